// topk_router's CUDA kernels (topk_kernels.hpp), every value from topk_math.hpp in the CPU's
// order, so the results are the CPU's bit for bit:
// - scores: a thread per token; blocks of tokens stage their rows' channels through shared
//   memory with coalesced loads, and each thread adds its token's channel sum in increasing
//   order, into the workspace;
// - top-k: a block per sequence, loom_router_core's radix select over the 64-bit rank keys
//   and ordered compaction (block_select.cuh, shared with random_ltd); global memory only for
//   the keys' source, so any seq_len works;
// - backward: the score gradients ds once (a thread per kept token, into the workspace), dx a
//   thread per (kept token, channel); dweight a thread per (sequence, channel) for the partial
//   sum over the kept tokens, then a thread per channel for the sum over the sequences.
// Each entry checks cudaPeekAtLastError before its first launch, so an error a previous
// (asynchronous) launch left is reported as that, not blamed on these kernels' launches.
#include <cuda_runtime.h>
#include <loom/sdk/cuda.hpp>
#include <loom/sdk/status.hpp>

#include <algorithm>
#include <cstdint>
#include <string>

#include "block_select.cuh"
#include "topk_kernels.hpp"

namespace loom::routers::topk::cuda {
namespace {

constexpr int kThreads = 256;
namespace bs = loom::routers::block_select;

// The grid of a kernel with a thread per element of a [n0, n1, n2] index space, `per_block`
// threads a block: throws OUT_OF_RANGE naming `what` when the count overflows int64 or the
// grid's 2^31 - 1 blocks.
unsigned grid_for(const char* what, int per_block, int64_t n0, int64_t n1 = 1, int64_t n2 = 1) {
  int64_t n = 0;
  if (__builtin_mul_overflow(n0, n1, &n) || __builtin_mul_overflow(n, n2, &n) ||
      n / per_block >= INT32_MAX) {
    throw loom::sdk::Error(LOOM_ERR_OUT_OF_RANGE,
                           std::string("topk_router: ") + what + " (" + std::to_string(n0) + " x " +
                               std::to_string(n1) + " x " + std::to_string(n2) +
                               ") needs more CUDA blocks than a grid holds");
  }
  return static_cast<unsigned>(std::max<int64_t>(1, n / per_block + (n % per_block != 0 ? 1 : 0)));
}

// Scores: a block of kScoreTokens tokens, one per thread; the channels go through shared
// memory kScoreChannels at a time, loaded coalesced (consecutive threads read consecutive
// channels of one token's row), and each thread adds its own token's products in increasing
// channel order (the CPU's order, so the same bits).
constexpr int kScoreTokens = 128;
constexpr int kScoreChannels = 32;
constexpr int kScoreStride = kScoreChannels + 1;  // padded: threads read rows apart

template <class T>
__global__ void score_kernel(const T* x, int64_t batch_stride, int64_t position_stride, const T* w,
                             int64_t batch, int64_t seq_len, int64_t channels, double* scores) {
  __shared__ double tile[kScoreTokens * kScoreStride];
  __shared__ double wtile[kScoreChannels];
  __shared__ int64_t row_of[kScoreTokens];
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kScoreTokens;
  const int64_t tokens = batch * seq_len;
  const int64_t t = first + tid;
  if (t < tokens) row_of[tid] = (t / seq_len) * batch_stride + (t % seq_len) * position_stride;
  const int here = static_cast<int>(tokens - first < kScoreTokens ? tokens - first : kScoreTokens);
  double acc = 0.0;
  for (int64_t c0 = 0; c0 < channels; c0 += kScoreChannels) {
    const int cn =
        static_cast<int>(channels - c0 < kScoreChannels ? channels - c0 : kScoreChannels);
    __syncthreads();  // row_of written; the previous chunk's tile read by every thread
    for (int i = tid; i < here * kScoreChannels; i += kScoreTokens) {
      const int r = i / kScoreChannels;
      const int c = i % kScoreChannels;
      if (c < cn) tile[r * kScoreStride + c] = to_double(x[row_of[r] + c0 + c]);
    }
    if (tid < cn) wtile[tid] = to_double(w[c0 + tid]);
    __syncthreads();
    if (t < tokens) {
      const double* row = tile + tid * kScoreStride;
      for (int c = 0; c < cn; ++c) acc = add(acc, mul(row[c], wtile[c]));
    }
  }
  if (t < tokens) scores[t] = acc;
}

// Top-k: a block per sequence, loom_router_core's radix select and ordered compaction
// (block_select.cuh) over the rank keys, read from the scores.
template <class T>
__global__ void topk_kernel(const double* scores, int64_t seq_len, int64_t kept, int gate,
                            int32_t* indices, T* gates, double* saved) {
  __shared__ bs::Shared sh;
  const int64_t b = blockIdx.x;
  const double* sc = scores + b * seq_len;
  int32_t* idx = indices + b * kept;
  T* g = gates + b * kept;
  double* sv = saved + b * kept;
  const auto key_at = [sc](int64_t p) { return static_cast<uint64_t>(rank_key(sc[p])); };
  const bs::Threshold th = bs::radix_threshold(key_at, seq_len, kept, sh);
  bs::ordered_compaction(key_at, seq_len, th, sh, [&](int64_t j, int64_t p) {
    const double score = sc[p];
    idx[j] = static_cast<int32_t>(p);
    sv[j] = score;
    g[j] = static_cast<T>(gate_of(score, static_cast<Gate>(gate)));
  });
}

// ds[k] = dL/dscore of kept token k, once, into the workspace (after the partials).
template <class T>
__global__ void ds_kernel(const T* dgates, const double* saved, int64_t n, int gate, double* ds) {
  const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k < n) ds[k] = score_grad(to_double(dgates[k]), saved[k], static_cast<Gate>(gate));
}

// Device indices are not read back (that would synchronise): a kept position outside
// [0, seq_len) is skipped, never written out of bounds (the host path refuses such rows).
template <class T>
__global__ void dx_kernel(const T* w, const int32_t* indices, const double* ds, int64_t batch,
                          int64_t seq_len, int64_t kept, int64_t channels, T* dx,
                          int64_t batch_stride, int64_t position_stride) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= batch * kept * channels) return;
  const int64_t c = t % channels;
  const int64_t k = t / channels;  // b * kept + j
  const int64_t b = k / kept;
  if (indices[k] < 0 || indices[k] >= seq_len) return;
  T* v = dx + b * batch_stride + int64_t{indices[k]} * position_stride + c;
  *v = static_cast<T>(add(to_double(*v), mul(ds[k], to_double(w[c]))));
}

