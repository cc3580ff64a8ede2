// The xtc kernels (plugins/quantizers/core/binary.*, ternary.*) directly: the Highway
// quantizers against the scalar reference bit for bit on every SIMD target this CPU has,
// round trips, the packed matmuls against the reference and against dequantize-then-matmul,
// 16-bit weights against their float32 widening, and the bad-input reports (first
// non-finite weight, first invalid ternary code).
#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <loom/quantizers/binary.hpp>
#include "../common/float16_reference.hpp"
#include "quant_core.hpp"
#include "ternary.hpp"

namespace {

using loom::quant::GroupedShape;

template <class Fn>
void for_each_target(Fn body) {
  for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    SCOPED_TRACE(std::string("target ") + hwy::TargetName(target));
    body();
  }
  hwy::SetSupportedTargetsForTest(0);
}

std::vector<float> weights(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 0.05f);
  std::vector<float> w(static_cast<size_t>(n));
  for (auto& v : w) v = dist(rng);
  // Exact zeros and ties with Delta's neighbourhood exercise the comparisons.
  for (int64_t i = 0; i < n; i += 7) w[static_cast<size_t>(i)] = 0.0f;
  for (int64_t i = 3; i < n; i += 11) w[static_cast<size_t>(i)] = -0.0f;
  return w;
}

// Shapes with rows and cols that do not fill bytes, groups that do not divide cols, one
// group per row and groups of one element.
const GroupedShape kShapes[] = {
    {1, 1, 1},    {3, 5, 5},      {7, 13, 4},  {9, 37, 16}, {16, 64, 64},
    {5, 130, 32}, {33, 257, 128}, {4, 100, 1}, {11, 48, 7}, {2, 1000, 1000},
};

std::string name(const GroupedShape& s) {
  return std::to_string(s.rows) + "x" + std::to_string(s.cols) + " g" +
         std::to_string(s.group_size);
}

void expect_bits_equal(const std::vector<float>& a, const std::vector<float>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    uint32_t x, y;
    std::memcpy(&x, &a[i], 4);
    std::memcpy(&y, &b[i], 4);
    ASSERT_EQ(x, y) << "element " << i << ": " << a[i] << " vs " << b[i];
  }
}

TEST(XtcKernels, BinaryQuantizeMatchesReferenceBitForBit) {
  for_each_target([] {
    for (const GroupedShape& s : kShapes) {
      SCOPED_TRACE(name(s));
      const auto w = weights(s.numel(), 1);
      const auto bytes = loom::quant::packed_bytes_of(s, 1);
      std::vector<uint8_t> p_ref(bytes, 0xAA), p(bytes, 0x55);
      std::vector<float> sc_ref(static_cast<size_t>(s.groups())), sc(sc_ref.size());
      ASSERT_EQ(loom::quant::binary_quantize_ref(w.data(), s, p_ref.data(), sc_ref.data()), -1);
      ASSERT_EQ(loom::quant::binary_quantize(w.data(), s, p.data(), sc.data()), -1);
      ASSERT_EQ(p, p_ref);
      expect_bits_equal(sc, sc_ref);
      // The unused bits of the last byte are 0.
      const uint64_t used = static_cast<uint64_t>(s.numel()) % 8;
      if (used != 0) {
        EXPECT_EQ(p.back() >> used, 0);
      }
    }
  });
}

TEST(XtcKernels, TernaryQuantizeMatchesReferenceBitForBit) {
  for_each_target([] {
    for (const GroupedShape& s : kShapes) {
      for (float threshold : {0.7f, 0.05f, 1.5f}) {
        SCOPED_TRACE(name(s) + " threshold " + std::to_string(threshold));
        const auto w = weights(s.numel(), 2);
        const auto bytes = loom::quant::packed_bytes_of(s, 2);
        std::vector<uint8_t> p_ref(bytes, 0xAA), p(bytes, 0x55);
        std::vector<float> sc_ref(static_cast<size_t>(s.groups())), sc(sc_ref.size());
        ASSERT_EQ(
            loom::quant::ternary_quantize_ref(w.data(), s, threshold, p_ref.data(), sc_ref.data()),
            -1);
        ASSERT_EQ(loom::quant::ternary_quantize(w.data(), s, threshold, p.data(), sc.data()), -1);
        ASSERT_EQ(p, p_ref);
        expect_bits_equal(sc, sc_ref);
      }
    }
  });
}

