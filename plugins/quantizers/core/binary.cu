// Binary (BWN) CUDA kernels: scales one thread per group (the reference's fixed-order sum),
// codes one thread per byte, dequantize one thread per element, the matmul one thread per
// output. See xtc_cuda.hpp.
#include "xtc_cuda.cuh"
#include "xtc_cuda.hpp"

namespace loom::quant::cuda {
namespace {

using detail::blocks_for;
using detail::kThreads;

__global__ void binary_scale_kernel(const float* w, int64_t groups, int64_t gpr, int64_t cols,
                                    int64_t group_size, float* scales, int64_t* bad) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (g >= groups) return;
  const int64_t r = g / gpr;
  const int64_t c0 = (g % gpr) * group_size;
  const int64_t n = group_size < cols - c0 ? group_size : cols - c0;
  int64_t kept = 0;
  int64_t first = detail::kNone;
  const float sum = detail::group_abs_sum(w + r * cols + c0, n, -1.0f, &kept, &first);
  scales[g] = __fdiv_rn(sum, static_cast<float>(n));
  // As the CPU: a non-finite weight, else numel + g when finite weights' sum overflows.
  const int64_t overflow = fabsf(sum) <= 3.40282347e38f ? detail::kNone : (groups / gpr) * cols + g;
  bad[g] = first == detail::kNone ? overflow : r * cols + c0 + first;
}

__global__ void binary_code_kernel(const float* w, int64_t numel, int64_t bytes, uint8_t* packed) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (b >= bytes) return;
  unsigned v = 0;
  for (int j = 0; j < 8; ++j) {
    const int64_t e = 8 * b + j;
    if (e < numel && w[e] >= 0.0f) v |= 1u << j;
  }
  packed[b] = static_cast<uint8_t>(v);
}

__global__ void binary_dequantize_kernel(const uint8_t* packed, const float* scales, int64_t numel,
                                         int64_t gpr, int64_t cols, int64_t group_size, float* w) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (e >= numel) return;
  const float alpha = scales[(e / cols) * gpr + (e % cols) / group_size];
  w[e] = ((packed[e / 8] >> (e % 8)) & 1u) != 0 ? alpha : -alpha;
}

__global__ void binary_matmul_kernel(const float* x, int64_t m, const uint8_t* packed,
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
      const int64_t e = n * cols + k;
      part = ((packed[e / 8] >> (e % 8)) & 1u) != 0 ? part + xr[k] : part - xr[k];
    }
    acc += scales[n * gpr + g] * part;
  }
  y[o] = acc + (bias != nullptr ? bias[n] : 0.0f);
}

}  // namespace

int64_t binary_quantize(const float* w, const GroupedShape& s, uint8_t* packed, float* scales,
                        void* workspace, int device, void* stream, int64_t* first) {
  if (s.numel() == 0) return detail::no_bad(first, device, stream);
  const loom::sdk::CudaDeviceGuard guard(device);
  auto* st = static_cast<cudaStream_t>(stream);
  const detail::Workspace ws = detail::split(workspace, s);
  const int64_t groups = s.groups();
  binary_scale_kernel<<<blocks_for(groups, "xtc quantize"), kThreads, 0, st>>>(
      w, groups, s.groups_per_row(), s.cols, s.group_size, scales, ws.bad);
  LOOM_CUDA_CHECK(cudaGetLastError());
  const auto bytes = static_cast<int64_t>(packed_bytes_of(s, 1));
  binary_code_kernel<<<blocks_for(bytes, "xtc quantize"), kThreads, 0, st>>>(w, s.numel(), bytes,
                                                                             packed);
  LOOM_CUDA_CHECK(cudaGetLastError());
  return detail::first_bad(ws, groups, st, first);
}

void binary_dequantize(const uint8_t* packed, const float* scales, const GroupedShape& s, float* w,
                       int device, void* stream) {
  if (s.numel() == 0) return;
  const loom::sdk::CudaDeviceGuard guard(device);
  auto* st = static_cast<cudaStream_t>(stream);
  binary_dequantize_kernel<<<blocks_for(s.numel(), "xtc dequantize"), kThreads, 0, st>>>(
      packed, scales, s.numel(), s.groups_per_row(), s.cols, s.group_size, w);
  LOOM_CUDA_CHECK(cudaGetLastError());
}

void binary_matmul(const float* x, int64_t m, const uint8_t* packed, const float* scales,
                   const GroupedShape& s, const float* bias, float* y, int device, void* stream) {
  if (m * s.rows == 0) return;
  const loom::sdk::CudaDeviceGuard guard(device);
  auto* st = static_cast<cudaStream_t>(stream);
  binary_matmul_kernel<<<blocks_for(m * s.rows, "xtc matmul"), kThreads, 0, st>>>(
      x, m, packed, scales, s.rows, s.cols, s.groups_per_row(), s.group_size, bias, y);
  LOOM_CUDA_CHECK(cudaGetLastError());
}

namespace detail {

// result[0] = min of bad[0, n), -1 when every entry is kNone (one block).
__global__ void min_kernel(const int64_t* bad, int64_t n, int64_t* result) {
  __shared__ int64_t part[kThreads];
  int64_t m = kNone;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) m = bad[i] < m ? bad[i] : m;
  part[threadIdx.x] = m;
  __syncthreads();
  for (int h = kThreads / 2; h >= 1; h /= 2) {
    if (static_cast<int>(threadIdx.x) < h && part[threadIdx.x + h] < part[threadIdx.x]) {
      part[threadIdx.x] = part[threadIdx.x + h];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) result[0] = part[0] == kNone ? -1 : part[0];
}

int64_t no_bad(int64_t* out, int device, void* stream) {
  if (out == nullptr) return -1;
  const loom::sdk::CudaDeviceGuard guard(device);
  // -1 is every byte 0xFF; a memset involves no host memory, so nothing waits.
  LOOM_CUDA_CHECK(cudaMemsetAsync(out, 0xFF, sizeof(int64_t), static_cast<cudaStream_t>(stream)));
  return -1;
}

int64_t first_bad(const Workspace& ws, int64_t n, cudaStream_t stream, int64_t* out) {
  min_kernel<<<1, kThreads, 0, stream>>>(ws.bad, n, out != nullptr ? out : ws.result);
  LOOM_CUDA_CHECK(cudaGetLastError());
  if (out != nullptr) return -1;
  int64_t host = -1;
  LOOM_CUDA_CHECK(cudaMemcpyAsync(&host, ws.result, sizeof host, cudaMemcpyDeviceToHost, stream));
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream));
  return host;
}

}  // namespace detail

}  // namespace loom::quant::cuda
