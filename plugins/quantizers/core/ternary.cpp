// Ternary (TWN) kernels: the scalar reference and the Highway ones (every SIMD target, chosen
// at run time), over the host pool. See ternary.hpp for the format and binary.hpp for the
// summation order.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ternary.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ternary.hpp"
#include "widen-inl.h"
#include "xtc_simd-inl.h"

HWY_BEFORE_NAMESPACE();
namespace loom::quant {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// The first code 3 of a word of `count` 2-bit codes, or -1.
HWY_INLINE int FirstInvalid(uint32_t word, int count) {
  uint32_t bad = word & (word >> 1) & 0x55555555u;
  if (count < 16) bad &= (1u << (2 * count)) - 1;
  if (bad == 0) return -1;
  int i = 0;
  while (((bad >> (2 * i)) & 1u) == 0) ++i;
  return i;
}

// Rows [r0, r1) (r0 a multiple of 8): per group Delta (one pass), then alpha and the codes
// (a second pass), stored or ORed into the zeroed bytes. Returns the first non-finite
// element, or -1. The weight is w (float32), or w16 (bf16 or float16 patterns, `bf16` says
// which): each span is then widened into L1 first, exactly, so the codes and scales are those
// of the float32 widening.
int64_t TernaryQuantizeRows(const float* HWY_RESTRICT w, const uint16_t* w16, bool bf16,
                            const GroupedShape* sp, float threshold, uint8_t* packed, float* scales,
                            int64_t r0, int64_t r1) {
  const GroupedShape& s = *sp;
  const int64_t gpr = s.groups_per_row();
  const uint64_t b0 = static_cast<uint64_t>(r0 * s.cols) * 2 / 8;
  const uint64_t b1 = (static_cast<uint64_t>(r1 * s.cols) * 2 + 7) / 8;
  std::memset(packed + b0, 0, b1 - b0);
  int64_t bad = -1;
  // Groups are taken a span at a time (about 16 KiB of weights, at most kSpan groups): the
  // first pass streams the span from memory alone, the second then finds it in L1.
  constexpr int64_t kSpan = 64;
  const int64_t span = std::clamp<int64_t>(4096 / s.group_size, 1, kSpan);
  float delta[kSpan];
  std::vector<float> wide(w16 != nullptr ? static_cast<std::size_t>(s.cols) : 0);
  for (int64_t r = r0; r < r1; ++r) {
    const float* row = w16 == nullptr ? w + r * s.cols : nullptr;
    for (int64_t g0 = 0; g0 < gpr; g0 += span) {
      const int64_t g1 = std::min(gpr, g0 + span);
      if (w16 != nullptr) {
        // The span's elements [g0 * group, end) into wide, so that row + c0 is element c0.
        const int64_t cs = g0 * s.group_size;
        const int64_t ce = std::min(s.cols, g1 * s.group_size);
        const int64_t e = r * s.cols + cs;
        WidenRow(w16 + e, bf16, ce - cs, wide.data());
        PrefetchRow16(w16 + r * s.cols + ce, std::min(ce - cs, s.numel() - (r * s.cols + ce)));
        row = wide.data() - cs;
      }
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t c0 = g * s.group_size;
        const int64_t n = std::min(s.group_size, s.cols - c0);
        const float sum = AbsSum(row + c0, n);
        const float d = threshold * (sum / static_cast<float>(n));
        if (!std::isfinite(d) && (bad < 0 || bad >= s.numel())) {
          // A non-finite weight, or finite ones whose Delta overflows (group numel() + g).
          const int64_t at = FirstNonFinite(row + c0, n);
          if (at >= 0) {
            bad = r * s.cols + c0 + at;
          } else if (bad < 0) {
            bad = s.numel() + r * gpr + g;
          }
        }
        delta[g - g0] = d;
      }
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t c0 = g * s.group_size;
        const int64_t n = std::min(s.group_size, s.cols - c0);
        int64_t kept = 0;
        // While this span is in L1, the next one (this row's or the next row's) is fetched.
        const int64_t next = r * s.cols + c0 + span * s.group_size;
        const float* ahead = w16 == nullptr && next + n <= s.rows * s.cols ? w + next : nullptr;
        const float kept_sum =
            TernaryKeptAndCodes(row + c0, n, delta[g - g0], packed,
                                static_cast<uint64_t>(r * s.cols + c0), &kept, ahead);
        scales[r * gpr + g] = kept > 0 ? kept_sum / static_cast<float>(kept) : 0.0f;
      }
    }
  }
  return bad;
}

