// The 1-bit family's CUDA kernels (plugins/optimizers/kernels/onebit_cuda.hpp) against the
// scalar loops of plugins/optimizers/onebit.cpp, written out here per element on the same
// random inputs. The kernels round every operation as these loops do (this file is built
// with -ffp-contract=off), so elements should agree exactly; the check allows a few ULP.
// Reductions are compared with the CPU's sequential double sums and must be bitwise
// identical across two runs. Skips when there is no CUDA device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu.hpp"
#include "kernels/cuda.hpp"
#include "kernels/onebit_cuda.hpp"

namespace {

namespace ob = loom::optim::cuda::onebit;
namespace cu = loom::optim::cuda;
using loom::optim::DType;

constexpr int kMaxUlp = 4;

// A device buffer, freed at scope exit.
template <class T>
class Dev {
 public:
  explicit Dev(std::size_t n) : n_(n) {
    const std::string e = cu::alloc(&ptr_, std::max<std::size_t>(n, 1) * sizeof(T), 0);
    EXPECT_TRUE(e.empty()) << e;
  }
  explicit Dev(const std::vector<T>& h) : Dev(h.size()) { put(h); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  ~Dev() { cu::free(ptr_); }
  T* get() const { return static_cast<T*>(ptr_); }
  void put(const std::vector<T>& h) {
    ASSERT_EQ(h.size(), n_);
    if (n_ == 0) return;
    const std::string e = cu::copy_to_device(ptr_, h.data(), n_ * sizeof(T), nullptr);
    ASSERT_TRUE(e.empty()) << e;
  }
  std::vector<T> get_host() const {
    std::vector<T> h(n_);
    if (n_ == 0) return h;
    const std::string e = cu::copy_to_host(h.data(), ptr_, n_ * sizeof(T), nullptr);
    EXPECT_TRUE(e.empty()) << e;
    return h;
  }

 private:
  void* ptr_ = nullptr;
  std::size_t n_ = 0;
};

int64_t ordered(float f) {
  int32_t i = 0;
  std::memcpy(&i, &f, 4);
  return i < 0 ? -static_cast<int64_t>(i & 0x7FFFFFFF) : static_cast<int64_t>(i);
}

// Every element within kMaxUlp (NaN only against NaN); returns the largest distance seen.
int64_t expect_close(const std::vector<float>& got, const std::vector<float>& want,
                     const std::string& what) {
  EXPECT_EQ(got.size(), want.size()) << what;
  int64_t worst = 0;
  int failures = 0;
  for (std::size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    if (std::isnan(want[i]) || std::isnan(got[i])) {
      if (std::isnan(want[i]) != std::isnan(got[i]) && failures++ < 5) {
        ADD_FAILURE() << what << "[" << i << "]: " << got[i] << " vs " << want[i];
      }
      continue;
    }
    const int64_t d = std::llabs(ordered(got[i]) - ordered(want[i]));
    worst = std::max(worst, d);
    if (d > kMaxUlp && failures++ < 5) {
      ADD_FAILURE() << what << "[" << i << "]: " << got[i] << " vs " << want[i] << " (" << d
                    << " ulp)";
    }
  }
  return worst;
}

void expect_sum(double got, double want, const std::string& what) {
  EXPECT_LE(std::fabs(got - want), 1e-9 * std::fabs(want) + 1e-300) << what;
}

// The step's tensors in a flat layout with a 3-element gap after each (the gaps must stay
// untouched), each with its own parameter.
struct Layout {
  std::vector<std::size_t> sizes;
  std::vector<ob::Segment> segs;
  std::size_t total = 0;
};

Layout make_layout(const std::vector<std::size_t>& sizes) {
  Layout l;
  l.sizes = sizes;
  for (std::size_t n : sizes) {
    ob::Segment s;
    s.offset = l.total;
    s.n = n;
    l.segs.push_back(s);
    l.total += n + 3;
  }
  return l;
}

std::vector<Layout> layouts() {
  std::vector<Layout> out;
  out.push_back(make_layout({1}));
  out.push_back(make_layout({13}));
  out.push_back(make_layout({(std::size_t{1} << 20) + 7}));
  // Several per launch, an empty one, chunk boundaries.
  out.push_back(make_layout({1, 13, 0, 4096, 4097, 8191, 100003}));
  // More tensors than one launch takes.
  std::vector<std::size_t> many;
  std::mt19937 rng(11);
  for (int i = 0; i < 2 * static_cast<int>(ob::kMaxSegments) + 5; ++i) many.push_back(rng() % 9000);
  out.push_back(make_layout(many));
  return out;
}

std::string name_of(const Layout& l) {
  std::string s =
      std::to_string(l.sizes.size()) + " tensors, first n=" + std::to_string(l.sizes[0]);
  return s;
}

struct Rand {
  std::mt19937 rng{1234};
  std::vector<float> normal(std::size_t n, float sd) {
    std::normal_distribution<float> d(0.0f, sd);
    std::vector<float> v(n);
    for (auto& x : v) x = d(rng);
    return v;
  }
  std::vector<float> uniform(std::size_t n, float lo, float hi) {
    std::uniform_real_distribution<float> d(lo, hi);
    std::vector<float> v(n);
    for (auto& x : v) x = d(rng);
    return v;
  }
  // 0 with probability 1/4, else 1.
  std::vector<float> mask(std::size_t n) {
    std::vector<float> v(n);
    for (auto& x : v) x = (rng() & 3u) == 0 ? 0.0f : 1.0f;
    return v;
  }
};

// Per-tensor parameters on host and device.
struct Params {
  std::vector<std::vector<float>> host;
  std::vector<std::unique_ptr<Dev<float>>> dev;
  Params(Layout& l, Rand& r) {
    for (auto& s : l.segs) {
      host.push_back(r.normal(s.n, 1.0f));
      dev.push_back(std::make_unique<Dev<float>>(host.back()));
      s.p = dev.back()->get();
    }
  }
  void expect_equal(const std::string& what) {
    for (std::size_t k = 0; k < host.size(); ++k) {
      expect_close(dev[k]->get_host(), host[k], what + " p" + std::to_string(k));
    }
  }
};

// Low-precision copies: even tensors bf16, odd fp16.
struct Lows {
  std::vector<std::unique_ptr<Dev<uint16_t>>> dev;
  explicit Lows(Layout& l) {
    for (std::size_t k = 0; k < l.segs.size(); ++k) {
      dev.push_back(std::make_unique<Dev<uint16_t>>(l.segs[k].n));
      l.segs[k].low = dev.back()->get();
      l.segs[k].ltype = k % 2 == 0 ? DType::kBF16 : DType::kF16;
    }
  }
  void expect_match(const Layout& l, const Params& p, const std::string& what) {
    for (std::size_t k = 0; k < dev.size(); ++k) {
      const auto got = dev[k]->get_host();
      std::size_t bad = 0;
      for (std::size_t i = 0; i < got.size(); ++i) {
        const float x = p.host[k][i];
        const uint16_t want = l.segs[k].ltype == DType::kBF16 ? loom::optim::f32_to_bf16(x)
                                                              : loom::optim::f32_to_f16(x);
        if (got[i] != want) ++bad;
      }
      EXPECT_EQ(bad, 0u) << what << " low copy of tensor " << k;
    }
  }
};

// Per-tensor exp_avg_masks (every third tensor has none); `flat` is the effective mask in
// the flat layout (1 where a tensor has no mask, and in the gaps).
struct Masks {
  std::vector<float> flat;
  std::vector<std::unique_ptr<Dev<float>>> dev;
  Masks(Layout& l, Rand& r, bool on) : flat(l.total, 1.0f) {
    if (!on) return;
    for (std::size_t k = 0; k < l.segs.size(); ++k) {
      auto& s = l.segs[k];
      if (k % 3 == 2) continue;
      const auto m = r.mask(s.n);
      std::copy(m.begin(), m.end(), flat.begin() + static_cast<std::ptrdiff_t>(s.offset));
      dev.push_back(std::make_unique<Dev<float>>(m));
      s.mask = dev.back()->get();
    }
  }
};

class OnebitCudaKernels : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cu::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

// Decay rates as the plugins pass them: beta and 1 - beta, both from double.
constexpr loom::optim::Decay kB1 = loom::optim::decay_of(0.9);
constexpr loom::optim::Decay kB2 = loom::optim::decay_of(0.999);
constexpr float kEps = 1e-8f;

TEST_F(OnebitCudaKernels, LoadGrad) {
  Rand r;
  for (const DType gt : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (Layout l : layouts()) {
      const float inv_scale = 1.0f / 1024.0f * 3.0f;
      std::vector<float> flat = r.normal(l.total, 1.0f);
      std::vector<std::unique_ptr<Dev<float>>> g32;
      std::vector<std::unique_ptr<Dev<uint16_t>>> g16;
      std::vector<float> want = flat;
      for (auto& s : l.segs) {
        const auto g = r.normal(s.n, 100.0f);
        s.gtype = gt;
        if (gt == DType::kF32) {
          g32.push_back(std::make_unique<Dev<float>>(g));
          s.g = g32.back()->get();
          for (std::size_t i = 0; i < s.n; ++i) want[s.offset + i] = g[i] * inv_scale;
        } else {
          std::vector<uint16_t> h(s.n);
          for (std::size_t i = 0; i < s.n; ++i) {
            h[i] =
                gt == DType::kBF16 ? loom::optim::f32_to_bf16(g[i]) : loom::optim::f32_to_f16(g[i]);
            const float x =
                gt == DType::kBF16 ? loom::optim::bf16_to_f32(h[i]) : loom::optim::f16_to_f32(h[i]);
            want[s.offset + i] = x * inv_scale;
          }
          g16.push_back(std::make_unique<Dev<uint16_t>>(h));
          s.g = g16.back()->get();
        }
      }
      Dev<float> d(flat);
      const std::string e =
          ob::load_grad(l.segs.data(), l.segs.size(), d.get(), inv_scale, nullptr);
      ASSERT_TRUE(e.empty()) << e;
      expect_close(d.get_host(), want, "load_grad " + name_of(l));
    }
  }
}

TEST_F(OnebitCudaKernels, Momentum) {
  Rand r;
  for (const std::size_t n : {std::size_t{1}, std::size_t{13}, (std::size_t{1} << 20) + 7}) {
    const auto m = r.normal(n, 0.1f);
    const auto g = r.normal(n, 1.0f);
    std::vector<float> want = m;
    for (std::size_t i = 0; i < n; ++i) want[i] = kB1.beta * m[i] + kB1.rest * g[i];
    Dev<float> dm(m), dg(g);
    const std::string e = ob::momentum(dm.get(), dg.get(), n, kB1, nullptr);
    ASSERT_TRUE(e.empty()) << e;
    expect_close(dm.get_host(), want, "momentum n=" + std::to_string(n));
  }
}

TEST_F(OnebitCudaKernels, MaskMultiply) {
  Rand r;
  for (Layout l : layouts()) {
    Masks mk(l, r, true);
    const auto x = r.normal(l.total, 1.0f);
    std::vector<float> want = x;
    for (std::size_t f = 0; f < l.total; ++f) want[f] = x[f] * mk.flat[f];
    Dev<float> dx(x);
    const std::string e = ob::mask_multiply(l.segs.data(), l.segs.size(), dx.get(), nullptr);
    ASSERT_TRUE(e.empty()) << e;
    const auto got = dx.get_host();
    expect_close(got, want, "mask_multiply " + name_of(l));
    for (std::size_t f = 0; f < l.total; ++f) {
      if (mk.flat[f] == 0.0f) ASSERT_EQ(got[f], 0.0f) << f;
    }
  }
}

TEST_F(OnebitCudaKernels, MomentumSegments) {
  Rand r;
  for (Layout l : layouts()) {
    auto m = r.normal(l.total, 0.1f);
    const auto g = r.normal(l.total, 1.0f);
    const auto prev0 = r.normal(l.total, 1.0f);
    std::vector<float> want = m;
    std::vector<float> want_prev = prev0;
    for (std::size_t k = 0; k < l.segs.size(); ++k) {
      auto& s = l.segs[k];
      s.scale = 0.5f + static_cast<float>(k) * 0.37f;
      for (std::size_t i = s.offset; i < s.offset + s.n; ++i) {
        want_prev[i] = m[i];
        want[i] = (kB1.beta * m[i] + kB1.rest * g[i]) * s.scale;
      }
    }
    Dev<float> dm(m), dg(g), dp(prev0);
    const std::string e = ob::momentum_segments(l.segs.data(), l.segs.size(), dm.get(), dg.get(),
                                                dp.get(), kB1, nullptr);
    ASSERT_TRUE(e.empty()) << e;
    expect_close(dm.get_host(), want, "momentum_segments m " + name_of(l));
    expect_close(dp.get_host(), want_prev, "momentum_segments m_prev " + name_of(l));
  }
}

TEST_F(OnebitCudaKernels, ApplyAdam) {
  Rand r;
  for (const bool masked : {false, true}) {
    for (Layout l : layouts()) {
      Params p(l, r);
      Lows low(l);
      auto m = r.normal(l.total, 0.1f);
      const auto v = r.uniform(l.total, 0.0f, 0.01f);
      Masks mk(l, r, masked);
      const auto& mask = mk.flat;
      const float inv_bc2 = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(0.999, 7.0)));
      std::vector<float> want_m = m;
      for (std::size_t k = 0; k < l.segs.size(); ++k) {
        auto& s = l.segs[k];
        const double lr = 1e-3 * (1.0 + static_cast<double>(k % 3));
        s.decay = static_cast<float>(1.0 - lr * 0.01);
        s.step = static_cast<float>(lr / (1.0 - std::pow(0.9, 7.0)));
        for (std::size_t i = 0; i < s.n; ++i) {
          float& mi = want_m[s.offset + i];
          if (masked) mi *= mask[s.offset + i];
          float& pi = p.host[k][i];
          pi = pi * s.decay - s.step * (mi / (std::sqrt(v[s.offset + i]) * inv_bc2 + kEps));
        }
      }
      Dev<float> dm(m), dv(v);
      const std::string e =
          ob::apply_adam(l.segs.data(), l.segs.size(), dm.get(), dv.get(), inv_bc2, kEps, nullptr);
      ASSERT_TRUE(e.empty()) << e;
      const auto got_m = dm.get_host();
      expect_close(got_m, want_m, "apply_adam m " + name_of(l));
      if (masked) {
        for (const auto& s : l.segs) {
          for (std::size_t i = s.offset; i < s.offset + s.n; ++i) {
            if (mask[i] == 0.0f) ASSERT_EQ(got_m[i], 0.0f) << "masked momentum " << i;
          }
        }
      }
      p.expect_equal("apply_adam " + name_of(l));
      low.expect_match(l, p, "apply_adam " + name_of(l));
    }
  }
}

