// Fused multi-tensor CUDA kernels of the optimizers. Plain C++ interface (compiled by the
// host compiler on one side and nvcc on the other). Every function is stream-ordered on
// `stream` (a cudaStream_t). A CUDA failure throws loom::sdk::Error (UNAVAILABLE) naming the
// call, file and line (LOOM_CUDA_CHECK); the returned string is empty (kept so callers that
// check it stay valid).
#pragma once

#include <cstddef>
#include <string>

#include "kernels/cpu.hpp"

namespace loom::optim::cuda {

// Built twice (docs/sdk.md "CPU and CUDA"): cuda.cu, onebit_cuda.cu, finite.cu and
// stream_order.cpp with CUDA; cuda_stub.cpp without (have_cuda false, device_count 0, every
// kernel UNIMPLEMENTED).
// Whether this build has the CUDA kernels.
bool have_cuda();
// Number of CUDA devices; 0 when there is no driver or device.
int device_count();

// The tensors of one launch share a device and hyperparameters.
std::string adam(const TensorRef* tensors, std::size_t count, const AdamHyper& h, void* stream);

// Both LAMB passes: moments and norms, then the trust-ratio update, all on the device.
// lr * clamp(|p| / |u|, min_coeff, max_coeff) per tensor (1 when a norm is 0).
// The norms are deterministic: per-thread fp64 sums over fixed strides of 4096-element
// blocks, a fixed tree per block, the block partials summed by one fixed-order pass per
// tensor (no atomics). The order depends only on the tensor's size, so runs, batchings and
// neighbouring tensors never change a bit. They agree with lamb_moments_cpu (whose fp32
// SIMD partials depend on the CPU) to a relative 1e-5 (tests/optimizers/lamb_norms_test.cpp).
std::string lamb(const TensorRef* tensors, std::size_t count, const LambHyper& h, float lr,
                 float min_coeff, float max_coeff, void* stream);

// LAMB pass 1 alone (m and v updated, p untouched): out[2 * i] = sum p^2 and out[2 * i + 1] =
// sum u^2 of tensors[i] (0 for an empty one), as lamb() computes them. Synchronizes. For tests.
std::string lamb_norms(const TensorRef* tensors, std::size_t count, const LambHyper& h, double* out,
                       void* stream);

// Memory helpers for state on a device.
std::string alloc(void** out, std::size_t bytes, int device);
void free(void* ptr);
std::string memset_zero(void* ptr, std::size_t bytes, void* stream);
std::string copy_to_host(void* dst, const void* src, std::size_t bytes, void* stream);
std::string copy_to_device(void* dst, const void* src, std::size_t bytes, void* stream);

}  // namespace loom::optim::cuda
