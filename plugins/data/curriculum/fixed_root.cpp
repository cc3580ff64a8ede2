// fixed_linear and fixed_root: DeepSpeed's root schedules (schedule.hpp), one plugin each
// (this file built with LOOM_CURRICULUM_ROOT 0 for fixed_linear, 1 for fixed_root).
#include <loom/sdk.hpp>
#include <loom/sdk/kinds/curriculum.hpp>

#include "schedule.hpp"
#include "schedule_params.hpp"

namespace {

namespace cl = loom::data::curriculum;
using loom::sdk::Context;

constexpr bool kRoot = LOOM_CURRICULUM_ROOT != 0;

class RootScheduleCurriculum : public loom::sdk::Curriculum {
 public:
  static loom::sdk::Schema schema() {
    loom::sdk::Schema s = {
        cl::min_difficulty_param("The difficulty at step 1; the schedule never goes below it."),
        cl::max_difficulty_param("The difficulty from step total_curriculum_step on."),
        cl::total_step_param(),
        cl::difficulty_step_param(1),
    };
    if (kRoot) s.add(cl::root_degree_param().required());
    return s;
  }

  static void validate_params(Context& params) { cl::validate(cl::read_root(params, kRoot)); }

  explicit RootScheduleCurriculum(Context& ctx) : s_(cl::read_root(ctx, kRoot)) {}

  void plan(loom_curriculum_plan_args& a) {
    a.seq_len_mode = LOOM_SEQ_LEN_NONE;
    a.stats_count = 0;
  }

  void at(loom_curriculum_at_args& a) {
    a.difficulty = cl::difficulty_at(s_, a.step);
    a.seq_len = 0;
  }

 private:
  cl::RootSchedule s_;
};

}  // namespace

#if LOOM_CURRICULUM_ROOT
LOOM_PLUGIN("fixed_root", "1.0.0",
            "Curriculum schedule: difficulty from min to max as (step / T)^(1/root_degree)",
            loom::sdk::factory<RootScheduleCurriculum>());
#else
LOOM_PLUGIN("fixed_linear", "1.0.0",
            "Curriculum schedule: difficulty from min to max linearly over T steps",
            loom::sdk::factory<RootScheduleCurriculum>());
#endif
