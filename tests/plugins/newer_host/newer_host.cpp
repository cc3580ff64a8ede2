// newer_host: a test-only SDK optimizer that declares it needs a host one ABI minor newer
// than this one (as a plugin built against a later minor's headers and using what that minor
// added would), so tests see it refuse at create with both versions named instead of reading
// fields this host does not have.
#include <loom/sdk/kinds/optimizer.hpp>

namespace {

class NeedsNewerHost : public loom::sdk::Optimizer {
 public:
  static constexpr uint16_t kRequiredHostMinor = LOOM_ABI_MINOR + 1;
  explicit NeedsNewerHost(loom::sdk::Context& /*ctx*/) {}
  void step(const loom_optimizer_step_args& /*args*/) {}
};

}  // namespace

LOOM_PLUGIN("newer_host", "1.0.0", "needs a newer host than this one (tests)",
            loom::sdk::factory<NeedsNewerHost>());
