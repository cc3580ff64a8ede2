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
#include <loom/kinds/moe.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <loom/moe/exchange.hpp>
#include <loom/moe/layer.hpp>
#include "comm_helpers.hpp"
#include "layer_layout.hpp"

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

// One forward of the layer (ep from `ex`) on `tokens` tokens, training, with `bias` (may be
// null) and saved sized `saved_bytes` (0 = the plan's); the exception's message or "".
std::string forward_once(Exchange& ex, const Params& p, int64_t max_tokens, int64_t tokens,
                         int64_t first_token, const float* x, int step, float* bias, double rate,
                         uint64_t saved_bytes) {
  loom::moe::LayerConfig cfg;
  cfg.gate.num_experts = kE;
  cfg.gate.k = kK;
  cfg.gate.training = true;
  cfg.gate.drop_tokens = false;
  cfg.gate.seed = 7;
  cfg.gate.step = step;
  cfg.gate.first_token = first_token;
  cfg.model_dim = kM;
  cfg.hidden_dim = kH;
  cfg.max_tokens = max_tokens;
  const int local = kE / ex.ep_size();
  cfg.local_experts = local;
  cfg.ep_size = ex.ep_size();
  cfg.ep_rank = ex.ep_rank();
  cfg.bias_update_rate = rate;
  const std::size_t f = static_cast<std::size_t>(ex.ep_rank() * local);
  loom::moe::LayerWeights<float> w;
  w.gate_w = p.gate_w.data();
  w.experts.w1 = p.w1.data() + f * kH * kM;
  w.experts.b1 = p.b1.data() + f * kH;
  w.experts.w2 = p.w2.data() + f * kM * kH;
  w.experts.b2 = p.b2.data() + f * kM;
  const uint64_t sb = loom::moe::saved_bytes(cfg, 4), wb = loom::moe::workspace_bytes(cfg, 4);
  std::vector<unsigned char> saved(sb + 256), work(wb + 256);
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
  fc.expert_bias = bias;
  fc.saved = aligned(saved);
  fc.saved_bytes = saved_bytes != 0 ? saved_bytes : sb;
  fc.workspace = aligned(work);
  fc.workspace_bytes = wb;
  loom::moe::LayerStats stats;
  try {
    loom::moe::layer_forward(cfg, ex, fc, stats);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

// One rank's saved holds the regions sized by its tokens but not those sized by the rows
// its experts receive (known only after the counts exchange): every rank of the group gets
// the error at once (not the comm's timeout), and the group is still in step afterwards.
TEST(MoeEpLayer, OneShortRankStopsEveryRankPromptly) {
  Comm c("timeout_s = 20.0\n");
  ASSERT_EQ(c.rc, LOOM_OK) << c.error;
  if (c.size == 1) GTEST_SKIP() << "needs 2 or more ranks";
  const int ep = c.size;
  ASSERT_EQ(kE % ep, 0);
  Exchange ex(c.vt, c.obj, ep);
  const Params p = init_params();
  constexpr int64_t kS = 12;
  const Batch b = global_batch(kS * c.size, 1);
  const float* x = b.x.data() + c.rank * kS * kM;
  loom::moe::LayerConfig cfg;
  cfg.gate.num_experts = kE;
  cfg.gate.k = kK;
  cfg.model_dim = kM;
  cfg.hidden_dim = kH;
  cfg.max_tokens = kS;
  cfg.local_experts = kE / ep;
  cfg.ep_size = ep;
  cfg.residual = false;
  // enough for the token-sized regions only
  const uint64_t tight = loom::moe::detail::carve_saved<float>(cfg, kS, 0, nullptr).bytes;
  const auto t0 = std::chrono::steady_clock::now();
  const std::string err =
      forward_once(ex, p, kS, kS, c.rank * kS, x, 1, nullptr, 0.0, c.rank == 0 ? tight : 0);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(secs, 10.0) << "the ranks waited for the comm's timeout";
  EXPECT_EQ(err.find("DEADLINE"), std::string::npos) << err;
  if (c.rank == 0) {
    EXPECT_NE(err.find("saved holds " + std::to_string(tight) + " bytes"), std::string::npos)
        << err;
    EXPECT_NE(err.find("expert-parallel rank 0 of " + std::to_string(ep)), std::string::npos)
        << err;
  } else {
    EXPECT_NE(err.find("expert-parallel rank 0 of " + std::to_string(ep) + " was short by "),
              std::string::npos)
        << err;
  }
  // Still in step: the next call with the plan's buffers goes through on every rank.
  EXPECT_EQ(forward_once(ex, p, kS, kS, c.rank * kS, x, 2, nullptr, 0.0, 0), "");
}

// Aux-loss-free balancing with data-parallel copies (ep 1 over the whole world, a different
// batch per rank): the load is summed over every rank, so every copy's bias stays the same.
TEST(MoeEpLayer, TheBalancingBiasIsTheSameOnEveryRank) {
  Comm c("timeout_s = 20.0\n");
  ASSERT_EQ(c.rc, LOOM_OK) << c.error;
  const std::vector<int64_t> s = split(c.size);
  int64_t n = 0, first = 0, most = 0;
  for (int r = 0; r < c.size; ++r) {
    if (r < c.rank) first += s[static_cast<std::size_t>(r)];
    n += s[static_cast<std::size_t>(r)];
    most = std::max(most, s[static_cast<std::size_t>(r)]);
  }
  const int64_t mine = s[static_cast<std::size_t>(c.rank)];
  for (int ep : {1, 2}) {
    if (c.size % ep != 0) continue;
    SCOPED_TRACE("ep " + std::to_string(ep));
    Exchange ex(c.vt, c.obj, ep);
    const Params p = init_params();
    std::vector<float> bias(kE, 0.0f);
    for (int step = 1; step <= 3; ++step) {
      const Batch b = global_batch(n, step);
      ASSERT_EQ(forward_once(ex, p, most, mine, first, b.x.data() + first * kM, step, bias.data(),
                             0.25, 0),
                "");
    }
    float moved = 0.0f;
    for (float v : bias) moved = std::max(moved, std::fabs(v));
    EXPECT_GT(moved, 0.0f) << "the bias never moved";
    Buf hi(Dt::kF32, kE), lo(Dt::kF32, kE);
    for (std::size_t e = 0; e < kE; ++e) {
      hi.set(e, bias[e]);
      lo.set(e, bias[e]);
    }
    ASSERT_EQ(c.allreduce(LOOM_REDUCE_MAX, nullptr, &hi.t).code, LOOM_OK);
    ASSERT_EQ(c.allreduce(LOOM_REDUCE_MIN, nullptr, &lo.t).code, LOOM_OK);
    for (std::size_t e = 0; e < kE; ++e) {
      EXPECT_EQ(hi.get(e), bias[e]) << "expert " << e << " on rank " << c.rank;
      EXPECT_EQ(lo.get(e), bias[e]) << "expert " << e << " on rank " << c.rank;
    }
  }
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

// The same loop through the `moe` plugin as the trainer drives it: a manifest with a ucx
// world and [moe.m] with ep_size and comm, the plugin's plan, forward, backward and
// reduce_gradients over loom.moe/1.
struct PluginLayer {
  loom_session* s = nullptr;
  loom_instance* inst = nullptr;
  void* obj = nullptr;
  const loom_moe_v1* t = nullptr;
  CommView world;
  std::string error;
  PluginLayer(int ep) {
    const std::string toml =
        "[comm.world]\nplugin = \"ucx\"\ntimeout_s = 20.0\n\n[moe.m]\nplugin = \"moe\"\n"
        "num_experts = " +
        std::to_string(kE) + "\nk = " + std::to_string(kK) +
        "\ndrop_tokens = false\ncomm = \"world\"\nep_size = " + std::to_string(ep) + "\n";
    if (loom_open_string(toml.c_str(), "moe_ep.toml", nullptr, &s) != LOOM_OK) {
      error = loom_last_error();
      s = nullptr;
      return;
    }
    loom_instance* w = nullptr;
    const void* table = nullptr;
    if (loom_find_instance(s, "comm", "world", &w) != LOOM_OK ||
        loom_find_instance(s, LOOM_KIND_MOE, "m", &inst) != LOOM_OK ||
        loom_instance_table(inst, LOOM_KIND_MOE, LOOM_MOE_V1_MIN_SIZE, &obj, &table) != LOOM_OK) {
      error = loom_last_error();
      return;
    }
    world = CommView(w);
    t = static_cast<const loom_moe_v1*>(table);
  }
  ~PluginLayer() { loom_close(s); }
  PluginLayer(const PluginLayer&) = delete;
  PluginLayer& operator=(const PluginLayer&) = delete;
  // "" when ok, else the status's message
  std::string take(loom_status* st) {
    if (st == nullptr) return "";
    std::array<char, 2048> msg{};
    loom_instance_take_status(inst, st, msg.data(), msg.size());
    return std::string("error: ") + msg.data();
  }
};

struct T1 {  // a contiguous float32 view
  std::vector<int64_t> shape;
  DLTensor t{};
  T1(float* data, std::vector<int64_t> dims) : shape(std::move(dims)) {
    t = DLTensor{data,
                 {kDLCPU, 0},
                 static_cast<int32_t>(shape.size()),
                 {kDLFloat, 32, 1},
                 shape.data(),
                 nullptr,
                 0};
  }
};

TEST(MoeEpLayer, ThePluginWithEpSizeAndCommMatchesOneRank) {
  const Comm probe("timeout_s = 20.0\n");
  ASSERT_EQ(probe.rc, LOOM_OK) << probe.error;
  const int W = probe.size, me = probe.rank;
  const Params ref = one_rank(W);
  const std::vector<int64_t> s = split(W);
  int64_t n = 0, first = 0, most = 0;
  for (int r = 0; r < W; ++r) {
    if (r < me) first += s[static_cast<std::size_t>(r)];
    n += s[static_cast<std::size_t>(r)];
    most = std::max(most, s[static_cast<std::size_t>(r)]);
  }
  const int64_t mine = s[static_cast<std::size_t>(me)];
  for (int ep : {1, 2, 4}) {
    if (W % ep != 0) continue;
    SCOPED_TRACE("plugin, ep " + std::to_string(ep) + " of " + std::to_string(W) + " ranks");
    PluginLayer L(ep);
    ASSERT_NE(L.t, nullptr) << L.error;
    loom_moe_plan_args pa{};
    pa.struct_size = LOOM_MOE_PLAN_ARGS_SIZE;
    pa.tokens = most;
    pa.model_dim = kM;
    pa.hidden_dim = kH;
    pa.num_layers = 1;
    pa.training = 1;
    pa.dtype = DLDataType{kDLFloat, 32, 1};
    ASSERT_EQ(L.take(L.t->plan(L.obj, &pa)), "");
    ASSERT_EQ(pa.ep_size, ep);
    ASSERT_EQ(pa.ep_rank, me % ep);
    ASSERT_EQ(pa.local_experts, kE / ep);
    ASSERT_EQ(pa.flags & LOOM_MOE_EXPERT_PARALLEL, ep > 1 ? LOOM_MOE_EXPERT_PARALLEL : 0u);
    const int64_t El = pa.local_experts;
    const auto f = static_cast<std::size_t>(pa.ep_rank * El);
    std::vector<unsigned char> saved(pa.saved_bytes + 256), work(pa.workspace_bytes + 256);
    auto aligned = [](std::vector<unsigned char>& v) {
      auto a = reinterpret_cast<uintptr_t>(v.data());
      return reinterpret_cast<void*>((a + 255) / 256 * 256);
    };
    Params p = init_params();
    for (int step = 1; step <= kSteps; ++step) {
      const Batch b = global_batch(n, step);
      std::vector<float> x(b.x.begin() + first * kM, b.x.begin() + (first + mine) * kM);
      std::vector<float> y(x.size()), dy(x.size()), dx(x.size());
      T1 tx(x.data(), {mine, kM}), ty(y.data(), {mine, kM}), tdy(dy.data(), {mine, kM}),
          tdx(dx.data(), {mine, kM});
      T1 gw(p.gate_w.data(), {kE, kM}), w1(p.w1.data() + f * kH * kM, {El, kH, kM}),
          b1(p.b1.data() + f * kH, {El, kH}), w2(p.w2.data() + f * kM * kH, {El, kM, kH}),
          b2(p.b2.data() + f * kM, {El, kM});
      loom_moe_weights w{};
      w.struct_size = LOOM_MOE_WEIGHTS_SIZE;
      w.gate_w = &gw.t;
      w.w1 = &w1.t;
      w.b1 = &b1.t;
      w.w2 = &w2.t;
      w.b2 = &b2.t;
      loom_moe_forward_args fa{};
      fa.struct_size = LOOM_MOE_FORWARD_ARGS_SIZE;
      fa.seed = 7;
      fa.step = step;
      fa.tokens = mine;
      fa.first_token = first;
      fa.model_dim = kM;
      fa.hidden_dim = kH;
      fa.num_layers = 1;
      fa.training = 1;
      fa.x = &tx.t;
      fa.weights = &w;
      fa.y = &ty.t;
      fa.saved = aligned(saved);
      fa.saved_bytes = pa.saved_bytes;
      fa.workspace = aligned(work);
      fa.workspace_bytes = pa.workspace_bytes;
      ASSERT_EQ(L.take(L.t->forward(L.obj, &fa)), "");
      for (std::size_t i = 0; i < y.size(); ++i) {
        dy[i] = (y[i] - b.target[static_cast<std::size_t>(first * kM) + i]) *
                static_cast<float>(W) / static_cast<float>(n);
      }
      Grads g;
      g.gate_w.assign(p.gate_w.size(), 0.0f);
      g.w1.assign(static_cast<std::size_t>(El * kH * kM), 0.0f);
      g.b1.assign(static_cast<std::size_t>(El * kH), 0.0f);
      g.w2.assign(static_cast<std::size_t>(El * kM * kH), 0.0f);
      g.b2.assign(static_cast<std::size_t>(El * kM), 0.0f);
      T1 ggw(g.gate_w.data(), {kE, kM}), gw1(g.w1.data(), {El, kH, kM}), gb1(g.b1.data(), {El, kH}),
          gw2(g.w2.data(), {El, kM, kH}), gb2(g.b2.data(), {El, kM});
      loom_moe_weights gr = w;
      gr.gate_w = &ggw.t;
      gr.w1 = &gw1.t;
      gr.b1 = &gb1.t;
      gr.w2 = &gw2.t;
      gr.b2 = &gb2.t;
      loom_moe_backward_args ba{};
      ba.struct_size = LOOM_MOE_BACKWARD_ARGS_SIZE;
      ba.seed = 7;
      ba.step = step;
      ba.tokens = mine;
      ba.first_token = first;
      ba.model_dim = kM;
      ba.hidden_dim = kH;
      ba.num_layers = 1;
      ba.training = 1;
      ba.aux_loss_coef = 0.0;
      ba.x = &tx.t;
      ba.weights = &w;
      ba.dy = &tdy.t;
      ba.dx = &tdx.t;
      ba.grads = &gr;
      ba.saved = fa.saved;
      ba.saved_bytes = fa.saved_bytes;
      ba.workspace = fa.workspace;
      ba.workspace_bytes = fa.workspace_bytes;
      ASSERT_EQ(L.take(L.t->backward(L.obj, &ba)), "");
      const Result r = L.world.allreduce(LOOM_REDUCE_SUM, nullptr, &ggw.t);
      ASSERT_EQ(r.code, LOOM_OK) << r.text;
      for (float& v : g.gate_w) v /= static_cast<float>(W);
      DLTensor* ts[] = {&gw1.t, &gb1.t, &gw2.t, &gb2.t};
      loom_moe_reduce_args ra{};
      ra.struct_size = LOOM_MOE_REDUCE_ARGS_SIZE;
      ra.tensors = ts;
      ra.count = 4;
      ASSERT_EQ(L.take(L.t->reduce_gradients(L.obj, &ra)), "");
      sgd(p.gate_w, g.gate_w, 0);
      sgd(p.w1, g.w1, f * kH * kM);
      sgd(p.b1, g.b1, f * kH);
      sgd(p.w2, g.w2, f * kM * kH);
      sgd(p.b2, g.b2, f * kM);
    }
    const auto Ls = static_cast<std::size_t>(El);
    expect_close(p.gate_w, ref.gate_w, 0, ref.gate_w.size(), "gate_w");
    expect_close(p.w1, ref.w1, f * kH * kM, Ls * kH * kM, "w1");
    expect_close(p.b1, ref.b1, f * kH, Ls * kH, "b1");
    expect_close(p.w2, ref.w2, f * kM * kH, Ls * kM * kH, "w2");
    expect_close(p.b2, ref.b2, f * kM, Ls * kM, "b2");
  }
}

}  // namespace
