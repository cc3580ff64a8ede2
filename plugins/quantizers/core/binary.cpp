// Binary (BWN) kernels: the scalar reference and the Highway ones (every SIMD target, chosen at
// run time), over the host pool. See binary.hpp for the format and the summation order.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "binary.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#include <loom/quantizers/binary.hpp>
#include "xtc_simd-inl.h"

HWY_BEFORE_NAMESPACE();
namespace loom::quant {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Rows [r0, r1) (r0 a multiple of 8, so the rows' bits start on a byte): per group the scale
// and, in the same pass, the codes stored or ORed into the zeroed bytes. Returns the first
// non-finite element, or -1.
int64_t BinaryQuantizeRows(const float* HWY_RESTRICT w, const GroupedShape* sp, uint8_t* packed,
                           float* scales, int64_t r0, int64_t r1) {
  const GroupedShape& s = *sp;
  const int64_t gpr = s.groups_per_row();
  const uint64_t b0 = static_cast<uint64_t>(r0 * s.cols) / 8;
  const uint64_t b1 = (static_cast<uint64_t>(r1 * s.cols) + 7) / 8;
  std::memset(packed + b0, 0, b1 - b0);
  int64_t bad = -1;
  for (int64_t r = r0; r < r1; ++r) {
    const float* row = w + r * s.cols;
    for (int64_t g = 0; g < gpr; ++g) {
      const int64_t c0 = g * s.group_size;
      const int64_t n = std::min(s.group_size, s.cols - c0);
      const float sum =
          BinarySumAndCodes(row + c0, n, packed, static_cast<uint64_t>(r * s.cols + c0));
      if (!std::isfinite(sum) && (bad < 0 || bad >= s.numel())) {
        // A non-finite weight, or finite ones whose |w| sum overflows (group numel() + g).
        const int64_t at = FirstNonFinite(row + c0, n);
        if (at >= 0) {
          bad = r * s.cols + c0 + at;
        } else if (bad < 0) {
          bad = s.numel() + r * gpr + g;
        }
      }
      scales[r * gpr + g] = sum / static_cast<float>(n);
    }
  }
  return bad;
}

// Rows [r0, r1) of w from the codes.
void BinaryDequantizeRows(const uint8_t* HWY_RESTRICT packed, const float* HWY_RESTRICT scales,
                          const GroupedShape* sp, float* HWY_RESTRICT w, int64_t r0, int64_t r1) {
  const GroupedShape& s = *sp;
  const DM d;
  const hn::RebindToUnsigned<DM> du;
  const int N = static_cast<int>(hn::Lanes(d));
  alignas(64) static constexpr uint32_t kBit[16] = {
      1u << 0, 1u << 1, 1u << 2,  1u << 3,  1u << 4,  1u << 5,  1u << 6,  1u << 7,
      1u << 8, 1u << 9, 1u << 10, 1u << 11, 1u << 12, 1u << 13, 1u << 14, 1u << 15};
  const auto bitv = hn::LoadU(du, kBit);
  const uint64_t bytes = packed_bytes_of(s, 1);
  const int64_t gpr = s.groups_per_row();
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t g = 0; g < gpr; ++g) {
      const int64_t c0 = g * s.group_size;
      const int64_t n = std::min(s.group_size, s.cols - c0);
      const float alpha = scales[r * gpr + g];
      const auto pos = hn::Set(d, alpha);
      const auto neg = hn::Set(d, -alpha);
      float* out = w + r * s.cols + c0;
      const uint64_t bit0 = static_cast<uint64_t>(r * s.cols + c0);
      int64_t i = 0;
      for (; i + N <= n; i += N) {
        const uint32_t bits = Bits(packed, bytes, bit0 + static_cast<uint64_t>(i), N);
        const auto m = hn::RebindMask(d, hn::TestBit(hn::Set(du, bits), bitv));
        hn::StoreU(hn::IfThenElse(m, pos, neg), d, out + i);
      }
      for (; i < n; ++i) {
        out[i] = Bits(packed, bytes, bit0 + static_cast<uint64_t>(i), 1) ? alpha : -alpha;
      }
    }
  }
}