// Finite weights whose |w| sum overflows float32 (two 3e38 in one of the 16 partial sums'
// fold): group 1 of row 2 (groups of 16, 2 per row) is reported as numel + 2 * 2 + 1 by the
// reference and by every target, not written as alpha = inf.
TEST(XtcKernels, AnOverflowingGroupSumIsReported) {
  for_each_target([] {
    const GroupedShape s{4, 32, 16};
    std::vector<float> w(static_cast<size_t>(s.numel()), 0.25f);
    w[2 * 32 + 16] = 3e38f;
    w[2 * 32 + 16 + 8] = -3e38f;
    const int64_t want = s.numel() + 2 * 2 + 1;
    std::vector<uint8_t> p(loom::quant::packed_bytes_of(s, 2));
    std::vector<float> sc(static_cast<size_t>(s.groups()));
    EXPECT_EQ(loom::quant::binary_quantize_ref(w.data(), s, p.data(), sc.data()), want);
    EXPECT_EQ(loom::quant::binary_quantize(w.data(), s, p.data(), sc.data()), want);
    EXPECT_EQ(loom::quant::ternary_quantize_ref(w.data(), s, 0.7f, p.data(), sc.data()), want);
    EXPECT_EQ(loom::quant::ternary_quantize(w.data(), s, 0.7f, p.data(), sc.data()), want);
    // Delta alone may overflow: mean |w| = 1e37 is finite, 1000 * mean is not.
    std::vector<float> v(16, 1e37f);
    const GroupedShape one{1, 16, 16};
    EXPECT_EQ(loom::quant::ternary_quantize(v.data(), one, 1000.0f, p.data(), sc.data()), 16);
    EXPECT_EQ(loom::quant::ternary_quantize_ref(v.data(), one, 1000.0f, p.data(), sc.data()), 16);
    // A NaN comes first, even after an overflowing group.
    w[3 * 32 + 5] = std::nanf("");
    EXPECT_EQ(loom::quant::binary_quantize(w.data(), s, p.data(), sc.data()), 3 * 32 + 5);
    EXPECT_EQ(loom::quant::ternary_quantize(w.data(), s, 0.7f, p.data(), sc.data()), 3 * 32 + 5);
  });
}

// The formulas on a group worked by hand: w = {0.5, -1.0, 0.1, 0.0, -0.2, 2.0}, one group.
TEST(XtcKernels, FormulasOnAHandWorkedGroup) {
  const std::vector<float> w = {0.5f, -1.0f, 0.1f, 0.0f, -0.2f, 2.0f};
  const GroupedShape s{1, 6, 6};
  // mean |w| = 3.8 / 6; binary: codes 1 for w >= 0 (the zero too).
  uint8_t pb = 0xFF;
  float ab = 0.0f;
  ASSERT_EQ(loom::quant::binary_quantize(w.data(), s, &pb, &ab), -1);
  EXPECT_FLOAT_EQ(ab, 3.8f / 6.0f);
  EXPECT_EQ(pb, 0b101101);
  // ternary, threshold 0.7: Delta = 0.7 * 0.6333 = 0.4433; kept 0.5, -1.0, 2.0: alpha = 3.5 / 3.
  uint8_t pt[2] = {0xFF, 0xFF};
  float at = 0.0f;
  ASSERT_EQ(loom::quant::ternary_quantize(w.data(), s, 0.7f, pt, &at), -1);
  EXPECT_FLOAT_EQ(at, 3.5f / 3.0f);
  // codes 1, 2, 0, 0 | 0, 1
  EXPECT_EQ(pt[0], 1u | 2u << 2);
  EXPECT_EQ(pt[1], 0u | 1u << 2);
  std::vector<float> back(6);
  ASSERT_EQ(loom::quant::ternary_dequantize(pt, &at, s, back.data()), -1);
  EXPECT_EQ(back, (std::vector<float>{at, -at, 0.0f, 0.0f, 0.0f, at}));
  // An all-zero group: binary alpha 0, ternary keeps nothing (alpha 0, codes 0).
  const std::vector<float> z(5, 0.0f);
  const GroupedShape sz{1, 5, 5};
  ASSERT_EQ(loom::quant::ternary_quantize(z.data(), sz, 0.7f, pt, &at), -1);
  EXPECT_EQ(at, 0.0f);
  EXPECT_EQ(pt[0], 0);
  EXPECT_EQ(pt[1], 0);
}

