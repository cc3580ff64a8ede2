// CUDA kernels of the onebit codec; see codec_kernels.hpp for the definitions these follow
// operation by operation (explicit _rn intrinsics: no contraction into FMA), and
// onebit_cuda.h for how faults found on the device reach the host.
#include <cuda_runtime.h>
#include <loom/sdk/cuda.hpp>

#include <cstdint>
#include <string>

#include "onebit_cuda.h"

namespace loom::codecs::cuda {
namespace {

constexpr std::size_t kBlock = 2048;  // kNormBlock
constexpr int kLanes = 16;            // kNormLanes
constexpr std::size_t kSuper = 256;   // kNormSuper

// A kernel launch's error (bad configuration, no kernel image, ...), naming the kernel.
#define LOOM_CHECK_LAUNCH(kernel) \
  ::loom::sdk::cuda_check(cudaGetLastError(), "launch of " #kernel, __FILE__, __LINE__)

// The fault word (onebit_cuda.h): the first fault recorded, and its details.
struct FaultWord {
  int32_t fault;
  uint32_t chunk;
  float value;
  int32_t reserved;
};

__device__ bool faulted(const FaultWord* w) { return w->fault != 0; }

// Only single-thread kernels record (finalize, check_scales), and kernels of one stream run
// in order, so the first fault is kept without atomics.
__device__ void record(FaultWord* w, Fault f, uint32_t chunk, float value) {
  if (w->fault != 0) return;
  w->fault = static_cast<int32_t>(f);
  w->chunk = chunk;
  w->value = value;
}

std::size_t round_up(std::size_t v, std::size_t m) { return (v + m - 1) / m * m; }

// One group of 16 threads per block of 2048 elements: thread l sums lane l.
__global__ void block_sums(const float* __restrict__ x, const float* __restrict__ e, std::size_t n,
                           std::size_t blocks, float* __restrict__ partial) {
  const std::size_t t = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::size_t b = t / kLanes;
  const int lane = static_cast<int>(t % kLanes);
  float acc = 0.0f;
  if (b < blocks) {
    const std::size_t base = b * kBlock + static_cast<std::size_t>(lane);
    for (std::size_t row = 0; row < kBlock / kLanes; ++row) {
      const std::size_t i = base + row * kLanes;
      if (i < n) {
        const float v = e != nullptr ? __fadd_rn(x[i], e[i]) : x[i];
        acc = __fadd_rn(acc, __fmul_rn(v, v));
      }
    }
  }
  // lane[i] += lane[i + step] for step 8, 4, 2, 1 (the lanes beyond `step` are unused).
  for (int step = kLanes / 2; step >= 1; step /= 2) {
    const float other = __shfl_down_sync(0xffffffffu, acc, step, kLanes);
    acc = __fadd_rn(acc, other);
  }
  if (b < blocks && lane == 0) partial[b] = acc;
}

__global__ void super_sums(const float* __restrict__ partial, std::size_t blocks,
                           double* __restrict__ supers) {
  const std::size_t s = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::size_t begin = s * kSuper;
  if (begin >= blocks) return;
  const std::size_t end = begin + kSuper < blocks ? begin + kSuper : blocks;
  double sum = 0.0;
  for (std::size_t b = begin; b < end; ++b) sum = __dadd_rn(sum, static_cast<double>(partial[b]));
  supers[s] = sum;
}

__device__ void store_scale(uint8_t* p, float v) {
  const uint32_t u = __float_as_uint(v);
  p[0] = static_cast<uint8_t>(u);
  p[1] = static_cast<uint8_t>(u >> 8);
  p[2] = static_cast<uint8_t>(u >> 16);
  p[3] = static_cast<uint8_t>(u >> 24);
}

__device__ float load_scale(const uint8_t* p) {
  const uint32_t u = static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
                     static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
  return __uint_as_float(u);
}

__global__ void finalize(const double* __restrict__ supers, std::size_t count, std::size_t n,
                         uint32_t chunk_count, std::size_t chunk_bytes, float* scale_out,
                         uint8_t* __restrict__ out, FaultWord* fault) {
  if (faulted(fault)) return;
  double total = 0.0;
  for (std::size_t s = 0; s < count; ++s) total = __dadd_rn(total, supers[s]);
  if (!(total <= 1.7976931348623157e308)) {  // Inf or NaN: the CPU codec's isfinite(sum)
    record(fault, Fault::kEncodeNonFinite, 0, 0.0f);
    return;
  }
  const float scale = n == 0 ? 0.0f : static_cast<float>(sqrt(total / static_cast<double>(n)));
  *scale_out = scale;
  for (uint32_t j = 0; j < chunk_count; ++j) store_scale(out + j * chunk_bytes, scale);
}

// One thread per 8 elements (one output byte).
template <bool kVec>
__global__ void sign_pack(const float* __restrict__ x, float* __restrict__ e, std::size_t groups,
                          std::size_t chunk_groups, std::size_t chunk_bytes,
                          const float* __restrict__ scale_in, uint8_t* __restrict__ out,
                          const FaultWord* fault) {
  const std::size_t g = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= groups || faulted(fault)) return;
  const float scale = *scale_in;
  float b[8];
  if constexpr (kVec) {
    const float4* x4 = reinterpret_cast<const float4*>(x) + 2 * g;
    const float4 a0 = x4[0];
    const float4 a1 = x4[1];
    b[0] = a0.x;
    b[1] = a0.y;
    b[2] = a0.z;
    b[3] = a0.w;
    b[4] = a1.x;
    b[5] = a1.y;
    b[6] = a1.z;
    b[7] = a1.w;
    if (e != nullptr) {
      const float4* e4 = reinterpret_cast<const float4*>(e) + 2 * g;
      const float4 c0 = e4[0];
      const float4 c1 = e4[1];
      b[0] = __fadd_rn(b[0], c0.x);
      b[1] = __fadd_rn(b[1], c0.y);
      b[2] = __fadd_rn(b[2], c0.z);
      b[3] = __fadd_rn(b[3], c0.w);
      b[4] = __fadd_rn(b[4], c1.x);
      b[5] = __fadd_rn(b[5], c1.y);
      b[6] = __fadd_rn(b[6], c1.z);
      b[7] = __fadd_rn(b[7], c1.w);
    }
  } else {
    for (int j = 0; j < 8; ++j) {
      b[j] = e != nullptr ? __fadd_rn(x[8 * g + j], e[8 * g + j]) : x[8 * g + j];
    }
  }
  unsigned byte = 0;
  float r[8];
  for (int j = 0; j < 8; ++j) {
    const bool bit = b[j] >= 0.0f;
    byte |= (bit ? 1u : 0u) << (7 - j);
    r[j] = __fsub_rn(b[j], bit ? scale : -scale);
  }
  const std::size_t chunk = g / chunk_groups;
  out[chunk * chunk_bytes + 4 + (g - chunk * chunk_groups)] = static_cast<uint8_t>(byte);
  if (e != nullptr) {
    if constexpr (kVec) {
      float4* e4 = reinterpret_cast<float4*>(e) + 2 * g;
      e4[0] = make_float4(r[0], r[1], r[2], r[3]);
      e4[1] = make_float4(r[4], r[5], r[6], r[7]);
    } else {
      for (int j = 0; j < 8; ++j) e[8 * g + j] = r[j];
    }
  }
}

// The CPU codec's scale check: finite and >= 0 (so -0 passes, NaN and Inf do not).
__device__ bool valid_scale(float s) { return s >= 0.0f && s <= 3.402823466e38f; }

// One thread: the first chunk with an invalid scale is recorded.
__global__ void check_scales(const uint8_t* __restrict__ in, uint32_t chunks,
                             std::size_t chunk_bytes, Fault kind, FaultWord* fault) {
  if (faulted(fault)) return;
  for (uint32_t c = 0; c < chunks; ++c) {
    const float s = load_scale(in + c * chunk_bytes);
    if (!valid_scale(s)) {
      record(fault, kind, c, s);
      return;
    }
  }
}

template <bool kVec>
__global__ void unpack(const uint8_t* __restrict__ in, std::size_t groups, std::size_t chunk_groups,
                       std::size_t chunk_bytes, float alpha, bool accumulate,
                       float* __restrict__ out, const FaultWord* fault) {
  const std::size_t g = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= groups || faulted(fault)) return;
  const std::size_t chunk = g / chunk_groups;
  const uint8_t* c = in + chunk * chunk_bytes;
  const float v = __fmul_rn(alpha, load_scale(c));
  const unsigned byte = c[4 + (g - chunk * chunk_groups)];
  float r[8];
  for (int j = 0; j < 8; ++j) r[j] = ((byte >> (7 - j)) & 1u) != 0 ? v : -v;
  if constexpr (kVec) {
    float4* o4 = reinterpret_cast<float4*>(out) + 2 * g;
    if (accumulate) {
      const float4 a0 = o4[0];
      const float4 a1 = o4[1];
      r[0] = __fadd_rn(a0.x, r[0]);
      r[1] = __fadd_rn(a0.y, r[1]);
      r[2] = __fadd_rn(a0.z, r[2]);
      r[3] = __fadd_rn(a0.w, r[3]);
      r[4] = __fadd_rn(a1.x, r[4]);
      r[5] = __fadd_rn(a1.y, r[5]);
      r[6] = __fadd_rn(a1.z, r[6]);
      r[7] = __fadd_rn(a1.w, r[7]);
    }
    o4[0] = make_float4(r[0], r[1], r[2], r[3]);
    o4[1] = make_float4(r[4], r[5], r[6], r[7]);
  } else {
    for (int j = 0; j < 8; ++j) {
      out[8 * g + j] = accumulate ? __fadd_rn(out[8 * g + j], r[j]) : r[j];
    }
  }
}

// decode_sum: thread g sums the 8 elements of byte g over all chunks, in chunk order.
template <bool kVec>
__global__ void unpack_sum(const uint8_t* __restrict__ in, uint32_t chunks, std::size_t groups,
                           std::size_t chunk_bytes, float alpha, bool accumulate,
                           float* __restrict__ out, const FaultWord* fault) {
  const std::size_t g = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= groups || faulted(fault)) return;
  float r[8];
  for (uint32_t c = 0; c < chunks; ++c) {
    const uint8_t* p = in + c * chunk_bytes;
    const float v = __fmul_rn(alpha, load_scale(p));
    const unsigned byte = p[4 + g];
    for (int j = 0; j < 8; ++j) {
      const float t = ((byte >> (7 - j)) & 1u) != 0 ? v : -v;
      if (c == 0) {
        r[j] = accumulate ? __fadd_rn(out[8 * g + j], t) : t;
      } else {
        r[j] = __fadd_rn(r[j], t);
      }
    }
  }
  if constexpr (kVec) {
    float4* o4 = reinterpret_cast<float4*>(out) + 2 * g;
    o4[0] = make_float4(r[0], r[1], r[2], r[3]);
    o4[1] = make_float4(r[4], r[5], r[6], r[7]);
  } else {
    for (int j = 0; j < 8; ++j) out[8 * g + j] = r[j];
  }
}

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

