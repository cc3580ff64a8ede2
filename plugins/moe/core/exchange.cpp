// Expert parallelism over a loom.comm instance: see exchange.hpp.
//
// forward: one all_to_all of the rows (this rank's rows for rank d are contiguous, since they
// are grouped by global expert and rank d holds a contiguous range of experts), which lands
// them grouped by source rank, then by local expert; a permutation then groups them by local
// expert, then by source rank. reverse runs the permutation's inverse, then the all_to_all
// with the counts swapped. The counts themselves travel first, in plan(), so every rank knows
// how much it receives before any row moves: ranks with unequal token counts never wait for
// rows that do not come.
//
// Device rows: when the transport can use the device (supports_device2), the all_to_all runs
// on device buffers on the caller's stream and the permutation is a set of device-to-device
// copies on it; otherwise rows are copied to host memory (stream synchronised), exchanged and
// permuted there, and copied back (synchronised again before returning: the host buffers are
// reused by the next call).
#include <loom/moe/exchange.hpp>

#include <loom/sdk/status.hpp>
#include <loom/sdk/tensor.hpp>

#include <loom/sdk/comm.hpp>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>

#include <loom/sdk/no_cuda.hpp>

#include <loom/moe/exchange_cuda.hpp>

namespace loom::moe {
namespace {

using loom::sdk::Error;
using Ref = loom::sdk::InstanceRef<loom_comm_v1>;

[[noreturn]] void fail(loom_code code, const std::string& message) {
  throw Error(code, "moe exchange: " + message);
}

// A 1-D tensor of `n` elements of `dtype` over `data` (no copy).
struct Flat {
  int64_t n;
  DLTensor t{};
  Flat(const void* data, int64_t count, DLDataType dtype, DLDevice device) : n(count) {
    t.data = const_cast<void*>(data);
    t.device = device;
    t.ndim = 1;
    t.dtype = dtype;
    t.shape = &n;
    t.strides = nullptr;
    t.byte_offset = 0;
  }
  Flat(const Flat&) = delete;
  Flat& operator=(const Flat&) = delete;
};

constexpr DLDataType kBytes{kDLUInt, 8, 1};
constexpr DLDataType kInt64{kDLInt, 64, 1};
constexpr DLDataType kFloat32{kDLFloat, 32, 1};
constexpr DLDevice kHost{kDLCPU, 0};

// Copies between two buffers of one side: host memcpy, or a device-to-device copy on stream.
void copy_rows(void* dst, const void* src, std::size_t bytes, bool device, void* stream) {
  if (bytes == 0) return;
  if (!device) {
    std::memcpy(dst, src, bytes);
    return;
  }
  cuda::copy_on_device(dst, src, bytes, stream);
}

// Host <-> device copies of the staging path, each followed by a stream synchronisation.
void to_host(void* dst, const void* src, std::size_t bytes, void* stream) {
  cuda::copy_to_host(dst, src, bytes, stream);
}
void to_device(void* dst, const void* src, std::size_t bytes, void* stream) {
  cuda::copy_to_device(dst, src, bytes, stream);
}

void check_device(DLDevice d, const char* what) {
  if (loom::sdk::is_cpu(d)) return;  // host or pinned host memory
  if (loom::sdk::is_cuda(d)) {
    if (cuda::have_cuda()) return;
    loom::sdk::throw_built_without_cuda("moe exchange: " + std::string(what) + " is on " +
                                        loom::sdk::device_string(d));
  }
  fail(LOOM_ERR_UNIMPLEMENTED, std::string(what) + " is on " + loom::sdk::device_string(d) +
                                   "; the exchange moves host or CUDA memory");
}

void all_to_all(const Ref& c, const void* send, int64_t send_n, void* recv, int64_t recv_n,
                const int64_t* send_counts, const int64_t* recv_counts, DLDataType dtype,
                DLDevice device, void* stream) {
  Flat s(send, send_n, dtype, device);
  Flat r(recv, recv_n, dtype, device);
  loom_all_to_all_args a{};
  a.struct_size = LOOM_ALL_TO_ALL_ARGS_SIZE;
  a.send = &s.t;
  a.recv = &r.t;
  a.send_counts = send_counts;
  a.recv_counts = recv_counts;
  a.stream = stream;
  c.call(&loom_comm_v1::all_to_all, &a);
}

void allreduce(const Ref& c, void* data, int64_t n, int32_t op, DLDevice device, void* stream) {
  Flat t(data, n, kFloat32, device);
  loom_allreduce_args a{};
  a.struct_size = LOOM_ALLREDUCE_ARGS_SIZE;
  a.op = op;
  a.send = nullptr;
  a.recv = &t.t;
  a.stream = stream;
  c.call(&loom_comm_v1::allreduce, &a);
}

void ensure(std::vector<char>& v, std::size_t bytes) {
  if (v.size() < bytes) v.resize(bytes);
}

}  // namespace

namespace {

// Pins the CUDA device of a call for its scope (nothing on the host).
class DevicePin {
 public:
  explicit DevicePin(const DLDevice& d) {
    if (loom::sdk::is_cuda(d)) scope_ = std::make_unique<cuda::DeviceScope>(d.device_id);
  }

