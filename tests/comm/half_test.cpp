// The ucx transport's reductions and conversions, by the names it uses (plugins/common/reduce.hpp
// over plugins/common/half.hpp), against exact arithmetic in double: every half value
// round-trips, float -> half rounds to nearest even, with subnormals, overflow to infinity and
// NaN handled, and reductions accumulate in fp32. tests/half checks the conversions exhaustively.
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include <gtest/gtest.h>

#include "common/reduce.hpp"

namespace {

using namespace loom::plugins::ucx;

// The exact value of a finite half, computed in double from its fields (the reference).
double f16_value(uint16_t h) {
  const int e = (h >> 10) & 0x1f;
  const int m = h & 0x3ff;
  const double v = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return (h & 0x8000) != 0 ? -v : v;
}

TEST(Half, EveryF16RoundTrips) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const auto x = static_cast<uint16_t>(h);
    const float f = f16_to_f32(x);
    if (((x >> 10) & 0x1f) == 0x1f && (x & 0x3ff) != 0) {
      EXPECT_TRUE(std::isnan(f));
      EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(f))));
      continue;
    }
    if (((x >> 10) & 0x1f) != 0x1f) {
      EXPECT_EQ(static_cast<double>(f), f16_value(x)) << h;
    }
    EXPECT_EQ(f32_to_f16(f), x) << h;
  }
}

TEST(Half, F32ToF16RoundsToNearestEven) {
  // Midpoints between neighbouring halves go to the even one; just off them, to the nearer.
  for (uint32_t h = 0; h < 0x7bff; h += 7) {
    const double lo = f16_value(static_cast<uint16_t>(h));
    const double hi = f16_value(static_cast<uint16_t>(h + 1));
    const double mid = (lo + hi) / 2;
    const auto even = static_cast<uint16_t>((h & 1) == 0 ? h : h + 1);
    EXPECT_EQ(f32_to_f16(static_cast<float>(mid)), even) << h;
    EXPECT_EQ(f32_to_f16(std::nextafter(static_cast<float>(mid), 0.0f)), h) << h;
    EXPECT_EQ(f32_to_f16(std::nextafter(static_cast<float>(mid), 1e9f)), h + 1) << h;
    EXPECT_EQ(f32_to_f16(-static_cast<float>(mid)), even | 0x8000) << h;
  }
  EXPECT_EQ(f32_to_f16(65519.0f), 0x7bff);  // below the midpoint to 65536: max half
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);  // the midpoint rounds to even: infinity
  EXPECT_EQ(f32_to_f16(1e30f), 0x7c00);
  EXPECT_EQ(f32_to_f16(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_EQ(f32_to_f16(1e-10f), 0);  // below half the smallest subnormal
  EXPECT_EQ(f32_to_f16(-0.0f), 0x8000);
}

TEST(Half, Bf16RoundsToNearestEven) {
  for (uint32_t h = 0; h < 0x7f80; h += 3) {
    const float lo = bf16_to_f32(static_cast<uint16_t>(h));
    EXPECT_EQ(f32_to_bf16(lo), h);
    const uint32_t mid_bits = (h << 16) | 0x8000U;  // exactly between h and h + 1
    const auto even = static_cast<uint16_t>((h & 1) == 0 ? h : h + 1);
    EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(mid_bits)), even) << h;
    EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(mid_bits - 1)), h) << h;
    EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(mid_bits + 1)), h + 1) << h;
  }
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(Half, ReductionsAccumulateInF32AndAgreeBothWays) {
  // max/min of +0 and -0 give the same bits whichever side each is on.
  float a = 0.0f;
  float b = -0.0f;
  EXPECT_EQ(std::bit_cast<uint32_t>(combine<Op::kMax>(a, b)),
            std::bit_cast<uint32_t>(combine<Op::kMax>(b, a)));
  EXPECT_EQ(std::bit_cast<uint32_t>(combine<Op::kMin>(a, b)),
            std::bit_cast<uint32_t>(combine<Op::kMin>(b, a)));
  // bf16 sum: 256 + 1 is not a bf16, so it rounds once (to even: 256).
  uint16_t acc = f32_to_bf16(256.0f);
  const uint16_t one = f32_to_bf16(1.0f);
  reduce(Op::kSum, Dtype::kBF16, &acc, &one, 1);
  EXPECT_EQ(bf16_to_f32(acc), 256.0f);
  uint16_t h = f32_to_f16(3.0f);
  divide(Dtype::kF16, &h, 1, 3.0f);
  EXPECT_EQ(f16_to_f32(h), 1.0f);
}

}  // namespace
