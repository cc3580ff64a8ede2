// adam: Adam and AdamW (adam_w_mode) as torch.optim.Adam / AdamW compute them, fused in
// one pass per element on the CPU (Highway) or one multi-tensor launch per group on CUDA
// (backend.hpp: one Backend, chosen by the step's device).
#include <loom/sdk.hpp>
#include <loom/sdk/kinds/optimizer.hpp>

#include <cmath>
#include <span>
#include <string>
#include <vector>

#include "backend.hpp"
#include "common.hpp"
#include "finite_check.hpp"

namespace {

using loom::optim::AdamHyper;
using loom::sdk::Context;
using loom::sdk::Error;

class Adam : public loom::sdk::Optimizer {
 public:
  static loom::sdk::Schema schema() {
    using namespace loom::sdk;
    return {
        loom::optim::betas_param(),
        Float("eps", 1e-8, "Added to sqrt(v_hat) in the denominator (torch.optim placement).")
            .range(0, 1),
        Float("weight_decay", 0.0, "Weight decay; a group's weight_decay overrides it.").min(0),
        Bool("adam_w_mode", true,
             "true: decoupled weight decay (AdamW); false: L2 added to the gradient (Adam)."),
        Bool("bias_correction", true, "Divide the moments by (1 - beta^t)."),
        loom::optim::skip_nonfinite_param(),
    };
  }

  explicit Adam(Context& ctx)
      : ctx_(ctx),
        beta1_(ctx.get_float_list("betas")[0]),
        beta2_(ctx.get_float_list("betas")[1]),
        eps_(ctx.get_float("eps")),
        weight_decay_(ctx.get_float("weight_decay")),
        adam_w_mode_(ctx.get_bool("adam_w_mode")),
        bias_correction_(ctx.get_bool("bias_correction")),
        skip_nonfinite_(ctx.get_bool("skip_nonfinite")) {}

  void step(const loom_optimizer_step_args& args) {
    auto groups = loom::optim::collect(args, weight_decay_, /*allow_cuda=*/true);
    loom::optim::expect_layout(slots_, groups);
    const float inv_scale = static_cast<float>(1.0 / args.grad_scale);
    if (loom::optim::skip_nonfinite_step(skip_nonfinite_, finite_, groups, args, inv_scale,
                                         skipped_, ctx_)) {
      return;
    }
    loom::optim::Backend& be = backends_.begin(groups, args.stream);
    loom::optim::StepBackend::End end(backends_);
    loom::optim::ensure_slots(slots_, groups, 2, args.stream);
    const uint64_t t = steps_ + 1;
    const double bc1 = loom::optim::bias_correction(bias_correction_, beta1_, t);
    const double bc2 = loom::optim::bias_correction(bias_correction_, beta2_, t);
    for (std::size_t g = 0; g < groups.size(); ++g) {
      const double lr = args.lr * groups[g].lr_scale;
      const double wd = groups[g].weight_decay;
      AdamHyper h;
      h.set_betas(beta1_, beta2_);
      h.eps = static_cast<float>(eps_);
      h.inv_scale = inv_scale;
      h.l2 = adam_w_mode_ ? 0.0f : static_cast<float>(wd);
      h.decay = adam_w_mode_ ? static_cast<float>(1.0 - lr * wd) : 1.0f;
      h.step_size = static_cast<float>(lr / bc1);
      h.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
      std::vector<loom::optim::TensorRef> refs;
      for (std::size_t i = 0; i < groups[g].tensors.size(); ++i) {
        loom::optim::TensorRef r = groups[g].tensors[i].ref;
        r.m = slots_[g][i].buffers[0].data();
        r.v = slots_[g][i].buffers[1].data();
        refs.push_back(r);
      }
      be.adam(refs, h);
    }
    end.done();
    steps_ = t;
    loom::optim::report_found_inf(args, false);
  }

  // adam and lamb never communicate; they report the steps they skipped.
  void comm_info(loom_optimizer_comm_info& out) {
    out.owns_communication = 0;
    out.skipped_steps = skipped_;
  }

  // Format v1: header, step count, slot table ({m, v} per tensor).
  void export_state(loom::sdk::StateWriter& out) {
    backends_.synchronize();  // the copies run on the legacy default stream
    loom::optim::write_moment_state(out, kMagic, kVersion, steps_, slots_);
  }

  void import_state(std::span<const std::byte> blob) {
    auto state = loom::optim::read_moment_state(blob, kMagic, kVersion);
    steps_ = state.steps;
    slots_ = std::move(state.slots);
    ctx_.debug("restored state at step " + std::to_string(steps_));
  }

 private:
  static constexpr const char* kMagic = "loom.adam";
  static constexpr uint32_t kVersion = 1;

  Context ctx_;
  double beta1_;
  double beta2_;
  double eps_;
  double weight_decay_;
  bool adam_w_mode_;
  bool bias_correction_;
  bool skip_nonfinite_;
  uint64_t steps_ = 0;
  loom::optim::SlotTable slots_;  // {m, v} per tensor
  uint64_t skipped_ = 0;          // steps skipped for a non-finite gradient (not exported)
  loom::optim::FiniteFlag finite_;
  loom::optim::StepBackend backends_;
};

}  // namespace

LOOM_PLUGIN("adam", "1.0.0", "Adam and AdamW, fused CPU (SIMD, threads) and CUDA kernels",
            loom::sdk::factory<Adam>());
