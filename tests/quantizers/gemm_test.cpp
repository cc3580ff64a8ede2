// The W8A8 / W4A8 matmul (int8_gemm.hpp, oneDNN) against the reference that quantizes x the
// same way (token-wise INT8, the reference's codes), accumulates the code products exactly in
// int64 and scales each K group's sum by s_x[m] s_w[n, g]: both then differ only by float
// rounding of the epilogue, so the tolerance is 1e-6 relative to the sum of the magnitudes
// of the scaled group sums and the bias.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "int8_gemm.hpp"
#include "quant_core.hpp"

namespace {

using loom::quant::Groups;
using loom::quant::IntScheme;
using loom::quant::IntWeight;
using loom::quant::Range;

std::vector<float> sample(std::size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> x(n);
  for (auto& v : x) v = nd(rng);
  return x;
}

// An Int8Gemm over codes with unit scales and no bias, with the buffers it writes.
struct UnitScaleGemm {
  std::vector<float> sx, sw, y, sw_col;
  std::vector<int32_t> acc;
  loom::quant::Int8Gemm g;
  UnitScaleGemm(const int8_t* xq, const int8_t* wq, int64_t m, int64_t n, int64_t k, int64_t group)
      : sx(m, 1.0f), sw(n * ((k + group - 1) / group), 1.0f), y(m * n), sw_col(n), acc(m * n) {
    g.xq = xq;
    g.sx = sx.data();
    g.wq = wq;
    g.sw = sw.data();
    g.y = y.data();
    g.m = m;
    g.n = n;
    g.k = k;
    g.group = group;
  }
  void run() { loom::quant::int8_gemm(g, acc.data(), sw_col.data()); }
};

struct Case {
  uint32_t bits;
  bool symmetric;
  Range range;
  int64_t group;
};

TEST(QuantGemm, Int8MatmulMatchesTheQuantizedReference) {
  if (!loom::quant::have_int8_gemm()) GTEST_SKIP() << "built without oneDNN";
  const int64_t n = 11, k = 48;
  const Case cases[] = {
      {8, true, Range::kExact, 0},  {8, true, Range::kDeepSpeed, 0},   {8, true, Range::kExact, 16},
      {4, true, Range::kExact, 0},  {4, true, Range::kDeepSpeed, 16},  {4, false, Range::kExact, 0},
      {4, true, Range::kExact, 20}, {7, false, Range::kDeepSpeed, 24}, {3, true, Range::kExact, 0}};
  for (const Case& c : cases) {
    for (int64_t m : {1, 5}) {
      for (bool with_bias : {false, true}) {
        SCOPED_TRACE("bits " + std::to_string(c.bits) + (c.symmetric ? " sym" : " asym") +
                     " group " + std::to_string(c.group) + " m " + std::to_string(m) +
                     (with_bias ? " bias" : ""));
        const IntScheme q{c.bits, c.symmetric, c.range};
        const Groups gs = Groups::of(n, k, c.group);
        const auto wf = sample(n * k, 3 + c.bits, 0.1f);
        const auto x = sample(m * k, static_cast<uint32_t>(9 + m), 2.0f);
        const auto bias = sample(n, 4);
        std::vector<uint8_t> p(loom::quant::packed_size(n * k, c.bits));
        std::vector<float> s(gs.count());
        std::vector<uint8_t> z(gs.count());
        loom::quant::reference_quantize(wf.data(), gs, q, LOOM_QUANT_PACK_LSB_FIRST, p.data(),
                                        s.data(), z.data());
        const IntWeight w{p.data(), s.data(), z.data(), gs, q, LOOM_QUANT_PACK_LSB_FIRST};
        ASSERT_TRUE(loom::quant::int8_matmul_supports(q, nullptr));
        std::vector<uint8_t> ws(loom::quant::int8_matmul_workspace_bytes(m, w) + 64);
        void* aligned =
            reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(ws.data()) + 63) / 64 * 64);
        std::vector<float> y(m * n, NAN);
        ASSERT_EQ(loom::quant::int8_matmul(x.data(), m, w, with_bias ? bias.data() : nullptr,
                                           y.data(), aligned),
                  -1);
        // The reference.
        std::vector<int8_t> xq(m * k);
        std::vector<float> sx(m);
        loom::quant::reference_quantize_rows_int8(x.data(), m, k, xq.data(), sx.data());
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = 0; j < n; ++j) {
            double want = with_bias ? bias[j] : 0.0;
            double mag = std::fabs(want);
            for (int64_t g = 0; g < gs.groups_per_row; ++g) {
              int64_t acc = 0;
              const int32_t zp = c.symmetric ? 0 : z[j * gs.groups_per_row + g];
              for (int64_t cc = gs.begin(g); cc < gs.end(g); ++cc) {
                const uint32_t u =
                    loom::quant::read_code(p.data(), j * k + cc, c.bits, LOOM_QUANT_PACK_LSB_FIRST);
                const int32_t wq = c.symmetric ? loom::quant::sign_extend(u, c.bits)
                                               : static_cast<int32_t>(u) - zp;
                acc += static_cast<int64_t>(xq[i * k + cc]) * wq;
              }
              const double term = static_cast<double>(acc) * sx[i] * s[j * gs.groups_per_row + g];
              want += term;
              mag += std::fabs(term);
            }
            ASSERT_NEAR(y[i * n + j], want, 1e-6 * mag + 1e-12) << "y[" << i << ", " << j << "]";
          }
        }
      }
    }
  }
}

