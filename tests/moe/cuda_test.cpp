// The MoE core's CUDA layer against the host one, and the plugin on CUDA memory against itself
// on host memory: the gate's probabilities bit for bit (so
// the same experts, the same drops, the same aux loss), the layer's output and every gradient
// within a stated tolerance (the expert GEMMs are cuBLAS's, summed in its own order). Skips
// without a CUDA device (the CUDA emulation provides one).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <loom/embed.h>
#include <loom/kinds/moe.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <loom/moe/layer.hpp>
#include <loom/moe/moe_cuda.hpp>
#include "cuda_support.hpp"
#include "reference.hpp"

namespace {

using loom::moe::LayerConfig;

class MoeCuda : public moe_test::CudaTest {};
using moe_test::Dev;

struct Weights {
  std::vector<float> gate_w, w1, b1, w2, b2, rw1, rb1, rw2, rb2, cw, cb;
  Weights(int64_t E, int64_t M, int64_t H) {
    gate_w = moe_test::random_vec<float>(E * M, 2u, 1.5);
    w1 = moe_test::random_vec<float>(E * H * M, 3u, 0.5);
    b1 = moe_test::random_vec<float>(E * H, 4u, 0.3);
    w2 = moe_test::random_vec<float>(E * M * H, 5u, 0.5);
    b2 = moe_test::random_vec<float>(E * M, 6u, 0.3);
    rw1 = moe_test::random_vec<float>(H * M, 7u, 0.5);
    rb1 = moe_test::random_vec<float>(H, 8u, 0.3);
    rw2 = moe_test::random_vec<float>(M * H, 9u, 0.5);
    rb2 = moe_test::random_vec<float>(M, 10u, 0.3);
    cw = moe_test::random_vec<float>(2 * M, 11u, 1.0);
    cb = moe_test::random_vec<float>(2, 12u, 0.5);
  }
  std::vector<std::vector<float>*> all() {
    return {&gate_w, &w1, &b1, &w2, &b2, &rw1, &rb1, &rw2, &rb2, &cw, &cb};
  }
};

void expect_close(const std::vector<float>& got, const std::vector<float>& want, double tol,
                  const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], tol * (1.0 + std::fabs(want[i]))) << what << "[" << i << "]";
  }
}

