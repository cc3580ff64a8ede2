// Fused multi-tensor CUDA kernels: one launch updates up to kMaxTensors tensors, each
// block taking one chunk of one tensor. The arithmetic matches kernels/cpu.cpp; fp16/bf16
// conversions are the shared ones of common/half.hpp. CUDA failures throw (LOOM_CUDA_CHECK:
// the call, file and line).
#include <cuda_runtime.h>
#include <loom/sdk/cuda.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cuda.hpp"

namespace loom::optim::cuda {
namespace {

constexpr int kMaxTensors = 24;
constexpr int kThreads = 256;
constexpr int kChunk = kThreads * 16;  // elements per block

struct Launch {
  float* p[kMaxTensors];
  const void* g[kMaxTensors];
  float* m[kMaxTensors];
  float* v[kMaxTensors];
  void* low[kMaxTensors];
  int64_t n[kMaxTensors];
  int block_start[kMaxTensors + 1];  // first block of each tensor
  uint8_t gtype[kMaxTensors];
  uint8_t ltype[kMaxTensors];
  int index[kMaxTensors];  // the caller's position of each tensor (host side only)
  int count;
};

namespace conv = loom::plugins::half;  // not "half": CUDA's fp16 type

__device__ __forceinline__ float load_g(const void* g, uint8_t type, int64_t i) {
  if (type == 0) return static_cast<const float*>(g)[i];
  const uint16_t h = static_cast<const uint16_t*>(g)[i];
  if (type == 1) return conv::bf16_to_f32(h);
  return conv::f16_to_f32(h);
}

__device__ __forceinline__ void store_low(void* low, uint8_t type, int64_t i, float f) {
  static_cast<uint16_t*>(low)[i] = type == 1 ? conv::f32_to_bf16(f) : conv::f32_to_f16(f);
}

__device__ __forceinline__ int find_tensor(const Launch& L, int block) {
  int t = 0;
  while (t + 1 < L.count && L.block_start[t + 1] <= block) ++t;
  return t;
}

__global__ void adam_kernel(Launch L, AdamHyper h) {
  const int t = find_tensor(L, static_cast<int>(blockIdx.x));
  const int64_t begin = static_cast<int64_t>(blockIdx.x - L.block_start[t]) * kChunk;
  const int64_t end = min(L.n[t], begin + kChunk);
  float* p = L.p[t];
  float* m = L.m[t];
  float* v = L.v[t];
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const float pv = p[i];
    const float g = fmaf(load_g(L.g[t], L.gtype[t], i), h.inv_scale, h.l2 * pv);
    const float mv = fmaf(h.beta1, m[i], h.omb1 * g);
    const float vv = fmaf(h.beta2, v[i], (h.omb2 * g) * g);
    const float denom = fmaf(sqrtf(vv), h.inv_bc2_sqrt, h.eps);
    const float np = fmaf(pv, h.decay, -h.step_size * __fdiv_rn(mv, denom));
    m[i] = mv;
    v[i] = vv;
    p[i] = np;
    if (L.low[t] != nullptr) store_low(L.low[t], L.ltype[t], i, np);
  }
}

// LAMB pass 1. Each thread sums p^2 and u^2 of its elements (begin + t, + kThreads, ...) in
// double with fma, then the block folds the kThreads sums in a fixed shared-memory tree and
// writes its partials to part[2 * block] and part[2 * block + 1]: no atomics, so the result
// does not depend on the order blocks run in.
__global__ void lamb_moments_kernel(Launch L, LambHyper h, double* part) {
  __shared__ double sp[kThreads];
  __shared__ double su[kThreads];
  const int t = find_tensor(L, static_cast<int>(blockIdx.x));
  const int64_t begin = static_cast<int64_t>(blockIdx.x - L.block_start[t]) * kChunk;
  const int64_t end = min(L.n[t], begin + kChunk);
  float* p = L.p[t];
  float* m = L.m[t];
  float* v = L.v[t];
  double ap = 0.0;
  double au = 0.0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const float pv = p[i];
    const float g = load_g(L.g[t], L.gtype[t], i) * h.inv_scale;
    const float mv = fmaf(h.beta1, m[i], h.omb1 * g);
    const float vv = fmaf(h.beta2, v[i], (h.omb2 * g) * g);
    m[i] = mv;
    v[i] = vv;
    const float u =
        fmaf(h.wd, pv, __fdiv_rn(mv * h.inv_bc1, fmaf(sqrtf(vv), h.inv_bc2_sqrt, h.eps)));
    const double pd = static_cast<double>(pv);
    const double ud = static_cast<double>(u);
    ap = fma(pd, pd, ap);
    au = fma(ud, ud, au);
  }
  sp[threadIdx.x] = ap;
  su[threadIdx.x] = au;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (static_cast<int>(threadIdx.x) < s) {
      sp[threadIdx.x] += sp[threadIdx.x + s];
      su[threadIdx.x] += su[threadIdx.x + s];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    part[2 * blockIdx.x] = sp[0];
    part[2 * blockIdx.x + 1] = su[0];
  }
}

