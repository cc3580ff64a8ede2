// The CUDA kernels of the integer schemes: the same outputs as int_kernels.hpp's CPU kernels
// (quantize, dequantize, token-wise INT8 activations, widening to int8 bit for bit: every
// value is one IEEE operation in the reference's order, __fdiv_rn / __fadd_rn / __fmul_rn and
// rintf, round half to even), the weight-only matmul (codes decoded in registers, a warp per
// output column), and the epilogue of the INT8 GEMM. Pointers are device memory; work is
// enqueued on `stream` with the device of the pointers current. Throws loom::sdk::Error.
#pragma once

#include <cstdint>

#include "int_kernels.hpp"

namespace loom::quant::cuda {

// quantize_int on the device. Returns -1 or the index of the first non-finite element of x;
// synchronises with `stream` to read that back. With first_bad (device int64 [1]) it writes
// that value there on the stream instead, returns -1 and does not wait.
int64_t quantize_int(const float* x, const Groups& gs, const IntScheme& q, int32_t packing,
                     uint8_t* packed, float* scales, uint8_t* zeros, void* stream,
                     int64_t* first_bad = nullptr);

void dequantize_int(const IntWeight& w, float* x, void* stream);

// Token-wise INT8 activations (symmetric, exact range, a scale per row); returns as
// quantize_int.
int64_t quantize_rows_int8(const float* x, int64_t rows, int64_t cols, int8_t* q, float* scales,
                           void* stream);

void widen_to_int8(const IntWeight& w, int8_t* out, void* stream);

// y [m, N] = x [m, K] . decode(W)^T (+ bias).
void matmul_weight_only(const float* x, int64_t m, const IntWeight& w, const float* bias, float* y,
                        void* stream);

// The INT8 GEMM's epilogue for K group g of `groups`: y[i, j] = acc[i, j] sw[j, g] sx[i]
// (+ bias[j]) when `first`, else y[i, j] + that. acc is int32 [m, n] row-major.
void int8_epilogue(const int32_t* acc, int64_t m, int64_t n, const float* sx, const float* sw,
                   int64_t groups, int64_t g, const float* bias, bool first, float* y,
                   void* stream);

// acc [m, n] (int32, row-major) = xq[:, k0 .. k0 + kg) . wq[:, k0 .. k0 + kg)^T, xq [m, k]
// and wq [n, k] row-major int8: a thread per output, exact. The fallback of the cuBLASLt
// GEMM for shapes it does not take (sizes or offsets not multiples of 4).
void int8_gemm_simple(const int8_t* xq, const int8_t* wq, int64_t m, int64_t n, int64_t k,
                      int64_t k0, int64_t kg, int32_t* acc, void* stream);

}  // namespace loom::quant::cuda
