// The fast CPU kernels (int_kernels.hpp) against the scalar reference, on every SIMD target
// Highway compiled and this CPU runs: quantize and dequantize bit for bit for every bit
// width, symmetry, range, group size and packing; the token-wise INT8 activations bit for
// bit; the weight-only matmul against dequantize-then-matmul in double.
#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "int_kernels.hpp"
#include "quant_core.hpp"

namespace {

using loom::quant::GroupParams;
using loom::quant::Groups;
using loom::quant::IntScheme;
using loom::quant::IntWeight;
using loom::quant::Range;

std::vector<float> sample(int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(rows * cols));
  for (auto& v : x) v = nd(rng);
  if (rows >= 3) {
    // A row of ties (s = 1 for 8-bit exact symmetric), a row of zeros, a positive row.
    for (int64_t c = 0; c < cols; ++c) {
      x[static_cast<std::size_t>(cols + c)] = c == 0 ? 127.0f : static_cast<float>(c % 9) - 3.5f;
      x[static_cast<std::size_t>(2 * cols + c)] = 0.0f;
    }
    if (rows >= 4) {
      for (int64_t c = 0; c < cols; ++c)
        x[static_cast<std::size_t>(3 * cols + c)] =
            std::fabs(x[static_cast<std::size_t>(3 * cols + c)]) + 0.25f;
    }
  }
  return x;
}

template <class Fn>
void on_every_target(Fn&& fn) {
  for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    SCOPED_TRACE(std::string("target ") + hwy::TargetName(target));
    fn();
  }
  hwy::SetSupportedTargetsForTest(0);
}

TEST(QuantKernels, QuantizeAndDequantizeMatchTheReferenceBitForBit) {
  const int64_t rows = 6, cols = 70;
  const auto x = sample(rows, cols, 11);
  on_every_target([&] {
    for (bool sym : {true, false}) {
      for (uint32_t bits = sym ? 2 : 1; bits <= 8; ++bits) {
        for (Range range : {Range::kExact, Range::kDeepSpeed}) {
          for (int64_t group : {0, 1, 4, 7, 16, 32, 64, 100}) {
            for (int32_t packing : {LOOM_QUANT_PACK_LSB_FIRST, LOOM_QUANT_PACK_MSB_FIRST}) {
              SCOPED_TRACE("bits " + std::to_string(bits) + (sym ? " sym" : " asym") + " range " +
                           std::to_string(static_cast<int>(range)) + " group " +
                           std::to_string(group) + " packing " + std::to_string(packing));
              const IntScheme q{bits, sym, range};
              const Groups gs = Groups::of(rows, cols, group);
              const std::size_t bytes = loom::quant::packed_size(rows * cols, bits);
              std::vector<uint8_t> p_ref(bytes, 0x5A), p_fast(bytes, 0xA5);
              std::vector<float> s_ref(gs.count(), -1), s_fast(gs.count(), -2);
              std::vector<uint8_t> z_ref(gs.count(), 1), z_fast(gs.count(), 2);
              loom::quant::reference_quantize(x.data(), gs, q, packing, p_ref.data(), s_ref.data(),
                                              z_ref.data());
              ASSERT_EQ(loom::quant::quantize_int(x.data(), gs, q, packing, p_fast.data(),
                                                  s_fast.data(), z_fast.data()),
                        -1);
              ASSERT_EQ(p_fast, p_ref);
              ASSERT_EQ(0, std::memcmp(s_fast.data(), s_ref.data(), s_ref.size() * sizeof(float)));
              if (!sym) {
                ASSERT_EQ(z_fast, z_ref);
              }
              std::vector<float> d_ref(x.size()), d_fast(x.size(), NAN);
              loom::quant::reference_dequantize(p_ref.data(), s_ref.data(), z_ref.data(), gs, q,
                                                packing, d_ref.data());
              IntWeight w{p_ref.data(), s_ref.data(), z_ref.data(), gs, q, packing};
              loom::quant::dequantize_int(w, d_fast.data());
              ASSERT_EQ(0, std::memcmp(d_fast.data(), d_ref.data(), d_ref.size() * sizeof(float)));
            }
          }
        }
      }
    }
  });
}

