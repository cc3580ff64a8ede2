// Helpers for writers and callers of "loom.comm/1" transports: names of reduce ops, and for
// code that holds another plugin's communicator (an InstanceRef<loom_comm_v1>): process
// groups (comm_split, owned by a SubComm), and the calls with a 1.2 args-struct form, which
// use it when the transport has it and the 1.0 entry otherwise; non-blocking collectives
// (comm_start and CommRequest, since 1.6) and reduce-scatter (comm_reduce_scatter), with
// blocking fallbacks for transports built before 1.6.
#pragma once

#include <loom/kinds/comm.h>
#include <loom/sdk/context.hpp>
#include <loom/sdk/status.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace loom::sdk {

// "sum", "avg", "max", "min" for a loom_reduce_op value; "?" for any other value (for error
// messages, which must not fail themselves).
inline const char* reduce_op_string(int32_t op) {
  switch (op) {
    case LOOM_REDUCE_SUM:
      return "sum";
    case LOOM_REDUCE_AVG:
      return "avg";
    case LOOM_REDUCE_MAX:
      return "max";
    case LOOM_REDUCE_MIN:
      return "min";
    default:
      return "?";
  }
}

// True when the table `vt` (another plugin's, maybe of an older minor) has `fn` within its
// struct_size and sets it.
template <class Fn>
bool comm_provides(const loom_comm_v1* vt, Fn loom_comm_v1::*fn) {
  return InstanceRef<loom_comm_v1>("", nullptr, vt).provides(fn);
}

// A sub-communicator from comm_split(): owns it and destroys it with its table's destroy_split
// (not collective). It must go before the communicator it was split from. Calls on it are
// [instance] like on any communicator; it may be split again.
class SubComm {
 public:
  SubComm() = default;
  SubComm(void* instance, const loom_comm_v1* vtable, std::string name)
      : instance_(instance), vtable_(vtable), name_(std::move(name)) {}
  ~SubComm() { reset(); }
  SubComm(SubComm&& o) noexcept
      : instance_(std::exchange(o.instance_, nullptr)),
        vtable_(std::exchange(o.vtable_, nullptr)),
        name_(std::move(o.name_)) {}
  SubComm& operator=(SubComm&& o) noexcept {
    if (this != &o) {
      reset();
      instance_ = std::exchange(o.instance_, nullptr);
      vtable_ = std::exchange(o.vtable_, nullptr);
      name_ = std::move(o.name_);
    }
    return *this;
  }
  SubComm(const SubComm&) = delete;
  SubComm& operator=(const SubComm&) = delete;

  // False for the result of a negative color (this rank is in no group).
  explicit operator bool() const { return instance_ != nullptr; }
  void* instance() const { return instance_; }
  const loom_comm_v1* vtable() const { return vtable_; }
  // "world/1": the parent's name and the color.
  const std::string& name() const { return name_; }
  int32_t rank() const { return instance_ != nullptr ? vtable_->rank(instance_) : -1; }
  int32_t size() const { return instance_ != nullptr ? vtable_->size(instance_) : 0; }
  // A borrowed handle, for code written against InstanceRef (valid while this lives).
  InstanceRef<loom_comm_v1> ref() const { return {name_, instance_, vtable_}; }

  void reset() noexcept {
    if (instance_ != nullptr) vtable_->destroy_split(instance_);
    instance_ = nullptr;
    vtable_ = nullptr;
  }

 private:
  void* instance_ = nullptr;
  const loom_comm_v1* vtable_ = nullptr;
  std::string name_;
};

// Splits `comm` into groups: collective over it (every rank calls it, in the same order as
// its other collectives). The ranks passing the same color >= 0 form one sub-communicator,
// ordered by (key, rank in comm); a negative color (LOOM_COMM_SPLIT_NONE) gives an empty
// SubComm. Throws Error: UNIMPLEMENTED naming comm when its plugin has no split (one built
// for ABI 1.1 or older); otherwise the plugin's error, prefixed with comm's name.
inline SubComm comm_split(const InstanceRef<loom_comm_v1>& comm, int32_t color, int32_t key) {
  if (!comm) throw Error(LOOM_ERR_FAILED_PRECONDITION, "split: the comm reference is not set");
  if (!comm.provides(&loom_comm_v1::split) || !comm.provides(&loom_comm_v1::destroy_split)) {
    throw Error(LOOM_ERR_UNIMPLEMENTED,
                "instance '" + comm.name() +
                    "' cannot split: its plugin has no process groups (loom_comm_v1.split and "
                    "destroy_split, ABI 1.2)");
  }
  loom_comm_split_args args{};
  args.struct_size = LOOM_COMM_SPLIT_ARGS_SIZE;
  args.color = color;
  args.key = key;
  args.result = nullptr;
  check(comm.vtable()->split(comm.instance(), &args), "instance '" + comm.name() + "': split");
  SubComm sub(args.result, comm.vtable(), comm.name() + "/" + std::to_string(color));
  if ((color < 0) != (args.result == nullptr)) {
    throw Error(LOOM_ERR_INTERNAL,
                "instance '" + comm.name() + "': split with color " + std::to_string(color) +
                    (color < 0 ? " returned a sub-communicator" : " returned no sub-communicator"));
  }
  return sub;
}