TEST(QuantGemm, Int8MatmulIsCloseToDequantizeThenMatmul) {
  // Against float x times the decoded W, the W8A8 result differs by the rounding of x to
  // INT8: at most 0.5 s_x[m] per element, so |dy| <= 0.5 s_x[m] sum_k |w_nk|.
  if (!loom::quant::have_int8_gemm()) GTEST_SKIP() << "built without oneDNN";
  const int64_t m = 3, n = 7, k = 64;
  const IntScheme q{8, true, Range::kExact};
  const Groups gs = Groups::of(n, k, 0);
  const auto wf = sample(n * k, 1);
  const auto x = sample(m * k, 2);
  std::vector<uint8_t> p(n * k);
  std::vector<float> s(n);
  loom::quant::reference_quantize(wf.data(), gs, q, LOOM_QUANT_PACK_LSB_FIRST, p.data(), s.data(),
                                  nullptr);
  std::vector<float> wd(n * k);
  loom::quant::reference_dequantize(p.data(), s.data(), nullptr, gs, q, LOOM_QUANT_PACK_LSB_FIRST,
                                    wd.data());
  const IntWeight w{p.data(), s.data(), nullptr, gs, q, LOOM_QUANT_PACK_LSB_FIRST};
  std::vector<uint8_t> ws(loom::quant::int8_matmul_workspace_bytes(m, w) + 64);
  void* aligned = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(ws.data()) + 63) / 64 * 64);
  std::vector<float> y(m * n);
  ASSERT_EQ(loom::quant::int8_matmul(x.data(), m, w, nullptr, y.data(), aligned), -1);
  for (int64_t i = 0; i < m; ++i) {
    float amax = 0;
    for (int64_t c = 0; c < k; ++c) amax = std::max(amax, std::fabs(x[i * k + c]));
    for (int64_t j = 0; j < n; ++j) {
      double want = 0, wabs = 0;
      for (int64_t c = 0; c < k; ++c) {
        want += static_cast<double>(x[i * k + c]) * wd[j * k + c];
        wabs += std::fabs(wd[j * k + c]);
      }
      EXPECT_NEAR(y[i * n + j], want, 0.5 * amax / 127 * wabs * 1.001 + 1e-5);
    }
  }
}

TEST(QuantGemm, ConcurrentMatmulsGetTheirOwnResults) {
  // Calls are [any]: two threads at once, each its own workspace, the serial result each.
  if (!loom::quant::have_int8_gemm()) GTEST_SKIP() << "built without oneDNN";
  const int64_t m = 4, n = 12, k = 32;
  const IntScheme q{8, true, Range::kExact};
  const Groups gs = Groups::of(n, k, 16);
  const auto wf = sample(n * k, 8);
  std::vector<uint8_t> p(n * k);
  std::vector<float> s(gs.count());
  loom::quant::reference_quantize(wf.data(), gs, q, LOOM_QUANT_PACK_LSB_FIRST, p.data(), s.data(),
                                  nullptr);
  const IntWeight w{p.data(), s.data(), nullptr, gs, q, LOOM_QUANT_PACK_LSB_FIRST};
  auto run = [&](const std::vector<float>& x, std::vector<float>& y) {
    std::vector<uint8_t> ws(loom::quant::int8_matmul_workspace_bytes(m, w) + 64);
    void* aligned =
        reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(ws.data()) + 63) / 64 * 64);
    for (int rep = 0; rep < 20; ++rep) {
      EXPECT_EQ(loom::quant::int8_matmul(x.data(), m, w, nullptr, y.data(), aligned), -1);
    }
  };
  const auto x1 = sample(m * k, 21), x2 = sample(m * k, 22);
  std::vector<float> want1(m * n), want2(m * n), got1(m * n), got2(m * n);
  run(x1, want1);
  run(x2, want2);
  std::thread t1([&] { run(x1, got1); });
  std::thread t2([&] { run(x2, got2); });
  t1.join();
  t2.join();
  EXPECT_EQ(got1, want1);
  EXPECT_EQ(got2, want2);
}

