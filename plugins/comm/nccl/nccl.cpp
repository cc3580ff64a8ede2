// The `nccl` transport (loom.comm/1): collectives on CUDA memory over NCCL, stream-ordered on
// the stream each call passes (NULL: the legacy default stream).
//
// Setup: rank 0's ncclUniqueId reaches every rank through the host's bootstrap allgather;
// the communicator is created non-blocking (ncclConfig_t.blocking = 0) and polled with a
// deadline, so a rank that never joins makes the others fail with DEADLINE_EXCEEDED after
// timeout_s instead of hanging; the communicator is then aborted. Every later NCCL call is
// polled the same way.
//
// Process groups: split is ncclCommSplit on this communicator (non-blocking, polled with the
// same deadline); the sub-communicator owns its own ncclComm_t on the same device, so it
// does not depend on the parent once made (the ABI still asks callers to destroy it first).
//
// Byte counters hold the volumes of NCCL's ring algorithms (NCCL does not report what it
// actually moved): allreduce 2 (p - 1) / p of the tensor each way, allgather (p - 1) blocks,
// all_to_all everything but the own block, broadcast the tensor once per non-root rank.
#include <loom/sdk.hpp>
#include <loom/sdk/collective_queue.hpp>
#include <loom/sdk/cuda.hpp>
#include <loom/sdk/kinds/comm.hpp>

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

using loom::sdk::Context;
using loom::sdk::Error;
using Clock = std::chrono::steady_clock;

