// Index dispatch/combine against loops, their adjoint identity, and the grouped expert GEMMs
// (forward and backward) against naive loops.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <vector>

#include <loom/moe/dispatch.hpp>
#include <loom/moe/experts.hpp>
#include "reference.hpp"

namespace {

// route of S tokens, k choices over E experts with some -1s, deterministic
std::vector<int32_t> some_route(int64_t S, int k, int E, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<int32_t> r(static_cast<size_t>(S * k));
  for (auto& v : r) v = static_cast<int32_t>(gen() % static_cast<uint32_t>(E + 1)) - 1;
  return r;
}

}  // namespace

TEST(MoeDispatch, SlotsAreAStableCountingSortByExpert) {
  const int E = 3, k = 2;
  const std::vector<int32_t> route = {2, 0, 0, -1, 2, 1, 0, 2};  // 4 tokens
  std::vector<int64_t> counts(E), slot(route.size());
  const int64_t total = loom::moe::build_slots(route.data(), 4, k, E, counts.data(), slot.data());
  EXPECT_EQ(total, 7);
  EXPECT_EQ(counts, (std::vector<int64_t>{3, 1, 3}));
  // expert 0: (0,1) (1,0) (3,0) -> 0,1,2; expert 1: (2,1) -> 3; expert 2: (0,0) (2,0) (3,1)
  EXPECT_EQ(slot, (std::vector<int64_t>{4, 0, 1, -1, 5, 3, 2, 6}));
  const std::vector<int32_t> bad = {0, 3};
  EXPECT_THROW(loom::moe::build_slots(bad.data(), 1, 2, E, counts.data(), slot.data()),
               std::invalid_argument);
}

TEST(MoeDispatch, GatherAndCombineMatchLoopsAndAreAdjoint) {
  const int64_t S = 13, M = 5;
  const int k = 3, E = 4;
  const auto route = some_route(S, k, E, 3u);
  std::vector<int64_t> counts(E), slot(static_cast<size_t>(S * k));
  const int64_t R = loom::moe::build_slots(route.data(), S, k, E, counts.data(), slot.data());
  const auto x = moe_test::random_vec<double>(static_cast<size_t>(S * M), 1u);
  const auto w = moe_test::random_vec<double>(static_cast<size_t>(S * k), 2u);
  std::vector<double> rows(static_cast<size_t>(R * M), -7.0);
  loom::moe::gather_rows<double>(x.data(), S, M, k, slot.data(), w.data(), rows.data());
  // every row of expert e holds the weighted x of a token that chose e, in (token, choice) order
  int64_t next = 0;
  for (int e = 0; e < E; ++e) {
    for (int64_t s = 0; s < S; ++s) {
      for (int j = 0; j < k; ++j) {
        if (route[static_cast<size_t>(s * k + j)] != e) continue;
        for (int64_t m = 0; m < M; ++m) {
          EXPECT_EQ(rows[static_cast<size_t>(next * M + m)],
                    w[static_cast<size_t>(s * k + j)] * x[static_cast<size_t>(s * M + m)]);
        }
        ++next;
      }
    }
  }
  EXPECT_EQ(next, R);
  const auto r2 = moe_test::random_vec<double>(static_cast<size_t>(R * M), 4u);
  std::vector<double> y(static_cast<size_t>(S * M), 9.0);
  loom::moe::combine_rows<double>(r2.data(), S, M, k, slot.data(), w.data(), y.data(), false);
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t m = 0; m < M; ++m) {
      double want = 0.0;
      for (int j = 0; j < k; ++j) {
        const int64_t r = slot[static_cast<size_t>(s * k + j)];
        if (r >= 0) want += w[static_cast<size_t>(s * k + j)] * r2[static_cast<size_t>(r * M + m)];
      }
      EXPECT_NEAR(y[static_cast<size_t>(s * M + m)], want, 1e-12);
    }
  }
  // <combine(r2), x> == <r2, gather(x)> with the same weights
  double lhs = 0.0, rhs = 0.0;
  for (size_t i = 0; i < y.size(); ++i) lhs += y[i] * x[i];
  for (size_t i = 0; i < rows.size(); ++i) rhs += r2[i] * rows[i];
  EXPECT_NEAR(lhs, rhs, 1e-10);
  // the weight gradient of the combine: d<combine(r2, w), dy>/dw[s, j] = dy[s] . r2[slot]
  std::vector<double> dw(static_cast<size_t>(S * k));
  loom::moe::combine_weight_grad<double>(r2.data(), x.data(), S, M, k, slot.data(), dw.data());
  for (int64_t s = 0; s < S; ++s) {
    for (int j = 0; j < k; ++j) {
      const int64_t r = slot[static_cast<size_t>(s * k + j)];
      double want = 0.0;
      for (int64_t m = 0; m < M && r >= 0; ++m) {
        want += x[static_cast<size_t>(s * M + m)] * r2[static_cast<size_t>(r * M + m)];
      }
      EXPECT_NEAR(dw[static_cast<size_t>(s * k + j)], want, 1e-12);
    }
  }
}

