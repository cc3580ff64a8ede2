// distinct_tokens: a loom.curriculum/1 difficulty metric. A sample's score is the fraction
// of its tokens that are distinct token ids: 1.0 when no id repeats, near 0 for a sample
// that repeats one id. Tokens equal to `pad_token` are left out of both counts; a sample
// with no other token scores 0.
//
// A starting point for your own metric: what matters is the structure (the SDK has checked
// the tensors' shapes, dtypes and devices before score runs; the metric checks what only it
// knows, here that every token is below vocab_size; scores are a pure function of the
// tokens, computed in a fixed order, so every thread and rank gets the same bits), not the
// arithmetic.
//
// The class has score and no at, so the SDK reports it as a metric (roles =
// LOOM_CURRICULUM_METRIC) and leaves at NULL; it has no count, so it needs no first pass
// over the dataset (stats_count 0) and needs no plan. Host memory only.
#include <loom/kinds/curriculum.h>
#include <loom/sdk.hpp>
#include <loom/sdk/kinds/curriculum.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace {

using loom::sdk::Context;
using loom::sdk::Error;

class DistinctTokens : public loom::sdk::Curriculum {
 public:
  static loom::sdk::Schema schema() {
    using namespace loom::sdk;
    return {
        Int("pad_token", -1, "Token id that is padding, not counted; -1: no padding.")
            .int_range(-1, INT64_MAX),
    };
  }

  explicit DistinctTokens(Context& ctx) : pad_(ctx.get_int("pad_token")) {}

  // [any]: called concurrently on one instance, so everything it changes is local.
  void score(const loom_curriculum_score_args& a) {
    const loom::sdk::CurriculumSamples s = loom::sdk::curriculum_samples(a.samples);
    if (!loom::sdk::is_cpu(s.device)) {
      throw Error(LOOM_ERR_UNIMPLEMENTED, "distinct_tokens: samples are on " +
                                              loom::sdk::device_string(s.device) +
                                              "; this metric runs on host memory only");
    }
    if (a.vocab_size == 0)
      throw Error(LOOM_ERR_INVALID_ARGUMENT, "distinct_tokens: vocab_size is 0");
    auto* out = loom::sdk::data_as<double>(*a.scores);
    const DLTensor& t = *s.tokens;
    if (loom::sdk::is_dtype(t, kDLUInt, 16)) {
      run(s, loom::sdk::data_as<const uint16_t>(t), a.vocab_size, out);
    } else if (loom::sdk::is_dtype(t, kDLInt, 32)) {
      run(s, loom::sdk::data_as<const int32_t>(t), a.vocab_size, out);
    } else {
      run(s, loom::sdk::data_as<const int64_t>(t), a.vocab_size, out);
    }
  }

 private:
  // seen[id] holds the number (1-based) of the last sample that had token id, so the array
  // is cleared once per call, not once per sample. Every token is checked before any score
  // is written.
  template <class Token>
  void run(const loom::sdk::CurriculumSamples& s, const Token* tok, uint32_t vocab,
           double* out) const {
    for (int64_t i = s.begin(0); s.count > 0 && i < s.end(s.count - 1); ++i) {
      const auto v = static_cast<int64_t>(tok[i]);
      if (v < 0 || v >= static_cast<int64_t>(vocab)) {
        throw Error(LOOM_ERR_INVALID_ARGUMENT,
                    "distinct_tokens: token " + std::to_string(i) + " is " + std::to_string(v) +
                        ", outside the vocabulary of " + std::to_string(vocab));
      }
    }
    std::vector<int64_t> seen(vocab, 0);
    for (int64_t k = 0; k < s.count; ++k) {
      int64_t counted = 0;
      int64_t distinct = 0;
      for (int64_t i = s.begin(k); i < s.end(k); ++i) {
        const auto v = static_cast<int64_t>(tok[i]);
        if (v == pad_) continue;
        ++counted;
        if (seen[static_cast<std::size_t>(v)] != k + 1) {
          seen[static_cast<std::size_t>(v)] = k + 1;
          ++distinct;
        }
      }
      out[k] = counted > 0 ? static_cast<double>(distinct) / static_cast<double>(counted) : 0.0;
    }
  }

  int64_t pad_;
};

}  // namespace

LOOM_PLUGIN("distinct_tokens", "1.0.0",
            "Difficulty metric: the fraction of a sample's tokens that are distinct ids",
            loom::sdk::factory<DistinctTokens>());
