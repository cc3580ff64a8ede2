// thread_comm: a test-only loom.comm/1 transport whose ranks are threads of one process.
//
// What it is for: running multi-rank code (the 1-bit optimizers' own communication, the
// compressed allreduce, anything that takes a manifest-referenced comm) with 2-4 ranks
// without mpirun, and on CUDA tensors on a machine with a single GPU, where NCCL refuses
// two ranks on one device. Each thread opens its own session with a manifest such as
//
//   [comm.c]
//   plugin = "thread_comm"
//   world = "t1"      # ranks of one world rendezvous by this name
//   rank = 2
//   size = 4
//   timeout_s = 30
//
// How it works: a process-global registry (under a mutex) maps world names to worlds. The
// first rank to arrive creates the world; the constructor waits until all `size` ranks
// have joined (or fails: DEADLINE_EXCEEDED after timeout_s naming the missing ranks;
// INVALID_ARGUMENT on every rank when two ranks disagree on `size` or a rank joins twice).
// The world is removed when its last instance is destroyed, so a name can be reused by a
// later test once every instance of the earlier world is gone; a world whose rendezvous
// failed on a size disagreement or a duplicate rank stays registered (failing every later
// open of that name in the process), so that every rank fails the same way whatever the
// order of arrival.
//
// Every collective: each rank copies its contribution into a host buffer of its own in the
// world (device memory: cudaMemcpyAsync on the caller's stream + cudaStreamSynchronize),
// publishes a description of the call (collective, op, dtype, element counts), and waits
// until every rank has published the same call number. Every rank then checks the same
// descriptions, so a disagreement (different sizes, ops, dtypes, roots, or collectives)
// fails with INVALID_ARGUMENT on every rank at once, and a rank's own argument error is
// reported by every rank. Then each rank builds its own output from the published buffers.
// Buffers are double-buffered by call parity, which is safe because no rank can start call
// k + 2 before every rank has finished reading call k (it needs their call k + 1).
//
// Reductions (sum, avg, max, min on float32, float16, bfloat16) are done in rank order,
// accumulated in float32 and rounded once to the tensor's dtype (avg divides the float32
// sum by size before rounding), so every rank gets identical bits. max/min order +0 above
// -0 and propagate NaN, as the ucx transport does.
//
// Stats (per rank, p ranks, B = bytes of one rank's tensor) count what a ring / pairwise
// transport would move, not the copies this plugin makes:
//   allreduce   sent = received = floor(2 (p - 1) B / p)   (ring reduce-scatter + allgather)
//   allgather   sent = received = (p - 1) B                  (ring)
//   all_to_all  sent = bytes of send_counts to the other ranks, received = of recv_counts
//   broadcast   a chain from the root: every rank but the last in the chain sends B, every
//               rank but the root receives B
//   barrier     no bytes
// `rounds` counts the collective calls that completed on this rank (failed calls count
// nothing); a world of one moves no bytes.
//
// Limits: test-only (never installed); one process; whole-byte dtypes for the data moving
// collectives; contiguous tensors; speed is not a goal (every rank reduces the whole tensor
// and device data goes through host memory). After a timeout, or a peer that destroyed its
// instance mid-call, the ranks no longer agree on the call sequence and the instance
// refuses further collectives (FAILED_PRECONDITION); argument errors and disagreements
// leave it usable.
#include <loom/sdk.hpp>
#include <loom/sdk/collective_queue.hpp>
#include <loom/sdk/kinds/comm.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/reduce.hpp"

#if defined(LOOM_THREAD_COMM_CUDA)
#include <cuda_runtime.h>
#endif

namespace {

using loom::sdk::Context;
using loom::sdk::Error;
using Clock = std::chrono::steady_clock;
namespace hf = loom::plugins::reduce_ops;

enum class Kind { kAllreduce = 1, kAllgather, kAllToAll, kBroadcast, kBarrier };

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kAllreduce:
      return "allreduce";
    case Kind::kAllgather:
      return "allgather";
    case Kind::kAllToAll:
      return "all_to_all";
    case Kind::kBroadcast:
      return "broadcast";
    case Kind::kBarrier:
      return "barrier";
  }
  return "?";
}

