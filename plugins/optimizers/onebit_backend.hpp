// The elementwise and reduction primitives of the 1-bit optimizer family (onebit.hpp), behind
// one interface with a CPU and a CUDA implementation: backend.hpp's Backend (the fused Adam
// and LAMB kernels, shared with adam and lamb) extended with the family's own loops. The
// algorithms (onebit_adam.cpp, zero_one_adam.cpp, onebit_lamb.cpp) are written once
// (schedules, bias corrections, LAMB's trust-ratio EMA and factor clamps, scaling
// coefficients: all host-side scalar logic) and call these for every loop over elements.
//
// Buffers are flat fp32 arrays (the optimizer's m, v, aux, gradient scratch) on the
// backend's device; a Segment (kernels/onebit_cuda.hpp) is one tensor of the step: its
// range [offset, offset + n) of the flat buffers, its own parameter p, exp_avg_mask, low
// copy, gradient, and the per-tensor scalars each primitive documents there.
//
// Decay rates cross as loom::optim::Decay: beta and 1 - beta, each computed in double and
// rounded to fp32 once (decay_of), never 1 - float(beta).
//
// CPU: threaded with parallel_for, the Highway kernels of kernels/cpu.hpp where they apply.
// CUDA: kernels/onebit_cuda.hpp and kernels/cuda.hpp, every launch and copy ordered on the
// stream given to begin() (the step's stream; begin()/end() order the state across streams,
// backend.hpp); primitives that return values to the host (the reductions) synchronize that
// stream.
// Errors throw loom::sdk::Error (INTERNAL for a CUDA failure).
#pragma once

#include <loom/sdk.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <string>
#include <vector>

#include "backend.hpp"
#include "common/parallel_for.hpp"
#include "kernels/cpu.hpp"
#include "kernels/cuda.hpp"
#include "kernels/onebit_cuda.hpp"  // Segment, LambPostStats (plain C++ declarations)