template <int R>
HWY_INLINE void BinaryBlock(const float* HWY_RESTRICT x0, int64_t K,
                            const uint8_t* HWY_RESTRICT packed, uint64_t bytes,
                            const float* HWY_RESTRICT scales, int64_t gpr, int64_t group_size,
                            int64_t n, float* out) {
  const DM d;
  const hn::RebindToUnsigned<DM> du;
  const int N = static_cast<int>(hn::Lanes(d));
  alignas(64) static constexpr uint32_t kBit[16] = {
      1u << 0, 1u << 1, 1u << 2,  1u << 3,  1u << 4,  1u << 5,  1u << 6,  1u << 7,
      1u << 8, 1u << 9, 1u << 10, 1u << 11, 1u << 12, 1u << 13, 1u << 14, 1u << 15};
  const auto bitv = hn::LoadU(du, kBit);
  const auto sign = hn::Set(d, -0.0f);
  const uint64_t rowbit = static_cast<uint64_t>(n * K);
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
      const uint32_t bits = Bits(packed, bytes, rowbit + static_cast<uint64_t>(k), N);
      const auto plus = hn::RebindMask(d, hn::TestBit(hn::Set(du, bits), bitv));
      const auto flip = hn::IfThenZeroElse(plus, sign);
      a0 = hn::Add(a0, hn::Xor(hn::LoadU(d, x0 + k), flip));
      if constexpr (R > 1) a1 = hn::Add(a1, hn::Xor(hn::LoadU(d, x1 + k), flip));
      if constexpr (R > 2) a2 = hn::Add(a2, hn::Xor(hn::LoadU(d, x2 + k), flip));
      if constexpr (R > 3) a3 = hn::Add(a3, hn::Xor(hn::LoadU(d, x3 + k), flip));
    }
    for (; k < c0 + len; ++k) {
      const bool p = Bits(packed, bytes, rowbit + static_cast<uint64_t>(k), 1) != 0;
      sc[0] += p ? x0[k] : -x0[k];
      if constexpr (R > 1) sc[1] += p ? x1[k] : -x1[k];
      if constexpr (R > 2) sc[2] += p ? x2[k] : -x2[k];
      if constexpr (R > 3) sc[3] += p ? x3[k] : -x3[k];
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

// y[:, n] for W rows [n0, n1): per group, alpha times the sum of x with the sign of each code
// (x XOR the sign bit where the code is 0), four activation rows per pass over the codes.
void BinaryMatmulRows(const float* HWY_RESTRICT x, int64_t m, const uint8_t* HWY_RESTRICT packed,
                      const float* HWY_RESTRICT scales, const GroupedShape* sp,
                      const float* HWY_RESTRICT bias, float* HWY_RESTRICT y, int64_t n0,
                      int64_t n1) {
  const GroupedShape& s = *sp;
  const uint64_t bytes = packed_bytes_of(s, 1);
  const int64_t gpr = s.groups_per_row();
  const int64_t K = s.cols;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t mb = 0; mb < m; mb += 4) {
      const int64_t mr = std::min<int64_t>(4, m - mb);
      const float* x0 = x + mb * K;
      float out[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      switch (mr) {
        case 1:
          BinaryBlock<1>(x0, K, packed, bytes, scales, gpr, s.group_size, n, out);
          break;
        case 2:
          BinaryBlock<2>(x0, K, packed, bytes, scales, gpr, s.group_size, n, out);
          break;
        case 3:
          BinaryBlock<3>(x0, K, packed, bytes, scales, gpr, s.group_size, n, out);
          break;
        default:
          BinaryBlock<4>(x0, K, packed, bytes, scales, gpr, s.group_size, n, out);
      }
      const float b = bias != nullptr ? bias[n] : 0.0f;
      for (int64_t j = 0; j < mr; ++j) y[(mb + j) * s.rows + n] = out[j] + b;
    }
  }
}

const char* TargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace loom::quant
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "common/parallel_for.hpp"

