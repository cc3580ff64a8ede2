// Ternary (TWN) kernels: the scalar reference and the Highway ones (every SIMD target, chosen
// at run time), over the host pool. See ternary.hpp for the format and binary.hpp for the
// summation order.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ternary.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "ternary.hpp"
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
// element, or -1.
int64_t TernaryQuantizeRows(const float* HWY_RESTRICT w, const GroupedShape* sp, float threshold,
                            uint8_t* packed, float* scales, int64_t r0, int64_t r1) {
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
  for (int64_t r = r0; r < r1; ++r) {
    const float* row = w + r * s.cols;
    for (int64_t g0 = 0; g0 < gpr; g0 += span) {
      const int64_t g1 = std::min(gpr, g0 + span);
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
        const float* ahead = next + n <= s.rows * s.cols ? w + next : nullptr;
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

template <int R>
HWY_INLINE void TernaryBlock(const float* HWY_RESTRICT x0, int64_t K,
                             const uint8_t* HWY_RESTRICT packed, uint64_t bytes,
                             const float* HWY_RESTRICT scales, int64_t gpr, int64_t group_size,
                             int64_t n, float* out, bool check, int64_t* bad_out) {
  const DM d;
  const hn::RebindToUnsigned<DM> du;
  const int N = static_cast<int>(hn::Lanes(d));
  alignas(64) static constexpr uint32_t kPlus[16] = {
      1u << 0,  1u << 2,  1u << 4,  1u << 6,  1u << 8,  1u << 10, 1u << 12, 1u << 14,
      1u << 16, 1u << 18, 1u << 20, 1u << 22, 1u << 24, 1u << 26, 1u << 28, 1u << 30};
  const auto pbit = hn::LoadU(du, kPlus);
  const auto mbit = hn::Add(pbit, pbit);
  const auto sign = hn::Set(d, -0.0f);
  const uint64_t rowe = static_cast<uint64_t>(n * K);
  int64_t bad = -1;
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
      const uint32_t bits = Bits(packed, bytes, (rowe + static_cast<uint64_t>(k)) * 2, 2 * N);
      if (check) {
        const int inv = FirstInvalid(bits, N);
        if (inv >= 0 && bad < 0) bad = static_cast<int64_t>(rowe) + k + inv;
      }
      const auto bv = hn::Set(du, bits);
      const auto minus = hn::RebindMask(d, hn::TestBit(bv, mbit));
      const auto nz = hn::Or(hn::RebindMask(d, hn::TestBit(bv, pbit)), minus);
      const auto flip = hn::IfThenElseZero(minus, sign);
      a0 = hn::Add(a0, hn::IfThenElseZero(nz, hn::Xor(hn::LoadU(d, x0 + k), flip)));
      if constexpr (R > 1)
        a1 = hn::Add(a1, hn::IfThenElseZero(nz, hn::Xor(hn::LoadU(d, x1 + k), flip)));
      if constexpr (R > 2)
        a2 = hn::Add(a2, hn::IfThenElseZero(nz, hn::Xor(hn::LoadU(d, x2 + k), flip)));
      if constexpr (R > 3)
        a3 = hn::Add(a3, hn::IfThenElseZero(nz, hn::Xor(hn::LoadU(d, x3 + k), flip)));
    }
    for (; k < c0 + len; ++k) {
      const uint32_t q = Bits(packed, bytes, (rowe + static_cast<uint64_t>(k)) * 2, 2);
      if (q == 3 && bad < 0) bad = static_cast<int64_t>(rowe) + k;
      const float sgn = q == 1 ? 1.0f : (q == 2 ? -1.0f : 0.0f);
      sc[0] += sgn * x0[k];
      if constexpr (R > 1) sc[1] += sgn * x1[k];
      if constexpr (R > 2) sc[2] += sgn * x2[k];
      if constexpr (R > 3) sc[3] += sgn * x3[k];
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
  if (bad >= 0 && *bad_out < 0) *bad_out = bad;
}

// y[:, n] for W rows [n0, n1): per group alpha * (sum of x where code 1 - sum where code 2),
// from the bit masks of the codes, four activation rows per pass over the codes. Returns the
// first code 3, or -1.
int64_t TernaryMatmulRows(const float* HWY_RESTRICT x, int64_t m,
                          const uint8_t* HWY_RESTRICT packed, const float* HWY_RESTRICT scales,
                          const GroupedShape* sp, const float* HWY_RESTRICT bias,
                          float* HWY_RESTRICT y, int64_t n0, int64_t n1) {
  const GroupedShape& s = *sp;
  const uint64_t bytes = packed_bytes_of(s, 2);
  const int64_t gpr = s.groups_per_row();
  const int64_t K = s.cols;
  int64_t bad = -1;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t mb = 0; mb < m; mb += 4) {
      const int64_t mr = std::min<int64_t>(4, m - mb);
      const float* x0 = x + mb * K;
      float out[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      switch (mr) {
        case 1:
          TernaryBlock<1>(x0, K, packed, bytes, scales, gpr, s.group_size, n, out, mb == 0, &bad);
          break;
        case 2:
          TernaryBlock<2>(x0, K, packed, bytes, scales, gpr, s.group_size, n, out, mb == 0, &bad);
          break;
        case 3:
          TernaryBlock<3>(x0, K, packed, bytes, scales, gpr, s.group_size, n, out, mb == 0, &bad);
          break;
        default:
          TernaryBlock<4>(x0, K, packed, bytes, scales, gpr, s.group_size, n, out, mb == 0, &bad);
      }
      const float b = bias != nullptr ? bias[n] : 0.0f;
      for (int64_t j = 0; j < mr; ++j) y[(mb + j) * s.rows + n] = out[j] + b;
    }
  }
  return bad;
}

}  // namespace HWY_NAMESPACE
}  // namespace loom::quant
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "common/parallel_for.hpp"

