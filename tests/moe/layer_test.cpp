// The whole MoE layer on the host: its gradient against central finite differences in double
// (through the gate, capacity, experts, the aux loss and PR-MoE's residual MLP and
// coefficient), the float layer against the double one, and the layer's bookkeeping.
#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include <loom/moe/layer.hpp>
#include "layer_layout.hpp"
#include "reference.hpp"

using loom::moe::Exchange;
using loom::moe::LayerConfig;

namespace {

template <class T>
struct Params {
  std::vector<T> x, gate_w, w1, b1, w2, b2, rw1, rb1, rw2, rb2, coef_w, coef_b;
  Params(const LayerConfig& c, int64_t S) {
    const int64_t E = c.gate.num_experts, M = c.model_dim, H = c.hidden_dim;
    x = moe_test::random_vec<T>(static_cast<size_t>(S * M), 1u);
    gate_w = moe_test::random_vec<T>(static_cast<size_t>(E * M), 2u, 1.5);
    w1 = moe_test::random_vec<T>(static_cast<size_t>(E * H * M), 3u, 0.7);
    b1 = moe_test::random_vec<T>(static_cast<size_t>(E * H), 4u, 0.3);
    w2 = moe_test::random_vec<T>(static_cast<size_t>(E * M * H), 5u, 0.7);
    b2 = moe_test::random_vec<T>(static_cast<size_t>(E * M), 6u, 0.3);
    rw1 = moe_test::random_vec<T>(static_cast<size_t>(H * M), 7u, 0.7);
    rb1 = moe_test::random_vec<T>(static_cast<size_t>(H), 8u, 0.3);
    rw2 = moe_test::random_vec<T>(static_cast<size_t>(M * H), 9u, 0.7);
    rb2 = moe_test::random_vec<T>(static_cast<size_t>(M), 10u, 0.3);
    coef_w = moe_test::random_vec<T>(static_cast<size_t>(2 * M), 11u, 1.0);
    coef_b = moe_test::random_vec<T>(2, 12u, 0.5);
  }
  loom::moe::LayerWeights<T> weights() const {
    loom::moe::LayerWeights<T> w;
    w.gate_w = gate_w.data();
    w.experts = {w1.data(), b1.data(), w2.data(), b2.data()};
    w.residual = {rw1.data(), rb1.data(), rw2.data(), rb2.data()};
    w.coef_w = coef_w.data();
    w.coef_b = coef_b.data();
    return w;
  }
};

struct Buffers {
  std::vector<char> saved, work;
  Buffers(const LayerConfig& c, size_t elem)
      : saved(loom::moe::saved_bytes(c, elem) + 256),
        work(loom::moe::workspace_bytes(c, elem) + 256) {}
  void* saved_ptr() { return align(saved.data()); }
  void* work_ptr() { return align(work.data()); }
  static void* align(char* p) {
    const auto a = reinterpret_cast<uintptr_t>(p);
    return p + ((256 - a % 256) % 256);
  }
};

template <class T>
struct LayerRun {
  std::vector<T> y;
  std::vector<int32_t> route;
  loom::moe::LayerStats stats;
};

template <class T>
LayerRun<T> forward(const LayerConfig& c, const Params<T>& p, int64_t S, Buffers& b,
                    float* bias = nullptr) {
  Exchange ex(nullptr, nullptr, 1);
  LayerRun<T> r;
  r.y.assign(static_cast<size_t>(S * c.model_dim), T(-5));
  r.route.assign(static_cast<size_t>(S * c.gate.k), -2);
  loom::moe::ForwardCall<T> call;
  call.tokens = S;
  call.x = p.x.data();
  call.w = p.weights();
  call.expert_bias = bias;
  call.y = r.y.data();
  call.route_experts = r.route.data();
  call.saved = b.saved_ptr();
  call.saved_bytes = loom::moe::saved_bytes(c, sizeof(T));
  call.workspace = b.work_ptr();
  call.workspace_bytes = loom::moe::workspace_bytes(c, sizeof(T));
  loom::moe::layer_forward<T>(c, ex, call, r.stats);
  return r;
}

LayerConfig config(int E, int k, bool residual, bool dropless, double f) {
  LayerConfig c;
  c.gate.num_experts = E;
  c.gate.k = k;
  c.gate.training = true;
  c.gate.drop_tokens = !dropless;
  c.gate.capacity_factor = f;
  c.gate.min_capacity = 0;
  c.gate.seed = 42;
  c.gate.step = 3;
  c.model_dim = 4;
  c.hidden_dim = 5;
  c.max_tokens = 9;
  c.local_experts = E;
  c.residual = residual;
  return c;
}

void gradient_check(const LayerConfig& c, int64_t S, double aux_coef) {
  Params<double> p(c, S);
  const int64_t M = c.model_dim;
  const auto G = moe_test::random_vec<double>(static_cast<size_t>(S * M), 77u);
  Buffers b(c, sizeof(double));
  auto loss = [&]() {
    const LayerRun<double> r = forward(c, p, S, b);
    double l = aux_coef * r.stats.aux_loss;
    for (size_t i = 0; i < r.y.size(); ++i) l += r.y[i] * G[i];
    return l;
  };
  const LayerRun<double> base = forward(c, p, S, b);
  if (c.gate.drop_tokens) {
    EXPECT_GT(base.stats.dropped, 0) << "the case should drop choices";
  }
  // backward into gradients that start at 0.5 (ADDED to)
  Params<double> g(c, S);
  for (auto* v : {&g.gate_w, &g.w1, &g.b1, &g.w2, &g.b2, &g.rw1, &g.rb1, &g.rw2, &g.rb2, &g.coef_w,
                  &g.coef_b}) {
    std::fill(v->begin(), v->end(), 0.5);
  }
  std::vector<double> dx(static_cast<size_t>(S * M), 123.0);
  loom::moe::BackwardCall<double> call;
  call.tokens = S;
  call.x = p.x.data();
  call.w = p.weights();
  call.dy = G.data();
  call.dx = dx.data();
  call.g.gate_w = g.gate_w.data();
  call.g.experts = {g.w1.data(), g.b1.data(), g.w2.data(), g.b2.data()};
  call.g.residual = {g.rw1.data(), g.rb1.data(), g.rw2.data(), g.rb2.data()};
  call.g.coef_w = g.coef_w.data();
  call.g.coef_b = g.coef_b.data();
  call.aux_loss_coef = aux_coef;
  call.saved = b.saved_ptr();
  call.saved_bytes = loom::moe::saved_bytes(c, sizeof(double));
  call.workspace = b.work_ptr();
  call.workspace_bytes = loom::moe::workspace_bytes(c, sizeof(double));
  Exchange ex(nullptr, nullptr, 1);
  loom::moe::layer_backward<double>(c, ex, call);

  auto check = [&](std::vector<double>& param, const std::vector<double>& grad, double added,
                   const char* name) {
    for (size_t i = 0; i < param.size(); ++i) {
      const double keep = param[i];
      param[i] = keep + 1e-6;
      const double up = loss();
      param[i] = keep - 1e-6;
      const double down = loss();
      param[i] = keep;
      const double fd = (up - down) / 2e-6;
      EXPECT_NEAR(grad[i] - added, fd, 1e-6 + 1e-5 * std::fabs(fd)) << name << "[" << i << "]";
    }
  };
  check(p.x, dx, 0.0, "x");
  check(p.gate_w, g.gate_w, 0.5, "gate_w");
  check(p.w1, g.w1, 0.5, "w1");
  check(p.b1, g.b1, 0.5, "b1");
  check(p.w2, g.w2, 0.5, "w2");
  check(p.b2, g.b2, 0.5, "b2");
  if (c.residual) {
    check(p.rw1, g.rw1, 0.5, "res_w1");
    check(p.rb1, g.rb1, 0.5, "res_b1");
    check(p.rw2, g.rw2, 0.5, "res_w2");
    check(p.rb2, g.rb2, 0.5, "res_b2");
    check(p.coef_w, g.coef_w, 0.5, "coef_w");
    check(p.coef_b, g.coef_b, 0.5, "coef_b");
  }
}

}  // namespace

