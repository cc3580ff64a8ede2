// fixed_discrete: difficulty[i] up to step max_step[i], the last difficulty after the last
// max_step (schedule.hpp).
#include <loom/sdk.hpp>
#include <loom/sdk/kinds/curriculum.hpp>

#include "schedule.hpp"

namespace {

namespace cl = loom::data::curriculum;
using loom::sdk::Context;

cl::DiscreteSchedule read(Context& p) {
  cl::DiscreteSchedule s;
  s.difficulty = p.get_float_list("difficulty");
  s.max_step = p.get_int_list("max_step");
  return s;
}

class FixedDiscrete : public loom::sdk::Curriculum {
 public:
  static loom::sdk::Schema schema() {
    using namespace loom::sdk;
    return {
        FloatList("difficulty", {},
                  "The difficulty of each stage; one more entry than max_step (the last "
                  "stage lasts to the end). Once the largest is reached it stays.")
            .required(),
        IntList("max_step", {},
                "The last step of each stage but the last: strictly increasing, >= 1 "
                "(steps are 1-based).")
            .required()
            .int_min(1),
    };
  }

  static void validate_params(Context& params) { cl::validate(read(params)); }

  explicit FixedDiscrete(Context& ctx) : s_(read(ctx)) {}

  void plan(loom_curriculum_plan_args& a) {
    a.seq_len_mode = LOOM_SEQ_LEN_NONE;
    a.stats_count = 0;
  }

  void at(loom_curriculum_at_args& a) {
    a.difficulty = cl::difficulty_at(s_, a.step);
    a.seq_len = 0;
  }

 private:
  cl::DiscreteSchedule s_;
};

}  // namespace

LOOM_PLUGIN("fixed_discrete", "1.0.0", "Curriculum schedule: a fixed difficulty per stage of steps",
            loom::sdk::factory<FixedDiscrete>());