unsigned grid(std::size_t threads, unsigned block) {
  return static_cast<unsigned>((threads + block - 1) / block);
}

}  // namespace

bool device_available() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return count > 0;
}

void* fault_word_alloc(int device) {
  const loom::sdk::CudaDeviceGuard on(device);
  void* w = nullptr;
  LOOM_CUDA_CHECK(cudaMalloc(&w, sizeof(FaultWord)));
  const cudaError_t e = cudaMemset(w, 0, sizeof(FaultWord));
  if (e != cudaSuccess) {
    (void)cudaFree(w);
    LOOM_CUDA_CHECK(e);
  }
  return w;
}

void fault_word_free(void* word) {
  if (word != nullptr) (void)cudaFree(word);
}

FaultReport read_fault(void* word, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  FaultWord h{};
  LOOM_CUDA_CHECK(cudaMemcpyAsync(&h, word, sizeof h, cudaMemcpyDeviceToHost, s));
  LOOM_CUDA_CHECK(cudaStreamSynchronize(s));
  FaultReport r;
  if (h.fault == 0) return r;
  LOOM_CUDA_CHECK(cudaMemsetAsync(word, 0, sizeof(FaultWord), s));
  r.fault = static_cast<Fault>(h.fault);
  r.chunk = h.chunk;
  r.value = h.value;
  return r;
}

