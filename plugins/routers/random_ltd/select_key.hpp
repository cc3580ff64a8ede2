// The random keys of random_ltd's selection, one definition for the host and CUDA (the
// functions are __host__ __device__ under nvcc), so both paths choose the same positions.
//
// Sequence b of a select call draws as sample s = first_sample + b. Position p's key is the
// 64-bit number made of words 2p (high half) and 2p + 1 (low half) of
//   loom::sdk::CounterRng(seed, step, layer, s, kPurpose)
// (the step's and the sample's low 32 bits). The kept positions are the `kept` positions
// with the smallest keys, ties broken by the smaller position: a uniformly random subset,
// a pure function of (seed, step, layer, sample). Any exact selection algorithm gives the
// same set, and the rows are written in increasing position order.
//
// Words 2p and 2p + 1 are elements 0-1 (p even) or 2-3 (p odd) of Philox block p / 2, so
// key_pair computes two keys with one block.
#pragma once

#include <loom/sdk/random.hpp>

#include <cstdint>

namespace loom::routers::ltd {

// CounterRng's `purpose` for this selection ("LTD1"): a stream no other draw of the layer
// shares.
constexpr uint32_t kPurpose = 0x4c544431u;

// The Philox key and counter words of one (seed, step, layer, sample), laid out as
// loom::sdk::CounterRng does (loom/sdk/random.hpp).
struct KeyStream {
  uint32_t key0, key1, sample, layer, step;
};

LOOM_SDK_HOST_DEVICE inline KeyStream key_stream(uint64_t seed, int64_t step, int32_t layer,
                                                 int64_t sample) {
  const uint64_t key = seed ^ loom::sdk::mix64(kPurpose);
  KeyStream s{};
  s.key0 = static_cast<uint32_t>(key);
  s.key1 = static_cast<uint32_t>(key >> 32);
  s.sample = static_cast<uint32_t>(static_cast<uint64_t>(sample));
  s.layer = static_cast<uint32_t>(layer);
  s.step = static_cast<uint32_t>(static_cast<uint64_t>(step));
  return s;
}

// The keys of positions 2m and 2m + 1.
LOOM_SDK_HOST_DEVICE inline void key_pair(const KeyStream& s, uint32_t m, uint64_t* even,
                                          uint64_t* odd) {
  const loom::sdk::Philox4x32 w = loom::sdk::philox4x32_10(
      loom::sdk::Philox4x32{{m, s.sample, s.layer, s.step}}, s.key0, s.key1);
  *even = (static_cast<uint64_t>(w.v[0]) << 32) | w.v[1];
  *odd = (static_cast<uint64_t>(w.v[2]) << 32) | w.v[3];
}

// The key of position p.
LOOM_SDK_HOST_DEVICE inline uint64_t key_of(const KeyStream& s, uint32_t p) {
  uint64_t even = 0, odd = 0;
  key_pair(s, p / 2, &even, &odd);
  return (p % 2 == 0) ? even : odd;
}

}  // namespace loom::routers::ltd