// One block per tensor of the launch: thread j adds the tensor's block partials j, j +
// kThreads, ... in block order, then the same fixed tree; norms[2 * t] = sum p^2, norms[2 * t
// + 1] = sum u^2. The order depends only on the tensor's size (its block count), never on
// the launch it shares or the order blocks ran in, so the norms are bit-identical run to run.
__global__ void lamb_norms_kernel(Launch L, const double* part, double* norms) {
  __shared__ double sp[kThreads];
  __shared__ double su[kThreads];
  const int t = static_cast<int>(blockIdx.x);
  double ap = 0.0;
  double au = 0.0;
  for (int b = L.block_start[t] + static_cast<int>(threadIdx.x); b < L.block_start[t + 1];
       b += kThreads) {
    ap += part[2 * static_cast<int64_t>(b)];
    au += part[2 * static_cast<int64_t>(b) + 1];
  }
  sp[threadIdx.x] = ap;
  su[threadIdx.x] = au;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (static_cast<int>(threadIdx.x) < s) {
      sp[threadIdx.x] += sp[threadIdx.x + s];
      su[threadIdx.x] += su[threadIdx.x + s];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    norms[2 * t] = sp[0];
    norms[2 * t + 1] = su[0];
  }
}

__global__ void lamb_apply_kernel(Launch L, LambHyper h, const double* norms, float lr,
                                  float min_coeff, float max_coeff) {
  const int t = find_tensor(L, static_cast<int>(blockIdx.x));
  const int64_t begin = static_cast<int64_t>(blockIdx.x - L.block_start[t]) * kChunk;
  const int64_t end = min(L.n[t], begin + kChunk);
  const double pn = sqrt(norms[2 * t]);
  const double un = sqrt(norms[2 * t + 1]);
  float coeff = 1.0f;
  if (pn > 0.0 && un > 0.0) {
    coeff = static_cast<float>(pn / un);
    coeff = fminf(fmaxf(coeff, min_coeff), max_coeff);
  }
  const float lr_coeff = lr * coeff;
  float* p = L.p[t];
  const float* m = L.m[t];
  const float* v = L.v[t];
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const float pv = p[i];
    const float u =
        fmaf(h.wd, pv, __fdiv_rn(m[i] * h.inv_bc1, fmaf(sqrtf(v[i]), h.inv_bc2_sqrt, h.eps)));
    const float np = fmaf(-lr_coeff, u, pv);
    p[i] = np;
    if (L.low[t] != nullptr) store_low(L.low[t], L.ltype[t], i, np);
  }
}

