// CUDA kernels of the 1-bit optimizer family; see kernels/onebit_cuda.hpp for the contract.
// Every float operation goes through an explicit round-to-nearest intrinsic, so nvcc
// cannot contract a multiply and an add into an FMA (or use approximate division or
// sqrt, whatever the flags): the elements match onebit.cpp's scalar loops bit for bit.
// fp16/bf16 conversions are the shared ones of common/half.hpp. CUDA failures throw
// (LOOM_CUDA_CHECK: the call, file and line).
#include <cuda_runtime.h>
#include <loom/sdk/cuda.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/onebit_cuda.hpp"

namespace loom::optim::cuda::onebit {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxSeg = static_cast<int>(kMaxSegments);
constexpr int64_t kBlockChunk = static_cast<int64_t>(kChunk);
static_assert(kBlockChunk % kThreads == 0, "a block's chunk is a whole number of strides");
constexpr int64_t kMaxBlocks = int64_t{1} << 30;  // per launch (gridDim.x < 2^31)
constexpr int64_t kFlatMaxBlocks = int64_t{1} << 16;

// One multi-tensor launch: segment k owns blocks [first[k], first[k + 1]).
struct Batch {
  Segment seg[kMaxSeg];
  int64_t first[kMaxSeg + 1];
  int index[kMaxSeg];  // position of seg[k] in the caller's list
  int count;
};
static_assert(sizeof(Batch) + 128 <= 4096, "kernel parameters must fit in 4 KiB");

// ---------------------------------------------------------------- arithmetic
__device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float dvd(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ float root(float a) { return __fsqrt_rn(a); }
// sqrt(v) * inv_bc2 + eps
__device__ __forceinline__ float denom_of(float v, float inv_bc2, float eps) {
  return add(mul(root(v), inv_bc2), eps);
}

namespace conv = loom::plugins::half;  // not "half": CUDA's fp16 type

__device__ __forceinline__ float load_g(const void* g, DType type, int64_t i) {
  if (type == DType::kF32) return static_cast<const float*>(g)[i];
  const uint16_t h = static_cast<const uint16_t*>(g)[i];
  return type == DType::kBF16 ? conv::bf16_to_f32(h) : conv::f16_to_f32(h);
}

__device__ __forceinline__ void store_low(const Segment& s, int64_t i, float f) {
  if (s.low == nullptr) return;
  static_cast<uint16_t*>(s.low)[i] =
      s.ltype == DType::kBF16 ? conv::f32_to_bf16(f) : conv::f32_to_f16(f);
}

// ---------------------------------------------------------------- segment walk
__device__ __forceinline__ int find_seg(const Batch& b, int64_t block) {
  int lo = 0;
  int hi = b.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (b.first[mid] <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Calls fn(seg, i, f) for this thread's elements of this block: i the tensor index, f the
// flat index; thread t takes begin + t, begin + t + 256, ... (the reduction order).
template <class Fn>
__device__ __forceinline__ void for_block(const Batch& b, Fn&& fn) {
  const int k = find_seg(b, static_cast<int64_t>(blockIdx.x));
  const Segment& s = b.seg[k];
  const int64_t begin = (static_cast<int64_t>(blockIdx.x) - b.first[k]) * kBlockChunk;
  const int64_t end = min(static_cast<int64_t>(s.n), begin + kBlockChunk);
  const int64_t off = static_cast<int64_t>(s.offset);
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) fn(s, i, off + i);
}

// ---------------------------------------------------------------- reductions
// Component c of a partial is combined by max when c == kMax, else by sum.
template <int K, int kMax>
__device__ __forceinline__ double combine(int c, double a, double b) {
  if (c == kMax) return a < b ? b : a;  // std::max(a, b): a NaN b never enters
  return a + b;
}

// Fixed shared-memory tree over the block's threads; thread 0 writes out[0..K).
template <int K, int kMax>
__device__ void block_reduce(double (&acc)[K], double* out) {
  __shared__ double sh[K][kThreads];
  for (int c = 0; c < K; ++c) sh[c][threadIdx.x] = acc[c];
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (static_cast<int>(threadIdx.x) < s) {
      for (int c = 0; c < K; ++c) {
        sh[c][threadIdx.x] = combine<K, kMax>(c, sh[c][threadIdx.x], sh[c][threadIdx.x + s]);
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    for (int c = 0; c < K; ++c) out[c] = sh[c][0];
  }
}

// One block per segment: its per-block partials, in block order per thread, then the tree.
template <int K, int kMax>
__global__ void finalize_kernel(Batch b, const double* part, double* result) {
  const int k = static_cast<int>(blockIdx.x);
  double acc[K];
  for (int c = 0; c < K; ++c) acc[c] = 0.0;
  for (int64_t j = b.first[k] + threadIdx.x; j < b.first[k + 1]; j += kThreads) {
    for (int c = 0; c < K; ++c) acc[c] = combine<K, kMax>(c, acc[c], part[j * K + c]);
  }
  block_reduce<K, kMax>(acc, result + static_cast<int64_t>(b.index[k]) * K);
}

// ---------------------------------------------------------------- element kernels
__global__ void load_grad_kernel(Batch b, float* flat, float inv_scale) {
  for_block(b, [&](const Segment& s, int64_t i, int64_t f) {
    flat[f] = mul(load_g(s.g, s.gtype, i), inv_scale);
  });
}

__global__ void momentum_kernel(float* m, const float* g, int64_t n, Decay b1) {
  const float omb1 = b1.rest;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    m[i] = add(mul(b1.beta, m[i]), mul(omb1, g[i]));
  }
}

__global__ void mask_kernel(Batch b, float* buf) {
  for_block(b, [&](const Segment& s, int64_t i, int64_t f) { buf[f] = mul(buf[f], s.mask[i]); });
}

__global__ void momentum_segments_kernel(Batch b, float* m, const float* g, float* m_prev,
                                         Decay b1) {
  const float omb1 = b1.rest;
  for_block(b, [&](const Segment& s, int64_t, int64_t f) {
    const float mv = m[f];
    if (m_prev != nullptr) m_prev[f] = mv;
    m[f] = mul(add(mul(b1.beta, mv), mul(omb1, g[f])), s.scale);
  });
}

__global__ void apply_adam_kernel(Batch b, float* m, const float* v, float inv_bc2, float eps) {
  for_block(b, [&](const Segment& s, int64_t i, int64_t f) {
    float mv = m[f];
    if (s.mask != nullptr) {
      mv = mul(mv, s.mask[i]);
      m[f] = mv;
    }
    const float np = sub(mul(s.p[i], s.decay), mul(s.step, dvd(mv, denom_of(v[f], inv_bc2, eps))));
    s.p[i] = np;
    store_low(s, i, np);
  });
}

__global__ void zero_one_local_kernel(Batch b, const float* m, const float* v, float* u,
                                      float inv_bc1, float inv_bc2, float eps) {
  for_block(b, [&](const Segment& s, int64_t i, int64_t f) {
    const float pv = s.p[i];
    const float d = add(dvd(mul(m[f], inv_bc1), denom_of(v[f], inv_bc2, eps)), mul(s.wd, pv));
    const float step = mul(s.lr, d);
    const float np = sub(pv, step);
    s.p[i] = np;
    u[f] = sub(u[f], step);
    store_low(s, i, np);
  });
}

__global__ void sync_pre_kernel(Batch b, const float* v, float* u, float inv_bc2, float eps) {
  for_block(b, [&](const Segment& s, int64_t i, int64_t f) {
    const float uv = u[f];
    s.p[i] = sub(s.p[i], uv);
    u[f] = mul(uv, denom_of(v[f], inv_bc2, eps));
  });
}

__global__ void sync_post_kernel(Batch b, float* m, const float* v, float* u, float scale,
                                 float inv_bc2, float eps) {
  for_block(b, [&](const Segment& s, int64_t i, int64_t f) {
    float uv = u[f];
    if (s.mask != nullptr) uv = mul(uv, s.mask[i]);
    m[f] = mul(uv, scale);
    const float np = add(s.p[i], dvd(uv, denom_of(v[f], inv_bc2, eps)));
    s.p[i] = np;
    u[f] = 0.0f;
    store_low(s, i, np);
  });
}

__global__ void copy_out_kernel(Batch b) {
  for_block(b, [&](const Segment& s, int64_t i, int64_t) { store_low(s, i, s.p[i]); });
}

__global__ void add_update_kernel(Batch b, const float* flat) {
  for_block(b, [&](const Segment& s, int64_t i, int64_t f) {
    const float np = add(s.p[i], flat[f]);
    s.p[i] = np;
    store_low(s, i, np);
  });
}

__global__ void lamb_apply_kernel(Batch b, const float* m, const float* v, float inv_bc1,
                                  float inv_bc2, float eps) {
  for_block(b, [&](const Segment& s, int64_t i, int64_t f) {
    const float pv = s.p[i];
    const float u = add(dvd(mul(m[f], inv_bc1), denom_of(v[f], inv_bc2, eps)), mul(s.wd, pv));
    const float np = sub(pv, mul(s.step, u));
    s.p[i] = np;
    store_low(s, i, np);
  });
}

// ---------------------------------------------------------------- reduction kernels
// part[block * K + c]: the block's partial of component c.
__global__ void sum_squares_kernel(Batch b, const float* m, double* part) {
  double acc[1] = {0.0};
  for_block(b, [&](const Segment&, int64_t, int64_t f) {
    const double x = static_cast<double>(m[f]);
    acc[0] = __dadd_rn(acc[0], __dmul_rn(x, x));
  });
  block_reduce<1, -1>(acc, part + static_cast<int64_t>(blockIdx.x));
}

__global__ void warmup_moments_kernel(Batch b, const float* g, float* m, float* v, Decay b1,
                                      Decay b2, float inv_bc1, float inv_bc2, float eps,
                                      double* part) {
  const float omb1 = b1.rest;
  const float omb2 = b2.rest;
  double acc[2] = {0.0, 0.0};
  for_block(b, [&](const Segment& s, int64_t i, int64_t f) {
    const float gv = g[f];
    const float mv = add(mul(b1.beta, m[f]), mul(omb1, gv));
    const float vv = add(mul(b2.beta, v[f]), mul(mul(omb2, gv), gv));
    m[f] = mv;
    v[f] = vv;
    const float pv = s.p[i];
    const float u = add(mul(s.wd, pv), dvd(mul(mv, inv_bc1), denom_of(vv, inv_bc2, eps)));
    const double pd = static_cast<double>(pv);
    const double ud = static_cast<double>(u);
    acc[0] = __dadd_rn(acc[0], __dmul_rn(pd, pd));
    acc[1] = __dadd_rn(acc[1], __dmul_rn(ud, ud));
  });
  block_reduce<2, -1>(acc, part + static_cast<int64_t>(blockIdx.x) * 2);
}

__global__ void lamb_post_kernel(Batch b, float* m, const float* mp, const float* v, float* vf,
                                 Decay b1, Decay b2, float inv_bc1, float inv_bc2,
                                 float inv_bc2_fresh, float eps, double* part) {
  const float omb1 = b1.rest;
  const float omb2 = b2.rest;
  double acc[3] = {0.0, 0.0, 0.0};
  float factor = 0.0f;
  for_block(b, [&](const Segment& s, int64_t i, int64_t f) {
    float mv = mul(m[f], s.scale);
    if (s.mask != nullptr) mv = mul(mv, s.mask[i]);
    m[f] = mv;
    const float gh = dvd(sub(mv, mul(b1.beta, mp[f])), omb1);
    const float vfv = add(mul(b2.beta, vf[f]), mul(mul(omb2, gh), gh));
    vf[f] = vfv;
    const float denom = denom_of(v[f], inv_bc2, eps);
    const float pre = dvd(mul(mv, inv_bc1), denom);
    const float u = add(pre, mul(s.wd, s.p[i]));
    const double pd = static_cast<double>(pre);
    const double ud = static_cast<double>(u);
    acc[0] = __dadd_rn(acc[0], __dmul_rn(pd, pd));
    acc[1] = __dadd_rn(acc[1], __dmul_rn(ud, ud));
    const float q = dvd(denom, denom_of(vfv, inv_bc2_fresh, eps));
    factor = factor < q ? q : factor;  // std::max(factor, q)
  });
  acc[2] = static_cast<double>(factor);
  block_reduce<3, 2>(acc, part + static_cast<int64_t>(blockIdx.x) * 3);
}

// ---------------------------------------------------------------- host side
// A kernel launch's error (bad configuration, no kernel image, ...), naming the operation.
#define LOOM_CHECK_LAUNCH(what)                                                             \
  ::loom::sdk::cuda_check(cudaGetLastError(), (std::string("launch of ") + (what)).c_str(), \
                          __FILE__, __LINE__)

// Device scratch ordered on a stream (loom/sdk/cuda.hpp).
using Scratch = ::loom::sdk::CudaScratch;

// Splits the segment list into launches; fn(batch, blocks) launches one. Empty segments
// are left out (their reduction results stay 0). Returns the argument error, if any.
template <class Fn>
std::string for_each_batch(const Segment* segs, std::size_t count, Fn&& fn) {
  std::size_t i = 0;
  while (i < count) {
    Batch b{};
    int64_t blocks = 0;
    while (i < count && b.count < kMaxSeg) {
      const Segment& s = segs[i];
      if (s.n == 0) {
        ++i;
        continue;
      }
      const int64_t nb = (static_cast<int64_t>(s.n) + kBlockChunk - 1) / kBlockChunk;
      if (nb > kMaxBlocks)
        return "onebit kernels: tensor of " + std::to_string(s.n) + " elements is too large";
      if (blocks + nb > kMaxBlocks) break;
      b.seg[b.count] = s;
      b.index[b.count] = static_cast<int>(i);
      b.first[b.count] = blocks;
      ++b.count;
      blocks += nb;
      ++i;
    }
    b.first[b.count] = blocks;
    if (b.count == 0) continue;
    fn(b, static_cast<unsigned>(blocks));
  }
  return {};
}

template <class Kernel>
std::string launch_each(const Segment* segs, std::size_t count, void* stream, const char* what,
                        Kernel&& kernel) {
  auto s = static_cast<cudaStream_t>(stream);
  return for_each_batch(segs, count, [&](const Batch& b, unsigned blocks) {
    kernel(b, blocks, s);
    LOOM_CHECK_LAUNCH(what);
  });
}

// Runs the reduction kernel (launch(batch, blocks, stream, part)) over every batch, then
// the per-segment finalize; copies count * K doubles into host_out and synchronizes.
template <int K, int kMax, class Launch>
std::string reduce_each(const Segment* segs, std::size_t count, void* stream, const char* what,
                        double* host_out, Launch&& launch) {
  std::fill(host_out, host_out + count * K, 0.0);
  if (count == 0) return {};
  auto s = static_cast<cudaStream_t>(stream);
  int64_t max_blocks = 1;
  std::string e = for_each_batch(segs, count, [&](const Batch&, unsigned blocks) {
    max_blocks = std::max<int64_t>(max_blocks, blocks);
  });
  if (!e.empty()) return e;
  {
    Scratch part(sizeof(double) * K * static_cast<std::size_t>(max_blocks), s);
    Scratch result(sizeof(double) * K * count, s);
    LOOM_CUDA_CHECK(cudaMemsetAsync(result.as<double>(), 0, sizeof(double) * K * count, s));
    e = for_each_batch(segs, count, [&](const Batch& b, unsigned blocks) {
      launch(b, blocks, s, part.as<double>());
      LOOM_CHECK_LAUNCH(what);
      finalize_kernel<K, kMax><<<static_cast<unsigned>(b.count), kThreads, 0, s>>>(
          b, part.as<double>(), result.as<double>());
      LOOM_CHECK_LAUNCH(std::string(what) + " (finalize)");
    });
    if (!e.empty()) return e;
    LOOM_CUDA_CHECK(cudaMemcpyAsync(host_out, result.as<double>(), sizeof(double) * K * count,
                                    cudaMemcpyDeviceToHost, s));
  }
  LOOM_CUDA_CHECK(cudaStreamSynchronize(s));
  return {};
}

unsigned flat_blocks(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, kFlatMaxBlocks));
}

}  // namespace

