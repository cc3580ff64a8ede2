// adam: Adam and AdamW (adam_w_mode) as torch.optim.Adam / AdamW compute them, fused in
// one pass per element on the CPU (Highway) or one multi-tensor launch per group on CUDA
// (backend.hpp: one Backend, chosen by the step's device).
#include <loom/sdk.hpp>
#include <loom/sdk/kinds/optimizer.hpp>

#include <cmath>
#include <vector>

#include "moment_optimizer.hpp"

namespace {

using loom::optim::AdamHyper;
using loom::sdk::Context;

class Adam : public loom::optim::MomentOptimizer<Adam> {
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

  explicit Adam(Context& ctx) : MomentOptimizer(ctx), adam_w_mode_(ctx.get_bool("adam_w_mode")) {}

  static constexpr const char* kMagic = "loom.adam";
  static constexpr uint32_t kVersion = 1;
  static constexpr bool kLogRestore = true;

  void update(loom::optim::Backend& be, std::vector<loom::optim::TensorRef>& refs,
              const loom::optim::MomentStep& s) {
    auto h = base_hyper<AdamHyper>(s);
    h.l2 = adam_w_mode_ ? 0.0f : static_cast<float>(s.wd);
    h.decay = adam_w_mode_ ? static_cast<float>(1.0 - s.lr * s.wd) : 1.0f;
    h.step_size = static_cast<float>(s.lr / s.bc1);
    h.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(s.bc2));
    be.adam(refs, h);
  }

 private:
  bool adam_w_mode_;
};

}  // namespace

LOOM_PLUGIN("adam", "1.0.0", "Adam and AdamW, fused CPU (SIMD, threads) and CUDA kernels",
            loom::sdk::factory<Adam>());