std::string seconds_string(double s) {
  std::string t = std::to_string(s);
  while (!t.empty() && t.back() == '0') t.pop_back();
  if (!t.empty() && t.back() == '.') t.pop_back();
  return t;
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (i != 0) s += ", ";
    s += std::to_string(ranks[i]);
  }
  return s;
}

// One rank's side of one collective call, as published to the world.
struct Call {
  uint64_t seq = 0;
  Kind kind = Kind::kBarrier;
  int32_t op = 0;
  int32_t root = 0;
  DLDataType dtype{};
  int64_t numel = 0;                 // allreduce, broadcast: the tensor; allgather: per rank
  std::vector<int64_t> send_counts;  // all_to_all, elements to each rank
  std::vector<int64_t> recv_counts;  // all_to_all, elements from each rank
  loom_code error_code = LOOM_OK;    // this rank's own failure: every rank reports it
  std::string error;
  std::vector<std::byte> data;  // this rank's contribution, on the host

  std::string describe() const {
    std::string s = kind_name(kind);
    switch (kind) {
      case Kind::kAllreduce:
        s += std::string("(") + loom::sdk::reduce_op_string(op) + ", " +
             loom::sdk::dtype_string(dtype) + ", " + std::to_string(numel) + " elements)";
        break;
      case Kind::kAllgather:
        s += "(" + loom::sdk::dtype_string(dtype) + ", " + std::to_string(numel) +
             " elements per rank)";
        break;
      case Kind::kAllToAll:
        s += "(" + loom::sdk::dtype_string(dtype) + ")";
        break;
      case Kind::kBroadcast:
        s += "(root " + std::to_string(root) + ", " + loom::sdk::dtype_string(dtype) + ", " +
             std::to_string(numel) + " elements)";
        break;
      case Kind::kBarrier:
        break;
    }
    return s;
  }
};

struct World {
  World(std::string n, int s)
      : name(std::move(n)),
        size(s),
        joined(static_cast<std::size_t>(s), false),
        left(static_cast<std::size_t>(s), false),
        slots(static_cast<std::size_t>(s)) {}

  const std::string name;
  const int size;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<bool> joined;
  std::vector<bool> left;
  int joined_count = 0;
  int live = 0;
  std::string poisoned;  // set when the ranks' configurations disagree before all joined
  std::vector<std::array<Call, 2>> slots;  // [rank][seq % 2]
};

// Both live until exit: instances may be destroyed from static destructors.
std::mutex& registry_mutex() {
  static auto* m = new std::mutex();
  return *m;
}
std::map<std::string, std::shared_ptr<World>>& registry() {
  static auto* r = new std::map<std::string, std::shared_ptr<World>>();
  return *r;
}

// ---- memory: host tensors are read and written in place; CUDA tensors through the
// caller's stream.

#if defined(LOOM_THREAD_COMM_CUDA)
void check_cuda(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) {
    throw Error(LOOM_ERR_UNAVAILABLE, "thread_comm: " + what + ": " + cudaGetErrorString(e));
  }
}

// Makes `device` current for the scope (the stream and pointers belong to it).
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check_cuda(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceScope() {
    int now = previous_;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
};

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}
#endif

bool device_supported(DLDevice d) {
  if (loom::sdk::is_cpu(d)) return true;
#if defined(LOOM_THREAD_COMM_CUDA)
  if (loom::sdk::is_cuda(d)) return d.device_id >= 0 && d.device_id < cuda_device_count();
#endif
  return false;
}

// Copies `bytes` from tensor memory into host memory.
void read_tensor(const DLTensor& t, std::byte* dst, std::size_t bytes, void* stream) {
  if (bytes == 0) return;
  const auto* src = loom::sdk::data_as<const std::byte>(t);
  if (loom::sdk::is_cpu(t)) {
    std::memcpy(dst, src, bytes);
    return;
  }
#if defined(LOOM_THREAD_COMM_CUDA)
  const DeviceScope scope(t.device.device_id);
  auto* s = static_cast<cudaStream_t>(stream);
  check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s), "cudaMemcpyAsync D2H");
  check_cuda(cudaStreamSynchronize(s), "cudaStreamSynchronize");
