// The skipped-step scenario of adam and lamb (a NaN or an Inf gradient at step k), written
// once over where the tensors live: host memory (nonfinite_test.cpp) or a CUDA device
// (nonfinite_cuda_test.cpp). Assertions are gtest's, so a caller wraps it in a TEST.
#pragma once

#include <gtest/gtest.h>
#include <loom/embed.h>
#include <loom/kinds/optimizer.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace loom_test {

// Where the tensors live.
struct Memory {
  DLDevice device{kDLCPU, 0};
  std::function<void*(size_t)> alloc;
  std::function<void(void*)> release;
  std::function<void(void*, const void*, size_t)> to_device;  // (device dst, host src, bytes)
  std::function<void(void*, const void*, size_t)> to_host;    // (host dst, device src, bytes)
};

inline Memory host_memory() {
  Memory m;
  m.alloc = [](size_t bytes) { return ::operator new(bytes == 0 ? 1 : bytes); };
  m.release = [](void* p) { ::operator delete(p); };
  m.to_device = [](void* d, const void* s, size_t b) { std::memcpy(d, s, b); };
  m.to_host = [](void* d, const void* s, size_t b) { std::memcpy(d, s, b); };
  return m;
}

struct OptSession {
  loom_session* s = nullptr;
  loom_instance* opt = nullptr;
  explicit OptSession(const std::string& toml) {
    loom_open_options o{};
    o.struct_size = LOOM_OPEN_OPTIONS_SIZE;
    o.log_level = -1;
    if (loom_open_string(toml.c_str(), "nonfinite.toml", &o, &s) != 0) {
      ADD_FAILURE() << "open: " << loom_last_error();
      return;
    }
    if (loom_find_instance(s, "loom.optimizer/1", "opt", &opt) != 0) {
      ADD_FAILURE() << "find: " << loom_last_error();
    }
  }
  ~OptSession() { loom_close(s); }
  OptSession(const OptSession&) = delete;
  OptSession& operator=(const OptSession&) = delete;

  std::vector<uint8_t> state() {
    size_t size = 0;
    EXPECT_EQ(loom_instance_export_state(opt, nullptr, 0, &size), 0) << loom_last_error();
    std::vector<uint8_t> buf(size);
    EXPECT_EQ(loom_instance_export_state(opt, buf.data(), buf.size(), &size), 0)
        << loom_last_error();
    buf.resize(size);
    return buf;
  }
  uint64_t skipped() {
    loom_optimizer_comm_info ci{};
    ci.struct_size = LOOM_OPTIMIZER_COMM_INFO_SIZE;
    EXPECT_EQ(loom_optimizer_get_comm_info(opt, &ci), 0) << loom_last_error();
    return ci.skipped_steps;
  }
};

// fp32 parameters and gradients (fp32, or fp16 when `f16_grads`) of several sizes, on the
// memory's device, one group.
class Model {
 public:
  Model(const Memory& mem, bool f16_grads, uint32_t seed) : mem_(mem), f16_(f16_grads) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d;
    shapes_ = {1, 37, 5000, 4096 * 2 + 3};
    for (int64_t n : shapes_) {
      std::vector<float> p(static_cast<size_t>(n));
      for (auto& x : p) x = d(rng);
      void* dp = mem_.alloc(p.size() * 4);
      mem_.to_device(dp, p.data(), p.size() * 4);
      params_.push_back(dp);
      grads_.push_back(mem_.alloc(p.size() * (f16_ ? 2 : 4)));
    }
  }
  ~Model() {
    for (void* p : params_) mem_.release(p);
    for (void* g : grads_) mem_.release(g);
  }
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  size_t count() const { return shapes_.size(); }
  int64_t size(size_t i) const { return shapes_[i]; }

  // Gradients from `values` (fp32; truncated to fp16 when the gradients are fp16: the runs
  // of a scenario get the same bits, NaN and Inf stay NaN and Inf).
  void set_grads(const std::vector<std::vector<float>>& values) {
    for (size_t i = 0; i < count(); ++i) {
      if (!f16_) {
        mem_.to_device(grads_[i], values[i].data(), values[i].size() * 4);
        continue;
      }
      std::vector<uint16_t> h(values[i].size());
      for (size_t k = 0; k < h.size(); ++k) h[k] = to_f16(values[i][k]);
      mem_.to_device(grads_[i], h.data(), h.size() * 2);
    }
  }

  // All parameters, concatenated, as bytes.
  std::vector<float> params() const {
    std::vector<float> out;
    for (size_t i = 0; i < count(); ++i) {
      std::vector<float> p(static_cast<size_t>(shapes_[i]));
      mem_.to_host(p.data(), params_[i], p.size() * 4);
      out.insert(out.end(), p.begin(), p.end());
    }
    return out;
  }

  // One step; `args_size` is the struct_size the caller claims (an older caller's is
  // shorter and has no found_inf).
  int32_t step(loom_instance* opt, int64_t t, double grad_scale, int32_t* found_inf,
               uint32_t args_size = LOOM_OPTIMIZER_STEP_ARGS_SIZE) {
    std::vector<DLTensor> tp(count()), tg(count());
    std::vector<loom_optimizer_tensor> ts(count());
    for (size_t i = 0; i < count(); ++i) {
      tp[i] = tensor(params_[i], &shapes_[i], {kDLFloat, 32, 1});
      tg[i] = tensor(grads_[i], &shapes_[i],
                     f16_ ? DLDataType{kDLFloat, 16, 1} : DLDataType{kDLFloat, 32, 1});
      ts[i] = {LOOM_OPTIMIZER_TENSOR_SIZE, 0, &tp[i], &tg[i], nullptr};
    }
    const loom_optimizer_group g{LOOM_OPTIMIZER_GROUP_SIZE, 0, ts.data(), ts.size(), 1.0, NAN};
    loom_optimizer_step_args a{};
    a.struct_size = args_size;
    a.groups = &g;
    a.group_count = 1;
    a.lr = 1e-2;
    a.grad_scale = grad_scale;
    a.step = t;
    a.found_inf = found_inf;
    return loom_optimizer_step(opt, &a);
  }

 private:
  DLTensor tensor(void* data, int64_t* shape, DLDataType dt) const {
    DLTensor t{};
    t.data = data;
    t.device = mem_.device;
    t.ndim = 1;
    t.dtype = dt;
    t.shape = shape;
    return t;
  }
  static uint16_t to_f16(float f) {
    if (std::isnan(f)) return 0x7E00;
    if (std::isinf(f)) return f > 0 ? 0x7C00 : 0xFC00;
    // Normal and subnormal halves by truncation (|f| < 65504 here).
    const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
    const double a = std::fabs(static_cast<double>(f));
    if (a == 0.0) return sign;
    int e = 0;
    const double m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
    const int exp16 = e - 1 + 15;
    if (exp16 <= 0) {
      return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::ldexp(a, 24)));
    }
    const auto man = static_cast<uint16_t>(std::ldexp(m * 2.0 - 1.0, 10));
    return static_cast<uint16_t>(sign | (exp16 << 10) | man);
  }

  Memory mem_;
  bool f16_;
  std::vector<int64_t> shapes_;
  std::vector<void*> params_;
  std::vector<void*> grads_;
};

