// The CUDA half of the xtc kernels (binary.cu, ternary.cu), behind a plain C++ interface so
// that the plugin, compiled by the host compiler, dispatches to it. CUDA builds only. Every
// pointer is device memory of `device`; work runs on `stream` (a cudaStream_t). The quantizers
// reproduce the CPU reference bit for bit (the same fixed-order sums, IEEE float operations,
// no contraction). A call that reports a bad element (non-finite weight, ternary code 3)
// synchronizes the stream to read it back; the others only enqueue work. `workspace` is
// xtc_cuda_workspace_bytes(s) bytes, 256-byte aligned. CUDA failures throw
// loom::sdk::Error (UNAVAILABLE).
#pragma once

#include <cstdint>

#include <loom/quantizers/binary.hpp>

namespace loom::quant::cuda {

// Return the row-major index of the first non-finite weight (or -1), like the CPU ones, read
// back by waiting for the stream. With first_bad (device int64 [1]) they write that value there
// on the stream instead, return -1 and do not wait.
int64_t binary_quantize(const float* w, const GroupedShape& s, uint8_t* packed, float* scales,
                        void* workspace, int device, void* stream, int64_t* first_bad = nullptr);
int64_t ternary_quantize(const float* w, const GroupedShape& s, float threshold, uint8_t* packed,
                         float* scales, void* workspace, int device, void* stream,
                         int64_t* first_bad = nullptr);

void binary_dequantize(const uint8_t* packed, const float* scales, const GroupedShape& s, float* w,
                       int device, void* stream);
// Returns the first code 3, or -1.
int64_t ternary_dequantize(const uint8_t* packed, const float* scales, const GroupedShape& s,
                           float* w, void* workspace, int device, void* stream);

// y [m, rows] = x [m, cols] . W^T (+ bias), one thread per output.
void binary_matmul(const float* x, int64_t m, const uint8_t* packed, const float* scales,
                   const GroupedShape& s, const float* bias, float* y, int device, void* stream);
// Returns the first code 3, or -1 (y then written).
int64_t ternary_matmul(const float* x, int64_t m, const uint8_t* packed, const float* scales,
                       const GroupedShape& s, const float* bias, float* y, void* workspace,
                       int device, void* stream);

}  // namespace loom::quant::cuda
