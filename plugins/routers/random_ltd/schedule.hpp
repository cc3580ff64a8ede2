// random_ltd's kept-token schedule (DeepSpeed's fixed_linear with Loom's two fixes) as pure
// functions of the step (1-based), with min = min_value, max = max_value, R = require_steps,
// q = seq_per_step and t = step - 1 (DeepSpeed counts from 0 at the first step):
//   t >= R:  r = max
//   else:    r = floor(t / R * (max - min) + min)   (in double, as DeepSpeed computes it)
//            r -= r mod q;  r = min(r, max);  r = max(r, min)
// The last clamp is Loom's (DeepSpeed's rounding gives 0 for min 8, q 16: no token kept); so is
// max from t >= R on (DeepSpeed's rounding there gives max rounded down to a multiple of q).
// A routed layer in training keeps min(r, seq_len) positions; an unrouted layer, and every
// layer in evaluation, keeps seq_len.
#pragma once

#include <cstdint>
#include <string>

namespace loom::routers::ltd {

struct Schedule {
  int64_t min_value = 1;
  int64_t max_value = 1;
  int64_t require_steps = 1;
  int64_t seq_per_step = 16;
};

// The only schedule_type.
inline constexpr const char* kFixedLinear = "fixed_linear";

// Throws loom::sdk::Error (INVALID_ARGUMENT) naming the parameter: min_value < 1, max_value <
// min_value, require_steps < 1, seq_per_step < 1, a schedule_type other than fixed_linear.
void validate(const Schedule& s, const std::string& schedule_type);

// r at `step` (>= 1; smaller throws INVALID_ARGUMENT naming "step"): in [min, max].
int64_t value_at(const Schedule& s, int64_t step);

// Positions kept per sequence.
int64_t kept_at(const Schedule& s, int64_t step, int64_t seq_len, bool routed, bool training);

}  // namespace loom::routers::ltd
