// Fused multi-tensor CUDA kernels of the optimizers. Plain C++ interface (compiled by the
// host compiler on one side and nvcc on the other). Every function is stream-ordered on
// `stream` (a cudaStream_t) and returns an empty string on success, else the error.
#pragma once

#include <cstddef>
#include <string>

#include "kernels/cpu.hpp"

namespace loom::optim::cuda {

// Number of CUDA devices; 0 when there is no driver or device.
int device_count();

// The tensors of one launch share a device and hyperparameters.
std::string adam(const TensorRef* tensors, std::size_t count, const AdamHyper& h, void* stream);

// Both LAMB passes: moments and norms, then the trust-ratio update, all on the device.
// lr * clamp(|p| / |u|, min_coeff, max_coeff) per tensor (1 when a norm is 0).
std::string lamb(const TensorRef* tensors, std::size_t count, const LambHyper& h, float lr,
                 float min_coeff, float max_coeff, void* stream);

// Memory helpers for state on a device.
std::string alloc(void** out, std::size_t bytes, int device);
void free(void* ptr);
std::string memset_zero(void* ptr, std::size_t bytes, void* stream);
std::string copy_to_host(void* dst, const void* src, std::size_t bytes, void* stream);
std::string copy_to_device(void* dst, const void* src, std::size_t bytes, void* stream);

}  // namespace loom::optim::cuda