TEST(XtcKernels, RoundTripsMatchTheReference) {
  for_each_target([] {
    for (const GroupedShape& s : kShapes) {
      SCOPED_TRACE(name(s));
      const auto w = weights(s.numel(), 3);
      std::vector<float> sc(static_cast<size_t>(s.groups()));
      std::vector<float> a(w.size()), b(w.size());
      std::vector<uint8_t> pb(loom::quant::packed_bytes_of(s, 1));
      ASSERT_EQ(loom::quant::binary_quantize(w.data(), s, pb.data(), sc.data()), -1);
      loom::quant::binary_dequantize(pb.data(), sc.data(), s, a.data());
      loom::quant::binary_dequantize_ref(pb.data(), sc.data(), s, b.data());
      expect_bits_equal(a, b);
      for (size_t i = 0; i < w.size(); ++i) {
        // sign kept (zero decodes to +alpha), magnitude the group's alpha
        ASSERT_EQ(a[i] >= 0.0f, w[i] >= 0.0f) << i;
        const auto g = static_cast<size_t>((static_cast<int64_t>(i) / s.cols) * s.groups_per_row() +
                                           (static_cast<int64_t>(i) % s.cols) / s.group_size);
        ASSERT_EQ(std::fabs(a[i]), sc[g]) << i;
      }
      std::vector<uint8_t> pt(loom::quant::packed_bytes_of(s, 2));
      ASSERT_EQ(loom::quant::ternary_quantize(w.data(), s, 0.7f, pt.data(), sc.data()), -1);
      ASSERT_EQ(loom::quant::ternary_dequantize(pt.data(), sc.data(), s, a.data()), -1);
      ASSERT_EQ(loom::quant::ternary_dequantize_ref(pt.data(), sc.data(), s, b.data()), -1);
      expect_bits_equal(a, b);
      // Quantizing the dequantized weight again gives the same codes and (up to the sum's
      // rounding) the same alphas: a fixed point.
      std::vector<uint8_t> pt2(pt.size());
      std::vector<float> sc2(sc.size());
      ASSERT_EQ(loom::quant::ternary_quantize(a.data(), s, 0.7f, pt2.data(), sc2.data()), -1);
      ASSERT_EQ(pt2, pt);
      for (size_t g = 0; g < sc.size(); ++g) ASSERT_NEAR(sc2[g], sc[g], 1e-5f * sc[g]) << g;
    }
  });
}

// |y - y_ref| within float rounding of sum |x| |w| over K.
void expect_close(const std::vector<float>& y, const std::vector<float>& ref,
                  const std::vector<float>& bound) {
  for (size_t i = 0; i < y.size(); ++i) {
    ASSERT_NEAR(y[i], ref[i], 1e-5f + 4e-6f * bound[i]) << "output " << i;
  }
}

