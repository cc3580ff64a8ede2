// state_counter: a test-only loom.optimizer/1 built with the SDK whose exported state says how
// many times it was serialised, so tests can see the SDK's framing and export cache from
// outside. step() adds 1 to every byte of a `payload_bytes` payload (parameters and gradients
// are ignored); the state is, after the SDK header, the step count, the number of times
// export_state has run (including the one writing it) and the payload.
#include <loom/sdk/kinds/optimizer.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace {

using loom::sdk::Context;
using loom::sdk::Error;

class StateCounter : public loom::sdk::Optimizer {
 public:
  static loom::sdk::Schema schema() {
    return {
        loom::sdk::Int("payload_bytes", 64, "Bytes of payload in the state.").range(0, 1 << 20)};
  }

  explicit StateCounter(Context& ctx)
      : payload_(static_cast<std::size_t>(ctx.get_int("payload_bytes"))) {
    for (std::size_t i = 0; i < payload_.size(); ++i) payload_[i] = static_cast<uint8_t>(i * 7);
  }

  void step(const loom_optimizer_step_args& /*args*/) {
    ++steps_;
    for (auto& b : payload_) ++b;
  }

  void export_state(loom::sdk::StateWriter& out) {
    ++serialisations_;
    out.write_header(kMagic, kVersion);
    out.write_pod(steps_);
    out.write_pod(serialisations_);
    out.write_vector(payload_);
  }

  void import_state(std::span<const std::byte> blob) {
    loom::sdk::StateReader in(blob);
    in.read_header(kMagic, kVersion);
    const auto steps = in.read_pod<int64_t>();
    const auto serialisations = in.read_pod<int64_t>();
    auto payload = in.read_vector<uint8_t>();
    in.expect_end();
    if (payload.size() != payload_.size()) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT, "state has " + std::to_string(payload.size()) +
                                                 " payload bytes, this instance " +
                                                 std::to_string(payload_.size()));
    }
    steps_ = steps;
    serialisations_ = serialisations;
    payload_ = std::move(payload);
  }

 private:
  static constexpr const char* kMagic = "loom.test.state_counter";
  static constexpr uint32_t kVersion = 1;

  int64_t steps_ = 0;
  int64_t serialisations_ = 0;
  std::vector<uint8_t> payload_;
};

}  // namespace

LOOM_PLUGIN("state_counter", "1.0.0", "Counts its own state exports (tests only)",
            loom::sdk::factory<StateCounter>());