TEST_F(OnebitCudaKernels, ZeroOneLocalAndSync) {
  Rand r;
  for (Layout l : layouts()) {
    Params p(l, r);
    Lows low(l);
    auto m = r.normal(l.total, 0.1f);
    const auto v = r.uniform(l.total, 0.0f, 0.01f);
    auto u = r.normal(l.total, 1e-3f);
    Masks mk(l, r, true);
    const auto& mask = mk.flat;
    const float inv_bc1 = static_cast<float>(1.0 / (1.0 - std::pow(0.9, 40.0)));
    const float inv_bc2 = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(0.999, 30.0)));
    Dev<float> dm(m), dv(v), du(u);
    // Local step.
    for (std::size_t k = 0; k < l.segs.size(); ++k) {
      auto& s = l.segs[k];
      s.lr = static_cast<float>(1e-3 * (1.0 + static_cast<double>(k % 2)));
      s.wd = k % 3 == 0 ? 0.0f : 0.01f;
      for (std::size_t i = 0; i < s.n; ++i) {
        const std::size_t f = s.offset + i;
        float& pi = p.host[k][i];
        const float d = m[f] * inv_bc1 / (std::sqrt(v[f]) * inv_bc2 + kEps) + s.wd * pi;
        pi -= s.lr * d;
        u[f] -= s.lr * d;
      }
    }
    std::string e = ob::zero_one_local(l.segs.data(), l.segs.size(), dm.get(), dv.get(), du.get(),
                                       inv_bc1, inv_bc2, kEps, nullptr);
    ASSERT_TRUE(e.empty()) << e;
    p.expect_equal("zero_one_local " + name_of(l));
    expect_close(du.get_host(), u, "zero_one_local u " + name_of(l));
    low.expect_match(l, p, "zero_one_local " + name_of(l));
    // Sync: pre, (the allreduce), post with a mask.
    for (std::size_t k = 0; k < l.segs.size(); ++k) {
      const auto& s = l.segs[k];
      for (std::size_t i = 0; i < s.n; ++i) {
        const std::size_t f = s.offset + i;
        p.host[k][i] -= u[f];
        u[f] *= std::sqrt(v[f]) * inv_bc2 + kEps;
      }
    }
    e = ob::zero_one_sync_pre(l.segs.data(), l.segs.size(), dv.get(), du.get(), inv_bc2, kEps,
                              nullptr);
    ASSERT_TRUE(e.empty()) << e;
    p.expect_equal("zero_one_sync_pre " + name_of(l));
    expect_close(du.get_host(), u, "zero_one_sync_pre u " + name_of(l));
    const float scale = static_cast<float>(-(1.0 - std::pow(0.9, 40.0)) / 3e-3);
    for (std::size_t k = 0; k < l.segs.size(); ++k) {
      const auto& s = l.segs[k];
      for (std::size_t i = 0; i < s.n; ++i) {
        const std::size_t f = s.offset + i;
        u[f] *= mask[f];
        m[f] = u[f] * scale;
        p.host[k][i] += u[f] / (std::sqrt(v[f]) * inv_bc2 + kEps);
        u[f] = 0.0f;
      }
    }
    e = ob::zero_one_sync_post(l.segs.data(), l.segs.size(), dm.get(), dv.get(), du.get(), scale,
                               inv_bc2, kEps, nullptr);
    ASSERT_TRUE(e.empty()) << e;
    p.expect_equal("zero_one_sync_post " + name_of(l));
    const auto got_m = dm.get_host();
    expect_close(got_m, m, "zero_one_sync_post m " + name_of(l));
    expect_close(du.get_host(), u, "zero_one_sync_post u " + name_of(l));
    for (const auto& s : l.segs) {
      for (std::size_t i = s.offset; i < s.offset + s.n; ++i) {
        if (mask[i] == 0.0f) ASSERT_EQ(got_m[i], 0.0f) << "masked momentum " << i;
      }
    }
    low.expect_match(l, p, "zero_one_sync_post " + name_of(l));
  }
}