// A kernel launch's error (bad configuration, no kernel image, ...), naming the kernel.
#define LOOM_CHECK_LAUNCH(kernel) \
  ::loom::sdk::cuda_check(cudaGetLastError(), "launch of " #kernel, __FILE__, __LINE__)

// Device scratch ordered on a stream (loom/sdk/cuda.hpp).
using Scratch = ::loom::sdk::CudaScratch;

// Splits the tensor list into launches of at most kMaxTensors tensors (empty ones left out;
// L.index[k] is the caller's position of tensor k).
template <class Fn>
void for_each_launch(const TensorRef* ts, std::size_t count, Fn&& fn) {
  std::size_t i = 0;
  while (i < count) {
    Launch L{};
    int blocks = 0;
    while (i < count && L.count < kMaxTensors) {
      const TensorRef& t = ts[i++];
      if (t.n == 0) continue;
      const int64_t tb = (static_cast<int64_t>(t.n) + kChunk - 1) / kChunk;
      if (L.count > 0 && blocks + tb > (1LL << 30)) {
        --i;
        break;
      }
      const int k = L.count++;
      L.p[k] = t.p;
      L.g[k] = t.g;
      L.m[k] = t.m;
      L.v[k] = t.v;
      L.low[k] = t.low;
      L.n[k] = static_cast<int64_t>(t.n);
      L.gtype[k] = static_cast<uint8_t>(t.gtype);
      L.ltype[k] = static_cast<uint8_t>(t.ltype);
      L.block_start[k] = blocks;
      L.index[k] = static_cast<int>(i - 1);
      blocks += static_cast<int>(tb);
    }
    L.block_start[L.count] = blocks;
    if (L.count == 0) continue;
    fn(L, blocks);
  }
}

// LAMB pass 1 with its norms: partials per block, then the fixed-order pass per tensor.
// Scratch for the largest launch of the list.
struct LambNorms {
  LambNorms(const TensorRef* ts, std::size_t count, cudaStream_t s)
      : part(sizeof(double) * 2 * static_cast<std::size_t>(max_blocks(ts, count)), s),
        norms(sizeof(double) * 2 * kMaxTensors, s) {}
  static int max_blocks(const TensorRef* ts, std::size_t count) {
    int most = 1;
    for_each_launch(ts, count, [&](const Launch&, int blocks) { most = std::max(most, blocks); });
    return most;
  }
  void run(const Launch& L, int blocks, const LambHyper& h, cudaStream_t s) {
    lamb_moments_kernel<<<blocks, kThreads, 0, s>>>(L, h, part.as<double>());
    LOOM_CHECK_LAUNCH(lamb_moments_kernel);
    lamb_norms_kernel<<<L.count, kThreads, 0, s>>>(L, part.as<double>(), norms.as<double>());
    LOOM_CHECK_LAUNCH(lamb_norms_kernel);
  }
  Scratch part;
  Scratch norms;
};

}  // namespace

bool have_cuda() { return true; }

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

std::string adam(const TensorRef* tensors, std::size_t count, const AdamHyper& h, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  for_each_launch(tensors, count, [&](const Launch& L, int blocks) {
    adam_kernel<<<blocks, kThreads, 0, s>>>(L, h);
    LOOM_CHECK_LAUNCH(adam_kernel);
  });
  return {};
}

std::string lamb(const TensorRef* tensors, std::size_t count, const LambHyper& h, float lr,
                 float min_coeff, float max_coeff, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  LambNorms w(tensors, count, s);
  for_each_launch(tensors, count, [&](const Launch& L, int blocks) {
    w.run(L, blocks, h, s);
    lamb_apply_kernel<<<blocks, kThreads, 0, s>>>(L, h, w.norms.as<double>(), lr, min_coeff,
                                                  max_coeff);
    LOOM_CHECK_LAUNCH(lamb_apply_kernel);
  });
  return {};
}

std::string lamb_norms(const TensorRef* tensors, std::size_t count, const LambHyper& h, double* out,
                       void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  std::fill(out, out + 2 * count, 0.0);
  LambNorms w(tensors, count, s);
  std::vector<double> host(2 * kMaxTensors);
  for_each_launch(tensors, count, [&](const Launch& L, int blocks) {
    w.run(L, blocks, h, s);
    LOOM_CUDA_CHECK(cudaMemcpyAsync(host.data(), w.norms.as<double>(), sizeof(double) * 2 * L.count,
                                    cudaMemcpyDeviceToHost, s));
    LOOM_CUDA_CHECK(cudaStreamSynchronize(s));
    for (int k = 0; k < L.count; ++k) {
      out[2 * L.index[k]] = host[2 * k];
      out[2 * L.index[k] + 1] = host[2 * k + 1];
    }
  });
  return {};
}

std::string alloc(void** out, std::size_t bytes, int device) {
  const loom::sdk::CudaDeviceGuard on(device);
  LOOM_CUDA_CHECK(cudaMalloc(out, bytes));
  return {};
}

void free(void* ptr) {
  if (ptr != nullptr) (void)cudaFree(ptr);
}

std::string memset_zero(void* ptr, std::size_t bytes, void* stream) {
  LOOM_CUDA_CHECK(cudaMemsetAsync(ptr, 0, bytes, static_cast<cudaStream_t>(stream)));
  return {};
}

std::string copy_to_host(void* dst, const void* src, std::size_t bytes, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  LOOM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s));
  LOOM_CUDA_CHECK(cudaStreamSynchronize(s));
  return {};
}

std::string copy_to_device(void* dst, const void* src, std::size_t bytes, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  LOOM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s));
  LOOM_CUDA_CHECK(cudaStreamSynchronize(s));
  return {};
}

}  // namespace loom::optim::cuda
