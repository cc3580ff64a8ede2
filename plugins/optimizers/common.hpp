// What the optimizer plugins share: argument validation (every tensor is checked before
// any is touched), per-tensor moment buffers on the tensors' device, and their state
// format.
#pragma once

#include <loom/sdk.hpp>
#include <loom/sdk/no_cuda.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "kernels/cpu.hpp"
#include "kernels/cuda.hpp"

namespace loom::optim {

using loom::sdk::Error;

// One validated tensor of a step.
struct StepTensor {
  TensorRef ref;  // p, g, low filled; m and v set by the optimizer
  DLDevice device{kDLCPU, 0};
  const float* mask = nullptr;  // exp_avg_mask (ref.n elements on `device`), or NULL
};

struct StepGroup {
  double lr_scale = 1.0;
  double weight_decay = 0.0;
  uint32_t flags = 0;  // LOOM_OPTIMIZER_GROUP_* (known bits only)
  std::vector<StepTensor> tensors;
  bool non_freeze() const { return (flags & LOOM_OPTIMIZER_GROUP_NON_FREEZE) != 0; }
};

inline DType dtype_of(const DLTensor& t) {
  if (loom::sdk::is_bf16(t)) return DType::kBF16;
  if (loom::sdk::is_fp16(t)) return DType::kF16;
  return DType::kF32;
}

// Checks every group and tensor of `args` and returns them in kernel form. Throws with a
// message naming the tensor ("param 0.3 ...") on the first problem. Fields a caller built
// against an older minor does not have (struct_size too small) read as absent: the group's
// weight_decay as NaN (1.0), its flags as 0, a tensor's exp_avg_mask as NULL (1.1).
inline std::vector<StepGroup> collect(const loom_optimizer_step_args& args, double default_wd,
                                      bool allow_cuda) {
  if (args.group_count != 0 && args.groups == nullptr) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT, "groups is NULL");
  }
  if (!std::isfinite(args.lr) || args.lr < 0.0) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT,
                "lr must be finite and >= 0, got " + std::to_string(args.lr));
  }
  if (!std::isfinite(args.grad_scale) || args.grad_scale <= 0.0) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT,
                "grad_scale must be positive, got " + std::to_string(args.grad_scale));
  }
  std::vector<StepGroup> out(args.group_count);
  bool any_cpu = false;
  bool any_cuda = false;
  for (std::size_t g = 0; g < args.group_count; ++g) {
    const loom_optimizer_group group = loom::sdk::element(args.groups, g);
    if (group.tensor_count != 0 && group.tensors == nullptr) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT, "group " + std::to_string(g) + " has no tensors");
    }
    if (!std::isfinite(group.lr_scale) || group.lr_scale < 0.0) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  "group " + std::to_string(g) + " has lr_scale " + std::to_string(group.lr_scale));
    }
    // A group struct without a weight_decay field (an older caller) uses the default.
    const bool has_wd =
        loom::sdk::has_field(group, LOOM_STRUCT_SIZE(loom_optimizer_group, weight_decay));
    const double wd = (!has_wd || std::isnan(group.weight_decay)) ? default_wd : group.weight_decay;
    if (!std::isfinite(wd) || wd < 0.0) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  "group " + std::to_string(g) + " has weight_decay " + std::to_string(wd));
    }
    const uint32_t flags =
        loom::sdk::has_field(group, LOOM_STRUCT_SIZE(loom_optimizer_group, flags)) ? group.flags
                                                                                   : 0u;
    if ((flags & ~static_cast<uint32_t>(LOOM_OPTIMIZER_GROUP_KNOWN_FLAGS)) != 0) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT, "group " + std::to_string(g) + " has unknown flags " +
                                                 std::to_string(flags) +
                                                 " (known: LOOM_OPTIMIZER_GROUP_NON_FREEZE = 1)");
    }
    out[g].lr_scale = group.lr_scale;
    out[g].weight_decay = wd;
    out[g].flags = flags;
    out[g].tensors.resize(group.tensor_count);
    for (std::size_t t = 0; t < group.tensor_count; ++t) {
      const std::string id = std::to_string(g) + "." + std::to_string(t);
      const loom_optimizer_tensor tensor = loom::sdk::element(group.tensors, t);
      const DLTensor& p = loom::sdk::expect_tensor(tensor.param, "param " + id);
      const DLTensor& grad = loom::sdk::expect_tensor(tensor.grad, "grad " + id);
      loom::sdk::expect_contiguous(p, "param " + id);
      loom::sdk::expect_contiguous(grad, "grad " + id);
      loom::sdk::expect_same_shape(grad, "grad " + id, p, "param " + id);
      loom::sdk::expect_same_device(grad, "grad " + id, p, "param " + id);
      if (!loom::sdk::is_fp32(grad) && !loom::sdk::is_bf16(grad) && !loom::sdk::is_fp16(grad)) {
        throw Error(LOOM_ERR_INVALID_ARGUMENT, "grad " + id + " has dtype " +
                                                   loom::sdk::dtype_string(grad.dtype) +
                                                   "; supported: float32, bfloat16, float16");
      }
      StepTensor st;
      st.device = p.device;
      st.ref.g = loom::sdk::data_as<const std::byte>(grad);
      st.ref.gtype = dtype_of(grad);
      st.ref.n = static_cast<std::size_t>(loom::sdk::numel(p));
      if (tensor.master != nullptr) {
        const DLTensor& master = loom::sdk::expect_tensor(tensor.master, "master " + id);
        loom::sdk::expect_fp32(master, "master " + id);
        loom::sdk::expect_contiguous(master, "master " + id);
        loom::sdk::expect_same_shape(master, "master " + id, p, "param " + id);
        loom::sdk::expect_same_device(master, "master " + id, p, "param " + id);
        if (!loom::sdk::is_bf16(p) && !loom::sdk::is_fp16(p)) {
          throw Error(LOOM_ERR_INVALID_ARGUMENT,
                      "param " + id +
                          " has a master copy, so it must be bfloat16 or float16, not " +
                          loom::sdk::dtype_string(p.dtype));
        }
        st.ref.p = loom::sdk::data_as<float>(master);
        st.ref.low = loom::sdk::data_as<std::byte>(p);
        st.ref.ltype = dtype_of(p);
      } else {
        if (!loom::sdk::is_fp32(p)) {
          throw Error(LOOM_ERR_INVALID_ARGUMENT,
                      "param " + id + " has dtype " + loom::sdk::dtype_string(p.dtype) +
                          "; a low-precision parameter needs an fp32 master copy");
        }
        st.ref.p = loom::sdk::data_as<float>(p);
      }
      const bool has_mask =
          loom::sdk::has_field(tensor, LOOM_STRUCT_SIZE(loom_optimizer_tensor, exp_avg_mask));
      if (has_mask && tensor.exp_avg_mask != nullptr) {
        const std::string what = "exp_avg_mask " + id;
        const DLTensor& mask = loom::sdk::expect_tensor(tensor.exp_avg_mask, what);
        loom::sdk::expect_fp32(mask, what);
        loom::sdk::expect_contiguous(mask, what);
        loom::sdk::expect_same_shape(mask, what, p, "param " + id);
        loom::sdk::expect_same_device(mask, what, p, "param " + id);
        st.mask = loom::sdk::data_as<const float>(mask);
      }
      if (loom::sdk::is_cuda(p)) {
        if (!allow_cuda) {
          throw Error(LOOM_ERR_UNIMPLEMENTED, "param " + id + " is on " +
                                                  loom::sdk::device_string(p.device) +
                                                  " but this optimizer runs on the CPU only");
        }
        if (!cuda::have_cuda()) {
          loom::sdk::throw_built_without_cuda("param " + id + " is on " +
                                              loom::sdk::device_string(p.device));
        }
        any_cuda = true;
      } else if (loom::sdk::is_cpu(p)) {
        any_cpu = true;
      } else {
        throw Error(LOOM_ERR_UNIMPLEMENTED, "param " + id + " is on " +
                                                loom::sdk::device_string(p.device) +
                                                "; supported: CPU, CUDA");
      }
      out[g].tensors[t] = st;
    }
  }
  if (any_cpu && any_cuda) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT, "a step mixes CPU and CUDA tensors");
  }
  return out;
}

