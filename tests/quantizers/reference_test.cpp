// The reference encoders (quant_core.hpp) on hand-computed values: every range and symmetry,
// rounding half to even, groups along K with a shorter last group, the decoded values, and
// DeepSpeed's formulas written out for the "deepspeed" range.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "quant_core.hpp"

namespace {

using loom::quant::Groups;
using loom::quant::IntScheme;
using loom::quant::Range;

struct Result {
  std::vector<uint8_t> packed;
  std::vector<float> scales;
  std::vector<uint8_t> zeros;
  std::vector<int32_t> codes;  // sign-extended when symmetric
  std::vector<float> decoded;
};

Result run(const std::vector<float>& x, int64_t rows, int64_t group, IntScheme q) {
  const int64_t cols = static_cast<int64_t>(x.size()) / rows;
  const Groups gs = Groups::of(rows, cols, group);
  Result r;
  r.packed.assign(loom::quant::packed_size(x.size(), q.bits), 0xAB);
  r.scales.assign(static_cast<std::size_t>(gs.count()), -1.0f);
  r.zeros.assign(static_cast<std::size_t>(gs.count()), 0xEE);
  loom::quant::reference_quantize(x.data(), gs, q, LOOM_QUANT_PACK_LSB_FIRST, r.packed.data(),
                                  r.scales.data(), r.zeros.data());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const uint32_t u =
        loom::quant::read_code(r.packed.data(), i, q.bits, LOOM_QUANT_PACK_LSB_FIRST);
    r.codes.push_back(q.symmetric ? loom::quant::sign_extend(u, q.bits) : static_cast<int32_t>(u));
  }
  r.decoded.assign(x.size(), NAN);
  loom::quant::reference_dequantize(r.packed.data(), r.scales.data(), r.zeros.data(), gs, q,
                                    LOOM_QUANT_PACK_LSB_FIRST, r.decoded.data());
  return r;
}

TEST(QuantReference, ExactSymmetricInt8RoundsHalfToEven) {
  const std::vector<float> x = {127, -64, 0.5f, 1.5f, 2.5f, -127, -0.5f, -1.5f};
  const auto r = run(x, 1, 0, {8, true, Range::kExact});
  EXPECT_EQ(r.scales, std::vector<float>{1.0f});
  EXPECT_EQ(r.codes, (std::vector<int32_t>{127, -64, 0, 2, 2, -127, 0, -2}));
  // Two's complement bytes, one per code.
  EXPECT_EQ(r.packed, (std::vector<uint8_t>{0x7F, 0xC0, 0x00, 0x02, 0x02, 0x81, 0x00, 0xFE}));
  EXPECT_EQ(r.decoded, (std::vector<float>{127, -64, 0, 2, 2, -127, 0, -2}));
}

TEST(QuantReference, DeepSpeedSymmetricDividesBy2ToTheBits) {
  // DeepSpeed's SymQuantizer: s = 2 max|x| / 2^b, q = clamp(round(x / s), -2^(b-1), 2^(b-1) - 1).
  // 4 bits, max|x| = 1: s = 2 / 16 = 0.125; 1 / s = 8 clips to 7, -1 / s = -8 stays.
  const std::vector<float> x = {1.0f, -1.0f, 0.5f, 0.3f, -0.0625f, 0.1875f};
  const auto r = run(x, 1, 0, {4, true, Range::kDeepSpeed});
  EXPECT_EQ(r.scales, std::vector<float>{0.125f});
  EXPECT_EQ(r.codes, (std::vector<int32_t>{7, -8, 4, 2, 0, 2}));  // 2.4 -> 2, -0.5 -> 0, 1.5 -> 2
  // Nibbles, element 0 low: (7, -8 = 0x8), (4, 2), (0, 2).
  EXPECT_EQ(r.packed, (std::vector<uint8_t>{0x87, 0x24, 0x20}));
  EXPECT_EQ(r.decoded, (std::vector<float>{0.875f, -1.0f, 0.5f, 0.25f, 0.0f, 0.25f}));
  // 8 bits, max|x| = 127: s = 254 / 256; 127 / s = 128 clips to 127, -127 / s = -128.
  const auto r8 = run({127.0f, -127.0f, 2.5f}, 1, 0, {8, true, Range::kDeepSpeed});
  EXPECT_EQ(r8.scales, std::vector<float>{127.0f / 128.0f});
  EXPECT_EQ(r8.codes, (std::vector<int32_t>{127, -128, 3}));  // 2.5 * 128 / 127 = 2.52 -> 3
}

TEST(QuantReference, ExactSymmetricFourBitsPutsTheExtremeOnSeven) {
  const std::vector<float> x = {-7.0f, 3.5f, 0.5f, 7.0f};
  const auto r = run(x, 1, 0, {4, true, Range::kExact});
  EXPECT_EQ(r.scales, std::vector<float>{1.0f});
  EXPECT_EQ(r.codes, (std::vector<int32_t>{-7, 4, 0, 7}));  // 3.5 -> 4 (even), 0.5 -> 0
  EXPECT_EQ(r.packed, (std::vector<uint8_t>{0x49, 0x70}));
}

