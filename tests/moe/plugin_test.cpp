// The moe plugin through the host: plan (flags, capacity, sizes), the refused configurations
// with messages naming the values, forward/backward equal to the core's layer called directly,
// and dispatch/combine alone.
#include <gtest/gtest.h>
#include <loom/embed.h>
#include <loom/kinds/moe.h>

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <loom/moe/layer.hpp>
#include "reference.hpp"

namespace {

constexpr DLDataType kF32{kDLFloat, 32, 1};
constexpr DLDataType kI32{kDLInt, 32, 1};

struct Session {
  loom_session* s = nullptr;
  std::string error;
  explicit Session(const std::string& params) {
    const std::string toml = "[moe.m]\nplugin = \"moe\"\n" + params + "\n";
    loom_open_options o{};
    o.struct_size = LOOM_OPEN_OPTIONS_SIZE;
    o.log_level = -1;
    if (loom_open_string(toml.c_str(), "test.toml", &o, &s) != 0) error = loom_last_error();
  }
  ~Session() { loom_close(s); }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
};

struct View {
  DLTensor t{};
  int64_t shape[3] = {0, 0, 0};
  View(void* data, std::vector<int64_t> dims, DLDataType dtype) {
    for (size_t i = 0; i < dims.size(); ++i) shape[i] = dims[i];
    t.data = data;
    t.device = DLDevice{kDLCPU, 0};
    t.ndim = static_cast<int32_t>(dims.size());
    t.dtype = dtype;
    t.shape = shape;
  }
  DLTensor* get() { return &t; }
};

struct Aligned {
  std::vector<unsigned char> bytes;
  void* p = nullptr;
  explicit Aligned(size_t n) : bytes(n + 256) {
    auto a = reinterpret_cast<uintptr_t>(bytes.data());
    p = reinterpret_cast<void*>((a + 255) / 256 * 256);
  }
};

struct Moe {
  loom_instance* inst = nullptr;
  void* obj = nullptr;
  const loom_moe_v1* t = nullptr;
  std::string error;
  explicit Moe(Session& s) {
    if (loom_find_instance(s.s, LOOM_KIND_MOE, "m", &inst) != 0) {
      ADD_FAILURE() << "find: " << loom_last_error();
      return;
    }
    const void* table = nullptr;
    if (loom_instance_table(inst, LOOM_KIND_MOE, LOOM_MOE_V1_MIN_SIZE, &obj, &table) != 0) {
      ADD_FAILURE() << "table: " << loom_last_error();
    }
    t = static_cast<const loom_moe_v1*>(table);
  }
  int32_t take(loom_status* st) {
    std::array<char, 2048> msg{};
    const int32_t rc = loom_instance_take_status(inst, st, msg.data(), msg.size());
    error = msg.data();
    return rc;
  }
};

loom_moe_plan_args plan_args(int64_t tokens, int64_t M, int64_t H, int32_t experts = 0,
                             DLDataType dtype = kF32) {
  loom_moe_plan_args a{};
  a.struct_size = LOOM_MOE_PLAN_ARGS_SIZE;
  a.tokens = tokens;
  a.model_dim = M;
  a.hidden_dim = H;
  a.num_experts = experts;
  a.layer = 0;
  a.num_layers = 2;
  a.training = 1;
  a.dtype = dtype;
  return a;
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

TEST(MoePlugin, PlanResolvesTheLayout) {
  Session s(
      "num_experts = 4\nk = 2\ncapacity_factor = 1.25\nmin_capacity = 1\nuse_residual = true");
  ASSERT_TRUE(s.error.empty()) << s.error;
  Moe m(s);
  loom_moe_plan_args a = plan_args(10, 8, 16);
  ASSERT_EQ(m.take(m.t->plan(m.obj, &a)), 0) << m.error;
  EXPECT_EQ(a.experts, 4);
  EXPECT_EQ(a.local_experts, 4);
  EXPECT_EQ(a.ep_size, 1);
  EXPECT_EQ(a.top_k, 2);
  EXPECT_EQ(a.capacity, 7);          // ceil(2 * 1.25 * 10 / 4)
  EXPECT_EQ(a.max_expert_rows, 20);  // min(S * k, E * C)
  EXPECT_EQ(a.flags, LOOM_MOE_RESIDUAL);
  EXPECT_EQ(a.activation, LOOM_MOE_GELU);
  EXPECT_GT(a.saved_bytes, 0u);
  // a pyramid layer plans with its own count
  a = plan_args(10, 8, 16, 8);
  ASSERT_EQ(m.take(m.t->plan(m.obj, &a)), 0) << m.error;
  EXPECT_EQ(a.experts, 8);
  EXPECT_EQ(a.capacity, 4);  // ceil(2 * 1.25 * 10 / 8)
  Session d("drop_tokens = false\nbias_update_rate = 0.001\nk = 3\nactivation = \"silu\"");
  ASSERT_TRUE(d.error.empty()) << d.error;
  Moe md(d);
  a = plan_args(10, 8, 16);
  ASSERT_EQ(md.take(md.t->plan(md.obj, &a)), 0) << md.error;
  EXPECT_EQ(a.flags, LOOM_MOE_DROPLESS | LOOM_MOE_EXPERT_BIAS);
  EXPECT_EQ(a.capacity, 0);
  EXPECT_EQ(a.max_expert_rows, 30);
  EXPECT_EQ(a.activation, LOOM_MOE_SILU);
}

TEST(MoePlugin, BadConfigurationsAreRefusedNamingTheValues) {
  {
    Session s("num_experts = 2\nk = 3");
    EXPECT_TRUE(has(s.error, "k = 3") && has(s.error, "num_experts = 2")) << s.error;
  }
  {
    Session s("num_experts = 8\nep_size = 3");
    EXPECT_TRUE(has(s.error, "num_experts = 8") && has(s.error, "ep_size = 3")) << s.error;
  }
  {
    Session s("capacity_factor = 0.0");
    EXPECT_TRUE(has(s.error, "capacity_factor")) << s.error;
  }
  {
    Session s("drop_policy = \"random\"");
    EXPECT_TRUE(has(s.error, "probs") && has(s.error, "position")) << s.error;
  }
  {
    Session s("noisy_gate_policy = \"gaussian\"");
    EXPECT_TRUE(has(s.error, "Jitter") && has(s.error, "RSample")) << s.error;
  }
  {
    Session s("ep_size = 2\nnum_experts = 4");
    EXPECT_TRUE(has(s.error, "comm")) << s.error;
  }
  // counts beyond the schema's maxima (they are narrowed to int), and at plan
  for (const char* bad :
       {"num_experts = 70000", "k = 70000", "ep_size = 70000", "num_experts = 4294967304"}) {
    Session s(bad);
    EXPECT_TRUE(has(s.error, bad) || has(s.error, "65536")) << bad << ": " << s.error;
    EXPECT_FALSE(s.error.empty()) << bad;
  }
  {
    Session s("num_experts = 8");
    ASSERT_TRUE(s.error.empty()) << s.error;
    Moe m(s);
    loom_moe_plan_args a = plan_args(10, 8, 16, -3);
    EXPECT_EQ(m.take(m.t->plan(m.obj, &a)), LOOM_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(has(m.error, "-3")) << m.error;
  }
  // at plan: a layer planned with fewer experts than k, and another dtype
  Session s("k = 3");
  ASSERT_TRUE(s.error.empty()) << s.error;
  Moe m(s);
  loom_moe_plan_args a = plan_args(10, 8, 16, 2);
  EXPECT_EQ(m.take(m.t->plan(m.obj, &a)), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(has(m.error, "k = 3") && has(m.error, "num_experts = 2")) << m.error;
  a = plan_args(INT64_MAX / 2, 1 << 20, 16);
  EXPECT_EQ(m.take(m.t->plan(m.obj, &a)), LOOM_ERR_OUT_OF_RANGE);
  EXPECT_TRUE(has(m.error, "do not fit")) << m.error;
  a = plan_args(10, 8, 16, 0, DLDataType{kDLFloat, 64, 1});
  EXPECT_EQ(m.take(m.t->plan(m.obj, &a)), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(has(m.error, "float64")) << m.error;
}

TEST(MoePlugin, ForwardBackwardMatchTheCoreAndDispatchCombineAlone) {
  Session s(
      "num_experts = 4\nk = 2\ncapacity_factor = 0.75\nmin_capacity = 0\n"
      "use_residual = true\nnoisy_gate_policy = \"Jitter\"");
  ASSERT_TRUE(s.error.empty()) << s.error;
  Moe m(s);
  const int64_t S = 12, M = 6, H = 5, E = 4, k = 2;
  loom_moe_plan_args p = plan_args(S, M, H);
  ASSERT_EQ(m.take(m.t->plan(m.obj, &p)), 0) << m.error;
  auto x = moe_test::random_vec<float>(S * M, 1u);
  auto gate_w = moe_test::random_vec<float>(E * M, 2u, 1.5);
  auto w1 = moe_test::random_vec<float>(E * H * M, 3u, 0.5);
  auto b1 = moe_test::random_vec<float>(E * H, 4u, 0.3);
  auto w2 = moe_test::random_vec<float>(E * M * H, 5u, 0.5);
  auto b2 = moe_test::random_vec<float>(E * M, 6u, 0.3);
  auto rw1 = moe_test::random_vec<float>(H * M, 7u, 0.5);
  auto rb1 = moe_test::random_vec<float>(H, 8u, 0.3);
  auto rw2 = moe_test::random_vec<float>(M * H, 9u, 0.5);
  auto rb2 = moe_test::random_vec<float>(M, 10u, 0.3);
  auto cw = moe_test::random_vec<float>(2 * M, 11u, 1.0);
  auto cb = moe_test::random_vec<float>(2, 12u, 0.5);
  View vx(x.data(), {S, M}, kF32), vg(gate_w.data(), {E, M}, kF32), vw1(w1.data(), {E, H, M}, kF32),
      vb1(b1.data(), {E, H}, kF32), vw2(w2.data(), {E, M, H}, kF32), vb2(b2.data(), {E, M}, kF32),
      vrw1(rw1.data(), {H, M}, kF32), vrb1(rb1.data(), {H}, kF32), vrw2(rw2.data(), {M, H}, kF32),
      vrb2(rb2.data(), {M}, kF32), vcw(cw.data(), {2, M}, kF32), vcb(cb.data(), {2}, kF32);
  loom_moe_weights w{LOOM_MOE_WEIGHTS_SIZE,
                     0,
                     vg.get(),
                     vw1.get(),
                     vb1.get(),
                     vw2.get(),
                     vb2.get(),
                     vrw1.get(),
                     vrb1.get(),
                     vrw2.get(),
                     vrb2.get(),
                     vcw.get(),
                     vcb.get()};
  std::vector<float> y(S * M), rw(S * k);
  std::vector<int32_t> re(S * k);
  std::vector<int64_t> load(E);
  View vy(y.data(), {S, M}, kF32), vre(re.data(), {S, k}, kI32), vrw(rw.data(), {S, k}, kF32);
  Aligned saved(p.saved_bytes), ws(p.workspace_bytes);
  loom_moe_stats stats{LOOM_MOE_STATS_SIZE, 0, 0.0, 0, 0, load.data(), E};
  loom_moe_forward_args f{};
  f.struct_size = LOOM_MOE_FORWARD_ARGS_SIZE;
  f.seed = 5;
  f.step = 2;
  f.tokens = S;
  f.first_token = 24;
  f.model_dim = M;
  f.hidden_dim = H;
  f.layer = 0;
  f.num_layers = 2;
  f.training = 1;
  f.x = vx.get();
  f.weights = &w;
  f.y = vy.get();
  f.route_experts = vre.get();
  f.route_weights = vrw.get();
  f.stats = &stats;
  f.saved = saved.p;
  f.saved_bytes = p.saved_bytes;
  f.workspace = ws.p;
  f.workspace_bytes = p.workspace_bytes;
  ASSERT_EQ(m.take(m.t->forward(m.obj, &f)), 0) << m.error;
  EXPECT_GT(stats.dropped, 0);
  int64_t total = 0;
  for (int64_t v : load) total += v;
  EXPECT_EQ(total, S * k);
  EXPECT_EQ(stats.expert_rows, S * k - stats.dropped);

  // the core, directly, with the same configuration
  loom::moe::LayerConfig c;
  c.gate.num_experts = E;
  c.gate.k = k;
  c.gate.training = true;
  c.gate.capacity_factor = 0.75;
  c.gate.min_capacity = 0;
  c.gate.noise = loom::moe::NoisePolicy::Jitter;
  c.gate.seed = 5;
  c.gate.step = 2;
  c.gate.first_token = 24;
  c.model_dim = M;
  c.hidden_dim = H;
  c.max_tokens = S;
  c.local_experts = E;
  c.residual = true;
  loom::moe::Exchange ex(nullptr, nullptr, 1);
  Aligned saved2(loom::moe::saved_bytes(c, 4)), ws2(loom::moe::workspace_bytes(c, 4));
  std::vector<float> y2(S * M);
  loom::moe::ForwardCall<float> call;
  call.tokens = S;
  call.x = x.data();
  call.w.gate_w = gate_w.data();
  call.w.experts = {w1.data(), b1.data(), w2.data(), b2.data()};
  call.w.residual = {rw1.data(), rb1.data(), rw2.data(), rb2.data()};
  call.w.coef_w = cw.data();
  call.w.coef_b = cb.data();
  call.y = y2.data();
  call.saved = saved2.p;
  call.saved_bytes = loom::moe::saved_bytes(c, 4);
  call.workspace = ws2.p;
  call.workspace_bytes = loom::moe::workspace_bytes(c, 4);
  loom::moe::LayerStats st2;
  loom::moe::layer_forward<float>(c, ex, call, st2);
  EXPECT_EQ(y, y2);
  EXPECT_EQ(stats.dropped, st2.dropped);
  EXPECT_DOUBLE_EQ(stats.aux_loss, st2.aux_loss);

  // backward: dx and the gradients are finite, and gradients are ADDED (run twice = double)
  auto dy = moe_test::random_vec<float>(S * M, 13u);
  std::vector<float> dx(S * M);
  std::vector<std::vector<float>> g = {
      std::vector<float>(E * M),     std::vector<float>(E * H * M), std::vector<float>(E * H),
      std::vector<float>(E * M * H), std::vector<float>(E * M),     std::vector<float>(H * M),
      std::vector<float>(H),         std::vector<float>(M * H),     std::vector<float>(M),
      std::vector<float>(2 * M),     std::vector<float>(2)};
  View gg(g[0].data(), {E, M}, kF32), gw1(g[1].data(), {E, H, M}, kF32),
      gb1(g[2].data(), {E, H}, kF32), gw2(g[3].data(), {E, M, H}, kF32),
      gb2(g[4].data(), {E, M}, kF32), grw1(g[5].data(), {H, M}, kF32), grb1(g[6].data(), {H}, kF32),
      grw2(g[7].data(), {M, H}, kF32), grb2(g[8].data(), {M}, kF32), gcw(g[9].data(), {2, M}, kF32),
      gcb(g[10].data(), {2}, kF32);
  loom_moe_weights gr{LOOM_MOE_WEIGHTS_SIZE,
                      0,
                      gg.get(),
                      gw1.get(),
                      gb1.get(),
                      gw2.get(),
                      gb2.get(),
                      grw1.get(),
                      grb1.get(),
                      grw2.get(),
                      grb2.get(),
                      gcw.get(),
                      gcb.get()};
  View vdy(dy.data(), {S, M}, kF32), vdx(dx.data(), {S, M}, kF32);
  loom_moe_backward_args b{};
  b.struct_size = LOOM_MOE_BACKWARD_ARGS_SIZE;
  b.seed = 5;
  b.step = 2;
  b.tokens = S;
  b.first_token = 24;
  b.model_dim = M;
  b.hidden_dim = H;
  b.layer = 0;
  b.num_layers = 2;
  b.training = 1;
  b.aux_loss_coef = 0.01;
  b.x = vx.get();
  b.weights = &w;
  b.dy = vdy.get();
  b.dx = vdx.get();
  b.grads = &gr;
  b.saved = saved.p;
  b.saved_bytes = p.saved_bytes;
  b.workspace = ws.p;
  b.workspace_bytes = p.workspace_bytes;
  ASSERT_EQ(m.take(m.t->backward(m.obj, &b)), 0) << m.error;
  const std::vector<float> once = g[1];
  const std::vector<std::vector<float>> g_once = g;
  const std::vector<float> dx1 = dx;
  ASSERT_EQ(m.take(m.t->backward(m.obj, &b)), 0) << m.error;
  double norm = 0.0;
  for (size_t i = 0; i < once.size(); ++i) {
    EXPECT_FLOAT_EQ(g[1][i], 2.0f * once[i]);
    norm += std::fabs(once[i]);
  }
  EXPECT_GT(norm, 0.0);
  EXPECT_EQ(dx, dx1);  // written, not added

  // the core's backward on its own saved, directly: the same dx and gradients bit for bit
  std::vector<std::vector<float>> g2(g.size());
  for (size_t i = 0; i < g.size(); ++i) g2[i].assign(g[i].size(), 0.0f);
  std::vector<float> dx2(S * M, -7.0f);
  loom::moe::BackwardCall<float> bcall;
  bcall.tokens = S;
  bcall.x = x.data();
  bcall.w = call.w;
  bcall.dy = dy.data();
  bcall.dx = dx2.data();
  bcall.g.gate_w = g2[0].data();
  bcall.g.experts = {g2[1].data(), g2[2].data(), g2[3].data(), g2[4].data()};
  bcall.g.residual = {g2[5].data(), g2[6].data(), g2[7].data(), g2[8].data()};
  bcall.g.coef_w = g2[9].data();
  bcall.g.coef_b = g2[10].data();
  bcall.aux_loss_coef = 0.01;
  bcall.saved = saved2.p;
  bcall.saved_bytes = loom::moe::saved_bytes(c, 4);
  bcall.workspace = ws2.p;
  bcall.workspace_bytes = loom::moe::workspace_bytes(c, 4);
  loom::moe::layer_backward<float>(c, ex, bcall);
  EXPECT_EQ(dx2, dx1);
  for (size_t i = 0; i < g.size(); ++i) EXPECT_EQ(g2[i], g_once[i]) << "gradient " << i;

  // dispatch alone: the rows of the routing, grouped by expert; combine brings them back
  std::vector<float> rows(p.max_expert_rows * M, -1.0f), back(S * M);
  std::vector<int64_t> counts(E);
  View vrows(rows.data(), {p.max_expert_rows, M}, kF32), vback(back.data(), {S, M}, kF32);
  loom_moe_dispatch_args d{};
  d.struct_size = LOOM_MOE_DISPATCH_ARGS_SIZE;
  d.tokens = S;
  d.model_dim = M;
  d.top_k = k;
  d.x = vx.get();
  d.rows = vrows.get();
  d.route_experts = vre.get();
  d.counts = counts.data();
  d.counts_count = E;
  ASSERT_EQ(m.take(m.t->dispatch(m.obj, &d)), 0) << m.error;
  int64_t kept = 0;
  for (int64_t v : counts) kept += v;
  EXPECT_EQ(kept, S * k - stats.dropped);
  int64_t r = 0;
  for (int e = 0; e < E; ++e) {
    for (int64_t t = 0; t < S; ++t) {
      for (int j = 0; j < k; ++j) {
        if (re[t * k + j] != e) continue;
        for (int64_t i = 0; i < M; ++i) ASSERT_EQ(rows[r * M + i], x[t * M + i]);
        ++r;
      }
    }
  }
  d.x = vback.get();
  d.route_weights = vrw.get();
  d.counts = nullptr;
  ASSERT_EQ(m.take(m.t->combine(m.obj, &d)), 0) << m.error;
  for (int64_t t = 0; t < S; ++t) {
    float wsum = 0.0f;
    for (int j = 0; j < k; ++j) wsum += re[t * k + j] >= 0 ? rw[t * k + j] : 0.0f;
    for (int64_t i = 0; i < M; ++i) EXPECT_NEAR(back[t * M + i], wsum * x[t * M + i], 1e-6);
  }
  // too few rows is refused
  View small(rows.data(), {1, M}, kF32);
  d.x = vx.get();
  d.rows = small.get();
  d.route_weights = nullptr;
  d.counts = counts.data();
  EXPECT_EQ(m.take(m.t->dispatch(m.obj, &d)), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(has(m.error, "max_expert_rows")) << m.error;
}

namespace {

// What run_at passes beyond the layer (the stats and the backward args' size) and what the
// backward returned.
struct Calls {
  loom_moe_stats* forward_stats = nullptr;
  uint32_t backward_size = LOOM_MOE_BACKWARD_ARGS_SIZE;
  loom_moe_stats* backward_stats = nullptr;
  int32_t backward_rc = 0;
  std::string backward_error;
  double forward_seconds = 0.0, backward_seconds = 0.0;
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// forward + backward through the plugin at one thread count: y, dx and every gradient.
std::vector<float> run_at(size_t threads, Calls* calls = nullptr) {
  EXPECT_EQ(loom_set_thread_count(threads), 0) << loom_last_error();
  Session s(
      "num_experts = 6\nk = 2\ncapacity_factor = 1.0\nuse_residual = true\n"
      "noisy_gate_policy = \"Jitter\"\nuse_rts = true");
  Moe m(s);
  const int64_t S = 40, M = 8, H = 6, E = 6;
  loom_moe_plan_args p = plan_args(S, M, H);
  EXPECT_EQ(m.take(m.t->plan(m.obj, &p)), 0) << m.error;
  std::vector<std::vector<float>> v = {
      moe_test::random_vec<float>(S * M, 1u),          moe_test::random_vec<float>(E * M, 2u, 1.5),
      moe_test::random_vec<float>(E * H * M, 3u, 0.5), moe_test::random_vec<float>(E * H, 4u),
      moe_test::random_vec<float>(E * M * H, 5u, 0.5), moe_test::random_vec<float>(E * M, 6u),
      moe_test::random_vec<float>(H * M, 7u, 0.5),     moe_test::random_vec<float>(H, 8u),
      moe_test::random_vec<float>(M * H, 9u, 0.5),     moe_test::random_vec<float>(M, 10u),
      moe_test::random_vec<float>(2 * M, 11u),         moe_test::random_vec<float>(2, 12u)};
  const std::vector<std::vector<int64_t>> dims = {
      {S, M}, {E, M}, {E, H, M}, {E, H}, {E, M, H}, {E, M}, {H, M}, {H}, {M, H}, {M}, {2, M}, {2}};
  std::vector<std::vector<float>> g;
  std::vector<View> views, gviews;
  views.reserve(12);
  gviews.reserve(12);
  for (size_t i = 0; i < v.size(); ++i) {
    views.emplace_back(v[i].data(), dims[i], kF32);
    g.emplace_back(v[i].size(), 0.0f);
  }
  for (size_t i = 0; i < v.size(); ++i) gviews.emplace_back(g[i].data(), dims[i], kF32);
  auto weights = [](std::vector<View>& t) {
    return loom_moe_weights{LOOM_MOE_WEIGHTS_SIZE,
                            0,
                            t[1].get(),
                            t[2].get(),
                            t[3].get(),
                            t[4].get(),
                            t[5].get(),
                            t[6].get(),
                            t[7].get(),
                            t[8].get(),
                            t[9].get(),
                            t[10].get(),
                            t[11].get()};
  };
  const loom_moe_weights w = weights(views), gw = weights(gviews);
  std::vector<float> y(S * M), dx(S * M);
  auto dy = moe_test::random_vec<float>(S * M, 13u);
  View vy(y.data(), {S, M}, kF32), vdx(dx.data(), {S, M}, kF32), vdy(dy.data(), {S, M}, kF32);
  Aligned saved(p.saved_bytes), ws(p.workspace_bytes);
  loom_moe_forward_args f{};
  f.struct_size = LOOM_MOE_FORWARD_ARGS_SIZE;
  f.seed = 11;
  f.step = 5;
  f.tokens = S;
  f.model_dim = M;
  f.hidden_dim = H;
  f.num_layers = 2;
  f.training = 1;
  f.x = views[0].get();
  f.weights = &w;
  f.y = vy.get();
  f.saved = saved.p;
  f.saved_bytes = p.saved_bytes;
  f.workspace = ws.p;
  f.workspace_bytes = p.workspace_bytes;
  f.stats = calls != nullptr ? calls->forward_stats : nullptr;
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(m.take(m.t->forward(m.obj, &f)), 0) << m.error;
  if (calls != nullptr) calls->forward_seconds = seconds_since(t0);
  loom_moe_backward_args b{};
  b.struct_size = calls != nullptr ? calls->backward_size : LOOM_MOE_BACKWARD_ARGS_SIZE;
  b.seed = 11;
  b.step = 5;
  b.tokens = S;
  b.model_dim = M;
  b.hidden_dim = H;
  b.num_layers = 2;
  b.training = 1;
  b.aux_loss_coef = 0.01;
  b.x = views[0].get();
  b.weights = &w;
  b.dy = vdy.get();
  b.dx = vdx.get();
  b.grads = &gw;
  b.saved = saved.p;
  b.saved_bytes = p.saved_bytes;
  b.workspace = ws.p;
  b.workspace_bytes = p.workspace_bytes;
  b.stats = calls != nullptr ? calls->backward_stats : nullptr;
  t0 = std::chrono::steady_clock::now();
  const int32_t rc = m.take(m.t->backward(m.obj, &b));
  if (calls != nullptr) {
    calls->backward_seconds = seconds_since(t0);
    calls->backward_rc = rc;
    calls->backward_error = m.error;
  } else {
    EXPECT_EQ(rc, 0) << m.error;
  }
  std::vector<float> out = y;
  out.insert(out.end(), dx.begin(), dx.end());
  for (const auto& gi : g) out.insert(out.end(), gi.begin(), gi.end());
  return out;
}

}  // namespace

TEST(MoePlugin, BitIdenticalOnAnyThreadCount) {
  const size_t before = loom_thread_count();
  const std::vector<float> one = run_at(1);
  for (size_t t : {2u, 3u}) EXPECT_EQ(run_at(t), one) << t << " threads";
  EXPECT_EQ(loom_set_thread_count(before), 0);
}

namespace {

uint64_t phase_sum(const loom_moe_stats& s) {
  return s.gate_ns + s.dispatch_ns + s.exchange_ns + s.experts_ns + s.combine_ns;
}

void expect_phases(const loom_moe_stats& s, double call_seconds, const char* what) {
  SCOPED_TRACE(what);
  EXPECT_GT(s.gate_ns, 0u);
  EXPECT_GT(s.dispatch_ns, 0u);
  EXPECT_GT(s.experts_ns, 0u);
  EXPECT_GT(s.combine_ns, 0u);
  // the phases are disjoint parts of the call
  EXPECT_LE(static_cast<double>(phase_sum(s)) * 1e-9, call_seconds);
}

}  // namespace

// Since ABI 1.7 forward's stats and backward's (a new args field) carry the time of each
// phase. A 1.6 caller's shorter stats and backward args still work, and nothing is written
// past what they hold; a backward's stats must be the 1.7 struct.
TEST(MoePlugin, PhaseTimesAndOlderCallersStructs) {
  const std::vector<float> plain = run_at(1);
  std::vector<int64_t> load(6);
  loom_moe_stats fs{LOOM_MOE_STATS_SIZE, 0, 0.0, 0, 0, load.data(), 6};
  loom_moe_stats bs{LOOM_MOE_STATS_SIZE, 0, 7.0, 3, 4, nullptr, 0};
  Calls c;
  c.forward_stats = &fs;
  c.backward_stats = &bs;
  EXPECT_EQ(run_at(1, &c), plain);  // timing changes nothing
  ASSERT_EQ(c.backward_rc, 0) << c.backward_error;
  expect_phases(fs, c.forward_seconds, "forward");
  expect_phases(bs, c.backward_seconds, "backward");
  EXPECT_EQ(bs.aux_loss, 7.0);  // backward writes the phases only
  EXPECT_EQ(bs.dropped, 3);
  EXPECT_EQ(bs.expert_rows, 4);

  // A 1.6 caller: shorter stats and backward args. The fields beyond them keep what they held.
  loom_moe_stats old{LOOM_MOE_STATS_SIZE_1_5, 0, 0.0, 0, 0, load.data(), 6};
  old.gate_ns = old.dispatch_ns = old.exchange_ns = old.experts_ns = old.combine_ns = 12345;
  loom_moe_stats unseen{LOOM_MOE_STATS_SIZE, 0, 0.0, 0, 0, nullptr, 0};
  unseen.experts_ns = 999;
  Calls o;
  o.forward_stats = &old;
  o.backward_size = LOOM_MOE_BACKWARD_ARGS_SIZE_1_5;
  o.backward_stats = &unseen;  // past the args' struct_size: never read
  EXPECT_EQ(run_at(1, &o), plain);
  ASSERT_EQ(o.backward_rc, 0) << o.backward_error;
  EXPECT_GT(old.expert_rows, 0);
  EXPECT_EQ(phase_sum(old), 5u * 12345u);
  EXPECT_EQ(unseen.experts_ns, 999u);

  // stats on backward are new in 1.7: a shorter one is refused, naming it
  loom_moe_stats short_bs{LOOM_MOE_STATS_SIZE_1_5, 0, 0.0, 0, 0, nullptr, 0};
  Calls r;
  r.backward_stats = &short_bs;
  run_at(1, &r);
  EXPECT_EQ(r.backward_rc, LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(has(r.backward_error, "backward stats has struct_size")) << r.backward_error;
}

#ifdef LOOM_CLI_PATH
namespace {

// `loom check FILE`: the exit code and stderr.
std::pair<int, std::string> loom_check(const std::string& toml) {
  const auto dir = std::filesystem::temp_directory_path();
  const auto file = dir / ("moe_check_" + std::to_string(::getpid()) + ".toml");
  const auto err_file = dir / ("moe_check_" + std::to_string(::getpid()) + ".err");
  {
    std::ofstream out(file);
    out << toml;
  }
  const std::string cmd = std::string("LOOM_PLUGIN_PATH= '") + LOOM_CLI_PATH + "' check '" +
                          file.string() + "' >/dev/null 2>'" + err_file.string() + "'";
  const int status = std::system(cmd.c_str());
  std::ifstream in(err_file);
  std::ostringstream os;
  os << in.rdbuf();
  std::filesystem::remove(file);
  std::filesystem::remove(err_file);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, os.str()};
}

}  // namespace

// `loom check` on a manifest with a [moe.NAME] section reports the configurations the
// plugin refuses, naming the values.
// Every cross-parameter problem in one report, each at its own key (test.toml:LINE:COL), not
// one at a time at the instance's table.
TEST(MoePlugin, CrossParameterProblemsComeTogetherAtTheirKeys) {
  Session s("num_experts = 6\nk = 7\nep_size = 4");
  EXPECT_TRUE(has(s.error, "test.toml:4:1: parameter 'k' of moe.m")) << s.error;
  EXPECT_TRUE(has(s.error, "k = 7 is more than num_experts = 6")) << s.error;
  EXPECT_TRUE(has(s.error,
                  "parameter 'ep_size': num_experts = 6 is not a multiple of "
                  "ep_size = 4"))
      << s.error;
  EXPECT_TRUE(has(s.error, "needs comm")) << s.error;
}

TEST(MoePlugin, LoomCheckReportsBadConfigurations) {
  const std::string head = "[moe.m]\nplugin = \"moe\"\n";
  auto [ok, ok_err] = loom_check(head + "num_experts = 8\nk = 2\n");
  EXPECT_EQ(ok, 0) << ok_err;
  struct Case {
    const char* body;
    std::vector<std::string> says;
  };
  const Case cases[] = {
      {"num_experts = 2\nk = 3\n", {"k = 3", "num_experts = 2"}},
      {"num_experts = 8\nep_size = 3\n", {"num_experts = 8", "ep_size = 3"}},
      {"capacity_factor = 0.0\n", {"capacity_factor"}},
      {"capacity_factor = -1.0\n", {"capacity_factor"}},
  };
  for (const Case& c : cases) {
    const auto [code, err] = loom_check(head + c.body);
    EXPECT_NE(code, 0) << c.body;
    for (const std::string& w : c.says) EXPECT_TRUE(has(err, w)) << c.body << ": " << err;
  }
}
#endif