TEST_F(OnebitCudaKernels, CopyOut) {
  Rand r;
  for (Layout l : layouts()) {
    Params p(l, r);
    // Values that exercise rounding: subnormal halves, overflow, ties.
    for (auto& h : p.host) {
      for (std::size_t i = 0; i < h.size(); ++i) {
        if (i % 7 == 1) h[i] *= 1e-6f;
        if (i % 11 == 2) h[i] *= 1e5f;
      }
    }
    for (std::size_t k = 0; k < l.segs.size(); ++k) p.dev[k]->put(p.host[k]);
    Lows low(l);
    const std::string e = ob::copy_out(l.segs.data(), l.segs.size(), nullptr);
    ASSERT_TRUE(e.empty()) << e;
    low.expect_match(l, p, "copy_out " + name_of(l));
  }
}

// shard_state's compressed parameter update: p += flat[offset + i], then the low copies.
TEST_F(OnebitCudaKernels, AddUpdate) {
  Rand r;
  for (Layout l : layouts()) {
    Params p(l, r);
    const auto flat = r.normal(l.total, 0.01f);
    for (std::size_t k = 0; k < l.segs.size(); ++k) {
      for (std::size_t i = 0; i < l.segs[k].n; ++i) p.host[k][i] += flat[l.segs[k].offset + i];
    }
    Lows low(l);
    Dev<float> df(flat);
    const std::string e = ob::add_update(l.segs.data(), l.segs.size(), df.get(), nullptr);
    ASSERT_TRUE(e.empty()) << e;
    p.expect_equal("add_update " + name_of(l));
    low.expect_match(l, p, "add_update " + name_of(l));
  }
}