// Tolerance: 1e-5 relative for outputs, 1e-4 for gradients (fp32 GEMMs in another order).
void compare(const LayerConfig& c, int64_t S, cudaStream_t stream) {
  const int64_t E = c.gate.num_experts, M = c.model_dim, H = c.hidden_dim, k = c.gate.k;
  Weights hw(E, M, H);
  const auto x = moe_test::random_vec<float>(S * M, 1u);
  const auto dy = moe_test::random_vec<float>(S * M, 13u);
  const uint64_t sb = loom::moe::saved_bytes(c, 4), wb = loom::moe::workspace_bytes(c, 4);
  loom::moe::Exchange ex(nullptr, nullptr, 1);

  // host
  std::vector<char> hsaved(sb + 256), hwork(wb + 256);
  auto align = [](char* p) {
    return static_cast<void*>(p + (256 - reinterpret_cast<uintptr_t>(p) % 256) % 256);
  };
  std::vector<float> y(S * M), dx(S * M);
  std::vector<int32_t> route(S * k);
  std::vector<int64_t> load(E), dload(E);
  loom::moe::ForwardCall<float> f;
  f.tokens = S;
  f.x = x.data();
  f.w.gate_w = hw.gate_w.data();
  f.w.experts = {hw.w1.data(), hw.b1.data(), hw.w2.data(), hw.b2.data()};
  f.w.residual = {hw.rw1.data(), hw.rb1.data(), hw.rw2.data(), hw.rb2.data()};
  f.w.coef_w = hw.cw.data();
  f.w.coef_b = hw.cb.data();
  f.y = y.data();
  f.route_experts = route.data();
  f.saved = align(hsaved.data());
  f.saved_bytes = sb;
  f.workspace = align(hwork.data());
  f.workspace_bytes = wb;
  // aux-loss-free balancing: a bias that moves some choices, updated by forward
  std::vector<float> bias = moe_test::random_vec<float>(E, 31u, 0.05);
  const std::vector<float> bias0 = bias;
  if (c.bias_update_rate > 0.0) f.expert_bias = bias.data();
  loom::moe::LayerStats hs;
  hs.load = load.data();
  loom::moe::layer_forward<float>(c, ex, f, hs);
  Weights hg(E, M, H);
  for (auto* v : hg.all()) std::fill(v->begin(), v->end(), 0.25f);
  loom::moe::BackwardCall<float> b;
  b.tokens = S;
  b.x = x.data();
  b.w = f.w;
  b.dy = dy.data();
  b.dx = dx.data();
  b.g.gate_w = hg.gate_w.data();
  b.g.experts = {hg.w1.data(), hg.b1.data(), hg.w2.data(), hg.b2.data()};
  b.g.residual = {hg.rw1.data(), hg.rb1.data(), hg.rw2.data(), hg.rb2.data()};
  b.g.coef_w = hg.cw.data();
  b.g.coef_b = hg.cb.data();
  b.aux_loss_coef = 0.1;
  b.saved = f.saved;
  b.saved_bytes = sb;
  b.workspace = f.workspace;
  b.workspace_bytes = wb;
  loom::moe::layer_backward<float>(c, ex, b);

  // device
  Dev<float> dxin(x), ddy(dy), dyout(S * M), ddx(S * M);
  Dev<int32_t> droute(S * k);
  Dev<char> dsaved(sb), dwork(wb);
  std::vector<std::unique_ptr<Dev<float>>> dw, dg;
  for (auto* v : hw.all()) dw.push_back(std::make_unique<Dev<float>>(*v));
  for (auto* v : hw.all())
    dg.push_back(std::make_unique<Dev<float>>(std::vector<float>(v->size(), 0.25f)));
  loom::moe::ForwardCall<float> df;
  df.tokens = S;
  df.x = dxin.p;
  df.w.gate_w = dw[0]->p;
  df.w.experts = {dw[1]->p, dw[2]->p, dw[3]->p, dw[4]->p};
  df.w.residual = {dw[5]->p, dw[6]->p, dw[7]->p, dw[8]->p};
  df.w.coef_w = dw[9]->p;
  df.w.coef_b = dw[10]->p;
  df.y = dyout.p;
  df.route_experts = droute.p;
  df.saved = dsaved.p;
  df.saved_bytes = sb;
  df.workspace = dwork.p;
  df.workspace_bytes = wb;
  loom::moe::cuda::Blas blas;
  const loom::moe::cuda::Device dev{0, stream, &blas};
  Dev<float> dbias(bias0);
  if (c.bias_update_rate > 0.0) df.expert_bias = dbias.p;
  loom::moe::LayerStats ds;
  ds.load = dload.data();
  loom::moe::cuda::layer_forward(c, ex, df, ds, dev);
  if (c.bias_update_rate > 0.0) {
    EXPECT_NE(bias, bias0);
    EXPECT_EQ(dbias.read(), bias);
  }
  EXPECT_EQ(droute.read(), route);  // the same experts, the same drops
  EXPECT_EQ(dload, load);
  EXPECT_EQ(ds.dropped, hs.dropped);
  EXPECT_EQ(ds.aux_loss, hs.aux_loss);
  expect_close(dyout.read(), y, 1e-5, "y");
  loom::moe::BackwardCall<float> db;
  db.tokens = S;
  db.x = dxin.p;
  db.w = df.w;
  db.dy = ddy.p;
  db.dx = ddx.p;
  db.g.gate_w = dg[0]->p;
  db.g.experts = {dg[1]->p, dg[2]->p, dg[3]->p, dg[4]->p};
  db.g.residual = {dg[5]->p, dg[6]->p, dg[7]->p, dg[8]->p};
  db.g.coef_w = dg[9]->p;
  db.g.coef_b = dg[10]->p;
  db.aux_loss_coef = 0.1;
  db.saved = dsaved.p;
  db.saved_bytes = sb;
  db.workspace = dwork.p;
  db.workspace_bytes = wb;
  loom::moe::cuda::layer_backward(c, ex, db, dev);
  expect_close(ddx.read(), dx, 1e-4, "dx");
  const char* names[] = {"gate_w", "w1",     "b1",     "w2",     "b2",    "res_w1",
                         "res_b1", "res_w2", "res_b2", "coef_w", "coef_b"};
  const auto hall = hg.all();
  for (size_t i = 0; i < hall.size(); ++i) {
    if (!c.residual && i >= 5) break;
    expect_close(dg[i]->read(), *hall[i], 1e-4, names[i]);
  }
}

