// int_cuda.hpp. Quantize is two kernels: a block per group reduces min, max and the first
// non-finite index (shared memory) and writes the group's scale and zero point; then a thread
// per output byte computes the codes whose bits fall in that byte and assembles it, so codes
// that straddle bytes need no atomics and the unused trailing bits come out 0. Dequantize,
// widen and the epilogue are a thread per element; the weight-only matmul a warp per output
// column over up to 8 activation rows at a time.
#include <cuda_runtime.h>
#include <loom/sdk/cuda.hpp>
#include <loom/sdk/status.hpp>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/float16_io_cuda.cuh"
#include "float_stage.hpp"
#include "int_cuda.hpp"

namespace loom::quant::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kGroupThreads = 128;  // a block per group: min, max, first non-finite

struct Dev {
  int64_t rows, cols, group, gpr;
  uint32_t bits;
  int32_t symmetric, deepspeed, packing;
};

Dev dev_of(const Groups& gs, const IntScheme& q, int32_t packing) {
  return {gs.rows,
          gs.cols,
          gs.group,
          gs.groups_per_row,
          q.bits,
          q.symmetric ? 1 : 0,
          q.range == Range::kDeepSpeed ? 1 : 0,
          packing};
}

unsigned blocks_for(int64_t n, int per_block, const char* what) {
  const int64_t b = (n + per_block - 1) / per_block;
  if (b >= INT32_MAX) {
    throw loom::sdk::Error(LOOM_ERR_OUT_OF_RANGE, std::string("quantizer: ") + what + " (" +
                                                      std::to_string(n) +
                                                      ") needs more CUDA blocks than a grid holds");
  }
  return static_cast<unsigned>(std::max<int64_t>(1, b));
}

// A grid-stride loop's grid: at most 65535 blocks.
unsigned stride_blocks(int64_t n) {
  return static_cast<unsigned>(
      std::min<int64_t>(65535, std::max<int64_t>(1, (n + kThreads - 1) / kThreads)));
}

__device__ __forceinline__ uint32_t dev_read_code(const uint8_t* packed, int64_t i, uint32_t bits,
                                                  int32_t packing) {
  const int64_t k = i * bits;
  const int64_t byte = k >> 3;
  const uint32_t off = static_cast<uint32_t>(k & 7);
  const uint32_t mask = (1u << bits) - 1u;
  const bool two = off + bits > 8;
  if (packing == LOOM_QUANT_PACK_LSB_FIRST) {
    uint32_t v = packed[byte];
    if (two) v |= static_cast<uint32_t>(packed[byte + 1]) << 8;
    return (v >> off) & mask;
  }
  uint32_t v = static_cast<uint32_t>(packed[byte]) << 8;
  if (two) v |= packed[byte + 1];
  return (v >> (16u - off - bits)) & mask;
}

// int_group_params of quant_core.hpp, operation for operation.
__device__ __forceinline__ void dev_params(float mn, float mx, const Dev& d, float* scale,
                                           int32_t* zero) {
  if (d.symmetric) {
    const float a = fmaxf(fabsf(mn), fabsf(mx));
    const float div = d.deepspeed ? static_cast<float>(1u << (d.bits - 1))
                                  : static_cast<float>((1u << (d.bits - 1)) - 1u);
    float s = __fdiv_rn(a, div);
    if (!(s > 0.0f)) s = 1.0f;
    *scale = s;
    *zero = 0;
    return;
  }
  const float lo = fminf(mn, 0.0f);
  const float hi = fmaxf(mx, 0.0f);
  const float div =
      d.deepspeed ? static_cast<float>(1u << d.bits) : static_cast<float>((1u << d.bits) - 1u);
  float s = __fdiv_rn(__fsub_rn(hi, lo), div);
  if (!(s > 0.0f) && isfinite(s)) s = 1.0f;
  *scale = s;
  const float qmax = static_cast<float>((1u << d.bits) - 1u);
  const float z = rintf(__fdiv_rn(-lo, s));
  *zero = static_cast<int32_t>(fminf(fmaxf(z, 0.0f), qmax));
}

// int_encode of quant_core.hpp.
__device__ __forceinline__ int32_t dev_encode(float x, float s, int32_t z, const Dev& d) {
  if (d.symmetric) {
    const float hi = static_cast<float>((1u << (d.bits - 1)) - 1u);
    const float lo = d.deepspeed ? -hi - 1.0f : -hi;
    const float r = rintf(__fdiv_rn(x, s));
    return static_cast<int32_t>(fminf(fmaxf(r, lo), hi));
  }
  const float qmax = static_cast<float>((1u << d.bits) - 1u);
  float r;
  if (!d.deepspeed) {
    r = __fadd_rn(rintf(__fdiv_rn(x, s)), static_cast<float>(z));
  } else {
    const float zf = __fmul_rn(static_cast<float>(z), s);
    r = rintf(__fdiv_rn(__fadd_rn(x, zf), s));
  }
  return static_cast<int32_t>(fminf(fmaxf(r, 0.0f), qmax));
}