template <class T>
__global__ void dw_partial_kernel(const T* x, int64_t batch_stride, int64_t position_stride,
                                  const int32_t* indices, const double* ds, int64_t batch,
                                  int64_t seq_len, int64_t kept, int64_t channels,
                                  double* partial) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= batch * channels) return;
  const int64_t b = t / channels;
  const int64_t c = t % channels;
  double part = 0.0;
  for (int64_t j = 0; j < kept; ++j) {
    const int64_t k = b * kept + j;
    if (indices[k] < 0 || indices[k] >= seq_len) continue;
    part =
        add(part,
            mul(ds[k], to_double(x[b * batch_stride + int64_t{indices[k]} * position_stride + c])));
  }
  partial[t] = part;
}

template <class T>
__global__ void dw_total_kernel(const double* partial, int64_t batch, int64_t channels, T* dw) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  double total = 0.0;
  for (int64_t b = 0; b < batch; ++b) total = add(total, partial[b * channels + c]);
  dw[c] = static_cast<T>(add(to_double(dw[c]), total));
}

template <class T>
void select_typed(const SelectData& d, cudaStream_t st) {
  const Shape& s = d.shape;
  if (s.batch > INT32_MAX) {
    throw loom::sdk::Error(LOOM_ERR_OUT_OF_RANGE,
                           "topk_router select: batch " + std::to_string(s.batch) +
                               " is more CUDA blocks (one per sequence) than a grid holds");
  }
  const unsigned score_grid =
      grid_for("the scores of batch x seq_len", kScoreTokens, s.batch, s.seq_len);
  LOOM_CUDA_CHECK(cudaPeekAtLastError());  // an earlier launch's error is not ours to report
  score_kernel<T><<<score_grid, kScoreTokens, 0, st>>>(
      static_cast<const T*>(d.x.data), d.x.batch_stride, d.x.position_stride,
      static_cast<const T*>(d.weight), s.batch, s.seq_len, s.channels, d.scores);
  LOOM_CUDA_CHECK(cudaGetLastError());
  topk_kernel<T><<<static_cast<unsigned>(s.batch), bs::kSelectThreads, 0, st>>>(
      d.scores, s.seq_len, s.kept, static_cast<int>(s.gate), d.indices, static_cast<T*>(d.gates),
      d.saved);
  LOOM_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void backward_typed(const BackwardData& d, cudaStream_t st) {
  const Shape& s = d.shape;
  const int gate = static_cast<int>(s.gate);
  const unsigned ds_grid =
      grid_for("the score gradients of batch x kept", kThreads, s.batch, s.kept);
  const unsigned dx_grid =
      grid_for("dx of batch x kept x channels", kThreads, s.batch, s.kept, s.channels);
  const unsigned part_grid =
      grid_for("dweight partials of batch x channels", kThreads, s.batch, s.channels);
  const unsigned total_grid = grid_for("dweight of channels", kThreads, s.channels);
  LOOM_CUDA_CHECK(cudaPeekAtLastError());  // an earlier launch's error is not ours to report
  ds_kernel<T><<<ds_grid, kThreads, 0, st>>>(static_cast<const T*>(d.dgates), d.saved,
                                             s.batch * s.kept, gate, d.ds);
  LOOM_CUDA_CHECK(cudaGetLastError());
  dx_kernel<T><<<dx_grid, kThreads, 0, st>>>(
      static_cast<const T*>(d.weight), d.indices, d.ds, s.batch, s.seq_len, s.kept, s.channels,
      static_cast<T*>(d.dx), d.dx_batch_stride, d.dx_position_stride);
  LOOM_CUDA_CHECK(cudaGetLastError());
  dw_partial_kernel<T><<<part_grid, kThreads, 0, st>>>(
      static_cast<const T*>(d.x.data), d.x.batch_stride, d.x.position_stride, d.indices, d.ds,
      s.batch, s.seq_len, s.kept, s.channels, d.partial);
  LOOM_CUDA_CHECK(cudaGetLastError());
  dw_total_kernel<T>
      <<<total_grid, kThreads, 0, st>>>(d.partial, s.batch, s.channels, static_cast<T*>(d.dweight));
  LOOM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void select(const SelectData& d, int device, void* stream) {
  loom::sdk::CudaDeviceGuard guard(device);
  auto* st = static_cast<cudaStream_t>(stream);
  if (d.shape.dtype == Dtype::kF64) {
    select_typed<double>(d, st);
  } else {
    select_typed<float>(d, st);
  }
}

void backward(const BackwardData& d, int device, void* stream) {
  loom::sdk::CudaDeviceGuard guard(device);
  auto* st = static_cast<cudaStream_t>(stream);
  if (d.shape.dtype == Dtype::kF64) {
    backward_typed<double>(d, st);
  } else {
    backward_typed<float>(d, st);
  }
}

}  // namespace loom::routers::topk::cuda