std::string load_grad(const Segment* segs, std::size_t count, float* flat, float inv_scale,
                      void* stream) {
  return launch_each(segs, count, stream, "onebit load_grad",
                     [&](const Batch& b, unsigned blocks, cudaStream_t s) {
                       load_grad_kernel<<<blocks, kThreads, 0, s>>>(b, flat, inv_scale);
                     });
}

std::string momentum(float* m, const float* g, std::size_t n, Decay b1, void* stream) {
  if (n == 0) return {};
  const auto nn = static_cast<int64_t>(n);
  momentum_kernel<<<flat_blocks(nn), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(m, g, nn,
                                                                                       b1);
  LOOM_CHECK_LAUNCH("onebit momentum");
  return {};
}

std::string momentum_segments(const Segment* segs, std::size_t count, float* m, const float* g,
                              float* m_prev, Decay b1, void* stream) {
  return launch_each(segs, count, stream, "onebit momentum_segments",
                     [&](const Batch& b, unsigned blocks, cudaStream_t s) {
                       momentum_segments_kernel<<<blocks, kThreads, 0, s>>>(b, m, g, m_prev, b1);
                     });
}

std::string mask_multiply(const Segment* segs, std::size_t count, float* buf, void* stream) {
  std::vector<Segment> masked;
  for (std::size_t i = 0; i < count; ++i) {
    if (segs[i].mask != nullptr) masked.push_back(segs[i]);
  }
  return launch_each(masked.data(), masked.size(), stream, "onebit mask_multiply",
                     [&](const Batch& b, unsigned blocks, cudaStream_t s) {
                       mask_kernel<<<blocks, kThreads, 0, s>>>(b, buf);
                     });
}

