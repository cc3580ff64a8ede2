#include "batch.hpp"

#include <string>

namespace loom::trainer {

int cut_rows(SeqLenCut mode, int rows, int seq_len, int L) {
  return mode == SeqLenCut::kTruncate ? rows : rows * (seq_len / L);
}

int cut_batch(SeqLenCut mode, const int32_t* x, const int32_t* y, int rows, int seq_len, int L,
              std::vector<int32_t>& ox, std::vector<int32_t>& oy) {
  if (L < 1 || L > seq_len) {
    throw std::invalid_argument("cut_batch: length " + std::to_string(L) + " outside [1, " +
                                std::to_string(seq_len) + "]");
  }
  const int pieces = mode == SeqLenCut::kTruncate ? 1 : seq_len / L;
  const int out_rows = rows * pieces;
  ox.resize(static_cast<size_t>(out_rows) * L);
  oy.resize(ox.size());
  size_t o = 0;
  for (int i = 0; i < rows; ++i) {
    for (int k = 0; k < pieces; ++k) {
      const size_t from = static_cast<size_t>(i) * seq_len + static_cast<size_t>(k) * L;
      for (int j = 0; j < L; ++j, ++o) {
        ox[o] = x[from + j];
        oy[o] = y[from + j];
      }
    }
  }
  return out_rows;
}

uint64_t sample_count(uint64_t train_tokens, int seq_len) {
  if (train_tokens < 1 || seq_len < 1) return 0;
  return (train_tokens - 1) / static_cast<uint64_t>(seq_len);
}

void fill_samples(std::span<const uint16_t> train, int seq_len, std::span<const int64_t> ids,
                  std::vector<int32_t>& x, std::vector<int32_t>& y) {
  const uint64_t n = sample_count(train.size(), seq_len);
  x.resize(ids.size() * static_cast<size_t>(seq_len));
  y.resize(x.size());
  for (size_t r = 0; r < ids.size(); ++r) {
    if (ids[r] < 0 || static_cast<uint64_t>(ids[r]) >= n) {
      throw std::out_of_range("sample id " + std::to_string(ids[r]) + " at place " +
                              std::to_string(r) + " of the batch is outside the dataset's " +
                              std::to_string(n) + " samples");
    }
    const size_t off = static_cast<size_t>(ids[r]) * static_cast<size_t>(seq_len);
    for (int j = 0; j < seq_len; ++j) {
      x[r * seq_len + j] = train[off + j];
      y[r * seq_len + j] = train[off + j + 1];
    }
  }
}

}  // namespace loom::trainer