// A barrier on `stream`, through barrier2 when the transport has it.
inline void comm_barrier(const InstanceRef<loom_comm_v1>& comm, void* stream) {
  if (comm.provides(&loom_comm_v1::barrier2)) {
    const loom_comm_barrier_args args{LOOM_COMM_BARRIER_ARGS_SIZE, 0, stream};
    comm.call(&loom_comm_v1::barrier2, &args);
  } else {
    comm.call(&loom_comm_v1::barrier, stream);
  }
}

// Whether the transport can operate on tensors on `device`, through supports_device2 when
// it has it.
inline bool comm_supports_device(const InstanceRef<loom_comm_v1>& comm, DLDevice device) {
  if (comm.provides(&loom_comm_v1::supports_device2)) {
    loom_comm_device_args args{LOOM_COMM_DEVICE_ARGS_SIZE, 0, device, 0};
    comm.call(&loom_comm_v1::supports_device2, &args);
    return args.supported == 1;
  }
  return comm.call(&loom_comm_v1::supports_device, device) == 1;
}

// Every rank's `value` (a 64-bit integer), in rank order: an allgather of one element, for
// the agreements a collective object makes at construction (sizes, host names' hashes).
template <class T>
std::vector<T> comm_allgather_value(const InstanceRef<loom_comm_v1>& comm, T value) {
  static_assert(sizeof(T) == 8 && std::is_integral_v<T>, "a 64-bit integer");
  std::vector<T> all(static_cast<std::size_t>(comm.call(&loom_comm_v1::size)));
  int64_t one = 1;
  int64_t n = static_cast<int64_t>(all.size());
  const DLDataType dtype{std::is_signed_v<T> ? uint8_t{kDLInt} : uint8_t{kDLUInt}, 64, 1};
  DLTensor send{&value, DLDevice{kDLCPU, 0}, 1, dtype, &one, nullptr, 0};
  DLTensor recv{all.data(), DLDevice{kDLCPU, 0}, 1, dtype, &n, nullptr, 0};
  loom_allgather_args ag{};
  ag.struct_size = LOOM_ALLGATHER_ARGS_SIZE;
  ag.send = &send;
  ag.recv = &recv;
  comm.call(&loom_comm_v1::allgather, &ag);
  return all;
}

// ---- since 1.6: reduce-scatter and non-blocking collectives

// True when the transport starts collectives without blocking (start, test and wait).
inline bool comm_nonblocking(const InstanceRef<loom_comm_v1>& comm) {
  return comm.provides(&loom_comm_v1::start) && comm.provides(&loom_comm_v1::test) &&
         comm.provides(&loom_comm_v1::wait);
}

namespace detail {
inline std::size_t comm_numel(const DLTensor& t) {
  std::size_t n = 1;
  for (int32_t i = 0; i < t.ndim; ++i) n *= static_cast<std::size_t>(t.shape[i]);
  return n;
}
}  // namespace detail

// Reduce-scatter through the transport's reduce_scatter; a transport without one (built
// before 1.6) gets an allreduce of a host copy of send, of which this rank keeps its block
// (host memory only; device tensors are UNIMPLEMENTED there).
inline void comm_reduce_scatter(const InstanceRef<loom_comm_v1>& comm,
                                const loom_reduce_scatter_args& args) {
  if (comm.provides(&loom_comm_v1::reduce_scatter)) {
    comm.call(&loom_comm_v1::reduce_scatter, &args);
    return;
  }
  if (args.send == nullptr || args.recv == nullptr) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT, "reduce_scatter: send and recv must be set");
  }
  if (args.send->device.device_type != kDLCPU || args.recv->device.device_type != kDLCPU) {
    throw Error(LOOM_ERR_UNIMPLEMENTED,
                "instance '" + comm.name() +
                    "' has no reduce_scatter (ABI 1.6) and the fallback works on host memory only");
  }
  const int32_t size = comm.call(&loom_comm_v1::size);
  const std::size_t block = detail::comm_numel(*args.recv);
  if (detail::comm_numel(*args.send) != block * static_cast<std::size_t>(size) ||
      args.send->dtype.bits != args.recv->dtype.bits || args.send->dtype.bits % 8 != 0) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT, "reduce_scatter: send must hold " +
                                               std::to_string(size) +
                                               " blocks of recv's element count and type");
  }
  const std::size_t es = args.send->dtype.bits / 8;
  std::vector<unsigned char> all(block * static_cast<std::size_t>(size) * es);
  std::memcpy(all.data(),
              static_cast<const unsigned char*>(args.send->data) + args.send->byte_offset,
              all.size());
  int64_t shape = static_cast<int64_t>(block) * size;
  DLTensor whole{all.data(), args.send->device, 1, args.send->dtype, &shape, nullptr, 0};
  const loom_allreduce_args ar{LOOM_ALLREDUCE_ARGS_SIZE, args.op, nullptr, &whole, args.stream};
  comm.call(&loom_comm_v1::allreduce, &ar);
  const int32_t rank = comm.call(&loom_comm_v1::rank);
  std::memcpy(static_cast<unsigned char*>(args.recv->data) + args.recv->byte_offset,
              all.data() + static_cast<std::size_t>(rank) * block * es, block * es);
}

