// bfloat16 and float16 through the moe kind (the plugin, through the host): a 16-bit layer
// chooses exactly the experts, combine weights, drops and aux loss of the float32 layer on the
// widened values, and its y, dx, rows and combined y are that layer's rounded to nearest even
// (checked against a plain reference rounding); float32 gradients of 16-bit weights are the
// float32 layer's bit for bit, and 16-bit gradients are the float32 sums started from them,
// rounded once. Built twice: on the CPU (loom_moe_float16_tests) and, with LOOM_TEST_CUDA, on
// CUDA tensors (loom_moe_float16_cuda_tests: against the CUDA float32 layer, and the routing
// against the CPU's; skips without a device, the CUDA emulation has one).
#include <gtest/gtest.h>
#include <loom/embed.h>
#include <loom/kinds/moe.h>

#if LOOM_TEST_CUDA
#include <cuda_runtime_api.h>
#endif

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "../common/float16_reference.hpp"

namespace {

using loom_test::is_bf16;
using loom_test::to16;
using loom_test::to32;

constexpr DLDataType kF32{kDLFloat, 32, 1};
constexpr DLDataType kBF16{kDLBfloat, 16, 1};
constexpr DLDataType kF16{kDLFloat, 16, 1};
constexpr DLDataType kI32{kDLInt, 32, 1};
constexpr bool kCuda = LOOM_TEST_CUDA != 0;

bool have_device() {
#if LOOM_TEST_CUDA
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
#else
  return false;
#endif
}

struct Session {
  loom_session* s = nullptr;
  explicit Session(const std::string& params) {
    const std::string toml = "[moe.m]\nplugin = \"moe\"\n" + params + "\n";
    loom_open_options o{};
    o.struct_size = LOOM_OPEN_OPTIONS_SIZE;
    o.log_level = -1;
    if (loom_open_string(toml.c_str(), "test.toml", &o, &s) != 0) {
      ADD_FAILURE() << "open: " << loom_last_error();
    }
  }
  ~Session() { loom_close(s); }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
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

// A tensor's bytes on the host or the device, with its DLTensor.
struct Buf {
  bool cuda = false;
  std::vector<unsigned char> host;
  void* dev = nullptr;
  DLTensor t{};
  int64_t shape[3] = {0, 0, 0};
  Buf(std::vector<int64_t> dims, DLDataType dtype, bool on_cuda) : cuda(on_cuda) {
    int64_t n = 1;
    for (size_t i = 0; i < dims.size(); ++i) n *= (shape[i] = dims[i]);
    host.assign(static_cast<size_t>(n) * dtype.bits / 8 + 256, 0);
#if LOOM_TEST_CUDA
    if (cuda) {
      EXPECT_EQ(cudaMalloc(&dev, host.size()), cudaSuccess);
      EXPECT_EQ(cudaMemset(dev, 0, host.size()), cudaSuccess);
    }
#endif
    t.data = aligned();
    t.device = cuda ? DLDevice{kDLCUDA, 0} : DLDevice{kDLCPU, 0};
    t.ndim = static_cast<int32_t>(dims.size());
    t.dtype = dtype;
    t.shape = shape;
  }
  ~Buf() {
#if LOOM_TEST_CUDA
    if (dev != nullptr) cudaFree(dev);
#endif
  }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  // 256-byte aligned, as saved and workspace must be
  void* aligned() {
    const auto base = reinterpret_cast<uintptr_t>(cuda ? dev : static_cast<void*>(host.data()));
    return reinterpret_cast<void*>((base + 255) / 256 * 256);
  }
  size_t bytes() const { return host.size() - 256; }
  // values (representable in the dtype) stored in it
  void set(const std::vector<float>& v) {
    std::vector<unsigned char> b(bytes());
    if (t.dtype.bits == 32) {
      std::memcpy(b.data(), v.data(), b.size());
    } else {
      const auto h = to16(v, is_bf16(t.dtype));
      std::memcpy(b.data(), h.data(), b.size());
    }
    put(b.data());
  }
  void put(const void* src) {
#if LOOM_TEST_CUDA
    if (cuda) {
      EXPECT_EQ(cudaMemcpy(aligned(), src, bytes(), cudaMemcpyHostToDevice), cudaSuccess);
      return;
    }
#endif
    std::memcpy(aligned(), src, bytes());
  }
  std::vector<unsigned char> get() {
    std::vector<unsigned char> b(bytes());
#if LOOM_TEST_CUDA
    if (cuda) {
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(b.data(), aligned(), b.size(), cudaMemcpyDeviceToHost), cudaSuccess);
      return b;
    }
#endif
    std::memcpy(b.data(), aligned(), b.size());
    return b;
  }
  // the values as float32 (exact)
  std::vector<float> values() {
    const auto b = get();
    if (t.dtype.bits == 32) {
      std::vector<float> f(b.size() / 4);
      std::memcpy(f.data(), b.data(), b.size());
      return f;
    }
    std::vector<uint16_t> h(b.size() / 2);
    std::memcpy(h.data(), b.data(), b.size());
    return to32(h, is_bf16(t.dtype));
  }
  std::vector<uint16_t> halves() {
    const auto b = get();
    std::vector<uint16_t> h(b.size() / 2);
    std::memcpy(h.data(), b.data(), b.size());
    return h;
  }
};

constexpr int64_t S = 12, M = 6, H = 5, E = 4, K = 2;

// The layer's inputs as values every dtype holds exactly (rounded to bf16 and then to f16, so
// both widen back to them).
struct Inputs {
  std::vector<float> x, dy;
  std::vector<std::vector<float>> w, g0;  // the 11 weights, and the gradients' start
};

std::vector<float> random_vec(int64_t n, uint32_t seed, double scale = 1.0) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> d(-scale, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = static_cast<float>(d(gen));
  return v;
}

std::vector<std::vector<int64_t>> weight_dims() {
  return {{E, M}, {E, H, M}, {E, H}, {E, M, H}, {E, M}, {H, M}, {H}, {M, H}, {M}, {2, M}, {2}};
}

std::vector<float> representable(std::vector<float> v) {
  v = to32(to16(v, true), true);
  v = to32(to16(v, false), false);
  // a float16 subnormal may keep more bits than bfloat16 has: such a rare element becomes 0
  const std::vector<float> b = to32(to16(v, true), true);
  for (size_t i = 0; i < v.size(); ++i) {
    if (b[i] != v[i]) v[i] = 0.0f;
  }
  return v;
}

Inputs inputs() {
  Inputs in;
  in.x = representable(random_vec(S * M, 1u));
  in.dy = representable(random_vec(S * M, 13u));
  uint32_t seed = 20;
  for (const auto& d : weight_dims()) {
    int64_t n = 1;
    for (int64_t v : d) n *= v;
    in.w.push_back(representable(random_vec(n, seed++, 0.5)));
    in.g0.push_back(representable(random_vec(n, seed++, 0.01)));
  }
  return in;
}

struct Outcome {
  int32_t rc = 0;
  std::string error;
  std::vector<float> y, dx, rows, combined, route_weights;
  std::vector<uint16_t> y16, dx16, rows16, combined16;
  std::vector<int32_t> route;
  std::vector<std::vector<float>> g;
  std::vector<std::vector<uint16_t>> g16;
  double aux = 0;
  int64_t dropped = 0;
};

// Forward, backward, then dispatch and combine with forward's routing, all in `dtype` (the
// gradients in `gdtype`) on one device.
// With `combine_rows`, combine reads those rows instead of dispatch's.
Outcome run(Moe& m, const Inputs& in, DLDataType dtype, DLDataType gdtype, bool cuda,
            const std::vector<float>* combine_rows = nullptr) {
  Outcome o;
  loom_moe_plan_args p{};
  p.struct_size = LOOM_MOE_PLAN_ARGS_SIZE;
  p.tokens = S;
  p.model_dim = M;
  p.hidden_dim = H;
  p.num_layers = 2;
  p.training = 1;
  p.dtype = dtype;
  if ((o.rc = m.take(m.t->plan(m.obj, &p))) != 0) {
    o.error = m.error;
    return o;
  }
  const auto dims = weight_dims();
  std::vector<std::unique_ptr<Buf>> w, g;
  for (size_t i = 0; i < dims.size(); ++i) {
    w.push_back(std::make_unique<Buf>(dims[i], dtype, cuda));
    w.back()->set(in.w[i]);
    g.push_back(std::make_unique<Buf>(dims[i], gdtype, cuda));
    g.back()->set(in.g0[i]);
  }
  auto weights = [](std::vector<std::unique_ptr<Buf>>& b) {
    return loom_moe_weights{LOOM_MOE_WEIGHTS_SIZE,
                            0,
                            &b[0]->t,
                            &b[1]->t,
                            &b[2]->t,
                            &b[3]->t,
                            &b[4]->t,
                            &b[5]->t,
                            &b[6]->t,
                            &b[7]->t,
                            &b[8]->t,
                            &b[9]->t,
                            &b[10]->t};
  };
  const loom_moe_weights wt = weights(w), gt = weights(g);
  Buf x({S, M}, dtype, cuda), y({S, M}, dtype, cuda), dy({S, M}, dtype, cuda),
      dx({S, M}, dtype, cuda), re({S, K}, kI32, cuda), rw({S, K}, kF32, cuda),
      saved({static_cast<int64_t>(p.saved_bytes)}, DLDataType{kDLUInt, 8, 1}, cuda),
      ws({static_cast<int64_t>(p.workspace_bytes)}, DLDataType{kDLUInt, 8, 1}, cuda);
  x.set(in.x);
  dy.set(in.dy);
  loom_moe_stats stats{};
  stats.struct_size = LOOM_MOE_STATS_SIZE;
  loom_moe_forward_args f{};
  f.struct_size = LOOM_MOE_FORWARD_ARGS_SIZE;
  f.seed = 5;
  f.step = 2;
  f.tokens = S;
  f.first_token = 24;
  f.model_dim = M;
  f.hidden_dim = H;
  f.num_layers = 2;
  f.training = 1;
  f.x = &x.t;
  f.weights = &wt;
  f.y = &y.t;
  f.route_experts = &re.t;
  f.route_weights = &rw.t;
  f.stats = &stats;
  f.saved = saved.t.data;
  f.saved_bytes = p.saved_bytes;
  f.workspace = ws.t.data;
  f.workspace_bytes = p.workspace_bytes;
  if ((o.rc = m.take(m.t->forward(m.obj, &f))) != 0) {
    o.error = "forward: " + m.error;
    return o;
  }
  o.aux = stats.aux_loss;
  o.dropped = stats.dropped;
  loom_moe_backward_args b{};
  b.struct_size = LOOM_MOE_BACKWARD_ARGS_SIZE;
  b.seed = 5;
  b.step = 2;
  b.tokens = S;
  b.first_token = 24;
  b.model_dim = M;
  b.hidden_dim = H;
  b.num_layers = 2;
  b.training = 1;
  b.aux_loss_coef = 0.01;
  b.x = &x.t;
  b.weights = &wt;
  b.dy = &dy.t;
  b.dx = &dx.t;
  b.grads = &gt;
  b.saved = saved.t.data;
  b.saved_bytes = p.saved_bytes;
  b.workspace = ws.t.data;
  b.workspace_bytes = p.workspace_bytes;
  if ((o.rc = m.take(m.t->backward(m.obj, &b))) != 0) {
    o.error = "backward: " + m.error;
    return o;
  }
  // dispatch the routed rows (weighted), then combine them back unweighted
  const int64_t R = p.max_expert_rows;
  Buf rows({R, M}, dtype, cuda), back({S, M}, dtype, cuda);
  std::vector<int64_t> counts(E);
  loom_moe_dispatch_args d{};
  d.struct_size = LOOM_MOE_DISPATCH_ARGS_SIZE;
  d.tokens = S;
  d.model_dim = M;
  d.top_k = K;
  d.x = &x.t;
  d.rows = &rows.t;
  d.route_experts = &re.t;
  d.route_weights = &rw.t;
  d.counts = counts.data();
  d.counts_count = E;
  d.workspace = ws.t.data;
  d.workspace_bytes = p.workspace_bytes;
  if ((o.rc = m.take(m.t->dispatch(m.obj, &d))) != 0) {
    o.error = "dispatch: " + m.error;
    return o;
  }
  // the rows dispatch wrote (the rest of `rows` is left as it was)
  int64_t used = 0;
  for (const int64_t c : counts) used += c;
  o.rows = rows.values();
  o.rows.resize(static_cast<size_t>(used * M));
  if (dtype.bits == 16) {
    o.rows16 = rows.halves();
    o.rows16.resize(o.rows.size());
  }
  if (combine_rows != nullptr) {
    std::vector<float> all(static_cast<size_t>(R * M), 0.0f);
    std::copy(combine_rows->begin(), combine_rows->end(), all.begin());
    rows.set(all);
  }
  d.x = &back.t;
  d.route_weights = nullptr;
  if ((o.rc = m.take(m.t->combine(m.obj, &d))) != 0) {
    o.error = "combine: " + m.error;
    return o;
  }
  o.y = y.values();
  o.dx = dx.values();
  o.combined = back.values();
  if (dtype.bits == 16) {
    o.y16 = y.halves();
    o.dx16 = dx.halves();
    o.combined16 = back.halves();
  }
  const auto r = re.get();
  o.route.resize(r.size() / 4);
  std::memcpy(o.route.data(), r.data(), r.size());
  o.route_weights = rw.values();
  for (auto& gb : g) {
    o.g.push_back(gb->values());
    if (gdtype.bits == 16) o.g16.push_back(gb->halves());
  }
  return o;
}

const char* kParams =
    "num_experts = 4\nk = 2\ncapacity_factor = 0.75\nmin_capacity = 0\n"
    "use_residual = true\nnoisy_gate_policy = \"Jitter\"";

TEST(MoeFloat16, SixteenBitLayersAreTheFloat32LayerRounded) {
  if (kCuda && !have_device()) GTEST_SKIP() << "no CUDA device";
  Session s(kParams);
  Moe m(s);
  const Inputs in = inputs();
  // The float32 layer on the same device, and the CPU's routing.
  const Outcome ref = run(m, in, kF32, kF32, kCuda);
  ASSERT_EQ(ref.rc, 0) << ref.error;
  const Outcome cpu = run(m, in, kF32, kF32, false);
  ASSERT_EQ(cpu.rc, 0) << cpu.error;
  EXPECT_EQ(ref.route, cpu.route);
  EXPECT_GT(ref.dropped, 0);
  for (const DLDataType dtype : {kBF16, kF16}) {
    const bool bf = is_bf16(dtype);
    for (const DLDataType gdtype : {kF32, dtype}) {
      SCOPED_TRACE(std::string(bf ? "bf16" : "f16") + (gdtype.bits == 32 ? ", f32 grads" : ""));
      const Outcome got = run(m, in, dtype, gdtype, kCuda);
      ASSERT_EQ(got.rc, 0) << got.error;
      EXPECT_EQ(got.route, ref.route);
      EXPECT_EQ(got.route_weights, ref.route_weights);
      EXPECT_EQ(got.dropped, ref.dropped);
      EXPECT_EQ(got.aux, ref.aux);
      EXPECT_EQ(got.y16, to16(ref.y, bf));
      EXPECT_EQ(got.dx16, to16(ref.dx, bf));
      // rows are the float32 rows rounded; combine reads those 16-bit rows, so its reference
      // is the float32 combine of them, rounded.
      EXPECT_EQ(got.rows16, to16(ref.rows, bf));
      const std::vector<float> rows16 = to32(got.rows16, bf);
      const Outcome back = run(m, in, kF32, kF32, kCuda, &rows16);
      ASSERT_EQ(back.rc, 0) << back.error;
      EXPECT_EQ(got.combined16, to16(back.combined, bf));
      for (size_t i = 0; i < got.g.size(); ++i) {
        if (gdtype.bits == 32) {
          EXPECT_EQ(got.g[i], ref.g[i]) << "gradient " << i;
        } else {
          EXPECT_EQ(got.g16[i], to16(ref.g[i], bf)) << "gradient " << i;
        }
      }
    }
  }
}

// A 16-bit dispatch or combine stages x and rows in its workspace: without one, or with one too
// short, it is refused by name before any work (float32 needs none).
TEST(MoeFloat16, DispatchWithoutItsStagingWorkspaceIsRefused) {
  if (kCuda && !have_device()) GTEST_SKIP() << "no CUDA device";
  Session s(kParams);
  Moe m(s);
  loom_moe_plan_args p{};
  p.struct_size = LOOM_MOE_PLAN_ARGS_SIZE;
  p.tokens = S;
  p.model_dim = M;
  p.hidden_dim = 1;
  p.num_layers = 1;
  p.dtype = kBF16;
  ASSERT_EQ(m.take(m.t->plan(m.obj, &p)), 0) << m.error;
  Buf x({S, M}, kBF16, kCuda), rows({p.max_expert_rows, M}, kBF16, kCuda), re({S, K}, kI32, kCuda),
      ws({static_cast<int64_t>(p.workspace_bytes)}, DLDataType{kDLUInt, 8, 1}, kCuda);
  x.set(std::vector<float>(static_cast<size_t>(S * M), 0.5f));
  std::vector<int32_t> route(static_cast<size_t>(S * K));
  for (size_t i = 0; i < route.size(); ++i) route[i] = static_cast<int32_t>(i % E);
  re.put(route.data());
  std::vector<int64_t> counts(E);
  loom_moe_dispatch_args d{};
  d.struct_size = LOOM_MOE_DISPATCH_ARGS_SIZE;
  d.tokens = S;
  d.model_dim = M;
  d.top_k = K;
  d.x = &x.t;
  d.rows = &rows.t;
  d.route_experts = &re.t;
  d.counts = counts.data();
  d.counts_count = E;
  for (const bool combine : {false, true}) {
    SCOPED_TRACE(combine ? "combine" : "dispatch");
    auto call = [&] {
      return m.take(combine ? m.t->combine(m.obj, &d) : m.t->dispatch(m.obj, &d));
    };
    d.workspace = nullptr;
    d.workspace_bytes = 0;
    EXPECT_EQ(call(), LOOM_ERR_INVALID_ARGUMENT);
    EXPECT_NE(m.error.find("workspace"), std::string::npos) << m.error;
    EXPECT_NE(m.error.find("is NULL"), std::string::npos) << m.error;
    d.workspace = ws.t.data;
    d.workspace_bytes = 256;
    EXPECT_EQ(call(), LOOM_ERR_INVALID_ARGUMENT);
    EXPECT_NE(m.error.find("has 256 bytes"), std::string::npos) << m.error;
    d.workspace_bytes = p.workspace_bytes;
    EXPECT_EQ(call(), 0) << m.error;
  }
}

}  // namespace