// The trainer's shapes (a W8A8 GPT of dim 128, 2048 tokens a step) run as blocks of rows, one
// primitive per block shape shared by the threads: oneDNN's brgemm s8 matmul copies W's block
// and its compensation into a scratchpad, and with the library's scratchpad (one per
// primitive) threads running one primitive at once overwrote each other's, so some calls came
// out wrong (about 1 in 100 per thread with two threads, 1 in 5 with four). Several threads at
// once, each its own x and W, each call's y compared with the exact sums.
TEST(QuantGemm, OneShapeOnManyThreadsAtOnceIsExact) {
  if (!loom::quant::have_int8_gemm()) GTEST_SKIP() << "built without oneDNN";
  struct Shape {
    int64_t m, n, k, group;
  };
  // 170 rows: one row block of n 384, K 128 (the attention's qkv); 128 x 128 x 512 the MLP's
  // projection; two K groups of 128.
  const Shape shapes[] = {{170, 384, 128, 128}, {128, 128, 512, 512}, {170, 384, 256, 128}};
  constexpr int kThreads = 4;
  constexpr int kReps = 150;
  for (const Shape& sh : shapes) {
    SCOPED_TRACE("m " + std::to_string(sh.m) + " n " + std::to_string(sh.n) + " k " +
                 std::to_string(sh.k) + " group " + std::to_string(sh.group));
    std::vector<int> wrong(kThreads, 0);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        std::mt19937 rng(static_cast<uint32_t>(100 + t));
        std::uniform_int_distribution<int> code(-127, 127);
        std::vector<int8_t> xq(sh.m * sh.k), wq(sh.n * sh.k);
        for (auto& v : xq) v = static_cast<int8_t>(code(rng));
        for (auto& v : wq) v = static_cast<int8_t>(code(rng));
        // Exact in float: |sum| <= 127 * 127 * 512 < 2^24, so are the group sums' sums.
        std::vector<float> want(sh.m * sh.n);
        for (int64_t i = 0; i < sh.m; ++i) {
          for (int64_t j = 0; j < sh.n; ++j) {
            int64_t sum = 0;
            for (int64_t c = 0; c < sh.k; ++c) sum += int64_t{xq[i * sh.k + c]} * wq[j * sh.k + c];
            want[i * sh.n + j] = static_cast<float>(sum);
          }
        }
        UnitScaleGemm gemm(xq.data(), wq.data(), sh.m, sh.n, sh.k, sh.group);
        for (int rep = 0; rep < kReps; ++rep) {
          std::fill(gemm.y.begin(), gemm.y.end(), NAN);
          gemm.run();
          if (gemm.y != want) ++wrong[t];
        }
      });
    }
    for (auto& th : threads) th.join();
    for (int t = 0; t < kThreads; ++t) {
      EXPECT_EQ(wrong[t], 0) << "thread " << t << ": " << wrong[t] << " of " << kReps
                             << " calls not the exact sums";
    }
  }
}