TEST(MoeExperts, GroupedGemmMatchesNaiveLoops) {
  const int El = 3;
  const int64_t M = 6, H = 7;
  const std::vector<int64_t> rows = {4, 0, 5};  // an expert without rows
  const int64_t R = 9;
  for (auto act :
       {loom::moe::Activation::Gelu, loom::moe::Activation::Relu, loom::moe::Activation::Silu}) {
    const auto in = moe_test::random_vec<float>(static_cast<size_t>(R * M), 1u);
    const auto w1 = moe_test::random_vec<float>(static_cast<size_t>(El * H * M), 2u, 0.5);
    const auto b1 = moe_test::random_vec<float>(static_cast<size_t>(El * H), 3u, 0.5);
    const auto w2 = moe_test::random_vec<float>(static_cast<size_t>(El * M * H), 4u, 0.5);
    const auto b2 = moe_test::random_vec<float>(static_cast<size_t>(El * M), 5u, 0.5);
    loom::moe::ExpertWeights<float> w{w1.data(), b1.data(), w2.data(), b2.data()};
    std::vector<float> pre(static_cast<size_t>(R * H)), h(pre.size()),
        out(static_cast<size_t>(R * M));
    loom::moe::experts_forward<float>(act, El, rows.data(), M, H, in.data(), w, pre.data(),
                                      h.data(), out.data());
    int64_t off = 0;
    for (int e = 0; e < El; ++e) {
      std::vector<float> want(static_cast<size_t>(std::max<int64_t>(rows[e], 1) * M));
      moe_test::naive_mlp<float>(act, rows[e], M, H, in.data() + off * M, w1.data() + e * H * M,
                                 b1.data() + e * H, w2.data() + e * M * H, b2.data() + e * M,
                                 want.data());
      for (int64_t i = 0; i < rows[e] * M; ++i) {
        EXPECT_NEAR(out[static_cast<size_t>(off * M + i)], want[static_cast<size_t>(i)], 2e-5);
      }
      off += rows[e];
    }
  }
}

TEST(MoeExperts, BackwardMatchesFiniteDifferencesInDouble) {
  const int El = 2;
  const int64_t M = 3, H = 4;
  const std::vector<int64_t> rows = {2, 3};
  const int64_t R = 5;
  auto in = moe_test::random_vec<double>(static_cast<size_t>(R * M), 1u);
  auto w1 = moe_test::random_vec<double>(static_cast<size_t>(El * H * M), 2u);
  auto b1 = moe_test::random_vec<double>(static_cast<size_t>(El * H), 3u);
  auto w2 = moe_test::random_vec<double>(static_cast<size_t>(El * M * H), 4u);
  auto b2 = moe_test::random_vec<double>(static_cast<size_t>(El * M), 5u);
  const auto g = moe_test::random_vec<double>(static_cast<size_t>(R * M), 6u);
  const auto act = loom::moe::Activation::Gelu;
  auto loss = [&]() {
    loom::moe::ExpertWeights<double> w{w1.data(), b1.data(), w2.data(), b2.data()};
    std::vector<double> pre(static_cast<size_t>(R * H)), h(pre.size()),
        out(static_cast<size_t>(R * M));
    loom::moe::experts_forward<double>(act, El, rows.data(), M, H, in.data(), w, pre.data(),
                                       h.data(), out.data());
    double l = 0.0;
    for (size_t i = 0; i < out.size(); ++i) l += out[i] * g[i];
    return l;
  };
  loom::moe::ExpertWeights<double> w{w1.data(), b1.data(), w2.data(), b2.data()};
  std::vector<double> pre(static_cast<size_t>(R * H)), h(pre.size()), dh(pre.size());
  std::vector<double> out(static_cast<size_t>(R * M)), din(out.size());
  loom::moe::experts_forward<double>(act, El, rows.data(), M, H, in.data(), w, pre.data(), h.data(),
                                     out.data());
  std::vector<double> gw1(w1.size(), 1.0), gb1(b1.size(), 1.0), gw2(w2.size(), 1.0),
      gb2(b2.size(), 1.0);
  loom::moe::ExpertGrads<double> gr{gw1.data(), gb1.data(), gw2.data(), gb2.data()};
  loom::moe::experts_backward<double>(act, El, rows.data(), M, H, in.data(), pre.data(), g.data(),
                                      w, gr, h.data(), dh.data(), din.data());
  auto check = [&](std::vector<double>& param, const std::vector<double>& grad, double added,
                   const char* name) {
    for (size_t i = 0; i < param.size(); ++i) {
      const double keep = param[i];
      param[i] = keep + 1e-6;
      const double up = loss();
      param[i] = keep - 1e-6;
      const double down = loss();
      param[i] = keep;
      EXPECT_NEAR(grad[i] - added, (up - down) / 2e-6, 1e-6) << name << "[" << i << "]";
    }
  };
  check(w1, gw1, 1.0, "w1");  // gradients were ADDED to 1.0
  check(b1, gb1, 1.0, "b1");
  check(w2, gw2, 1.0, "w2");
  check(b2, gb2, 1.0, "b2");
  check(in, din, 0.0, "in");
}