std::string apply_adam(const Segment* segs, std::size_t count, float* m, const float* v,
                       float inv_bc2, float eps, void* stream) {
  return launch_each(segs, count, stream, "onebit apply_adam",
                     [&](const Batch& b, unsigned blocks, cudaStream_t s) {
                       apply_adam_kernel<<<blocks, kThreads, 0, s>>>(b, m, v, inv_bc2, eps);
                     });
}

std::string zero_one_local(const Segment* segs, std::size_t count, const float* m, const float* v,
                           float* u, float inv_bc1, float inv_bc2, float eps, void* stream) {
  return launch_each(segs, count, stream, "onebit zero_one_local",
                     [&](const Batch& b, unsigned blocks, cudaStream_t s) {
                       zero_one_local_kernel<<<blocks, kThreads, 0, s>>>(b, m, v, u, inv_bc1,
                                                                         inv_bc2, eps);
                     });
}

std::string zero_one_sync_pre(const Segment* segs, std::size_t count, const float* v, float* u,
                              float inv_bc2, float eps, void* stream) {
  return launch_each(segs, count, stream, "onebit zero_one_sync_pre",
                     [&](const Batch& b, unsigned blocks, cudaStream_t s) {
                       sync_pre_kernel<<<blocks, kThreads, 0, s>>>(b, v, u, inv_bc2, eps);
                     });
}