// Tolerance: central differences with h = 1e-6 in double, |analytic - numeric| <= 1e-6 +
// 1e-5 |numeric|.
TEST(MoeLayer, GradientTopOneWithCapacityAndAuxLoss) {
  gradient_check(config(4, 1, false, false, 0.75), 9, 0.3);
}

TEST(MoeLayer, GradientTopTwoJitterResidual) {
  LayerConfig c = config(4, 2, true, false, 0.6);
  c.gate.noise = loom::moe::NoisePolicy::Jitter;
  c.gate.jitter_eps = 0.1f;
  gradient_check(c, 9, 0.1);
}

TEST(MoeLayer, GradientTopThreeDroplessSiluResidual) {
  LayerConfig c = config(5, 3, true, true, 1.0);
  c.activation = loom::moe::Activation::Silu;
  gradient_check(c, 8, 0.05);
}

TEST(MoeLayer, FloatMatchesDoubleAndDroppedTokensGetZero) {
  LayerConfig c = config(4, 1, false, false, 0.5);
  c.gate.training = false;
  c.gate.eval_capacity_factor = 0.5;
  const int64_t S = 9;
  Params<double> pd(c, S);
  Params<float> pf(c, S);
  Buffers bd(c, 8), bf(c, 4);
  const LayerRun<double> d = forward(c, pd, S, bd);
  const LayerRun<float> f = forward(c, pf, S, bf);
  EXPECT_EQ(d.route, f.route);
  EXPECT_GT(f.stats.dropped, 0);
  for (size_t i = 0; i < f.y.size(); ++i) EXPECT_NEAR(f.y[i], d.y[i], 1e-5);
  for (int64_t s = 0; s < S; ++s) {
    if (f.route[static_cast<size_t>(s)] >= 0) continue;
    for (int64_t m = 0; m < c.model_dim; ++m)
      EXPECT_EQ(f.y[static_cast<size_t>(s * c.model_dim + m)], 0.0f);
  }
  // eval is deterministic whatever the seed
  c.gate.seed = 777;
  EXPECT_EQ(forward(c, pf, S, bf).y, f.y);
  EXPECT_EQ(f.stats.expert_rows, S - f.stats.dropped);
}