__device__ __forceinline__ int32_t dev_value(uint32_t u, int32_t z, const Dev& d) {
  if (d.symmetric) {
    const uint32_t m = 1u << (d.bits - 1);
    return static_cast<int32_t>(u ^ m) - static_cast<int32_t>(m);
  }
  return static_cast<int32_t>(u) - z;
}

// A block per group: min, max, first non-finite index; thread 0 writes the parameters.
__global__ void group_kernel(const float* x, Dev d, float* scales, uint8_t* zeros, int64_t* bad) {
  __shared__ float smin[kGroupThreads];
  __shared__ float smax[kGroupThreads];
  __shared__ int64_t sbad[kGroupThreads];
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t gi = blockIdx.x;
  const int64_t r = gi / d.gpr;
  const int64_t g = gi % d.gpr;
  const int64_t c0 = g * d.group;
  const int64_t c1 = min(d.cols, c0 + d.group);
  const float* row = x + r * d.cols;
  float mn = INFINITY, mx = -INFINITY;
  int64_t first_bad = INT64_MAX;
  for (int64_t c = c0 + tid; c < c1; c += kGroupThreads) {
    const float v = row[c];
    if (!isfinite(v)) {
      if (c < first_bad) first_bad = c;
    } else {
      mn = fminf(mn, v);
      mx = fmaxf(mx, v);
    }
  }
  smin[tid] = mn;
  smax[tid] = mx;
  sbad[tid] = first_bad;
  __syncthreads();
  for (int h = kGroupThreads / 2; h > 0; h /= 2) {
    if (tid < h) {
      smin[tid] = fminf(smin[tid], smin[tid + h]);
      smax[tid] = fmaxf(smax[tid], smax[tid + h]);
      sbad[tid] = min(sbad[tid], sbad[tid + h]);
    }
    __syncthreads();
  }
  if (tid == 0) {
    float s;
    int32_t z;
    dev_params(smin[0], smax[0], d, &s, &z);
    scales[gi] = s;
    if (!d.symmetric) zeros[gi] = static_cast<uint8_t>(z);
    bad[gi] = sbad[0] == INT64_MAX ? -1 : r * d.cols + sbad[0];
  }
}

// The first non-finite index over the groups (one block).
__global__ void first_bad_kernel(const int64_t* bad, int64_t groups, int64_t* out) {
  __shared__ int64_t s[kThreads];
  const int tid = static_cast<int>(threadIdx.x);
  int64_t best = INT64_MAX;
  for (int64_t i = tid; i < groups; i += kThreads) {
    if (bad[i] >= 0 && bad[i] < best) best = bad[i];
  }
  s[tid] = best;
  __syncthreads();
  for (int h = kThreads / 2; h > 0; h /= 2) {
    if (tid < h) s[tid] = min(s[tid], s[tid + h]);
    __syncthreads();
  }
  if (tid == 0) *out = s[0] == INT64_MAX ? -1 : s[0];
}

// A thread per output byte: the codes (or parts of codes) whose stream bits fall in it.
__global__ void encode_kernel(const float* x, Dev d, const float* scales, const uint8_t* zeros,
                              int64_t total, int64_t bytes, uint8_t* packed) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < bytes;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e0 = (8 * j) / d.bits;
    const int64_t e1 = min(total - 1, (8 * j + 7) / static_cast<int64_t>(d.bits));
    uint32_t out = 0;
    for (int64_t e = e0; e <= e1; ++e) {
      const int64_t r = e / d.cols;
      const int64_t c = e % d.cols;
      const int64_t gi = r * d.gpr + c / d.group;
      const int32_t z = d.symmetric ? 0 : zeros[gi];
      const uint32_t code =
          static_cast<uint32_t>(dev_encode(x[e], scales[gi], z, d)) & ((1u << d.bits) - 1u);
      const int64_t offset = e * d.bits - 8 * j;  // the code's first bit relative to the byte
      const int64_t shift = d.packing == LOOM_QUANT_PACK_LSB_FIRST ? offset : 8 - d.bits - offset;
      out |= shift >= 0 ? code << shift : code >> (-shift);
    }
    packed[j] = static_cast<uint8_t>(out & 0xFFu);
  }
}

