// CUDA kernels of the curriculum metrics. Every call first runs one check pass (a thread per
// sample: its offsets, then its tokens) and reads its result back, so the compute kernels only
// see valid data and count() adds nothing when the data are bad. Scores: a warp per sample, each
// lane summing a strided share of its tokens, then a shuffle tree over the lanes. Every sum is
// an integer (seqlen: a count; vocabulary_rarity: the fixed-point values of the host's
// rarity_table, kernels.hpp), exact in any order, so the scores are bit-identical to the CPU's.
#include <cuda_runtime.h>
#include <loom/sdk/cuda.hpp>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels.hpp"

namespace loom::data::curriculum {

bool have_cuda() { return true; }

namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;
constexpr int kSamplesPerBlock = kThreads / kWarp;

// The sum over the warp's lanes, on every lane (integers: exact in any order).
__device__ __forceinline__ long long warp_sum(long long v) {
  for (int step = kWarp / 2; step > 0; step /= 2) v += __shfl_down_sync(0xffffffffu, v, step);
  return v;
}

__device__ __forceinline__ int64_t load_token(const void* tokens, int type, int64_t i) {
  if (type == 0) return static_cast<const uint16_t*>(tokens)[i];
  if (type == 1) return static_cast<const int32_t*>(tokens)[i];
  return static_cast<const int64_t*>(tokens)[i];
}

// rec[i]: the first problem of sample i (its offsets, then its tokens); bad counts samples
// with one. With no samples, thread 0 checks offsets[0] alone.
// max_len: the longest sample allowed (kSampleTooLong beyond, before its tokens are checked).
__global__ void check_kernel(const void* tokens, int type, int64_t token_count,
                             const int64_t* offsets, int64_t samples, int64_t vocab,
                             int64_t max_len, Problem* rec, unsigned* bad) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t threads = samples > 0 ? samples : 1;
  if (i >= threads) return;
  Problem p;
  p.kind = Problem::kNone;
  p.reserved = 0;
  p.index = 0;
  p.value = 0;
  p.previous = 0;
  const int64_t lo = offsets[i];
  if (i == 0 && (lo < 0 || lo > token_count)) {
    p.kind = lo < 0 ? Problem::kOffsetNegative : Problem::kOffsetBeyond;
    p.index = 0;
    p.value = lo;
  } else if (samples > 0) {
    const int64_t hi = offsets[i + 1];
    if (hi < 0 || hi > token_count) {
      p.kind = hi < 0 ? Problem::kOffsetNegative : Problem::kOffsetBeyond;
      p.index = i + 1;
      p.value = hi;
    } else if (hi < lo) {
      p.kind = Problem::kOffsetDecreasing;
      p.index = i + 1;
      p.value = hi;
      p.previous = lo;
    } else if (lo >= 0 && lo <= token_count && hi - lo > max_len) {
      p.kind = Problem::kSampleTooLong;
      p.index = i;
      p.value = hi - lo;
      p.previous = max_len;
    } else if (lo >= 0 && lo <= token_count) {
      for (int64_t k = lo; k < hi; ++k) {
        const int64_t t = load_token(tokens, type, k);
        if (t < 0 || t >= vocab) {
          p.kind = t < 0 ? Problem::kTokenNegative : Problem::kTokenTooLarge;
          p.index = k;
          p.value = t;
          break;
        }
      }
    }
  }
  rec[i] = p;
  if (p.kind != Problem::kNone) atomicAdd(bad, 1u);  // lint: integer atomic
}

// A warp per sample: blockDim.x == kThreads, sample blockIdx.x * kSamplesPerBlock + warp.
__global__ void seqlen_kernel(const void* tokens, int type, const int64_t* offsets, int64_t samples,
                              int64_t pad_token, double* scores) {
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const int64_t i =
      static_cast<int64_t>(blockIdx.x) * kSamplesPerBlock + static_cast<int>(threadIdx.x) / kWarp;
  // Lanes past the last sample still take part in the shuffles (no early return).
  const bool active = i < samples;
  long long n = 0;
  if (active) {
    for (int64_t k = offsets[i] + lane; k < offsets[i + 1]; k += kWarp) {
      n += load_token(tokens, type, k) != pad_token ? 1 : 0;
    }
  }
  n = warp_sum(n);
  if (active && lane == 0) scores[i] = static_cast<double>(n);
}

__global__ void rarity_kernel(const void* tokens, int type, const int64_t* offsets, int64_t samples,
                              const int64_t* value, double* scores) {
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const int64_t i =
      static_cast<int64_t>(blockIdx.x) * kSamplesPerBlock + static_cast<int>(threadIdx.x) / kWarp;
  const bool active = i < samples;
  long long sum = 0;
  if (active) {
    for (int64_t k = offsets[i] + lane; k < offsets[i + 1]; k += kWarp) {
      sum += value[load_token(tokens, type, k)];
    }
  }
  sum = warp_sum(sum);
  // As rarity_score_of: int64 to double (round to nearest), times 2^-kRarityFractionBits.
  if (active && lane == 0) {
    scores[i] =
        static_cast<double>(sum) * (1.0 / static_cast<double>(int64_t{1} << kRarityFractionBits));
  }
}

// Grid-stride over the samples' tokens [lo, lo + n): integer atomics, order-independent.
__global__ void count_kernel(const void* tokens, int type, int64_t lo, int64_t n,
                             unsigned long long* stats) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < n;
       k += stride) {
    atomicAdd(&stats[load_token(tokens, type, lo + k)], 1ull);  // lint: integer atomic
  }
}

