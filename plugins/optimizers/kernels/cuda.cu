// Fused multi-tensor CUDA kernels: one launch updates up to kMaxTensors tensors, each
// block taking one chunk of one tensor. The arithmetic matches kernels/cpu.cpp.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

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
  int count;
};

__device__ __forceinline__ float load_g(const void* g, uint8_t type, int64_t i) {
  if (type == 0) return static_cast<const float*>(g)[i];
  const uint16_t h = static_cast<const uint16_t*>(g)[i];
  if (type == 1) return __uint_as_float(static_cast<uint32_t>(h) << 16);
  return __half2float(__ushort_as_half(h));
}

__device__ __forceinline__ uint16_t to_bf16(float f) {
  const uint32_t x = __float_as_uint(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ void store_low(void* low, uint8_t type, int64_t i, float f) {
  if (type == 1) {
    static_cast<uint16_t*>(low)[i] = to_bf16(f);
  } else {
    static_cast<uint16_t*>(low)[i] = __half_as_ushort(__float2half_rn(f));
  }
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

__global__ void lamb_moments_kernel(Launch L, LambHyper h, double* norms) {
  __shared__ double sp[kThreads];
  __shared__ double su[kThreads];
  const int t = find_tensor(L, static_cast<int>(blockIdx.x));
  const int64_t begin = static_cast<int64_t>(blockIdx.x - L.block_start[t]) * kChunk;
  const int64_t end = min(L.n[t], begin + kChunk);
  float* p = L.p[t];
  float* m = L.m[t];
  float* v = L.v[t];
  float ap = 0.0f;
  float au = 0.0f;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const float pv = p[i];
    const float g = load_g(L.g[t], L.gtype[t], i) * h.inv_scale;
    const float mv = fmaf(h.beta1, m[i], h.omb1 * g);
    const float vv = fmaf(h.beta2, v[i], (h.omb2 * g) * g);
    m[i] = mv;
    v[i] = vv;
    const float u =
        fmaf(h.wd, pv, __fdiv_rn(mv * h.inv_bc1, fmaf(sqrtf(vv), h.inv_bc2_sqrt, h.eps)));
    ap = fmaf(pv, pv, ap);
    au = fmaf(u, u, au);
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
    atomicAdd(&norms[2 * t], sp[0]);
    atomicAdd(&norms[2 * t + 1], su[0]);
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

std::string err(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return {};
  return std::string(what) + ": " + cudaGetErrorString(e);
}

// Splits the tensor list into launches of at most kMaxTensors tensors.
template <class Fn>
std::string for_each_launch(const TensorRef* ts, std::size_t count, Fn&& fn) {
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
      blocks += static_cast<int>(tb);
    }
    L.block_start[L.count] = blocks;
    if (L.count == 0) continue;
    std::string e = fn(L, blocks);
    if (!e.empty()) return e;
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

std::string adam(const TensorRef* tensors, std::size_t count, const AdamHyper& h, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  return for_each_launch(tensors, count, [&](const Launch& L, int blocks) {
    adam_kernel<<<blocks, kThreads, 0, s>>>(L, h);
    return err(cudaGetLastError(), "adam kernel launch");
  });
}

std::string lamb(const TensorRef* tensors, std::size_t count, const LambHyper& h, float lr,
                 float min_coeff, float max_coeff, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  double* norms = nullptr;
  std::string e =
      err(cudaMallocAsync(reinterpret_cast<void**>(&norms), sizeof(double) * 2 * kMaxTensors, s),
          "lamb workspace");
  if (!e.empty()) return e;
  e = for_each_launch(tensors, count, [&](const Launch& L, int blocks) {
    std::string r =
        err(cudaMemsetAsync(norms, 0, sizeof(double) * 2 * kMaxTensors, s), "lamb workspace");
    if (!r.empty()) return r;
    lamb_moments_kernel<<<blocks, kThreads, 0, s>>>(L, h, norms);
    r = err(cudaGetLastError(), "lamb kernel launch");
    if (!r.empty()) return r;
    lamb_apply_kernel<<<blocks, kThreads, 0, s>>>(L, h, norms, lr, min_coeff, max_coeff);
    return err(cudaGetLastError(), "lamb kernel launch");
  });
  const std::string f = err(cudaFreeAsync(norms, s), "lamb workspace");
  return e.empty() ? f : e;
}

std::string alloc(void** out, std::size_t bytes, int device) {
  int prev = 0;
  cudaGetDevice(&prev);
  std::string e = err(cudaSetDevice(device), "cudaSetDevice");
  if (!e.empty()) return e;
  e = err(cudaMalloc(out, bytes), "cudaMalloc");
  cudaSetDevice(prev);
  return e;
}

void free(void* ptr) {
  if (ptr != nullptr) cudaFree(ptr);
}

std::string memset_zero(void* ptr, std::size_t bytes, void* stream) {
  return err(cudaMemsetAsync(ptr, 0, bytes, static_cast<cudaStream_t>(stream)), "cudaMemset");
}

std::string copy_to_host(void* dst, const void* src, std::size_t bytes, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  std::string e = err(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s), "cudaMemcpy");
  if (!e.empty()) return e;
  return err(cudaStreamSynchronize(s), "cudaStreamSynchronize");
}

std::string copy_to_device(void* dst, const void* src, std::size_t bytes, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  std::string e = err(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s), "cudaMemcpy");
  if (!e.empty()) return e;
  return err(cudaStreamSynchronize(s), "cudaStreamSynchronize");
}

}  // namespace loom::optim::cuda