// Gradient values for the model's tensors: multiples of 2^-10 in [-4, 4], times `scale`.
inline std::vector<std::vector<float>> random_grads(const Model& m, std::mt19937& rng,
                                                    float scale) {
  std::uniform_int_distribution<int> d(-4096, 4096);
  std::vector<std::vector<float>> out(m.count());
  for (size_t i = 0; i < m.count(); ++i) {
    out[i].resize(static_cast<size_t>(m.size(i)));
    for (auto& x : out[i]) x = std::ldexp(static_cast<float>(d(rng)), -10) * scale;
  }
  return out;
}

enum class Bad { kNaN, kInf, kNegInf, kOverflow };

inline const char* bad_name(Bad b) {
  switch (b) {
    case Bad::kNaN:
      return "NaN";
    case Bad::kInf:
      return "+Inf";
    case Bad::kNegInf:
      return "-Inf";
    case Bad::kOverflow:
      return "finite but Inf once divided by grad_scale";
  }
  return "";
}

// Step k's gradients are `good` with one element of one tensor made non-finite; returns the
// grad_scale to use for that step (kOverflow: a tiny scale that makes a finite grad Inf).
inline double make_bad(std::vector<std::vector<float>>& g, Bad b, size_t tensor, size_t at,
                       double scale, bool f16) {
  switch (b) {
    case Bad::kNaN:
      g[tensor][at] = std::numeric_limits<float>::quiet_NaN();
      return scale;
    case Bad::kInf:
      g[tensor][at] = std::numeric_limits<float>::infinity();
      return scale;
    case Bad::kNegInf:
      g[tensor][at] = -std::numeric_limits<float>::infinity();
      return scale;
    case Bad::kOverflow:
      // fp32: 2^127 / 2^-2 overflows; fp16: 4 / 2^-127 does. Other elements stay finite.
      for (auto& t : g) {
        for (auto& x : t) x = 0.0f;
      }
      g[tensor][at] = f16 ? 4.0f : std::ldexp(1.0f, 127);
      return f16 ? std::ldexp(1.0, -127) : 0.25;
  }
  return scale;
}