int blocks_for(int64_t n) {
  return static_cast<int>(std::max<int64_t>(1, (n + kThreads - 1) / kThreads));
}

int sample_blocks(int64_t samples) {
  return static_cast<int>(
      std::max<int64_t>(1, (samples + kSamplesPerBlock - 1) / kSamplesPerBlock));
}

// Runs the check pass; returns the problem the CPU would report (lowest offset index, else
// lowest token index).
Problem check(const SampleData& s, cudaStream_t stream, int64_t max_len = INT64_MAX) {
  const int64_t threads = std::max<int64_t>(s.samples, 1);
  loom::sdk::CudaScratch rec(sizeof(Problem) * static_cast<std::size_t>(threads), stream);
  loom::sdk::CudaScratch bad(sizeof(unsigned), stream);
  LOOM_CUDA_CHECK(cudaMemsetAsync(bad.as<unsigned>(), 0, sizeof(unsigned), stream));
  check_kernel<<<blocks_for(threads), kThreads, 0, stream>>>(
      s.tokens, static_cast<int>(s.type), s.token_count, s.offsets, s.samples,
      static_cast<int64_t>(s.vocab_size), max_len, rec.as<Problem>(), bad.as<unsigned>());
  LOOM_CUDA_CHECK(cudaGetLastError());
  unsigned found = 0;
  LOOM_CUDA_CHECK(cudaMemcpyAsync(&found, bad.as<unsigned>(), sizeof(unsigned),
                                  cudaMemcpyDeviceToHost, stream));
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (found == 0) return {};
  std::vector<Problem> host(static_cast<std::size_t>(threads));
  LOOM_CUDA_CHECK(cudaMemcpyAsync(host.data(), rec.as<Problem>(), sizeof(Problem) * host.size(),
                                  cudaMemcpyDeviceToHost, stream));
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream));
  for (const Problem& p : host) {
    if (p.kind >= Problem::kOffsetNegative && p.kind <= Problem::kOffsetDecreasing) return p;
  }
  for (const Problem& p : host) {
    if (p.kind == Problem::kSampleTooLong) return p;
  }
  for (const Problem& p : host) {
    if (p.kind != Problem::kNone) return p;
  }
  return {};
}

}  // namespace

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

Problem seqlen(const SampleData& s, int64_t pad_token, double* scores, int device, void* stream) {
  loom::sdk::CudaDeviceGuard guard(device);
  auto* st = static_cast<cudaStream_t>(stream);
  if (Problem p = check(s, st); p.kind != Problem::kNone) return p;
  if (s.samples == 0) return {};
  seqlen_kernel<<<sample_blocks(s.samples), kThreads, 0, st>>>(
      s.tokens, static_cast<int>(s.type), s.offsets, s.samples, pad_token, scores);
  LOOM_CUDA_CHECK(cudaGetLastError());
  return {};
}

Problem count(const SampleData& s, int64_t* stats, int device, void* stream) {
  loom::sdk::CudaDeviceGuard guard(device);
  auto* st = static_cast<cudaStream_t>(stream);
  if (Problem p = check(s, st); p.kind != Problem::kNone) return p;
  if (s.samples == 0) return {};
  int64_t range[2] = {0, 0};
  LOOM_CUDA_CHECK(
      cudaMemcpyAsync(&range[0], s.offsets, sizeof(int64_t), cudaMemcpyDeviceToHost, st));
  LOOM_CUDA_CHECK(cudaMemcpyAsync(&range[1], s.offsets + s.samples, sizeof(int64_t),
                                  cudaMemcpyDeviceToHost, st));
  LOOM_CUDA_CHECK(cudaStreamSynchronize(st));
  const int64_t n = range[1] - range[0];
  if (n == 0) return {};
  const int blocks = static_cast<int>(std::min<int64_t>(blocks_for(n), 4096));
  count_kernel<<<blocks, kThreads, 0, st>>>(s.tokens, static_cast<int>(s.type), range[0], n,
                                            reinterpret_cast<unsigned long long*>(stats));
  LOOM_CUDA_CHECK(cudaGetLastError());
  return {};
}

Problem rarity(const SampleData& s, const RarityTable& table, double* scores, int device,
               void* stream) {
  loom::sdk::CudaDeviceGuard guard(device);
  auto* st = static_cast<cudaStream_t>(stream);
  if (Problem p = check(s, st, table.max_tokens); p.kind != Problem::kNone) return p;
  if (s.samples == 0) return {};
  const std::size_t bytes = sizeof(int64_t) * table.value.size();
  loom::sdk::CudaScratch dev_table(bytes, st);
  LOOM_CUDA_CHECK(cudaMemcpyAsync(dev_table.as<int64_t>(), table.value.data(), bytes,
                                  cudaMemcpyHostToDevice, st));
  rarity_kernel<<<sample_blocks(s.samples), kThreads, 0, st>>>(
      s.tokens, static_cast<int>(s.type), s.offsets, s.samples, dev_table.as<int64_t>(), scores);
  LOOM_CUDA_CHECK(cudaGetLastError());
  // The table's host copy (the caller's) must outlive the transfer.
  LOOM_CUDA_CHECK(cudaStreamSynchronize(st));
  return {};
}

void copy_to_host(void* dst, const void* src, std::size_t bytes, int device, void* stream) {
  loom::sdk::CudaDeviceGuard guard(device);
  auto* st = static_cast<cudaStream_t>(stream);
  LOOM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, st));
  LOOM_CUDA_CHECK(cudaStreamSynchronize(st));
}

}  // namespace cuda
}  // namespace loom::data::curriculum
