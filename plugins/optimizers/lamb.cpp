// lamb: LAMB (layer-wise adaptive moments) with the trust ratio clamped to
// [min_coeff, max_coeff], as DeepSpeed's FusedLamb computes it:
//   m, v as in Adam; u = m_hat / (sqrt(v_hat) + eps) + weight_decay * p
//   coeff = clamp(|p| / |u|, min_coeff, max_coeff)  (1 when either norm is 0)
//   p = p - lr * coeff * u
// Both passes run in the step's Backend (backend.hpp), CPU or CUDA by the tensors' device.
#include <loom/sdk.hpp>
#include <loom/sdk/kinds/optimizer.hpp>

#include <cmath>
#include <string>
#include <vector>

#include "moment_optimizer.hpp"

namespace {

using loom::optim::LambHyper;
using loom::sdk::Context;
using loom::sdk::Error;

class Lamb : public loom::optim::MomentOptimizer<Lamb> {
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
      : MomentOptimizer(ctx),
        max_coeff_(ctx.get_float("max_coeff")),
        min_coeff_(ctx.get_float("min_coeff")) {}

  // Checked by `loom check`, at the min_coeff key.
  static void validate_params(Context& params) {
    if (params.get_float("min_coeff") > params.get_float("max_coeff")) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  "min_coeff " + std::to_string(params.get_float("min_coeff")) +
                      " is above max_coeff " + std::to_string(params.get_float("max_coeff")),
                  "min_coeff");
    }
  }

  static constexpr const char* kMagic = "loom.lamb";
  static constexpr uint32_t kVersion = 1;
  static constexpr bool kLogRestore = false;

  void update(loom::optim::Backend& be, std::vector<loom::optim::TensorRef>& refs,
              const loom::optim::MomentStep& s) {
    auto h = base_hyper<LambHyper>(s);
    h.wd = static_cast<float>(s.wd);
    h.inv_bc1 = static_cast<float>(1.0 / s.bc1);
    h.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(s.bc2));
    be.lamb(refs, h, s.lr, min_coeff_, max_coeff_);
  }

 private:
  double max_coeff_;
  double min_coeff_;
};

}  // namespace

LOOM_PLUGIN("lamb", "1.0.0", "LAMB with clamped trust ratio, fused CPU and CUDA kernels",
            loom::sdk::factory<Lamb>());