 private:
  std::unique_ptr<cuda::DeviceScope> scope_;
};

}  // namespace

struct Exchange::Impl {
  enum class Dir { kForward, kReverse };
  Impl(const loom_comm_v1* vt, void* comm, int ep_size);
  ~Impl();
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  Plan plan(const int64_t* send_counts, int num_experts);
  void move(const Plan& plan, Dir dir, const void* in, void* out, int64_t row_bytes,
            DLDevice device, void* stream);
  void reduce_gradients(DLTensor* const* tensors, int64_t count, void* stream);
  void sum_ep(int64_t* v, int64_t n);
  int64_t max_ep(int64_t v);
  void sum_world(int64_t* v, int64_t n);
  std::string agree_ep(int64_t status, const std::string& local_error, const char* unit);
  void check_plan(const Plan& plan, const char* what) const;
  // The EP group's communicator (the world itself when ep == world), or none when ep == 1.
  Ref ep_comm() const;
  // The expert-data-parallel group's (the world when ep == 1), or none when W == ep.
  Ref edp_comm() const;
  std::vector<int64_t> gather_ep(const int64_t* v, int64_t n);
  // The allgather of n values from each of `ranks` ranks of c.
  std::vector<int64_t> gather(const Ref& c, int ranks, const int64_t* v, int64_t n);