std::string zero_one_sync_post(const Segment* segs, std::size_t count, float* m, const float* v,
                               float* u, float scale, float inv_bc2, float eps, void* stream) {
  return launch_each(segs, count, stream, "onebit zero_one_sync_post",
                     [&](const Batch& b, unsigned blocks, cudaStream_t s) {
                       sync_post_kernel<<<blocks, kThreads, 0, s>>>(b, m, v, u, scale, inv_bc2,
                                                                    eps);
                     });
}

std::string copy_out(const Segment* segs, std::size_t count, void* stream) {
  std::vector<Segment> with_low;
  for (std::size_t i = 0; i < count; ++i) {
    if (segs[i].low != nullptr) with_low.push_back(segs[i]);
  }
  return launch_each(with_low.data(), with_low.size(), stream, "onebit copy_out",
                     [&](const Batch& b, unsigned blocks, cudaStream_t s) {
                       copy_out_kernel<<<blocks, kThreads, 0, s>>>(b);
                     });
}

std::string add_update(const Segment* segs, std::size_t count, const float* flat, void* stream) {
  return launch_each(segs, count, stream, "onebit add_update",
                     [&](const Batch& b, unsigned blocks, cudaStream_t s) {
                       add_update_kernel<<<blocks, kThreads, 0, s>>>(b, flat);
                     });
}

