// topk_router through the host: kept counts from capacity, the selection against a plain
// sort-by-score reference (ties, -0, NaN), gates, backward against finite differences in
// fp64, bit-identical results on any thread count, bad input as clear statuses, advance and
// the exported state.
#include <gtest/gtest.h>
#include <loom/embed.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "topk_helpers.hpp"

namespace {

using namespace topk_test;

// A double as a TOML float.
std::string toml_float(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  std::string out(buf);
  if (out.find_first_of(".e") == std::string::npos) out += ".0";
  return out;
}

std::string manifest(const std::string& params) {
  return "[router.r]\nplugin = \"topk_router\"\n" + params + "\n";
}

// The reference: scores in the same fixed order, positions sorted by (score desc, position),
// the first kept of them in position order. NaN ranks last, -0 equals +0.
template <class T>
std::vector<int32_t> reference_rows(Problem<T>& pr, int64_t kept, std::vector<double>& scores) {
  std::vector<int32_t> out;
  scores.assign(static_cast<std::size_t>(pr.batch * pr.seq_len), 0.0);
  for (int64_t b = 0; b < pr.batch; ++b) {
    std::vector<int32_t> order(static_cast<std::size_t>(pr.seq_len));
    std::iota(order.begin(), order.end(), 0);
    double* sc = scores.data() + b * pr.seq_len;
    for (int64_t p = 0; p < pr.seq_len; ++p) {
      double acc = 0.0;
      for (int64_t c = 0; c < pr.channels; ++c) {
        acc += static_cast<double>(pr.at(b, p, c)) * static_cast<double>(pr.w[c]);
      }
      sc[p] = acc;
    }
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t c) {
      const double sa = sc[a], sb = sc[c];
      if (std::isnan(sa) || std::isnan(sb)) return !std::isnan(sa) && std::isnan(sb);
      return sa > sb;
    });
    order.resize(static_cast<std::size_t>(kept));
    std::sort(order.begin(), order.end());
    out.insert(out.end(), order.begin(), order.end());
  }
  return out;
}

double sigmoid_ref(double s) { return 1.0 / (1.0 + std::exp(-s)); }

TEST(TopKRouter, KeptCountFromCapacity) {
  struct Case {
    double capacity;
    int64_t seq_len;
    int64_t kept;
  };
  // round(capacity * seq_len) half up, then clamped to 1 .. seq_len.
  const Case cases[] = {{0.125, 16, 2}, {0.125, 4, 1}, {0.125, 3, 1},    {0.125, 1, 1},
                        {0.25, 10, 3},  {0.3, 10, 3},  {0.35, 10, 4},    {0.5, 7, 4},
                        {1.0, 9, 9},    {0.999, 9, 9}, {0.01, 4096, 41}, {0.125, 32768, 4096},
                        {1e-9, 5, 1}};
  for (const Case& c : cases) {
    Session s(manifest("capacity = " + toml_float(c.capacity)));
    ASSERT_TRUE(s.error.empty()) << s.error;
    Router r(s, "r");
    loom_router_plan_args a = plan_args(2, c.seq_len, 8, 1, 3);
    ASSERT_EQ(r.plan(a), 0) << r.error;
    EXPECT_EQ(a.kept, c.kept) << "capacity " << c.capacity << " seq_len " << c.seq_len;
    EXPECT_NE(a.flags & LOOM_ROUTER_LEARNED, 0u);
    EXPECT_EQ((a.flags & LOOM_ROUTER_ROUTED) != 0, c.kept < c.seq_len);
    EXPECT_EQ(a.saved_bytes, static_cast<uint64_t>(2 * c.kept) * sizeof(double));
    EXPECT_GE(a.workspace_bytes, static_cast<uint64_t>(2 * std::max<int64_t>(c.seq_len, 8)) * 8);
    // Evaluation keeps the same count.
    a.training = 0;
    ASSERT_EQ(r.plan(a), 0) << r.error;
    EXPECT_EQ(a.kept, c.kept);
  }
}

