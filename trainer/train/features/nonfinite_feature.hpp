// LOOM_TRAIN_NONFINITE_GRAD=STEP[:RANK] (a test aid): at global step STEP, rank RANK (the last
// rank when omitted) puts a NaN into its first gradient element right after the backward
// pass, so the optimizer's skipped-step path can be exercised end to end.
#pragma once

#include <cstdlib>
#include <limits>
#include <memory>
#include <string>

#include "feature.hpp"
#include "run.hpp"

namespace loom::trainer {

class NonfiniteFeature final : public Feature {
 public:
  // The variable's feature, or nullptr when it is unset. Throws TrainError on a bad value.
  static std::unique_ptr<NonfiniteFeature> from_environment(Model& model, int rank, int world) {
    const char* v = std::getenv("LOOM_TRAIN_NONFINITE_GRAD");
    if (v == nullptr || *v == '\0') return nullptr;
    const std::string text = v;
    char* end = nullptr;
    const long long step = std::strtoll(text.c_str(), &end, 10);
    bool ok = end != text.c_str();
    long long at_rank = world - 1;
    if (ok && *end == ':') {
      const char* r = end + 1;
      at_rank = std::strtoll(r, &end, 10);
      ok = end != r;
    }
    ok = ok && *end == '\0';
    if (!ok || step < 1 || at_rank < 0 || at_rank >= world) {
      throw TrainError("LOOM_TRAIN_NONFINITE_GRAD='" + text +
                       "': expected STEP or STEP:RANK with STEP >= 1 and RANK in 0.." +
                       std::to_string(world - 1));
    }
    if (at_rank != rank) return std::make_unique<NonfiniteFeature>(model, 0);
    return std::make_unique<NonfiniteFeature>(model, step);
  }

  // `step`: the step whose gradient this rank poisons (0: none).
  NonfiniteFeature(Model& model, int64_t step) : model_(model), step_(step) {}

  void after_backward(int64_t step, StepResult&) override {
    auto& params = model_.parameters();
    if (step == step_ && !params.empty() && params[0].numel > 0) {
      params[0].grad[0] = std::numeric_limits<float>::quiet_NaN();
    }
  }

 private:
  Model& model_;
  int64_t step_;
};

}  // namespace loom::trainer
