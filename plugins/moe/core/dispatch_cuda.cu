// Index dispatch on CUDA: gather of token rows into their slots, the weighted combine in
// choice order (written, never atomics) and its weight gradient; the slots come from the
// host's stable counting sort.
#include <loom/moe/moe_cuda.hpp>
#include "cuda_util.cuh"

namespace loom::moe::cuda {
namespace {

__global__ void gather_kernel(const float* x, int64_t pairs, int64_t M, int k, const int64_t* slot,
                              const float* w, float* rows) {
  const int64_t n = pairs * M;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t pair = i / M, m = i % M;
    const int64_t r = slot[pair];
    if (r < 0) continue;
    const float v = x[(pair / k) * M + m];
    rows[r * M + m] = w == nullptr ? v : w[pair] * v;
  }
}

__global__ void combine_kernel(const float* rows, int64_t tokens, int64_t M, int k,
                               const int64_t* slot, const float* w, float* y, bool accumulate) {
  const int64_t n = tokens * M;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t s = i / M, m = i % M;
    float acc = accumulate ? y[i] : 0.0f;
    for (int j = 0; j < k; ++j) {
      const int64_t r = slot[s * k + j];
      if (r < 0) continue;
      const float wj = w == nullptr ? 1.0f : w[s * k + j];
      acc = acc + wj * rows[r * M + m];
    }
    y[i] = acc;
  }
}

__global__ void weight_grad_kernel(const float* rows, const float* dy, int64_t pairs, int64_t M,
                                   int k, const int64_t* slot, float* dw) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < pairs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = slot[i];
    float acc = 0.0f;
    if (r >= 0) {
      const float* d = dy + (i / k) * M;
      const float* src = rows + r * M;
      for (int64_t m = 0; m < M; ++m) acc = acc + d[m] * src[m];
    }
    dw[i] = acc;
  }
}

}  // namespace

void gather_rows(const float* x, int64_t tokens, int64_t model_dim, int k, const int64_t* slot,
                 const float* weights, float* rows, void* stream) {
  if (tokens <= 0) return;
  gather_kernel<<<blocks_for(tokens * k * model_dim), kThreads, 0, as_stream(stream)>>>(
      x, tokens * k, model_dim, k, slot, weights, rows);
  check_launch("gather_rows");
}

void combine_rows(const float* rows, int64_t tokens, int64_t model_dim, int k, const int64_t* slot,
                  const float* weights, float* y, bool accumulate, void* stream) {
  if (tokens <= 0) return;
  combine_kernel<<<blocks_for(tokens * model_dim), kThreads, 0, as_stream(stream)>>>(
      rows, tokens, model_dim, k, slot, weights, y, accumulate);
  check_launch("combine_rows");
}

void combine_weight_grad(const float* rows, const float* dy, int64_t tokens, int64_t model_dim,
                         int k, const int64_t* slot, float* dweights, void* stream) {
  if (tokens <= 0) return;
  weight_grad_kernel<<<blocks_for(tokens * k), kThreads, 0, as_stream(stream)>>>(
      rows, dy, tokens * k, model_dim, k, slot, dweights);
  check_launch("combine_weight_grad");
}

}  // namespace loom::moe::cuda