LayerConfig config(int E, int k, bool residual, bool dropless) {
  LayerConfig c;
  c.gate.num_experts = E;
  c.gate.k = k;
  c.gate.training = true;
  c.gate.drop_tokens = !dropless;
  c.gate.capacity_factor = 0.75;
  c.gate.min_capacity = 0;
  c.gate.seed = 9;
  c.gate.step = 4;
  c.gate.first_token = 100;
  c.model_dim = 12;
  c.hidden_dim = 10;
  c.max_tokens = 40;
  c.local_experts = E;
  c.residual = residual;
  return c;
}

}  // namespace

TEST_F(MoeCuda, GateProbabilitiesAreBitIdenticalToTheHost) {
  LayerConfig c = config(6, 2, false, false);
  c.gate.noise = loom::moe::NoisePolicy::Jitter;
  const int64_t S = 33, M = c.model_dim, E = 6;
  const auto x = moe_test::random_vec<float>(S * M, 21u, 2.0);
  const auto w = moe_test::random_vec<float>(E * M, 22u, 1.5);
  std::vector<float> host(S * E);
  loom::moe::gate_probs<float>(c.gate, x.data(), S, M, w.data(), host.data());
  Dev<float> dx(x), dw(w), dp(S * E);
  loom::moe::cuda::gate_probs(c.gate, dx.p, S, M, dw.p, dp.p, stream_);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  EXPECT_EQ(dp.read(), host);
}

TEST_F(MoeCuda, TopTwoWithCapacityJitterAndResidualMatchesTheHost) {
  LayerConfig c = config(4, 2, true, false);
  c.gate.noise = loom::moe::NoisePolicy::Jitter;
  compare(c, 40, stream_);
}

TEST_F(MoeCuda, TopOneRSampleWithBiasBalancingMatchesTheHost) {
  LayerConfig c = config(5, 1, false, false);
  c.gate.noise = loom::moe::NoisePolicy::RSample;
  c.gate.use_rts = true;
  c.bias_update_rate = 0.01;
  compare(c, 37, stream_);
}

TEST_F(MoeCuda, DroplessTopThreeSiluMatchesTheHost) {
  LayerConfig c = config(6, 3, false, true);
  c.activation = loom::moe::Activation::Silu;
  compare(c, 25, stream_);
}

