// Declared public interface of loom_moe_core: bench/, the trainer and tests may include this
// header (as <loom/moe/moe_math.hpp>); the core's other headers are private to it.
//
// Elementary functions that round alike on the host and on CUDA: exp and log in float built
// from +, *, floor and exponent scaling only (the core is compiled without contraction, the
// CUDA files with --fmad=false), so the gate's probabilities, its Gumbel noise and hence the
// experts chosen are bit-identical on both. The double overloads (host tests only) use the
// C library.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__CUDACC__)
#define LOOM_MOE_HD __host__ __device__
#else
#define LOOM_MOE_HD
#endif

namespace loom::moe {

// e^x for x <= 0 (softmax arguments); larger x is handled but less carefully. Relative error
// about 2 ulp.
LOOM_MOE_HD inline float exp_fixed(float x) {
  if (!(x > -87.0f)) return 0.0f;  // also NaN -> 0 never happens: callers pass finite values
  if (x > 88.0f) x = 88.0f;
  const float n = floorf(x * 1.44269504f + 0.5f);
  // Cody-Waite: ln 2 = hi + lo with hi exact in 16 bits.
  float r = x - n * 0.693145752f;
  r = r - n * 1.42860677e-06f;
  // e^r on |r| <= 0.35: Taylor to r^7, Horner.
  float p = 1.98412698e-04f;
  p = p * r + 1.38888889e-03f;
  p = p * r + 8.33333333e-03f;
  p = p * r + 4.16666667e-02f;
  p = p * r + 1.66666667e-01f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return ldexpf(p, static_cast<int>(n));
}

// ln x for finite x > 0.
LOOM_MOE_HD inline float log_fixed(float x) {
  int e = 0;
  float m = frexpf(x, &e);  // m in [0.5, 1)
  if (m < 0.70710678f) {
    m = m * 2.0f;
    e -= 1;
  }
  const float s = (m - 1.0f) / (m + 1.0f);  // |s| <= 0.1716
  const float s2 = s * s;
  float p = 1.0f / 9.0f;
  p = p * s2 + 1.0f / 7.0f;
  p = p * s2 + 0.2f;
  p = p * s2 + 1.0f / 3.0f;
  p = p * s2 + 1.0f;
  const float logm = 2.0f * s * p;
  return static_cast<float>(e) * 0.693147181f + logm;
}

inline double exp_fixed(double x) { return std::exp(x); }
inline double log_fixed(double x) { return std::log(x); }

// A 32-bit random word as a float in (0, 1), never 0 or 1.
LOOM_MOE_HD inline float open_uniform(uint32_t word) {
  return (static_cast<float>(word >> 8) + 0.5f) * (1.0f / 16777216.0f);
}

// Standard Gumbel noise from a random word: -ln(-ln u).
LOOM_MOE_HD inline float gumbel(uint32_t word) {
  return -log_fixed(-log_fixed(open_uniform(word)));
}

// The RSample choice score of probability p: log p + Gumbel noise, so the top choice is a
// sample of p (the Gumbel-max trick). p == 0 (an underflowed softmax) scores below any other.
template <class T>
inline T gumbel_score(T p, uint32_t word) {
  if (!(p > T(0))) return std::numeric_limits<T>::lowest();
  return log_fixed(p) + static_cast<T>(gumbel(word));
}
// float, callable on the device too (the device routing scores with it).
LOOM_MOE_HD inline float gumbel_score(float p, uint32_t word) {
  if (!(p > 0.0f)) return -3.40282347e+38f;  // numeric_limits<float>::lowest()
  return log_fixed(p) + gumbel(word);
}

// Capacity's "probs" order: a goes before b when its probability is higher; a NaN (an
// overflowed gate) goes after every number, so the order stays a strict weak one and the
// host's stable sort and the device's ranks agree.
template <class T>
LOOM_MOE_HD inline bool kept_before(T a, T b) {
  return a > b || (!(a != a) && b != b);
}

// One token's combine weights from its probabilities ps [E] and route r [k] (gating.hpp
// combine_weights): k = 1: p (1 with normalize_top1); k >= 2: p_j / max(kept sum, eps); 0
// where dropped. The host and the device run this same code.
template <class T>
LOOM_MOE_HD inline void token_weights(const T* ps, const int32_t* r, int k, bool normalize_top1,
                                      T eps, T* w) {
  if (k == 1) {
    w[0] = r[0] < 0 ? T(0) : (normalize_top1 ? T(1) : ps[r[0]]);
    return;
  }
  T denom = T(0);
  for (int j = 0; j < k; ++j) {
    if (r[j] >= 0) denom = denom + ps[r[j]];
  }
  denom = denom < eps ? eps : denom;  // std::max(denom, eps)
  for (int j = 0; j < k; ++j) w[j] = r[j] < 0 ? T(0) : ps[r[j]] / denom;
}

// One token's gradient with respect to its gate logits (gating.hpp gate_dlogits): dp [E]
// holds the aux loss's part on entry; the combine weights' part (from dw [k]) is added and
// the softmax's adjoint applied. The host and the device run this same code.
template <class T>
LOOM_MOE_HD inline void token_dlogits(const T* ps, const int32_t* r, const T* dw, int E, int k,
                                      bool normalize_top1, T eps, T* dp) {
  if (k == 1) {
    if (r[0] >= 0 && !normalize_top1) dp[r[0]] += dw[0];
  } else {
    T raw = T(0);
    bool any = false;
    for (int j = 0; j < k; ++j) {
      if (r[j] >= 0) {
        raw = raw + ps[r[j]];
        any = true;
      }
    }
    if (any) {
      const T denom = raw < eps ? eps : raw;
      T dot = T(0);
      for (int j = 0; j < k; ++j) {
        if (r[j] >= 0) dot += dw[j] * ps[r[j]];
      }
      const bool clamped = !(raw > eps);
      for (int j = 0; j < k; ++j) {
        if (r[j] < 0) continue;
        dp[r[j]] += dw[j] / denom;
        if (!clamped) dp[r[j]] -= dot / (denom * denom);
      }
    }
  }
  T dot = T(0);
  for (int e = 0; e < E; ++e) dot += ps[e] * dp[e];
  for (int e = 0; e < E; ++e) dp[e] = ps[e] * (dp[e] - dot);
}

// The jitter factor U(1 - eps, 1 + eps) from a random word.
LOOM_MOE_HD inline float jitter_factor(uint32_t word, float eps) {
  const float u = static_cast<float>(word >> 8) * (1.0f / 16777216.0f);
  return (1.0f - eps) + (2.0f * eps) * u;
}

// Activations: GELU is the tanh approximation (GPT-2's dense MLP).
enum class Activation : int { Gelu = 1, Relu = 2, Silu = 3 };

template <class T>
inline T act_forward(Activation a, T x) {
  switch (a) {
    case Activation::Relu:
      return x > T(0) ? x : T(0);
    case Activation::Silu:
      return x / (T(1) + std::exp(-x));
    case Activation::Gelu:
    default: {
      const T u = T(0.79788456080286535588) * (x + T(0.044715) * x * x * x);
      return T(0.5) * x * (T(1) + std::tanh(u));
    }
  }
}

// d act / dx at x.
template <class T>
inline T act_grad(Activation a, T x) {
  switch (a) {
    case Activation::Relu:
      return x > T(0) ? T(1) : T(0);
    case Activation::Silu: {
      const T sg = T(1) / (T(1) + std::exp(-x));
      return sg * (T(1) + x * (T(1) - sg));
    }
    case Activation::Gelu:
    default: {
      const T u = T(0.79788456080286535588) * (x + T(0.044715) * x * x * x);
      const T th = std::tanh(u);
      const T du = T(0.79788456080286535588) * (T(1) + T(3) * T(0.044715) * x * x);
      return T(0.5) * (T(1) + th) + T(0.5) * x * (T(1) - th * th) * du;
    }
  }
}

}  // namespace loom::moe
