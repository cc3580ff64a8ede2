// Shared bits of the MoE CUDA files: the error check and a grid-stride launch shape.
#pragma once

#include <cuda_runtime.h>
#include <loom/sdk/cuda.hpp>
#include <loom/sdk/status.hpp>

#include <algorithm>
#include <cstdint>

#define LOOM_MOE_CUDA(call) ::loom::sdk::cuda_check((call), #call, __FILE__, __LINE__)

namespace loom::moe::cuda {

constexpr int kThreads = 256;

inline unsigned blocks_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(b, 65535)));
}

inline cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

inline void check_launch(const char* what) {
  LOOM_MOE_CUDA(cudaGetLastError());
  (void)what;
}

}  // namespace loom::moe::cuda