// A 16-bit x (bfloat16 and float16) quantizes exactly as its float32 widening, for groups of
// whole vectors (the span path), odd groups and odd widths, on every target; a NaN or an
// infinity is found at its index.
TEST(QuantKernels, SixteenBitInputIsItsFloat32Widening) {
  auto to16 = [](float f, bool bf) {
    uint32_t u = 0;
    std::memcpy(&u, &f, 4);
    if (bf) return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    // float16 of a value in range: through the bits of the nearest (the samples are < 8)
    const float a = std::fabs(f);
    int e = 0;
    const float m = std::frexp(a, &e);  // a = m 2^e, m in [0.5, 1)
    const int shift = e >= -13 ? 11 : 11 - (-13 - e);
    const float q = std::nearbyint(std::ldexp(m, shift));  // ties to even (default mode)
    const float back = std::ldexp(q, e - shift);
    uint16_t h = 0;
    if (back != 0.0f) {
      int be = 0;
      const float bm = std::frexp(back, &be);
      if (be >= -13) {
        h = static_cast<uint16_t>(((be + 14) << 10) |
                                  (static_cast<uint32_t>(std::ldexp(bm, 11)) & 0x3ffu));
      } else {
        h = static_cast<uint16_t>(std::ldexp(back, 24));
      }
    }
    return static_cast<uint16_t>(h | (std::signbit(f) ? 0x8000u : 0u));
  };
  auto from16 = [](uint16_t h, bool bf) {
    if (bf) {
      const uint32_t u = static_cast<uint32_t>(h) << 16;
      float f = 0;
      std::memcpy(&f, &u, 4);
      return f;
    }
    const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    const float v = e == 0 ? std::ldexp(static_cast<float>(m), -24)
                           : std::ldexp(static_cast<float>(m | 0x400), e - 25);
    return (h & 0x8000u) != 0 ? -v : v;
  };
  on_every_target([&] {
    for (const bool bf : {true, false}) {
      for (const int64_t cols : {int64_t{256}, int64_t{70}}) {
        for (const int64_t group : {int64_t{0}, int64_t{16}, int64_t{7}}) {
          for (const uint32_t bits : {8u, 4u, 3u}) {
            SCOPED_TRACE(std::string(bf ? "bf16" : "f16") + " cols " + std::to_string(cols) +
                         " group " + std::to_string(group) + " bits " + std::to_string(bits));
            const int64_t rows = 5;
            const auto x = sample(rows, cols, 23);
            std::vector<uint16_t> h(x.size());
            std::vector<float> wide(x.size());
            for (std::size_t i = 0; i < x.size(); ++i) {
              h[i] = to16(x[i], bf);
              wide[i] = from16(h[i], bf);
            }
            const IntScheme q{bits, bits != 3, Range::kExact};
            const Groups gs = Groups::of(rows, cols, group);
            const std::size_t bytes = loom::quant::packed_size(rows * cols, bits);
            std::vector<uint8_t> p32(bytes, 1), p16(bytes, 2), z32(gs.count(), 3),
                z16(gs.count(), 4);
            std::vector<float> s32(gs.count(), -1), s16(gs.count(), -2);
            ASSERT_EQ(loom::quant::quantize_int(wide.data(), gs, q, LOOM_QUANT_PACK_LSB_FIRST,
                                                p32.data(), s32.data(), z32.data()),
                      -1);
            ASSERT_EQ(loom::quant::quantize_int16(h.data(), bf, gs, q, LOOM_QUANT_PACK_LSB_FIRST,
                                                  p16.data(), s16.data(), z16.data()),
                      -1);
            EXPECT_EQ(p16, p32);
            EXPECT_EQ(0, std::memcmp(s16.data(), s32.data(), s32.size() * sizeof(float)));
            if (!q.symmetric) {
              EXPECT_EQ(z16, z32);
            }
            // NaN, then infinity, at an element of the last row
            for (const uint16_t bad : {bf ? uint16_t{0x7fc1} : uint16_t{0x7e01},
                                       bf ? uint16_t{0xff80} : uint16_t{0xfc00}}) {
              auto hb = h;
              hb[static_cast<std::size_t>(4 * cols + 5)] = bad;
              EXPECT_EQ(loom::quant::quantize_int16(hb.data(), bf, gs, q, LOOM_QUANT_PACK_LSB_FIRST,
                                                    p16.data(), s16.data(), z16.data()),
                        4 * cols + 5);
            }
          }
        }
      }
    }
  });
}

