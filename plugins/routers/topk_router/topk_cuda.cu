// topk_router's CUDA kernels (topk_kernels.hpp), every value from topk_math.hpp in the CPU's
// order, so the results are the CPU's bit for bit:
// - scores: a thread per token, its channel sum in increasing order, into the workspace;
// - top-k: a block per sequence; a radix select over the 64-bit rank keys (eight passes of
//   8 bits: a shared histogram of the keys that match the digits found so far) finds the
//   kept-th smallest key K* and how many keys equal to it are kept (the earliest ones); then
//   each thread takes a contiguous run of positions, the block scans the runs' counts, and
//   every thread writes its kept positions in order. Global memory only for the keys' source,
//   so any seq_len works;
// - backward: dx a thread per (kept token, channel); dweight a thread per (sequence, channel)
//   for the partial sum over the kept tokens, then a thread per channel for the sum over the
//   sequences.
#include <cuda_runtime.h>
#include <loom/sdk/cuda.hpp>

#include <algorithm>
#include <cstdint>

#include "topk_kernels.hpp"

namespace loom::routers::topk::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kSelectThreads = 256;

int blocks_for(int64_t n) {
  return static_cast<int>(std::max<int64_t>(1, (n + kThreads - 1) / kThreads));
}

template <class T>
__global__ void score_kernel(const T* x, int64_t batch_stride, int64_t position_stride, const T* w,
                             int64_t batch, int64_t seq_len, int64_t channels, double* scores) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= batch * seq_len) return;
  const int64_t b = t / seq_len;
  const int64_t p = t % seq_len;
  const T* row = x + b * batch_stride + p * position_stride;
  double acc = 0.0;
  for (int64_t c = 0; c < channels; ++c) {
    acc = add(acc, mul(to_double(row[c]), to_double(w[c])));
  }
  scores[t] = acc;
}

template <class T>
__global__ void topk_kernel(const double* scores, int64_t seq_len, int64_t kept, int gate,
                            int32_t* indices, T* gates, double* saved) {
  __shared__ unsigned hist[256];
  __shared__ unsigned long long s_prefix;
  __shared__ unsigned long long s_need;
  __shared__ unsigned long long s_lt[kSelectThreads];
  __shared__ unsigned long long s_eq[kSelectThreads];
  const int64_t b = blockIdx.x;
  const int tid = static_cast<int>(threadIdx.x);
  const double* sc = scores + b * seq_len;
  if (tid == 0) {
    s_prefix = 0;
    s_need = static_cast<unsigned long long>(kept);
  }
  // Radix select: after the pass at `shift`, s_prefix holds the top digits of K* and s_need
  // the rank of K* among the keys that share them.
  unsigned long long mask = 0;
  for (int shift = 56; shift >= 0; shift -= 8) {
    for (int i = tid; i < 256; i += kSelectThreads) hist[i] = 0;
    __syncthreads();
    const unsigned long long prefix = s_prefix;
    for (int64_t p = tid; p < seq_len; p += kSelectThreads) {
      const unsigned long long k = rank_key(sc[p]);
      if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 255u], 1u);  // lint: integer atomic
    }
    __syncthreads();
    if (tid == 0) {
      unsigned long long below = 0;
      for (unsigned d = 0; d < 256; ++d) {
        if (below + hist[d] >= s_need) {
          s_prefix = prefix | (static_cast<unsigned long long>(d) << shift);
          s_need -= below;
          break;
        }
        below += hist[d];
      }
    }
    mask |= 255ull << shift;
    __syncthreads();
  }
  const unsigned long long kstar = s_prefix;
  const unsigned long long need = s_need;  // keys equal to K* that are kept (1 ..)
  // Contiguous runs: count keys below K* and equal to it.
  const int64_t run = (seq_len + kSelectThreads - 1) / kSelectThreads;
  const int64_t lo = tid * run < seq_len ? tid * run : seq_len;
  const int64_t hi = lo + run < seq_len ? lo + run : seq_len;
  unsigned long long lt = 0;
  unsigned long long eq = 0;
  for (int64_t p = lo; p < hi; ++p) {
    const unsigned long long k = rank_key(sc[p]);
    lt += k < kstar ? 1 : 0;
    eq += k == kstar ? 1 : 0;
  }
  s_lt[tid] = lt;
  s_eq[tid] = eq;
  __syncthreads();
  if (tid == 0) {  // exclusive scans
    unsigned long long a = 0;
    unsigned long long e = 0;
    for (int i = 0; i < kSelectThreads; ++i) {
      const unsigned long long li = s_lt[i];
      const unsigned long long ei = s_eq[i];
      s_lt[i] = a;
      s_eq[i] = e;
      a += li;
      e += ei;
    }
  }
  __syncthreads();
  unsigned long long eq_seen = s_eq[tid];
  unsigned long long out = s_lt[tid] + (eq_seen < need ? eq_seen : need);
  int32_t* idx = indices + b * kept;
  T* g = gates + b * kept;
  double* sv = saved + b * kept;
  for (int64_t p = lo; p < hi; ++p) {
    const double score = sc[p];
    const unsigned long long k = rank_key(score);
    bool take = k < kstar;
    if (k == kstar) {
      take = eq_seen < need;
      ++eq_seen;
    }
    if (take) {
      idx[out] = static_cast<int32_t>(p);
      sv[out] = score;
      g[out] = static_cast<T>(gate_of(score, static_cast<Gate>(gate)));
      ++out;
    }
  }
}

