// The parameters the schedule plugins share (DeepSpeed's key names), read into the structs of
// schedule.hpp. Only the schedule plugins include this (it needs the SDK).
#pragma once

#include <loom/sdk.hpp>

#include <cstdint>
#include <string>

#include "schedule.hpp"

namespace loom::data::curriculum {

inline loom::sdk::Float min_difficulty_param(const char* what) {
  return loom::sdk::Float("min_difficulty", 0.0, what).required();
}
inline loom::sdk::Float max_difficulty_param(const char* what) {
  return loom::sdk::Float("max_difficulty", 0.0, what).required();
}
inline loom::sdk::Int total_step_param() {
  return loom::sdk::Int("total_curriculum_step", 1,
                        "Steps the schedule takes from min_difficulty to max_difficulty (T); "
                        "from step T on the difficulty is max_difficulty.")
      .required()
      .int_min(1);
}
inline loom::sdk::Int difficulty_step_param(int64_t def) {
  return loom::sdk::Int("difficulty_step", def,
                        "q: the difficulty is rounded down to a multiple of q (then kept "
                        ">= min_difficulty). 8 keeps sequence lengths Tensor Core friendly.")
      .int_min(1);
}
inline loom::sdk::Float root_degree_param() {
  return loom::sdk::Float("root_degree", 1.0,
                          "k: the difficulty grows with (step / T)^(1/k); 1 is linear, 2 a "
                          "square root (fast at first, slower later).")
      .greater_than(0);
}

// The root schedule of an instance's (or a manifest block's) parameters.
inline RootSchedule read_root(loom::sdk::Context& p, bool has_root_degree) {
  RootSchedule s;
  s.min_difficulty = p.get_float("min_difficulty");
  s.max_difficulty = p.get_float("max_difficulty");
  s.total_curriculum_step = p.get_int("total_curriculum_step");
  s.difficulty_step = p.get_int("difficulty_step");
  s.root_degree = has_root_degree ? p.get_float("root_degree") : 1.0;
  return s;
}

}  // namespace loom::data::curriculum