// The fast kernel divides by multiplying with 1 / s and takes the division only where a code
// could differ: here one element in 32 lies within an ulp of a half-integer multiple of its
// group's scale (the ties the reciprocal can move), the rest anywhere in the group's range.
// A group where t is an exact tie takes the division, so most near ties sit in groups that
// have none. With the kernel's margin dropped to 0.5, 8-bit symmetric gives wrong codes here.
TEST(QuantKernels, NearTiesMatchTheDivisionBitForBit) {
  const int64_t rows = 256, cols = 256, group = 128;
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> unit(0.5f, 2.0f);
  std::uniform_int_distribution<int> ulps(-1, 1);
  on_every_target([&] {
    for (bool sym : {true, false}) {
      for (uint32_t bits : {8u, 4u, 3u}) {
        for (Range range : {Range::kExact, Range::kDeepSpeed}) {
          SCOPED_TRACE("bits " + std::to_string(bits) + (sym ? " sym" : " asym") + " range " +
                       std::to_string(static_cast<int>(range)));
          const IntScheme q{bits, sym, range};
          const Groups gs = Groups::of(rows, cols, group);
          std::vector<float> x(static_cast<std::size_t>(rows * cols));
          for (int64_t r = 0; r < rows; ++r) {
            for (int64_t g = 0; g < gs.groups_per_row; ++g) {
              float* v = x.data() + r * cols + g * group;
              v[0] = -unit(rng) * 3.0f;  // the extremes fix the group's scale
              v[1] = unit(rng) * 5.0f;
              const float lo = v[0], hi = v[1];
              const GroupParams p =
                  loom::quant::int_group_params(loom::quant::group_stats(v, 2), q);
              const int levels = 1 << (bits - 1);
              std::uniform_int_distribution<int> k(sym ? -levels : 0, 2 * levels - 1);
              std::uniform_real_distribution<float> any(lo, hi);
              for (int64_t i = 2; i < group; ++i) {
                if (i % 32 != 5) {
                  v[i] = any(rng);
                  continue;
                }
                float t = (static_cast<float>(k(rng)) + 0.5f) * p.scale;
                if (!sym) t -= static_cast<float>(p.zero) * p.scale;
                t = std::min(std::max(t, lo), hi);
                const int steps = ulps(rng);
                if (steps != 0) t = std::nextafter(t, steps > 0 ? hi : lo);
                v[i] = t;
              }
            }
          }
          const std::size_t bytes = loom::quant::packed_size(rows * cols, bits);
          std::vector<uint8_t> p_ref(bytes), p_fast(bytes);
          std::vector<float> s_ref(gs.count()), s_fast(gs.count());
          std::vector<uint8_t> z_ref(gs.count()), z_fast(gs.count());
          loom::quant::reference_quantize(x.data(), gs, q, LOOM_QUANT_PACK_LSB_FIRST, p_ref.data(),
                                          s_ref.data(), z_ref.data());
          ASSERT_EQ(loom::quant::quantize_int(x.data(), gs, q, LOOM_QUANT_PACK_LSB_FIRST,
                                              p_fast.data(), s_fast.data(), z_fast.data()),
                    -1);
          ASSERT_EQ(p_fast, p_ref);
          ASSERT_EQ(0, std::memcmp(s_fast.data(), s_ref.data(), s_ref.size() * sizeof(float)));
        }
      }
    }
  });
}