std::string cuda_error(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

// A sub-communicator ncclCommSplit made, on its way to the Nccl that will own it; aborted
// when nobody takes it.
struct NcclSplit {
  NcclSplit() = default;
  NcclSplit(NcclSplit&& o) noexcept
      : comm(std::exchange(o.comm, nullptr)),
        rank(o.rank),
        size(o.size),
        device(o.device),
        timeout_s(o.timeout_s) {}
  NcclSplit& operator=(NcclSplit&&) = delete;
  NcclSplit(const NcclSplit&) = delete;
  NcclSplit& operator=(const NcclSplit&) = delete;
  ~NcclSplit() {
    if (comm != nullptr) (void)ncclCommAbort(comm);
  }
  ncclComm_t comm = nullptr;
  int rank = 0;
  int size = 1;
  int device = 0;
  double timeout_s = 300.0;
};

class Nccl : public loom::sdk::Comm {
 public:
  static loom::sdk::Schema schema() {
    using namespace loom::sdk;
    return {
        Int("device", -1, "CUDA device of this rank; -1 = the rank's local rank.").range(-1, 1024),
        Float("timeout_s", 300.0,
              "Seconds communicator creation or a call waits for NCCL before failing with "
              "DEADLINE_EXCEEDED (the communicator is aborted then).")
            .range(0.001, 1e6),
    };
  }

  explicit Nccl(Context& ctx)
      : ctx_(ctx),
        rank_(ctx.rank()),
        size_(ctx.world_size()),
        timeout_s_(ctx.get_float("timeout_s")) {
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count <= 0) {
      (void)cudaGetLastError();  // clear the sticky error of a machine without a driver
      throw Error(LOOM_ERR_UNAVAILABLE,
                  std::string("nccl: no CUDA device (") +
                      (e != cudaSuccess ? cuda_error(e) : std::string("0 devices")) + ")");
    }
    const int64_t asked = ctx.get_int("device");
    device_ = asked >= 0 ? static_cast<int>(asked) : ctx.local_rank();
    if (device_ >= count) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  "nccl: device " + std::to_string(device_) + " does not exist (this machine has " +
                      std::to_string(count) + "); set `device` or launch fewer ranks per machine");
    }
    // The rank's device for communicator creation only; the caller's is current again after.
    const loom::sdk::CudaDeviceGuard on_device(device_);

    ncclUniqueId id{};
    if (rank_ == 0) check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    std::vector<ncclUniqueId> ids(static_cast<std::size_t>(size_));
    ctx_.bootstrap_allgather(&id, sizeof(id), ids.data());
    id = ids[0];

    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const ncclResult_t r = ncclCommInitRankConfig(&comm_, size_, id, rank_, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      comm_ = nullptr;
      check_nccl(r, "ncclCommInitRankConfig");
    }
    try {
      wait_comm("communicator creation");
      check_cuda(cudaMalloc(&scratch_, sizeof(float)), "cudaMalloc");
    } catch (...) {
      release(true);
      throw;
    }
  }

  // A sub-communicator from split: takes over the ncclComm_t.
  Nccl(Context& ctx, NcclSplit&& sub)
      : ctx_(ctx),
        rank_(sub.rank),
        size_(sub.size),
        timeout_s_(sub.timeout_s),
        device_(sub.device),
        comm_(std::exchange(sub.comm, nullptr)) {
    const loom::sdk::CudaDeviceGuard on_device(device_);
    try {
      check_cuda(cudaMalloc(&scratch_, sizeof(float)), "cudaMalloc");
    } catch (...) {
      release(true);
      throw;
    }
  }

  ~Nccl() {
    queue_.stop();
    release(broken_);
  }
  Nccl(const Nccl&) = delete;
  Nccl& operator=(const Nccl&) = delete;

  int32_t rank() const { return rank_; }
  int32_t size() const { return size_; }
  bool supports_device(DLDevice d) const { return loom::sdk::is_cuda(d) && d.device_id == device_; }
  loom::sdk::NativeHandle native_handle() const { return {"nccl", comm_}; }

  void stats(loom_comm_stats& out) const {
    out.bytes_sent = bytes_sent_.load(std::memory_order_relaxed);
    out.bytes_received = bytes_received_.load(std::memory_order_relaxed);
    out.rounds = rounds_.load(std::memory_order_relaxed);
  }

  // NCCL calls only queue work on the call's stream: a started collective is queued at once
  // on the caller's thread, and its request is finished when start returns (stream-ordered).
  loom::sdk::CollectiveQueue& collective_queue() { return queue_; }

  void reduce_scatter(const loom_reduce_scatter_args& a) {
    const DLTensor& recv = device_tensor(a.recv, "reduce_scatter recv");
    const DLTensor& send = device_tensor(a.send, "reduce_scatter send");
    const ncclDataType_t dt = reduce_dtype(recv);
    const ncclRedOp_t op = reduce_op(a.op);
    loom::sdk::expect_dtype(send, recv.dtype, "reduce_scatter send");
    const auto n = static_cast<std::size_t>(loom::sdk::numel(recv));
    loom::sdk::expect_numel(send, static_cast<int64_t>(n) * size_, "reduce_scatter send");
    usable();
    call("reduce_scatter", [&] {
      return ncclReduceScatter(loom::sdk::data_as<const char>(send), loom::sdk::data_as<char>(recv),
                               n, dt, op, comm_, stream(a.stream));
    });
    const uint64_t bytes = n * loom::sdk::element_bytes(recv.dtype);
    count(bytes * (size_ - 1), bytes * (size_ - 1));
  }

  void allreduce(const loom_allreduce_args& a) {
    const DLTensor& recv = device_tensor(a.recv, "allreduce recv");
    const ncclDataType_t dt = reduce_dtype(recv);
    const ncclRedOp_t op = reduce_op(a.op);
    const void* send = loom::sdk::data_as<char>(recv);
    if (a.send != nullptr) {
      const DLTensor& s = device_tensor(a.send, "allreduce send");
      loom::sdk::expect_dtype(s, recv.dtype, "allreduce send");
      loom::sdk::expect_numel(s, loom::sdk::numel(recv), "allreduce send");
      send = loom::sdk::data_as<const char>(s);
    }
    usable();
    const auto n = static_cast<std::size_t>(loom::sdk::numel(recv));
    call("allreduce", [&] {
      return ncclAllReduce(send, loom::sdk::data_as<char>(recv), n, dt, op, comm_,
                           stream(a.stream));
    });
    const uint64_t bytes = n * loom::sdk::element_bytes(recv.dtype);
    count(bytes * 2 * (size_ - 1) / size_, bytes * 2 * (size_ - 1) / size_);
  }

  void allgather(const loom_allgather_args& a) {
    const DLTensor& send = device_tensor(a.send, "allgather send");
    const DLTensor& recv = device_tensor(a.recv, "allgather recv");
    const std::size_t es = byte_dtype(send, "allgather send");
    loom::sdk::expect_dtype(recv, send.dtype, "allgather recv");
    const int64_t n = loom::sdk::numel(send);
    loom::sdk::expect_numel(recv, n * size_, "allgather recv");
    usable();
    const std::size_t bytes = static_cast<std::size_t>(n) * es;
    call("allgather", [&] {
      return ncclAllGather(loom::sdk::data_as<const char>(send), loom::sdk::data_as<char>(recv),
                           bytes, ncclUint8, comm_, stream(a.stream));
    });
    count(bytes * (size_ - 1), bytes * (size_ - 1));
  }

  void all_to_all(const loom_all_to_all_args& a) {
    const DLTensor& send = device_tensor(a.send, "all_to_all send");
    const DLTensor& recv = device_tensor(a.recv, "all_to_all recv");
    const std::size_t es = byte_dtype(send, "all_to_all send");
    loom::sdk::expect_dtype(recv, send.dtype, "all_to_all recv");
    if ((a.send_counts == nullptr) != (a.recv_counts == nullptr)) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  "all_to_all: send_counts and recv_counts must both be set or both be NULL");
    }
    const auto p = static_cast<std::size_t>(size_);
    const int64_t ns = loom::sdk::numel(send);
    const int64_t nr = loom::sdk::numel(recv);
    std::vector<int64_t> sc(p);
    std::vector<int64_t> rc(p);
    if (a.send_counts == nullptr) {
      if (ns % size_ != 0) {
        throw Error(LOOM_ERR_INVALID_ARGUMENT, "all_to_all with equal splits: send has " +
                                                   std::to_string(ns) +
                                                   " elements, not a multiple of the ranks");
      }
      loom::sdk::expect_numel(recv, ns, "all_to_all recv");
      for (std::size_t i = 0; i < p; ++i) sc[i] = rc[i] = ns / size_;
    } else {
      int64_t ts = 0;
      int64_t tr = 0;
      for (std::size_t i = 0; i < p; ++i) {
        if (a.send_counts[i] < 0 || a.recv_counts[i] < 0) {
          throw Error(LOOM_ERR_INVALID_ARGUMENT, "all_to_all: negative count");
        }
        sc[i] = a.send_counts[i];
        rc[i] = a.recv_counts[i];
        ts += sc[i];
        tr += rc[i];
      }
      if (ts > ns || tr > nr) {
        throw Error(LOOM_ERR_INVALID_ARGUMENT, "all_to_all: the counts exceed the tensors");
      }
    }
    usable();
    const char* in = loom::sdk::data_as<const char>(send);
    char* out = loom::sdk::data_as<char>(recv);
    uint64_t sent = 0;
    uint64_t received = 0;
    call("all_to_all", [&] {
      ncclResult_t r = ncclGroupStart();
      if (r != ncclSuccess) return r;
      std::size_t so = 0;
      std::size_t ro = 0;
      for (std::size_t i = 0; i < p; ++i) {
        const std::size_t sb = static_cast<std::size_t>(sc[i]) * es;
        const std::size_t rb = static_cast<std::size_t>(rc[i]) * es;
        if (sb != 0)
          r = ncclSend(in + so, sb, ncclUint8, static_cast<int>(i), comm_, stream(a.stream));
        if (r == ncclSuccess && rb != 0) {
          r = ncclRecv(out + ro, rb, ncclUint8, static_cast<int>(i), comm_, stream(a.stream));
        }
        if (r != ncclSuccess && r != ncclInProgress) break;
        if (static_cast<int>(i) != rank_) {
          sent += sb;
          received += rb;
        }
        so += sb;
        ro += rb;
      }
      const ncclResult_t end = ncclGroupEnd();
      return r != ncclSuccess && r != ncclInProgress ? r : end;
    });
    count(sent, received);
  }

  void broadcast(const loom_broadcast_args& a) {
    const DLTensor& t = device_tensor(a.tensor, "broadcast tensor");
    const std::size_t es = byte_dtype(t, "broadcast tensor");
    if (a.root < 0 || a.root >= size_) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT, "broadcast root " + std::to_string(a.root) +
                                                 " is not a rank of " + std::to_string(size_));
    }
    usable();
    const std::size_t bytes = static_cast<std::size_t>(loom::sdk::numel(t)) * es;
    char* buf = loom::sdk::data_as<char>(t);
    call("broadcast", [&] {
      return ncclBroadcast(buf, buf, bytes, ncclUint8, a.root, comm_, stream(a.stream));
    });
    // A chain: every rank but the last forwards the tensor once, every rank but the root
    // receives it once.
    count(rank_ == (a.root + size_ - 1) % size_ ? 0 : bytes, rank_ == a.root ? 0 : bytes);
  }

  // Collective over this communicator: ncclCommSplit, then both it and the new one polled
  // until done. NCCL_SPLIT_NOCOLOR for a negative color (no sub-communicator).
  std::optional<NcclSplit> split(int32_t color, int32_t key) {
    usable();
    const loom::sdk::CudaDeviceGuard on_device(device_);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    NcclSplit sub;
    sub.device = device_;
    sub.timeout_s = timeout_s_;
    const ncclResult_t r =
        ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &sub.comm, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      if (sub.comm != nullptr) (void)ncclCommAbort(std::exchange(sub.comm, nullptr));
      broken_ = true;  // the other ranks are inside the split
      check_nccl(r, "ncclCommSplit");
    }
    wait_comm("split");
    rounds_.fetch_add(1, std::memory_order_relaxed);
    if (color < 0) return std::nullopt;
    if (sub.comm == nullptr) {
      throw Error(LOOM_ERR_INTERNAL,
                  "nccl: ncclCommSplit gave no communicator for color " + std::to_string(color));
    }
    wait_other(sub.comm, "the split's new communicator");
    check_nccl(ncclCommUserRank(sub.comm, &sub.rank), "ncclCommUserRank");
    check_nccl(ncclCommCount(sub.comm, &sub.size), "ncclCommCount");
    return std::optional<NcclSplit>(std::move(sub));
  }

  void barrier(void* s) {
    usable();
    call("barrier", [&] {
      return ncclAllReduce(scratch_, scratch_, 1, ncclFloat32, ncclSum, comm_, stream(s));
    });
    // Stream-ordered like every other call: the barrier completes on `s`.
    count(0, 0);
  }

 private:
  static cudaStream_t stream(void* s) { return static_cast<cudaStream_t>(s); }

  void check_cuda(cudaError_t e, const char* what) const {
    if (e != cudaSuccess) {
      throw Error(LOOM_ERR_UNAVAILABLE, std::string("nccl: ") + what + " failed: " + cuda_error(e));
    }
  }
  static void check_nccl(ncclResult_t r, const char* what) {
    if (r != ncclSuccess && r != ncclInProgress) {
      throw Error(r == ncclInvalidArgument || r == ncclInvalidUsage ? LOOM_ERR_INVALID_ARGUMENT
                                                                    : LOOM_ERR_UNAVAILABLE,
                  std::string("nccl: ") + what + " failed: " + ncclGetErrorString(r));
    }
  }

  // Polls the communicator's asynchronous state until it leaves ncclInProgress.
  void wait_comm(const char* what) {
    const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s_);
    for (;;) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
      if (r != ncclSuccess) check_nccl(r, "ncclCommGetAsyncError");
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) {
        broken_ = true;
        check_nccl(state, what);
      }
      if (Clock::now() > deadline) {
        broken_ = true;
        throw Error(LOOM_ERR_DEADLINE_EXCEEDED,
                    std::string("nccl: ") + what + " did not finish within timeout_s = " +
                        std::to_string(timeout_s_) + " s on rank " + std::to_string(rank_) +
                        " (did a rank fail or never join?)");
      }
      std::this_thread::yield();
    }
  }

  // Polls a communicator this instance does not own yet (a split's result) until it leaves
  // ncclInProgress.
  void wait_other(ncclComm_t comm, const char* what) const {
    const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s_);
    for (;;) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
      if (r != ncclSuccess) check_nccl(r, "ncclCommGetAsyncError");
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) check_nccl(state, what);
      if (Clock::now() > deadline) {
        throw Error(LOOM_ERR_DEADLINE_EXCEEDED,
                    std::string("nccl: ") + what + " was not ready within timeout_s = " +
                        std::to_string(timeout_s_) + " s on rank " + std::to_string(rank_));
      }
      std::this_thread::yield();
    }
  }

  template <class Fn>
  void call(const char* what, Fn&& fn) {
    const loom::sdk::CudaDeviceGuard on_device(device_);
    const ncclResult_t r = fn();
    if (r != ncclSuccess && r != ncclInProgress) {
      broken_ = true;
      check_nccl(r, what);
    }
    if (r == ncclInProgress) wait_comm(what);
    rounds_.fetch_add(1, std::memory_order_relaxed);
  }

  void count(uint64_t sent, uint64_t received) {
    bytes_sent_.fetch_add(sent, std::memory_order_relaxed);
    bytes_received_.fetch_add(received, std::memory_order_relaxed);
  }

  void usable() const {
    if (broken_) {
      throw Error(LOOM_ERR_FAILED_PRECONDITION,
                  "nccl: the communicator failed earlier and was aborted; open a new session");
    }
  }

  const DLTensor& device_tensor(const DLTensor* t, const char* what) const {
    const DLTensor& x = loom::sdk::expect_tensor(t, what);
    if (!loom::sdk::is_cuda(x.device)) {
      throw Error(LOOM_ERR_UNIMPLEMENTED,
                  std::string(what) + " is on " + loom::sdk::device_string(x.device) +
                      ": the nccl transport moves CUDA memory only (use ucx for host memory)");
    }
    if (x.device.device_id != device_) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  std::string(what) + " is on " + loom::sdk::device_string(x.device) +
                      " but this rank's communicator is on cuda:" + std::to_string(device_));
    }
    loom::sdk::expect_contiguous(x, what);
    return x;
  }

  static ncclDataType_t reduce_dtype(const DLTensor& t) {
    if (loom::sdk::is_fp32(t)) return ncclFloat32;
    if (loom::sdk::is_fp16(t)) return ncclFloat16;
    if (loom::sdk::is_bf16(t)) return ncclBfloat16;
    throw Error(LOOM_ERR_UNIMPLEMENTED, "allreduce dtype " + loom::sdk::dtype_string(t.dtype) +
                                            ": nccl here reduces float32, float16, bfloat16");
  }

  static ncclRedOp_t reduce_op(int32_t op) {
    switch (op) {
      case LOOM_REDUCE_SUM:
        return ncclSum;
      case LOOM_REDUCE_AVG:
        return ncclAvg;
      case LOOM_REDUCE_MAX:
        return ncclMax;
      case LOOM_REDUCE_MIN:
        return ncclMin;
      default:
        throw Error(LOOM_ERR_INVALID_ARGUMENT,
                    "allreduce op " + std::to_string(op) + " is not a loom_reduce_op");
    }
  }

  static std::size_t byte_dtype(const DLTensor& t, const char* what) {
    const std::size_t es = loom::sdk::element_bytes(t.dtype);
    if (es == 0 || t.dtype.bits % 8 != 0) {
      throw Error(LOOM_ERR_UNIMPLEMENTED, std::string(what) + " has dtype " +
                                              loom::sdk::dtype_string(t.dtype) +
                                              ": nccl moves whole-byte element types only");
    }
    return es;
  }

  void release(bool abort) noexcept {
    // On the rank's device, and back to the caller's after (by hand: this cannot throw).
    int caller_device = -1;
    const bool restore = cudaGetDevice(&caller_device) == cudaSuccess && caller_device != device_;
    (void)cudaSetDevice(device_);
    release_on_device(abort);
    if (restore) (void)cudaSetDevice(caller_device);
  }

  void release_on_device(bool abort) noexcept {
    if (scratch_ != nullptr) {
      (void)cudaFree(scratch_);
      scratch_ = nullptr;
    }
    if (comm_ == nullptr) return;
    if (!abort) {
      // Finalize flushes outstanding work; polled with the deadline, aborted if it stalls.
      const ncclResult_t r = ncclCommFinalize(comm_);
      ncclResult_t state = r;
      const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s_);
      while (state == ncclInProgress && Clock::now() < deadline) {
        std::this_thread::yield();
        if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) state = ncclInternalError;
      }
      abort = state != ncclSuccess;
    }
    if (abort) {
      (void)ncclCommAbort(comm_);
    } else {
      (void)ncclCommDestroy(comm_);
    }
    comm_ = nullptr;
  }

  Context& ctx_;
  int rank_;
  int size_;
  double timeout_s_;
  int device_ = 0;
  ncclComm_t comm_ = nullptr;
  float* scratch_ = nullptr;
  bool broken_ = false;
  std::atomic<uint64_t> bytes_sent_{0};
  std::atomic<uint64_t> bytes_received_{0};
  std::atomic<uint64_t> rounds_{0};
  loom::sdk::CollectiveQueue queue_{loom::sdk::CollectiveQueue::Mode::inline_calls};
};

}  // namespace

LOOM_PLUGIN("nccl", "1.0.0", "Collectives on CUDA memory over NCCL, on the caller's stream",
            loom::sdk::factory<Nccl>());