std::size_t onebit_encode_workspace_bytes(std::size_t n) {
  const std::size_t blocks = (n + kBlock - 1) / kBlock;
  const std::size_t supers = (blocks + kSuper - 1) / kSuper;
  return round_up(blocks * sizeof(float), 16) + round_up(supers * sizeof(double), 16) + 16;
}

void onebit_encode(const float* x, float* e, std::size_t n, uint32_t chunk_count, uint8_t* out,
                   void* workspace, void* fault, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  auto* fw = static_cast<FaultWord*>(fault);
  const std::size_t blocks = (n + kBlock - 1) / kBlock;
  const std::size_t supers = (blocks + kSuper - 1) / kSuper;
  auto* ws = static_cast<char*>(workspace);
  auto* partial = reinterpret_cast<float*>(ws);
  auto* super = reinterpret_cast<double*>(ws + round_up(blocks * sizeof(float), 16));
  auto* scale = reinterpret_cast<float*>(ws + round_up(blocks * sizeof(float), 16) +
                                         round_up(supers * sizeof(double), 16));
  const std::size_t chunk_elements = n / chunk_count;
  const std::size_t chunk_groups = chunk_elements / 8;
  const std::size_t chunk_bytes = 4 + chunk_groups;
  if (blocks > 0) {
    block_sums<<<grid(blocks * kLanes, 256), 256, 0, s>>>(x, e, n, blocks, partial);
    LOOM_CHECK_LAUNCH(block_sums);
    super_sums<<<grid(supers, 128), 128, 0, s>>>(partial, blocks, super);
    LOOM_CHECK_LAUNCH(super_sums);
  }
  finalize<<<1, 1, 0, s>>>(super, supers, n, chunk_count, chunk_bytes, scale, out, fw);
  LOOM_CHECK_LAUNCH(finalize);
  const std::size_t groups = n / 8;
  if (groups > 0) {
    if (aligned16(x) && (e == nullptr || aligned16(e))) {
      sign_pack<true><<<grid(groups, 256), 256, 0, s>>>(x, e, groups, chunk_groups, chunk_bytes,
                                                        scale, out, fw);
    } else {
      sign_pack<false><<<grid(groups, 256), 256, 0, s>>>(x, e, groups, chunk_groups, chunk_bytes,
                                                         scale, out, fw);
    }
    LOOM_CHECK_LAUNCH(sign_pack);
  }
}

