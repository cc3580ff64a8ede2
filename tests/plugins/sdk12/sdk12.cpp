// sdk12: an SDK optimizer using the SDK side of ABI 1.2: a validate_params hook that blames a
// key (nesterov without momentum) or the instance as a whole (seed 13), exclusive bounds
// (greater_than, less_than) and exact int64 ranges (int_range, int_min). Its state is the
// number of imports it has taken (uint64); the step does nothing.
#include <loom/sdk.hpp>
#include <loom/sdk/kinds/optimizer.hpp>

#include <cstdint>
#include <span>

namespace {

using loom::sdk::Error;

class Sdk12 : public loom::sdk::Optimizer {
 public:
  static loom::sdk::Schema schema() {
    using namespace loom::sdk;
    return {
        Float("momentum", 0.0, "Momentum factor.").range(0, 1),
        Bool("nesterov", false, "Nesterov momentum; needs momentum > 0."),
        Float("eps", 1e-8, "Added to a denominator.").greater_than(0),
        Float("beta", 0.5, "Strictly between 0 and 1.").greater_than(0).less_than(1),
        Int("seed", 0, "Exact bounds past 2^53.").int_range(-9007199254740993, 9007199254740993),
        IntList("sizes", {1}, "Each at least 1.").int_min(1),
    };
  }

  static void validate_params(loom::sdk::Context& p) {
    if (p.get_bool("nesterov") && p.get_float("momentum") <= 0.0) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT, "nesterov needs momentum > 0", "nesterov");
    }
    if (p.get_int("seed") == 13) throw Error(LOOM_ERR_INVALID_ARGUMENT, "seed 13 is refused");
  }

  explicit Sdk12(loom::sdk::Context& /*ctx*/) {}
  void step(const loom_optimizer_step_args& /*args*/) {}
  void export_state(loom::sdk::StateWriter& out) { out.write_pod<uint64_t>(imports_); }
  void import_state(std::span<const std::byte> blob) {
    loom::sdk::StateReader in(blob);
    const auto before = in.read_pod<uint64_t>();
    in.expect_end();
    imports_ = before + 1;
  }

 private:
  uint64_t imports_ = 0;
};

}  // namespace

LOOM_PLUGIN("sdk12", "1.2.0", "SDK plugin using the ABI 1.2 core (tests)",
            loom::sdk::factory<Sdk12>());
