// Vector kernels of the host MoE core, written with Highway and dispatched at run time to the
// best target the CPU supports (simd.cpp).
#pragma once

#include <cstdint>

namespace loom::moe::simd {

// The gate's logits are computed for kGateTokens tokens at a time over a transposed, padded
// gate weight w [M, ldw] (experts innermost, ldw a multiple of kGateLanes):
// lg[t * ldw + c] = sum_m xs[t][m] * w[m * ldw + c], each sum in feature order from 0 with the
// product and the sum rounded apart, so every logit is bit-identical to the plain per-expert
// loop (and to the CUDA kernel, built with --fmad=false) on every target.
constexpr int64_t kGateTokens = 8;
constexpr int64_t kGateLanes = 16;
void gate_logits(const float* const* xs, int64_t M, const float* w, int64_t ldw, float* lg);
void gate_logits(const double* const* xs, int64_t M, const double* w, int64_t ldw, double* lg);

// GELU, the tanh approximation, in fp32: y[i] = gelu(x[i]); dy[i] *= gelu'(x[i]);
// g[i] = gelu'(x[i]). Within a few ulp of the libm formula (act_forward / act_grad in
// moe_math.hpp), not bit for bit. x and y (or dy, g) may be the same array.
void gelu_forward(const float* x, float* y, int64_t n);
void gelu_grad_mul(const float* x, float* dy, int64_t n);
void gelu_slope(const float* x, float* g, int64_t n);

}  // namespace loom::moe::simd
