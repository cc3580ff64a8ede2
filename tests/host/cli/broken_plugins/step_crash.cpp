// step_crash: a valid SDK optimizer, with defaults for everything, whose step dereferences
// NULL: `loom validate-plugin` must pass load, schema and create, and name the step stage.
#include <loom/sdk/kinds/optimizer.hpp>

namespace {

int* volatile nowhere = nullptr;  // volatile: the store is emitted as written

class StepCrash : public loom::sdk::Optimizer {
 public:
  explicit StepCrash(loom::sdk::Context& /*ctx*/) {}
  void step(const loom_optimizer_step_args& /*args*/) { *nowhere = 1; }
};

}  // namespace

LOOM_PLUGIN("step_crash", "1.0.0", "crashes in its step (tests)", loom::sdk::factory<StepCrash>());
