// The INT8 x INT8 -> INT32 GEMM of the W8A8 and W4A8 matmuls with the dequantization fused
// into its epilogue, on the CPU through oneDNN (s8 x s8 matmul, f32 output; per-N output
// scales, a binary multiply by the per-row activation scale and a binary add of the bias as
// post-ops; groups along K: one GEMM per group, accumulated with a sum post-op), and the
// whole matmul around it (per-token activation quantization, the weight's codes widened to
// int8 unless they already are int8).
#pragma once

#include <cstdint>
#include <string>

#include "int_kernels.hpp"

namespace loom::quant {

// Whether this build has the oneDNN GEMM (libdnnl-dev found at configure time).
bool have_int8_gemm();

// y [m, n] = sum over K groups g of (xq[:, g] . wq[:, g]^T) * sx[m] * sw[n, g] (+ bias[n]),
// the products accumulated exactly in int32 within a group. xq [m, k] and wq [n, k] are
// row-major int8; sw [n, groups] row-major. `scratch` holds int8_gemm_scratch_floats(n,
// groups) floats. Throws std::runtime_error with oneDNN's message on failure.
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
void int8_gemm(const Int8Gemm& g, float* scratch);
int64_t int8_gemm_scratch_floats(int64_t n, int64_t groups);

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
