#include "schedule.hpp"

#include <common/number.hpp>
#include <loom/sdk/status.hpp>

#include <algorithm>
#include <cmath>
#include <string>

namespace loom::data::curriculum {
namespace {

[[noreturn]] void fail(const std::string& key, const std::string& what) {
  throw loom::sdk::Error(LOOM_ERR_INVALID_ARGUMENT, key + " " + what, key);
}

using loom::common::number;

void check_step(int64_t step) {
  if (step < 1) fail("step", "is " + std::to_string(step) + "; steps are 1-based (the first is 1)");
}

}  // namespace

void validate(const RootSchedule& s) {
  if (!std::isfinite(s.min_difficulty)) fail("min_difficulty", "is not finite");
  if (!std::isfinite(s.max_difficulty)) fail("max_difficulty", "is not finite");
  if (s.min_difficulty > s.max_difficulty) {
    fail("min_difficulty", "(" + number(s.min_difficulty) + ") is above max_difficulty (" +
                               number(s.max_difficulty) + ")");
  }
  // The formula scales by max - min: finite bounds whose difference overflows would make
  // every difficulty before T infinite or NaN.
  if (!std::isfinite(s.max_difficulty - s.min_difficulty)) {
    fail("max_difficulty", "(" + number(s.max_difficulty) + ") minus min_difficulty (" +
                               number(s.min_difficulty) +
                               ") is not a finite number; the schedule scales by that difference");
  }
  if (s.total_curriculum_step < 1) {
    fail("total_curriculum_step",
         "is " + std::to_string(s.total_curriculum_step) + "; must be >= 1");
  }
  if (s.difficulty_step < 1) {
    fail("difficulty_step", "is " + std::to_string(s.difficulty_step) + "; must be >= 1");
  }
  if (!std::isfinite(s.root_degree) || s.root_degree <= 0) {
    fail("root_degree", "is " + number(s.root_degree) + "; must be a finite number > 0");
  }
}

void validate(const DiscreteSchedule& s) {
  if (s.difficulty.size() != s.max_step.size() + 1) {
    fail("difficulty", "has " + std::to_string(s.difficulty.size()) +
                           " entries; it needs one more than max_step (" +
                           std::to_string(s.max_step.size()) + "), so " +
                           std::to_string(s.max_step.size() + 1));
  }
  for (std::size_t i = 0; i < s.difficulty.size(); ++i) {
    if (!std::isfinite(s.difficulty[i])) {
      fail("difficulty", "entry " + std::to_string(i) + " is not finite");
    }
  }
  for (std::size_t i = 0; i < s.max_step.size(); ++i) {
    if (s.max_step[i] < 1) {
      fail("max_step", "entry " + std::to_string(i) + " is " + std::to_string(s.max_step[i]) +
                           "; steps are 1-based, so it must be >= 1");
    }
    if (i > 0 && s.max_step[i] <= s.max_step[i - 1]) {
      fail("max_step", "entry " + std::to_string(i) + " (" + std::to_string(s.max_step[i]) +
                           ") is not above entry " + std::to_string(i - 1) + " (" +
                           std::to_string(s.max_step[i - 1]) + "); it must be strictly increasing");
    }
  }
}

double difficulty_at(const RootSchedule& s, int64_t step) {
  check_step(step);
  const double lo = s.min_difficulty;
  const double hi = s.max_difficulty;
  // Loom's deliberate difference: max from step T on. DeepSpeed's formula rounds max down to
  // a multiple of q at T (max 2047, q 8 gives 2040 there); this also avoids pow of huge
  // ratios long after T.
  if (step >= s.total_curriculum_step) return hi;
  const double ratio = static_cast<double>(step) / static_cast<double>(s.total_curriculum_step);
  const double v = s.root_degree == 1 ? ratio : std::pow(ratio, 1.0 / s.root_degree);
  double d = std::floor(v * (hi - lo) + lo);
  const double q = static_cast<double>(s.difficulty_step);
  double r = std::fmod(d, q);
  if (r < 0) r += q;  // Python's %: the remainder has the sign of q
  d -= r;
  d = std::min(d, hi);
  return std::max(d, lo);
}

double difficulty_at(const DiscreteSchedule& s, int64_t step) {
  check_step(step);
  const double top = *std::max_element(s.difficulty.begin(), s.difficulty.end());
  std::size_t i = 0;
  while (i < s.max_step.size() && step > s.max_step[i]) ++i;
  // Frozen at the maximum: an earlier segment that reached it wins.
  for (std::size_t j = 0; j < i; ++j) {
    if (s.difficulty[j] == top) return top;
  }
  return s.difficulty[i];
}

int64_t seq_len_at(const RootSchedule& s, int64_t step) {
  const double d = difficulty_at(s, step);
  return std::max<int64_t>(1, static_cast<int64_t>(d));
}

}  // namespace loom::data::curriculum