// Segments longer than one work block (64 rows) and a hidden width of two gradient blocks:
// forward and backward against plain loops in double.
TEST(MoeExperts, BlockedWorkMatchesLoops) {
  const int El = 2;
  const int64_t M = 3, H = 66;
  const std::vector<int64_t> rows = {70, 3};
  const int64_t R = 73;
  const auto act = loom::moe::Activation::Gelu;
  const auto in = moe_test::random_vec<double>(static_cast<size_t>(R * M), 1u);
  const auto w1 = moe_test::random_vec<double>(static_cast<size_t>(El * H * M), 2u, 0.5);
  const auto b1 = moe_test::random_vec<double>(static_cast<size_t>(El * H), 3u, 0.5);
  const auto w2 = moe_test::random_vec<double>(static_cast<size_t>(El * M * H), 4u, 0.5);
  const auto b2 = moe_test::random_vec<double>(static_cast<size_t>(El * M), 5u, 0.5);
  const auto dout = moe_test::random_vec<double>(static_cast<size_t>(R * M), 6u);
  loom::moe::ExpertWeights<double> w{w1.data(), b1.data(), w2.data(), b2.data()};
  std::vector<double> pre(static_cast<size_t>(R * H)), h(pre.size()), dh(pre.size());
  std::vector<double> out(static_cast<size_t>(R * M)), din(out.size());
  loom::moe::experts_forward<double>(act, El, rows.data(), M, H, in.data(), w, pre.data(), h.data(),
                                     out.data());
  std::vector<double> gw1(w1.size()), gb1(b1.size()), gw2(w2.size()), gb2(b2.size());
  loom::moe::ExpertGrads<double> g{gw1.data(), gb1.data(), gw2.data(), gb2.data()};
  loom::moe::experts_backward<double>(act, El, rows.data(), M, H, in.data(), pre.data(),
                                      dout.data(), w, g, h.data(), dh.data(), din.data());
  std::vector<double> rw1(w1.size()), rb1(b1.size()), rw2(w2.size()), rb2(b2.size());
  int64_t off = 0;
  for (int e = 0; e < El; ++e) {
    for (int64_t r = off; r < off + rows[e]; ++r) {
      std::vector<double> p(static_cast<size_t>(H)), hh(p.size()), dp(p.size());
      for (int64_t i = 0; i < H; ++i) {
        double acc = b1[e * H + i];
        for (int64_t m = 0; m < M; ++m) acc += in[r * M + m] * w1[(e * H + i) * M + m];
        p[i] = acc;
        hh[i] = loom::moe::act_forward(act, acc);
      }
      for (int64_t m = 0; m < M; ++m) {
        double acc = b2[e * M + m];
        for (int64_t i = 0; i < H; ++i) acc += hh[i] * w2[(e * M + m) * H + i];
        EXPECT_NEAR(out[r * M + m], acc, 1e-12);
        rb2[e * M + m] += dout[r * M + m];
        for (int64_t i = 0; i < H; ++i) rw2[(e * M + m) * H + i] += dout[r * M + m] * hh[i];
      }
      for (int64_t i = 0; i < H; ++i) {
        double acc = 0.0;
        for (int64_t m = 0; m < M; ++m) acc += dout[r * M + m] * w2[(e * M + m) * H + i];
        dp[i] = acc * loom::moe::act_grad(act, p[i]);
        rb1[e * H + i] += dp[i];
        for (int64_t m = 0; m < M; ++m) rw1[(e * H + i) * M + m] += dp[i] * in[r * M + m];
      }
      for (int64_t m = 0; m < M; ++m) {
        double acc = 0.0;
        for (int64_t i = 0; i < H; ++i) acc += dp[i] * w1[(e * H + i) * M + m];
        EXPECT_NEAR(din[r * M + m], acc, 1e-12);
      }
    }
    off += rows[e];
  }
  for (size_t i = 0; i < gw1.size(); ++i) EXPECT_NEAR(gw1[i], rw1[i], 1e-11) << "w1 " << i;
  for (size_t i = 0; i < gb1.size(); ++i) EXPECT_NEAR(gb1[i], rb1[i], 1e-11) << "b1 " << i;
  for (size_t i = 0; i < gw2.size(); ++i) EXPECT_NEAR(gw2[i], rw2[i], 1e-11) << "w2 " << i;
  for (size_t i = 0; i < gb2.size(); ++i) EXPECT_NEAR(gb2[i], rb2[i], 1e-11) << "b2 " << i;
}