namespace loom::optim::onebit {

using Segment = loom::optim::cuda::onebit::Segment;
using LambPostStats = loom::optim::cuda::onebit::LambPostStats;
using Segments = std::vector<Segment>;

template <class Fn>
void for_range(std::size_t n, Fn&& fn) {
  loom::plugins::parallel_for(n, 1 << 15, [&](std::size_t b, std::size_t e) {
    for (std::size_t i = b; i < e; ++i) fn(i);
  });
}

// Semantics of every primitive: kernels/onebit_cuda.hpp (the function of the same name)
// unless noted; adam() and lamb(): backend.hpp.
class Backend : public loom::optim::Backend {
 public:
  // flat[offset + i] = float(seg.g[i]) * inv_scale.
  virtual void load_grad(const Segments& s, float* flat, float inv_scale) = 0;
  // dst[0, n) = src[0, n) (same device).
  virtual void copy(float* dst, const float* src, std::size_t n) = 0;
  virtual void zero(float* dst, std::size_t n) = 0;
  // m = b1.beta * m + b1.rest * g over n elements.
  virtual void momentum(float* m, const float* g, std::size_t n, Decay b1) = 0;
  // The same per segment (momentum_segments with scale 1, no m_prev).
  virtual void momentum_subset(const Segments& s, float* m, const float* g, Decay b1) = 0;
  virtual void mask_multiply(const Segments& s, float* buf) = 0;
  virtual void apply_adam(const Segments& s, float* m, const float* v, float inv_bc2,
                          float eps) = 0;
  virtual void zero_one_local(const Segments& s, const float* m, const float* v, float* u,
                              float inv_bc1, float inv_bc2, float eps) = 0;
  virtual void zero_one_sync_pre(const Segments& s, const float* v, float* u, float inv_bc2,
                                 float eps) = 0;
  virtual void zero_one_sync_post(const Segments& s, float* m, const float* v, float* u,
                                  float scale, float inv_bc2, float eps) = 0;
  virtual void copy_out(const Segments& s) = 0;
  virtual void add_update(const Segments& s, const float* flat) = 0;
  // LAMB warmup pass 1 (out: 2 doubles per segment, sum p^2 and sum u^2) and pass 2
  // (lamb_apply with seg.step = lr * lr_scale * trust ratio).
  virtual void lamb_warmup_moments(const Segments& s, const float* g, float* m, float* v, Decay b1,
                                   Decay b2, float inv_bc1, float inv_bc2, float eps,
                                   double* out) = 0;
  virtual void lamb_warmup_apply(const Segments& s, const float* m, const float* v, Decay b1,
                                 Decay b2, float inv_bc1, float inv_bc2, float eps) = 0;
  virtual void sum_squares(const Segments& s, const float* m, double* out) = 0;
  // m_prev = m, then m = (b1.beta * m + b1.rest * g) * seg.scale (momentum_segments).
  virtual void lamb_momentum(const Segments& s, float* m, const float* g, float* m_prev,
                             Decay b1) = 0;
  virtual void lamb_post(const Segments& s, float* m, const float* mp, const float* v, float* vf,
                         Decay b1, Decay b2, float inv_bc1, float inv_bc2, float inv_bc2_fresh,
                         float eps, LambPostStats* out) = 0;
  virtual void lamb_apply(const Segments& s, const float* m, const float* v, float inv_bc1,
                          float inv_bc2, float eps) = 0;
};

// ---------------------------------------------------------------- CPU
class CpuBackend final : public loom::optim::CpuBackendT<Backend> {
 public:
  void load_grad(const Segments& s, float* flat, float inv_scale) override {
    for (const Segment& seg : s) {
      float* dst = flat + seg.offset;
      const std::size_t esize = seg.gtype == DType::kF32 ? 4 : 2;
      loom::plugins::parallel_for(seg.n, 1 << 15, [&](std::size_t b, std::size_t e) {
        load_grad_cpu(static_cast<const std::byte*>(seg.g) + b * esize, seg.gtype, e - b, inv_scale,
                      dst + b);
      });
    }
  }
  void copy(float* dst, const float* src, std::size_t n) override {
    if (n != 0 && dst != src) std::memcpy(dst, src, n * sizeof(float));
  }
  void zero(float* dst, std::size_t n) override { std::fill(dst, dst + n, 0.0f); }
  void momentum(float* m, const float* g, std::size_t n, Decay b1) override {
    momentum_cpu(m, g, DType::kF32, n, b1, 1.0f);
  }
  void momentum_subset(const Segments& s, float* m, const float* g, Decay b1) override {
    for (const Segment& seg : s) {
      momentum_cpu(m + seg.offset, g + seg.offset, DType::kF32, seg.n, b1, 1.0f);
    }
  }
  void mask_multiply(const Segments& s, float* buf) override {
    for (const Segment& seg : s) {
      if (seg.mask == nullptr) continue;
      float* x = buf + seg.offset;
      const float* mask = seg.mask;
      for_range(seg.n, [&](std::size_t i) { x[i] *= mask[i]; });
    }
  }
  void apply_adam(const Segments& s, float* m_flat, const float* v_flat, float inv_bc2,
                  float eps) override {
    mask_multiply(s, m_flat);
    for (const Segment& seg : s) {
      float* p = seg.p;
      const float* m = m_flat + seg.offset;
      const float* v = v_flat + seg.offset;
      const float decay = seg.decay;
      const float step = seg.step;
      for_range(seg.n, [&](std::size_t i) {
        p[i] = p[i] * decay - step * (m[i] / (std::sqrt(v[i]) * inv_bc2 + eps));
      });
      if (seg.low != nullptr) copy_out_cpu(p, seg.low, seg.ltype, seg.n);
    }
  }
  void zero_one_local(const Segments& s, const float* m_flat, const float* v_flat, float* u_flat,
                      float inv_bc1, float inv_bc2, float eps) override {
    for (const Segment& seg : s) {
      float* p = seg.p;
      const float* m = m_flat + seg.offset;
      const float* v = v_flat + seg.offset;
      float* u = u_flat + seg.offset;
      const float lrf = seg.lr;
      const float wd = seg.wd;
      for_range(seg.n, [&](std::size_t i) {
        const float d = m[i] * inv_bc1 / (std::sqrt(v[i]) * inv_bc2 + eps) + wd * p[i];
        p[i] -= lrf * d;
        u[i] -= lrf * d;
      });
      if (seg.low != nullptr) copy_out_cpu(p, seg.low, seg.ltype, seg.n);
    }
  }
  void zero_one_sync_pre(const Segments& s, const float* v_flat, float* u_flat, float inv_bc2,
                         float eps) override {
    for (const Segment& seg : s) {
      float* p = seg.p;
      const float* v = v_flat + seg.offset;
      float* u = u_flat + seg.offset;
      for_range(seg.n, [&](std::size_t i) {
        p[i] -= u[i];
        u[i] *= std::sqrt(v[i]) * inv_bc2 + eps;
      });
    }
  }
  void zero_one_sync_post(const Segments& s, float* m_flat, const float* v_flat, float* u_flat,
                          float scale, float inv_bc2, float eps) override {
    mask_multiply(s, u_flat);
    for (const Segment& seg : s) {
      float* p = seg.p;
      float* m = m_flat + seg.offset;
      const float* v = v_flat + seg.offset;
      float* u = u_flat + seg.offset;
      for_range(seg.n, [&](std::size_t i) {
        m[i] = u[i] * scale;
        p[i] += u[i] / (std::sqrt(v[i]) * inv_bc2 + eps);
        u[i] = 0.0f;
      });
      if (seg.low != nullptr) copy_out_cpu(p, seg.low, seg.ltype, seg.n);
    }
  }
  void copy_out(const Segments& s) override {
    for (const Segment& seg : s) {
      if (seg.low != nullptr) copy_out_cpu(seg.p, seg.low, seg.ltype, seg.n);
    }
  }
  void add_update(const Segments& s, const float* flat) override {
    for (const Segment& seg : s) {
      float* p = seg.p;
      const float* d = flat + seg.offset;
      for_range(seg.n, [&](std::size_t i) { p[i] += d[i]; });
      if (seg.low != nullptr) copy_out_cpu(p, seg.low, seg.ltype, seg.n);
    }
  }
  void lamb_warmup_moments(const Segments& s, const float* g, float* m, float* v, Decay b1,
                           Decay b2, float inv_bc1, float inv_bc2, float eps,
                           double* out) override {
    for (std::size_t k = 0; k < s.size(); ++k) {
      const TensorRef r = ref(s[k], g, m, v);
      const LambHyper h = hyper(s[k], b1, b2, inv_bc1, inv_bc2, eps);
      out[2 * k] = 0.0;
      out[2 * k + 1] = 0.0;
      lamb_moments_cpu(r, h, &out[2 * k], &out[2 * k + 1]);
    }
  }
  void lamb_warmup_apply(const Segments& s, const float* m, const float* v, Decay b1, Decay b2,
                         float inv_bc1, float inv_bc2, float eps) override {
    for (const Segment& seg : s) {
      const TensorRef r = ref(seg, nullptr, const_cast<float*>(m), const_cast<float*>(v));
      lamb_apply_cpu(r, hyper(seg, b1, b2, inv_bc1, inv_bc2, eps), seg.step);
    }
  }
  void sum_squares(const Segments& s, const float* m, double* out) override {
    for (std::size_t k = 0; k < s.size(); ++k) {
      const float* x = m + s[k].offset;
      double sum = 0.0;
      for (std::size_t i = 0; i < s[k].n; ++i) sum += static_cast<double>(x[i]) * x[i];
      out[k] = sum;
    }
  }
  void lamb_momentum(const Segments& s, float* m_flat, const float* g_flat, float* m_prev,
                     Decay b1) override {
    for (const Segment& seg : s) {
      float* m = m_flat + seg.offset;
      const float* g = g_flat + seg.offset;
      if (m_prev != nullptr) copy(m_prev + seg.offset, m, seg.n);
      const float sc = seg.scale;
      for_range(seg.n, [&](std::size_t i) { m[i] = (b1.beta * m[i] + b1.rest * g[i]) * sc; });
    }
  }
  void lamb_post(const Segments& s, float* m_flat, const float* mp_flat, const float* v_flat,
                 float* vf_flat, Decay b1, Decay b2, float inv_bc1, float inv_bc2,
                 float inv_bc2_fresh, float eps, LambPostStats* out) override {
    for (std::size_t k = 0; k < s.size(); ++k) {
      const Segment& seg = s[k];
      float* m = m_flat + seg.offset;
      const float* mp = mp_flat + seg.offset;
      const float* v = v_flat + seg.offset;
      float* vf = vf_flat + seg.offset;
      const float* p = seg.p;
      const float* mask = seg.mask;
      const float inv_sc = seg.scale;
      const float wd = seg.wd;
      double pre2 = 0.0;
      double u2 = 0.0;
      float factor = 0.0f;
      for (std::size_t i = 0; i < seg.n; ++i) {
        m[i] *= inv_sc;
        if (mask != nullptr) m[i] *= mask[i];
        const float gh = (m[i] - b1.beta * mp[i]) / b1.rest;
        vf[i] = b2.beta * vf[i] + b2.rest * gh * gh;
        const float denom = std::sqrt(v[i]) * inv_bc2 + eps;
        const float pre = m[i] * inv_bc1 / denom;
        const float u = pre + wd * p[i];
        pre2 += static_cast<double>(pre) * pre;
        u2 += static_cast<double>(u) * u;
        factor = std::max(factor, denom / (std::sqrt(vf[i]) * inv_bc2_fresh + eps));
      }
      out[k] = {pre2, u2, factor};
    }
  }
  void lamb_apply(const Segments& s, const float* m_flat, const float* v_flat, float inv_bc1,
                  float inv_bc2, float eps) override {
    for (const Segment& seg : s) {
      const float* m = m_flat + seg.offset;
      const float* v = v_flat + seg.offset;
      float* pw = seg.p;
      const float wd = seg.wd;
      const float step = seg.step;
      for_range(seg.n, [&](std::size_t i) {
        const float u = m[i] * inv_bc1 / (std::sqrt(v[i]) * inv_bc2 + eps) + wd * pw[i];
        pw[i] -= step * u;
      });
      if (seg.low != nullptr) copy_out_cpu(pw, seg.low, seg.ltype, seg.n);
    }
  }

