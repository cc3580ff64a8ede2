// The whole MoE layer (plugins/moe/core/layer.cpp) with expert parallelism over the ucx
// transport against the same layer on one rank: a tiny SGD loop over a global batch split
// unequally over the world's ranks (one rank gets a single token), the gate averaged over the
// world as a data-parallel trainer does and the experts by reduce_gradients. After the steps,
// every parameter this rank holds must equal the one-rank run's within the tolerance below.
//
// Loss: (1 / N) * sum over the N global tokens of 0.5 * |y_t - target_t|^2, so each rank's dy
// is (y - target) * W / N (its share of the world's mean). Dropless routing (capacity would
// depend on each rank's token count, which is not what is compared) and no aux loss (it is a
// function of each rank's own batch); top-2 over 8 experts.
#include <loom/embed.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "comm_helpers.hpp"
#include "exchange.hpp"
#include "layer.hpp"

namespace {

using loom::moe::Exchange;
using namespace loom_test;  // NOLINT(google-build-using-namespace)

constexpr int kE = 8, kK = 2, kSteps = 4;
constexpr int64_t kM = 6, kH = 10;
constexpr float kLr = 0.5f;
// |ep - one rank| <= kTol * (1 + |one rank|): the runs differ only in the order of the sums
// that cross ranks (the world's gradient average, the experts' over the groups).
constexpr float kTol = 2e-5f;

struct Params {  // global (all experts)
  std::vector<float> gate_w, w1, b1, w2, b2;
};

Params init_params() {
  std::mt19937 rng(42);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  Params p;
  auto fill = [&](std::vector<float>& v, std::size_t n, float s) {
    v.resize(n);
    for (float& x : v) x = s * nd(rng);
  };
  fill(p.gate_w, kE * kM, 0.5f);
  fill(p.w1, kE * kH * kM, 0.4f);
  fill(p.b1, kE * kH, 0.1f);
  fill(p.w2, kE * kM * kH, 0.3f);
  fill(p.b2, kE * kM, 0.1f);
  return p;
}

// Tokens of each world rank: unequal, one rank with a single token.
std::vector<int64_t> split(int world) {
  std::vector<int64_t> s;
  for (int r = 0; r < world; ++r) s.push_back(r == 1 ? 1 : 7 + 5 * r);
  return s;
}

struct Batch {
  std::vector<float> x, target;
};
Batch global_batch(int64_t n, int step) {
  std::mt19937 rng(1000 + step);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  Batch b;
  b.x.resize(static_cast<std::size_t>(n * kM));
  b.target.resize(static_cast<std::size_t>(n * kM));
  for (float& v : b.x) v = nd(rng);
  for (float& v : b.target) v = 0.5f * nd(rng);
  return b;
}

// One layer holding experts [first, first + local) of the global parameters, run on `tokens`
// tokens from `first_token` on; returns the gradients (gate [E, M], experts local) of
// loss_scale * sum of 0.5 |y - target|^2.
struct Grads {
  std::vector<float> gate_w, w1, b1, w2, b2;
};
Grads step_grads(Exchange& ex, const Params& p, int local, int64_t max_tokens, int64_t tokens,
                 int64_t first_token, const float* x, const float* target, float loss_scale,
                 int step) {
  loom::moe::LayerConfig cfg;
  cfg.gate.num_experts = kE;
  cfg.gate.k = kK;
  cfg.gate.training = true;
  cfg.gate.drop_tokens = false;
  cfg.gate.seed = 7;
  cfg.gate.step = step;
  cfg.gate.first_token = first_token;
  cfg.activation = loom::moe::Activation::Gelu;
  cfg.model_dim = kM;
  cfg.hidden_dim = kH;
  cfg.max_tokens = max_tokens;
  cfg.local_experts = local;
  cfg.ep_size = ex.ep_size();
  cfg.ep_rank = ex.ep_rank();
  const std::size_t f = static_cast<std::size_t>(ex.ep_rank() * local);
  const std::size_t L = static_cast<std::size_t>(local);
  loom::moe::LayerWeights<float> w;
  w.gate_w = p.gate_w.data();
  w.experts.w1 = p.w1.data() + f * kH * kM;
  w.experts.b1 = p.b1.data() + f * kH;
  w.experts.w2 = p.w2.data() + f * kM * kH;
  w.experts.b2 = p.b2.data() + f * kM;
  std::vector<unsigned char> saved(loom::moe::saved_bytes(cfg, 4) + 256);
  std::vector<unsigned char> work(loom::moe::workspace_bytes(cfg, 4) + 256);
  auto aligned = [](std::vector<unsigned char>& v) {
    auto a = reinterpret_cast<uintptr_t>(v.data());
    return reinterpret_cast<void*>((a + 255) / 256 * 256);
  };
  std::vector<float> y(static_cast<std::size_t>(std::max<int64_t>(1, tokens) * kM));
  loom::moe::ForwardCall<float> fc;
  fc.tokens = tokens;
  fc.x = x;
  fc.w = w;
  fc.y = y.data();
  fc.saved = aligned(saved);
  fc.saved_bytes = loom::moe::saved_bytes(cfg, 4);
  fc.workspace = aligned(work);
  fc.workspace_bytes = loom::moe::workspace_bytes(cfg, 4);
  loom::moe::LayerStats stats;
  loom::moe::layer_forward(cfg, ex, fc, stats);
  std::vector<float> dy(y.size(), 0.0f);
  for (int64_t i = 0; i < tokens * kM; ++i) {
    dy[static_cast<std::size_t>(i)] = (y[static_cast<std::size_t>(i)] - target[i]) * loss_scale;
  }
  std::vector<float> dx(y.size());
  Grads g;
  g.gate_w.assign(p.gate_w.size(), 0.0f);
  g.w1.assign(L * kH * kM, 0.0f);
  g.b1.assign(L * kH, 0.0f);
  g.w2.assign(L * kM * kH, 0.0f);
  g.b2.assign(L * kM, 0.0f);
  loom::moe::BackwardCall<float> bc;
  bc.tokens = tokens;
  bc.x = x;
  bc.w = w;
  bc.dy = dy.data();
  bc.dx = dx.data();
  bc.g.gate_w = g.gate_w.data();
  bc.g.experts = {g.w1.data(), g.b1.data(), g.w2.data(), g.b2.data()};
  bc.aux_loss_coef = 0.0;
  bc.saved = fc.saved;
  bc.saved_bytes = fc.saved_bytes;
  bc.workspace = fc.workspace;
  bc.workspace_bytes = fc.workspace_bytes;
  loom::moe::layer_backward(cfg, ex, bc);
  return g;
}

void sgd(std::vector<float>& p, const std::vector<float>& g, std::size_t offset) {
  for (std::size_t i = 0; i < g.size(); ++i) p[offset + i] -= kLr * g[i];
}

// The reference: one rank, every expert, the whole global batch.
Params one_rank(int world) {
  Params p = init_params();
  Exchange ex(nullptr, nullptr, 1);
  const std::vector<int64_t> s = split(world);
  int64_t n = 0;
  for (int64_t v : s) n += v;
  for (int step = 1; step <= kSteps; ++step) {
    const Batch b = global_batch(n, step);
    const Grads g = step_grads(ex, p, kE, n, n, 0, b.x.data(), b.target.data(),
                               1.0f / static_cast<float>(n), step);
    sgd(p.gate_w, g.gate_w, 0);
    sgd(p.w1, g.w1, 0);
    sgd(p.b1, g.b1, 0);
    sgd(p.w2, g.w2, 0);
    sgd(p.b2, g.b2, 0);
  }
  return p;
}

void expect_close(const std::vector<float>& got, const std::vector<float>& want, std::size_t offset,
                  std::size_t n, const char* what) {
  std::size_t bad = 0;
  float worst = 0.0f;
  for (std::size_t i = 0; i < n; ++i) {
    const float d = std::fabs(got[offset + i] - want[offset + i]);
    worst = std::max(worst, d);
    bad += d > kTol * (1.0f + std::fabs(want[offset + i])) ? 1 : 0;
  }
  EXPECT_EQ(bad, 0U) << what << ": " << bad << " of " << n << " differ, worst by " << worst;
}

TEST(MoeEpLayer, ExpertParallelTrainingMatchesOneRank) {
  Comm c("timeout_s = 20.0\n");
  ASSERT_EQ(c.rc, LOOM_OK) << c.error;
  const Params ref = one_rank(c.size);
  const std::vector<int64_t> s = split(c.size);
  int64_t n = 0, first = 0, most = 0;
  for (int r = 0; r < c.size; ++r) {
    if (r < c.rank) first += s[static_cast<std::size_t>(r)];
    n += s[static_cast<std::size_t>(r)];
    most = std::max(most, s[static_cast<std::size_t>(r)]);
  }
  const int64_t mine = s[static_cast<std::size_t>(c.rank)];
  for (int ep : {1, 2, 4}) {
    if (c.size % ep != 0 || kE % ep != 0) continue;
    SCOPED_TRACE("ep " + std::to_string(ep) + " of " + std::to_string(c.size) + " ranks");
    Exchange ex(c.vt, c.obj, ep);
    const int local = kE / ep;
    Params p = init_params();
    const std::size_t f = static_cast<std::size_t>(ex.ep_rank() * local);
    for (int step = 1; step <= kSteps; ++step) {
      const Batch b = global_batch(n, step);
      Grads g = step_grads(ex, p, local, most, mine, first, b.x.data() + first * kM,
                           b.target.data() + first * kM,
                           static_cast<float>(c.size) / static_cast<float>(n), step);
      // The gate: the trainer's world average. The experts: reduce_gradients.
      Buf gate(Dt::kF32, g.gate_w.size());
      for (std::size_t i = 0; i < g.gate_w.size(); ++i) gate.set(i, g.gate_w[i]);
      const Result r = c.allreduce(LOOM_REDUCE_SUM, nullptr, &gate.t);
      ASSERT_EQ(r.code, LOOM_OK) << r.text;
      for (std::size_t i = 0; i < g.gate_w.size(); ++i) {
        g.gate_w[i] = gate.get(i) / static_cast<float>(c.size);
      }
      std::vector<int64_t> shapes = {
          static_cast<int64_t>(g.w1.size()), static_cast<int64_t>(g.b1.size()),
          static_cast<int64_t>(g.w2.size()), static_cast<int64_t>(g.b2.size())};
      std::vector<float>* bufs[] = {&g.w1, &g.b1, &g.w2, &g.b2};
      DLTensor ts[4];
      DLTensor* tp[4];
      for (int i = 0; i < 4; ++i) {
        ts[i] =
            DLTensor{bufs[i]->data(), {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, &shapes[i], nullptr, 0};
        tp[i] = &ts[i];
      }
      ex.reduce_gradients(tp, 4, nullptr);
      sgd(p.gate_w, g.gate_w, 0);
      sgd(p.w1, g.w1, f * kH * kM);
      sgd(p.b1, g.b1, f * kH);
      sgd(p.w2, g.w2, f * kM * kH);
      sgd(p.b2, g.b2, f * kM);
    }
    const std::size_t L = static_cast<std::size_t>(local);
    expect_close(p.gate_w, ref.gate_w, 0, ref.gate_w.size(), "gate_w");
    expect_close(p.w1, ref.w1, f * kH * kM, L * kH * kM, "w1");
    expect_close(p.b1, ref.b1, f * kH, L * kH, "b1");
    expect_close(p.w2, ref.w2, f * kM * kH, L * kM * kH, "w2");
    expect_close(p.b2, ref.b2, f * kM, L * kM, "b2");
    // The run moved the parameters (so the comparison means something).
    const Params p0 = init_params();
    float moved = 0.0f;
    for (std::size_t i = 0; i < L * kH * kM; ++i) {
      moved = std::max(moved, std::fabs(p.w1[f * kH * kM + i] - p0.w1[f * kH * kM + i]));
    }
    EXPECT_GT(moved, 1e-3f);
  }
}

}  // namespace