TEST(TopKRouter, LayersParameterChoosesRoutedLayers) {
  {
    Session s(manifest("capacity = 0.25"));  // default: the middle layers 1 .. 4 of 6
    Router r(s, "r");
    for (int32_t l = 0; l < 6; ++l) {
      loom_router_plan_args a = plan_args(1, 16, 4, l, 6);
      ASSERT_EQ(r.plan(a), 0) << r.error;
      EXPECT_EQ(a.kept, l == 0 || l == 5 ? 16 : 4) << "layer " << l;
      EXPECT_EQ((a.flags & LOOM_ROUTER_ROUTED) != 0, l != 0 && l != 5);
    }
  }
  Session s(manifest("capacity = 0.25\nlayers = [0, 3]"));
  ASSERT_TRUE(s.error.empty()) << s.error;
  Router r(s, "r");
  for (int32_t l = 0; l < 4; ++l) {
    loom_router_plan_args a = plan_args(1, 16, 4, l, 4);
    ASSERT_EQ(r.plan(a), 0) << r.error;
    EXPECT_EQ(a.kept, l == 0 || l == 3 ? 4 : 16) << "layer " << l;
  }
  // An entry beyond the model's layers is an error naming it.
  loom_router_plan_args a = plan_args(1, 16, 4, 1, 3);
  EXPECT_EQ(r.plan(a), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(r.error.find("layers"), std::string::npos) << r.error;
}

template <class T>
void check_against_reference(Problem<T>& pr, double capacity, const char* gate) {
  Session s(manifest("capacity = " + toml_float(capacity) + "\ngate = \"" + gate + "\""));
  ASSERT_TRUE(s.error.empty()) << s.error;
  Router r(s, "r");
  Selection<T> sel = select_host(r, pr);
  ASSERT_EQ(sel.rc, 0) << r.error;
  std::vector<double> scores;
  const std::vector<int32_t> want = reference_rows(pr, sel.kept, scores);
  ASSERT_EQ(sel.indices, want);
  const bool sigmoid = std::string(gate) == "sigmoid";
  for (int64_t b = 0; b < pr.batch; ++b) {
    for (int64_t j = 0; j < sel.kept; ++j) {
      const std::size_t k = static_cast<std::size_t>(b * sel.kept + j);
      const double score = scores[static_cast<std::size_t>(b * pr.seq_len + want[k])];
      // saved: the kept scores, bit for bit (the same fixed order of fp64 operations).
      if (std::isnan(score)) {
        EXPECT_TRUE(std::isnan(sel.saved[k]));
        continue;
      }
      EXPECT_EQ(sel.saved[k], score) << "b " << b << " j " << j;
      const double g = sigmoid ? sigmoid_ref(score) : score;
      const double tol = sizeof(T) == 8 ? 4e-16 : 1.2e-7;
      EXPECT_NEAR(static_cast<double>(sel.gates[k]), g, tol * std::max(1.0, std::fabs(g)))
          << "b " << b << " j " << j << " score " << score;
    }
  }
}

TEST(TopKRouter, SelectionMatchesSortReferenceFp64) {
  Problem<double> pr = random_problem<double>(3, 37, 11, 1);
  check_against_reference(pr, 0.3, "sigmoid");
  check_against_reference(pr, 0.125, "linear");
  check_against_reference(pr, 1.0, "sigmoid");
}

TEST(TopKRouter, SelectionMatchesSortReferenceFp32) {
  Problem<float> pr = random_problem<float>(2, 50, 16, 2);
  check_against_reference(pr, 0.2, "sigmoid");
  check_against_reference(pr, 0.5, "linear");
  // A long sequence (no per-position limit anywhere).
  Problem<float> long_seq = random_problem<float>(1, 32768, 3, 12);
  check_against_reference(long_seq, 0.125, "sigmoid");
}

TEST(TopKRouter, TiesKeepTheEarlierPositions) {
  // Scores from a handful of integers: many ties, kept by smaller position; -0 ties +0.
  Problem<double> pr = random_problem<double>(4, 23, 3, 3);
  pr.w = {1.0, 0.0, 0.0};
  for (int64_t b = 0; b < pr.batch; ++b) {
    for (int64_t p = 0; p < pr.seq_len; ++p) {
      pr.at(b, p, 0) = static_cast<double>((p * 7 + b) % 4) - 1.0;
      pr.at(b, p, 1) = 0.0;
      pr.at(b, p, 2) = 0.0;
    }
  }
  pr.at(0, 3, 0) = -0.0;  // ties with the +0 scores
  pr.at(1, 0, 0) = 2.0;   // a unique best
  check_against_reference(pr, 0.4, "sigmoid");
  check_against_reference(pr, 0.05, "linear");
  // Every score equal: the first kept positions.
  for (double& v : pr.x) v = 0.5;
  Session s(manifest("capacity = 0.25"));
  Router r(s, "r");
  Selection<double> sel = select_host(r, pr);
  ASSERT_EQ(sel.rc, 0) << r.error;
  for (int64_t b = 0; b < pr.batch; ++b) {
    for (int64_t j = 0; j < sel.kept; ++j) {
      EXPECT_EQ(sel.indices[static_cast<std::size_t>(b * sel.kept + j)], j);
    }
  }
}

TEST(TopKRouter, NaNScoresRankLast) {
  Problem<double> pr = random_problem<double>(2, 12, 4, 4);
  pr.at(0, 2, 1) = std::numeric_limits<double>::quiet_NaN();
  pr.at(0, 7, 0) = std::numeric_limits<double>::infinity();
  for (int64_t p = 0; p < pr.seq_len; ++p) pr.at(1, p, 0) = std::nan("");
  check_against_reference(pr, 0.5, "sigmoid");
}

TEST(TopKRouter, GatesAcrossTheScoreRange) {
  // One channel, w = 1: the scores are the x values themselves; every position kept.
  const std::vector<double> scores = {-1e300, -800.0, -708.5, -708.0, -300.0, -40.0,
                                      -1.0,   -1e-9,  -0.0,   0.0,    1e-12,  0.5,
                                      1.0,    17.25,  40.0,   709.0,  1e300};
  Problem<double> pr;
  pr.batch = 1;
  pr.seq_len = static_cast<int64_t>(scores.size());
  pr.channels = 1;
  pr.x = scores;
  pr.w = {1.0};
  Session s(manifest("capacity = 1.0"));
  Router r(s, "r");
  Selection<double> sel = select_host(r, pr);
  ASSERT_EQ(sel.rc, 0) << r.error;
  for (std::size_t k = 0; k < scores.size(); ++k) {
    const double want = sigmoid_ref(scores[k]);
    const double got = sel.gates[k];
    EXPECT_GE(got, 0.0);
    EXPECT_LE(got, 1.0);
    if (scores[k] < -708.0) {
      EXPECT_EQ(got, 0.0) << scores[k];  // documented: e^s is 0 below -708
    } else {
      EXPECT_NEAR(got, want, 4e-16 * want) << "score " << scores[k];
    }
  }
  // Monotone in the score.
  for (std::size_t k = 1; k < scores.size(); ++k) EXPECT_LE(sel.gates[k - 1], sel.gates[k]);
}

TEST(TopKRouter, GatherAndScatterMoveTheKeptRows) {
  Session s(manifest("capacity = 0.25"));
  Router r(s, "r");
  Problem<float> pr = random_problem<float>(2, 12, 5, 13);
  Selection<float> sel = select_host(r, pr);
  ASSERT_EQ(sel.rc, 0) << r.error;
  ASSERT_EQ(sel.kept, 3);
  std::vector<float> kept(static_cast<std::size_t>(2 * 3 * 5), -1.0f);
  View full(pr.x.data(), {2, 12, 5}, kF32), kv(kept.data(), {2, 3, 5}, kF32);
  View idx(sel.indices.data(), {2, 3}, kI32);
  loom_router_move_args m{};
  m.struct_size = LOOM_ROUTER_MOVE_ARGS_SIZE;
  m.full = full.get();
  m.kept = kv.get();
  m.indices = idx.get();
  ASSERT_EQ(r.take(r.t->gather(r.obj, &m)), 0) << r.error;
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t j = 0; j < 3; ++j) {
      const int32_t p = sel.indices[static_cast<std::size_t>(b * 3 + j)];
      for (int64_t c = 0; c < 5; ++c) {
        EXPECT_EQ(kept[static_cast<std::size_t>((b * 3 + j) * 5 + c)], pr.at(b, p, c));
      }
    }
  }
  for (float& v : kept) v *= 2.0f;
  const std::vector<float> before = pr.x;
  ASSERT_EQ(r.take(r.t->scatter(r.obj, &m)), 0) << r.error;
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t p = 0; p < 12; ++p) {
      const auto row = sel.indices.begin() + b * 3;
      const bool is_kept = std::find(row, row + 3, p) != row + 3;
      for (int64_t c = 0; c < 5; ++c) {
        const std::size_t i = static_cast<std::size_t>((b * 12 + p) * 5 + c);
        EXPECT_EQ(pr.x[i], is_kept ? 2.0f * before[i] : before[i]);
      }
    }
  }
}

