// Binary (BWN) kernels: the scalar reference and the Highway ones (every SIMD target, chosen at
// run time), over the host pool. See binary.hpp for the format and the summation order.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "binary.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <loom/quantizers/binary.hpp>
#include "widen-inl.h"
#include "xtc_simd-inl.h"

HWY_BEFORE_NAMESPACE();
namespace loom::quant {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Rows [r0, r1) (r0 a multiple of 8, so the rows' bits start on a byte): per group the scale
// and, in the same pass, the codes stored or ORed into the zeroed bytes. Returns the first
// non-finite element, or -1. The weight is w (float32), or w16 (bf16 or float16 patterns,
// `bf16` says which): each group is then widened into L1 first, exactly, so the codes and
// scales are those of the float32 widening.
int64_t BinaryQuantizeRows(const float* HWY_RESTRICT w, const uint16_t* w16, bool bf16,
                           const GroupedShape* sp, uint8_t* packed, float* scales, int64_t r0,
                           int64_t r1) {
  const GroupedShape& s = *sp;
  const int64_t gpr = s.groups_per_row();
  const uint64_t b0 = static_cast<uint64_t>(r0 * s.cols) / 8;
  const uint64_t b1 = (static_cast<uint64_t>(r1 * s.cols) + 7) / 8;
  std::memset(packed + b0, 0, b1 - b0);
  std::vector<float> wide(w16 != nullptr ? static_cast<std::size_t>(std::min(s.group_size, s.cols))
                                         : 0);
  int64_t bad = -1;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t g = 0; g < gpr; ++g) {
      const int64_t c0 = g * s.group_size;
      const int64_t n = std::min(s.group_size, s.cols - c0);
      const float* at = w16 == nullptr ? w + r * s.cols + c0 : wide.data();
      if (w16 != nullptr) {
        const int64_t e = r * s.cols + c0;
        WidenRow(w16 + e, bf16, n, wide.data());
        PrefetchRow16(w16 + e + n, std::min(n, s.numel() - e - n));  // the next group
      }
      const float sum = BinarySumAndCodes(at, n, packed, static_cast<uint64_t>(r * s.cols + c0));
      if (!std::isfinite(sum) && (bad < 0 || bad >= s.numel())) {
        // A non-finite weight, or finite ones whose |w| sum overflows (group numel() + g).
        const int64_t at_bad = FirstNonFinite(at, n);
        if (at_bad >= 0) {
          bad = r * s.cols + c0 + at_bad;
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

// The codes of W row n for GroupBlock: a lane's x keeps its sign where the code is 1 and is
// negated (XOR the sign bit) where it is 0.
struct BinaryCodes {
  const uint8_t* packed;
  uint64_t bytes;
  uint64_t rowbit;  // the row's first element
  hn::Vec<hn::RebindToUnsigned<DM>> bitv;
  VM sign;

  HWY_INLINE VM Load(int64_t k) const {
    const DM d;
    const hn::RebindToUnsigned<DM> du;
    const int N = static_cast<int>(hn::Lanes(d));
    const uint32_t bits = Bits(packed, bytes, rowbit + static_cast<uint64_t>(k), N);
    const auto plus = hn::RebindMask(d, hn::TestBit(hn::Set(du, bits), bitv));
    return hn::IfThenZeroElse(plus, sign);
  }
  HWY_INLINE VM Signed(VM flip, VM x) const { return hn::Xor(x, flip); }
  HWY_INLINE bool Scalar(int64_t k) const {
    return Bits(packed, bytes, rowbit + static_cast<uint64_t>(k), 1) != 0;
  }
  HWY_INLINE float Add(float acc, bool p, float x) const { return acc + (p ? x : -x); }
};

// y[:, n] for W rows [n0, n1): per group, alpha times the sum of x with the sign of each code.
void BinaryMatmulRows(const float* HWY_RESTRICT x, int64_t m, const uint8_t* HWY_RESTRICT packed,
                      const float* HWY_RESTRICT scales, const GroupedShape* sp,
                      const float* HWY_RESTRICT bias, float* HWY_RESTRICT y, int64_t n0,
                      int64_t n1) {
  const GroupedShape& s = *sp;
  const DM d;
  const hn::RebindToUnsigned<DM> du;
  alignas(64) static constexpr uint32_t kBit[16] = {
      1u << 0, 1u << 1, 1u << 2,  1u << 3,  1u << 4,  1u << 5,  1u << 6,  1u << 7,
      1u << 8, 1u << 9, 1u << 10, 1u << 11, 1u << 12, 1u << 13, 1u << 14, 1u << 15};
  const BinaryCodes base{packed, packed_bytes_of(s, 1), 0, hn::LoadU(du, kBit), hn::Set(d, -0.0f)};
  auto make = [&](int64_t n, int64_t) HWY_ATTR {
    BinaryCodes c = base;
    c.rowbit = static_cast<uint64_t>(n * s.cols);
    return c;
  };
  GroupMatmulRows(x, m, scales, s, bias, y, n0, n1, make);
}

const char* TargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace loom::quant
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "xtc_rows.hpp"

namespace loom::quant {

HWY_EXPORT(BinaryQuantizeRows);
HWY_EXPORT(BinaryDequantizeRows);
HWY_EXPORT(BinaryMatmulRows);
HWY_EXPORT(TargetName);

using xtc_rows::first_bad_over_rows;

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
  xtc_rows::matmul_ref(x, m, scales, s, bias, y, [&](float part, int64_t e, float v) {
    return part + (((packed[e / 8] >> (e % 8)) & 1u) != 0 ? v : -v);
  });
}

int64_t binary_quantize(const float* w, const GroupedShape& s, uint8_t* packed, float* scales) {
  if (s.numel() == 0) return -1;
  return first_bad_over_rows(s, 8, [&](int64_t r0, int64_t r1) {
    return HWY_DYNAMIC_DISPATCH(BinaryQuantizeRows)(w, nullptr, false, &s, packed, scales, r0, r1);
  });
}

int64_t binary_quantize16(const uint16_t* w, bool bf16, const GroupedShape& s, uint8_t* packed,
                          float* scales) {
  if (s.numel() == 0) return -1;
  return first_bad_over_rows(s, 8, [&](int64_t r0, int64_t r1) {
    return HWY_DYNAMIC_DISPATCH(BinaryQuantizeRows)(nullptr, w, bf16, &s, packed, scales, r0, r1);
  });
}

void binary_dequantize(const uint8_t* packed, const float* scales, const GroupedShape& s,
                       float* w) {
  if (s.numel() == 0) return;
  first_bad_over_rows(s, 1, [&](int64_t r0, int64_t r1) {
    HWY_DYNAMIC_DISPATCH(BinaryDequantizeRows)(packed, scales, &s, w, r0, r1);
    return int64_t{-1};
  });
}

void binary_matmul(const float* x, int64_t m, const uint8_t* packed, const float* scales,
                   const GroupedShape& s, const float* bias, float* y) {
  xtc_rows::matmul_over_rows(m, s, bias, y, [&](int64_t n0, int64_t n1) {
    HWY_DYNAMIC_DISPATCH(BinaryMatmulRows)(x, m, packed, scales, &s, bias, y, n0, n1);
    return int64_t{-1};
  });
}

}  // namespace loom::quant
#endif  // HWY_ONCE