 private:
  static TensorRef ref(const Segment& seg, const float* g, float* m, float* v) {
    TensorRef r;
    r.p = seg.p;
    r.g = g != nullptr ? g + seg.offset : nullptr;
    r.gtype = DType::kF32;
    r.m = m + seg.offset;
    r.v = v + seg.offset;
    r.low = seg.low;
    r.ltype = seg.ltype;
    r.n = seg.n;
    return r;
  }
  static LambHyper hyper(const Segment& seg, Decay b1, Decay b2, float inv_bc1, float inv_bc2,
                         float eps) {
    LambHyper h;
    h.beta1 = b1.beta;
    h.beta2 = b2.beta;
    h.omb1 = b1.rest;
    h.omb2 = b2.rest;
    h.eps = eps;
    h.inv_scale = 1.0f;
    h.wd = seg.wd;
    h.inv_bc1 = inv_bc1;
    h.inv_bc2_sqrt = inv_bc2;
    return h;
  }
};

// ---------------------------------------------------------------- CUDA
namespace k = loom::optim::cuda::onebit;

class CudaBackend final : public loom::optim::CudaBackendT<Backend> {
 public:
  void load_grad(const Segments& s, float* flat, float inv_scale) override {
    ok(k::load_grad(s.data(), s.size(), flat, inv_scale, stream_));
  }
  void copy(float* dst, const float* src, std::size_t n) override {
    if (n != 0 && dst != src) ok(k::copy_device(dst, src, n * sizeof(float), stream_));
  }
  void zero(float* dst, std::size_t n) override {
    if (n != 0) ok(cuda::memset_zero(dst, n * sizeof(float), stream_));
  }
  void momentum(float* m, const float* g, std::size_t n, Decay b1) override {
    if (n != 0) ok(k::momentum(m, g, n, b1, stream_));
  }
  void momentum_subset(const Segments& s, float* m, const float* g, Decay b1) override {
    Segments unscaled = s;
    for (Segment& seg : unscaled) seg.scale = 1.0f;
    ok(k::momentum_segments(unscaled.data(), unscaled.size(), m, g, nullptr, b1, stream_));
  }
  void mask_multiply(const Segments& s, float* buf) override {
    ok(k::mask_multiply(s.data(), s.size(), buf, stream_));
  }
  void apply_adam(const Segments& s, float* m, const float* v, float inv_bc2, float eps) override {
    ok(k::apply_adam(s.data(), s.size(), m, v, inv_bc2, eps, stream_));
  }
  void zero_one_local(const Segments& s, const float* m, const float* v, float* u, float inv_bc1,
                      float inv_bc2, float eps) override {
    ok(k::zero_one_local(s.data(), s.size(), m, v, u, inv_bc1, inv_bc2, eps, stream_));
  }
  void zero_one_sync_pre(const Segments& s, const float* v, float* u, float inv_bc2,
                         float eps) override {
    ok(k::zero_one_sync_pre(s.data(), s.size(), v, u, inv_bc2, eps, stream_));
  }
  void zero_one_sync_post(const Segments& s, float* m, const float* v, float* u, float scale,
                          float inv_bc2, float eps) override {
    ok(k::zero_one_sync_post(s.data(), s.size(), m, v, u, scale, inv_bc2, eps, stream_));
  }
  void copy_out(const Segments& s) override { ok(k::copy_out(s.data(), s.size(), stream_)); }
  void add_update(const Segments& s, const float* flat) override {
    ok(k::add_update(s.data(), s.size(), flat, stream_));
  }
  void lamb_warmup_moments(const Segments& s, const float* g, float* m, float* v, Decay b1,
                           Decay b2, float inv_bc1, float inv_bc2, float eps,
                           double* out) override {
    ok(k::lamb_warmup_moments(s.data(), s.size(), g, m, v, b1, b2, inv_bc1, inv_bc2, eps, out,
                              stream_));
  }
  void lamb_warmup_apply(const Segments& s, const float* m, const float* v, Decay /*b1*/,
                         Decay /*b2*/, float inv_bc1, float inv_bc2, float eps) override {
    ok(k::lamb_apply(s.data(), s.size(), m, v, inv_bc1, inv_bc2, eps, stream_));
  }
  void sum_squares(const Segments& s, const float* m, double* out) override {
    ok(k::sum_squares(s.data(), s.size(), m, out, stream_));
  }
  void lamb_momentum(const Segments& s, float* m, const float* g, float* m_prev,
                     Decay b1) override {
    ok(k::momentum_segments(s.data(), s.size(), m, g, m_prev, b1, stream_));
  }
  void lamb_post(const Segments& s, float* m, const float* mp, const float* v, float* vf, Decay b1,
                 Decay b2, float inv_bc1, float inv_bc2, float inv_bc2_fresh, float eps,
                 LambPostStats* out) override {
    ok(k::lamb_post(s.data(), s.size(), m, mp, v, vf, b1, b2, inv_bc1, inv_bc2, inv_bc2_fresh, eps,
                    out, stream_));
  }
  void lamb_apply(const Segments& s, const float* m, const float* v, float inv_bc1, float inv_bc2,
                  float eps) override {
    ok(k::lamb_apply(s.data(), s.size(), m, v, inv_bc1, inv_bc2, eps, stream_));
  }
};

}  // namespace loom::optim::onebit
