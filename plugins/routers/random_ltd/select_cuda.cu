// random_ltd's selection on CUDA: one block per sequence, no limit on the sequence length
// from shared memory (the keys live in the workspace, in global memory). Every thread writes
// the keys of its share of the positions (select_key.hpp), then the block selects the `kept`
// smallest with loom_router_core's radix select and ordered compaction (block_select.cuh).
// The same set as the host's nth_element (the `kept` smallest keys, ties by position), so
// the rows are bit-identical to select_cpu's.
#include <cuda_runtime.h>
#include <loom/sdk/cuda.hpp>
#include <loom/sdk/status.hpp>

#include <cstdint>
#include <string>

#include "block_select.cuh"
#include "select.hpp"
#include "select_key.hpp"

namespace loom::routers::ltd::cuda {
namespace {

namespace bs = loom::routers::block_select;
constexpr int kThreads = bs::kSelectThreads;

__global__ void iota_kernel(int32_t* out, int64_t batch, int64_t seq_len) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < batch * seq_len) out[i] = static_cast<int32_t>(i % seq_len);
}

__global__ void select_kernel(uint64_t seed, int64_t step, int32_t layer, int64_t first_sample,
                              int64_t seq_len, int64_t kept, uint64_t* workspace,
                              int32_t* indices) {
  __shared__ bs::Shared sh;
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t b = blockIdx.x;
  uint64_t* keys = workspace + b * seq_len;
  int32_t* out = indices + b * kept;
  const KeyStream ks = key_stream(seed, step, layer, first_sample + b);

  // 1. The keys.
  const int64_t pairs = (seq_len + 1) / 2;
  for (int64_t m = tid; m < pairs; m += kThreads) {
    uint64_t even = 0, odd = 0;
    key_pair(ks, static_cast<uint32_t>(m), &even, &odd);
    keys[2 * m] = even;
    if (2 * m + 1 < seq_len) keys[2 * m + 1] = odd;
  }
  __syncthreads();
  // 2. and 3. The threshold and the ordered compaction (block_select.cuh).
  const auto key_at = [keys](int64_t p) { return keys[p]; };
  const bs::Threshold th = bs::radix_threshold(key_at, seq_len, kept, sh);
  bs::ordered_compaction(key_at, seq_len, th, sh,
                         [out](int64_t j, int64_t p) { out[j] = static_cast<int32_t>(p); });
}

// The selection over caller-supplied keys (select_keys, for tests).
__global__ void keys_select_kernel(const uint64_t* keys_in, int64_t seq_len, int64_t kept,
                                   int32_t* indices) {
  __shared__ bs::Shared sh;
  const int64_t b = blockIdx.x;
  const uint64_t* keys = keys_in + b * seq_len;
  int32_t* out = indices + b * kept;
  const auto key_at = [keys](int64_t p) { return keys[p]; };
  const bs::Threshold th = bs::radix_threshold(key_at, seq_len, kept, sh);
  bs::ordered_compaction(key_at, seq_len, th, sh,
                         [out](int64_t j, int64_t p) { out[j] = static_cast<int32_t>(p); });
}

}  // namespace

void select_keys(const uint64_t* keys, int64_t batch, int64_t seq_len, int64_t kept,
                 int32_t* indices, int device, void* stream) {
  if (batch < 1) return;
  if (batch > INT32_MAX || kept < 1 || kept > seq_len) {
    throw loom::sdk::Error(LOOM_ERR_INVALID_ARGUMENT,
                           "random_ltd select_keys: batch " + std::to_string(batch) + ", kept " +
                               std::to_string(kept) + " of " + std::to_string(seq_len));
  }
  const loom::sdk::CudaDeviceGuard guard(device);
  auto* s = static_cast<cudaStream_t>(stream);
  LOOM_CUDA_CHECK(cudaPeekAtLastError());
  keys_select_kernel<<<static_cast<unsigned>(batch), kThreads, 0, s>>>(keys, seq_len, kept,
                                                                       indices);
  LOOM_CUDA_CHECK(cudaGetLastError());
}

void select(const SelectJob& job, int32_t* indices, void* workspace, int device, void* stream) {
  if (job.batch < 1) return;
  const loom::sdk::CudaDeviceGuard guard(device);
  auto* s = static_cast<cudaStream_t>(stream);
  if (job.kept >= job.seq_len) {
    const int64_t n = job.batch * job.seq_len;
    const int64_t blocks = (n + kThreads - 1) / kThreads;
    if (blocks > INT32_MAX) {
      throw loom::sdk::Error(LOOM_ERR_OUT_OF_RANGE, "random_ltd select: " + std::to_string(n) +
                                                        " indices need more " +
                                                        "CUDA blocks than a grid holds");
    }
    LOOM_CUDA_CHECK(cudaPeekAtLastError());  // an earlier launch's error is not ours
    iota_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(indices, job.batch, job.seq_len);
    LOOM_CUDA_CHECK(cudaGetLastError());
    return;
  }
  if (job.batch > INT32_MAX) {
    throw loom::sdk::Error(LOOM_ERR_OUT_OF_RANGE, "random_ltd select: batch " +
                                                      std::to_string(job.batch) +
                                                      " is more CUDA blocks than a grid holds");
  }
  if (workspace == nullptr) {
    throw loom::sdk::Error(LOOM_ERR_INVALID_ARGUMENT,
                           "random_ltd select: the workspace is NULL; plan asks for " +
                               std::to_string(workspace_bytes(job.batch, job.seq_len, job.kept)) +
                               " bytes");
  }
  LOOM_CUDA_CHECK(cudaPeekAtLastError());  // an earlier launch's error is not ours
  select_kernel<<<static_cast<unsigned>(job.batch), kThreads, 0, s>>>(
      job.seed, job.step, job.layer, job.first_sample, job.seq_len, job.kept,
      static_cast<uint64_t*>(workspace), indices);
  LOOM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace loom::routers::ltd::cuda