__global__ void decode_kernel(const uint8_t* packed, const float* scales, const uint8_t* zeros,
                              Dev d, int64_t total, float* x) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t gi = (e / d.cols) * d.gpr + (e % d.cols) / d.group;
    const int32_t z = d.symmetric ? 0 : zeros[gi];
    const int32_t v = dev_value(dev_read_code(packed, e, d.bits, d.packing), z, d);
    x[e] = __fmul_rn(scales[gi], static_cast<float>(v));
  }
}

__global__ void widen_kernel(const uint8_t* packed, const uint8_t* zeros, Dev d, int64_t total,
                             int8_t* out) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t gi = (e / d.cols) * d.gpr + (e % d.cols) / d.group;
    const int32_t z = d.symmetric ? 0 : zeros[gi];
    out[e] = static_cast<int8_t>(dev_value(dev_read_code(packed, e, d.bits, d.packing), z, d));
  }
}

constexpr int kRows = 8;  // activation rows per pass of the weight-only kernel
constexpr int kWarps = kThreads / 32;

// A warp per output column n; lane l takes columns k = l, l + 32, ... of W's row n, decodes
// each code once and multiplies it into up to kRows activation rows.
__global__ void weight_only_kernel(const float* x, int64_t m, const uint8_t* packed,
                                   const float* scales, const uint8_t* zeros, Dev d,
                                   const float* bias, float* y) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const bool active = n < d.rows;
  const int64_t K = d.cols;
  for (int64_t m0 = 0; m0 < m; m0 += kRows) {
    const int rows = static_cast<int>(min(static_cast<int64_t>(kRows), m - m0));
    float acc[kRows];
    for (int r = 0; r < kRows; ++r) acc[r] = 0.0f;
    if (active) {
      for (int64_t k = lane; k < K; k += 32) {
        const int64_t gi = n * d.gpr + k / d.group;
        const int32_t z = d.symmetric ? 0 : zeros[gi];
        const float w =
            __fmul_rn(scales[gi], static_cast<float>(dev_value(
                                      dev_read_code(packed, n * K + k, d.bits, d.packing), z, d)));
        for (int r = 0; r < rows; ++r) acc[r] += w * x[(m0 + r) * K + k];
      }
    }
    for (int r = 0; r < kRows; ++r) {
      float v = acc[r];
      for (int off = 16; off > 0; off /= 2) v += __shfl_down_sync(0xffffffffu, v, off);
      if (active && lane == 0 && r < rows)
        y[(m0 + r) * d.rows + n] = v + (bias != nullptr ? bias[n] : 0.0f);
    }
  }
}

__global__ void epilogue_kernel(const int32_t* acc, int64_t m, int64_t n, const float* sx,
                                const float* sw, int64_t groups, int64_t g, const float* bias,
                                int first, float* y) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < m * n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = e / n;
    const int64_t j = e % n;
    const float t = __fmul_rn(__fmul_rn(static_cast<float>(acc[e]), sw[j * groups + g]), sx[i]);
    if (first) {
      y[e] = bias != nullptr ? __fadd_rn(t, bias[j]) : t;
    } else {
      y[e] = __fadd_rn(y[e], t);
    }
  }
}

__global__ void int8_gemm_kernel(const int8_t* xq, const int8_t* wq, int64_t m, int64_t n,
                                 int64_t k, int64_t k0, int64_t kg, int32_t* acc) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < m * n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int8_t* a = xq + (e / n) * k + k0;
    const int8_t* b = wq + (e % n) * k + k0;
    int32_t sum = 0;
    for (int64_t i = 0; i < kg; ++i) sum += static_cast<int32_t>(a[i]) * static_cast<int32_t>(b[i]);
    acc[e] = sum;
  }
}

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

void check_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    throw loom::sdk::Error(LOOM_ERR_UNAVAILABLE,
                           loom::sdk::cuda_failure(e, what, __FILE__, __LINE__));
  }
}

}  // namespace

int64_t quantize_int(const float* x, const Groups& gs, const IntScheme& q, int32_t packing,
                     uint8_t* packed, float* scales, uint8_t* zeros, void* stream,
                     int64_t* first_bad) {
  const int64_t total = gs.rows * gs.cols;
  const auto bytes = static_cast<int64_t>(packed_size(static_cast<uint64_t>(total), q.bits));
  const cudaStream_t s = as_stream(stream);
  if (bytes == 0) {
    // -1 is every byte 0xFF; a memset involves no host memory, so nothing waits.
    if (first_bad != nullptr) LOOM_CUDA_CHECK(cudaMemsetAsync(first_bad, 0xFF, sizeof(int64_t), s));
    return -1;
  }
  LOOM_CUDA_CHECK(cudaPeekAtLastError());
  const Dev d = dev_of(gs, q, packing);
  const int64_t groups = gs.count();
  loom::sdk::CudaScratch bad(static_cast<std::size_t>(groups + 1) * sizeof(int64_t), s);
  int64_t* badp = bad.as<int64_t>();
  group_kernel<<<blocks_for(groups, 1, "quantize groups"), kGroupThreads, 0, s>>>(x, d, scales,
                                                                                  zeros, badp);
  check_launch("quantize group kernel");
  first_bad_kernel<<<1, kThreads, 0, s>>>(badp, groups,
                                          first_bad != nullptr ? first_bad : badp + groups);
  check_launch("quantize check kernel");
  encode_kernel<<<stride_blocks(bytes), kThreads, 0, s>>>(x, d, scales, zeros, total, bytes,
                                                          packed);
  check_launch("quantize encode kernel");
  if (first_bad != nullptr) return -1;  // the caller reads it when it needs it
  int64_t first = -1;
  LOOM_CUDA_CHECK(cudaMemcpyAsync(&first, badp + groups, sizeof first, cudaMemcpyDeviceToHost, s));
  LOOM_CUDA_CHECK(cudaStreamSynchronize(s));
  return first;
}

