#include "schedule.hpp"

#include <loom/sdk/status.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace loom::routers::ltd {
namespace {

[[noreturn]] void fail(const std::string& key, const std::string& what) {
  throw loom::sdk::Error(LOOM_ERR_INVALID_ARGUMENT, key + " " + what, key);
}

}  // namespace

void validate(const Schedule& s, const std::string& schedule_type) {
  if (schedule_type != kFixedLinear) {
    fail("schedule_type", "is \"" + schedule_type + "\"; the only schedule random_ltd has is \"" +
                              kFixedLinear + "\"");
  }
  if (s.min_value < 1) fail("min_value", "is " + std::to_string(s.min_value) + "; must be >= 1");
  if (s.max_value > INT32_MAX) {
    fail("max_value",
         "is " + std::to_string(s.max_value) + "; must be <= 2^31 - 1 (positions are int32)");
  }
  if (s.max_value < s.min_value) {
    fail("max_value", "(" + std::to_string(s.max_value) + ") is below min_value (" +
                          std::to_string(s.min_value) + ")");
  }
  if (s.require_steps < 1) {
    fail("require_steps", "is " + std::to_string(s.require_steps) + "; must be >= 1");
  }
  if (s.seq_per_step < 1) {
    fail("seq_per_step", "is " + std::to_string(s.seq_per_step) + "; must be >= 1");
  }
}

int64_t value_at(const Schedule& s, int64_t step) {
  if (step < 1) {
    fail("step", "is " + std::to_string(step) + "; steps are 1-based (the first is 1)");
  }
  const int64_t t = step - 1;
  if (t >= s.require_steps) return s.max_value;
  const double ratio = static_cast<double>(t) / static_cast<double>(s.require_steps);
  const double v = std::floor(ratio * static_cast<double>(s.max_value - s.min_value) +
                              static_cast<double>(s.min_value));
  // v is in [min, max] (ratio < 1), so it converts exactly.
  auto r = static_cast<int64_t>(v);
  r -= r % s.seq_per_step;  // r >= 0: C++'s % is Python's here
  r = std::min(r, s.max_value);
  return std::max(r, s.min_value);
}

int64_t kept_at(const Schedule& s, int64_t step, int64_t seq_len, bool routed, bool training) {
  if (!routed || !training) return seq_len;
  return std::min(value_at(s, step), seq_len);
}

}  // namespace loom::routers::ltd