TEST(MoeLayer, BiasUpdateInTrainingOnlyAndFewerTokensThanPlanned) {
  LayerConfig c = config(4, 2, false, true, 1.0);
  c.bias_update_rate = 0.01;
  Params<float> p(c, 9);
  Buffers b(c, 4);
  std::vector<float> bias(4, 0.0f);
  const LayerRun<float> r = forward(c, p, 5, b, bias.data());
  EXPECT_EQ(r.stats.dropped, 0);
  float moved = 0.0f;
  for (float v : bias) moved += std::fabs(v);
  EXPECT_GT(moved, 0.0f);
  for (float v : bias) EXPECT_TRUE(v == 0.0f || std::fabs(std::fabs(v) - 0.01f) < 1e-7f);
  std::vector<float> before = bias;
  c.gate.training = false;
  forward(c, p, 5, b, bias.data());
  EXPECT_EQ(bias, before);
  // more tokens than planned is refused
  EXPECT_THROW(forward(c, p, 10, b, bias.data()), std::invalid_argument);
}

TEST(MoeLayer, NoTokensIsAValidCall) {
  LayerConfig c = config(4, 2, true, false, 1.0);
  Params<float> p(c, 9);
  Buffers b(c, 4);
  const LayerRun<float> r = forward(c, p, 0, b);
  EXPECT_EQ(r.stats.expert_rows, 0);
  EXPECT_EQ(r.stats.dropped, 0);
  EXPECT_EQ(r.stats.aux_loss, 0.0);
  Params<float> g(c, 9);
  loom::moe::BackwardCall<float> call;
  call.tokens = 0;
  call.w = p.weights();
  call.g.gate_w = g.gate_w.data();
  call.g.experts = {g.w1.data(), g.b1.data(), g.w2.data(), g.b2.data()};
  call.g.residual = {g.rw1.data(), g.rb1.data(), g.rw2.data(), g.rb2.data()};
  call.g.coef_w = g.coef_w.data();
  call.g.coef_b = g.coef_b.data();
  call.saved = b.saved_ptr();
  call.saved_bytes = loom::moe::saved_bytes(c, 4);
  call.workspace = b.work_ptr();
  call.workspace_bytes = loom::moe::workspace_bytes(c, 4);
  Exchange ex(nullptr, nullptr, 1);
  const std::vector<float> before = g.w1;
  loom::moe::layer_backward<float>(c, ex, call);
  EXPECT_EQ(g.w1, before);  // nothing to add
  // a backward whose tokens differ from its forward's is refused
  call.tokens = 3;
  std::vector<float> dy(3 * 4), dx(3 * 4);
  call.x = p.x.data();
  call.dy = dy.data();
  call.dx = dx.data();
  EXPECT_THROW(loom::moe::layer_backward<float>(c, ex, call), std::invalid_argument);
}