// sum_k |x[i,k]| |w[n,k]| + |bias| per output, the scale of the rounding error.
std::vector<float> magnitude(const std::vector<float>& x, int64_t m, const std::vector<float>& w,
                             const GroupedShape& s) {
  std::vector<float> b(static_cast<size_t>(m * s.rows));
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t n = 0; n < s.rows; ++n) {
      double acc = 1.0;
      for (int64_t k = 0; k < s.cols; ++k) {
        acc += std::fabs(x[static_cast<size_t>(i * s.cols + k)]) *
               std::fabs(w[static_cast<size_t>(n * s.cols + k)]);
      }
      b[static_cast<size_t>(i * s.rows + n)] = static_cast<float>(acc);
    }
  }
  return b;
}

std::vector<float> dense_matmul(const std::vector<float>& x, int64_t m, const std::vector<float>& w,
                                const GroupedShape& s, const std::vector<float>& bias) {
  std::vector<float> y(static_cast<size_t>(m * s.rows));
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t n = 0; n < s.rows; ++n) {
      double acc = bias[static_cast<size_t>(n)];
      for (int64_t k = 0; k < s.cols; ++k) {
        acc += static_cast<double>(x[static_cast<size_t>(i * s.cols + k)]) *
               w[static_cast<size_t>(n * s.cols + k)];
      }
      y[static_cast<size_t>(i * s.rows + n)] = static_cast<float>(acc);
    }
  }
  return y;
}

TEST(XtcKernels, MatmulsMatchReferenceAndDequantizeThenMatmul) {
  for_each_target([] {
    for (const GroupedShape& s : kShapes) {
      for (int64_t m : {1, 3, 4, 9}) {
        SCOPED_TRACE(name(s) + " m " + std::to_string(m));
        const auto w = weights(s.numel(), 4);
        auto x = weights(m * s.cols, 5);
        for (auto& v : x) v *= 20.0f;
        std::vector<float> bias(static_cast<size_t>(s.rows));
        for (size_t n = 0; n < bias.size(); ++n) bias[n] = 0.01f * static_cast<float>(n);
        std::vector<float> sc(static_cast<size_t>(s.groups())), deq(w.size());
        std::vector<float> y(static_cast<size_t>(m * s.rows)), y_ref(y.size());

        std::vector<uint8_t> pb(loom::quant::packed_bytes_of(s, 1));
        ASSERT_EQ(loom::quant::binary_quantize(w.data(), s, pb.data(), sc.data()), -1);
        loom::quant::binary_dequantize(pb.data(), sc.data(), s, deq.data());
        auto bound = magnitude(x, m, deq, s);
        loom::quant::binary_matmul(x.data(), m, pb.data(), sc.data(), s, bias.data(), y.data());
        loom::quant::binary_matmul_ref(x.data(), m, pb.data(), sc.data(), s, bias.data(),
                                       y_ref.data());
        expect_close(y, y_ref, bound);
        expect_close(y, dense_matmul(x, m, deq, s, bias), bound);

        std::vector<uint8_t> pt(loom::quant::packed_bytes_of(s, 2));
        ASSERT_EQ(loom::quant::ternary_quantize(w.data(), s, 0.7f, pt.data(), sc.data()), -1);
        ASSERT_EQ(loom::quant::ternary_dequantize(pt.data(), sc.data(), s, deq.data()), -1);
        bound = magnitude(x, m, deq, s);
        ASSERT_EQ(
            loom::quant::ternary_matmul(x.data(), m, pt.data(), sc.data(), s, nullptr, y.data()),
            -1);
        ASSERT_EQ(loom::quant::ternary_matmul_ref(x.data(), m, pt.data(), sc.data(), s, nullptr,
                                                  y_ref.data()),
                  -1);
        expect_close(y, y_ref, bound);
        const std::vector<float> nobias(bias.size(), 0.0f);
        expect_close(y, dense_matmul(x, m, deq, s, nobias), bound);
      }
    }
  });
}