namespace loom::quant {

HWY_EXPORT(TernaryQuantizeRows);
HWY_EXPORT(TernaryDequantizeRows);
HWY_EXPORT(TernaryMatmulRows);

namespace {

constexpr int64_t kTaskElements = 1 << 15;

std::size_t row_grain(const GroupedShape& s, int64_t unit) {
  const int64_t per = std::max<int64_t>(1, kTaskElements / std::max<int64_t>(1, s.cols));
  return static_cast<std::size_t>((per + unit - 1) / unit);
}

void atomic_min(std::atomic<int64_t>& a, int64_t v) {
  int64_t cur = a.load();
  while ((cur < 0 || v < cur) && !a.compare_exchange_weak(cur, v)) {
  }
}

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
  const int64_t gpr = s.groups_per_row();
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t n = 0; n < s.rows; ++n) {
      float acc = 0.0f;
      for (int64_t g = 0; g < gpr; ++g) {
        const int64_t c0 = g * s.group_size;
        const int64_t len = std::min(s.group_size, s.cols - c0);
        float part = 0.0f;
        for (int64_t k = c0; k < c0 + len; ++k) {
          const uint32_t q = code_at(packed, n * s.cols + k);
          const float v = x[i * s.cols + k];
          if (q == 1) part += v;
          if (q == 2) part -= v;
        }
        acc += scales[n * gpr + g] * part;
      }
      y[i * s.rows + n] = acc + (bias != nullptr ? bias[n] : 0.0f);
    }
  }
  return -1;
}

int64_t ternary_quantize(const float* w, const GroupedShape& s, float threshold, uint8_t* packed,
                         float* scales) {
  if (s.numel() == 0) return -1;
  std::atomic<int64_t> bad{-1};
  const int64_t units = (s.rows + 7) / 8;
  loom::plugins::parallel_for(
      static_cast<std::size_t>(units), row_grain(s, 8), [&](std::size_t b, std::size_t e) {
        const int64_t r0 = static_cast<int64_t>(b) * 8;
        const int64_t r1 = std::min(s.rows, static_cast<int64_t>(e) * 8);
        const int64_t first =
            HWY_DYNAMIC_DISPATCH(TernaryQuantizeRows)(w, &s, threshold, packed, scales, r0, r1);
        if (first >= 0) atomic_min(bad, first);
      });
  return bad.load();
}

int64_t ternary_dequantize(const uint8_t* packed, const float* scales, const GroupedShape& s,
                           float* w) {
  if (s.numel() == 0) return -1;
  std::atomic<int64_t> bad{-1};
  loom::plugins::parallel_for(
      static_cast<std::size_t>(s.rows), row_grain(s, 1), [&](std::size_t b, std::size_t e) {
        const int64_t first = HWY_DYNAMIC_DISPATCH(TernaryDequantizeRows)(
            packed, scales, &s, w, static_cast<int64_t>(b), static_cast<int64_t>(e));
        if (first >= 0) atomic_min(bad, first);
      });
  return bad.load();
}

int64_t ternary_matmul(const float* x, int64_t m, const uint8_t* packed, const float* scales,
                       const GroupedShape& s, const float* bias, float* y) {
  if (m == 0 || s.rows == 0) return -1;
  if (s.cols == 0) {
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t n = 0; n < s.rows; ++n) y[i * s.rows + n] = bias != nullptr ? bias[n] : 0.0f;
    }
    return -1;
  }
  std::atomic<int64_t> bad{-1};
  const int64_t work = std::max<int64_t>(1, s.cols * std::max<int64_t>(1, m / 4));
  const auto grain = static_cast<std::size_t>(std::max<int64_t>(1, kTaskElements / work));
  loom::plugins::parallel_for(
      static_cast<std::size_t>(s.rows), grain, [&](std::size_t b, std::size_t e) {
        const int64_t first = HWY_DYNAMIC_DISPATCH(TernaryMatmulRows)(
            x, m, packed, scales, &s, bias, y, static_cast<int64_t>(b), static_cast<int64_t>(e));
        if (first >= 0) atomic_min(bad, first);
      });
  return bad.load();
}

}  // namespace loom::quant
#endif  // HWY_ONCE