// The combine sums one or two kept pairs in a single pass over y: bit for bit the pass-by-pass
// loop (y = 0 or y, then y = y + w_j * row in choice order), for k = 1, 2, 3 with drops, with
// and without weights, overwrite and accumulate, signed zeros included.
TEST(MoeDispatch, CombineIsBitIdenticalToThePassByPassLoop) {
  const int64_t S = 6, M = 13;
  for (int k = 1; k <= 3; ++k) {
    std::vector<int32_t> route(static_cast<size_t>(S * k));
    for (size_t i = 0; i < route.size(); ++i)
      route[i] = (i % 4 == 3) ? -1 : static_cast<int>(i % 3);
    std::vector<int64_t> counts(3), slot(route.size());
    const int64_t R = loom::moe::build_slots(route.data(), S, k, 3, counts.data(), slot.data());
    std::vector<float> rows(static_cast<size_t>(R * M)), w(route.size());
    for (size_t i = 0; i < rows.size(); ++i) {
      rows[i] = (i % 7 == 0) ? -0.0f : static_cast<float>(i % 11) * 0.37f - 1.3f;
    }
    for (size_t i = 0; i < w.size(); ++i) w[i] = 0.1f + 0.29f * static_cast<float>(i % 5);
    for (const bool weighted : {true, false}) {
      for (const bool accumulate : {false, true}) {
        std::vector<float> y(static_cast<size_t>(S * M), -0.0f);
        for (size_t i = 0; i < y.size(); i += 3) y[i] = 0.25f;
        std::vector<float> want = y;
        loom::moe::combine_rows<float>(rows.data(), S, M, k, slot.data(),
                                       weighted ? w.data() : nullptr, y.data(), accumulate);
        for (int64_t s = 0; s < S; ++s) {
          float* ys = want.data() + s * M;
          if (!accumulate) std::fill(ys, ys + M, 0.0f);
          for (int j = 0; j < k; ++j) {
            const int64_t r = slot[static_cast<size_t>(s * k + j)];
            if (r < 0) continue;
            const float wj = weighted ? w[static_cast<size_t>(s * k + j)] : 1.0f;
            for (int64_t m = 0; m < M; ++m) {
              const float p = wj * rows[static_cast<size_t>(r * M + m)];
              ys[m] = ys[m] + p;
            }
          }
        }
        ASSERT_EQ(std::memcmp(y.data(), want.data(), y.size() * sizeof(float)), 0)
            << "k " << k << " weighted " << weighted << " accumulate " << accumulate;
      }
    }
  }
}

// A gather of 4 MiB streams its rows (non-temporal stores): the rows must still be exact
// copies, dropped pairs leave their rows alone, and a weighted gather (never streamed) scales.
TEST(MoeDispatch, LargeGatherStreamsExactRows) {
  const int64_t S = 1024, M = 512;
  const int k = 2, E = 4;
  std::vector<int32_t> route(static_cast<size_t>(S * k));
  for (size_t i = 0; i < route.size(); ++i)
    route[i] = (i % 97 == 5) ? -1 : static_cast<int>(i * 7 % E);
  std::vector<int64_t> counts(E), slot(route.size());
  const int64_t R = loom::moe::build_slots(route.data(), S, k, E, counts.data(), slot.data());
  std::vector<float> x(static_cast<size_t>(S * M));
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 1009) - 504.5f;
  std::vector<float> rows(static_cast<size_t>(S * k * M), 7.0f);
  loom::moe::gather_rows<float>(x.data(), S, M, k, slot.data(), nullptr, rows.data());
  std::vector<float> w(route.size(), 0.5f);
  std::vector<float> scaled(static_cast<size_t>(R * M));
  loom::moe::gather_rows<float>(x.data(), S, M, k, slot.data(), w.data(), scaled.data());
  for (int64_t s = 0; s < S; ++s) {
    for (int j = 0; j < k; ++j) {
      const int64_t r = slot[static_cast<size_t>(s * k + j)];
      if (r < 0) continue;
      ASSERT_EQ(std::memcmp(rows.data() + r * M, x.data() + s * M, M * sizeof(float)), 0)
          << "token " << s << " choice " << j;
      ASSERT_EQ(scaled[static_cast<size_t>(r * M + 3)], 0.5f * x[static_cast<size_t>(s * M + 3)]);
    }
  }
  for (size_t i = static_cast<size_t>(R * M); i < rows.size(); ++i) ASSERT_EQ(rows[i], 7.0f);
}
