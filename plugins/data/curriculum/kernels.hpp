// The metric kernels of the curriculum plugins (seqlen, vocabulary_rarity) behind a plain C++
// interface, compiled by the host compiler (kernels_cpu.cpp) and by nvcc (kernels_cuda.cu).
// metrics.hpp checks the tensors and calls these.
//
// Samples: sample i is tokens[offsets[i], offsets[i + 1]). The kernels check the data as they
// read it (offsets within the tokens and non-decreasing, every token in [0, vocab_size)) and
// return the first problem, the same one on every device: the lowest offset index that is
// wrong (outside the tokens, then below its predecessor: the SDK's order for host offsets),
// else the lowest token index that is. Scores written before a problem is found are
// unspecified.
//
// Bit-identical scores on every thread count, SIMD target and device: a sample's score is an
// integer sum over its tokens, exact in any order (seqlen: a count; vocabulary_rarity: the
// fixed-point values of rarity_table, always built on the host, summed in int64 and scaled by
// 2^-kRarityFractionBits once at the end), so the kernels may split and vectorise the sums.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace loom::data::curriculum {

enum class TokenType : uint8_t { kU16 = 0, kI32 = 1, kI64 = 2 };

struct SampleData {
  const void* tokens = nullptr;  // token_count elements of `type`
  TokenType type = TokenType::kU16;
  int64_t token_count = 0;
  const int64_t* offsets = nullptr;  // samples + 1 elements
  int64_t samples = 0;
  uint32_t vocab_size = 0;
};

// What a kernel found wrong with the data (kind kNone: nothing).
struct Problem {
  enum Kind : int32_t {
    kNone = 0,
    kOffsetNegative = 1,    // offsets[index] (value) < 0
    kOffsetBeyond = 2,      // offsets[index] (value) > token_count
    kOffsetDecreasing = 3,  // offsets[index] (value) < offsets[index - 1] (previous)
    kTokenNegative = 4,     // tokens[index] (value) < 0
    kTokenTooLarge = 5,     // tokens[index] (value) >= vocab_size
    kSampleTooLong = 6,     // sample index has value tokens, more than previous (the most the
                            // fixed-point sum of vocabulary_rarity holds exactly)
  };
  int32_t kind = kNone;
  int32_t reserved = 0;
  int64_t index = 0;
  int64_t value = 0;
  int64_t previous = 0;
};

// The per-token values of vocabulary_rarity: -log(c(t) / C), c(t) = max(counts[t], 1) (a token
// never counted counts once), C = the sum of c over the vocabulary, as fixed point:
// value[t] = round(-log(c(t) / C) * 2^kRarityFractionBits), an int64. A sample's score is the
// int64 sum of its tokens' values times 2^-kRarityFractionBits: exact in any order. Since
// C < 2^63, -log p <= 63 ln 2 < 43.7, so value[t] < 2^37.45 and a sum of up to max_tokens values
// (INT64_MAX / the largest value; at least 2^25 = 33.5 Mi tokens for any counts) cannot overflow.
// Throws loom::sdk::Error (INVALID_ARGUMENT) for a negative count or a sum beyond int64.
constexpr int kRarityFractionBits = 32;
struct RarityTable {
  std::vector<int64_t> value;  // vocab_size entries
  int64_t max_tokens = 0;      // the longest sample whose sum stays exact
};
RarityTable rarity_table(const int64_t* counts, std::size_t vocab_size);
// A sample's score from its fixed-point sum (the same rounding on every device).
inline double rarity_score_of(int64_t sum) {
  return static_cast<double>(sum) * (1.0 / static_cast<double>(int64_t{1} << kRarityFractionBits));
}

// ---- CPU (all cores, loom::sdk::parallel_for; uint16 tokens through Highway's best target
// for this CPU, chosen at run time)
Problem seqlen_cpu(const SampleData& s, int64_t pad_token, double* scores);
Problem count_cpu(const SampleData& s, int64_t* stats);  // adds to stats[vocab_size]
Problem rarity_cpu(const SampleData& s, const RarityTable& table, double* scores);

// ---- CUDA (device pointers; stream-ordered on `stream`, then synchronized to read back the
// check's result). CUDA failures throw loom::sdk::Error (UNAVAILABLE). `device` is made
// current for the call and the caller's restored.
// Built twice (docs/sdk.md "CPU and CUDA"): kernels_cuda.cu with CUDA, kernels_cuda_stub.cpp
// without (device_count 0, have_cuda false, the rest UNIMPLEMENTED).
bool have_cuda();
namespace cuda {
int device_count();
Problem seqlen(const SampleData& s, int64_t pad_token, double* scores, int device, void* stream);
Problem count(const SampleData& s, int64_t* stats, int device, void* stream);
// table: built on the host (from a copy of the device stats), copied to the device here.
Problem rarity(const SampleData& s, const RarityTable& table, double* scores, int device,
               void* stream);
// bytes from device memory to the host, synchronously (after the work queued on `stream`).
void copy_to_host(void* dst, const void* src, std::size_t bytes, int device, void* stream);
}  // namespace cuda

}  // namespace loom::data::curriculum