// A started collective (comm_start). wait() finishes it and throws its error; test() says
// whether it has finished. A request still pending when destroyed is waited for, and its
// error dropped: wait explicitly to see it. Move-only; must not outlive its communicator.
class CommRequest {
 public:
  CommRequest() = default;
  CommRequest(InstanceRef<loom_comm_v1> comm, void* request)
      : comm_(std::move(comm)), request_(request) {}
  ~CommRequest() {
    try {
      wait();
    } catch (...) {  // dropped: the caller did not wait
    }
  }
  CommRequest(CommRequest&& o) noexcept
      : comm_(std::move(o.comm_)), request_(std::exchange(o.request_, nullptr)) {}
  CommRequest& operator=(CommRequest&& o) noexcept {
    if (this != &o) {
      try {
        wait();
      } catch (...) {
      }
      comm_ = std::move(o.comm_);
      request_ = std::exchange(o.request_, nullptr);
    }
    return *this;
  }
  CommRequest(const CommRequest&) = delete;
  CommRequest& operator=(const CommRequest&) = delete;

  // True while the request needs a wait.
  bool pending() const { return request_ != nullptr; }

  // True when the collective has finished (a request from a blocking fallback always has).
  // Throws the collective's error; the request then still needs wait().
  bool test() {
    if (request_ == nullptr) return true;
    loom_comm_request_args a{LOOM_COMM_REQUEST_ARGS_SIZE, 0, request_};
    comm_.call(&loom_comm_v1::test, &a);
    return a.done == 1;
  }

  // Blocks until the collective has finished and throws its error; the request is spent
  // either way. No-op once spent.
  void wait() {
    if (request_ == nullptr) return;
    const loom_comm_request_args a{LOOM_COMM_REQUEST_ARGS_SIZE, 0,
                                   std::exchange(request_, nullptr)};
    comm_.call(&loom_comm_v1::wait, &a);
  }

 private:
  InstanceRef<loom_comm_v1> comm_;
  void* request_ = nullptr;
};

// Starts `collective` with its args struct (loom_comm_collective names which one) and returns
// its request. The args struct and what it points to stay valid and untouched until the
// request is waited for. A transport built before 1.6 runs the collective here, blocking, and
// returns a finished request; so does a reduce-scatter on a transport without one (through
// comm_reduce_scatter).
inline CommRequest comm_start(const InstanceRef<loom_comm_v1>& comm,
                              loom_comm_collective collective, const void* args) {
  if (!comm) throw Error(LOOM_ERR_FAILED_PRECONDITION, "start: the comm reference is not set");
  const bool scatter_fallback =
      collective == LOOM_COLLECTIVE_REDUCE_SCATTER && !comm.provides(&loom_comm_v1::reduce_scatter);
  if (comm_nonblocking(comm) && !scatter_fallback) {
    loom_comm_start_args a{LOOM_COMM_START_ARGS_SIZE, collective, args, nullptr};
    comm.call(&loom_comm_v1::start, &a);
    return {comm, a.request};
  }
  switch (collective) {
    case LOOM_COLLECTIVE_ALLREDUCE:
      comm.call(&loom_comm_v1::allreduce, static_cast<const loom_allreduce_args*>(args));
      break;
    case LOOM_COLLECTIVE_ALLGATHER:
      comm.call(&loom_comm_v1::allgather, static_cast<const loom_allgather_args*>(args));
      break;
    case LOOM_COLLECTIVE_REDUCE_SCATTER:
      comm_reduce_scatter(comm, *static_cast<const loom_reduce_scatter_args*>(args));
      break;
    case LOOM_COLLECTIVE_ALL_TO_ALL:
      comm.call(&loom_comm_v1::all_to_all, static_cast<const loom_all_to_all_args*>(args));
      break;
    case LOOM_COLLECTIVE_BROADCAST:
      comm.call(&loom_comm_v1::broadcast, static_cast<const loom_broadcast_args*>(args));
      break;
    default:
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  "start: unknown collective " + std::to_string(static_cast<int>(collective)));
  }
  return {comm, nullptr};
}

}  // namespace loom::sdk