// The plugin through the host on CUDA memory against the same plugin on host memory: the same
// routes and drops, outputs and gradients within the tolerances above, dispatch/combine alone.
namespace {

struct Session {
  loom_session* s = nullptr;
  explicit Session(const std::string& params) {
    const std::string toml = "[moe.m]\nplugin = \"moe\"\n" + params + "\n";
    loom_open_options o{};
    o.struct_size = LOOM_OPEN_OPTIONS_SIZE;
    o.log_level = -1;
    EXPECT_EQ(loom_open_string(toml.c_str(), "test.toml", &o, &s), 0) << loom_last_error();
  }
  ~Session() { loom_close(s); }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
};

struct Tensor {
  DLTensor t{};
  int64_t shape[3] = {0, 0, 0};
  Tensor(void* data, std::vector<int64_t> dims, DLDataType dtype, DLDevice dev) {
    for (size_t i = 0; i < dims.size(); ++i) shape[i] = dims[i];
    t.data = data;
    t.device = dev;
    t.ndim = static_cast<int32_t>(dims.size());
    t.dtype = dtype;
    t.shape = shape;
  }
};

// One forward + backward + dispatch + combine through the plugin, on host or device memory.
struct PluginRun {
  std::vector<float> y, dx, dgate, dw1, rows, back;
  std::vector<int32_t> route;
  std::vector<int64_t> counts;
  int64_t dropped = -1;
};

template <class Mem>
PluginRun run_plugin(const loom_moe_v1* t, void* obj, loom_instance* inst, Mem& mem, DLDevice dev,
                     cudaStream_t stream) {
  const int64_t S = 20, M = 8, H = 6, E = 4, k = 2;
  const DLDataType f32{kDLFloat, 32, 1}, i32{kDLInt, 32, 1};
  auto take = [&](loom_status* st) {
    std::array<char, 2048> msg{};
    const int32_t rc = loom_instance_take_status(inst, st, msg.data(), msg.size());
    EXPECT_EQ(rc, 0) << msg.data();
    return rc;
  };
  loom_moe_plan_args p{};
  p.struct_size = LOOM_MOE_PLAN_ARGS_SIZE;
  p.tokens = S;
  p.model_dim = M;
  p.hidden_dim = H;
  p.num_layers = 1;
  p.training = 1;
  p.dtype = f32;
  PluginRun out;
  if (take(t->plan(obj, &p)) != 0) return out;
  Weights hw(E, M, H);
  auto x = mem(moe_test::random_vec<float>(S * M, 1u));
  auto dy = mem(moe_test::random_vec<float>(S * M, 13u));
  auto gw = mem(hw.gate_w), w1 = mem(hw.w1), b1 = mem(hw.b1), w2 = mem(hw.w2), b2 = mem(hw.b2);
  auto g0 = mem(std::vector<float>(E * M)), g1 = mem(std::vector<float>(E * H * M)),
       g2 = mem(std::vector<float>(E * H)), g3 = mem(std::vector<float>(E * M * H)),
       g4 = mem(std::vector<float>(E * M));
  auto y = mem(std::vector<float>(S * M)), dx = mem(std::vector<float>(S * M));
  auto rw = mem(std::vector<float>(S * k));
  auto re = mem(std::vector<int32_t>(S * k));
  auto saved = mem(std::vector<char>(p.saved_bytes + 256));
  auto ws = mem(std::vector<char>(p.workspace_bytes + 256));
  Tensor tx(x.p, {S, M}, f32, dev), tdy(dy.p, {S, M}, f32, dev), tg(gw.p, {E, M}, f32, dev),
      tw1(w1.p, {E, H, M}, f32, dev), tb1(b1.p, {E, H}, f32, dev), tw2(w2.p, {E, M, H}, f32, dev),
      tb2(b2.p, {E, M}, f32, dev), tg0(g0.p, {E, M}, f32, dev), tg1(g1.p, {E, H, M}, f32, dev),
      tg2(g2.p, {E, H}, f32, dev), tg3(g3.p, {E, M, H}, f32, dev), tg4(g4.p, {E, M}, f32, dev),
      ty(y.p, {S, M}, f32, dev), tdx(dx.p, {S, M}, f32, dev), tre(re.p, {S, k}, i32, dev),
      trw(rw.p, {S, k}, f32, dev);
  const loom_moe_weights w{LOOM_MOE_WEIGHTS_SIZE,
                           0,
                           &tg.t,
                           &tw1.t,
                           &tb1.t,
                           &tw2.t,
                           &tb2.t,
                           nullptr,
                           nullptr,
                           nullptr,
                           nullptr,
                           nullptr,
                           nullptr};
  const loom_moe_weights g{LOOM_MOE_WEIGHTS_SIZE,
                           0,
                           &tg0.t,
                           &tg1.t,
                           &tg2.t,
                           &tg3.t,
                           &tg4.t,
                           nullptr,
                           nullptr,
                           nullptr,
                           nullptr,
                           nullptr,
                           nullptr};
  auto aligned = [](void* q) {
    auto* c = static_cast<char*>(q);
    return static_cast<void*>(c + (256 - reinterpret_cast<uintptr_t>(c) % 256) % 256);
  };
  loom_moe_stats stats{LOOM_MOE_STATS_SIZE, 0, 0.0, 0, 0, nullptr, 0};
  loom_moe_forward_args f{};
  f.struct_size = LOOM_MOE_FORWARD_ARGS_SIZE;
  f.seed = 3;
  f.step = 1;
  f.tokens = S;
  f.model_dim = M;
  f.hidden_dim = H;
  f.num_layers = 1;
  f.training = 1;
  f.x = &tx.t;
  f.weights = &w;
  f.y = &ty.t;
  f.route_experts = &tre.t;
  f.route_weights = &trw.t;
  f.stats = &stats;
  f.saved = aligned(saved.p);
  f.saved_bytes = p.saved_bytes;
  f.workspace = aligned(ws.p);
  f.workspace_bytes = p.workspace_bytes;
  f.stream = stream;
  if (take(t->forward(obj, &f)) != 0) return out;
  loom_moe_backward_args b{};
  b.struct_size = LOOM_MOE_BACKWARD_ARGS_SIZE;
  b.seed = 3;
  b.step = 1;
  b.tokens = S;
  b.model_dim = M;
  b.hidden_dim = H;
  b.num_layers = 1;
  b.training = 1;
  b.aux_loss_coef = 0.01;
  b.x = &tx.t;
  b.weights = &w;
  b.dy = &tdy.t;
  b.dx = &tdx.t;
  b.grads = &g;
  b.saved = f.saved;
  b.saved_bytes = p.saved_bytes;
  b.workspace = f.workspace;
  b.workspace_bytes = p.workspace_bytes;
  b.stream = stream;
  if (take(t->backward(obj, &b)) != 0) return out;
  auto rows = mem(std::vector<float>(p.max_expert_rows * M));
  auto back = mem(std::vector<float>(S * M));
  Tensor trows(rows.p, {p.max_expert_rows, M}, f32, dev), tback(back.p, {S, M}, f32, dev);
  out.counts.assign(E, -1);
  loom_moe_dispatch_args d{};
  d.struct_size = LOOM_MOE_DISPATCH_ARGS_SIZE;
  d.tokens = S;
  d.model_dim = M;
  d.top_k = k;
  d.x = &tx.t;
  d.rows = &trows.t;
  d.route_experts = &tre.t;
  d.route_weights = &trw.t;
  d.counts = out.counts.data();
  d.counts_count = E;
  d.stream = stream;
  if (take(t->dispatch(obj, &d)) != 0) return out;
  d.x = &tback.t;
  d.counts = nullptr;
  if (take(t->combine(obj, &d)) != 0) return out;
  out.y = y.read();
  out.dx = dx.read();
  out.dgate = g0.read();
  out.dw1 = g1.read();
  out.route = re.read();
  out.rows = rows.read();
  out.back = back.read();
  out.dropped = stats.dropped;
  return out;
}

// Host memory with the same interface as Dev.
template <class T>
struct Host {
  std::vector<T> v;
  T* p;
  explicit Host(std::vector<T> h) : v(std::move(h)), p(v.data()) {}
  std::vector<T> read() const { return v; }
};

}  // namespace