TEST_F(OnebitCudaKernels, LambWarmupMomentsAndApply) {
  Rand r;
  for (Layout l : layouts()) {
    Params p(l, r);
    Lows low(l);
    const auto m0 = r.normal(l.total, 0.1f);
    const auto v0 = r.uniform(l.total, 0.0f, 0.01f);
    const auto g = r.normal(l.total, 1.0f);
    const float inv_bc1 = static_cast<float>(1.0 / (1.0 - std::pow(0.9, 5.0)));
    const float inv_bc2 = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(0.999, 5.0)));
    auto m = m0;
    auto v = v0;
    std::vector<double> want(2 * l.segs.size(), 0.0);
    for (std::size_t k = 0; k < l.segs.size(); ++k) {
      auto& s = l.segs[k];
      s.wd = k % 2 == 0 ? 0.01f : 0.0f;
      double sp = 0.0;
      double su = 0.0;
      for (std::size_t i = 0; i < s.n; ++i) {
        const std::size_t f = s.offset + i;
        m[f] = kB1.beta * m[f] + kB1.rest * g[f];
        v[f] = kB2.beta * v[f] + kB2.rest * g[f] * g[f];
        const float pi = p.host[k][i];
        const float u = s.wd * pi + (m[f] * inv_bc1) / (std::sqrt(v[f]) * inv_bc2 + kEps);
        sp += static_cast<double>(pi) * pi;
        su += static_cast<double>(u) * u;
      }
      want[2 * k] = sp;
      want[2 * k + 1] = su;
    }
    Dev<float> dg(g), dm(m0), dv(v0);
    std::vector<double> got(2 * l.segs.size(), -1.0);
    std::string e =
        ob::lamb_warmup_moments(l.segs.data(), l.segs.size(), dg.get(), dm.get(), dv.get(), kB1,
                                kB2, inv_bc1, inv_bc2, kEps, got.data(), nullptr);
    ASSERT_TRUE(e.empty()) << e;
    expect_close(dm.get_host(), m, "lamb_warmup_moments m " + name_of(l));
    expect_close(dv.get_host(), v, "lamb_warmup_moments v " + name_of(l));
    for (std::size_t k = 0; k < got.size(); ++k) {
      expect_sum(got[k], want[k], "lamb_warmup_moments sum " + std::to_string(k));
    }
    // The same inputs again: the sums are bitwise identical.
    dm.put(m0);
    dv.put(v0);
    std::vector<double> again(got.size(), -1.0);
    e = ob::lamb_warmup_moments(l.segs.data(), l.segs.size(), dg.get(), dm.get(), dv.get(), kB1,
                                kB2, inv_bc1, inv_bc2, kEps, again.data(), nullptr);
    ASSERT_TRUE(e.empty()) << e;
    EXPECT_EQ(std::memcmp(got.data(), again.data(), got.size() * sizeof(double)), 0);
    // Pass 2 with the host's trust ratio, as onebit.cpp computes it.
    for (std::size_t k = 0; k < l.segs.size(); ++k) {
      auto& s = l.segs[k];
      double coeff = 1.0;
      if (got[2 * k] > 0.0 && got[2 * k + 1] > 0.0) {
        coeff = std::clamp(std::sqrt(got[2 * k]) / std::sqrt(got[2 * k + 1]), 0.01, 10.0);
      }
      s.step = static_cast<float>(1e-2 * coeff);
      for (std::size_t i = 0; i < s.n; ++i) {
        const std::size_t f = s.offset + i;
        float& pi = p.host[k][i];
        const float u = m[f] * inv_bc1 / (std::sqrt(v[f]) * inv_bc2 + kEps) + s.wd * pi;
        pi -= s.step * u;
      }
    }
    e = ob::lamb_apply(l.segs.data(), l.segs.size(), dm.get(), dv.get(), inv_bc1, inv_bc2, kEps,
                       nullptr);
    ASSERT_TRUE(e.empty()) << e;
    p.expect_equal("lamb_apply " + name_of(l));
    low.expect_match(l, p, "lamb_apply " + name_of(l));
  }
}

