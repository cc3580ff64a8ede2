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
// Bit-identical scores on every thread count and device: a sample's score is a sequential sum
// over its tokens, left to right, starting from 0 (seqlen: an integer count; vocabulary_rarity:
// fp64 additions of the per-token values of rarity_table, which is always built on the host).
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
  };
  int32_t kind = kNone;
  int32_t reserved = 0;
  int64_t index = 0;
  int64_t value = 0;
  int64_t previous = 0;
};

// The per-token values of vocabulary_rarity: -log(c(t) / C), c(t) = max(counts[t], 1) (a token
// never counted counts once), C = the sum of c over the vocabulary. Throws loom::sdk::Error
// (INVALID_ARGUMENT) for a negative count or a sum beyond int64.
std::vector<double> rarity_table(const int64_t* counts, std::size_t vocab_size);

// ---- CPU (all cores, loom::sdk::parallel_for)
Problem seqlen_cpu(const SampleData& s, int64_t pad_token, double* scores);
Problem count_cpu(const SampleData& s, int64_t* stats);  // adds to stats[vocab_size]
Problem rarity_cpu(const SampleData& s, const double* table, double* scores);

// ---- CUDA (device pointers; stream-ordered on `stream`, then synchronized to read back the
// check's result). CUDA failures throw loom::sdk::Error (UNAVAILABLE). `device` is made
// current for the call and the caller's restored.
namespace cuda {
int device_count();
Problem seqlen(const SampleData& s, int64_t pad_token, double* scores, int device, void* stream);
Problem count(const SampleData& s, int64_t* stats, int device, void* stream);
// stats: device memory (vocab_size int64); the table is built on the host from a copy.
Problem rarity(const SampleData& s, const int64_t* stats, double* scores, int device, void* stream);
// bytes from device memory to the host, synchronously (after the work queued on `stream`).
void copy_to_host(void* dst, const void* src, std::size_t bytes, int device, void* stream);
}  // namespace cuda

}  // namespace loom::data::curriculum
