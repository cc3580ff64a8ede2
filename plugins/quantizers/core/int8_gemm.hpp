// The INT8 x INT8 -> INT32 GEMM of the W8A8 and W4A8 matmuls with the dequantization in its
// epilogue, on the CPU through oneDNN (s8 x s8 -> s32 matmul per K group, then one Highway
// pass y = acc s_w[n] s_x[m] (+ bias), accumulating the groups), and the whole matmul around
// it (per-token activation quantization, the weight's codes widened to int8 unless they
// already are int8).
#pragma once

#include <cstdint>
#include <string>

#include "int_kernels.hpp"

namespace loom::quant {

// Whether this build has the oneDNN GEMM (libdnnl-dev found at configure time).
bool have_int8_gemm();

// y [m, n] = sum over K groups g of (xq[:, g] . wq[:, g]^T) * sw[n, g] * sx[m] (+ bias[n]),
// the products accumulated exactly in int32 within a group: oneDNN's s8 x s8 -> s32 matmul
// per group (its VNNI / AVX2 kernels; oneDNN 2.6 runs a per-row binary post-op only in its
// reference kernel, so the scales and the bias are applied by int8_epilogue, in the CUDA
// epilogue's order). xq [m, k] and wq [n, k] are row-major int8; sw [n, groups] row-major.
// Throws std::runtime_error with oneDNN's message on failure.
struct Int8Gemm {
  const int8_t* xq = nullptr;
  const float* sx = nullptr;
  const int8_t* wq = nullptr;
  const float* sw = nullptr;
  const float* bias = nullptr;
  float* y = nullptr;
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
  int64_t group = 0;  // >= 1 (k for one group per row)
};
// acc: m * n int32; sw_col: n floats (used when there are several groups).
// The products run on oneDNN only where its int8 kernels are exact (VNNI: avx512_core_vnni,
// avx2_vnni or later, as dnnl_get_effective_cpu_isa() reports); elsewhere on an exact
// Highway kernel (int8_dot_exact). int8_gemm_uses_onednn() says which.
bool int8_gemm_uses_onednn();
void int8_gemm(const Int8Gemm& g, int32_t* acc, float* sw_col);

// The regions of a W8A8 / W4A8 matmul's workspace, carved in this order from a 64-byte
// aligned base: x's codes [m, K], x's scales [m], W's codes widened to int8 [N, K] (unless
// they already are int8), one group's weight scales [N], the int32 accumulator [m, N].
struct Int8Workspace {
  int8_t* xq = nullptr;
  float* sx = nullptr;
  int8_t* wide = nullptr;  // NULL when W's codes are used as they are
  float* sw_col = nullptr;
  int32_t* acc = nullptr;
};
Int8Workspace carve_int8_workspace(void* base, int64_t m, const IntWeight& w);
// Whether W's packed bytes already are the int8 [N, K] matrix (8-bit symmetric codes).
bool codes_are_int8(const IntWeight& w);

// The W8A8 / W4A8 matmul: x [m, K] quantized per token (symmetric INT8, exact range; the
// reference_quantize_rows_int8 codes), times W's codes as int8, scaled in the epilogue.
// Needs symmetric codes, or asymmetric of at most 7 bits (q - z must fit int8): the caller
// checks int8_matmul_supports. Returns -1, or the index of the first non-finite x element
// (nothing written to y then). `workspace` holds int8_matmul_workspace_bytes(m, W) bytes,
// 64-byte aligned.
bool int8_matmul_supports(const IntScheme& q, std::string* why);
uint64_t int8_matmul_workspace_bytes(int64_t m, const IntWeight& w);
int64_t int8_matmul(const float* x, int64_t m, const IntWeight& w, const float* bias, float* y,
                    void* workspace);

}  // namespace loom::quant