TEST(XtcKernels, ReportTheFirstNonFiniteWeight) {
  for_each_target([] {
    const GroupedShape s{9, 37, 16};
    for (float bad :
         {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
          -std::numeric_limits<float>::infinity()}) {
      for (int64_t at : {int64_t{0}, int64_t{17}, int64_t{5 * 37 + 36}, int64_t{9 * 37 - 1}}) {
        auto w = weights(s.numel(), 6);
        w[static_cast<size_t>(at)] = bad;
        if (at + 40 < s.numel()) w[static_cast<size_t>(at + 40)] = bad;  // a later one too
        std::vector<uint8_t> p(loom::quant::packed_bytes_of(s, 2));
        std::vector<float> sc(static_cast<size_t>(s.groups()));
        EXPECT_EQ(loom::quant::binary_quantize(w.data(), s, p.data(), sc.data()), at);
        EXPECT_EQ(loom::quant::binary_quantize_ref(w.data(), s, p.data(), sc.data()), at);
        EXPECT_EQ(loom::quant::ternary_quantize(w.data(), s, 0.7f, p.data(), sc.data()), at);
        EXPECT_EQ(loom::quant::ternary_quantize_ref(w.data(), s, 0.7f, p.data(), sc.data()), at);
      }
    }
  });
}

// A bf16 or float16 weight quantized in place (binary_quantize16, ternary_quantize16: each
// group or span widened in L1) gives the codes, scales and first bad element of the float32
// kernels on its widening, on every target, for every shape.
TEST(XtcKernels, SixteenBitWeightsAreTheirFloat32Widening) {
  for_each_target([] {
    for (const bool bf : {true, false}) {
      for (const GroupedShape& s : kShapes) {
        SCOPED_TRACE(std::string(bf ? "bf16 " : "f16 ") + name(s));
        auto w = weights(s.numel(), 8);
        for (auto& v : w) v *= 20.0f;  // float16's normal range
        const std::vector<uint16_t> h = loom_test::to16(w, bf);
        const std::vector<float> wide = loom_test::to32(h, bf);
        for (const bool ternary : {false, true}) {
          const int bits = ternary ? 2 : 1;
          const auto bytes = loom::quant::packed_bytes_of(s, bits);
          std::vector<uint8_t> p32(bytes, 0xAA), p16(bytes, 0x55);
          std::vector<float> s32(static_cast<size_t>(s.groups())), s16(s32.size());
          const int64_t b32 =
              ternary ? loom::quant::ternary_quantize(wide.data(), s, 0.7f, p32.data(), s32.data())
                      : loom::quant::binary_quantize(wide.data(), s, p32.data(), s32.data());
          const int64_t b16 =
              ternary
                  ? loom::quant::ternary_quantize16(h.data(), bf, s, 0.7f, p16.data(), s16.data())
                  : loom::quant::binary_quantize16(h.data(), bf, s, p16.data(), s16.data());
          EXPECT_EQ(b16, b32);
          ASSERT_EQ(p16, p32) << (ternary ? "ternary" : "binary");
          expect_bits_equal(s16, s32);
        }
      }
    }
    // A NaN and an infinity (all-ones exponents) are found at their index.
    const GroupedShape s{9, 37, 16};
    for (const bool bf : {true, false}) {
      for (const uint16_t bad :
           {bf ? uint16_t{0x7fc1} : uint16_t{0x7e01}, bf ? uint16_t{0xff80} : uint16_t{0xfc00}}) {
        for (const int64_t at : {int64_t{0}, int64_t{5 * 37 + 36}, int64_t{9 * 37 - 1}}) {
          std::vector<uint16_t> h = loom_test::to16(weights(s.numel(), 9), bf);
          h[static_cast<size_t>(at)] = bad;
          std::vector<uint8_t> p(loom::quant::packed_bytes_of(s, 2));
          std::vector<float> sc(static_cast<size_t>(s.groups()));
          EXPECT_EQ(loom::quant::binary_quantize16(h.data(), bf, s, p.data(), sc.data()), at);
          EXPECT_EQ(loom::quant::ternary_quantize16(h.data(), bf, s, 0.7f, p.data(), sc.data()),
                    at);
        }
      }
    }
  });
}

