// float16_io.hpp's conversions as CUDA kernels: common/half.hpp's integer rule, so the bits
// equal the host's. A core includes this in one of its .cu files and launches them from its
// own CUDA interface (docs/sdk.md, "CPU and CUDA"); the launches stay in the .cu, where the
// CUDA emulation rewrites them. `storage` is a float16::Storage: a run-time argument, the same
// branch for every thread of a launch.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "float16_io.hpp"
#include "half.hpp"

namespace loom::plugins::float16 {

__device__ __forceinline__ float widen_one(const void* src, int storage, int64_t i) {
  if (storage == static_cast<int>(Storage::kF32)) return static_cast<const float*>(src)[i];
  const uint16_t h = static_cast<const uint16_t*>(src)[i];
  return storage == static_cast<int>(Storage::kBF16) ? half::bf16_to_f32(h) : half::f16_to_f32(h);
}

// dst[i] = src[i] as float32, i < n (grid-stride).
__global__ void widen_kernel(const void* src, int storage, float* dst, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    dst[i] = widen_one(src, storage, i);
  }
}

// dst[i] = src[i] rounded to dst's storage.
__global__ void narrow_kernel(const float* src, int storage, void* dst, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const float v = src[i];
    if (storage == static_cast<int>(Storage::kF32)) {
      static_cast<float*>(dst)[i] = v;
    } else {
      static_cast<uint16_t*>(dst)[i] =
          storage == static_cast<int>(Storage::kBF16) ? half::f32_to_bf16(v) : half::f32_to_f16(v);
    }
  }
}

// Blocks of 256 threads for n elements, at most 4096 (the loops stride over the rest).
inline unsigned grid_for(int64_t n) {
  const int64_t blocks = (n + 255) / 256;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks < 4096 ? blocks : 4096));
}

}  // namespace loom::plugins::float16
