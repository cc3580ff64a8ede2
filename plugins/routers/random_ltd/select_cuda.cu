// random_ltd's selection on CUDA: one block per sequence, no limit on the sequence length
// from shared memory (the keys live in the workspace, in global memory).
//  1. Every thread writes the keys of its share of the positions (select_key.hpp).
//  2. A radix select over the 64-bit keys, 8 bits per pass from the top: a shared histogram
//     of the next digit among the keys that match the digits chosen so far, then (a block
//     scan over the 256 digits) the digit that holds the rank-kept key. It stops once the
//     chosen bucket is taken whole (after 3 passes or so for random keys). Then `prefix`
//     (the top `bits` bits of the threshold key) and `take` (how many keys with that prefix
//     to keep, the first by position) are known.
//  3. An ordered compaction over tiles of kThreads * kPerThread positions: each thread counts
//     the keys of its consecutive positions below and equal to the prefix, a block scan turns
//     the counts into output offsets, and the thread writes its kept positions in order.
// The same set as the host's nth_element (the `kept` smallest keys, ties by position), so
// the rows are bit-identical to select_cpu's.
#include <cuda_runtime.h>
#include <loom/sdk/cuda.hpp>
#include <loom/sdk/status.hpp>

#include <cstdint>
#include <string>

#include "select.hpp"
#include "select_key.hpp"

namespace loom::routers::ltd::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kPerThread = 8;
constexpr int kTile = kThreads * kPerThread;
constexpr int kDigits = 256;
static_assert(kThreads == kDigits, "the radix select gives each thread one digit");

__global__ void iota_kernel(int32_t* out, int64_t batch, int64_t seq_len) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < batch * seq_len) out[i] = static_cast<int32_t>(i % seq_len);
}

// The exclusive prefix sum of v over the block (every thread calls it), and the block's total.
// A warp's suffix sums by __shfl_down_sync, then the warps' totals through shared memory.
__device__ uint64_t block_exclusive_scan(uint64_t v, uint64_t* warp_totals, uint64_t* total) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  uint64_t suffix = v;  // the sum over lanes >= lane of this warp
  for (int d = 1; d < 32; d *= 2) {
    const uint64_t other = __shfl_down_sync(0xffffffffu, suffix, d);
    if (lane + d < 32) suffix += other;
  }
  if (lane == 0) warp_totals[warp] = suffix;
  __syncthreads();
  uint64_t before = warp_totals[warp] - suffix;  // lanes < lane of this warp
  uint64_t all = 0;
  for (int w = 0; w < kWarps; ++w) {
    if (w < warp) before += warp_totals[w];
    all += warp_totals[w];
  }
  __syncthreads();  // warp_totals is reused by the next call
  *total = all;
  return before;
}

__global__ void select_kernel(uint64_t seed, int64_t step, int32_t layer, int64_t first_sample,
                              int64_t seq_len, int64_t kept, uint64_t* workspace,
                              int32_t* indices) {
  __shared__ unsigned hist[kDigits];
  __shared__ uint64_t warp_totals[kWarps];
  __shared__ uint64_t tile[kTile];
  __shared__ uint64_t s_prefix;
  __shared__ int64_t s_take;
  __shared__ int s_bits;
  __shared__ int s_done;
  __shared__ uint64_t s_base;  // packed (below | equal << 32) counts of the tiles before

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
  if (tid == 0) {
    s_prefix = 0;
    s_take = kept;
    s_bits = 0;
    s_done = 0;
    s_base = 0;
  }
  __syncthreads();

  // 2. The radix select. Thread d owns digit d: a block scan of the histogram finds the
  // digit whose bucket holds the rank-`take` key.
  for (;;) {
    hist[tid] = 0;
    __syncthreads();
    const int bits = s_bits;
    const uint64_t prefix = s_prefix;
    const auto take = static_cast<uint64_t>(s_take);
    const int shift = 56 - bits;  // of the next digit
    for (int64_t p = tid; p < seq_len; p += kThreads) {
      const uint64_t k = keys[p];
      if (bits == 0 || (k >> (64 - bits)) == prefix) {
        atomicAdd(&hist[(k >> shift) & 0xffu], 1u);  // lint: integer atomic
      }
    }
    __syncthreads();
    const uint64_t count = hist[tid];
    uint64_t all = 0;
    const uint64_t below = block_exclusive_scan(count, warp_totals, &all);
    if (below < take && take <= below + count) {  // exactly one thread: count >= 1
      s_prefix = (prefix << 8) | static_cast<uint64_t>(tid);
      s_bits = bits + 8;
      s_take = static_cast<int64_t>(take - below);
      s_done = (take - below == count || bits + 8 == 64) ? 1 : 0;
    }
    __syncthreads();
    if (s_done != 0) break;
  }
  const int rest = 64 - s_bits;  // the bits below the chosen prefix: 0 .. 56
  const uint64_t prefix = s_prefix;
  const auto take = static_cast<uint64_t>(s_take);

  // 3. The ordered compaction.
  for (int64_t base = 0; base < seq_len; base += kTile) {
    for (int i = tid; i < kTile; i += kThreads) {
      const int64_t p = base + i;
      tile[i] = p < seq_len ? keys[p] : ~uint64_t{0};
    }
    __syncthreads();
    uint64_t count = 0;  // below | equal << 32, over this thread's positions
    for (int i = 0; i < kPerThread; ++i) {
      const int64_t p = base + tid * kPerThread + i;
      if (p >= seq_len) break;
      const uint64_t top = tile[tid * kPerThread + i] >> rest;
      count += top < prefix ? 1u : (top == prefix ? (uint64_t{1} << 32) : 0u);
    }
    uint64_t total = 0;
    const uint64_t before = s_base + block_exclusive_scan(count, warp_totals, &total);
    uint64_t below = before & 0xffffffffu;
    uint64_t equal = before >> 32;
    for (int i = 0; i < kPerThread; ++i) {
      const int64_t p = base + tid * kPerThread + i;
      if (p >= seq_len) break;
      const uint64_t top = tile[tid * kPerThread + i] >> rest;
      if (top < prefix) {
        out[below + (equal < take ? equal : take)] = static_cast<int32_t>(p);
        ++below;
      } else if (top == prefix) {
        if (equal < take) out[below + equal] = static_cast<int32_t>(p);
        ++equal;
      }
    }
    __syncthreads();  // every thread has read s_base and the tile
    if (tid == 0) s_base += total;
    __syncthreads();
  }
}

}  // namespace

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
  select_kernel<<<static_cast<unsigned>(job.batch), kThreads, 0, s>>>(
      job.seed, job.step, job.layer, job.first_sample, job.seq_len, job.kept,
      static_cast<uint64_t*>(workspace), indices);
  LOOM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace loom::routers::ltd::cuda
