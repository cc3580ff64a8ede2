// Test helpers: a batch of samples as the ABI's tensors over host (or device) buffers.
#pragma once

#include <dlpack/dlpack.h>
#include <loom/kinds/curriculum.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace curriculum_test {

// Host data of a batch: tokens of one dtype (kept as int64 here), offsets.
struct HostBatch {
  std::vector<int64_t> tokens;
  std::vector<int64_t> offsets;
};

// `samples` samples of random lengths in [0, max_len], tokens Zipf-like in [0, vocab).
inline HostBatch random_batch(uint32_t seed, int samples, int max_len, uint32_t vocab) {
  std::mt19937_64 rng(seed);
  HostBatch b;
  b.offsets.push_back(0);
  std::uniform_int_distribution<int> len(0, max_len);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int i = 0; i < samples; ++i) {
    const int n = len(rng);
    for (int k = 0; k < n; ++k) {
      // Skewed: small ids much more often, so the rarities differ.
      const auto t = static_cast<int64_t>(std::pow(u(rng), 3.0) * vocab);
      b.tokens.push_back(std::min<int64_t>(t, vocab - 1));
    }
    b.offsets.push_back(static_cast<int64_t>(b.tokens.size()));
  }
  return b;
}

// Bytes of `tokens` stored as `dtype` (uint16, int32 or int64).
inline std::vector<unsigned char> pack(const std::vector<int64_t>& tokens, DLDataType dtype) {
  const std::size_t w = dtype.bits / 8;
  std::vector<unsigned char> out(tokens.size() * w);
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    if (dtype.bits == 16) {
      const auto v = static_cast<uint16_t>(tokens[i]);
      std::memcpy(out.data() + i * w, &v, w);
    } else if (dtype.bits == 32) {
      const auto v = static_cast<int32_t>(tokens[i]);
      std::memcpy(out.data() + i * w, &v, w);
    } else {
      std::memcpy(out.data() + i * w, &tokens[i], w);
    }
  }
  return out;
}

constexpr DLDataType kU16{kDLUInt, 16, 1};
constexpr DLDataType kI32{kDLInt, 32, 1};
constexpr DLDataType kI64{kDLInt, 64, 1};
constexpr DLDataType kF64{kDLFloat, 64, 1};
constexpr DLDataType kF32{kDLFloat, 32, 1};

// A 1-D tensor view (shape owned here).
struct Tensor {
  int64_t shape[1] = {0};
  DLTensor t{};
  Tensor() = default;
  Tensor(void* data, int64_t n, DLDataType dtype, DLDevice dev = {kDLCPU, 0}) {
    shape[0] = n;
    t = DLTensor{data, dev, 1, dtype, shape, nullptr, 0};
  }
  Tensor(const Tensor& o) : Tensor(o.t.data, o.shape[0], o.t.dtype, o.t.device) {}
  Tensor& operator=(const Tensor& o) {
    shape[0] = o.shape[0];
    t = DLTensor{o.t.data, o.t.device, 1, o.t.dtype, shape, nullptr, 0};
    return *this;
  }
  DLTensor* get() { return &t; }
};

// Score / count arguments over the given tensors.
inline loom_curriculum_samples samples_of(Tensor& tokens, Tensor& offsets) {
  loom_curriculum_samples s{};
  s.struct_size = LOOM_CURRICULUM_SAMPLES_SIZE;
  s.tokens = tokens.get();
  s.offsets = offsets.get();
  return s;
}

inline loom_curriculum_score_args score_args(Tensor& tokens, Tensor& offsets, uint32_t vocab,
                                             DLTensor* stats, Tensor& scores,
                                             void* stream = nullptr) {
  loom_curriculum_score_args a{};
  a.struct_size = LOOM_CURRICULUM_SCORE_ARGS_SIZE;
  a.samples = samples_of(tokens, offsets);
  a.vocab_size = vocab;
  a.stats = stats;
  a.scores = scores.get();
  a.stream = stream;
  return a;
}

inline loom_curriculum_count_args count_args(Tensor& tokens, Tensor& offsets, uint32_t vocab,
                                             Tensor& stats, void* stream = nullptr) {
  loom_curriculum_count_args a{};
  a.struct_size = LOOM_CURRICULUM_COUNT_ARGS_SIZE;
  a.samples = samples_of(tokens, offsets);
  a.vocab_size = vocab;
  a.stats = stats.get();
  a.stream = stream;
  return a;
}

}  // namespace curriculum_test