void dequantize_int(const IntWeight& w, float* x, void* stream) {
  const int64_t total = w.gs.rows * w.gs.cols;
  if (total == 0) return;
  LOOM_CUDA_CHECK(cudaPeekAtLastError());
  decode_kernel<<<stride_blocks(total), kThreads, 0, as_stream(stream)>>>(
      w.packed, w.scales, w.zeros, dev_of(w.gs, w.q, w.packing), total, x);
  check_launch("dequantize kernel");
}

int64_t quantize_rows_int8(const float* x, int64_t rows, int64_t cols, int8_t* q, float* scales,
                           void* stream) {
  return quantize_int(x, Groups::of(rows, cols, 0), IntScheme{8, true, Range::kExact},
                      LOOM_QUANT_PACK_LSB_FIRST, reinterpret_cast<uint8_t*>(q), scales, nullptr,
                      stream);
}

void widen_to_int8(const IntWeight& w, int8_t* out, void* stream) {
  const int64_t total = w.gs.rows * w.gs.cols;
  if (total == 0) return;
  LOOM_CUDA_CHECK(cudaPeekAtLastError());
  widen_kernel<<<stride_blocks(total), kThreads, 0, as_stream(stream)>>>(
      w.packed, w.zeros, dev_of(w.gs, w.q, w.packing), total, out);
  check_launch("widen kernel");
}

void matmul_weight_only(const float* x, int64_t m, const IntWeight& w, const float* bias, float* y,
                        void* stream) {
  if (m == 0 || w.gs.rows == 0) return;
  LOOM_CUDA_CHECK(cudaPeekAtLastError());
  weight_only_kernel<<<blocks_for(w.gs.rows, kWarps, "weight-only matmul columns"), kThreads, 0,
                       as_stream(stream)>>>(x, m, w.packed, w.scales, w.zeros,
                                            dev_of(w.gs, w.q, w.packing), bias, y);
  check_launch("weight-only matmul kernel");
}

void int8_epilogue(const int32_t* acc, int64_t m, int64_t n, const float* sx, const float* sw,
                   int64_t groups, int64_t g, const float* bias, bool first, float* y,
                   void* stream) {
  if (m * n == 0) return;
  epilogue_kernel<<<stride_blocks(m * n), kThreads, 0, as_stream(stream)>>>(
      acc, m, n, sx, sw, groups, g, bias, first ? 1 : 0, y);
  check_launch("INT8 GEMM epilogue kernel");
}

void int8_gemm_simple(const int8_t* xq, const int8_t* wq, int64_t m, int64_t n, int64_t k,
                      int64_t k0, int64_t kg, int32_t* acc, void* stream) {
  if (m * n == 0) return;
  int8_gemm_kernel<<<stride_blocks(m * n), kThreads, 0, as_stream(stream)>>>(xq, wq, m, n, k, k0,
                                                                             kg, acc);
  check_launch("INT8 GEMM kernel");
}

void widen_floats(int device, const void* src, f16::Storage s, float* dst, int64_t n,
                  void* stream) {
  if (n <= 0) return;
  loom::sdk::CudaDeviceGuard guard(device);
  f16::widen_kernel<<<f16::grid_for(n), 256, 0, as_stream(stream)>>>(src, static_cast<int>(s), dst,
                                                                     n);
  check_launch("widen_kernel");
}

void narrow_floats(int device, const float* src, f16::Storage s, void* dst, int64_t n,
                   void* stream) {
  if (n <= 0) return;
  loom::sdk::CudaDeviceGuard guard(device);
  f16::narrow_kernel<<<f16::grid_for(n), 256, 0, as_stream(stream)>>>(src, static_cast<int>(s), dst,
                                                                      n);
  check_launch("narrow_kernel");
}

}  // namespace loom::quant::cuda
