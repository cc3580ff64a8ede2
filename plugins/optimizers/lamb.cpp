// lamb: LAMB (layer-wise adaptive moments) with the trust ratio clamped to
// [min_coeff, max_coeff], as DeepSpeed's FusedLamb computes it:
//   m, v as in Adam; u = m_hat / (sqrt(v_hat) + eps) + weight_decay * p
//   coeff = clamp(|p| / |u|, min_coeff, max_coeff)  (1 when either norm is 0)
//   p = p - lr * coeff * u
// Both passes run in the step's Backend (backend.hpp), CPU or CUDA by the tensors' device.
#include <loom/sdk.hpp>
#include <loom/sdk/kinds/optimizer.hpp>

#include <algorithm>
#include <cmath>
#include <span>
#include <string>
#include <vector>

#include "backend.hpp"
#include "common.hpp"
#include "finite_check.hpp"

namespace {

using loom::optim::LambHyper;
using loom::sdk::Context;
using loom::sdk::Error;

class Lamb : public loom::sdk::Optimizer {
 public:
  static loom::sdk::Schema schema() {
    using namespace loom::sdk;
    return {
        loom::optim::betas_param(),
        Float("eps", 1e-8, "Added to sqrt(v_hat) in the denominator.").range(0, 1),
        Float("weight_decay", 0.0,
              "Decoupled weight decay inside the update u; a group's "
              "weight_decay overrides it.")
            .min(0),
        Bool("bias_correction", true, "Divide the moments by (1 - beta^t)."),
        loom::optim::skip_nonfinite_param(),
        Float("max_coeff", 10.0, "Upper clamp of the trust ratio |p| / |u|.").min(0),
        Float("min_coeff", 0.01, "Lower clamp of the trust ratio |p| / |u|.").min(0),
    };
  }

  explicit Lamb(Context& ctx)
      : ctx_(ctx),
        beta1_(ctx.get_float_list("betas")[0]),
        beta2_(ctx.get_float_list("betas")[1]),
        eps_(ctx.get_float("eps")),
        weight_decay_(ctx.get_float("weight_decay")),
        bias_correction_(ctx.get_bool("bias_correction")),
        max_coeff_(ctx.get_float("max_coeff")),
        min_coeff_(ctx.get_float("min_coeff")),
        skip_nonfinite_(ctx.get_bool("skip_nonfinite")) {}

  // Checked by `loom check`, at the min_coeff key.
  static void validate_params(Context& params) {
    if (params.get_float("min_coeff") > params.get_float("max_coeff")) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  "min_coeff " + std::to_string(params.get_float("min_coeff")) +
                      " is above max_coeff " + std::to_string(params.get_float("max_coeff")),
                  "min_coeff");
    }
  }

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
      LambHyper h;
      h.set_betas(beta1_, beta2_);
      h.eps = static_cast<float>(eps_);
      h.inv_scale = inv_scale;
      h.wd = static_cast<float>(groups[g].weight_decay);
      h.inv_bc1 = static_cast<float>(1.0 / bc1);
      h.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
      std::vector<loom::optim::TensorRef> refs;
      for (std::size_t i = 0; i < groups[g].tensors.size(); ++i) {
        loom::optim::TensorRef r = groups[g].tensors[i].ref;
        r.m = slots_[g][i].buffers[0].data();
        r.v = slots_[g][i].buffers[1].data();
        refs.push_back(r);
      }
      be.lamb(refs, h, lr, min_coeff_, max_coeff_);
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

  void export_state(loom::sdk::StateWriter& out) {
    backends_.synchronize();  // the copies run on the legacy default stream
    loom::optim::write_moment_state(out, kMagic, kVersion, steps_, slots_);
  }

  void import_state(std::span<const std::byte> blob) {
    auto state = loom::optim::read_moment_state(blob, kMagic, kVersion);
    steps_ = state.steps;
    slots_ = std::move(state.slots);
  }

 private:
  static constexpr const char* kMagic = "loom.lamb";
  static constexpr uint32_t kVersion = 1;

  Context ctx_;
  double beta1_;
  double beta2_;
  double eps_;
  double weight_decay_;
  bool bias_correction_;
  double max_coeff_;
  double min_coeff_;
  bool skip_nonfinite_;
  uint64_t steps_ = 0;
  loom::optim::SlotTable slots_;  // {m, v} per tensor
  uint64_t skipped_ = 0;          // steps skipped for a non-finite gradient (not exported)
  loom::optim::FiniteFlag finite_;
  loom::optim::StepBackend backends_;
};

}  // namespace

LOOM_PLUGIN("lamb", "1.0.0", "LAMB with clamped trust ratio, fused CPU and CUDA kernels",
            loom::sdk::factory<Lamb>());