// Rows [r0, r1) of w from the codes. Returns the first code 3, or -1.
int64_t TernaryDequantizeRows(const uint8_t* HWY_RESTRICT packed, const float* HWY_RESTRICT scales,
                              const GroupedShape* sp, float* HWY_RESTRICT w, int64_t r0,
                              int64_t r1) {
  const GroupedShape& s = *sp;
  const DM d;
  const hn::RebindToUnsigned<DM> du;
  const int N = static_cast<int>(hn::Lanes(d));
  alignas(64) static constexpr uint32_t kPlus[16] = {
      1u << 0,  1u << 2,  1u << 4,  1u << 6,  1u << 8,  1u << 10, 1u << 12, 1u << 14,
      1u << 16, 1u << 18, 1u << 20, 1u << 22, 1u << 24, 1u << 26, 1u << 28, 1u << 30};
  const auto pbit = hn::LoadU(du, kPlus);
  const auto mbit = hn::Add(pbit, pbit);
  const uint64_t bytes = packed_bytes_of(s, 2);
  const int64_t gpr = s.groups_per_row();
  int64_t bad = -1;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t g = 0; g < gpr; ++g) {
      const int64_t c0 = g * s.group_size;
      const int64_t n = std::min(s.group_size, s.cols - c0);
      const float alpha = scales[r * gpr + g];
      const auto pos = hn::Set(d, alpha);
      const auto neg = hn::Set(d, -alpha);
      float* out = w + r * s.cols + c0;
      const uint64_t e0 = static_cast<uint64_t>(r * s.cols + c0);
      int64_t i = 0;
      for (; i + N <= n; i += N) {
        const uint32_t bits = Bits(packed, bytes, (e0 + static_cast<uint64_t>(i)) * 2, 2 * N);
        const int inv = FirstInvalid(bits, N);
        if (inv >= 0 && bad < 0) bad = static_cast<int64_t>(e0) + i + inv;
        const auto bv = hn::Set(du, bits);
        const auto plus = hn::RebindMask(d, hn::TestBit(bv, pbit));
        const auto minus = hn::RebindMask(d, hn::TestBit(bv, mbit));
        hn::StoreU(hn::IfThenElse(plus, pos, hn::IfThenElseZero(minus, neg)), d, out + i);
      }
      for (; i < n; ++i) {
        const uint32_t q = Bits(packed, bytes, (e0 + static_cast<uint64_t>(i)) * 2, 2);
        if (q == 3 && bad < 0) bad = static_cast<int64_t>(e0) + i;
        out[i] = q == 1 ? alpha : (q == 2 ? -alpha : 0.0f);
      }
    }
  }
  return bad;
}

// The codes of W row n for GroupBlock: x where the code is 1, -x (XOR the sign bit) where 2,
// 0 where 0. The first code 3 met goes to *bad when that is still -1; the vector codes are
// checked only when `check` (the row's first block of activation rows), the tail always.
struct TernaryCodes {
  struct Lanes {
    hn::Mask<DM> nz;
    VM flip;
  };
  const uint8_t* packed;
  uint64_t bytes;
  uint64_t rowe;  // the row's first element
  hn::Vec<hn::RebindToUnsigned<DM>> pbit;
  VM sign;
  bool check;
  int64_t* bad;