// loss = sum over (b, j) of gates[b, j] * coef[b, j]; dL/dgates = coef.
double loss_of(Router& r, Problem<double>& pr, const std::vector<double>& coef,
               const std::vector<int32_t>& want_indices) {
  Selection<double> sel = select_host(r, pr);
  EXPECT_EQ(sel.rc, 0) << r.error;
  EXPECT_EQ(sel.indices, want_indices) << "the perturbation changed the selection";
  double l = 0.0;
  for (std::size_t k = 0; k < sel.gates.size(); ++k) l += sel.gates[k] * coef[k];
  return l;
}

void check_finite_differences(const char* gate) {
  Session s(manifest("capacity = 0.4\ngate = \"" + std::string(gate) + "\""));
  ASSERT_TRUE(s.error.empty()) << s.error;
  Router r(s, "r");
  Problem<double> pr = random_problem<double>(2, 9, 5, 5);
  Selection<double> sel = select_host(r, pr);
  ASSERT_EQ(sel.rc, 0) << r.error;
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<double> coef(sel.gates.size());
  for (double& c : coef) c = u(rng);
  // backward adds: start from non-zero gradients and compare the increments.
  std::vector<double> dx0(pr.x.size()), dw0(pr.w.size());
  for (double& v : dx0) v = u(rng);
  for (double& v : dw0) v = u(rng);
  std::vector<double> dx = dx0, dw = dw0, dg = coef;
  ASSERT_EQ(backward_host(r, pr, sel, dg, dx, dw), 0) << r.error;
  const double h = 1e-6;
  auto fd = [&](double& v) {
    const double keep = v;
    v = keep + h;
    const double up = loss_of(r, pr, coef, sel.indices);
    v = keep - h;
    const double down = loss_of(r, pr, coef, sel.indices);
    v = keep;
    return (up - down) / (2 * h);
  };
  for (std::size_t i = 0; i < pr.x.size(); ++i) {
    const double want = fd(pr.x[i]);
    EXPECT_NEAR(dx[i] - dx0[i], want, 1e-7 * std::max(1.0, std::fabs(want))) << "x[" << i << "]";
  }
  for (std::size_t c = 0; c < pr.w.size(); ++c) {
    const double want = fd(pr.w[c]);
    EXPECT_NEAR(dw[c] - dw0[c], want, 1e-7 * std::max(1.0, std::fabs(want))) << "w[" << c << "]";
    EXPECT_NE(dw[c], dw0[c]);
  }
  // Positions not kept get nothing.
  for (int64_t b = 0; b < pr.batch; ++b) {
    for (int64_t p = 0; p < pr.seq_len; ++p) {
      const auto row = sel.indices.begin() + b * sel.kept;
      if (std::find(row, row + sel.kept, p) != row + sel.kept) continue;
      for (int64_t c = 0; c < pr.channels; ++c) {
        const std::size_t i = static_cast<std::size_t>((b * pr.seq_len + p) * pr.channels + c);
        EXPECT_EQ(dx[i], dx0[i]);
      }
    }
  }
}