namespace loom::quant {

HWY_EXPORT(BinaryQuantizeRows);
HWY_EXPORT(BinaryDequantizeRows);
HWY_EXPORT(BinaryMatmulRows);
HWY_EXPORT(TargetName);

namespace {

// Rows per task so that a task moves about this many weights.
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

}  // namespace

const char* xtc_simd_target() { return HWY_DYNAMIC_DISPATCH(TargetName)(); }

int64_t binary_quantize_ref(const float* w, const GroupedShape& s, uint8_t* packed, float* scales) {
  for (int64_t i = 0; i < s.numel(); ++i) {
    if (!std::isfinite(w[i])) return i;
  }
  const uint64_t bytes = packed_bytes_of(s, 1);
  std::memset(packed, 0, bytes);
  const int64_t gpr = s.groups_per_row();
  for (int64_t r = 0; r < s.rows; ++r) {
    for (int64_t g = 0; g < gpr; ++g) {
      const int64_t c0 = g * s.group_size;
      const int64_t n = std::min(s.group_size, s.cols - c0);
      const float* p = w + r * s.cols + c0;
      const float sum = group_abs_sum_ref(p, n, -1.0f, nullptr);
      if (!std::isfinite(sum)) return s.numel() + r * gpr + g;
      scales[r * gpr + g] = sum / static_cast<float>(n);
      for (int64_t i = 0; i < n; ++i) {
        const auto e = static_cast<uint64_t>(r * s.cols + c0 + i);
        if (p[i] >= 0.0f) packed[e / 8] = static_cast<uint8_t>(packed[e / 8] | (1u << (e % 8)));
      }
    }
  }
  return -1;
}

void binary_dequantize_ref(const uint8_t* packed, const float* scales, const GroupedShape& s,
                           float* w) {
  const int64_t gpr = s.groups_per_row();
  for (int64_t e = 0; e < s.numel(); ++e) {
    const int64_t r = e / s.cols;
    const int64_t g = (e % s.cols) / s.group_size;
    const float alpha = scales[r * gpr + g];
    const bool one = ((packed[e / 8] >> (e % 8)) & 1u) != 0;
    w[e] = one ? alpha : -alpha;
  }
}

void binary_matmul_ref(const float* x, int64_t m, const uint8_t* packed, const float* scales,
                       const GroupedShape& s, const float* bias, float* y) {
  const int64_t gpr = s.groups_per_row();
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t n = 0; n < s.rows; ++n) {
      float acc = 0.0f;
      for (int64_t g = 0; g < gpr; ++g) {
        const int64_t c0 = g * s.group_size;
        const int64_t len = std::min(s.group_size, s.cols - c0);
        float part = 0.0f;
        for (int64_t k = c0; k < c0 + len; ++k) {
          const auto e = static_cast<uint64_t>(n * s.cols + k);
          const float v = x[i * s.cols + k];
          part += ((packed[e / 8] >> (e % 8)) & 1u) != 0 ? v : -v;
        }
        acc += scales[n * gpr + g] * part;
      }
      y[i * s.rows + n] = acc + (bias != nullptr ? bias[n] : 0.0f);
    }
  }
}

int64_t binary_quantize(const float* w, const GroupedShape& s, uint8_t* packed, float* scales) {
  if (s.numel() == 0) return -1;
  std::atomic<int64_t> bad{-1};
  const int64_t units = (s.rows + 7) / 8;
  loom::plugins::parallel_for(
      static_cast<std::size_t>(units), row_grain(s, 8), [&](std::size_t b, std::size_t e) {
        const int64_t r0 = static_cast<int64_t>(b) * 8;
        const int64_t r1 = std::min(s.rows, static_cast<int64_t>(e) * 8);
        const int64_t first =
            HWY_DYNAMIC_DISPATCH(BinaryQuantizeRows)(w, &s, packed, scales, r0, r1);
        if (first >= 0) atomic_min(bad, first);
      });
  return bad.load();
}

void binary_dequantize(const uint8_t* packed, const float* scales, const GroupedShape& s,
                       float* w) {
  if (s.numel() == 0) return;
  loom::plugins::parallel_for(
      static_cast<std::size_t>(s.rows), row_grain(s, 1), [&](std::size_t b, std::size_t e) {
        HWY_DYNAMIC_DISPATCH(BinaryDequantizeRows)
        (packed, scales, &s, w, static_cast<int64_t>(b), static_cast<int64_t>(e));
      });
}

void binary_matmul(const float* x, int64_t m, const uint8_t* packed, const float* scales,
                   const GroupedShape& s, const float* bias, float* y) {
  if (m == 0 || s.rows == 0) return;
  if (s.cols == 0) {
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t n = 0; n < s.rows; ++n) y[i * s.rows + n] = bias != nullptr ? bias[n] : 0.0f;
    }
    return;
  }
  // Each task reads its rows' codes once per four activation rows.
  const int64_t work = std::max<int64_t>(1, s.cols * std::max<int64_t>(1, m / 4));
  const auto grain = static_cast<std::size_t>(std::max<int64_t>(1, kTaskElements / work));
  loom::plugins::parallel_for(
      static_cast<std::size_t>(s.rows), grain, [&](std::size_t b, std::size_t e) {
        HWY_DYNAMIC_DISPATCH(BinaryMatmulRows)
        (x, m, packed, scales, &s, bias, y, static_cast<int64_t>(b), static_cast<int64_t>(e));
      });
}

}  // namespace loom::quant
#endif  // HWY_ONCE