TEST(QuantKernels, TokenWiseInt8MatchesTheReference) {
  const int64_t rows = 5, cols = 83;
  const auto x = sample(rows, cols, 5);
  on_every_target([&] {
    std::vector<int8_t> q_ref(x.size()), q_fast(x.size());
    std::vector<float> s_ref(rows), s_fast(rows);
    loom::quant::reference_quantize_rows_int8(x.data(), rows, cols, q_ref.data(), s_ref.data());
    ASSERT_EQ(loom::quant::quantize_rows_int8(x.data(), rows, cols, q_fast.data(), s_fast.data()),
              -1);
    EXPECT_EQ(q_fast, q_ref);
    EXPECT_EQ(0, std::memcmp(s_fast.data(), s_ref.data(), rows * sizeof(float)));
  });
}

TEST(QuantKernels, NonFiniteInputIsFoundAndNamed) {
  on_every_target([&] {
    for (float bad : {NAN, INFINITY, -INFINITY}) {
      auto x = sample(4, 40, 3);
      x[2 * 40 + 17] = bad;
      x[3 * 40 + 1] = bad;
      std::vector<uint8_t> p(160);
      std::vector<float> s(4);
      EXPECT_EQ(loom::quant::quantize_int(x.data(), Groups::of(4, 40, 0), {8, true, Range::kExact},
                                          LOOM_QUANT_PACK_LSB_FIRST, p.data(), s.data(), nullptr),
                2 * 40 + 17);
      std::vector<int8_t> q(160);
      EXPECT_EQ(loom::quant::quantize_rows_int8(x.data(), 4, 40, q.data(), s.data()), 2 * 40 + 17);
    }
  });
}

// Groups of whole vectors take their statistics N groups at a time (symmetric: max |x| over
// the bits as integers); a NaN or an infinity anywhere in them, also in the last group of a
// span and of the tensor, is still found and named.
TEST(QuantKernels, NonFiniteInputIsFoundInGroupsOfWholeVectors) {
  const int64_t rows = 4, cols = 1024;
  on_every_target([&] {
    for (bool sym : {true, false}) {
      for (int64_t group : {16, 64, 128}) {
        for (int64_t at : {int64_t{0}, int64_t{5}, cols + 127, 2 * cols + 1000, rows * cols - 1}) {
          for (float bad : {NAN, -NAN, INFINITY, -INFINITY}) {
            SCOPED_TRACE(std::string(sym ? "sym" : "asym") + " group " + std::to_string(group) +
                         " at " + std::to_string(at) + " value " + std::to_string(bad));
            auto x = sample(rows, cols, 9);
            x[static_cast<std::size_t>(at)] = bad;
            const Groups gs = Groups::of(rows, cols, group);
            std::vector<uint8_t> p(static_cast<std::size_t>(rows * cols));
            std::vector<float> s(static_cast<std::size_t>(gs.count()));
            std::vector<uint8_t> z(static_cast<std::size_t>(gs.count()));
            EXPECT_EQ(
                loom::quant::quantize_int(x.data(), gs, {8, sym, Range::kExact},
                                          LOOM_QUANT_PACK_LSB_FIRST, p.data(), s.data(), z.data()),
                at);
          }
        }
      }
    }
  });
}

// y = x . decode(W)^T (+ bias) in double from the reference's decoded weight.
std::vector<double> dequant_matmul(const std::vector<float>& x, int64_t m,
                                   const std::vector<float>& wd, int64_t n, int64_t k,
                                   const float* bias) {
  std::vector<double> y(static_cast<std::size_t>(m * n));
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double acc = bias != nullptr ? bias[j] : 0.0;
      for (int64_t c = 0; c < k; ++c) acc += static_cast<double>(x[i * k + c]) * wd[j * k + c];
      y[i * n + j] = acc;
    }
  }
  return y;
}