TEST(XtcKernels, ReportTheFirstInvalidTernaryCode) {
  for_each_target([] {
    const GroupedShape s{5, 37, 16};
    const auto w = weights(s.numel(), 7);
    std::vector<uint8_t> p(loom::quant::packed_bytes_of(s, 2));
    std::vector<float> sc(static_cast<size_t>(s.groups()));
    ASSERT_EQ(loom::quant::ternary_quantize(w.data(), s, 0.7f, p.data(), sc.data()), -1);
    for (int64_t at : {int64_t{0}, int64_t{20}, int64_t{2 * 37 + 33}, int64_t{5 * 37 - 1}}) {
      auto q = p;
      q[static_cast<size_t>(at / 4)] |= static_cast<uint8_t>(3u << (2 * (at % 4)));
      std::vector<float> out(w.size());
      std::vector<float> y(static_cast<size_t>(2 * s.rows));
      const std::vector<float> x(static_cast<size_t>(2 * s.cols), 1.0f);
      EXPECT_EQ(loom::quant::ternary_dequantize(q.data(), sc.data(), s, out.data()), at);
      EXPECT_EQ(loom::quant::ternary_dequantize_ref(q.data(), sc.data(), s, out.data()), at);
      EXPECT_EQ(loom::quant::ternary_matmul(x.data(), 2, q.data(), sc.data(), s, nullptr, y.data()),
                at);
      EXPECT_EQ(
          loom::quant::ternary_matmul_ref(x.data(), 2, q.data(), sc.data(), s, nullptr, y.data()),
          at);
    }
  });
}

// The packed bytes are the format's (quant_format.h, LSB first), as the shared packing code
// of the quantizer core reads and writes them: its unpack gives each element's code, and its
// pack of the per-element codes gives the same bytes.
TEST(XtcKernels, PackedBytesAreTheFormatsLsbFirstStream) {
  const GroupedShape s{7, 13, 4};
  const auto w = weights(s.numel(), 8);
  const auto n = static_cast<uint64_t>(s.numel());
  std::vector<float> sc(static_cast<size_t>(s.groups()));
  std::vector<uint8_t> pb(loom::quant::packed_bytes_of(s, 1)),
      pt(loom::quant::packed_bytes_of(s, 2));
  ASSERT_EQ(loom::quant::binary_quantize(w.data(), s, pb.data(), sc.data()), -1);
  ASSERT_EQ(loom::quant::ternary_quantize(w.data(), s, 0.7f, pt.data(), sc.data()), -1);
  std::vector<uint8_t> cb(n), ct(n);
  loom::quant::unpack_codes(pb.data(), 0, n, 1, LOOM_QUANT_PACK_LSB_FIRST, cb.data());
  loom::quant::unpack_codes(pt.data(), 0, n, 2, LOOM_QUANT_PACK_LSB_FIRST, ct.data());
  for (uint64_t i = 0; i < n; ++i) {
    ASSERT_EQ(cb[i], w[i] >= 0.0f ? 1 : 0) << i;
    ASSERT_LE(ct[i], 2) << i;
    if (ct[i] != 0) {
      ASSERT_EQ(ct[i], w[i] > 0.0f ? 1 : 2) << i;
    }
  }
  std::vector<uint8_t> repacked(pt.size(), 0);
  loom::quant::pack_codes(ct.data(), 0, n, 2, LOOM_QUANT_PACK_LSB_FIRST, repacked.data());
  EXPECT_EQ(repacked, pt);
  std::vector<uint8_t> repacked1(pb.size(), 0);
  loom::quant::pack_codes(cb.data(), 0, n, 1, LOOM_QUANT_PACK_LSB_FIRST, repacked1.data());
  EXPECT_EQ(repacked1, pb);
}

}  // namespace