// An fp32 buffer on the CPU or a CUDA device.
class Buffer {
 public:
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      release();
      host_ = std::move(o.host_);
      dev_ = o.dev_;
      device_ = o.device_;
      n_ = o.n_;
      o.dev_ = nullptr;
      o.n_ = 0;
    }
    return *this;
  }
  ~Buffer() { release(); }

  static Buffer zeros(std::size_t n, DLDevice device, void* stream) {
    Buffer b;
    b.n_ = n;
    b.device_ = device;
    if (loom::sdk::is_cuda(device)) {
      void* p = nullptr;
      check_cuda(cuda::alloc(&p, std::max<std::size_t>(n, 1) * 4, device.device_id));
      b.dev_ = static_cast<float*>(p);
      check_cuda(cuda::memset_zero(p, n * 4, stream));
    } else {
      b.host_.assign(n, 0.0f);
    }
    return b;
  }
  static Buffer from_host(std::vector<float> values) {
    Buffer b;
    b.n_ = values.size();
    b.host_ = std::move(values);
    return b;
  }

  float* data() { return dev_ != nullptr ? dev_ : host_.data(); }
  const float* data() const { return dev_ != nullptr ? dev_ : host_.data(); }
  std::size_t size() const { return n_; }
  DLDevice device() const { return device_; }
  bool on_cuda() const { return dev_ != nullptr; }

  // The values, copied to the host when they live on a device.
  std::vector<float> to_host(void* stream = nullptr) const {
    if (dev_ == nullptr) return host_;
    std::vector<float> out(n_);
    check_cuda(cuda::copy_to_host(out.data(), dev_, n_ * 4, stream));
    return out;
  }

  // Moves the buffer to `device` (after an import, state starts on the host).
  void move_to(DLDevice device, void* stream) {
    if (loom::sdk::same_device(device, device_)) return;
    std::vector<float> values = to_host(stream);
    Buffer b = zeros(values.size(), device, stream);
    if (b.on_cuda()) {
      check_cuda(cuda::copy_to_device(b.dev_, values.data(), values.size() * 4, stream));
    } else {
      b.host_ = std::move(values);
    }
    *this = std::move(b);
  }

  static void check_cuda(const std::string& e) {
    if (!e.empty()) throw Error(LOOM_ERR_INTERNAL, e);
  }

 private:
  void release() {
    if (dev_ != nullptr) cuda::free(dev_);
    dev_ = nullptr;
  }

  std::vector<float> host_;
  float* dev_ = nullptr;
  DLDevice device_{kDLCPU, 0};
  std::size_t n_ = 0;
};

