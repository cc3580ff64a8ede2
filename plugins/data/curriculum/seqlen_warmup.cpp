// seqlen_warmup: sequence-length warmup, a root schedule over sequence lengths (schedule.hpp)
// whose seq_len tells the trainer to truncate (or reshape) each batch's sequences.
#include <loom/sdk.hpp>
#include <loom/sdk/kinds/curriculum.hpp>

#include <string>

#include "schedule.hpp"
#include "schedule_params.hpp"

namespace {

namespace cl = loom::data::curriculum;
using loom::sdk::Context;
using loom::sdk::Error;

cl::RootSchedule read(Context& p) {
  cl::RootSchedule s;
  s.min_difficulty = static_cast<double>(p.get_int("min_difficulty"));
  s.max_difficulty = static_cast<double>(p.get_int("max_difficulty"));
  s.total_curriculum_step = p.get_int("total_curriculum_step");
  s.difficulty_step = p.get_int("difficulty_step");
  s.root_degree = p.get_string("schedule_type") == "fixed_root" ? p.get_float("root_degree") : 1.0;
  return s;
}

class SeqlenWarmup : public loom::sdk::Curriculum {
 public:
  static loom::sdk::Schema schema() {
    using namespace loom::sdk;
    return {
        String("mode", "truncate",
               "truncate: keep each sequence's first seq_len tokens; reshape: cut sequences "
               "into seq_len pieces, so a step keeps its token count.")
            .choices({"truncate", "reshape"}),
        String("schedule_type", "fixed_linear", "How the length grows: linearly or as a root.")
            .choices({"fixed_linear", "fixed_root"}),
        Int("min_difficulty", 8, "The sequence length at step 1 (>= 1).")
            .required()
            .int_range(1, INT32_MAX),
        Int("max_difficulty", 8, "The full sequence length, from step total_curriculum_step on.")
            .required()
            .int_range(1, INT32_MAX),
        cl::total_step_param(),
        cl::difficulty_step_param(8),
        cl::root_degree_param(),
    };
  }

  static void validate_params(Context& params) {
    if (params.get_string("schedule_type") != "fixed_root" &&
        params.get_float("root_degree") != 1) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  "root_degree is only read when schedule_type is \"fixed_root\"", "root_degree");
    }
    cl::validate(read(params));
  }

  explicit SeqlenWarmup(Context& ctx)
      : s_(read(ctx)),
        mode_(ctx.get_string("mode") == "reshape" ? LOOM_SEQ_LEN_RESHAPE : LOOM_SEQ_LEN_TRUNCATE) {}

  void plan(loom_curriculum_plan_args& a) {
    a.seq_len_mode = mode_;
    a.stats_count = 0;
  }

  void at(loom_curriculum_at_args& a) {
    a.seq_len = cl::seq_len_at(s_, a.step);
    a.difficulty = static_cast<double>(a.seq_len);
  }

 private:
  cl::RootSchedule s_;
  uint32_t mode_;
};

}  // namespace

LOOM_PLUGIN("seqlen_warmup", "1.0.0",
            "Sequence-length warmup: the trainer's sequence length from min to max over T steps",
            loom::sdk::factory<SeqlenWarmup>());
