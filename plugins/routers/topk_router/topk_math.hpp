// The arithmetic of topk_router that the CPU (topk_cpu.cpp) and CUDA (topk_cuda.cu) kernels
// share, written once so that both devices round every operation the same way: products and
// sums through mul()/add() (__dmul_rn/__dadd_rn on the device, plain operators on the host,
// whose files are compiled with -ffp-contract=off), no FMA, no library transcendental (the
// exponential is a fixed polynomial below), so a score, a gate and a gradient term are the
// same bits on every thread count and device.
#pragma once

#include <math.h>

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define LOOM_TOPK_HD __host__ __device__
#else
#define LOOM_TOPK_HD
#endif

namespace loom::routers::topk {

// The gate applied to a kept token's score.
enum class Gate : int32_t { kSigmoid = 0, kLinear = 1 };

LOOM_TOPK_HD inline double mul(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

LOOM_TOPK_HD inline double add(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

// exp(a) for a <= 0, from the operations above only: a = k ln2 + r (|r| <= ln2 / 2, ln2 in two
// parts so k * ln2_hi is exact), e^r by its Taylor series to r^13 / 13! (truncation below
// 1e-17), times 2^k (ldexp: exact). Below -708 it returns 0 (e^-708 is near the smallest
// normal double; a sigmoid gate there is 0 to 300 digits).
LOOM_TOPK_HD inline double exp_nonpositive(double a) {
  if (!(a == a)) return a;  // NaN
  if (a < -708.0) return 0.0;
  if (a > 0.0) a = 0.0;
  constexpr double kInvLn2 = 1.44269504088896338700e+00;
  constexpr double kLn2Hi = 6.93147180369123816490e-01;  // 32 significant bits
  constexpr double kLn2Lo = 1.90821492927058770002e-10;
  const double kd = floor(add(mul(a, kInvLn2), 0.5));
  const double r = add(add(a, -mul(kd, kLn2Hi)), -mul(kd, kLn2Lo));
  // 1 / n! for n = 13 .. 1 (compile-time divisions, correctly rounded by every compiler).
  constexpr double kCoef[13] = {1.0 / 6227020800.0,
                                1.0 / 479001600.0,
                                1.0 / 39916800.0,
                                1.0 / 3628800.0,
                                1.0 / 362880.0,
                                1.0 / 40320.0,
                                1.0 / 5040.0,
                                1.0 / 720.0,
                                1.0 / 120.0,
                                1.0 / 24.0,
                                1.0 / 6.0,
                                1.0 / 2.0,
                                1.0};
  double p = kCoef[0];
  for (int i = 1; i < 13; ++i) p = add(mul(p, r), kCoef[i]);
  p = add(mul(p, r), 1.0);
  return ldexp(p, static_cast<int>(kd));
}

// sigmoid(s) = 1 / (1 + e^-s), through e^-|s| so the exponential never overflows.
LOOM_TOPK_HD inline double sigmoid(double s) {
  if (!(s == s)) return s;
  if (s >= 0.0) return 1.0 / add(1.0, exp_nonpositive(-s));
  const double e = exp_nonpositive(s);
  return e / add(1.0, e);
}

LOOM_TOPK_HD inline double gate_of(double score, Gate g) {
  return g == Gate::kSigmoid ? sigmoid(score) : score;
}

// dL/dscore from dL/dgate: sigmoid' = g (1 - g); linear' = 1.
LOOM_TOPK_HD inline double score_grad(double dgate, double score, Gate g) {
  if (g == Gate::kLinear) return dgate;
  const double s = sigmoid(score);
  return mul(dgate, mul(s, add(1.0, -s)));
}

// The selection order as one unsigned key: a larger score gives a smaller key, -0 counts as
// +0 and every NaN ranks below every number (the largest key). The kept positions are the
// `kept` smallest (key, position) pairs, so equal scores keep the earlier position.
LOOM_TOPK_HD inline uint64_t rank_key(double s) {
  if (!(s == s)) return ~uint64_t{0};
  if (s == 0.0) s = 0.0;
  uint64_t u = 0;
  memcpy(&u, &s, sizeof u);
  const uint64_t ascending = (u >> 63) != 0 ? ~u : (u | (uint64_t{1} << 63));
  return ~ascending;
}

// Elements are read as double (exact from fp32) and results written back rounded once.
template <class T>
LOOM_TOPK_HD inline double to_double(T v) {
  return static_cast<double>(v);
}

}  // namespace loom::routers::topk
