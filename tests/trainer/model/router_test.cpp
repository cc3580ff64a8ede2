// The model's token-routing seam (router_hook.hpp) with two routers written here: a fixed
// router (each routed layer keeps a given subset of each sequence's positions, ungated, in
// training only, as random-LTD does) and a learned one (top-k of x . w with a sigmoid gate,
// in training and evaluation, as a Mixture-of-Depths router does). Whole-model gradients in
// double against central differences through routed layers, the bypass of dropped
// positions, the gate's forward, the evaluation path, and the layer-token and FLOP counts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "gpt.hpp"
#include "router_hook.hpp"

namespace lt = loom::trainer;

namespace {

// Moves of both routers: plain loops over [B, S, C] and [B, K, C].
template <typename T>
struct Moves : lt::RouterHookT<T> {
  int gathers = 0, scatters = 0;
  void gather(const T* full, T* kept, const int32_t* idx, int B, int S, int K, int C) override {
    ++gathers;
    for (int b = 0; b < B; ++b)
      for (int j = 0; j < K; ++j)
        for (int c = 0; c < C; ++c)
          kept[(static_cast<size_t>(b) * K + j) * C + c] =
              full[(static_cast<size_t>(b) * S + idx[b * K + j]) * C + c];
  }
  void scatter(T* full, const T* kept, const int32_t* idx, int B, int S, int K, int C) override {
    ++scatters;
    for (int b = 0; b < B; ++b)
      for (int j = 0; j < K; ++j)
        for (int c = 0; c < C; ++c)
          full[(static_cast<size_t>(b) * S + idx[b * K + j]) * C + c] =
              kept[(static_cast<size_t>(b) * K + j) * C + c];
  }
};

// Layer l in `keep` keeps keep[l][b % rows] of sequence b in training; evaluation and the
// other layers keep everything.
struct FixedRouter final : Moves<double> {
  std::vector<std::vector<std::vector<int32_t>>> keep;  // [layer][row] -> positions
  int selects = 0;
  bool has_weight(int, int) override { return false; }
  lt::RoutePlan plan(int layer, int, int, int seq, bool training) override {
    if (!training || static_cast<size_t>(layer) >= keep.size() || keep[layer].empty())
      return {seq, false, false};
    return {static_cast<int>(keep[layer][0].size()), true, false};
  }
  void select(int layer, int, int B, int, int, bool, const double*, const double* weight,
              int32_t* idx, double* gates) override {
    ++selects;
    EXPECT_EQ(weight, nullptr);
    EXPECT_EQ(gates, nullptr);
    const auto& rows = keep[layer];
    for (int b = 0; b < B; ++b) {
      const auto& r = rows[static_cast<size_t>(b) % rows.size()];
      std::copy(r.begin(), r.end(), idx + static_cast<size_t>(b) * r.size());
    }
  }
  void backward(int, int, int, int, int, const double*, const double*, const int32_t*,
                const double*, double*, double*) override {
    ADD_FAILURE() << "backward called on an ungated router";
  }
};

// Layers in `layers` keep the `kept` positions of largest score x . w (ties: the smaller
// position), in position order, gate sigmoid(score) (or `constant_gate` when >= 0), in
// training and evaluation alike.
struct LearnedRouter final : Moves<double> {
  std::set<int> layers;
  int kept = 3;
  double constant_gate = -1;
  int backwards = 0;
  bool has_weight(int layer, int) override { return layers.count(layer) != 0; }
  lt::RoutePlan plan(int layer, int, int, int seq, bool) override {
    if (!layers.count(layer)) return {seq, false, false};
    const int k = std::min(kept, seq);
    return {k, k < seq, true};
  }
  static double score(const double* x, const double* w, int C) {
    double s = 0;
    for (int c = 0; c < C; ++c) s += x[c] * w[c];
    return s;
  }
  void select(int, int, int B, int S, int C, bool, const double* x, const double* w, int32_t* idx,
              double* gates) override {
    EXPECT_NE(w, nullptr);
    EXPECT_NE(gates, nullptr);
    const int K = std::min(kept, S);
    for (int b = 0; b < B; ++b) {
      std::vector<double> s(static_cast<size_t>(S));
      for (int p = 0; p < S; ++p) s[p] = score(x + (static_cast<size_t>(b) * S + p) * C, w, C);
      std::vector<int32_t> order(static_cast<size_t>(S));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](int32_t a, int32_t c) { return s[a] > s[c]; });
      std::sort(order.begin(), order.begin() + K);
      for (int j = 0; j < K; ++j) {
        idx[b * K + j] = order[j];
        gates[b * K + j] =
            constant_gate >= 0 ? constant_gate : 1.0 / (1.0 + std::exp(-s[order[j]]));
      }
    }
  }
  void backward(int, int, int B, int S, int C, const double* x, const double* w, const int32_t* idx,
                const double* dgates, double* dx, double* dw) override {
    ++backwards;
    if (constant_gate >= 0) return;  // the gate does not depend on x or w
    const int K = std::min(kept, S);
    for (int b = 0; b < B; ++b)
      for (int j = 0; j < K; ++j) {
        const double* xr = x + (static_cast<size_t>(b) * S + idx[b * K + j]) * C;
        const double g = 1.0 / (1.0 + std::exp(-score(xr, w, C)));
        const double ds = dgates[b * K + j] * g * (1 - g);
        double* dxr = dx + (static_cast<size_t>(b) * S + idx[b * K + j]) * C;
        for (int c = 0; c < C; ++c) {
          dw[c] += ds * xr[c];
          dxr[c] += ds * w[c];
        }
      }
  }
};