TEST(QuantKernels, WeightOnlyMatmulMatchesDequantizeThenMatmul) {
  // Tolerance: float accumulation of k products against double, relative to sum |x w|:
  // 1e-5 (k <= 200, unit roundoff 6e-8 times the terms' count, with margin).
  const int64_t n = 9;
  on_every_target([&] {
    for (int64_t k : {64, 67}) {
      for (uint32_t bits : {2u, 3u, 4u, 8u}) {
        for (bool sym : {true, false}) {
          for (int64_t group : {0, 32, 5}) {
            for (int32_t packing : {LOOM_QUANT_PACK_LSB_FIRST, LOOM_QUANT_PACK_MSB_FIRST}) {
              // 11 rows: a block of 8 (AVX-512) or two of 4, then 3; 2 and 1 the small blocks.
              for (int64_t m : {1, 2, 11}) {
                SCOPED_TRACE("k " + std::to_string(k) + " bits " + std::to_string(bits) +
                             (sym ? " sym" : " asym") + " group " + std::to_string(group) +
                             " packing " + std::to_string(packing) + " m " + std::to_string(m));
                const IntScheme q{bits, sym, Range::kExact};
                const Groups gs = Groups::of(n, k, group);
                const auto wf = sample(n, k, 17);
                const auto x = sample(m, k, 23);
                std::vector<float> bias(n);
                for (int64_t j = 0; j < n; ++j) bias[j] = 0.5f * static_cast<float>(j) - 2.0f;
                std::vector<uint8_t> p(loom::quant::packed_size(n * k, bits));
                std::vector<float> s(gs.count());
                std::vector<uint8_t> z(gs.count());
                loom::quant::reference_quantize(wf.data(), gs, q, packing, p.data(), s.data(),
                                                z.data());
                std::vector<float> wd(wf.size());
                loom::quant::reference_dequantize(p.data(), s.data(), z.data(), gs, q, packing,
                                                  wd.data());
                const IntWeight w{p.data(), s.data(), z.data(), gs, q, packing};
                std::vector<float> y(m * n, NAN);
                loom::quant::matmul_weight_only(x.data(), m, w, bias.data(), y.data(), nullptr);
                const auto want = dequant_matmul(x, m, wd, n, k, bias.data());
                for (int64_t i = 0; i < m * n; ++i) {
                  double mag = std::fabs(bias[i % n]);
                  for (int64_t c = 0; c < k; ++c)
                    mag += std::fabs(x[(i / n) * k + c] * wd[(i % n) * k + c]);
                  ASSERT_NEAR(y[i], want[i], 1e-5 * mag + 1e-6)
                      << "y[" << i / n << ", " << i % n << "]";
                }
              }
            }
          }
        }
      }
    }
  });
}

TEST(QuantKernels, WidenToInt8) {
  const int64_t n = 3, k = 21;
  const auto wf = sample(n, k, 2);
  for (bool sym : {true, false}) {
    const IntScheme q{4, sym, Range::kExact};
    const Groups gs = Groups::of(n, k, 8);
    std::vector<uint8_t> p(loom::quant::packed_size(n * k, 4));
    std::vector<float> s(gs.count());
    std::vector<uint8_t> z(gs.count());
    loom::quant::reference_quantize(wf.data(), gs, q, LOOM_QUANT_PACK_LSB_FIRST, p.data(), s.data(),
                                    z.data());
    std::vector<int8_t> wide(n * k);
    loom::quant::widen_to_int8({p.data(), s.data(), z.data(), gs, q, LOOM_QUANT_PACK_LSB_FIRST},
                               wide.data());
    for (int64_t i = 0; i < n * k; ++i) {
      const uint32_t u = loom::quant::read_code(p.data(), i, 4, LOOM_QUANT_PACK_LSB_FIRST);
      const int32_t want =
          sym ? loom::quant::sign_extend(u, 4)
              : static_cast<int32_t>(u) - z[(i / k) * gs.groups_per_row + (i % k) / 8];
      ASSERT_EQ(wide[i], want) << i;
    }
  }
}

}  // namespace
