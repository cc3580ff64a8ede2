// Batches of the reference trainer: the fixed samples a sampler names, and the cuts of
// sequence-length warmup (docs/trainer.md "Curriculum and sequence-length warmup").
#pragma once

#include <cstdint>
#include <span>
#include <stdexcept>
#include <vector>

namespace loom::trainer {

// How a step shorter than seq_len is made from full sequences.
enum class SeqLenCut {
  kTruncate,  // each sequence's first L inputs (and their labels); the rest is dropped
  kReshape,   // each sequence cut into floor(seq_len / L) pieces of L inputs, one row each
};

// Rows a cut makes from `rows` sequences of `seq_len`: rows (truncate) or
// rows * floor(seq_len / L) (reshape).
int cut_rows(SeqLenCut mode, int rows, int seq_len, int L);

// Cuts a batch of `rows` sequences of `seq_len` inputs x and labels y (row-major; y[i][j] is
// the token after x[i][j]) to rows of L (8 <= L <= seq_len). Truncate: row i keeps x[i][0, L)
// and y[i][0, L), so its last label is the token after its last input. Reshape: sequence i
// gives pieces k = 0 .. floor(seq_len / L) - 1, in that order, each x[i][kL, kL + L) with
// y[i][kL, kL + L): a window of L + 1 tokens with its labels shifted within it; the last
// seq_len - floor(seq_len / L) * L inputs of each sequence (and their labels) are dropped.
// Writes cut_rows(...) * L tokens into ox and oy (resized) and returns the row count.
int cut_batch(SeqLenCut mode, const int32_t* x, const int32_t* y, int rows, int seq_len, int L,
              std::vector<int32_t>& ox, std::vector<int32_t>& oy);

// The number of fixed samples of a train split of `train_tokens` tokens with sample length
// seq_len: sample i is the seq_len + 1 tokens from i * seq_len, so floor((T - 1) / seq_len).
uint64_t sample_count(uint64_t train_tokens, int seq_len);

// Sample ids to a batch: row r is sample ids[r]'s inputs train[id * seq_len, + seq_len) and
// labels one token later. Throws std::out_of_range naming an id >= sample_count.
void fill_samples(std::span<const uint16_t> train, int seq_len, std::span<const int64_t> ids,
                  std::vector<int32_t>& x, std::vector<int32_t>& y);

}  // namespace loom::trainer