TEST_F(OnebitCudaKernels, SumSquares) {
  Rand r;
  for (Layout l : layouts()) {
    const auto m = r.normal(l.total, 0.1f);
    std::vector<double> want(l.segs.size(), 0.0);
    for (std::size_t k = 0; k < l.segs.size(); ++k) {
      const auto& s = l.segs[k];
      double acc = 0.0;
      for (std::size_t i = s.offset; i < s.offset + s.n; ++i)
        acc += static_cast<double>(m[i]) * m[i];
      want[k] = acc;
    }
    Dev<float> dm(m);
    std::vector<double> got(l.segs.size(), -1.0);
    std::vector<double> again(l.segs.size(), -2.0);
    std::string e = ob::sum_squares(l.segs.data(), l.segs.size(), dm.get(), got.data(), nullptr);
    ASSERT_TRUE(e.empty()) << e;
    e = ob::sum_squares(l.segs.data(), l.segs.size(), dm.get(), again.data(), nullptr);
    ASSERT_TRUE(e.empty()) << e;
    for (std::size_t k = 0; k < got.size(); ++k) {
      expect_sum(got[k], want[k], "sum_squares " + std::to_string(k) + " " + name_of(l));
    }
    EXPECT_EQ(std::memcmp(got.data(), again.data(), got.size() * sizeof(double)), 0);
  }
}

