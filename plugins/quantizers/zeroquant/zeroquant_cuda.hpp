// zeroquant's CUDA side: the device made current, the core's kernels, and the INT8 GEMM on
// cuBLASLt (int8 inputs, int32 accumulation) followed by the epilogue kernel. Built twice
// (docs/sdk.md "CPU and CUDA"): zeroquant_cuda.cpp with CUDA; zeroquant_cuda_stub.cpp without,
// where have_cuda() is false and the rest UNIMPLEMENTED (never called: on_cuda refuses first).
#pragma once

#include <cstdint>

#include "int_kernels.hpp"

namespace loom::quant {

bool have_cuda();

// quantize_int on device `device`; returns -1 or the first non-finite index, or with first_bad
// (device int64 [1]) writes it there on the stream and returns -1 without waiting.
int64_t zq_cuda_quantize(int device, const float* x, const Groups& gs, const IntScheme& q,
                         uint8_t* packed, float* scales, uint8_t* zeros, void* stream,
                         int64_t* first_bad);
// One float read back from the device (for an error message).
void zq_cuda_read_float(int device, const float* p, float* out);
void zq_cuda_dequantize(int device, const IntWeight& w, float* x, void* stream);
// y = x . W^T (+ bias): int8_activations: x quantized per token, widened codes, cuBLASLt's
// int8 GEMM per K group into the workspace's int32 accumulator (carve_int8_workspace), the
// epilogue;
// else the weight-only kernel. Returns -1 or the first non-finite x index.
int64_t zq_cuda_matmul(int device, const float* x, int64_t m, const IntWeight& w, const float* bias,
                       float* y, bool int8_activations, void* workspace, void* stream);

}  // namespace loom::quant