// Device indices are not read back (that would synchronise): a kept position outside
// [0, seq_len) is skipped, never written out of bounds (the host path refuses such rows).
template <class T>
__global__ void dx_kernel(const T* w, const int32_t* indices, const T* dgates, const double* saved,
                          int64_t batch, int64_t seq_len, int64_t kept, int64_t channels, int gate,
                          T* dx, int64_t batch_stride, int64_t position_stride) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= batch * kept * channels) return;
  const int64_t c = t % channels;
  const int64_t k = t / channels;  // b * kept + j
  const int64_t b = k / kept;
  if (indices[k] < 0 || indices[k] >= seq_len) return;
  const double ds = score_grad(to_double(dgates[k]), saved[k], static_cast<Gate>(gate));
  T* v = dx + b * batch_stride + int64_t{indices[k]} * position_stride + c;
  *v = static_cast<T>(add(to_double(*v), mul(ds, to_double(w[c]))));
}

template <class T>
__global__ void dw_partial_kernel(const T* x, int64_t batch_stride, int64_t position_stride,
                                  const int32_t* indices, const T* dgates, const double* saved,
                                  int64_t batch, int64_t seq_len, int64_t kept, int64_t channels,
                                  int gate, double* partial) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= batch * channels) return;
  const int64_t b = t / channels;
  const int64_t c = t % channels;
  double part = 0.0;
  for (int64_t j = 0; j < kept; ++j) {
    const int64_t k = b * kept + j;
    if (indices[k] < 0 || indices[k] >= seq_len) continue;
    const double ds = score_grad(to_double(dgates[k]), saved[k], static_cast<Gate>(gate));
    part = add(part,
               mul(ds, to_double(x[b * batch_stride + int64_t{indices[k]} * position_stride + c])));
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
  score_kernel<T><<<blocks_for(s.batch * s.seq_len), kThreads, 0, st>>>(
      static_cast<const T*>(d.x.data), d.x.batch_stride, d.x.position_stride,
      static_cast<const T*>(d.weight), s.batch, s.seq_len, s.channels, d.scores);
  LOOM_CUDA_CHECK(cudaGetLastError());
  topk_kernel<T><<<static_cast<unsigned>(s.batch), kSelectThreads, 0, st>>>(
      d.scores, s.seq_len, s.kept, static_cast<int>(s.gate), d.indices, static_cast<T*>(d.gates),
      d.saved);
  LOOM_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void backward_typed(const BackwardData& d, cudaStream_t st) {
  const Shape& s = d.shape;
  const int gate = static_cast<int>(s.gate);
  dx_kernel<T><<<blocks_for(s.batch * s.kept * s.channels), kThreads, 0, st>>>(
      static_cast<const T*>(d.weight), d.indices, static_cast<const T*>(d.dgates), d.saved, s.batch,
      s.seq_len, s.kept, s.channels, gate, static_cast<T*>(d.dx), d.dx_batch_stride,
      d.dx_position_stride);
  LOOM_CUDA_CHECK(cudaGetLastError());
  dw_partial_kernel<T><<<blocks_for(s.batch * s.channels), kThreads, 0, st>>>(
      static_cast<const T*>(d.x.data), d.x.batch_stride, d.x.position_stride, d.indices,
      static_cast<const T*>(d.dgates), d.saved, s.batch, s.seq_len, s.kept, s.channels, gate,
      d.partial);
  LOOM_CUDA_CHECK(cudaGetLastError());
  dw_total_kernel<T><<<blocks_for(s.channels), kThreads, 0, st>>>(d.partial, s.batch, s.channels,
                                                                  static_cast<T*>(d.dweight));
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