lt::ModelConfig small() {
  lt::ModelConfig c;
  c.vocab_size = 11;
  c.context = 7;
  c.layers = 3;
  c.heads = 2;
  c.dim = 8;
  return c;
}

struct Batch {
  int B = 2, T = 6;
  std::vector<int32_t> tok, tgt;
  explicit Batch(uint64_t seed, int b = 2, int t = 6) : B(b), T(t) {
    std::mt19937_64 rng(seed);
    tok.resize(static_cast<size_t>(B) * T);
    tgt.resize(tok.size());
    for (size_t i = 0; i < tok.size(); ++i) {
      tok[i] = static_cast<int32_t>(rng() % 11);
      tgt[i] = static_cast<int32_t>(rng() % 11);
    }
  }
};

void perturb(lt::Gpt<double>& m, std::mt19937_64& rng, double scale) {
  std::normal_distribution<> nd;
  for (auto& p : m.parameters())
    for (size_t i = 0; i < p.numel; ++i) p.value[i] += scale * nd(rng);
}

// Every parameter tensor's gradient (12 entries each) against central differences of the
// training loss (h = 1e-6, tolerance 1e-6 + 1e-5 relative), as the model's other checks.
void check_all_gradients(lt::Gpt<double>& m, const Batch& d, std::mt19937_64& rng) {
  m.zero_grad();
  m.forward_backward(d.tok.data(), d.tgt.data(), d.B, d.T);
  for (auto& p : m.parameters()) {
    const std::vector<double> g(p.grad, p.grad + p.numel);
    std::vector<size_t> idx;
    if (p.numel <= 12) {
      for (size_t i = 0; i < p.numel; ++i) idx.push_back(i);
    } else {
      std::uniform_int_distribution<size_t> pick(0, p.numel - 1);
      for (int k = 0; k < 12; ++k) idx.push_back(pick(rng));
    }
    for (const size_t i : idx) {
      constexpr double h = 1e-6;
      const double saved = p.value[i];
      p.value[i] = saved + h;
      const double lp = m.forward_loss(d.tok.data(), d.tgt.data(), d.B, d.T, true);
      p.value[i] = saved - h;
      const double lm = m.forward_loss(d.tok.data(), d.tgt.data(), d.B, d.T, true);
      p.value[i] = saved;
      const double num = (lp - lm) / (2 * h);
      EXPECT_NEAR(g[i], num, 1e-6 + 1e-5 * std::fabs(num)) << p.name << "[" << i << "]";
    }
  }
}

}  // namespace

