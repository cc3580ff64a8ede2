// vocabulary_rarity: a difficulty metric, the sum over a sample's tokens of -log p(token), p
// the token's frequency in the dataset (counted first with count()).
#include <loom/sdk.hpp>
#include <loom/sdk/kinds/curriculum.hpp>

#include "metrics.hpp"

namespace {

using loom::sdk::Context;
using loom::sdk::Error;

class VocabularyRarity : public loom::sdk::Curriculum {
 public:
  explicit VocabularyRarity(Context& /*ctx*/) {}

  void plan(loom_curriculum_plan_args& a) {
    if (a.vocab_size == 0) throw Error(LOOM_ERR_INVALID_ARGUMENT, "vocab_size is 0");
    a.seq_len_mode = LOOM_SEQ_LEN_NONE;
    a.stats_count = a.vocab_size;
  }

  void count(const loom_curriculum_count_args& a) { loom::data::curriculum::rarity_count(a); }
  void score(const loom_curriculum_score_args& a) {
    loom::data::curriculum::rarity_score(a, &cache_);
  }

 private:
  // The -log p table of the last stats seen (an analysis scores every chunk with the same).
  loom::data::curriculum::RarityCache cache_;
};

}  // namespace

LOOM_PLUGIN("vocabulary_rarity", "1.0.0",
            "Curriculum metric: a sample's summed -log frequency of its tokens",
            loom::sdk::factory<VocabularyRarity>());