TEST_F(MoeCuda, ThePluginOnDeviceMemoryMatchesItselfOnHostMemory) {
  Session s(
      "num_experts = 4\nk = 2\ncapacity_factor = 0.75\nmin_capacity = 0\n"
      "noisy_gate_policy = \"RSample\"");
  ASSERT_NE(s.s, nullptr);
  loom_instance* inst = nullptr;
  ASSERT_EQ(loom_find_instance(s.s, LOOM_KIND_MOE, "m", &inst), 0) << loom_last_error();
  void* obj = nullptr;
  const void* table = nullptr;
  ASSERT_EQ(loom_instance_table(inst, LOOM_KIND_MOE, LOOM_MOE_V1_MIN_SIZE, &obj, &table), 0);
  const auto* t = static_cast<const loom_moe_v1*>(table);
  auto host_mem = [](auto v) { return Host<typename decltype(v)::value_type>(std::move(v)); };
  auto dev_mem = [](auto v) { return Dev<typename decltype(v)::value_type>(v); };
  const PluginRun h = run_plugin(t, obj, inst, host_mem, DLDevice{kDLCPU, 0}, nullptr);
  const PluginRun d = run_plugin(t, obj, inst, dev_mem, DLDevice{kDLCUDA, 0}, stream_);
  ASSERT_GE(h.dropped, 1);
  EXPECT_EQ(d.dropped, h.dropped);
  EXPECT_EQ(d.route, h.route);
  EXPECT_EQ(d.counts, h.counts);
  expect_close(d.y, h.y, 1e-5, "y");
  expect_close(d.dx, h.dx, 1e-4, "dx");
  expect_close(d.dgate, h.dgate, 1e-4, "dgate_w");
  expect_close(d.dw1, h.dw1, 1e-4, "dw1");
  int64_t kept = 0;
  for (int64_t c : h.counts) kept += c;
  const std::vector<float> hr(h.rows.begin(), h.rows.begin() + kept * 8);
  const std::vector<float> dr(d.rows.begin(), d.rows.begin() + kept * 8);
  EXPECT_EQ(dr, hr);
  EXPECT_EQ(d.back, h.back);
}