TEST(TrainerRouting, FixedRouterGradientThroughRoutedLayersDouble) {
  lt::Gpt<double> m(small(), 5);
  auto r = std::make_unique<FixedRouter>();
  // Layer 1 keeps 3 of 6 positions (sequence 0: 0, 2, 5; sequence 1: 1, 3, 4), layer 2 keeps
  // 4 (both: 0, 1, 3, 5); layer 0 is not routed.
  r->keep = {{}, {{0, 2, 5}, {1, 3, 4}}, {{0, 1, 3, 5}}};
  FixedRouter* fixed = r.get();
  const size_t before = m.parameters().size();
  m.set_router(std::move(r));
  EXPECT_EQ(m.parameters().size(), before) << "an ungated router adds no parameters";
  std::mt19937_64 rng(11);
  perturb(m, rng, 0.3);
  const Batch d(3);
  check_all_gradients(m, d, rng);
  EXPECT_GT(fixed->selects, 0);
  EXPECT_EQ(m.kept(), (std::vector<int>{6, 3, 4}));
  EXPECT_EQ(m.layer_tokens(), 2 * (6 + 3 + 4));
  // Evaluation keeps every position: the unrouted model's loss.
  const double eval = m.forward_loss(d.tok.data(), d.tgt.data(), d.B, d.T);
  EXPECT_EQ(m.kept(), (std::vector<int>{6, 6, 6}));
  lt::Gpt<double> dense(small(), 5);
  for (size_t k = 0; k < dense.parameters().size(); ++k)
    std::copy(m.parameters()[k].value, m.parameters()[k].value + m.parameters()[k].numel,
              dense.parameters()[k].value);
  EXPECT_DOUBLE_EQ(eval, dense.forward_loss(d.tok.data(), d.tgt.data(), d.B, d.T));
  EXPECT_NE(eval, m.forward_loss(d.tok.data(), d.tgt.data(), d.B, d.T, true));
}

TEST(TrainerRouting, LearnedRouterGradientIncludingTheRouterWeightDouble) {
  lt::Gpt<double> m(small(), 6);
  auto r = std::make_unique<LearnedRouter>();
  r->layers = {1, 2};
  r->kept = 4;
  LearnedRouter* learned = r.get();
  const size_t before = m.parameters().size();
  m.set_router(std::move(r));
  ASSERT_EQ(m.parameters().size(), before + 2);
  // The router weights sit after their layer's MLP, [dim], initialised to 0.
  std::vector<std::string> names;
  for (const auto& p : m.parameters()) names.push_back(p.name);
  for (const int l : {1, 2}) {
    const std::string name = "h." + std::to_string(l) + ".router.w";
    const auto it = std::find(names.begin(), names.end(), name);
    ASSERT_NE(it, names.end()) << name;
    EXPECT_EQ(*(it - 1), "h." + std::to_string(l) + ".mlp.proj.b");
    const auto& p = m.parameters()[static_cast<size_t>(it - names.begin())];
    EXPECT_EQ(p.shape, (std::vector<int64_t>{8}));
    for (size_t i = 0; i < p.numel; ++i) EXPECT_EQ(p.value[i], 0.0);
  }
  EXPECT_EQ(std::count(names.begin(), names.end(), "h.0.router.w"), 0);
  // Distinct scores, so the finite differences do not move the top-k.
  std::mt19937_64 rng(12);
  perturb(m, rng, 0.3);
  const Batch d(4);
  check_all_gradients(m, d, rng);
  EXPECT_GT(learned->backwards, 0);
  // The router weight gets a gradient: the gates carry one.
  m.zero_grad();
  m.forward_backward(d.tok.data(), d.tgt.data(), d.B, d.T);
  for (const auto& p : m.parameters()) {
    if (p.name.find("router.w") == std::string::npos) continue;
    double n = 0;
    for (size_t i = 0; i < p.numel; ++i) n += p.grad[i] * p.grad[i];
    EXPECT_GT(n, 0.0) << p.name;
  }
  // Evaluation routes the same way (a learned router's top-k in both).
  m.forward_loss(d.tok.data(), d.tgt.data(), d.B, d.T);
  EXPECT_EQ(m.kept(), (std::vector<int>{6, 4, 4}));
}

// Dropped positions bypass the layer bit for bit; a routed layer that keeps a prefix of
// each sequence computes there what the dense layer computes (causal attention).
TEST(TrainerRouting, DroppedPositionsPassThroughAndKeptOnesRunTheBlock) {
  lt::Gpt<double> m(small(), 7);
  lt::Gpt<double> dense(small(), 7);
  auto r = std::make_unique<FixedRouter>();
  r->keep = {{{0, 1, 2}}, {{1, 4}, {0, 5}}, {}};
  m.set_router(std::move(r));
  const Batch d(5);
  const int C = 8;
  m.forward_loss(d.tok.data(), d.tgt.data(), d.B, d.T, true);
  dense.forward_loss(d.tok.data(), d.tgt.data(), d.B, d.T, true);
  auto row = [&](const lt::Gpt<double>& g, int layer, int b, int p) {
    return g.layer_output(layer) + (static_cast<size_t>(b) * d.T + p) * C;
  };
  const std::vector<std::set<int>> kept1 = {{1, 4}, {0, 5}};
  for (int b = 0; b < d.B; ++b) {
    for (int p = 0; p < d.T; ++p) {
      // Layer 0 keeps positions 0..2: equal to the dense layer there, the input elsewhere.
      for (int c = 0; c < C; ++c) {
        if (p < 3) {
          EXPECT_NEAR(row(m, 0, b, p)[c], row(dense, 0, b, p)[c], 1e-12) << b << "," << p;
        } else {
          EXPECT_EQ(row(m, 0, b, p)[c], row(m, -1, b, p)[c]) << b << "," << p;
        }
      }
      // Layer 1: the dropped positions are the layer's input, bit for bit; the kept ones not.
      bool same = true;
      for (int c = 0; c < C; ++c) same = same && row(m, 1, b, p)[c] == row(m, 0, b, p)[c];
      EXPECT_EQ(same, kept1[static_cast<size_t>(b)].count(p) == 0) << b << "," << p;
    }
  }
  EXPECT_EQ(m.kept(), (std::vector<int>{3, 2, 6}));
  EXPECT_EQ(m.layer_tokens(), 2 * (3 + 2 + 6));
}

