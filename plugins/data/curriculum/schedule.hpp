// Difficulty schedules of curriculum learning as pure functions of the training step (steps
// are 1-based: the first step is 1). The plugins fixed_linear, fixed_root, fixed_discrete and
// seqlen_warmup (this folder) wrap them; docs/data.md "Schedules" gives the formulas.
//
// Root schedules (fixed_linear is fixed_root with root_degree 1), with s the step, T
// total_curriculum_step, k root_degree, q difficulty_step:
//   v = (s / T)^(1/k);  d = floor(v * (max - min) + min);  d -= d mod q (rounded down, the
//   remainder taken as Python's %, so d is a multiple of q);  d = min(d, max);  d = max(d, min).
// The last clamp is Loom's: without it a min that is not a multiple of q rounds below min
// (min 1, q 8 gives 0 at step 1). The value never decreases with s and is max from s >= T on
// (also Loom's: at T the formula rounds a max that is not a multiple of q down).
//
// Discrete schedules: difficulty[i] for the first i with s <= max_step[i], the last
// difficulty after the last max_step; once the largest listed difficulty has been reached it
// stays (the schedule is frozen at its maximum, also if a later entry is smaller).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace loom::data::curriculum {

struct RootSchedule {
  double min_difficulty = 0;
  double max_difficulty = 0;
  int64_t total_curriculum_step = 1;
  int64_t difficulty_step = 1;
  double root_degree = 1;  // 1: fixed_linear
};

struct DiscreteSchedule {
  std::vector<double> difficulty;  // len(max_step) + 1 entries
  std::vector<int64_t> max_step;   // strictly increasing, >= 1
};

// Throw loom::sdk::Error (INVALID_ARGUMENT) naming the parameter key ("max_difficulty") for
// parameters the formulas cannot use: min > max, a non-finite value or max - min, T < 1,
// q < 1, k <= 0,
// len(difficulty) != len(max_step) + 1, max_step not strictly increasing or < 1.
void validate(const RootSchedule& s);
void validate(const DiscreteSchedule& s);

// The difficulty at `step` (>= 1; a smaller step throws INVALID_ARGUMENT naming "step").
// The parameters must have passed validate().
double difficulty_at(const RootSchedule& s, int64_t step);
double difficulty_at(const DiscreteSchedule& s, int64_t step);

// Sequence-length warmup: a root schedule over lengths (min_difficulty >= 1), the length as
// an integer (>= 1).
int64_t seq_len_at(const RootSchedule& s, int64_t step);

}  // namespace loom::data::curriculum
