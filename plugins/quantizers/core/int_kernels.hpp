// The fast CPU kernels of the integer schemes (Highway, dispatched at run time to the best
// SIMD target the CPU has; threaded over the host pool with loom::plugins::parallel_for):
// quantize and dequantize of a [rows, cols] matrix with groups along each row, token-wise
// INT8 activation quantization, and the weight-only matmul that decodes packed codes in
// registers. quantize, dequantize and the activation quantization write exactly what the
// references of quant_core.hpp write, on every target.
#pragma once

#include <cstdint>

#include "quant_core.hpp"

namespace loom::quant {

// A packed INT weight W [gs.rows, gs.cols] = [N, K] and its group scales (and zero points).
struct IntWeight {
  const uint8_t* packed = nullptr;
  const float* scales = nullptr;
  const uint8_t* zeros = nullptr;  // asymmetric only
  Groups gs;
  IntScheme q;
  int32_t packing = LOOM_QUANT_PACK_LSB_FIRST;
};

// reference_quantize's output, computed fast. Returns -1, or the index of the first
// non-finite element of x (then the outputs are unspecified).
int64_t quantize_int(const float* x, const Groups& gs, const IntScheme& q, int32_t packing,
                     uint8_t* packed, float* scales, uint8_t* zeros);

// quantize_int of a 16-bit x (bf16 true: bfloat16, else float16, raw patterns): exactly the
// output of quantize_int on x widened to float32, each row widened in cache as it is quantized
// (no float32 copy of x in memory).
int64_t quantize_int16(const uint16_t* x, bool bf16, const Groups& gs, const IntScheme& q,
                       int32_t packing, uint8_t* packed, float* scales, uint8_t* zeros);

// reference_dequantize's output, computed fast.
void dequantize_int(const IntWeight& w, float* x);

// reference_quantize_rows_int8's output (symmetric INT8, exact range, one scale per row),
// computed fast. Returns -1 or the index of the first non-finite element.
int64_t quantize_rows_int8(const float* x, int64_t rows, int64_t cols, int8_t* q, float* scales);

// y [m, N] = x [m, K] . decode(W)^T (+ bias [N]): float x times the decoded weight, the codes
// unpacked in registers (4-bit LSB_FIRST codes two per byte straight from the packed bytes,
// 8-bit codes as bytes, other widths a chunk of codes at a time into a small buffer of bytes:
// never the weight as floats). Each group's partial sum is scaled once. `workspace` holds
// weight_only_workspace_floats(m, K) floats (NULL: allocated here).
void matmul_weight_only(const float* x, int64_t m, const IntWeight& w, const float* bias, float* y,
                        float* workspace);
int64_t weight_only_workspace_floats(int64_t m, int64_t k);

// Floats between rows of the 4-bit path's even and odd halves of x: K / 2 and a cache line
// more. At the usual K, K / 2 floats is a power of two, so a block's rows would all map to
// one L1 set and its 2 R streams fill the set's ways.
inline int64_t weight_only_row_stride(int64_t k) { return k / 2 + 16; }

// Widens W's codes to one int8 per element, [N, K] row-major: the symmetric code itself, or
// q - z (asymmetric; needs bits <= 7 so it fits). The W4A8 path's weight for the INT8 GEMM.
void widen_to_int8(const IntWeight& w, int8_t* out);

// The INT8 GEMM's epilogue for one K group, rows [0, m): t = (float(acc[i, j]) * sw[j]) *
// sx[i]; y[i, j] = t (+ bias[j]) when `first`, else y[i, j] + t. sw is the group's N weight
// scales, contiguous. The same operations in the same order as the CUDA epilogue.
void int8_epilogue(const int32_t* acc, int64_t m, int64_t n, const float* sx, const float* sw,
                   const float* bias, bool first, float* y);

// Exact int32 sums of int8 code products (Highway, over the host pool): acc[i, j] = sum over
// c in [k0, k0 + kg) of xq[i, c] * wq[j, c]; xq [m, k], wq [n, k] row-major, acc [m, n]. The
// INT8 GEMM's kernel where oneDNN's int8 kernels could saturate (no VNNI).
void int8_dot_exact(const int8_t* xq, const int8_t* wq, int64_t m, int64_t n, int64_t k, int64_t k0,
                    int64_t kg, int32_t* acc);

}  // namespace loom::quant
