// Steps with a NaN or an Inf gradient: the finite-check kernel (kernels/finite.hpp) against a
// plain loop on every SIMD target, and adam, adamw and lamb skipping such steps through the
// host's C API (nonfinite_scenario.hpp).
#include <gtest/gtest.h>

#include <hwy/targets.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/finite.hpp"
#include "nonfinite_scenario.hpp"

namespace {

using loom::optim::DType;
using loom::optim::FiniteInput;

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The reference: widen each element exactly (bf16: high half of an fp32; fp16: sign,
// exponent, mantissa by hand), multiply in fp32, ask std::isfinite.
float widen(const void* g, DType t, size_t i) {
  if (t == DType::kF32) return static_cast<const float*>(g)[i];
  const uint16_t h = static_cast<const uint16_t*>(g)[i];
  if (t == DType::kBF16) return from_bits(static_cast<uint32_t>(h) << 16);
  const int e = (h >> 10) & 31;
  const int m = h & 1023;
  double v = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  if (e == 31) v = m != 0 ? NAN : INFINITY;
  return static_cast<float>((h & 0x8000) != 0 ? -v : v);
}
bool reference_finite(const void* g, DType t, size_t n, float inv_scale) {
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(widen(g, t, i) * inv_scale)) return false;
  }
  return true;
}

// Buffers of every dtype with the same random finite values, and a way to plant a bit
// pattern at one index.
struct Grads {
  std::vector<float> f32;
  std::vector<uint16_t> b16, h16;
  explicit Grads(size_t n, std::mt19937& rng) : f32(n), b16(n), h16(n) {
    std::uniform_int_distribution<int> d(-2000, 2000);
    for (size_t i = 0; i < n; ++i) {
      f32[i] = static_cast<float>(d(rng)) / 64.0f;  // exact in bf16 and fp16
      uint32_t u;
      std::memcpy(&u, &f32[i], 4);
      b16[i] = static_cast<uint16_t>(u >> 16);
      h16[i] = half_of(f32[i]);
    }
  }
  static uint16_t half_of(float f) {
    if (f == 0.0f) return std::signbit(f) ? 0x8000 : 0;
    int e = 0;
    const double m = std::frexp(std::fabs(static_cast<double>(f)), &e);
    const auto man = static_cast<uint16_t>(std::ldexp(m * 2.0 - 1.0, 10));
    return static_cast<uint16_t>((f < 0 ? 0x8000 : 0) | ((e - 1 + 15) << 10) | man);
  }
  const void* data(DType t) const {
    if (t == DType::kF32) return f32.data();
    return t == DType::kBF16 ? static_cast<const void*>(b16.data()) : h16.data();
  }
};