#else
  (void)stream;
  throw Error(LOOM_ERR_INTERNAL, "thread_comm: device memory without CUDA");
#endif
}

// Copies `bytes` of host memory into tensor memory at byte `offset`.
void write_tensor(const DLTensor& t, std::size_t offset, const std::byte* src, std::size_t bytes,
                  void* stream) {
  if (bytes == 0) return;
  auto* dst = loom::sdk::data_as<std::byte>(t) + offset;
  if (loom::sdk::is_cpu(t)) {
    std::memmove(dst, src, bytes);
    return;
  }
#if defined(LOOM_THREAD_COMM_CUDA)
  const DeviceScope scope(t.device.device_id);
  auto* s = static_cast<cudaStream_t>(stream);
  check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s), "cudaMemcpyAsync H2D");
  check_cuda(cudaStreamSynchronize(s), "cudaStreamSynchronize");
#else
  (void)stream;
  throw Error(LOOM_ERR_INTERNAL, "thread_comm: device memory without CUDA");
#endif
}

// ---- reductions, accumulated in fp32 in rank order

float load(DLDataType d, const std::byte* p, std::size_t i) {
  if (d.bits == 32) {
    float v = 0;
    std::memcpy(&v, p + 4 * i, 4);
    return v;
  }
  uint16_t h = 0;
  std::memcpy(&h, p + 2 * i, 2);
  return d.code == kDLBfloat ? hf::bf16_to_f32(h) : hf::f16_to_f32(h);
}

void store(DLDataType d, std::byte* p, std::size_t i, float v) {
  if (d.bits == 32) {
    std::memcpy(p + 4 * i, &v, 4);
    return;
  }
  const uint16_t h = d.code == kDLBfloat ? hf::f32_to_bf16(v) : hf::f32_to_f16(v);
  std::memcpy(p + 2 * i, &h, 2);
}

template <hf::Op op>
void accumulate(std::vector<float>& acc, DLDataType d, const std::byte* in) {
  for (std::size_t i = 0; i < acc.size(); ++i) acc[i] = hf::combine<op>(acc[i], load(d, in, i));
}

class ThreadComm : public loom::sdk::Comm {
 public:
  static loom::sdk::Schema schema() {
    using namespace loom::sdk;
    return {
        String("world", "world",
               "Name of the world: the instances (one per thread) that open a thread_comm with "
               "the same name rendezvous and form one world."),
        Int("rank", 0, "This instance's rank in the world, 0 <= rank < size.").required().min(0),
        Int("size", 1, "Number of ranks; every rank of the world must give the same size.")
            .required()
            .range(1, 4096),
        Float("timeout_s", 60.0,
              "Seconds the constructor waits for every rank to join, and a collective for "
              "every rank to arrive, before failing with DEADLINE_EXCEEDED.")
            .range(0.001, 1e6),
    };
  }

