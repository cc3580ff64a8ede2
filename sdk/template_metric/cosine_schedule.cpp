// cosine_schedule: a loom.curriculum/1 difficulty schedule (a `custom` schedule in
// DeepSpeed's terms, shipped as a plugin). The difficulty rises from min_difficulty to
// max_difficulty along half a cosine over total_curriculum_step steps, slowly at first and
// at the end, fastest in the middle, then stays at max_difficulty:
//
//   f(s) = (1 - cos(pi * s / T)) / 2                       s = step (1-based), T = total
//   d(s) = floor(min + f(s) * (max - min)), rounded down to a multiple of difficulty_step,
//          then clamped to [min_difficulty, max_difficulty], for s < T
//   d(s) = max_difficulty                                   for s >= T
//
// (like the bundled schedules: from T on the difficulty is max itself, also when max is
// not a multiple of difficulty_step, which the rounding would take below it).
//
// A starting point for your own schedule: at() is a pure function of the step, so the
// instance has no state to export and a resumed run gets the same difficulties; parameters
// that only make sense together are checked in validate_params, so `loom check` reports them
// at the key to blame.
//
// The class has at and no score, so the SDK reports it as a schedule (roles =
// LOOM_CURRICULUM_SCHEDULE) and leaves count and score NULL. Its difficulty is not a
// sequence length (seq_len_mode NONE, the SDK's default; a sequence-length schedule would
// set it in plan() and fill at()'s seq_len).
#include <loom/kinds/curriculum.h>
#include <loom/sdk.hpp>
#include <loom/sdk/kinds/curriculum.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

namespace {

using loom::sdk::Context;
using loom::sdk::Error;

class CosineSchedule : public loom::sdk::Curriculum {
 public:
  static loom::sdk::Schema schema() {
    using namespace loom::sdk;
    return {
        Float("min_difficulty", 0.0, "Difficulty at the first step.").min(0),
        Float("max_difficulty", 100.0, "Difficulty from total_curriculum_step on.").min(0),
        Int("total_curriculum_step", 1000, "Steps the difficulty takes to reach its maximum.")
            .int_range(1, INT64_MAX),
        Int("difficulty_step", 1, "Difficulties are multiples of this (e.g. 8 for lengths).")
            .int_range(1, INT64_MAX),
    };
  }

  static void validate_params(Context& params) {
    if (params.get_float("max_difficulty") < params.get_float("min_difficulty")) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT, "max_difficulty must be >= min_difficulty",
                  "max_difficulty");
    }
  }

  explicit CosineSchedule(Context& ctx)
      : min_(ctx.get_float("min_difficulty")),
        max_(ctx.get_float("max_difficulty")),
        total_(ctx.get_int("total_curriculum_step")),
        quantum_(ctx.get_int("difficulty_step")) {}

  // [instance]; the SDK has checked that step >= 1.
  void at(loom_curriculum_at_args& a) {
    a.seq_len = 0;  // not a sequence-length schedule
    if (a.step >= total_) {
      a.difficulty = max_;  // from T on: max, not max rounded down
      return;
    }
    constexpr double kPi = 3.14159265358979323846;
    const double f =
        (1.0 - std::cos(kPi * static_cast<double>(a.step) / static_cast<double>(total_))) / 2.0;
    double d = std::floor(min_ + f * (max_ - min_));
    d -= std::fmod(d, static_cast<double>(quantum_));
    a.difficulty = std::clamp(d, min_, max_);
  }

 private:
  double min_;
  double max_;
  int64_t total_;
  int64_t quantum_;
};

}  // namespace

LOOM_PLUGIN("cosine_schedule", "1.0.0",
            "Difficulty schedule: min to max along half a cosine over total_curriculum_step",
            loom::sdk::factory<CosineSchedule>());