// Codes at +-127 with both signs mixed: x and W products of 127 * 127, pairs summing to
// 2 * 127 * 127 = 32258 and, on a kernel that shifts the signed activations to unsigned bytes
// (+128) before an 8-bit multiply-add into int16 lanes, (127 + 128) * 127 * 2 = 64770, which
// saturates int16. The accumulator must still hold the exact int32 sums. Run as it is and
// again with oneDNN capped to AVX2 (ONEDNN_MAX_CPU_ISA, its own ctest entry), the ISA of a CPU
// without VNNI.
TEST(QuantGemm, ExtremeCodesAccumulateExactly) {
  if (!loom::quant::have_int8_gemm()) GTEST_SKIP() << "built without oneDNN";
  const char* cap = std::getenv("ONEDNN_MAX_CPU_ISA");
  // Capped to AVX2 oneDNN's kernels are not exact, so the GEMM must not use them.
  if (cap != nullptr && std::string(cap) == "AVX2") {
    EXPECT_FALSE(loom::quant::int8_gemm_uses_onednn());
  }
  std::printf("INT8 GEMM path: %s\n",
              loom::quant::int8_gemm_uses_onednn() ? "oneDNN (VNNI)" : "exact Highway kernel");
  struct Shape {
    int64_t m, n, k, group;
  };
  const Shape shapes[] = {
      {1, 40, 256, 256}, {16, 48, 256, 256}, {33, 17, 512, 128}, {64, 64, 128, 128}};
  std::mt19937 rng(7);
  for (const Shape& sh : shapes) {
    SCOPED_TRACE("m " + std::to_string(sh.m) + " n " + std::to_string(sh.n) + " k " +
                 std::to_string(sh.k) + " group " + std::to_string(sh.group));
    for (int pattern = 0; pattern < 3; ++pattern) {
      std::vector<int8_t> xq(sh.m * sh.k), wq(sh.n * sh.k);
      // 0: every x +127, every W -127 (the most negative sums); 1: random signs; 2: x and W of
      // one sign per pair of K (pairs that add up to the largest magnitudes), mixed by row.
      for (int64_t i = 0; i < sh.m; ++i) {
        for (int64_t c = 0; c < sh.k; ++c) {
          int8_t v = 127;
          if (pattern == 1) v = (rng() & 1) != 0 ? 127 : -127;
          if (pattern == 2) v = ((i + c / 2) % 3 == 0) ? -127 : 127;
          xq[i * sh.k + c] = v;
        }
      }
      for (int64_t j = 0; j < sh.n; ++j) {
        for (int64_t c = 0; c < sh.k; ++c) {
          int8_t v = -127;
          if (pattern == 1) v = (rng() & 1) != 0 ? 127 : -127;
          if (pattern == 2) v = ((j + c / 2) % 2 == 0) ? 127 : -127;
          wq[j * sh.k + c] = v;
        }
      }
      UnitScaleGemm gemm(xq.data(), wq.data(), sh.m, sh.n, sh.k, sh.group);
      gemm.run();
      const std::vector<int32_t>& acc = gemm.acc;
      const std::vector<float>& y = gemm.y;
      const int64_t groups = (sh.k + sh.group - 1) / sh.group;
      // The exact Highway kernel (the GEMM's path without VNNI) over all of K, whichever path
      // int8_gemm took.
      std::vector<int32_t> dot(sh.m * sh.n);
      loom::quant::int8_dot_exact(xq.data(), wq.data(), sh.m, sh.n, sh.k, 0, sh.k, dot.data());
      int64_t bad = 0;
      for (int64_t i = 0; i < sh.m; ++i) {
        for (int64_t j = 0; j < sh.n; ++j) {
          int64_t total = 0, last = 0;
          for (int64_t c = 0; c < sh.k; ++c) {
            const int64_t prod = int64_t{xq[i * sh.k + c]} * int64_t{wq[j * sh.k + c]};
            total += prod;
            if (c >= (groups - 1) * sh.group) last += prod;
          }
          // The accumulator holds the last group's sums; y their total (exact in float: at
          // most 127 * 127 * 512 < 2^24).
          if (acc[i * sh.n + j] != last || y[i * sh.n + j] != static_cast<float>(total) ||
              dot[i * sh.n + j] != total) {
            if (++bad <= 3) {
              ADD_FAILURE() << "pattern " << pattern << " [" << i << ", " << j << "]: acc "
                            << acc[i * sh.n + j] << " want " << last << ", y " << y[i * sh.n + j]
                            << " want " << total;
            }
          }
        }
      }
      EXPECT_EQ(bad, 0) << "pattern " << pattern;
    }
  }
}

TEST(QuantGemm, AsymmetricEightBitIsRefusedWithAReason) {
  std::string why;
  EXPECT_FALSE(loom::quant::int8_matmul_supports({8, false, Range::kExact}, &why));
  EXPECT_NE(why.find("do not fit"), std::string::npos) << why;
  EXPECT_TRUE(loom::quant::int8_matmul_supports({7, false, Range::kExact}, nullptr));
}

TEST(QuantGemm, NonFiniteActivationIsReported) {
  if (!loom::quant::have_int8_gemm()) GTEST_SKIP() << "built without oneDNN";
  const int64_t m = 2, n = 2, k = 8;
  std::vector<uint8_t> p(n * k, 1);
  std::vector<float> s(n, 1.0f);
  const IntWeight w{p.data(),
                    s.data(),
                    nullptr,
                    Groups::of(n, k, 0),
                    {8, true, Range::kExact},
                    LOOM_QUANT_PACK_LSB_FIRST};
  std::vector<float> x(m * k, 1.0f);
  x[k + 3] = NAN;
  std::vector<uint8_t> ws(loom::quant::int8_matmul_workspace_bytes(m, w) + 64);
  void* aligned = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(ws.data()) + 63) / 64 * 64);
  std::vector<float> y(m * n);
  EXPECT_EQ(loom::quant::int8_matmul(x.data(), m, w, nullptr, y.data(), aligned), k + 3);
}

}  // namespace
