// The experts on CUDA: one cuBLAS GEMM pair per expert segment on the caller's stream (row-
// major operands passed as their column-major transposes), bias, activation and column sums
// in small kernels (sums in row order, so the bias gradients are deterministic).
#include <cublas_v2.h>

#include <string>

#include <loom/moe/moe_cuda.hpp>
#include "cuda_util.cuh"

namespace loom::moe::cuda {
namespace {

void blas_check(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS) {
    throw loom::sdk::Error(LOOM_ERR_UNAVAILABLE, std::string("moe: ") + what +
                                                     " failed (cuBLAS status " +
                                                     std::to_string(static_cast<int>(st)) + ")");
  }
}

int blas_int(int64_t v) {
  if (v > 2147483647) {
    throw loom::sdk::Error(LOOM_ERR_OUT_OF_RANGE, "moe: a GEMM dimension exceeds cuBLAS's int");
  }
  return static_cast<int>(v);
}

// Row-major C[m, n] = alpha op(A) op(B) + beta C.
void gemm(cublasHandle_t h, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
          const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
          int64_t ldc) {
  blas_check(cublasSgemm(h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                         blas_int(n), blas_int(m), blas_int(k), &alpha, b, blas_int(ldb), a,
                         blas_int(lda), &beta, c, blas_int(ldc)),
             "cublasSgemm");
}

__device__ float act_f(int act, float x) {
  if (act == static_cast<int>(Activation::Relu)) return x > 0.0f ? x : 0.0f;
  if (act == static_cast<int>(Activation::Silu)) return x / (1.0f + expf(-x));
  const float u = 0.79788456f * (x + 0.044715f * x * x * x);
  return 0.5f * x * (1.0f + tanhf(u));
}

__device__ float act_g(int act, float x) {
  if (act == static_cast<int>(Activation::Relu)) return x > 0.0f ? 1.0f : 0.0f;
  if (act == static_cast<int>(Activation::Silu)) {
    const float sg = 1.0f / (1.0f + expf(-x));
    return sg * (1.0f + x * (1.0f - sg));
  }
  const float u = 0.79788456f * (x + 0.044715f * x * x * x);
  const float th = tanhf(u);
  const float du = 0.79788456f * (1.0f + 3.0f * 0.044715f * x * x);
  return 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * du;
}

// y[r, c] += b[c]; with h: h = act(y)
__global__ void bias_act_kernel(float* y, const float* b, int64_t n, int64_t width, float* h,
                                int act) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n * width;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] += b[i % width];
    if (h != nullptr) h[i] = act_f(act, y[i]);
  }
}

__global__ void act_kernel(const float* pre, float* h, int64_t n, int act) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    h[i] = act_f(act, pre[i]);
  }
}

__global__ void act_grad_kernel(const float* pre, float* dh, int64_t n, int act) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dh[i] *= act_g(act, pre[i]);
  }
}

// g[c] += sum over rows r (ascending) of d[r, c]
__global__ void colsum_kernel(float* g, const float* d, int64_t n, int64_t width) {
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < width;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float acc = g[c];
    for (int64_t r = 0; r < n; ++r) acc += d[r * width + c];
    g[c] = acc;
  }
}

cublasHandle_t handle_on(const Device& dev) {
  auto h = static_cast<cublasHandle_t>(dev.blas->handle(dev.device));
  blas_check(cublasSetStream(h, as_stream(dev.stream)), "cublasSetStream");
  return h;
}

}  // namespace

Blas::~Blas() {
  if (handle_ != nullptr) {
    int previous = 0;
    if (cudaGetDevice(&previous) == cudaSuccess) {
      (void)cudaSetDevice(device_);
      (void)cublasDestroy(static_cast<cublasHandle_t>(handle_));
      (void)cudaSetDevice(previous);
    }
  }
}

