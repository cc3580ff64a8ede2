// Counter-based randomness for plugins (docs/abi.md, "Randomness"): every random choice is a
// pure function of (seed, step, layer, sample, draw), so ranks that must agree do so without
// exchanging anything, and a resumed run makes the same choices without exporting RNG state.
//
// The generator is Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as
// 1, 2, 3", SC'11): a keyed bijection on 128-bit counters. Loom's layout:
//   key     = the 64-bit seed, mixed with a 32-bit `purpose` (so two uses in one layer, say a
//             router's selection and a gate's noise, draw independent streams)
//   counter = {draw block, sample, layer, step} (32 bits each; the step's low 32 bits, so
//             draws repeat after 2^32 steps unless the caller folds the step's high bits into
//             another word, as the curriculum sampler does with its layer word)
// Header-only, no allocation, usable in CUDA device code (functions are __host__ __device__
// under nvcc), so a CPU and a CUDA path draw bit-identical numbers.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define LOOM_SDK_HOST_DEVICE __host__ __device__
#else
#define LOOM_SDK_HOST_DEVICE
#endif

namespace loom::sdk {

struct Philox4x32 {
  uint32_t v[4];
};

// Philox4x32 with 10 rounds over `counter` under `key` (Random123's philox4x32_10).
LOOM_SDK_HOST_DEVICE constexpr Philox4x32 philox4x32_10(Philox4x32 counter, uint32_t key0,
                                                        uint32_t key1) {
  constexpr uint32_t kMul0 = 0xD2511F53u;
  constexpr uint32_t kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u;  // golden ratio
  constexpr uint32_t kWeyl1 = 0xBB67AE85u;  // sqrt(3) - 1
  uint32_t c0 = counter.v[0], c1 = counter.v[1], c2 = counter.v[2], c3 = counter.v[3];
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t{kMul0} * c0;
    const uint64_t p1 = uint64_t{kMul1} * c2;
    const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ key0;
    const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ key1;
    c0 = n0;
    c1 = static_cast<uint32_t>(p1);
    c2 = n2;
    c3 = static_cast<uint32_t>(p0);
    key0 += kWeyl0;
    key1 += kWeyl1;
  }
  return Philox4x32{{c0, c1, c2, c3}};
}

// SplitMix64's finaliser: spreads a small `purpose` over the whole key.
LOOM_SDK_HOST_DEVICE constexpr uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The random numbers of one (seed, purpose, step, layer, sample): an endless, seekable
// sequence of 32-bit words, four per Philox block. Cheap to construct; construct one per
// sample (or per thread) rather than sharing one.
class CounterRng {
 public:
  LOOM_SDK_HOST_DEVICE constexpr CounterRng(uint64_t seed, int64_t step, uint32_t layer,
                                            uint32_t sample, uint32_t purpose = 0)
      : key_(purpose == 0 ? seed : seed ^ mix64(purpose)),
        step_(static_cast<uint32_t>(static_cast<uint64_t>(step))),
        layer_(layer),
        sample_(sample) {}

  // Word `index` of the sequence, without advancing: draw order never matters.
  [[nodiscard]] LOOM_SDK_HOST_DEVICE constexpr uint32_t word(uint64_t index) const {
    const Philox4x32 out = block(static_cast<uint32_t>(index / 4));
    return out.v[index % 4];
  }

  // The next word.
  LOOM_SDK_HOST_DEVICE constexpr uint32_t next_u32() { return word(position_++); }

  LOOM_SDK_HOST_DEVICE constexpr uint64_t next_u64() {
    const uint64_t hi = next_u32();
    return (hi << 32) | next_u32();
  }

  // Uniform in [0, 1): 24 random bits, so every value is an exact float.
  LOOM_SDK_HOST_DEVICE constexpr float uniform_float() {
    return static_cast<float>(next_u32() >> 8) * (1.0f / 16777216.0f);
  }

  // Uniform in [0, 1): 53 random bits.
  LOOM_SDK_HOST_DEVICE constexpr double uniform_double() {
    return static_cast<double>(next_u64() >> 11) * (1.0 / 9007199254740992.0);
  }

  // Uniform integer in [0, bound), bound > 0, without modulo bias (Lemire's multiply-shift
  // with rejection). Returns 0 for bound 0.
  LOOM_SDK_HOST_DEVICE constexpr uint32_t below(uint32_t bound) {
    if (bound == 0) return 0;
    uint64_t m = uint64_t{next_u32()} * bound;
    auto low = static_cast<uint32_t>(m);
    if (low < bound) {
      const uint32_t threshold = (0u - bound) % bound;
      while (low < threshold) {
        m = uint64_t{next_u32()} * bound;
        low = static_cast<uint32_t>(m);
      }
    }
    return static_cast<uint32_t>(m >> 32);
  }

  // Where the next draw comes from (for tests and for seeking).
  [[nodiscard]] LOOM_SDK_HOST_DEVICE constexpr uint64_t position() const { return position_; }
  LOOM_SDK_HOST_DEVICE constexpr void seek(uint64_t position) { position_ = position; }

 private:
  [[nodiscard]] LOOM_SDK_HOST_DEVICE constexpr Philox4x32 block(uint32_t draw_block) const {
    return philox4x32_10(Philox4x32{{draw_block, sample_, layer_, step_}},
                         static_cast<uint32_t>(key_), static_cast<uint32_t>(key_ >> 32));
  }

  uint64_t key_;
  uint32_t step_;
  uint32_t layer_;
  uint32_t sample_;
  uint64_t position_ = 0;
};

// Shuffles first[0, n) in place with Fisher-Yates driven by `rng`: the same (rng, n) gives
// the same permutation on every machine. RandomIt must be a random-access iterator.
template <class RandomIt>
LOOM_SDK_HOST_DEVICE constexpr void shuffle(RandomIt first, uint32_t n, CounterRng& rng) {
  for (uint32_t i = n; i > 1; --i) {
    const uint32_t j = rng.below(i);
    auto tmp = first[i - 1];
    first[i - 1] = first[j];
    first[j] = tmp;
  }
}

}  // namespace loom::sdk