// The scenario: k - 1 finite steps, then step k with a non-finite gradient (skipped: found_inf
// 1, parameters and exported state byte-identical, skipped_steps 1), then two finite steps
// that equal a run that never saw step k. With skip_nonfinite = false, step k's NaN or Inf
// reaches the parameter and nothing is reported.
inline void run_skip_scenario(const Memory& mem, const std::string& plugin,
                              const std::string& extra, bool f16_grads, Bad bad, int k) {
  SCOPED_TRACE(plugin + " " + extra + (f16_grads ? " fp16 grads, " : " fp32 grads, ") +
               bad_name(bad) + " at step " + std::to_string(k));
  const std::string toml = "[optimizer.opt]\nplugin = \"" + plugin + "\"\n" + extra;
  OptSession a(toml), b(toml), off(toml + "skip_nonfinite = false\n");
  ASSERT_NE(a.opt, nullptr);
  ASSERT_NE(b.opt, nullptr);
  ASSERT_NE(off.opt, nullptr);
  Model ma(mem, f16_grads, 11), mb(mem, f16_grads, 11), moff(mem, f16_grads, 11);
  std::mt19937 rng(5);
  const double scale = 4.0;
  int32_t found = -1;
  for (int t = 1; t < k; ++t) {
    const auto g = random_grads(ma, rng, static_cast<float>(scale));
    for (Model* m : {&ma, &mb, &moff}) m->set_grads(g);
    found = -1;
    ASSERT_EQ(ma.step(a.opt, t, scale, &found), 0) << loom_last_error();
    EXPECT_EQ(found, 0) << "step " << t;
    ASSERT_EQ(mb.step(b.opt, t, scale, nullptr), 0) << loom_last_error();
    ASSERT_EQ(moff.step(off.opt, t, scale, &found), 0) << loom_last_error();
  }
  // Step k: the bad element is in the third tensor, so the check must cover all of them.
  auto g = random_grads(ma, rng, static_cast<float>(scale));
  const size_t at = 4321;
  const double bad_scale = make_bad(g, bad, 2, at, scale, f16_grads);
  ma.set_grads(g);
  moff.set_grads(g);
  const auto p_before = ma.params();
  const auto s_before = a.state();
  found = -1;
  ASSERT_EQ(ma.step(a.opt, k, bad_scale, &found), 0) << loom_last_error();
  EXPECT_EQ(found, 1);
  EXPECT_EQ(ma.params(), p_before) << "a skipped step changed the parameters";
  EXPECT_EQ(a.state(), s_before) << "a skipped step changed the optimizer state";
  EXPECT_EQ(a.skipped(), 1u);
  EXPECT_EQ(b.skipped(), 0u);
  // Opt-out: today's behaviour, the non-finite value reaches the parameter.
  found = -1;
  ASSERT_EQ(moff.step(off.opt, k, bad_scale, &found), 0) << loom_last_error();
  EXPECT_EQ(found, 0);
  EXPECT_FALSE(std::isfinite(moff.params()[1 + 37 + at])) << "skip_nonfinite = false";
  EXPECT_EQ(off.skipped(), 0u);
  // The next steps: as if step k had never happened (b sees them as its steps k, k + 1).
  for (int t = k + 1; t <= k + 2; ++t) {
    const auto gn = random_grads(ma, rng, static_cast<float>(scale));
    ma.set_grads(gn);
    mb.set_grads(gn);
    found = -1;
    ASSERT_EQ(ma.step(a.opt, t, scale, &found), 0) << loom_last_error();
    EXPECT_EQ(found, 0);
    ASSERT_EQ(mb.step(b.opt, t - 1, scale, nullptr), 0) << loom_last_error();
    const auto pa = ma.params();
    const auto pb = mb.params();
    ASSERT_EQ(pa.size(), pb.size());
    EXPECT_EQ(0, std::memcmp(pa.data(), pb.data(), pa.size() * 4)) << "after step " << t;
    EXPECT_EQ(a.state(), b.state()) << "after step " << t;
  }
  EXPECT_EQ(a.skipped(), 1u);
}

// A caller built against ABI 1.1 (step args without found_inf): the step is still skipped;
// nothing is written past the struct it passed.
inline void run_old_caller_scenario(const Memory& mem, const std::string& plugin) {
  SCOPED_TRACE(plugin);
  OptSession a("[optimizer.opt]\nplugin = \"" + plugin + "\"\n");
  ASSERT_NE(a.opt, nullptr);
  Model m(mem, false, 3);
  std::mt19937 rng(9);
  m.set_grads(random_grads(m, rng, 1.0f));
  ASSERT_EQ(m.step(a.opt, 1, 1.0, nullptr), 0) << loom_last_error();
  auto g = random_grads(m, rng, 1.0f);
  g[0][0] = std::numeric_limits<float>::quiet_NaN();
  m.set_grads(g);
  const auto p = m.params();
  const auto s = a.state();
  int32_t untouched = -7;
  const uint32_t v11 = LOOM_STRUCT_SIZE(loom_optimizer_step_args, stream);
  ASSERT_EQ(m.step(a.opt, 2, 1.0, &untouched, v11), 0) << loom_last_error();
  EXPECT_EQ(untouched, -7) << "found_inf is past the caller's struct_size";
  EXPECT_EQ(m.params(), p);
  EXPECT_EQ(a.state(), s);
  EXPECT_EQ(a.skipped(), 1u);
  // A 1.1 comm_info struct (without skipped_steps) still works.
  loom_optimizer_comm_info ci{};
  ci.struct_size = LOOM_STRUCT_SIZE(loom_optimizer_comm_info, uncompressed_bytes_sent);
  ci.skipped_steps = 99;
  ASSERT_EQ(loom_optimizer_get_comm_info(a.opt, &ci), 0) << loom_last_error();
  EXPECT_EQ(ci.skipped_steps, 99u);
  EXPECT_EQ(ci.owns_communication, 0);
}

}  // namespace loom_test