  HWY_INLINE Lanes Load(int64_t k) const {
    const DM d;
    const hn::RebindToUnsigned<DM> du;
    const int N = static_cast<int>(hn::Lanes(d));
    const uint32_t bits = Bits(packed, bytes, (rowe + static_cast<uint64_t>(k)) * 2, 2 * N);
    if (check) {
      const int inv = FirstInvalid(bits, N);
      if (inv >= 0 && *bad < 0) *bad = static_cast<int64_t>(rowe) + k + inv;
    }
    const auto bv = hn::Set(du, bits);
    const auto minus = hn::RebindMask(d, hn::TestBit(bv, hn::Add(pbit, pbit)));
    const auto nz = hn::Or(hn::RebindMask(d, hn::TestBit(bv, pbit)), minus);
    return {nz, hn::IfThenElseZero(minus, sign)};
  }
  HWY_INLINE VM Signed(const Lanes& c, VM x) const {
    return hn::IfThenElseZero(c.nz, hn::Xor(x, c.flip));
  }
  HWY_INLINE float Scalar(int64_t k) const {
    const uint32_t q = Bits(packed, bytes, (rowe + static_cast<uint64_t>(k)) * 2, 2);
    if (q == 3 && *bad < 0) *bad = static_cast<int64_t>(rowe) + k;
    return q == 1 ? 1.0f : (q == 2 ? -1.0f : 0.0f);
  }
  HWY_INLINE float Add(float acc, float sgn, float x) const { return acc + sgn * x; }
};

// y[:, n] for W rows [n0, n1): per group alpha * (sum of x where code 1 - sum where code 2),
// from the bit masks of the codes. Returns the first code 3, or -1.
int64_t TernaryMatmulRows(const float* HWY_RESTRICT x, int64_t m,
                          const uint8_t* HWY_RESTRICT packed, const float* HWY_RESTRICT scales,
                          const GroupedShape* sp, const float* HWY_RESTRICT bias,
                          float* HWY_RESTRICT y, int64_t n0, int64_t n1) {
  const GroupedShape& s = *sp;
  const DM d;
  const hn::RebindToUnsigned<DM> du;
  alignas(64) static constexpr uint32_t kPlus[16] = {
      1u << 0,  1u << 2,  1u << 4,  1u << 6,  1u << 8,  1u << 10, 1u << 12, 1u << 14,
      1u << 16, 1u << 18, 1u << 20, 1u << 22, 1u << 24, 1u << 26, 1u << 28, 1u << 30};
  int64_t bad = -1;
  const TernaryCodes base{
      packed, packed_bytes_of(s, 2), 0, hn::LoadU(du, kPlus), hn::Set(d, -0.0f), false, &bad};
  auto make = [&](int64_t n, int64_t mb) HWY_ATTR {
    TernaryCodes c = base;
    c.rowe = static_cast<uint64_t>(n * s.cols);
    c.check = mb == 0;
    return c;
  };
  GroupMatmulRows(x, m, scales, s, bias, y, n0, n1, make);
  return bad;
}

}  // namespace HWY_NAMESPACE
}  // namespace loom::quant
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "xtc_rows.hpp"

