// Highway helpers the binary and ternary kernels share (binary.cpp, ternary.cpp), compiled
// once per SIMD target like the kernels that include them.
//
// The group sums keep the 16 fixed partial sums of group_abs_sum_ref (binary.hpp) in 16 / N
// vectors of N lanes, so any target (AVX-512, AVX2, SSE4, the emulated 128-bit one) sums in
// exactly the scalar reference's order; the codes are written in the same pass. The matmuls
// read their masks straight from the packed bits.

// Per-target include guard (Highway's convention for -inl headers).
#if defined(LOOM_QUANT_XTC_SIMD_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef LOOM_QUANT_XTC_SIMD_INL_H_
#undef LOOM_QUANT_XTC_SIMD_INL_H_
#else
#define LOOM_QUANT_XTC_SIMD_INL_H_
#endif

#include <hwy/cache_control.h>
#include <hwy/highway.h>
#if HWY_ARCH_X86
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include <loom/quantizers/binary.hpp>

HWY_BEFORE_NAMESPACE();
namespace loom::quant {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DM = hn::CappedTag<float, 16>;
// Every kernel here keeps the 16 partial sums in 16 / N vectors (at most four, see
// FoldAccumulators) and reads 16-entry lane tables (kBit, kPlus), so N must be 4, 8 or 16:
// a 1-lane (HWY_SCALAR) or wider target would silently sum in another order.
static_assert(hn::MaxLanes(DM()) == 4 || hn::MaxLanes(DM()) == 8 || hn::MaxLanes(DM()) == 16,
              "the xtc kernels need 4, 8 or 16 float lanes");

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

// Writes the low `count` bits of `word` at stream bit `bit` into bytes that only these bits
// use whole (bit and count multiples of 8) by a plain store, else ORs them into the zeroed
// stream.
HWY_INLINE void PutBits(uint8_t* p, uint64_t bit, uint32_t word, int count) {
  if (bit % 8 == 0 && count % 8 == 0) {
    std::memcpy(p + bit / 8, &word, static_cast<std::size_t>(count / 8));  // little-endian
  } else {
    OrBits(p, bit, word, count);
  }
}

// The mask's lanes as bits (lane j in bit j; at most 16 lanes).
template <class D>
HWY_INLINE uint32_t MaskWord(D d, hn::Mask<D> m) {
  uint8_t b[8] = {};
  hn::StoreMaskBits(d, m, b);
  return static_cast<uint32_t>(b[0]) | static_cast<uint32_t>(b[1]) << 8;
}

// Spreads the low 16 bits of x to the even bits of 32 (bit i to bit 2 i) by shifts and masks:
// the same on every target, and cheap everywhere (BMI2's pdep would do it in one instruction,
// but it is microcoded and very slow on AMD Zen 1 and 2, which run the AVX2 target).
HWY_INLINE uint32_t Spread16(uint32_t x) {
  x &= 0xFFFFu;
  x = (x | (x << 8)) & 0x00FF00FFu;
  x = (x | (x << 4)) & 0x0F0F0F0Fu;
  x = (x | (x << 2)) & 0x33333333u;
  x = (x | (x << 1)) & 0x55555555u;
  return x;
}

// 16 2-bit codes from their low bits (plus) and high bits (minus): bit i of plus to bit 2 i,
// bit i of minus to bit 2 i + 1. On the AVX-512 targets by pdep, which every CPU that runs
// them executes in one cycle (Intel since Haswell, AMD since Zen 3): the shifts and masks cost
// about 30 instructions per 16 codes, most of the ternary quantizer's time.
HWY_INLINE uint32_t Interleave16(uint32_t plus, uint32_t minus) {
#if HWY_TARGET <= HWY_AVX3 && HWY_ARCH_X86
  return _pdep_u32(plus, 0x55555555u) | _pdep_u32(minus, 0xAAAAAAAAu);
#else
  return Spread16(plus) | Spread16(minus) << 1;
#endif
}

// The fixed-order group sums (binary.hpp group_abs_sum_ref): the 16 partials live in 16 / N
// vectors of N lanes (one on AVX-512, two on AVX2, four of 4 lanes elsewhere), vector v lane
// j holding partial v N + j, so 16 consecutive elements are 16 / N loads. The fold
// p[j] += p[j + h] for h = 8, 4, 2, 1 is then vector adds of halves.
using VM = hn::Vec<DM>;

// Floats AbsSum prefetches ahead of the one it reads.
constexpr int64_t kPrefetchAhead = 512;

template <class D>
HWY_INLINE float FoldQuad(D d, hn::Vec<D> v) {
  if constexpr (hn::MaxLanes(D()) > 4) {
    const hn::Half<D> dh;
    return FoldQuad(dh, hn::Add(hn::LowerHalf(dh, v), hn::UpperHalf(dh, v)));
  } else {
    alignas(16) float t[4];
    hn::Store(v, d, t);
    return (t[0] + t[2]) + (t[1] + t[3]);
  }
}

// The fold of accumulators a0..a3 (16 / N of them in use) when no scalar tail follows.
HWY_INLINE float FoldAccumulators(DM d, int N, VM a0, VM a1, VM a2, VM a3) {
  const VM v =
      N >= 16 ? a0 : (N == 8 ? hn::Add(a0, a1) : hn::Add(hn::Add(a0, a2), hn::Add(a1, a3)));
  return FoldQuad(d, v);
}

// The partials as 16 floats, for a scalar tail.
HWY_INLINE void StoreAccumulators(DM d, int N, VM a0, VM a1, VM a2, VM a3, float* partial) {
  hn::StoreU(a0, d, partial);
  if (N < 16) hn::StoreU(a1, d, partial + N);
  if (N < 8) {
    hn::StoreU(a2, d, partial + 2 * N);
    hn::StoreU(a3, d, partial + 3 * N);
  }
}

// The 16 / N mask words of one 16-element step as one 16-bit word (element i in bit i).
HWY_INLINE uint32_t Join16(int N, uint32_t m0, uint32_t m1, uint32_t m2, uint32_t m3) {
  if (N >= 16) return m0;
  if (N == 8) return m0 | m1 << 8;
  return m0 | m1 << 4 | m2 << 8 | m3 << 12;
}

// Sum of |w_i| over the group in the fixed order. A non-finite weight makes it non-finite
// (the caller then looks for it).
HWY_INLINE float AbsSum(const float* HWY_RESTRICT w, int64_t n) {
  const DM d;
  const int N = static_cast<int>(hn::Lanes(d));
  VM a0 = hn::Zero(d), a1 = hn::Zero(d), a2 = hn::Zero(d), a3 = hn::Zero(d);
  int64_t i = 0;
  for (; i + kSumLanes <= n; i += kSumLanes) {
    // The second pass over the group (ternary) fills the out-of-order window; fetching
    // ahead keeps the loads of the next groups in flight meanwhile.
    hwy::Prefetch(w + i + kPrefetchAhead);
    a0 = hn::Add(a0, hn::Abs(hn::LoadU(d, w + i)));
    if (N < 16) a1 = hn::Add(a1, hn::Abs(hn::LoadU(d, w + i + N)));
    if (N < 8) {
      a2 = hn::Add(a2, hn::Abs(hn::LoadU(d, w + i + 2 * N)));
      a3 = hn::Add(a3, hn::Abs(hn::LoadU(d, w + i + 3 * N)));
    }
  }
  if (i == n) return FoldAccumulators(d, N, a0, a1, a2, a3);
  float partial[kSumLanes];
  StoreAccumulators(d, N, a0, a1, a2, a3, partial);
  for (int j = 0; i < n; ++i, ++j) partial[j] = partial[j] + std::fabs(w[i]);
  return fold_partials(partial);
}

// Binary: the sum of |w_i| in the fixed order and, in the same pass, the codes (1 for
// w >= 0) ORed or stored at stream bit `bit0` onwards.
HWY_INLINE float BinarySumAndCodes(const float* HWY_RESTRICT w, int64_t n, uint8_t* packed,
                                   uint64_t bit0) {
  const DM d;
  const int N = static_cast<int>(hn::Lanes(d));
  const VM zero = hn::Zero(d);
  VM a0 = zero, a1 = zero, a2 = zero, a3 = zero;
  int64_t i = 0;
  for (; i + kSumLanes <= n; i += kSumLanes) {
    const VM v0 = hn::LoadU(d, w + i);
    a0 = hn::Add(a0, hn::Abs(v0));
    uint32_t m0 = MaskWord(d, hn::Ge(v0, zero)), m1 = 0, m2 = 0, m3 = 0;
    if (N < 16) {
      const VM v1 = hn::LoadU(d, w + i + N);
      a1 = hn::Add(a1, hn::Abs(v1));
      m1 = MaskWord(d, hn::Ge(v1, zero));
    }
    if (N < 8) {
      const VM v2 = hn::LoadU(d, w + i + 2 * N), v3 = hn::LoadU(d, w + i + 3 * N);
      a2 = hn::Add(a2, hn::Abs(v2));
      a3 = hn::Add(a3, hn::Abs(v3));
      m2 = MaskWord(d, hn::Ge(v2, zero));
      m3 = MaskWord(d, hn::Ge(v3, zero));
    }
    PutBits(packed, bit0 + static_cast<uint64_t>(i), Join16(N, m0, m1, m2, m3), 16);
  }
  if (i == n) return FoldAccumulators(d, N, a0, a1, a2, a3);
  float partial[kSumLanes];
  StoreAccumulators(d, N, a0, a1, a2, a3, partial);
  for (int j = 0; i < n; ++i, ++j) {
    partial[j] = partial[j] + std::fabs(w[i]);
    if (w[i] >= 0.0f) OrBits(packed, bit0 + static_cast<uint64_t>(i), 1u, 1);
  }
  return fold_partials(partial);
}

// Ternary, given Delta: the fixed-order sum of the kept |w_i| (> delta), their count, and
// in the same pass the codes (1: w > Delta, 2: w < -Delta) at stream bit `bit0` onwards.
// `ahead` (or null): weights to prefetch meanwhile, a cache line per 16 elements read.
HWY_INLINE float TernaryKeptAndCodes(const float* HWY_RESTRICT w, int64_t n, float delta,
                                     uint8_t* packed, uint64_t bit0, int64_t* kept,
                                     const float* ahead) {
  const DM d;
  const int N = static_cast<int>(hn::Lanes(d));
  const VM zero = hn::Zero(d);
  const VM dv = hn::Set(d, delta);
  VM a0 = zero, a1 = zero, a2 = zero, a3 = zero;
  int64_t count = 0;
  int64_t i = 0;
  uint32_t p[4] = {0, 0, 0, 0}, m[4] = {0, 0, 0, 0};
  const auto step = [&](const float* at, VM& acc, int slot) HWY_ATTR {
    const VM v = hn::LoadU(d, at);
    const VM a = hn::Abs(v);
    const auto keep = hn::Gt(a, dv);
    acc = hn::Add(acc, hn::IfThenElseZero(keep, a));
    p[slot] = MaskWord(d, keep);             // kept
    m[slot] = MaskWord(d, hn::Lt(v, zero));  // negative
  };
  for (; i + kSumLanes <= n; i += kSumLanes) {
    if (ahead != nullptr) hwy::Prefetch(ahead + i);
    step(w + i, a0, 0);
    if (N < 16) step(w + i + N, a1, 1);
    if (N < 8) {
      step(w + i + 2 * N, a2, 2);
      step(w + i + 3 * N, a3, 3);
    }
    // A kept weight is nonzero, so it is w > Delta (plus) unless negative (minus).
    const uint32_t kept_bits = Join16(N, p[0], p[1], p[2], p[3]);
    const uint32_t neg = Join16(N, m[0], m[1], m[2], m[3]);
    const uint32_t plus = kept_bits & ~neg;
    const uint32_t minus = kept_bits & neg;
    count += __builtin_popcount(kept_bits);
    PutBits(packed, (bit0 + static_cast<uint64_t>(i)) * 2, Interleave16(plus, minus), 32);
  }
  if (i == n) {
    *kept = count;
    return FoldAccumulators(d, N, a0, a1, a2, a3);
  }
  float partial[kSumLanes];
  StoreAccumulators(d, N, a0, a1, a2, a3, partial);
  for (int j = 0; i < n; ++i, ++j) {
    const float a = std::fabs(w[i]);
    if (a > delta) {
      ++count;
      partial[j] = partial[j] + a;
      OrBits(packed, (bit0 + static_cast<uint64_t>(i)) * 2, w[i] > 0.0f ? 1u : 2u, 2);
    } else {
      partial[j] = partial[j] + 0.0f;
    }
  }
  *kept = count;
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

// One W row n times activation rows x0 .. x0 + (R - 1) K (R <= 4) into out[0, R): per group,
// alpha times the signed sum of x that Codes gives, the vector part by lanes and the tail
// element by element. Codes: auto Load(k) (the lanes' codes at row element k), VM Signed(c, x)
// (x signed by them: -x, 0 or x), auto Scalar(k) and float Add(acc, c, x) (one element).
template <int R, class Codes>
HWY_INLINE void GroupBlock(const float* HWY_RESTRICT x0, int64_t K,
                           const float* HWY_RESTRICT scales, int64_t gpr, int64_t group_size,
                           int64_t n, float* out, Codes& codes) {
  const DM d;
  const int N = static_cast<int>(hn::Lanes(d));
  const float* x1 = R > 1 ? x0 + K : x0;
  const float* x2 = R > 2 ? x0 + 2 * K : x0;
  const float* x3 = R > 3 ? x0 + 3 * K : x0;
  auto t0 = hn::Zero(d), t1 = hn::Zero(d), t2 = hn::Zero(d), t3 = hn::Zero(d);
  float tail[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int64_t g = 0; g < gpr; ++g) {
    const int64_t c0 = g * group_size;
    const int64_t len = std::min(group_size, K - c0);
    auto a0 = hn::Zero(d), a1 = hn::Zero(d), a2 = hn::Zero(d), a3 = hn::Zero(d);
    float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int64_t k = c0;
    for (; k + N <= c0 + len; k += N) {
      const auto c = codes.Load(k);
      a0 = hn::Add(a0, codes.Signed(c, hn::LoadU(d, x0 + k)));
      if constexpr (R > 1) a1 = hn::Add(a1, codes.Signed(c, hn::LoadU(d, x1 + k)));
      if constexpr (R > 2) a2 = hn::Add(a2, codes.Signed(c, hn::LoadU(d, x2 + k)));
      if constexpr (R > 3) a3 = hn::Add(a3, codes.Signed(c, hn::LoadU(d, x3 + k)));
    }
    for (; k < c0 + len; ++k) {
      const auto c = codes.Scalar(k);
      sc[0] = codes.Add(sc[0], c, x0[k]);
      if constexpr (R > 1) sc[1] = codes.Add(sc[1], c, x1[k]);
      if constexpr (R > 2) sc[2] = codes.Add(sc[2], c, x2[k]);
      if constexpr (R > 3) sc[3] = codes.Add(sc[3], c, x3[k]);
    }
    const float alpha = scales[n * gpr + g];
    const auto av = hn::Set(d, alpha);
    t0 = hn::MulAdd(av, a0, t0);
    if constexpr (R > 1) t1 = hn::MulAdd(av, a1, t1);
    if constexpr (R > 2) t2 = hn::MulAdd(av, a2, t2);
    if constexpr (R > 3) t3 = hn::MulAdd(av, a3, t3);
    for (int j = 0; j < 4; ++j) tail[j] += alpha * sc[j];
  }
  out[0] = hn::GetLane(hn::SumOfLanes(d, t0)) + tail[0];
  if constexpr (R > 1) out[1] = hn::GetLane(hn::SumOfLanes(d, t1)) + tail[1];
  if constexpr (R > 2) out[2] = hn::GetLane(hn::SumOfLanes(d, t2)) + tail[2];
  if constexpr (R > 3) out[3] = hn::GetLane(hn::SumOfLanes(d, t3)) + tail[3];
}

// y[:, n] for W rows [n0, n1), four activation rows per pass over a row's codes.
// make(n, mb) returns the Codes of W row n for the block of activation rows from mb.
template <class MakeCodes>
HWY_INLINE void GroupMatmulRows(const float* HWY_RESTRICT x, int64_t m,
                                const float* HWY_RESTRICT scales, const GroupedShape& s,
                                const float* HWY_RESTRICT bias, float* HWY_RESTRICT y, int64_t n0,
                                int64_t n1, MakeCodes& make) {
  const int64_t gpr = s.groups_per_row();
  const int64_t K = s.cols;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t mb = 0; mb < m; mb += 4) {
      const int64_t mr = std::min<int64_t>(4, m - mb);
      const float* x0 = x + mb * K;
      float out[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      auto codes = make(n, mb);
      switch (mr) {
        case 1:
          GroupBlock<1>(x0, K, scales, gpr, s.group_size, n, out, codes);
          break;
        case 2:
          GroupBlock<2>(x0, K, scales, gpr, s.group_size, n, out, codes);
          break;
        case 3:
          GroupBlock<3>(x0, K, scales, gpr, s.group_size, n, out, codes);
          break;
        default:
          GroupBlock<4>(x0, K, scales, gpr, s.group_size, n, out, codes);
      }
      const float b = bias != nullptr ? bias[n] : 0.0f;
      for (int64_t j = 0; j < mr; ++j) y[(mb + j) * s.rows + n] = out[j] + b;
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace loom::quant
HWY_AFTER_NAMESPACE();

#endif  // LOOM_QUANT_XTC_SIMD_INL_H_
