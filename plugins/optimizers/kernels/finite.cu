// The CUDA finite check of the gradients (kernels/finite.hpp): one multi-tensor launch per
// kMaxTensors tensors, each block taking one chunk of one tensor and storing 1.0f to the
// flag when it finds a non-finite element.
#include <cuda_runtime.h>
#include <loom/sdk/cuda.hpp>

#include <cstdint>
#include <string>

#include "common/half.hpp"
#include "kernels/finite.hpp"

namespace loom::optim::cuda {
namespace {

constexpr int kMaxTensors = 32;
constexpr int kThreads = 256;
constexpr int kChunk = kThreads * 16;  // elements per block

struct FiniteLaunch {
  const void* g[kMaxTensors];
  int64_t n[kMaxTensors];
  int block_start[kMaxTensors + 1];  // first block of each tensor
  uint8_t gtype[kMaxTensors];
  int count;
};

namespace conv = loom::plugins::half;  // not "half": CUDA's fp16 type

__device__ __forceinline__ float load_grad(const void* g, uint8_t type, int64_t i) {
  if (type == 0) return static_cast<const float*>(g)[i];
  const uint16_t h = static_cast<const uint16_t*>(g)[i];
  return type == 1 ? conv::bf16_to_f32(h) : conv::f16_to_f32(h);
}

__global__ void flag_nonfinite_kernel(FiniteLaunch L, float inv_scale, float* flag) {
  int t = 0;
  while (t + 1 < L.count && L.block_start[t + 1] <= static_cast<int>(blockIdx.x)) ++t;
  const int64_t begin = static_cast<int64_t>(blockIdx.x - L.block_start[t]) * kChunk;
  const int64_t end = min(L.n[t], begin + kChunk);
  bool bad = false;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    // __fmul_rn: the same fp32 product as the optimizer kernels, never contracted. An
    // all-ones exponent is Inf or NaN.
    const uint32_t bits = __float_as_uint(__fmul_rn(load_grad(L.g[t], L.gtype[t], i), inv_scale));
    bad = bad || (bits & 0x7F800000u) == 0x7F800000u;
  }
  if (bad) *flag = 1.0f;
}

std::string err(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return {};
  return loom::sdk::cuda_failure(e, what, __FILE__, __LINE__);
}

}  // namespace

std::string flag_nonfinite(const FiniteInput* tensors, std::size_t count, float inv_scale,
                           float* flag, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  std::size_t i = 0;
  while (i < count) {
    FiniteLaunch L{};
    int64_t blocks = 0;
    while (i < count && L.count < kMaxTensors) {
      const FiniteInput& t = tensors[i];
      if (t.n == 0) {
        ++i;
        continue;
      }
      const int64_t tb = (static_cast<int64_t>(t.n) + kChunk - 1) / kChunk;
      if (L.count > 0 && blocks + tb > (int64_t{1} << 30)) break;
      const int k = L.count++;
      L.g[k] = t.g;
      L.n[k] = static_cast<int64_t>(t.n);
      L.gtype[k] = static_cast<uint8_t>(t.gtype);
      L.block_start[k] = static_cast<int>(blocks);
      blocks += tb;
      ++i;
    }
    L.block_start[L.count] = static_cast<int>(blocks);
    if (L.count == 0) continue;
    flag_nonfinite_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(L, inv_scale, flag);
    std::string e = err(cudaGetLastError(), "finite check kernel launch");
    if (!e.empty()) return e;
  }
  return {};
}

}  // namespace loom::optim::cuda