TEST(TopKRouter, BackwardMatchesFiniteDifferencesSigmoid) { check_finite_differences("sigmoid"); }
TEST(TopKRouter, BackwardMatchesFiniteDifferencesLinear) { check_finite_differences("linear"); }

// select + backward at one thread count, as bytes.
template <class T>
std::vector<unsigned char> run_all(std::size_t threads) {
  EXPECT_EQ(loom_set_thread_count(threads), 0) << loom_last_error();
  Session s(manifest("capacity = 0.3"));
  Router r(s, "r");
  Problem<T> pr = random_problem<T>(5, 301, 130, 9);
  Selection<T> sel = select_host(r, pr);
  EXPECT_EQ(sel.rc, 0) << r.error;
  std::vector<T> dg(sel.gates.size());
  for (std::size_t k = 0; k < dg.size(); ++k) dg[k] = static_cast<T>(std::sin(double(k)));
  std::vector<T> dx(pr.x.size(), T(0.25)), dw(pr.w.size(), T(-0.5));
  EXPECT_EQ(backward_host(r, pr, sel, dg, dx, dw), 0) << r.error;
  std::vector<unsigned char> out;
  auto put = [&](const void* p, std::size_t n) {
    const auto* c = static_cast<const unsigned char*>(p);
    out.insert(out.end(), c, c + n);
  };
  put(sel.indices.data(), sel.indices.size() * 4);
  put(sel.gates.data(), sel.gates.size() * sizeof(T));
  put(sel.saved.data(), sel.saved.size() * 8);
  put(dx.data(), dx.size() * sizeof(T));
  put(dw.data(), dw.size() * sizeof(T));
  return out;
}

