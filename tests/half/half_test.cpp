// plugins/common/half.hpp on the host: every fp16 and bf16 pattern round-trips through fp32,
// and fp32 -> fp16 / bf16 agrees with an exact reference (tests/half/reference.hpp) on ties,
// subnormals, the overflow edges, NaN payloads and a sweep through all fp32 patterns.
#include "common/half.hpp"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "reference.hpp"

namespace {

namespace h = loom::plugins::half;

bool f16_is_nan(uint16_t x) { return (x & 0x7c00) == 0x7c00 && (x & 0x3ff) != 0; }
bool bf16_is_nan(uint16_t x) { return (x & 0x7f80) == 0x7f80 && (x & 0x7f) != 0; }

TEST(Half, EveryF16PatternRoundTrips) {
  for (uint32_t i = 0; i < 0x10000; ++i) {
    const auto x = static_cast<uint16_t>(i);
    const float f = h::f16_to_f32(x);
    const uint32_t fb = std::bit_cast<uint32_t>(f);
    // Widening is exact: sign, exponent and payload land where they belong.
    EXPECT_EQ(fb >> 31, static_cast<uint32_t>(x >> 15)) << i;
    if (f16_is_nan(x)) {
      ASSERT_TRUE(std::isnan(f)) << i;
      EXPECT_EQ((fb >> 13) & 0x3ff, x & 0x3ffu) << i;  // the whole payload, quiet bit included
      // Back: a quiet NaN comes back as it was, a signalling one with its quiet bit set.
      EXPECT_EQ(h::f32_to_f16(f), x | 0x200) << i;
      continue;
    }
    if ((x & 0x7fff) == 0x7c00) {
      EXPECT_TRUE(std::isinf(f)) << i;
    } else {
      EXPECT_EQ(static_cast<double>(f), half_ref::f16_value(x)) << i;  // subnormals too
    }
    EXPECT_EQ(h::f32_to_f16(f), x) << i;
  }
}

TEST(Half, EveryBf16PatternRoundTrips) {
  for (uint32_t i = 0; i < 0x10000; ++i) {
    const auto x = static_cast<uint16_t>(i);
    const float f = h::bf16_to_f32(x);
    EXPECT_EQ(std::bit_cast<uint32_t>(f), i << 16) << i;  // widening is the upper half
    if (bf16_is_nan(x)) {
      ASSERT_TRUE(std::isnan(f)) << i;
      EXPECT_EQ(h::f32_to_bf16(f), x | 0x40) << i;
    } else {
      EXPECT_EQ(h::f32_to_bf16(f), x) << i;
    }
  }
}

TEST(Half, F32ToF16MatchesTheExactReference) {
  const std::vector<uint32_t> in = half_ref::probe_floats();
  ASSERT_GT(in.size(), 1000000u);
  int failures = 0;
  for (uint32_t x : in) {
    const float f = std::bit_cast<float>(x);
    const uint16_t got = h::f32_to_f16(f);
    const uint16_t want = half_ref::to_f16(f);
    if (got != want && failures++ < 10) {
      ADD_FAILURE() << std::hex << "f32 0x" << x << " -> f16 0x" << got << ", want 0x" << want;
    }
  }
  EXPECT_EQ(failures, 0);
}

TEST(Half, F32ToBf16MatchesTheExactReference) {
  const std::vector<uint32_t> in = half_ref::probe_floats();
  int failures = 0;
  for (uint32_t x : in) {
    const float f = std::bit_cast<float>(x);
    const uint16_t got = h::f32_to_bf16(f);
    const uint16_t want = half_ref::to_bf16(f);
    if (got != want && failures++ < 10) {
      ADD_FAILURE() << std::hex << "f32 0x" << x << " -> bf16 0x" << got << ", want 0x" << want;
    }
  }
  EXPECT_EQ(failures, 0);
}

// The rule's named cases, spelled out (the reference could share a mistake with the code).
TEST(Half, NamedCases) {
  const float inf = std::numeric_limits<float>::infinity();
  // Ties to even.
  EXPECT_EQ(h::f32_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  EXPECT_EQ(h::f32_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_EQ(h::f32_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  EXPECT_EQ(h::f32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  // The fp16 overflow edge: 65504 is the largest half; 65520 is the tie to Inf.
  EXPECT_EQ(h::f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(h::f32_to_f16(std::nextafter(65520.0f, 0.0f)), 0x7bff);
  EXPECT_EQ(h::f32_to_f16(65520.0f), 0x7c00);
  EXPECT_EQ(h::f32_to_f16(-65520.0f), 0xfc00);
  EXPECT_EQ(h::f32_to_f16(inf), 0x7c00);
  EXPECT_EQ(h::f32_to_f16(-inf), 0xfc00);
  EXPECT_EQ(h::f32_to_bf16(std::numeric_limits<float>::max()), 0x7f80);  // rounds up to Inf
  EXPECT_EQ(h::f32_to_bf16(-inf), 0xff80);
  // Subnormals, exact; 2^-25 is the tie to zero, just above it the smallest subnormal.
  EXPECT_EQ(h::f32_to_f16(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(h::f32_to_f16(std::ldexp(1.0f, -25)), 0x0000);
  EXPECT_EQ(h::f32_to_f16(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), 0x0001);
  EXPECT_EQ(h::f32_to_f16(-std::ldexp(3.0f, -25)), 0x8002);    // 1.5 ulp: tie to even (2)
  EXPECT_EQ(h::f32_to_f16(std::ldexp(1023.5f, -24)), 0x0400);  // rounds up to the smallest normal
  EXPECT_EQ(h::f16_to_f32(0x03ff), std::ldexp(1023.0f, -24));
  EXPECT_EQ(h::f32_to_f16(-0.0f), 0x8000);
  EXPECT_EQ(h::f32_to_bf16(-0.0f), 0x8000);
  EXPECT_EQ(h::f32_to_bf16(std::numeric_limits<float>::denorm_min()), 0x0000);
  // NaN: quiet, sign and leading payload kept.
  EXPECT_EQ(h::f32_to_f16(std::bit_cast<float>(0x7f800001u)), 0x7e00);  // signalling -> quiet
  EXPECT_EQ(h::f32_to_f16(std::bit_cast<float>(0xffc00000u)), 0xfe00);  // sign kept
  EXPECT_EQ(h::f32_to_f16(std::bit_cast<float>(0x7fd5a000u)), 0x7ead);  // payload kept
  EXPECT_EQ(h::f32_to_bf16(std::bit_cast<float>(0x7f800001u)), 0x7fc0);
  EXPECT_EQ(h::f32_to_bf16(std::bit_cast<float>(0xff8a0000u)), 0xffca);
}

}  // namespace
