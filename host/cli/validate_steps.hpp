// `loom validate-plugin`'s step stage: one call of a kind's main function on small made-up
// inputs, for the kinds where that needs nothing but the instance (an optimizer step, a
// schedule's value at a step, a sampler's first batch, an allreduce in a world of one).
#pragma once

#include <loom/embed.h>

#include <string>

namespace loom_validate {

struct StepResult {
  enum class Status { kOk, kFailed, kSkipped };
  Status status = Status::kSkipped;
  std::string note;  // what ran (ok), what went wrong (failed) or why not (skipped)
};

// `section`: the manifest section of the instance's kind ("optimizer").
StepResult generic_step(const std::string& section, loom_instance* instance);

}  // namespace loom_validate