void* Blas::handle(int device) {
  if (handle_ != nullptr && device_ != device) {
    throw loom::sdk::Error(LOOM_ERR_INVALID_ARGUMENT,
                           "moe: this instance runs on CUDA device " + std::to_string(device_) +
                               "; a call on device " + std::to_string(device) +
                               " needs an instance of its own");
  }
  if (handle_ == nullptr) {
    cublasHandle_t h = nullptr;
    blas_check(cublasCreate(&h), "cublasCreate");
    handle_ = h;
    device_ = device;
  }
  return handle_;
}

void experts_forward(Activation act, int local_experts, const int64_t* rows, int64_t model_dim,
                     int64_t hidden_dim, const float* in, const ExpertWeights<float>& w, float* pre,
                     float* h, float* out, const Device& dev) {
  const int64_t M = model_dim, H = hidden_dim;
  cublasHandle_t bh = nullptr;
  int64_t off = 0;
  for (int e = 0; e < local_experts; ++e) {
    const int64_t n = rows[e];
    if (n <= 0) continue;
    if (bh == nullptr) bh = handle_on(dev);
    float* p = pre + off * H;
    float* hh = h + off * H;
    float* o = out + off * M;
    gemm(bh, false, true, n, H, M, 1.0f, in + off * M, M, w.w1 + e * H * M, M, 0.0f, p, H);
    bias_act_kernel<<<blocks_for(n * H), kThreads, 0, as_stream(dev.stream)>>>(
        p, w.b1 + e * H, n, H, hh, static_cast<int>(act));
    check_launch("bias_act");
    gemm(bh, false, true, n, M, H, 1.0f, hh, H, w.w2 + e * M * H, H, 0.0f, o, M);
    bias_act_kernel<<<blocks_for(n * M), kThreads, 0, as_stream(dev.stream)>>>(o, w.b2 + e * M, n,
                                                                               M, nullptr, 0);
    check_launch("bias");
    off += n;
  }
}

void experts_backward(Activation act, int local_experts, const int64_t* rows, int64_t model_dim,
                      int64_t hidden_dim, const float* in, const float* pre, const float* dout,
                      const ExpertWeights<float>& w, const ExpertGrads<float>& g, float* h,
                      float* dh, float* din, const Device& dev) {
  const int64_t M = model_dim, H = hidden_dim;
  cublasHandle_t bh = nullptr;
  int64_t off = 0;
  for (int e = 0; e < local_experts; ++e) {
    const int64_t n = rows[e];
    if (n <= 0) continue;
    if (bh == nullptr) bh = handle_on(dev);
    const float* a = in + off * M;
    const float* p = pre + off * H;
    const float* d = dout + off * M;
    float* hh = h + off * H;
    float* dhh = dh + off * H;
    const cudaStream_t st = as_stream(dev.stream);
    act_kernel<<<blocks_for(n * H), kThreads, 0, st>>>(p, hh, n * H, static_cast<int>(act));
    check_launch("act");
    gemm(bh, false, false, n, H, M, 1.0f, d, M, w.w2 + e * M * H, H, 0.0f, dhh, H);
    gemm(bh, true, false, M, H, n, 1.0f, d, M, hh, H, 1.0f, g.w2 + e * M * H, H);
    colsum_kernel<<<blocks_for(M), kThreads, 0, st>>>(g.b2 + e * M, d, n, M);
    check_launch("colsum");
    act_grad_kernel<<<blocks_for(n * H), kThreads, 0, st>>>(p, dhh, n * H, static_cast<int>(act));
    check_launch("act_grad");
    gemm(bh, true, false, H, M, n, 1.0f, dhh, H, a, M, 1.0f, g.w1 + e * H * M, M);
    colsum_kernel<<<blocks_for(H), kThreads, 0, st>>>(g.b1 + e * H, dhh, n, H);
    check_launch("colsum");
    if (din != nullptr) {
      gemm(bh, false, false, n, M, H, 1.0f, dhh, H, w.w1 + e * H * M, M, 0.0f, din + off * M, M);
    }
    off += n;
  }
}

}  // namespace loom::moe::cuda
