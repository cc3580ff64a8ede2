// Ternary (TWN) CUDA kernels: Delta and alpha one thread per group (the reference's
// fixed-order sums), codes one thread per byte, the code-3 check one thread per row,
// dequantize one thread per element, the matmul one thread per output. See xtc_cuda.hpp.
#include "xtc_cuda.cuh"
#include "xtc_cuda.hpp"

namespace loom::quant::cuda {
namespace {

using detail::blocks_for;
using detail::kThreads;

__device__ inline unsigned code_at(const uint8_t* packed, int64_t e) {
  return (packed[e / 4] >> (2 * (e % 4))) & 3u;
}

__global__ void ternary_scale_kernel(const float* w, int64_t groups, int64_t gpr, int64_t cols,
                                     int64_t group_size, float threshold, float* scales,
                                     float* delta, int64_t* bad) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (g >= groups) return;
  const int64_t r = g / gpr;
  const int64_t c0 = (g % gpr) * group_size;
  const int64_t n = group_size < cols - c0 ? group_size : cols - c0;
  const float* p = w + r * cols + c0;
  int64_t kept = 0;
  int64_t first = detail::kNone;
  const float mean =
      __fdiv_rn(detail::group_abs_sum(p, n, -1.0f, &kept, &first), static_cast<float>(n));
  const float d = __fmul_rn(threshold, mean);
  int64_t unused = 0;
  const float kept_sum = detail::group_abs_sum(p, n, d, &kept, &unused);
  scales[g] = kept > 0 ? __fdiv_rn(kept_sum, static_cast<float>(kept)) : 0.0f;
  delta[g] = d;
  // As the CPU: a non-finite weight, else numel + g when Delta overflows.
  const int64_t overflow = fabsf(d) <= 3.40282347e38f ? detail::kNone : (groups / gpr) * cols + g;
  bad[g] = first == detail::kNone ? overflow : r * cols + c0 + first;
}

__global__ void ternary_code_kernel(const float* w, int64_t numel, int64_t bytes, int64_t gpr,
                                    int64_t cols, int64_t group_size, const float* delta,
                                    uint8_t* packed) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (b >= bytes) return;
  unsigned v = 0;
  for (int j = 0; j < 4; ++j) {
    const int64_t e = 4 * b + j;
    if (e >= numel) break;
    const float d = delta[(e / cols) * gpr + (e % cols) / group_size];
    if (fabsf(w[e]) > d) v |= (w[e] > 0.0f ? 1u : 2u) << (2 * j);
  }
  packed[b] = static_cast<uint8_t>(v);
}

// bad[r] = the first code 3 of row r (kNone if none).
__global__ void ternary_check_kernel(const uint8_t* packed, int64_t rows, int64_t cols,
                                     int64_t* bad) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (r >= rows) return;
  int64_t first = detail::kNone;
  for (int64_t k = 0; k < cols; ++k) {
    if (code_at(packed, r * cols + k) == 3u) {
      first = r * cols + k;
      break;
    }
  }
  bad[r] = first;
}

__global__ void ternary_dequantize_kernel(const uint8_t* packed, const float* scales, int64_t numel,
                                          int64_t gpr, int64_t cols, int64_t group_size, float* w) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (e >= numel) return;
  const float alpha = scales[(e / cols) * gpr + (e % cols) / group_size];
  const unsigned q = code_at(packed, e);
  w[e] = q == 1u ? alpha : (q == 2u ? -alpha : 0.0f);
}

__global__ void ternary_matmul_kernel(const float* x, int64_t m, const uint8_t* packed,
                                      const float* scales, int64_t rows, int64_t cols, int64_t gpr,
                                      int64_t group_size, const float* bias, float* y) {
  const int64_t o = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (o >= m * rows) return;
  const int64_t i = o / rows;
  const int64_t n = o % rows;
  const float* xr = x + i * cols;
  float acc = 0.0f;
  for (int64_t g = 0; g < gpr; ++g) {
    const int64_t c0 = g * group_size;
    const int64_t c1 = c0 + group_size < cols ? c0 + group_size : cols;
    float part = 0.0f;
    for (int64_t k = c0; k < c1; ++k) {
      const unsigned q = code_at(packed, n * cols + k);
      if (q == 1u) part += xr[k];
      if (q == 2u) part -= xr[k];
    }
    acc += scales[n * gpr + g] * part;
  }
  y[o] = acc + (bias != nullptr ? bias[n] : 0.0f);
}

int64_t check_codes(const uint8_t* packed, const GroupedShape& s, const detail::Workspace& ws,
                    cudaStream_t st) {
  ternary_check_kernel<<<blocks_for(s.rows, "xtc code check"), kThreads, 0, st>>>(packed, s.rows,
                                                                                  s.cols, ws.bad);
  LOOM_CUDA_CHECK(cudaGetLastError());
  return detail::first_bad(ws, s.rows, st);
}

}  // namespace

int64_t ternary_quantize(const float* w, const GroupedShape& s, float threshold, uint8_t* packed,
                         float* scales, void* workspace, int device, void* stream, int64_t* first) {
  if (s.numel() == 0) return detail::no_bad(first, device, stream);
  const loom::sdk::CudaDeviceGuard guard(device);
  auto* st = static_cast<cudaStream_t>(stream);
  const detail::Workspace ws = detail::split(workspace, s);
  const int64_t groups = s.groups();
  const int64_t gpr = s.groups_per_row();
  ternary_scale_kernel<<<blocks_for(groups, "xtc quantize"), kThreads, 0, st>>>(
      w, groups, gpr, s.cols, s.group_size, threshold, scales, ws.delta, ws.bad);
  LOOM_CUDA_CHECK(cudaGetLastError());
  const auto bytes = static_cast<int64_t>(packed_bytes_of(s, 2));
  ternary_code_kernel<<<blocks_for(bytes, "xtc quantize"), kThreads, 0, st>>>(
      w, s.numel(), bytes, gpr, s.cols, s.group_size, ws.delta, packed);
  LOOM_CUDA_CHECK(cudaGetLastError());
  return detail::first_bad(ws, groups, st, first);
}

int64_t ternary_dequantize(const uint8_t* packed, const float* scales, const GroupedShape& s,
                           float* w, void* workspace, int device, void* stream) {
  if (s.numel() == 0) return -1;
  const loom::sdk::CudaDeviceGuard guard(device);
  auto* st = static_cast<cudaStream_t>(stream);
  const detail::Workspace ws = detail::split(workspace, s);
  ternary_dequantize_kernel<<<blocks_for(s.numel(), "xtc dequantize"), kThreads, 0, st>>>(
      packed, scales, s.numel(), s.groups_per_row(), s.cols, s.group_size, w);
  LOOM_CUDA_CHECK(cudaGetLastError());
  return check_codes(packed, s, ws, st);
}

int64_t ternary_matmul(const float* x, int64_t m, const uint8_t* packed, const float* scales,
                       const GroupedShape& s, const float* bias, float* y, void* workspace,
                       int device, void* stream) {
  if (m * s.rows == 0) return -1;
  const loom::sdk::CudaDeviceGuard guard(device);
  auto* st = static_cast<cudaStream_t>(stream);
  ternary_matmul_kernel<<<blocks_for(m * s.rows, "xtc matmul"), kThreads, 0, st>>>(
      x, m, packed, scales, s.rows, s.cols, s.groups_per_row(), s.group_size, bias, y);
  LOOM_CUDA_CHECK(cudaGetLastError());
  if (s.cols == 0) return -1;
  return check_codes(packed, s, detail::split(workspace, s), st);
}

}  // namespace loom::quant::cuda
