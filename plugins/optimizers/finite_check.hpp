// Skipping steps whose gradients are not finite, as torch's GradScaler does with found_inf:
// the optimizers check every gradient of a step (divided by grad_scale, in fp32 as their
// kernels compute it) before they change anything, and a step with a NaN or an Inf leaves
// parameters and state exactly as they were and is reported through
// loom_optimizer_step_args.found_inf and comm_info's skipped_steps. The manifest parameter
// skip_nonfinite = false turns it off (the NaN then propagates, as before ABI 1.2).
#pragma once

#include <loom/sdk.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common.hpp"
#include "kernels/finite.hpp"

namespace loom::optim {

// The parameter every optimizer declares (same name, default and doc).
inline loom::sdk::Bool skip_nonfinite_param() {
  return loom::sdk::Bool(
      "skip_nonfinite", true,
      "Skip a step whose gradients (divided by grad_scale) hold a NaN or an Inf: parameters "
      "and optimizer state stay as they were, the step reports found_inf = 1 and counts in "
      "comm_info's skipped_steps. false: no check, a non-finite gradient propagates.");
}

// Writes the caller's found_inf out-field when it passed one (a caller built against an
// older minor has none: the SDK's normalized copy of its args reads it as NULL).
inline void report_found_inf(const loom_optimizer_step_args& args, bool skipped) {
  if (args.found_inf != nullptr) *args.found_inf = skipped ? 1 : 0;
}

// One flag (a float: 0 finite, 1 not) on the step's device, set by the finite-check kernels
// and read back once per step. The buffer is kept between steps (no allocation per step).
class FiniteFlag {
 public:
  // Zeroes the flag on `device` (allocating it there on first use or after a move).
  void reset(DLDevice device, void* stream) {
    const bool same = flag_.size() == 1 && loom::sdk::same_device(flag_.device(), device);
    if (!same) {
      flag_ = Buffer::zeros(1, device, stream);
      return;
    }
    if (flag_.on_cuda()) {
      Buffer::check_cuda(cuda::memset_zero(flag_.data(), sizeof(float), stream));
    } else {
      flag_.data()[0] = 0.0f;
    }
  }

  // Sets the flag when any tensor's elements, times inv_scale, are not finite. The tensors
  // are on the flag's device.
  void check(const std::vector<FiniteInput>& tensors, float inv_scale, void* stream) {
    if (tensors.empty()) return;
    if (flag_.on_cuda()) {
      Buffer::check_cuda(
          cuda::flag_nonfinite(tensors.data(), tensors.size(), inv_scale, flag_.data(), stream));
      return;
    }
    if (flag_.data()[0] != 0.0f) return;
    for (const FiniteInput& t : tensors) {
      if (!all_finite_cpu(t, inv_scale)) {
        flag_.data()[0] = 1.0f;
        return;
      }
    }
  }

  // The flag buffer (one fp32 on the device), e.g. for an allreduce MAX over the ranks.
  Buffer& buffer() { return flag_; }

  // True when the flag is set; synchronizes the stream when the flag is on a device.
  bool raised(void* stream) const {
    if (!flag_.on_cuda()) return flag_.data()[0] != 0.0f;
    return flag_.to_host(stream)[0] != 0.0f;
  }

 private:
  Buffer flag_;
};

// The step's gradients as finite-check inputs.
inline std::vector<FiniteInput> gradient_inputs(const std::vector<StepGroup>& groups) {
  std::vector<FiniteInput> out;
  for (const auto& g : groups) {
    for (const auto& t : g.tensors) out.push_back({t.ref.g, t.ref.gtype, t.ref.n});
  }
  return out;
}

// adam and lamb: true when every gradient of the step, times inv_scale, is finite. Their
// gradients are already averaged over the ranks by the trainer, so a NaN on any rank
// reaches every rank and all of them skip the same step without talking.
inline bool gradients_finite(FiniteFlag& flag, const std::vector<StepGroup>& groups,
                             float inv_scale, void* stream) {
  const DLDevice device = step_device_of(groups);
  flag.reset(device, stream);
  flag.check(gradient_inputs(groups), inv_scale, stream);
  return !flag.raised(stream);
}

// adam's and lamb's first move in a step: when checking is on and a gradient is not finite,
// counts the skip, logs it, reports found_inf and returns true (the step then changes
// nothing).
inline bool skip_nonfinite_step(bool enabled, FiniteFlag& flag,
                                const std::vector<StepGroup>& groups,
                                const loom_optimizer_step_args& args, float inv_scale,
                                uint64_t& skipped, const loom::sdk::Context& ctx) {
  if (!enabled || gradients_finite(flag, groups, inv_scale, args.stream)) return false;
  ++skipped;
  ctx.debug("step " + std::to_string(args.step) + " skipped: a gradient is not finite");
  report_found_inf(args, true);
  return true;
}

}  // namespace loom::optim
