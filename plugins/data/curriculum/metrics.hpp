// The curriculum metrics at the ABI's level (loom_curriculum_{count,score}_args): the tensor
// checks, then the CPU or CUDA kernel (kernels.hpp) by the tokens' device. Every problem throws
// loom::sdk::Error (INVALID_ARGUMENT) naming the tensor and, for data, the element:
//   "samples.tokens[1234] is 50300 (in sample 1, from offset 1024); tokens must be < vocab_size
//   50257"
// The plugins seqlen and vocabulary_rarity call these.
#pragma once

#include <loom/kinds/curriculum.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "kernels.hpp"

namespace loom::data::curriculum {

// Whether CUDA tensors can be scored (the library was built with CUDA).
bool have_cuda();

// seqlen: score = the number of the sample's tokens that are not pad_token (-1: no padding, so
// the sample's length). args.stats is not read.
void seqlen_score(const loom_curriculum_score_args& args, int64_t pad_token);

// The fixed-point -log p table of vocabulary_rarity for the last stats content seen, so score
// calls with unchanged stats (every chunk of an analysis) reuse it instead of taking one log
// per vocabulary entry. Safe to share between threads (score is [any]): the entry is immutable
// and swapped under a mutex; the stats are compared with the entry's copy outside the lock.
class RarityCache {
 public:
  std::shared_ptr<const RarityTable> get(const int64_t* counts, std::size_t vocab_size);

 private:
  struct Entry {
    std::vector<int64_t> counts;
    RarityTable table;
  };
  std::mutex mutex_;
  std::shared_ptr<const Entry> entry_;
};

// vocabulary_rarity: count adds each token's occurrences in the samples to args.stats
// (vocab_size int64); score sums -log p(t) over each sample's tokens (rarity_table), with the
// table from `cache` when given (else built for this call).
void rarity_count(const loom_curriculum_count_args& args);
void rarity_score(const loom_curriculum_score_args& args, RarityCache* cache = nullptr);

}  // namespace loom::data::curriculum