// The gate scales the update: with a constant gate g over all positions (kept = seq), a
// gated layer's output is x + g (block(x) - x); g = 1 is the dense model.
TEST(TrainerRouting, GateScalesTheLayersUpdate) {
  const Batch d(6);
  lt::Gpt<double> dense(small(), 8);
  dense.forward_loss(d.tok.data(), d.tgt.data(), d.B, d.T);
  for (const double g : {1.0, 0.25}) {
    lt::Gpt<double> m(small(), 8);
    auto r = std::make_unique<LearnedRouter>();
    r->layers = {0};
    r->kept = 6;
    r->constant_gate = g;
    m.set_router(std::move(r));
    m.forward_loss(d.tok.data(), d.tgt.data(), d.B, d.T);
    const size_t n = static_cast<size_t>(d.B) * d.T * 8;
    for (size_t i = 0; i < n; ++i) {
      const double x = m.layer_output(-1)[i];
      EXPECT_NEAR(m.layer_output(0)[i], x + g * (dense.layer_output(0)[i] - x), 1e-12) << i;
    }
  }
}

TEST(TrainerRouting, FlopsCountTheKeptTokens) {
  lt::Gpt<double> m(small(), 9);
  auto r = std::make_unique<FixedRouter>();
  r->keep = {{}, {{0, 2, 5}}, {}};
  m.set_router(std::move(r));
  const Batch d(7);
  m.forward_loss(d.tok.data(), d.tgt.data(), d.B, d.T);
  const double dense = m.flops();
  EXPECT_NEAR(dense, m.flops_per_token(d.T) * d.B * d.T, 1e-6 * dense);
  m.forward_loss(d.tok.data(), d.tgt.data(), d.B, d.T, true);
  const double C = 8, V = 11;
  const double per_token_layer = 6.0 * 12.0 * C * C;
  const double want =
      6.0 * V * C * 12 + per_token_layer * 2 * (6 + 3 + 6) + 6.0 * C * 2 * (36 + 9 + 36);
  EXPECT_NEAR(m.flops(), want, 1e-6 * want);
}

TEST(TrainerRouting, BadPlansAreRefusedWithTheLayer) {
  struct Liar final : Moves<double> {
    int kept;
    bool routed, gated;
    Liar(int k, bool r, bool g) : kept(k), routed(r), gated(g) {}
    bool has_weight(int, int) override { return false; }
    lt::RoutePlan plan(int, int, int, int, bool) override { return {kept, routed, gated}; }
    void select(int, int, int, int, int, bool, const double*, const double*, int32_t*,
                double*) override {}
    void backward(int, int, int, int, int, const double*, const double*, const int32_t*,
                  const double*, double*, double*) override {}
  };
  const Batch d(8);
  for (const auto& [k, routed, gated, what] :
       std::vector<std::tuple<int, bool, bool, std::string>>{{0, true, false, "planned 0"},
                                                             {7, true, false, "planned 7"},
                                                             {6, true, false, "(routed)"},
                                                             {3, false, false, "(not routed)"},
                                                             {3, true, true, "no router weight"}}) {
    lt::Gpt<double> m(small(), 1);
    m.set_router(std::make_unique<Liar>(k, routed, gated));
    try {
      m.forward_loss(d.tok.data(), d.tgt.data(), d.B, d.T);
      ADD_FAILURE() << "accepted kept " << k;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("layer 0"), std::string::npos) << e.what();
    }
  }
}