void onebit_decode(const uint8_t* in, uint32_t chunk_count, std::size_t chunk_elements, float alpha,
                   bool accumulate, float* out, void* fault, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  auto* fw = static_cast<FaultWord*>(fault);
  const std::size_t chunk_groups = chunk_elements / 8;
  const std::size_t groups = chunk_groups * chunk_count;
  if (groups == 0) return;
  check_scales<<<1, 1, 0, s>>>(in, chunk_count, 4 + chunk_groups, Fault::kDecodeBadScale, fw);
  LOOM_CHECK_LAUNCH(check_scales);
  if (aligned16(out)) {
    unpack<true><<<grid(groups, 256), 256, 0, s>>>(in, groups, chunk_groups, 4 + chunk_groups,
                                                   alpha, accumulate, out, fw);
  } else {
    unpack<false><<<grid(groups, 256), 256, 0, s>>>(in, groups, chunk_groups, 4 + chunk_groups,
                                                    alpha, accumulate, out, fw);
  }
  LOOM_CHECK_LAUNCH(unpack);
}

void onebit_decode_sum(const uint8_t* in, uint32_t chunk_count, std::size_t chunk_elements,
                       float alpha, bool accumulate, float* out, void* fault, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  auto* fw = static_cast<FaultWord*>(fault);
  const std::size_t groups = chunk_elements / 8;
  if (groups == 0) return;
  if (chunk_count == 0) {
    if (!accumulate) LOOM_CUDA_CHECK(cudaMemsetAsync(out, 0, chunk_elements * sizeof(float), s));
    return;
  }
  check_scales<<<1, 1, 0, s>>>(in, chunk_count, 4 + groups, Fault::kDecodeSumBadScale, fw);
  LOOM_CHECK_LAUNCH(check_scales);
  if (aligned16(out)) {
    unpack_sum<true><<<grid(groups, 256), 256, 0, s>>>(in, chunk_count, groups, 4 + groups, alpha,
                                                       accumulate, out, fw);
  } else {
    unpack_sum<false><<<grid(groups, 256), 256, 0, s>>>(in, chunk_count, groups, 4 + groups, alpha,
                                                        accumulate, out, fw);
  }
  LOOM_CHECK_LAUNCH(unpack_sum);
}

void copy_to_device(void* dst, const void* src, std::size_t bytes) {
  LOOM_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}
void copy_to_host(void* dst, const void* src, std::size_t bytes) {
  LOOM_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}

}  // namespace loom::codecs::cuda