  Ref comm_;
  loom::sdk::SubComm ep_group_, edp_group_;
  int ep_ = 1, ep_rank_ = 0, world_ = 1, world_rank_ = 0;
  // Host staging (device rows through a host-only transport) and the permutation's scratch.
  // Runs a collective of the small int64 arrays (counts, loads) on host memory, or, for a
  // transport that moves device memory only (nccl), on a device copy of them.
  template <class Fn>
  void small(const int64_t* send, int64_t send_n, int64_t* recv, int64_t recv_n, Fn&& fn);
  bool host_ok_ = true;  // the transport takes host tensors
  std::vector<char> host_a_, host_b_, host_stage_;
  void* device_scratch_ = nullptr;  // CUDA scratch of a device-capable transport
  std::size_t device_scratch_bytes_ = 0;
  int device_scratch_device_ = 0;  // where device_scratch_ lives
  int last_device_ = -1;           // the CUDA device of the last device call (small() uses it)
};

Exchange::Impl::Impl(const loom_comm_v1* vt, void* comm, int ep_size) : ep_(ep_size) {
  if (ep_size < 1) {
    fail(LOOM_ERR_INVALID_ARGUMENT, "ep_size is " + std::to_string(ep_size) + "; must be >= 1");
  }
  if (comm == nullptr || vt == nullptr) {
    if (ep_size != 1) {
      fail(LOOM_ERR_INVALID_ARGUMENT, "ep_size is " + std::to_string(ep_size) +
                                          " but no comm is set: expert parallelism needs one");
    }
    return;
  }
  comm_ = Ref("comm", comm, vt);
  world_ = vt->size(comm);
  world_rank_ = vt->rank(comm);
  host_ok_ = loom::sdk::comm_supports_device(comm_, kHost);
  if (world_ < 1 || world_rank_ < 0 || world_rank_ >= world_) {
    fail(LOOM_ERR_INTERNAL,
         "the comm reports rank " + std::to_string(world_rank_) + " of " + std::to_string(world_));
  }
  if (world_ % ep_size != 0) {
    fail(LOOM_ERR_INVALID_ARGUMENT, "the comm has " + std::to_string(world_) +
                                        " ranks, not a multiple of ep_size " +
                                        std::to_string(ep_size));
  }
  ep_rank_ = world_rank_ % ep_size;
  // Both splits only when both groups are proper subsets of the world; every rank takes the
  // same branch (same world size and ep_size), so the collective splits match.
  if (ep_size > 1 && ep_size < world_) {
    ep_group_ = loom::sdk::comm_split(comm_, world_rank_ / ep_size, world_rank_);
    edp_group_ = loom::sdk::comm_split(comm_, world_rank_ % ep_size, world_rank_);
    if (ep_group_.size() != ep_size || ep_group_.rank() != ep_rank_) {
      fail(LOOM_ERR_INTERNAL, "the expert-parallel group has rank " +
                                  std::to_string(ep_group_.rank()) + " of " +
                                  std::to_string(ep_group_.size()) + ", expected " +
                                  std::to_string(ep_rank_) + " of " + std::to_string(ep_size));
    }
  }
}

Exchange::Impl::~Impl() { cuda::free_on(device_scratch_device_, device_scratch_); }

Ref Exchange::Impl::ep_comm() const {
  if (ep_ == 1) return {};
  if (ep_ == world_) return comm_;
  return ep_group_.ref();
}

Ref Exchange::Impl::edp_comm() const {
  if (world_ == ep_) return {};
  if (ep_ == 1) return comm_;
  return edp_group_.ref();
}

Exchange::Plan Exchange::Impl::plan(const int64_t* send_counts, int num_experts) {
  if (num_experts < 1 || num_experts % ep_ != 0) {
    fail(LOOM_ERR_INVALID_ARGUMENT, "num_experts " + std::to_string(num_experts) +
                                        " is not a positive multiple of ep_size " +
                                        std::to_string(ep_));
  }
  if (send_counts == nullptr) fail(LOOM_ERR_INVALID_ARGUMENT, "send_counts is NULL");
  Plan p;
  p.num_experts = num_experts;
  p.ep = ep_;
  p.local_experts = num_experts / ep_;
  p.send_counts.assign(send_counts, send_counts + num_experts);
  for (int e = 0; e < num_experts; ++e) {
    if (send_counts[e] < 0) {
      fail(LOOM_ERR_INVALID_ARGUMENT, "send_counts[" + std::to_string(e) + "] is " +
                                          std::to_string(send_counts[e]) + "; must be >= 0");
    }
  }
  const auto E = static_cast<std::size_t>(num_experts);
  const auto El = static_cast<std::size_t>(p.local_experts);
  const auto ep = static_cast<std::size_t>(ep_);
  std::vector<int64_t> by_source(E);  // [source rank][local expert], as the all_to_all lands
  if (ep_ == 1) {
    by_source = p.send_counts;
  } else {
    small(p.send_counts.data(), num_experts, by_source.data(), num_experts,
          [&](const int64_t* in, int64_t* out, DLDevice where) {
            all_to_all(ep_comm(), in, num_experts, out, num_experts, nullptr, nullptr, kInt64,
                       where, nullptr);
          });
  }
  p.recv_counts.assign(E, 0);
  for (std::size_t r = 0; r < ep; ++r) {
    for (std::size_t l = 0; l < El; ++l) {
      const int64_t n = by_source[r * El + l];
      if (n < 0) {
        fail(LOOM_ERR_INTERNAL, "rank " + std::to_string(r) +
                                    " of the expert-parallel group sends " + std::to_string(n) +
                                    " rows");
      }
      p.recv_counts[l * ep + r] = n;
      p.recv_rows += n;
    }
  }
  return p;
}

void Exchange::Impl::check_plan(const Plan& p, const char* what) const {
  const auto E = static_cast<std::size_t>(p.num_experts);
  if (p.ep != ep_ || p.num_experts < 1 || p.local_experts * p.ep != p.num_experts ||
      p.send_counts.size() != E || p.recv_counts.size() != E) {
    fail(LOOM_ERR_INVALID_ARGUMENT,
         std::string(what) + ": the plan is not one of this exchange's (ep " +
             std::to_string(p.ep) + ", " + std::to_string(p.num_experts) + " experts)");
  }
}

void Exchange::Impl::move(const Plan& p, Dir dir, const void* in, void* out, int64_t row_bytes,
                          DLDevice device, void* stream) {
  const char* what = dir == Dir::kForward ? "forward" : "reverse";
  check_plan(p, what);
  check_device(device, what);
  if (row_bytes < 1) {
    fail(LOOM_ERR_INVALID_ARGUMENT,
         std::string(what) + ": row_bytes is " + std::to_string(row_bytes) + "; must be >= 1");
  }
  const auto ep = static_cast<std::size_t>(p.ep);
  const auto El = static_cast<std::size_t>(p.local_experts);
  const auto rb = static_cast<std::size_t>(row_bytes);
  // Rows per peer rank, each way, and the totals.
  std::vector<int64_t> to_rank(ep, 0), from_rank(ep, 0);
  int64_t sent = 0;
  for (std::size_t d = 0; d < ep; ++d) {
    for (std::size_t l = 0; l < El; ++l) {
      to_rank[d] += p.send_counts[d * El + l];
      from_rank[d] += p.recv_counts[l * ep + d];
    }
    sent += to_rank[d];
  }
  const int64_t received = p.recv_rows;
  const int64_t in_rows = dir == Dir::kForward ? sent : received;
  const int64_t out_rows = dir == Dir::kForward ? received : sent;
  if ((in == nullptr && in_rows > 0) || (out == nullptr && out_rows > 0)) {
    fail(LOOM_ERR_INVALID_ARGUMENT, std::string(what) + ": a row buffer is NULL");
  }
  const bool dev = loom::sdk::is_cuda(device);
  const DevicePin pin(device);
  if (dev) last_device_ = device.device_id;
  if (ep == 1) {  // one rank: the expert layout is the send layout
    if (in != out) copy_rows(out, in, static_cast<std::size_t>(sent) * rb, dev, stream);
    return;
  }
  const Ref c = ep_comm();
  const bool native = !dev || loom::sdk::comm_supports_device(c, device);
  // Byte counts of the all_to_all.
  std::vector<int64_t> bytes_to(ep), bytes_from(ep);
  for (std::size_t d = 0; d < ep; ++d) {
    bytes_to[d] = to_rank[d] * row_bytes;
    bytes_from[d] = from_rank[d] * row_bytes;
  }
  const std::size_t in_bytes = static_cast<std::size_t>(in_rows) * rb;
  const std::size_t out_bytes = static_cast<std::size_t>(out_rows) * rb;
  const std::size_t recv_bytes = static_cast<std::size_t>(received) * rb;

  // Where the work happens: the caller's buffers (host, or device with a device transport),
  // or host copies of them.
  const void* win = in;
  void* wout = out;
  bool device_work = dev && native;
  if (dev && !native) {
    ensure(host_a_, in_bytes);
    ensure(host_b_, out_bytes);
    to_host(host_a_.data(), in, in_bytes, stream);
    win = host_a_.data();
    wout = host_b_.data();
  }
  const DLDevice comm_device = device_work ? device : kHost;
  void* comm_stream = device_work ? stream : nullptr;

  // The permutation between [source rank][local expert] (as the all_to_all lands) and
  // [local expert][source rank] (the expert layout): one copy per (rank, expert) segment.
  auto permute = [&](const char* from, char* to, bool to_expert_layout) {
    std::vector<std::size_t> by_rank(ep * El), by_expert(ep * El);
    std::size_t o = 0;
    for (std::size_t r = 0; r < ep; ++r) {
      for (std::size_t l = 0; l < El; ++l) {
        by_rank[r * El + l] = o;
        o += static_cast<std::size_t>(p.recv_counts[l * ep + r]) * rb;
      }
    }
    o = 0;
    for (std::size_t l = 0; l < El; ++l) {
      for (std::size_t r = 0; r < ep; ++r) {
        by_expert[r * El + l] = o;
        o += static_cast<std::size_t>(p.recv_counts[l * ep + r]) * rb;
      }
    }
    for (std::size_t r = 0; r < ep; ++r) {
      for (std::size_t l = 0; l < El; ++l) {
        const std::size_t n = static_cast<std::size_t>(p.recv_counts[l * ep + r]) * rb;
        const std::size_t a = by_rank[r * El + l], b = by_expert[r * El + l];
        if (to_expert_layout) {
          copy_rows(to + b, from + a, n, device_work, stream);
        } else {
          copy_rows(to + a, from + b, n, device_work, stream);
        }
      }
    }
  };
  // Scratch for the rank-major layout when the permutation is not the identity.
  char* stage = nullptr;
  if (El > 1 && recv_bytes > 0) {
    if (device_work) {
      if (device_scratch_bytes_ < recv_bytes || device_scratch_device_ != device.device_id) {
        // the previous call synchronised its stream, so nothing still uses the scratch
        cuda::free_on(device_scratch_device_, device_scratch_);
        device_scratch_ = nullptr;
        device_scratch_bytes_ = 0;
        device_scratch_ = cuda::allocate(recv_bytes, "cudaMalloc (exchange scratch)");
        device_scratch_bytes_ = recv_bytes;
        device_scratch_device_ = device.device_id;
      }
      stage = static_cast<char*>(device_scratch_);
    } else {
      // host_a_/host_b_ may hold the staged in/out; the stage gets its own buffer.
      ensure(host_stage_, recv_bytes);
      stage = host_stage_.data();
    }
  }
  if (dir == Dir::kForward) {
    char* land = stage != nullptr ? stage : static_cast<char*>(wout);
    all_to_all(c, win, static_cast<int64_t>(in_bytes), land, static_cast<int64_t>(recv_bytes),
               bytes_to.data(), bytes_from.data(), kBytes, comm_device, comm_stream);
    if (stage != nullptr) permute(stage, static_cast<char*>(wout), true);
  } else {
    const char* src = static_cast<const char*>(win);
    if (stage != nullptr) {
      permute(src, stage, false);
      src = stage;
    }
    all_to_all(c, src, static_cast<int64_t>(recv_bytes), wout, static_cast<int64_t>(out_bytes),
               bytes_from.data(), bytes_to.data(), kBytes, comm_device, comm_stream);
  }
  if (dev && !native) to_device(out, host_b_.data(), out_bytes, stream);
  // The scratch is shared by every call (of any stream): the next call may reuse or free it
  // only once this one's copies out of it are done.
  if (device_work && stage != nullptr) cuda::synchronize(stream);
}

void Exchange::Impl::reduce_gradients(DLTensor* const* tensors, int64_t count, void* stream) {
  if (count < 0) {
    fail(LOOM_ERR_INVALID_ARGUMENT, "reduce_gradients: count is " + std::to_string(count));
  }
  if (count > 0 && tensors == nullptr) {
    fail(LOOM_ERR_INVALID_ARGUMENT, "reduce_gradients: tensors is NULL");
  }
  // Every tensor is checked before any is reduced, so a bad one leaves all as they were
  // (and no rank enters a collective the others may not).
  for (int64_t i = 0; i < count; ++i) {
    const std::string w = "reduce_gradients: tensor " + std::to_string(i);
    const DLTensor& t = loom::sdk::expect_tensor(tensors[i], w);
    loom::sdk::expect_fp32(t, w);
    loom::sdk::expect_contiguous(t, w);
    check_device(t.device, w.c_str());
  }
  if (world_ == 1) return;
  const Ref c = edp_comm();
  const auto world = static_cast<float>(world_);
  auto scale = [&](float* v, int64_t n) {
    for (int64_t j = 0; j < n; ++j) v[j] /= world;
  };
  for (int64_t i = 0; i < count; ++i) {
    DLTensor& t = *tensors[i];
    const int64_t n = loom::sdk::numel(t);
    if (n == 0) continue;
    auto* data = reinterpret_cast<float*>(static_cast<char*>(t.data) + t.byte_offset);
    const std::size_t bytes = static_cast<std::size_t>(n) * sizeof(float);
    if (!loom::sdk::is_cuda(t.device)) {
      if (c) allreduce(c, data, n, LOOM_REDUCE_SUM, kHost, nullptr);
      scale(data, n);
      continue;
    }
    // Device: with a device transport (or no transport needed: W == ep) the sum and the
    // division stay on the device; otherwise the sum is made on the host and divided there.
    const DevicePin pin(t.device);
    last_device_ = t.device.device_id;
    const bool native = !c || loom::sdk::comm_supports_device(c, t.device);
    if (native) {
      if (c) allreduce(c, data, n, LOOM_REDUCE_SUM, t.device, stream);
      cuda::divide_in_place(data, n, world, stream);
      continue;
    }
    ensure(host_a_, bytes);
    to_host(host_a_.data(), data, bytes, stream);
    auto* h = reinterpret_cast<float*>(host_a_.data());
    if (c) allreduce(c, h, n, LOOM_REDUCE_SUM, kHost, nullptr);
    scale(h, n);
    to_device(data, h, bytes, stream);
  }
}

std::vector<int64_t> Exchange::Impl::gather_ep(const int64_t* v, int64_t n) {
  return gather(ep_comm(), ep_, v, n);
}

std::vector<int64_t> Exchange::Impl::gather(const Ref& c, int ranks, const int64_t* v, int64_t n) {
  if (n < 0 || (n > 0 && v == nullptr)) {
    fail(LOOM_ERR_INVALID_ARGUMENT, "sum_ep: " + std::to_string(n) + " values at NULL");
  }
  std::vector<int64_t> all(static_cast<std::size_t>(n) * static_cast<std::size_t>(ranks));
  if (ranks == 1 || !c) {
    std::copy(v, v + n, all.begin());
    return all;
  }
  small(v, n, all.data(), n * ranks, [&](const int64_t* in, int64_t* out, DLDevice where) {
    Flat s(in, n, kInt64, where);
    Flat r(out, n * ranks, kInt64, where);
    loom_allgather_args a{};
    a.struct_size = LOOM_ALLGATHER_ARGS_SIZE;
    a.send = &s.t;
    a.recv = &r.t;
    a.stream = nullptr;
    c.call(&loom_comm_v1::allgather, &a);
  });
  return all;
}

template <class Fn>
void Exchange::Impl::small(const int64_t* send, int64_t send_n, int64_t* recv, int64_t recv_n,
                           Fn&& fn) {
  if (host_ok_) {
    fn(send, recv, kHost);
    return;
  }
  if (!cuda::have_cuda()) {
    loom::sdk::throw_built_without_cuda("moe exchange: the comm moves device memory only");
  }
  // On the legacy default stream, synchronised: the values come from the host and go back to
  // it.
  // On the device of the last device call (else the current one), pinned for the call.
  int device = last_device_;
  if (device < 0) device = cuda::current_device();
  const cuda::DeviceScope pin(device);
  const auto sb = static_cast<std::size_t>(send_n) * sizeof(int64_t);
  const auto rb = static_cast<std::size_t>(recv_n) * sizeof(int64_t);
  void* d = cuda::allocate(std::max<std::size_t>(sb + rb, 16), "cudaMalloc (exchange counts)");
  struct Free {
    int device;
    void* p;
    ~Free() { cuda::free_on(device, p); }
  } guard{device, d};
  auto* ds = static_cast<int64_t*>(d);
  int64_t* dr = ds + send_n;
  if (sb != 0) cuda::copy_to_device_now(ds, send, sb);
  fn(ds, dr, DLDevice{kDLCUDA, device});
  cuda::synchronize(nullptr);
  if (rb != 0) cuda::copy_to_host_now(recv, dr, rb);
}

// The ucx transport reduces floating-point types only; int64 sums go through an allgather
// (exact, and the same order on every rank).
void Exchange::Impl::sum_ep(int64_t* v, int64_t n) {
  if (ep_ == 1) return;
  const std::vector<int64_t> all = gather_ep(v, n);
  for (int64_t j = 0; j < n; ++j) {
    int64_t s = 0;
    for (int r = 0; r < ep_; ++r) s += all[static_cast<std::size_t>(r * n + j)];
    v[j] = s;
  }
}

int64_t Exchange::Impl::max_ep(int64_t v) {
  if (ep_ == 1) return v;
  const std::vector<int64_t> all = gather_ep(&v, 1);
  return *std::max_element(all.begin(), all.end());
}

void Exchange::Impl::sum_world(int64_t* v, int64_t n) {
  if (world_ == 1) return;
  const std::vector<int64_t> all = gather(comm_, world_, v, n);
  for (int64_t j = 0; j < n; ++j) {
    int64_t s = 0;
    for (int r = 0; r < world_; ++r) s += all[static_cast<std::size_t>(r * n + j)];
    v[j] = s;
  }
}

// One allgather of each rank's status, so a rank that cannot go on stops every rank of its
// group at the same point instead of leaving them waiting in the next collective.
std::string Exchange::Impl::agree_ep(int64_t status, const std::string& local_error,
                                     const char* unit) {
  const std::vector<int64_t> all = gather_ep(&status, 1);
  int bad = -1;
  for (int r = 0; r < ep_; ++r) {
    if (all[static_cast<std::size_t>(r)] != 0) {
      bad = r;
      break;
    }
  }
  if (bad < 0) return "";
  const std::string tail = ep_ > 1 ? " (expert-parallel rank " + std::to_string(ep_rank_) + " of " +
                                         std::to_string(ep_) + "; every rank of the group stops)"
                                   : "";
  if (status != 0) {
    return (local_error.empty() ? "moe: this rank cannot go on" : local_error) + tail;
  }
  const int64_t v = all[static_cast<std::size_t>(bad)];
  return "moe: expert-parallel rank " + std::to_string(bad) + " of " + std::to_string(ep_) +
         (v > 0 ? " was short by " + std::to_string(v) + " " + unit : " refused the call") +
         "; every rank of the group stops with it";
}

Exchange::Exchange(const loom_comm_v1* vt, void* comm, int ep_size)
    : impl_(std::make_unique<Impl>(vt, comm, ep_size)) {}
Exchange::~Exchange() = default;
int Exchange::ep_size() const { return impl_->ep_; }
int Exchange::ep_rank() const { return impl_->ep_rank_; }
int Exchange::world_size() const { return impl_->world_; }
int Exchange::world_rank() const { return impl_->world_rank_; }
Exchange::Plan Exchange::plan(const int64_t* send_counts, int num_experts) {
  return impl_->plan(send_counts, num_experts);
}
void Exchange::forward(const Plan& p, const void* send, void* recv, int64_t row_bytes,
                       DLDevice device, void* stream) {
  impl_->move(p, Impl::Dir::kForward, send, recv, row_bytes, device, stream);
}
void Exchange::reverse(const Plan& p, const void* recv_layout, void* send_layout, int64_t row_bytes,
                       DLDevice device, void* stream) {
  impl_->move(p, Impl::Dir::kReverse, recv_layout, send_layout, row_bytes, device, stream);
}
void Exchange::reduce_gradients(DLTensor* const* tensors, int64_t count, void* stream) {
  impl_->reduce_gradients(tensors, count, stream);
}
void Exchange::sum_ep(int64_t* v, int64_t n) { impl_->sum_ep(v, n); }
int64_t Exchange::max_ep(int64_t v) { return impl_->max_ep(v); }
void Exchange::sum_world(int64_t* v, int64_t n) { impl_->sum_world(v, n); }
std::string Exchange::agree_ep(int64_t status, const std::string& local_error, const char* unit) {
  return impl_->agree_ep(status, local_error, unit);
}

}  // namespace loom::moe
