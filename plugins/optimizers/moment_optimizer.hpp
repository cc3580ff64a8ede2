// What adam and lamb share: the parameters both read (betas, eps, weight_decay,
// bias_correction, skip_nonfinite), the step's frame (collect, layout check, non-finite skip,
// backend, {m, v} slots, bias corrections) and the state format v1 (header, step count, slot
// table). Each plugin adds its own parameters and the per-group update (Derived::update).
#pragma once

#include <loom/sdk.hpp>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "backend.hpp"
#include "common.hpp"
#include "finite_check.hpp"

namespace loom::optim {

// The per-step values a group's update needs besides its tensors.
struct MomentStep {
  double lr = 0.0;   // args.lr * the group's lr_scale
  double wd = 0.0;   // the group's weight_decay
  double bc1 = 1.0;  // 1 - beta1^t (1 without bias correction)
  double bc2 = 1.0;  // 1 - beta2^t
  float inv_scale = 1.0f;
};

// Derived: kMagic, kVersion, kLogRestore (a debug line on import) and
// void update(Backend&, std::vector<TensorRef>&, const MomentStep&).
template <class Derived>
class MomentOptimizer : public loom::sdk::Optimizer {
 public:
  explicit MomentOptimizer(loom::sdk::Context& ctx)
      : ctx_(ctx),
        beta1_(ctx.get_float_list("betas")[0]),
        beta2_(ctx.get_float_list("betas")[1]),
        eps_(ctx.get_float("eps")),
        weight_decay_(ctx.get_float("weight_decay")),
        bias_correction_(ctx.get_bool("bias_correction")),
        skip_nonfinite_(ctx.get_bool("skip_nonfinite")) {}

  void step(const loom_optimizer_step_args& args) {
    auto groups = collect(args, weight_decay_, /*allow_cuda=*/true);
    expect_layout(slots_, groups);
    const float inv_scale = static_cast<float>(1.0 / args.grad_scale);
    if (skip_nonfinite_step(skip_nonfinite_, finite_, groups, args, inv_scale, skipped_, ctx_)) {
      return;
    }
    Backend& be = backends_.begin(groups, args.stream);
    StepBackend::End end(backends_);
    ensure_slots(slots_, groups, 2, args.stream);
    const uint64_t t = steps_ + 1;
    MomentStep s;
    s.bc1 = bias_correction(bias_correction_, beta1_, t);
    s.bc2 = bias_correction(bias_correction_, beta2_, t);
    s.inv_scale = inv_scale;
    for (std::size_t g = 0; g < groups.size(); ++g) {
      s.lr = args.lr * groups[g].lr_scale;
      s.wd = groups[g].weight_decay;
      std::vector<TensorRef> refs;
      for (std::size_t i = 0; i < groups[g].tensors.size(); ++i) {
        TensorRef r = groups[g].tensors[i].ref;
        r.m = slots_[g][i].buffers[0].data();
        r.v = slots_[g][i].buffers[1].data();
        refs.push_back(r);
      }
      static_cast<Derived&>(*this).update(be, refs, s);
    }
    end.done();
    steps_ = t;
    report_found_inf(args, false);
  }

  // adam and lamb never communicate; they report the steps they skipped.
  void comm_info(loom_optimizer_comm_info& out) {
    out.owns_communication = 0;
    out.skipped_steps = skipped_;
  }

  // Format v1: header, step count, slot table ({m, v} per tensor).
  void export_state(loom::sdk::StateWriter& out) {
    backends_.synchronize();  // the copies run on the legacy default stream
    write_moment_state(out, Derived::kMagic, Derived::kVersion, steps_, slots_);
  }

  void import_state(std::span<const std::byte> blob) {
    auto state = read_moment_state(blob, Derived::kMagic, Derived::kVersion);
    steps_ = state.steps;
    slots_ = std::move(state.slots);
    if (Derived::kLogRestore) ctx_.debug("restored state at step " + std::to_string(steps_));
  }

 protected:
  // The hyperparameters both updates start from: betas, eps and the gradient's unscale.
  template <class Hyper>
  Hyper base_hyper(const MomentStep& s) const {
    Hyper h;
    h.set_betas(beta1_, beta2_);
    h.eps = static_cast<float>(eps_);
    h.inv_scale = s.inv_scale;
    return h;
  }

 private:
  loom::sdk::Context ctx_;
  double beta1_;
  double beta2_;
  double eps_;
  double weight_decay_;
  bool bias_correction_;
  bool skip_nonfinite_;
  uint64_t steps_ = 0;
  SlotTable slots_;       // {m, v} per tensor
  uint64_t skipped_ = 0;  // steps skipped for a non-finite gradient (not exported)
  FiniteFlag finite_;
  StepBackend backends_;
};

}  // namespace loom::optim