  explicit ThreadComm(Context& ctx)
      : name_(ctx.get_string("world")),
        rank_(static_cast<int>(ctx.get_int("rank"))),
        size_(static_cast<int>(ctx.get_int("size"))),
        timeout_s_(ctx.get_float("timeout_s")) {
    if (rank_ < 0 || rank_ >= size_) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT, "thread_comm: rank " + std::to_string(rank_) +
                                                 " is not a rank of a world of " +
                                                 std::to_string(size_));
    }
    join();
  }

  ~ThreadComm() {
    queue_.stop();
    leave();
  }
  ThreadComm(const ThreadComm&) = delete;
  ThreadComm& operator=(const ThreadComm&) = delete;

  int32_t rank() const { return rank_; }
  int32_t size() const { return size_; }
  bool supports_device(DLDevice d) const { return device_supported(d); }
  // Non-blocking collectives (ABI 1.6) through the SDK's queue; no reduce_scatter of its own,
  // so callers exercise the SDK's fallback for transports without one.
  loom::sdk::CollectiveQueue& collective_queue() { return queue_; }

  void stats(loom_comm_stats& out) const {
    out.bytes_sent = bytes_sent_.load(std::memory_order_relaxed);
    out.bytes_received = bytes_received_.load(std::memory_order_relaxed);
    out.rounds = rounds_.load(std::memory_order_relaxed);
  }

  // ---------------------------------------------------------------- allreduce
  void allreduce(const loom_allreduce_args& a) {
    run(
        Kind::kAllreduce,
        [&](Call& c) {
          const DLTensor& recv = tensor(a.recv, "allreduce recv");
          if (!loom::sdk::is_fp32(recv) && !loom::sdk::is_fp16(recv) && !loom::sdk::is_bf16(recv)) {
            throw Error(LOOM_ERR_UNIMPLEMENTED,
                        "allreduce recv has dtype " + loom::sdk::dtype_string(recv.dtype) +
                            ": thread_comm reduces float32, float16 and bfloat16");
          }
          if (a.op < LOOM_REDUCE_SUM || a.op > LOOM_REDUCE_MIN) {
            throw Error(LOOM_ERR_INVALID_ARGUMENT,
                        "allreduce op " + std::to_string(a.op) + " is not a loom_reduce_op");
          }
          const DLTensor* src = &recv;
          if (a.send != nullptr) {
            src = &tensor(a.send, "allreduce send");
            loom::sdk::expect_dtype(*src, recv.dtype, "allreduce send");
            loom::sdk::expect_numel(*src, loom::sdk::numel(recv), "allreduce send");
          }
          c.op = a.op;
          c.dtype = recv.dtype;
          c.numel = loom::sdk::numel(recv);
          c.data.resize(loom::sdk::nbytes(recv));
          read_tensor(*src, c.data.data(), c.data.size(), a.stream);
        },
        [&](const std::vector<const Call*>& calls) {
          const Call& me = *calls[static_cast<std::size_t>(rank_)];
          const auto n = static_cast<std::size_t>(me.numel);
          std::vector<float> acc(n);
          for (std::size_t i = 0; i < n; ++i) acc[i] = load(me.dtype, calls[0]->data.data(), i);
          for (std::size_t r = 1; r < calls.size(); ++r) {
            const std::byte* in = calls[r]->data.data();
            switch (me.op) {
              case LOOM_REDUCE_MAX:
                accumulate<hf::Op::kMax>(acc, me.dtype, in);
                break;
              case LOOM_REDUCE_MIN:
                accumulate<hf::Op::kMin>(acc, me.dtype, in);
                break;
              default:
                accumulate<hf::Op::kSum>(acc, me.dtype, in);
                break;
            }
          }
          if (me.op == LOOM_REDUCE_AVG) {
            const auto p = static_cast<float>(size_);
            for (float& x : acc) x /= p;
          }
          std::vector<std::byte> out(me.data.size());
          for (std::size_t i = 0; i < n; ++i) store(me.dtype, out.data(), i, acc[i]);
          write_tensor(*a.recv, 0, out.data(), out.size(), a.stream);
          const auto p = static_cast<uint64_t>(size_);
          const uint64_t bytes = 2 * (p - 1) * out.size() / p;
          count(bytes, bytes);
        });
  }

  // ---------------------------------------------------------------- allgather
  void allgather(const loom_allgather_args& a) {
    run(
        Kind::kAllgather,
        [&](Call& c) {
          const DLTensor& send = tensor(a.send, "allgather send");
          const DLTensor& recv = tensor(a.recv, "allgather recv");
          byte_dtype(send, "allgather send");
          loom::sdk::expect_dtype(recv, send.dtype, "allgather recv");
          loom::sdk::expect_numel(recv, loom::sdk::numel(send) * size_, "allgather recv");
          c.dtype = send.dtype;
          c.numel = loom::sdk::numel(send);
          c.data.resize(loom::sdk::nbytes(send));
          read_tensor(send, c.data.data(), c.data.size(), a.stream);
        },
        [&](const std::vector<const Call*>& calls) {
          const std::size_t block = calls[static_cast<std::size_t>(rank_)]->data.size();
          if (loom::sdk::is_cpu(*a.recv)) {
            for (std::size_t r = 0; r < calls.size(); ++r) {
              write_tensor(*a.recv, r * block, calls[r]->data.data(), block, a.stream);
            }
          } else {
            std::vector<std::byte> out(block * calls.size());
            for (std::size_t r = 0; r < calls.size(); ++r) {
              if (block != 0) std::memcpy(out.data() + r * block, calls[r]->data.data(), block);
            }
            write_tensor(*a.recv, 0, out.data(), out.size(), a.stream);
          }
          const uint64_t bytes = static_cast<uint64_t>(size_ - 1) * block;
          count(bytes, bytes);
        });
  }

  // ---------------------------------------------------------------- all_to_all
  void all_to_all(const loom_all_to_all_args& a) {
    run(
        Kind::kAllToAll,
        [&](Call& c) {
          const DLTensor& send = tensor(a.send, "all_to_all send");
          const DLTensor& recv = tensor(a.recv, "all_to_all recv");
          byte_dtype(send, "all_to_all send");
          loom::sdk::expect_dtype(recv, send.dtype, "all_to_all recv");
          if ((a.send_counts == nullptr) != (a.recv_counts == nullptr)) {
            throw Error(LOOM_ERR_INVALID_ARGUMENT,
                        "all_to_all: send_counts and recv_counts must both be set or both be "
                        "NULL");
          }
          const auto p = static_cast<std::size_t>(size_);
          const int64_t ns = loom::sdk::numel(send);
          const int64_t nr = loom::sdk::numel(recv);
          if (a.send_counts == nullptr) {
            if (ns % size_ != 0) {
              throw Error(LOOM_ERR_INVALID_ARGUMENT, "all_to_all with equal splits: send has " +
                                                         std::to_string(ns) +
                                                         " elements, not a multiple of the " +
                                                         std::to_string(size_) + " ranks");
            }
            loom::sdk::expect_numel(recv, ns, "all_to_all recv");
            c.send_counts.assign(p, ns / size_);
            c.recv_counts.assign(p, ns / size_);
          } else {
            c.send_counts.assign(a.send_counts, a.send_counts + p);
            c.recv_counts.assign(a.recv_counts, a.recv_counts + p);
            int64_t ts = 0;
            int64_t tr = 0;
            for (std::size_t i = 0; i < p; ++i) {
              if (c.send_counts[i] < 0 || c.recv_counts[i] < 0) {
                throw Error(LOOM_ERR_INVALID_ARGUMENT,
                            "all_to_all: negative count for rank " + std::to_string(i));
              }
              ts += c.send_counts[i];
              tr += c.recv_counts[i];
            }
            if (ts > ns || tr > nr) {
              throw Error(LOOM_ERR_INVALID_ARGUMENT,
                          "all_to_all: the counts add up to " + std::to_string(ts) + " sent / " +
                              std::to_string(tr) + " received elements, but send has " +
                              std::to_string(ns) + " and recv " + std::to_string(nr));
            }
          }
          int64_t total = 0;
          for (const int64_t x : c.send_counts) total += x;
          c.dtype = send.dtype;
          c.data.resize(static_cast<std::size_t>(total) * loom::sdk::element_bytes(send.dtype));
          read_tensor(send, c.data.data(), c.data.size(), a.stream);
        },
        [&](const std::vector<const Call*>& calls) {
          const auto me = static_cast<std::size_t>(rank_);
          const std::size_t es = loom::sdk::element_bytes(calls[me]->dtype);
          const std::vector<int64_t>& rc = calls[me]->recv_counts;
          std::vector<std::byte> out;
          uint64_t sent = 0;
          uint64_t received = 0;
          for (std::size_t r = 0; r < calls.size(); ++r) {
            const Call& from = *calls[r];
            std::size_t offset = 0;  // where rank r's elements for me start in its send
            for (std::size_t j = 0; j < me; ++j)
              offset += static_cast<std::size_t>(from.send_counts[j]);
            const std::size_t bytes = static_cast<std::size_t>(rc[r]) * es;
            out.insert(out.end(), from.data.begin() + static_cast<std::ptrdiff_t>(offset * es),
                       from.data.begin() + static_cast<std::ptrdiff_t>(offset * es + bytes));
            if (r != me) {
              received += bytes;
              sent += static_cast<uint64_t>(calls[me]->send_counts[r]) * es;
            }
          }
          write_tensor(*a.recv, 0, out.data(), out.size(), a.stream);
          count(sent, received);
        });
  }

  // ---------------------------------------------------------------- broadcast
  void broadcast(const loom_broadcast_args& a) {
    run(
        Kind::kBroadcast,
        [&](Call& c) {
          const DLTensor& t = tensor(a.tensor, "broadcast tensor");
          byte_dtype(t, "broadcast tensor");
          if (a.root < 0 || a.root >= size_) {
            throw Error(LOOM_ERR_INVALID_ARGUMENT, "broadcast root " + std::to_string(a.root) +
                                                       " is not a rank of " +
                                                       std::to_string(size_));
          }
          c.root = a.root;
          c.dtype = t.dtype;
          c.numel = loom::sdk::numel(t);
          if (a.root == rank_) {
            c.data.resize(loom::sdk::nbytes(t));
            read_tensor(t, c.data.data(), c.data.size(), a.stream);
          }
        },
        [&](const std::vector<const Call*>& calls) {
          const Call& root = *calls[static_cast<std::size_t>(a.root)];
          const uint64_t bytes = root.data.size();
          if (a.root != rank_) write_tensor(*a.tensor, 0, root.data.data(), bytes, a.stream);
          const int k = (rank_ - a.root + size_) % size_;  // position in the chain
          count(k < size_ - 1 ? bytes : 0, k > 0 ? bytes : 0);
        });
  }

  // ---------------------------------------------------------------- barrier
  void barrier(void* stream) {
    run(
        Kind::kBarrier,
        [&](Call&) {
#if defined(LOOM_THREAD_COMM_CUDA)
          // The stream's earlier work is part of what the barrier orders.
          if (stream != nullptr) {
            check_cuda(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)),
                       "cudaStreamSynchronize");
          }
#else
          (void)stream;
#endif
        },
        [&](const std::vector<const Call*>&) { count(0, 0); });
  }

 private:
  // ---- validation

  static const DLTensor& tensor(const DLTensor* t, const char* what) {
    const DLTensor& x = loom::sdk::expect_tensor(t, what);
    if (!device_supported(x.device)) {
      throw Error(LOOM_ERR_UNIMPLEMENTED, std::string(what) + " is on " +
                                              loom::sdk::device_string(x.device) +
                                              ": thread_comm moves host memory"
#if defined(LOOM_THREAD_COMM_CUDA)
                                              " and memory of the CUDA devices this process sees"
#else
                                              " only (built without CUDA)"
#endif
      );
    }
    loom::sdk::expect_contiguous(x, what);
    if (loom::sdk::numel(x) != 0 && x.data == nullptr) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT, std::string(what) + " has no data");
    }
    return x;
  }

  static void byte_dtype(const DLTensor& t, const char* what) {
    if (loom::sdk::element_bytes(t.dtype) == 0 || t.dtype.bits % 8 != 0) {
      throw Error(LOOM_ERR_UNIMPLEMENTED, std::string(what) + " has dtype " +
                                              loom::sdk::dtype_string(t.dtype) +
                                              ": thread_comm moves whole-byte element types only");
    }
  }

  // ---- world membership

  std::string where() const { return "thread_comm world '" + name_ + "'"; }

  void join() {
    std::shared_ptr<World> w;
    {
      const std::lock_guard<std::mutex> reg_lock(registry_mutex());
      auto& reg = registry();
      auto it = reg.find(name_);
      if (it == reg.end()) {
        it = reg.emplace(name_, std::make_shared<World>(name_, size_)).first;
      }
      w = it->second;
      const std::lock_guard<std::mutex> lock(w->mu);
      const bool complete = w->joined_count == w->size;
      std::string problem;
      if (!w->poisoned.empty()) {
        problem = w->poisoned;
      } else if (w->size != size_) {
        problem = where() + ": rank " + std::to_string(rank_) + " says size " +
                  std::to_string(size_) + ", but the world was created with size " +
                  std::to_string(w->size) + " (every rank must give the same size)";
      } else if (w->joined[static_cast<std::size_t>(rank_)]) {
        problem = where() + ": rank " + std::to_string(rank_) +
                  " joined twice (each rank of a world must be opened once; a world's name "
                  "can be reused only after all its instances are destroyed)";
      }
      if (!problem.empty()) {
        // Ranks still waiting for the others would otherwise wait out their timeout.
        if (!complete && w->poisoned.empty()) {
          w->poisoned = problem;
          w->cv.notify_all();
        }
        throw Error(LOOM_ERR_INVALID_ARGUMENT, problem);
      }
      w->joined[static_cast<std::size_t>(rank_)] = true;
      ++w->joined_count;
      ++w->live;
      w->cv.notify_all();
      world_ = w;
    }
    // Wait for every rank, so that a missing or misconfigured rank fails here.
    std::optional<Error> failure;
    {
      std::unique_lock<std::mutex> lock(w->mu);
      const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s_);
      for (;;) {
        if (!w->poisoned.empty()) {
          failure.emplace(LOOM_ERR_INVALID_ARGUMENT, w->poisoned);
          break;
        }
        if (w->joined_count == w->size) break;
        if (w->cv.wait_until(lock, deadline) == std::cv_status::timeout &&
            w->joined_count < w->size && w->poisoned.empty()) {
          std::vector<int> missing;
          for (int r = 0; r < w->size; ++r) {
            if (!w->joined[static_cast<std::size_t>(r)]) missing.push_back(r);
          }
          failure.emplace(LOOM_ERR_DEADLINE_EXCEEDED, where() + ": rank " + std::to_string(rank_) +
                                                          " waited " + seconds_string(timeout_s_) +
                                                          " s (timeout_s) for rank(s) " +
                                                          rank_list(missing) + " to join");
          break;
        }
      }
    }
    if (failure) {
      leave();  // the destructor does not run when the constructor throws
      throw *failure;
    }
  }

  void leave() noexcept {
    if (!world_) return;
    std::shared_ptr<World> w = std::move(world_);
    world_.reset();
    const std::lock_guard<std::mutex> reg_lock(registry_mutex());
    {
      const std::lock_guard<std::mutex> lock(w->mu);
      --w->live;
      w->left[static_cast<std::size_t>(rank_)] = true;
      w->cv.notify_all();
      // A failed rendezvous stays registered, so that ranks arriving after the others have
      // given up fail the same way instead of starting a new world and timing out.
      if (w->live != 0 || !w->poisoned.empty()) return;
    }
    auto& reg = registry();
    auto it = reg.find(name_);
    if (it != reg.end() && it->second == w) reg.erase(it);
  }

  // ---- one collective

  void usable() const {
    if (!broken_.empty()) {
      throw Error(LOOM_ERR_FAILED_PRECONDITION,
                  where() +
                      ": an earlier collective failed and the ranks no longer agree on "
                      "the call sequence (" +
                      broken_ + "); open a new session");
    }
  }

  // describe(Call&) validates this rank's arguments and stages its contribution; finish()
  // builds this rank's output from every rank's published call, in rank order.
  template <class Describe, class Finish>
  void run(Kind kind, Describe&& describe, Finish&& finish) {
    usable();
    World& w = *world_;
    const uint64_t seq = ++seq_;
    Call mine;
    mine.seq = seq;
    mine.kind = kind;
    std::optional<Error> own;
    try {
      describe(mine);
    } catch (const Error& e) {
      own = e;
    } catch (const std::exception& e) {
      own.emplace(LOOM_ERR_INTERNAL, e.what());
    }
    if (own) {
      mine.error_code = own->code();
      mine.error = own->what();
      mine.data.clear();
    }
    std::vector<const Call*> calls(static_cast<std::size_t>(size_));
    {
      std::unique_lock<std::mutex> lock(w.mu);
      w.slots[static_cast<std::size_t>(rank_)][seq % 2] = std::move(mine);
      w.cv.notify_all();
      // Even a rank whose own arguments are wrong waits for the others: they may still be
      // reading its previous call's buffer, which its next call would overwrite.
      const std::string call = std::string(kind_name(kind)) + " #" + std::to_string(seq);
      const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s_);
      for (;;) {
        std::vector<int> missing;
        std::vector<int> gone;
        for (int r = 0; r < size_; ++r) {
          const auto ur = static_cast<std::size_t>(r);
          if (w.slots[ur][seq % 2].seq != seq) {
            missing.push_back(r);
            if (w.left[ur]) gone.push_back(r);
          }
        }
        if (missing.empty()) break;
        if (!gone.empty()) {
          broken_ = "rank(s) " + rank_list(gone) + " left";
          throw Error(LOOM_ERR_UNAVAILABLE,
                      where() + ": " + call + " on rank " + std::to_string(rank_) + ": rank(s) " +
                          rank_list(gone) + " destroyed their instance before making it");
        }
        if (Clock::now() >= deadline) {
          broken_ = call + " timed out";
          throw Error(LOOM_ERR_DEADLINE_EXCEEDED,
                      where() + ": " + call + " on rank " + std::to_string(rank_) + " waited " +
                          seconds_string(timeout_s_) + " s (timeout_s) for rank(s) " +
                          rank_list(missing) + " (did a rank skip the call, or stop?)");
        }
        w.cv.wait_until(lock, deadline);
      }
      for (int r = 0; r < size_; ++r) {
        calls[static_cast<std::size_t>(r)] = &w.slots[static_cast<std::size_t>(r)][seq % 2];
      }
    }
    // Every rank consumed the call, so an argument error leaves the ranks in step and the
    // instance usable.
    if (own) throw *own;
    // No lock from here: no rank rewrites these slots before every rank has published
    // call seq + 1, which this rank does only after returning.
    agree(calls, seq);
    finish(calls);
  }

  // Throws the same INVALID_ARGUMENT on every rank when the ranks' calls disagree.
  void agree(const std::vector<const Call*>& calls, uint64_t seq) const {
    const std::string head = where() + ", call #" + std::to_string(seq) + ": ";
    for (std::size_t r = 0; r < calls.size(); ++r) {
      if (calls[r]->error_code != LOOM_OK) {
        throw Error(calls[r]->error_code, head + "rank " + std::to_string(r) + "'s " +
                                              kind_name(calls[r]->kind) +
                                              " failed: " + calls[r]->error);
      }
    }
    const Call& c0 = *calls[0];
    bool same = true;
    for (const Call* c : calls) {
      same = same && c->kind == c0.kind && c->op == c0.op && c->root == c0.root &&
             c->dtype.code == c0.dtype.code && c->dtype.bits == c0.dtype.bits &&
             c->dtype.lanes == c0.dtype.lanes && c->numel == c0.numel;
    }
    if (!same) {
      std::string m = head + "the ranks disagree:";
      for (std::size_t r = 0; r < calls.size(); ++r) {
        m += (r == 0 ? " rank " : ", rank ") + std::to_string(r) + " " + calls[r]->describe();
      }
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  m + "; every rank must make the same collective call with the same op, "
                      "dtype, root and element count");
    }
    if (c0.kind == Kind::kAllToAll) {
      for (std::size_t i = 0; i < calls.size(); ++i) {
        for (std::size_t j = 0; j < calls.size(); ++j) {
          const int64_t s = calls[i]->send_counts[j];
          const int64_t r = calls[j]->recv_counts[i];
          if (s != r) {
            throw Error(LOOM_ERR_INVALID_ARGUMENT, head + "all_to_all: rank " + std::to_string(i) +
                                                       " sends " + std::to_string(s) +
                                                       " elements to rank " + std::to_string(j) +
                                                       ", which expects " + std::to_string(r));
          }
        }
      }
    }
  }

  void count(uint64_t sent, uint64_t received) {
    bytes_sent_.fetch_add(sent, std::memory_order_relaxed);
    bytes_received_.fetch_add(received, std::memory_order_relaxed);
    rounds_.fetch_add(1, std::memory_order_relaxed);
  }

  const std::string name_;
  const int rank_;
  const int size_;
  const double timeout_s_;
  std::shared_ptr<World> world_;
  uint64_t seq_ = 0;
  std::string broken_;
  std::atomic<uint64_t> bytes_sent_{0};
  std::atomic<uint64_t> bytes_received_{0};
  std::atomic<uint64_t> rounds_{0};
  loom::sdk::CollectiveQueue queue_;
};

}  // namespace

LOOM_PLUGIN("thread_comm", "0.1.0",
            "Test-only transport: the ranks are threads of one process (host and CUDA memory)",
            loom::sdk::factory<ThreadComm>());