TEST_F(OnebitCudaKernels, LambPost) {
  Rand r;
  for (const bool masked : {false, true}) {
    for (Layout l : layouts()) {
      Params p(l, r);
      const auto m0 = r.normal(l.total, 0.1f);
      const auto mp = r.normal(l.total, 0.1f);
      const auto v = r.uniform(l.total, 0.0f, 0.01f);
      const auto vf0 = r.uniform(l.total, 0.0f, 0.01f);
      Masks mk(l, r, masked);
      const auto& mask = mk.flat;
      const float inv_bc1 = static_cast<float>(1.0 / (1.0 - std::pow(0.9, 50.0)));
      const float inv_bc2 = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(0.999, 20.0)));
      const float inv_bc2_fresh = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(0.999, 50.0)));
      auto m = m0;
      auto vf = vf0;
      std::vector<ob::LambPostStats> want(l.segs.size());
      for (std::size_t k = 0; k < l.segs.size(); ++k) {
        auto& s = l.segs[k];
        s.wd = k % 2 == 0 ? 0.01f : 0.0f;
        s.scale = static_cast<float>(1.0 / (0.3 + 0.2 * static_cast<double>(k)));
        double pre2 = 0.0;
        double u2 = 0.0;
        float factor = 0.0f;
        for (std::size_t i = 0; i < s.n; ++i) {
          const std::size_t f = s.offset + i;
          m[f] *= s.scale;
          if (masked) m[f] *= mask[f];
          const float gh = (m[f] - kB1.beta * mp[f]) / kB1.rest;
          vf[f] = kB2.beta * vf[f] + kB2.rest * gh * gh;
          const float denom = std::sqrt(v[f]) * inv_bc2 + kEps;
          const float pre = m[f] * inv_bc1 / denom;
          const float u = pre + s.wd * p.host[k][i];
          pre2 += static_cast<double>(pre) * pre;
          u2 += static_cast<double>(u) * u;
          factor = std::max(factor, denom / (std::sqrt(vf[f]) * inv_bc2_fresh + kEps));
        }
        want[k] = {pre2, u2, factor};
      }
      Dev<float> dm(m0), dmp(mp), dv(v), dvf(vf0);
      std::vector<ob::LambPostStats> got(l.segs.size());
      auto run = [&](std::vector<ob::LambPostStats>& out) {
        const std::string e =
            ob::lamb_post(l.segs.data(), l.segs.size(), dm.get(), dmp.get(), dv.get(), dvf.get(),
                          kB1, kB2, inv_bc1, inv_bc2, inv_bc2_fresh, kEps, out.data(), nullptr);
        ASSERT_TRUE(e.empty()) << e;
      };
      run(got);
      const auto got_m = dm.get_host();
      expect_close(got_m, m, "lamb_post m " + name_of(l));
      expect_close(dvf.get_host(), vf, "lamb_post vf " + name_of(l));
      p.expect_equal("lamb_post (p unchanged) " + name_of(l));
      for (std::size_t k = 0; k < got.size(); ++k) {
        const std::string what = "lamb_post tensor " + std::to_string(k) + " " + name_of(l);
        expect_sum(got[k].pre2, want[k].pre2, what + " pre2");
        expect_sum(got[k].u2, want[k].u2, what + " u2");
        EXPECT_LE(std::llabs(ordered(got[k].factor) - ordered(want[k].factor)), kMaxUlp)
            << what << " factor " << got[k].factor << " vs " << want[k].factor;
      }
      if (masked) {
        for (const auto& s : l.segs) {
          for (std::size_t i = s.offset; i < s.offset + s.n; ++i) {
            if (mask[i] == 0.0f) ASSERT_EQ(got_m[i], 0.0f) << "masked momentum " << i;
          }
        }
      }
      // Same inputs again: bitwise identical results.
      dm.put(m0);
      dvf.put(vf0);
      std::vector<ob::LambPostStats> again(l.segs.size());
      run(again);
      for (std::size_t k = 0; k < got.size(); ++k) {
        EXPECT_EQ(std::memcmp(&got[k].pre2, &again[k].pre2, sizeof(double)), 0) << k;
        EXPECT_EQ(std::memcmp(&got[k].u2, &again[k].u2, sizeof(double)), 0) << k;
        EXPECT_EQ(std::memcmp(&got[k].factor, &again[k].factor, sizeof(float)), 0) << k;
      }
    }
  }
}

TEST_F(OnebitCudaKernels, CopyDevice) {
  Rand r;
  const std::size_t n = (std::size_t{1} << 20) + 7;
  const auto a = r.normal(n, 1.0f);
  Dev<float> src(a), dst(n);
  const std::string e = ob::copy_device(dst.get(), src.get(), n * sizeof(float), nullptr);
  ASSERT_TRUE(e.empty()) << e;
  EXPECT_EQ(dst.get_host(), a);
}

}  // namespace