// Every dtype, sizes around the vector widths and the threading grain, a non-finite value
// (NaN, +-Inf, or a finite value that overflows once scaled) at the first, a middle, the last
// and a tail position: the kernel agrees with the reference, on every SIMD target.
TEST(FiniteKernel, MatchesReferenceOnEverySimdTarget) {
  const size_t sizes[] = {0, 1, 3, 8, 15, 16, 17, 31, 33, 100, 1000, 65536 + 7, 200003};
  const DType types[] = {DType::kF32, DType::kBF16, DType::kF16};
  int checked = 0;
  for (const int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    SCOPED_TRACE(std::string("target ") + hwy::TargetName(target));
    std::mt19937 rng(17);
    for (const size_t n : sizes) {
      Grads base(n, rng);
      for (const DType t : types) {
        SCOPED_TRACE("n " + std::to_string(n) + " dtype " + std::to_string(static_cast<int>(t)));
        const FiniteInput in{base.data(t), t, n};
        EXPECT_TRUE(loom::optim::all_finite_cpu(in, 0.25f));
        EXPECT_TRUE(reference_finite(in.g, t, n, 0.25f));
        // inv_scale 0 (a huge grad_scale): finite grads stay finite; inf scale: not.
        EXPECT_EQ(loom::optim::all_finite_cpu(in, 0.0f), reference_finite(in.g, t, n, 0.0f));
        if (n > 0) {
          EXPECT_FALSE(loom::optim::all_finite_cpu(in, std::numeric_limits<float>::infinity()))
              << "Inf inv_scale";
        }
        if (n == 0) continue;
        // Bit patterns: NaN (quiet and signalling), +Inf, -Inf, and the largest finite value
        // (overflows with inv_scale 4 in fp32; fp16's largest is finite there).
        struct Plant {
          uint32_t f32;
          uint16_t half;
          uint16_t bf16;
          float inv_scale;
        };
        const Plant plants[] = {{0x7FC00000u, 0x7E00, 0x7FC0, 1.0f},
                                {0x7F800001u, 0x7C01, 0x7F81, 1.0f},
                                {0x7F800000u, 0x7C00, 0x7F80, 1.0f},
                                {0xFF800000u, 0xFC00, 0xFF80, 1.0f},
                                {0x7F7FFFFFu, 0x7BFF, 0x7F7F, 4.0f}};
        const size_t positions[] = {0, n / 2, n - 1, n - n % 16 + (n % 16) / 2};
        for (const Plant& pl : plants) {
          for (const size_t at : positions) {
            if (at >= n) continue;
            Grads g = base;
            std::memcpy(&g.f32[at], &pl.f32, 4);
            g.h16[at] = pl.half;
            g.b16[at] = pl.bf16;
            const FiniteInput bad{g.data(t), t, n};
            const bool want = reference_finite(bad.g, t, n, pl.inv_scale);
            ASSERT_EQ(loom::optim::all_finite_cpu(bad, pl.inv_scale), want)
                << "pattern " << std::hex << pl.f32 << std::dec << " at " << at;
            // The reference itself: every plant but fp16's largest value is non-finite.
            if (!(t == DType::kF16 && pl.half == 0x7BFF)) {
              ASSERT_FALSE(want);
            }
            ++checked;
          }
        }
      }
    }
  }
  hwy::SetSupportedTargetsForTest(0);
  EXPECT_GT(checked, 100);
}

const loom_test::Bad kBads[] = {loom_test::Bad::kNaN, loom_test::Bad::kInf, loom_test::Bad::kNegInf,
                                loom_test::Bad::kOverflow};

struct Case {
  const char* plugin;
  const char* extra;
};
const Case kCases[] = {
    {"adam", "adam_w_mode = false\nweight_decay = 0.01\n"},  // Adam (L2 in the gradient)
    {"adam", "weight_decay = 0.01\n"},                       // AdamW
    {"lamb", "weight_decay = 0.01\n"},
};

TEST(SkipNonfinite, AdamAdamwLambSkipTheStepAndContinueAsIfItNeverHappened) {
  const loom_test::Memory mem = loom_test::host_memory();
  for (const Case& c : kCases) {
    for (const loom_test::Bad bad : kBads) {
      loom_test::run_skip_scenario(mem, c.plugin, c.extra, /*f16_grads=*/false, bad, 4);
    }
    // fp16 gradients, and a skip at the very first step (the state is still empty).
    loom_test::run_skip_scenario(mem, c.plugin, c.extra, /*f16_grads=*/true, loom_test::Bad::kNaN,
                                 3);
    loom_test::run_skip_scenario(mem, c.plugin, c.extra, /*f16_grads=*/false, loom_test::Bad::kInf,
                                 1);
  }
}

TEST(SkipNonfinite, OlderCallersStillSkip) {
  const loom_test::Memory mem = loom_test::host_memory();
  for (const char* plugin : {"adam", "lamb"}) loom_test::run_old_caller_scenario(mem, plugin);
}

TEST(SkipNonfinite, ParameterIsDescribed) {
  for (const char* plugin : {"adam", "lamb"}) {
    char* json = nullptr;
    ASSERT_EQ(loom_describe_plugins(plugin, nullptr, &json), 0) << loom_last_error();
    const std::string s = json;
    loom_free_string(json);
    EXPECT_NE(s.find("\"skip_nonfinite\""), std::string::npos) << plugin;
  }
}

}  // namespace