std::string lamb_warmup_moments(const Segment* segs, std::size_t count, const float* g, float* m,
                                float* v, Decay b1, Decay b2, float inv_bc1, float inv_bc2,
                                float eps, double* out, void* stream) {
  return reduce_each<2, -1>(segs, count, stream, "onebit lamb_warmup_moments", out,
                            [&](const Batch& b, unsigned blocks, cudaStream_t s, double* part) {
                              warmup_moments_kernel<<<blocks, kThreads, 0, s>>>(
                                  b, g, m, v, b1, b2, inv_bc1, inv_bc2, eps, part);
                            });
}

std::string sum_squares(const Segment* segs, std::size_t count, const float* m, double* out,
                        void* stream) {
  return reduce_each<1, -1>(segs, count, stream, "onebit sum_squares", out,
                            [&](const Batch& b, unsigned blocks, cudaStream_t s, double* part) {
                              sum_squares_kernel<<<blocks, kThreads, 0, s>>>(b, m, part);
                            });
}

std::string lamb_post(const Segment* segs, std::size_t count, float* m, const float* mp,
                      const float* v, float* vf, Decay b1, Decay b2, float inv_bc1, float inv_bc2,
                      float inv_bc2_fresh, float eps, LambPostStats* out, void* stream) {
  std::vector<double> r(3 * count);
  std::string e =
      reduce_each<3, 2>(segs, count, stream, "onebit lamb_post", r.data(),
                        [&](const Batch& b, unsigned blocks, cudaStream_t s, double* part) {
                          lamb_post_kernel<<<blocks, kThreads, 0, s>>>(
                              b, m, mp, v, vf, b1, b2, inv_bc1, inv_bc2, inv_bc2_fresh, eps, part);
                        });
  for (std::size_t k = 0; k < count; ++k) {
    out[k].pre2 = r[3 * k];
    out[k].u2 = r[3 * k + 1];
    out[k].factor = static_cast<float>(r[3 * k + 2]);  // exact: it was a float
  }
  return e;
}

std::string lamb_apply(const Segment* segs, std::size_t count, const float* m, const float* v,
                       float inv_bc1, float inv_bc2, float eps, void* stream) {
  return launch_each(segs, count, stream, "onebit lamb_apply",
                     [&](const Batch& b, unsigned blocks, cudaStream_t s) {
                       lamb_apply_kernel<<<blocks, kThreads, 0, s>>>(b, m, v, inv_bc1, inv_bc2,
                                                                     eps);
                     });
}

std::string copy_device(void* dst, const void* src, std::size_t bytes, void* stream) {
  if (bytes == 0) return {};
  LOOM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice,
                                  static_cast<cudaStream_t>(stream)));
  return {};
}

}  // namespace loom::optim::cuda::onebit