namespace {

// A backward for `c` over the saved of a forward (of possibly another configuration); the
// exception's message or "".
std::string backward_message(const LayerConfig& c, const Params<float>& p, int64_t S, Buffers& b) {
  Params<float> g(c, 9);
  std::vector<float> dy(static_cast<size_t>(S * c.model_dim), 0.5f), dx(dy.size());
  loom::moe::BackwardCall<float> call;
  call.tokens = S;
  call.x = p.x.data();
  call.w = p.weights();
  call.dy = dy.data();
  call.dx = dx.data();
  call.g.gate_w = g.gate_w.data();
  call.g.experts = {g.w1.data(), g.b1.data(), g.w2.data(), g.b2.data()};
  call.g.residual = {g.rw1.data(), g.rb1.data(), g.rw2.data(), g.rb2.data()};
  call.g.coef_w = g.coef_w.data();
  call.g.coef_b = g.coef_b.data();
  call.saved = b.saved_ptr();
  call.saved_bytes = loom::moe::saved_bytes(c, 4);
  call.workspace = b.work_ptr();
  call.workspace_bytes = loom::moe::workspace_bytes(c, 4);
  Exchange ex(nullptr, nullptr, 1);
  try {
    loom::moe::layer_backward<float>(c, ex, call);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

}  // namespace

// `saved` records the forward's configuration and routing inputs; a backward that differs in
// any of them is refused, naming the field.
TEST(MoeLayer, BackwardRefusesASavedOfAnotherConfiguration) {
  const LayerConfig c = config(4, 2, false, true, 1.0);
  Params<float> p(c, 9);
  Buffers b(c, 4);
  forward(c, p, 6, b);
  EXPECT_EQ(backward_message(c, p, 6, b), "");
  struct Change {
    const char* field;
    void (*apply)(LayerConfig&);
  };
  const Change changes[] = {
      {"k", [](LayerConfig& x) { x.gate.k = 1; }},
      {"step", [](LayerConfig& x) { x.gate.step = 4; }},
      {"seed", [](LayerConfig& x) { x.gate.seed = 43; }},
      {"layer", [](LayerConfig& x) { x.gate.layer = 1; }},
      {"first_token", [](LayerConfig& x) { x.gate.first_token = 2; }},
      {"training", [](LayerConfig& x) { x.gate.training = false; }},
      {"ep_rank", [](LayerConfig& x) { x.ep_rank = 1; }},
  };
  for (const Change& ch : changes) {
    LayerConfig d = c;
    ch.apply(d);
    const std::string m = backward_message(d, p, 6, b);
    EXPECT_NE(m.find(std::string("backward's ") + ch.field + " ("), std::string::npos)
        << ch.field << ": " << m;
  }
}

// A forward refused by its checks (here `saved` too small for the rows the experts receive)
// leaves the balancing bias as it was.
TEST(MoeLayer, ARefusedForwardLeavesTheBias) {
  LayerConfig c = config(4, 2, false, true, 1.0);
  c.bias_update_rate = 0.01;
  Params<float> p(c, 9);
  Buffers b(c, 4);
  std::vector<float> bias(4, 0.0f), y(9 * 4);
  loom::moe::ForwardCall<float> call;
  call.tokens = 6;
  call.x = p.x.data();
  call.w = p.weights();
  call.expert_bias = bias.data();
  call.y = y.data();
  call.saved = b.saved_ptr();
  call.saved_bytes = loom::moe::detail::carve_saved<float>(c, 6, 0, nullptr).bytes;
  call.workspace = b.work_ptr();
  call.workspace_bytes = loom::moe::workspace_bytes(c, 4);
  Exchange ex(nullptr, nullptr, 1);
  loom::moe::LayerStats stats;
  EXPECT_THROW(loom::moe::layer_forward<float>(c, ex, call, stats), std::invalid_argument);
  EXPECT_EQ(bias, std::vector<float>(4, 0.0f));
  call.saved_bytes = loom::moe::saved_bytes(c, 4);  // the plan's: goes through, bias moves
  loom::moe::layer_forward<float>(c, ex, call, stats);
  EXPECT_NE(bias, std::vector<float>(4, 0.0f));
}
