// Highway helpers the binary and ternary kernels share (binary.cpp, ternary.cpp), compiled
// once per SIMD target like the kernels that include them.
//
// The group sums use 128-bit vectors of 4 floats on every target: four of them are the 16
// fixed partial sums of group_abs_sum_ref (binary.hpp), so any target (AVX-512, AVX2, SSE4,
// the emulated 128-bit one) sums in exactly the scalar reference's order. Quantization is
// memory-bound, so the narrower vectors cost nothing measurable. The matmuls use the full
// vector width (up to 16 lanes) and read their masks straight from the packed bits.

// Per-target include guard (Highway's convention for -inl headers).
#if defined(LOOM_QUANT_XTC_SIMD_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef LOOM_QUANT_XTC_SIMD_INL_H_
#undef LOOM_QUANT_XTC_SIMD_INL_H_
#else
#define LOOM_QUANT_XTC_SIMD_INL_H_
#endif

#include <hwy/highway.h>

#include <cstdint>
#include <cstring>
#include <limits>

#include "binary.hpp"

HWY_BEFORE_NAMESPACE();
namespace loom::quant {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using D4 = hn::FixedTag<float, 4>;
using DM = hn::CappedTag<float, 16>;

// Bits [bit, bit + count) of the stream (count <= 32): one unaligned 8-byte load when the
// stream has 8 bytes there, else byte by byte.
HWY_INLINE uint32_t Bits(const uint8_t* p, uint64_t bytes, uint64_t bit, int count) {
  const uint64_t first = bit / 8;
  if (first + 8 <= bytes) {
    uint64_t word;
    std::memcpy(&word, p + first, 8);
    word >>= bit % 8;
    return static_cast<uint32_t>(count >= 32 ? word : word & ((uint64_t{1} << count) - 1));
  }
  return load_bits(p, bytes, bit, count);
}

// ORs the low `count` bits of `word` into the (zeroed) stream at bit `bit`.
HWY_INLINE void OrBits(uint8_t* p, uint64_t bit, uint32_t word, int count) {
  uint64_t w = static_cast<uint64_t>(word) << (bit % 8);
  uint8_t* q = p + bit / 8;
  const int span = static_cast<int>((bit % 8 + static_cast<uint64_t>(count) + 7) / 8);
  for (int b = 0; b < span; ++b) {
    q[b] = static_cast<uint8_t>(q[b] | static_cast<uint8_t>(w & 0xFF));
    w >>= 8;
  }
}

// The 16 bits of four 4-lane masks, lane j of mask v in bit 4 v + j.
HWY_INLINE uint32_t MaskBits16(hn::Mask<D4> m0, hn::Mask<D4> m1, hn::Mask<D4> m2, hn::Mask<D4> m3) {
  const D4 d;
  uint8_t b[4][8] = {};
  hn::StoreMaskBits(d, m0, b[0]);
  hn::StoreMaskBits(d, m1, b[1]);
  hn::StoreMaskBits(d, m2, b[2]);
  hn::StoreMaskBits(d, m3, b[3]);
  return (b[0][0] & 0xFu) | (b[1][0] & 0xFu) << 4 | (b[2][0] & 0xFu) << 8 | (b[3][0] & 0xFu) << 12;
}

// Spreads 16 bits to the even bits of 32 (bit i to bit 2 i).
HWY_INLINE uint32_t Spread16(uint32_t x) {
  x = (x | (x << 8)) & 0x00FF00FFu;
  x = (x | (x << 4)) & 0x0F0F0F0Fu;
  x = (x | (x << 2)) & 0x33333333u;
  x = (x | (x << 1)) & 0x55555555u;
  return x;
}

// The fixed-order sum of |w_i| (with above >= 0: of those > above; *kept counts them) and
// whether every w_i is finite.
HWY_INLINE float GroupAbsSum(const float* HWY_RESTRICT w, int64_t n, float above, int64_t* kept,
                             bool* finite) {
  const D4 d;
  const hn::RebindToSigned<D4> di;
  const auto inf = hn::Set(d, std::numeric_limits<float>::infinity());
  const auto thr = hn::Set(d, above);
  auto s0 = hn::Zero(d), s1 = hn::Zero(d), s2 = hn::Zero(d), s3 = hn::Zero(d);
  auto c = hn::Zero(di);
  auto ok = hn::Lt(hn::Zero(d), inf);  // all true
  int64_t i = 0;
  const bool filter = above >= 0.0f;
  for (; i + kSumLanes <= n; i += kSumLanes) {
    const auto a0 = hn::Abs(hn::LoadU(d, w + i));
    const auto a1 = hn::Abs(hn::LoadU(d, w + i + 4));
    const auto a2 = hn::Abs(hn::LoadU(d, w + i + 8));
    const auto a3 = hn::Abs(hn::LoadU(d, w + i + 12));
    ok = hn::And(ok, hn::And(hn::And(hn::Lt(a0, inf), hn::Lt(a1, inf)),
                             hn::And(hn::Lt(a2, inf), hn::Lt(a3, inf))));
    if (filter) {
      const auto k0 = hn::Gt(a0, thr), k1 = hn::Gt(a1, thr);
      const auto k2 = hn::Gt(a2, thr), k3 = hn::Gt(a3, thr);
      s0 = hn::Add(s0, hn::IfThenElseZero(k0, a0));
      s1 = hn::Add(s1, hn::IfThenElseZero(k1, a1));
      s2 = hn::Add(s2, hn::IfThenElseZero(k2, a2));
      s3 = hn::Add(s3, hn::IfThenElseZero(k3, a3));
      c = hn::Sub(c, hn::Add(hn::Add(hn::VecFromMask(di, hn::RebindMask(di, k0)),
                                     hn::VecFromMask(di, hn::RebindMask(di, k1))),
                             hn::Add(hn::VecFromMask(di, hn::RebindMask(di, k2)),
                                     hn::VecFromMask(di, hn::RebindMask(di, k3)))));
    } else {
      s0 = hn::Add(s0, a0);
      s1 = hn::Add(s1, a1);
      s2 = hn::Add(s2, a2);
      s3 = hn::Add(s3, a3);
    }
  }
  alignas(16) float partial[kSumLanes];
  hn::Store(s0, d, partial);
  hn::Store(s1, d, partial + 4);
  hn::Store(s2, d, partial + 8);
  hn::Store(s3, d, partial + 12);
  alignas(16) int32_t counts[4];
  hn::Store(c, di, counts);
  int64_t k = static_cast<int64_t>(counts[0]) + counts[1] + counts[2] + counts[3];
  bool all_finite = hn::AllTrue(d, ok);
  for (int64_t j = 0; i < n; ++i, ++j) {
    float a = w[i] < 0.0f ? -w[i] : w[i];
    if (!(a < std::numeric_limits<float>::infinity())) all_finite = false;
    if (filter) {
      if (a > above) {
        ++k;
      } else {
        a = 0.0f;
      }
    }
    partial[j] = partial[j] + a;
  }
  if (kept != nullptr) *kept = filter ? k : n;
  *finite = all_finite;
  return fold_partials(partial);
}

// The first non-finite element of w[0, n), or -1.
HWY_INLINE int64_t FirstNonFinite(const float* w, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float a = w[i] < 0.0f ? -w[i] : w[i];
    if (!(a < std::numeric_limits<float>::infinity())) return i;
  }
  return -1;
}

}  // namespace HWY_NAMESPACE
}  // namespace loom::quant
HWY_AFTER_NAMESPACE();

#endif  // LOOM_QUANT_XTC_SIMD_INL_H_
