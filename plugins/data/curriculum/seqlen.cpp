// seqlen: a difficulty metric, the number of a sample's tokens that are not padding.
#include <loom/sdk.hpp>
#include <loom/sdk/kinds/curriculum.hpp>

#include <string>

#include "metrics.hpp"

namespace {

using loom::sdk::Context;
using loom::sdk::Error;

class Seqlen : public loom::sdk::Curriculum {
 public:
  static loom::sdk::Schema schema() {
    using namespace loom::sdk;
    return {
        Int("pad_token", -1,
            "The padding token, not counted; -1: no padding (the score is the sample's "
            "length).")
            .int_range(-1, UINT32_MAX),
    };
  }

  explicit Seqlen(Context& ctx) : pad_(ctx.get_int("pad_token")) {}

  void plan(loom_curriculum_plan_args& a) {
    if (pad_ >= 0 && static_cast<uint64_t>(pad_) >= a.vocab_size) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  "pad_token " + std::to_string(pad_) + " is not below the dataset's vocab_size " +
                      std::to_string(a.vocab_size),
                  "pad_token");
    }
    a.seq_len_mode = LOOM_SEQ_LEN_NONE;
    a.stats_count = 0;
  }

  void score(const loom_curriculum_score_args& a) { loom::data::curriculum::seqlen_score(a, pad_); }

 private:
  int64_t pad_;
};

}  // namespace

LOOM_PLUGIN("seqlen", "1.0.0", "Curriculum metric: a sample's length without padding",
            loom::sdk::factory<Seqlen>());