TEST(QuantReference, AsymmetricExactAndDeepSpeed) {
  // exact: range [-1, 6.5], s = 7.5 / 15 = 0.5, z = round(1 / 0.5) = 2.
  const std::vector<float> x = {-1.0f, 0.0f, 2.5f, 6.5f};
  const auto e = run(x, 1, 0, {4, false, Range::kExact});
  EXPECT_EQ(e.scales, std::vector<float>{0.5f});
  EXPECT_EQ(e.zeros, std::vector<uint8_t>{2});
  EXPECT_EQ(e.codes, (std::vector<int32_t>{0, 2, 7, 15}));
  EXPECT_EQ(e.packed, (std::vector<uint8_t>{0x20, 0xF7}));
  EXPECT_EQ(e.decoded, x);
  // DeepSpeed's AsymQuantizer: s = (max - min) / 2^b, zero point round(min / s) s,
  // q = clamp(round((x - zp) / s), 0, 2^b - 1). Range [-1, 7]: s = 0.5, zp = -1 (z = 2);
  // 7 -> round(8 / 0.5) = 16 clips to 15.
  const std::vector<float> y = {-1.0f, 0.0f, 2.5f, 7.0f};
  const auto d = run(y, 1, 0, {4, false, Range::kDeepSpeed});
  EXPECT_EQ(d.scales, std::vector<float>{0.5f});
  EXPECT_EQ(d.zeros, std::vector<uint8_t>{2});
  const float s = (7.0f - -1.0f) / 16.0f;
  const float zp = std::nearbyint(-1.0f / s) * s;
  std::vector<int32_t> want;
  for (float v : y)
    want.push_back(
        static_cast<int32_t>(std::fmin(std::fmax(std::nearbyint((v - zp) / s), 0.0f), 15.0f)));
  EXPECT_EQ(d.codes, want);
  EXPECT_EQ(d.codes, (std::vector<int32_t>{0, 2, 7, 15}));
}

TEST(QuantReference, AsymmetricRangeAlwaysHoldsZero) {
  // All positive: the range is [0, 4], so z = 0 and 0 decodes exactly.
  const auto r = run({2.0f, 4.0f, 1.0f}, 1, 0, {8, false, Range::kExact});
  EXPECT_FLOAT_EQ(r.scales[0], 4.0f / 255.0f);
  EXPECT_EQ(r.zeros, std::vector<uint8_t>{0});
  EXPECT_EQ(r.codes[1], 255);
  // All negative: z = 2^b - 1.
  const auto n = run({-2.0f, -4.0f}, 1, 0, {8, false, Range::kExact});
  EXPECT_EQ(n.zeros, std::vector<uint8_t>{255});
  EXPECT_EQ(n.codes, (std::vector<int32_t>{128, 0}));
}

TEST(QuantReference, ZeroGroupsGetScaleOne) {
  for (bool sym : {true, false}) {
    for (Range range : {Range::kExact, Range::kDeepSpeed}) {
      const auto r = run({0.0f, -0.0f, 0.0f, 0.0f}, 2, 0, {3, sym, range});
      EXPECT_EQ(r.scales, (std::vector<float>{1.0f, 1.0f}));
      EXPECT_EQ(r.codes, (std::vector<int32_t>{0, 0, 0, 0}));
      EXPECT_EQ(r.packed, (std::vector<uint8_t>{0x00, 0x00}));  // unused bits zeroed too
      if (!sym) {
        EXPECT_EQ(r.zeros, (std::vector<uint8_t>{0, 0}));
      }
    }
  }
}

TEST(QuantReference, GroupsAlongKWithAShorterLastGroup) {
  // 2 rows of 6, groups of 4: scales of row 0 from {1, -2, 4, 0.5} and {8, -1}, row 1 from
  // {0.25, ...} and {-16, 2}.
  const std::vector<float> x = {1, -2, 4, 0.5f, 8, -1, 0.25f, 0, 0, 0, -16, 2};
  const auto r = run(x, 2, 4, {8, true, Range::kExact});
  EXPECT_EQ(r.scales, (std::vector<float>{4.0f / 127, 8.0f / 127, 0.25f / 127, 16.0f / 127}));
  EXPECT_EQ(r.codes[2], 127);
  EXPECT_EQ(r.codes[4], 127);
  EXPECT_EQ(r.codes[5], -16);  // -1 / (8 / 127) = -15.875
  EXPECT_EQ(r.codes[6], 127);
  EXPECT_EQ(r.codes[10], -127);
  EXPECT_EQ(r.codes[11], 16);
  for (std::size_t i = 0; i < x.size(); ++i) {
    const float s = r.scales[(i / 6) * 2 + (i % 6) / 4];
    EXPECT_LE(std::fabs(r.decoded[i] - x[i]), 0.5f * s * 1.0001f) << i;
  }
}

TEST(QuantReference, TokenWiseInt8) {
  const std::vector<float> x = {0.5f, -1.27f, 0.0f, 0.0f, 3.0f, -0.75f};
  std::vector<int8_t> q(6);
  std::vector<float> s(3);
  loom::quant::reference_quantize_rows_int8(x.data(), 3, 2, q.data(), s.data());
  EXPECT_EQ(s[0], 1.27f / 127.0f);
  EXPECT_EQ(s[1], 1.0f);
  EXPECT_EQ(s[2], 3.0f / 127.0f);
  EXPECT_EQ(q, (std::vector<int8_t>{50, -127, 0, 0, 127, -32}));  // -31.75 -> -32
}

TEST(QuantReference, NonFiniteMessageNamesTheElement) {
  const std::vector<float> x = {1, 2, 3, 4, NAN, 6};
  EXPECT_EQ(loom::quant::first_non_finite(x.data(), 6), 4);
  EXPECT_EQ(loom::quant::non_finite_message("weight", x.data(), 3, 4),
            "weight[1, 1] is nan (quantize takes finite values only)");
  const std::vector<float> y = {1, -INFINITY};
  EXPECT_EQ(loom::quant::non_finite_message("x", y.data(), 2, 1),
            "x[0, 1] is -inf (quantize takes finite values only)");
}

}  // namespace
