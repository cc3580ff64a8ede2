// Helpers for writers and callers of "loom.comm/1" transports: names of reduce ops, and for
// code that holds another plugin's communicator (an InstanceRef<loom_comm_v1>): process
// groups (comm_split, owned by a SubComm), and the calls with a 1.2 args-struct form, which
// use it when the transport has it and the 1.0 entry otherwise.
#pragma once

#include <loom/kinds/comm.h>
#include <loom/sdk/context.hpp>
#include <loom/sdk/status.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

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

}  // namespace loom::sdk