namespace loom::quant {

HWY_EXPORT(TernaryQuantizeRows);
HWY_EXPORT(TernaryDequantizeRows);
HWY_EXPORT(TernaryMatmulRows);

using xtc_rows::first_bad_over_rows;

namespace {

uint32_t code_at(const uint8_t* packed, int64_t e) { return (packed[e / 4] >> (2 * (e % 4))) & 3u; }

}  // namespace

int64_t ternary_quantize_ref(const float* w, const GroupedShape& s, float threshold,
                             uint8_t* packed, float* scales) {
  for (int64_t i = 0; i < s.numel(); ++i) {
    if (!std::isfinite(w[i])) return i;
  }
  std::memset(packed, 0, packed_bytes_of(s, 2));
  const int64_t gpr = s.groups_per_row();
  for (int64_t r = 0; r < s.rows; ++r) {
    for (int64_t g = 0; g < gpr; ++g) {
      const int64_t c0 = g * s.group_size;
      const int64_t n = std::min(s.group_size, s.cols - c0);
      const float* p = w + r * s.cols + c0;
      const float mean = group_abs_sum_ref(p, n, -1.0f, nullptr) / static_cast<float>(n);
      const float delta = threshold * mean;
      if (!std::isfinite(delta)) return s.numel() + r * gpr + g;
      int64_t kept = 0;
      const float kept_sum = group_abs_sum_ref(p, n, delta, &kept);
      scales[r * gpr + g] = kept > 0 ? kept_sum / static_cast<float>(kept) : 0.0f;
      for (int64_t i = 0; i < n; ++i) {
        if (std::fabs(p[i]) <= delta) continue;
        const int64_t e = r * s.cols + c0 + i;
        const uint32_t q = p[i] > 0.0f ? 1u : 2u;
        packed[e / 4] = static_cast<uint8_t>(packed[e / 4] | (q << (2 * (e % 4))));
      }
    }
  }
  return -1;
}

int64_t ternary_dequantize_ref(const uint8_t* packed, const float* scales, const GroupedShape& s,
                               float* w) {
  const int64_t gpr = s.groups_per_row();
  for (int64_t e = 0; e < s.numel(); ++e) {
    const float alpha = scales[(e / s.cols) * gpr + (e % s.cols) / s.group_size];
    const uint32_t q = code_at(packed, e);
    if (q == 3) return e;
    w[e] = q == 1 ? alpha : (q == 2 ? -alpha : 0.0f);
  }
  return -1;
}

int64_t ternary_matmul_ref(const float* x, int64_t m, const uint8_t* packed, const float* scales,
                           const GroupedShape& s, const float* bias, float* y) {
  for (int64_t e = 0; e < s.numel(); ++e) {
    if (code_at(packed, e) == 3) return e;
  }
  xtc_rows::matmul_ref(x, m, scales, s, bias, y, [&](float part, int64_t e, float v) {
    const uint32_t q = code_at(packed, e);
    return q == 1 ? part + v : (q == 2 ? part - v : part);
  });
  return -1;
}

int64_t ternary_quantize(const float* w, const GroupedShape& s, float threshold, uint8_t* packed,
                         float* scales) {
  if (s.numel() == 0) return -1;
  return first_bad_over_rows(s, 8, [&](int64_t r0, int64_t r1) {
    return HWY_DYNAMIC_DISPATCH(TernaryQuantizeRows)(w, nullptr, false, &s, threshold, packed,
                                                     scales, r0, r1);
  });
}

int64_t ternary_quantize16(const uint16_t* w, bool bf16, const GroupedShape& s, float threshold,
                           uint8_t* packed, float* scales) {
  if (s.numel() == 0) return -1;
  return first_bad_over_rows(s, 8, [&](int64_t r0, int64_t r1) {
    return HWY_DYNAMIC_DISPATCH(TernaryQuantizeRows)(nullptr, w, bf16, &s, threshold, packed,
                                                     scales, r0, r1);
  });
}

int64_t ternary_dequantize(const uint8_t* packed, const float* scales, const GroupedShape& s,
                           float* w) {
  if (s.numel() == 0) return -1;
  return first_bad_over_rows(s, 1, [&](int64_t r0, int64_t r1) {
    return HWY_DYNAMIC_DISPATCH(TernaryDequantizeRows)(packed, scales, &s, w, r0, r1);
  });
}

int64_t ternary_matmul(const float* x, int64_t m, const uint8_t* packed, const float* scales,
                       const GroupedShape& s, const float* bias, float* y) {
  return xtc_rows::matmul_over_rows(m, s, bias, y, [&](int64_t n0, int64_t n1) {
    return HWY_DYNAMIC_DISPATCH(TernaryMatmulRows)(x, m, packed, scales, &s, bias, y, n0, n1);
  });
}

}  // namespace loom::quant
#endif  // HWY_ONCE
