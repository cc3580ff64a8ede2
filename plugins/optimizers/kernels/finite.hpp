// The finite check of a step's gradients, run before an optimizer changes anything: a step
// whose gradients (after dividing by grad_scale) hold a NaN or an Inf is skipped. Plain C++
// interface, shared by the CPU (Highway, finite.cpp) and CUDA (finite.cu) sides.
#pragma once

#include <cstddef>
#include <string>

#include "kernels/cpu.hpp"

namespace loom::optim {

// One gradient to check: n elements of gtype at g.
struct FiniteInput {
  const void* g = nullptr;
  DType gtype = DType::kF32;
  std::size_t n = 0;
};

// True when float(g[i]) * inv_scale is finite for every i (the product in fp32, as the
// optimizer kernels compute it: a finite gradient that overflows once unscaled counts as
// non-finite, and so does any gradient when inv_scale is not finite). Threaded; dispatched
// at run time to the best SIMD target of the CPU.
bool all_finite_cpu(const FiniteInput& t, float inv_scale);

namespace cuda {

// Stores 1.0f to *flag (device memory, one float) when any element of the tensors, times
// inv_scale, is not finite; leaves it untouched otherwise, so the caller zeroes it first and
// may check several lists into one flag. A float, so that it can go through an fp32
// allreduce MAX as it is. Stream-ordered; no atomics (every writer stores the same value).
std::string flag_nonfinite(const FiniteInput* tensors, std::size_t count, float inv_scale,
                           float* flag, void* stream);

}  // namespace cuda
}  // namespace loom::optim