// Per-tensor buffers of an optimizer, keyed by (group, tensor) position.
struct Slot {
  std::vector<Buffer> buffers;  // e.g. {m, v}
};
using SlotTable = std::vector<std::vector<Slot>>;

// Checks that the step has the layout the state was built with.
inline void expect_layout(const SlotTable& slots, const std::vector<StepGroup>& groups) {
  if (slots.empty()) return;
  if (slots.size() != groups.size()) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT, "got " + std::to_string(groups.size()) +
                                               " groups, the optimizer state has " +
                                               std::to_string(slots.size()));
  }
  for (std::size_t g = 0; g < groups.size(); ++g) {
    if (slots[g].size() != groups[g].tensors.size()) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT, "group " + std::to_string(g) + " has " +
                                                 std::to_string(groups[g].tensors.size()) +
                                                 " tensors, the optimizer state has " +
                                                 std::to_string(slots[g].size()));
    }
    for (std::size_t t = 0; t < slots[g].size(); ++t) {
      for (const Buffer& b : slots[g][t].buffers) {
        if (b.size() != groups[g].tensors[t].ref.n) {
          throw Error(LOOM_ERR_INVALID_ARGUMENT,
                      "param " + std::to_string(g) + "." + std::to_string(t) + " has " +
                          std::to_string(groups[g].tensors[t].ref.n) +
                          " elements, its optimizer state " + std::to_string(b.size()));
        }
      }
    }
  }
}

// Creates zeroed buffers (`per_tensor` per tensor) on first use, and moves imported ones
// to the tensors' device.
inline void ensure_slots(SlotTable& slots, const std::vector<StepGroup>& groups,
                         std::size_t per_tensor, void* stream) {
  if (slots.empty()) {
    SlotTable fresh(groups.size());
    for (std::size_t g = 0; g < groups.size(); ++g) {
      fresh[g].resize(groups[g].tensors.size());
      for (std::size_t t = 0; t < groups[g].tensors.size(); ++t) {
        for (std::size_t k = 0; k < per_tensor; ++k) {
          fresh[g][t].buffers.push_back(
              Buffer::zeros(groups[g].tensors[t].ref.n, groups[g].tensors[t].device, stream));
        }
      }
    }
    slots = std::move(fresh);
    return;
  }
  for (std::size_t g = 0; g < groups.size(); ++g) {
    for (std::size_t t = 0; t < groups[g].tensors.size(); ++t) {
      for (Buffer& b : slots[g][t].buffers) b.move_to(groups[g].tensors[t].device, stream);
    }
  }
}