TEST(TopKRouter, BitIdenticalOnAnyThreadCount) {
  const std::size_t before = loom_thread_count();
  const auto one32 = run_all<float>(1);
  const auto one64 = run_all<double>(1);
  for (std::size_t t : {2u, 3u, 7u}) {
    EXPECT_EQ(run_all<float>(t), one32) << t << " threads";
    EXPECT_EQ(run_all<double>(t), one64) << t << " threads";
  }
  EXPECT_EQ(loom_set_thread_count(before), 0);
}

TEST(TopKRouter, BadParametersAreClearErrors) {
  struct Case {
    const char* params;
    const char* needle;
  };
  const Case cases[] = {{"capacity = 0.0", "capacity"}, {"capacity = -0.5", "capacity"},
                        {"capacity = 1.5", "capacity"}, {"gate = \"relu\"", "gate"},
                        {"layers = [2, 1]", "layers"},  {"layers = [-1]", "layers"}};
  for (const Case& c : cases) {
    Session s(manifest(c.params));
    EXPECT_FALSE(s.error.empty()) << c.params;
    EXPECT_NE(s.error.find(c.needle), std::string::npos) << c.params << ": " << s.error;
  }
}

TEST(TopKRouter, BadTensorsAreClearErrors) {
  Session s(manifest("capacity = 0.5"));
  ASSERT_TRUE(s.error.empty()) << s.error;
  Router r(s, "r");
  // Wrong dtype: plan names it.
  loom_router_plan_args p = plan_args(1, 8, 4, 1, 3, DLDataType{kDLFloat, 16, 1});
  EXPECT_EQ(r.plan(p), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(r.error.find("dtype"), std::string::npos) << r.error;
  // Layer out of range.
  p = plan_args(1, 8, 4, 3, 3);
  EXPECT_EQ(r.plan(p), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(r.error.find("layer"), std::string::npos) << r.error;
  // select: x NULL, weight NULL, int32 x, layer out of range; nothing is written.
  Problem<double> pr = random_problem<double>(2, 8, 4, 6);
  p = plan_args(2, 8, 4, 1, 3);
  ASSERT_EQ(r.plan(p), 0) << r.error;
  std::vector<int32_t> idx(static_cast<std::size_t>(2 * p.kept), -1);
  std::vector<double> gates(idx.size(), -1.0);
  Aligned saved(p.saved_bytes), ws(p.workspace_bytes);
  std::vector<int32_t> xi(pr.x.size(), 1);
  View x(pr.x.data(), {2, 8, 4}, kF64), w(pr.w.data(), {4}, kF64);
  View xint(xi.data(), {2, 8, 4}, kI32), wint(xi.data(), {4}, kI32);
  View iv(idx.data(), {2, p.kept}, kI32), gv(gates.data(), {2, p.kept}, kF64);
  auto select = [&](const DLTensor* xt, const DLTensor* wt, int32_t layer) {
    loom_router_select_args a{};
    a.struct_size = LOOM_ROUTER_SELECT_ARGS_SIZE;
    a.step = 1;
    a.batch = 2;
    a.seq_len = 8;
    a.channels = 4;
    a.layer = layer;
    a.num_layers = 3;
    a.training = 1;
    a.x = xt;
    a.weight = wt;
    a.indices = iv.get();
    a.gates = gv.get();
    a.saved = saved.p;
    a.saved_bytes = p.saved_bytes;
    a.workspace = ws.p;
    a.workspace_bytes = p.workspace_bytes;
    return r.take(r.t->select(r.obj, &a));
  };
  EXPECT_EQ(select(nullptr, w.get(), 1), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(r.error.find("x is NULL"), std::string::npos) << r.error;
  EXPECT_EQ(select(x.get(), nullptr, 1), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(r.error.find("weight"), std::string::npos) << r.error;
  EXPECT_EQ(select(xint.get(), wint.get(), 1), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(r.error.find("dtype"), std::string::npos) << r.error;
  EXPECT_EQ(select(x.get(), w.get(), 3), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(r.error.find("layer 3"), std::string::npos) << r.error;
  for (int32_t v : idx) EXPECT_EQ(v, -1);
  ASSERT_EQ(select(x.get(), w.get(), 1), 0) << r.error;

  // backward: saved NULL or short, indices outside the sequence: errors, dx untouched.
  Selection<double> sel;
  sel.kept = p.kept;
  sel.indices = idx;
  sel.saved.assign(static_cast<std::size_t>(2 * p.kept), 0.5);
  std::vector<double> dg(idx.size(), 1.0), dx(pr.x.size(), 0.0), dw(4, 0.0);
  ASSERT_EQ(backward_host(r, pr, sel, dg, dx, dw), 0) << r.error;
  auto backward = [&](void* sp, uint64_t sbytes, std::vector<int32_t>& rows) {
    View bx(pr.x.data(), {2, 8, 4}, kF64), bw(pr.w.data(), {4}, kF64);
    View bi(rows.data(), {2, p.kept}, kI32), bg(dg.data(), {2, p.kept}, kF64);
    View bdx(dx.data(), {2, 8, 4}, kF64), bdw(dw.data(), {4}, kF64);
    loom_router_backward_args a{};
    a.struct_size = LOOM_ROUTER_BACKWARD_ARGS_SIZE;
    a.batch = 2;
    a.seq_len = 8;
    a.channels = 4;
    a.x = bx.get();
    a.weight = bw.get();
    a.indices = bi.get();
    a.dgates = bg.get();
    a.dx = bdx.get();
    a.dweight = bdw.get();
    a.saved = sp;
    a.saved_bytes = sbytes;
    a.workspace = ws.p;
    a.workspace_bytes = p.workspace_bytes;
    return r.take(r.t->backward(r.obj, &a));
  };
  const std::vector<double> dx_before = dx;
  EXPECT_EQ(backward(nullptr, 0, idx), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(r.error.find("saved"), std::string::npos) << r.error;
  EXPECT_EQ(backward(saved.p, 8, idx), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(r.error.find("saved"), std::string::npos) << r.error;
  std::vector<int32_t> bad = idx;
  bad[1] = 8;
  EXPECT_EQ(backward(saved.p, p.saved_bytes, bad), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(r.error.find("indices[0, 1] = 8"), std::string::npos) << r.error;
  EXPECT_EQ(dx, dx_before);
}

struct Advance {
  int32_t rc = 0;
  loom_router_advance_args a{};
};

Advance advance(Router& r, int64_t step, int64_t batch, int64_t seq_len, int32_t num_layers) {
  Advance out;
  out.a.struct_size = LOOM_ROUTER_ADVANCE_ARGS_SIZE;
  out.a.step = step;
  out.a.batch = batch;
  out.a.seq_len = seq_len;
  out.a.num_layers = num_layers;
  out.rc = r.take(r.t->advance(r.obj, &out.a));
  return out;
}

TEST(TopKRouter, AdvanceCountsLayerTokensAndStateRoundTrips) {
  std::vector<unsigned char> blob(4096);
  size_t size = 0;
  {
    Session s(manifest("capacity = 0.125"));
    ASSERT_TRUE(s.error.empty()) << s.error;
    Router r(s, "r");
    // 4 layers, the middle two routed: 64 + 8 + 8 + 64 tokens per sequence.
    Advance a1 = advance(r, 1, 3, 64, 4);
    ASSERT_EQ(a1.rc, 0) << r.error;
    EXPECT_EQ(a1.a.layer_tokens, 3 * (64 + 8 + 8 + 64));
    EXPECT_EQ(a1.a.consumed_layer_tokens, 432u);
    Advance a2 = advance(r, 2, 2, 32, 4);  // a shorter (curriculum-cut) step: 32 + 4 + 4 + 32
    ASSERT_EQ(a2.rc, 0) << r.error;
    EXPECT_EQ(a2.a.layer_tokens, 2 * 72);
    EXPECT_EQ(a2.a.consumed_layer_tokens, 432u + 144u);
    Advance again = advance(r, 2, 2, 32, 4);  // the last step again: nothing changes
    ASSERT_EQ(again.rc, 0) << r.error;
    EXPECT_EQ(again.a.consumed_layer_tokens, 576u);
    Advance skip = advance(r, 4, 2, 32, 4);
    EXPECT_EQ(skip.rc, LOOM_ERR_FAILED_PRECONDITION);
    EXPECT_EQ(advance(r, 1, 2, 32, 4).rc, LOOM_ERR_FAILED_PRECONDITION);
    ASSERT_EQ(loom_instance_export_state(r.inst, blob.data(), blob.size(), &size), 0)
        << loom_last_error();
    blob.resize(size);
  }
  Session s(manifest("capacity = 0.125"));
  Router r(s, "r");
  ASSERT_EQ(advance(r, 2, 1, 8, 4).rc, LOOM_ERR_FAILED_PRECONDITION);  // a fresh router: step 1
  // A damaged blob is refused and changes nothing.
  std::vector<unsigned char> bad = blob;
  bad[bad.size() / 2] ^= 0x40;
  EXPECT_NE(loom_instance_import_state(r.inst, bad.data(), bad.size()), 0);
  ASSERT_EQ(loom_instance_import_state(r.inst, blob.data(), blob.size()), 0) << loom_last_error();
  Advance a3 = advance(r, 3, 1, 64, 4);
  ASSERT_EQ(a3.rc, 0) << r.error;
  EXPECT_EQ(a3.a.layer_tokens, 144);
  EXPECT_EQ(a3.a.consumed_layer_tokens, 576u + 144u);
}

}  // namespace