// The whole state of a two-moment optimizer (adam, lamb): header, step count, then {m, v}
// per tensor. Reading validates the whole blob first, so a bad one changes nothing.
struct MomentState {
  uint64_t steps = 0;
  SlotTable slots;
};

// State format of the slot table: group count, per group the tensor count, per tensor the
// buffer count and each buffer as a vector.
inline void write_slots(loom::sdk::StateWriter& out, const SlotTable& slots, void* stream) {
  out.write_pod<uint64_t>(slots.size());
  for (const auto& group : slots) {
    out.write_pod<uint64_t>(group.size());
    for (const Slot& s : group) {
      out.write_pod<uint64_t>(s.buffers.size());
      for (const Buffer& b : s.buffers) out.write_vector(b.to_host(stream));
    }
  }
}

inline SlotTable read_slots(loom::sdk::StateReader& in, std::size_t per_tensor) {
  const auto groups = in.read_pod<uint64_t>();
  if (groups > in.remaining()) throw Error(LOOM_ERR_DATA_LOSS, "corrupt group count");
  SlotTable slots(static_cast<std::size_t>(groups));
  for (auto& group : slots) {
    const auto tensors = in.read_pod<uint64_t>();
    if (tensors > in.remaining()) throw Error(LOOM_ERR_DATA_LOSS, "corrupt tensor count");
    group.resize(static_cast<std::size_t>(tensors));
    for (Slot& s : group) {
      const auto count = in.read_pod<uint64_t>();
      if (count != per_tensor) {
        throw Error(LOOM_ERR_DATA_LOSS, "a tensor's state has " + std::to_string(count) +
                                            " buffers, expected " + std::to_string(per_tensor));
      }
      for (uint64_t k = 0; k < count; ++k) {
        s.buffers.push_back(Buffer::from_host(in.read_vector<float>()));
      }
      for (const Buffer& b : s.buffers) {
        if (b.size() != s.buffers.front().size()) {
          throw Error(LOOM_ERR_DATA_LOSS, "a tensor's state buffers differ in length");
        }
      }
    }
  }
  return slots;
}

inline void write_moment_state(loom::sdk::StateWriter& out, const char* magic, uint32_t version,
                               uint64_t steps, const SlotTable& slots) {
  out.write_header(magic, version);
  out.write_pod<uint64_t>(steps);
  write_slots(out, slots, nullptr);
}

inline MomentState read_moment_state(std::span<const std::byte> blob, const char* magic,
                                     uint32_t version) {
  loom::sdk::StateReader in(blob);
  in.read_header(magic, version);
  MomentState state;
  state.steps = in.read_pod<uint64_t>();
  state.slots = read_slots(in, 2);
  in.expect_end();
  return state;
}

// The `betas` parameter every Adam-family optimizer declares (same name, default, range).
inline loom::sdk::FloatList betas_param() {
  return loom::sdk::FloatList("betas", {0.9, 0.999}, "Decay rates of the first and second moments.")
      .length(2)
      .min(0)
      .less_than(1);  // as torch.optim: 0 <= beta < 1
}

// Bias correction 1 - beta^t; 1 when it is off, and for t = 0 (nothing accumulated yet, e.g. a
// variance frozen before any update).
inline double bias_correction(bool on, double beta, uint64_t t) {
  return on && t > 0 ? 1.0 - std::pow(beta, static_cast<double>(t)) : 1.0;
}

// The device of the step's tensors (collect() has refused mixed devices); the CPU when
// there are none.
inline DLDevice step_device_of(const std::vector<StepGroup>& groups) {
  for (const auto& g : groups) {
    if (!g.tensors.empty()) {
      const DLDevice d = g.tensors.front().device;
      return loom::sdk::is_cuda(d) ? d : DLDevice{kDLCPU, 0};
    }
  }
  return DLDevice{kDLCPU, 0};
}

}  // namespace loom::optim
