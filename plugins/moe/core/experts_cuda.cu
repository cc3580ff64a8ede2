// The experts on CUDA: each GEMM of the expert MLPs is one cuBLAS grouped call over every
// expert segment (cublasGemmGroupedBatchedEx, one problem per expert with rows; row-major
// operands passed as their column-major transposes), and bias, activation and column sums
// are one kernel each over all segments (sums in row order, so the bias gradients are
// deterministic). The pointer arrays and segment offsets go to the device in one copy per
// call, into the instance's scratch (Blas::scratch).
#include <cublas_v2.h>

#include <algorithm>
#include <string>
#include <vector>

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

// One product per expert segment: row-major C_e[m_e, n] = alpha op(A_e) op(B_e) + beta C_e
// with inner size k_e; n, the leading dimensions, alpha and beta are shared.
struct Grouped {
  Grouped(bool op_a, bool op_b, int64_t cols, int64_t ld_a, int64_t ld_b, int64_t ld_c,
          float add = 0.0f)
      : ta(op_a), tb(op_b), n(cols), lda(ld_a), ldb(ld_b), ldc(ld_c), beta(add) {}
  bool ta, tb;
  int64_t n, lda, ldb, ldc;
  float alpha = 1.0f, beta;
  std::vector<int> m, k;
  std::vector<const void*> a, b;
  std::vector<void*> c;
  void add(int64_t rows, int64_t inner, const float* pa, const float* pb, float* pc) {
    m.push_back(blas_int(rows));
    k.push_back(blas_int(inner));
    a.push_back(pa);
    b.push_back(pb);
    c.push_back(pc);
  }
};

// The pointer arrays of `g` copied to `dev_ptrs` (3 * count entries), then one grouped call.
// Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: cuBLAS gets B as its A.
void run_grouped(cublasHandle_t h, const Grouped& g, const void** dev_ptrs, cudaStream_t st) {
  const size_t count = g.m.size();
  if (count == 0) return;
  const std::vector<cublasOperation_t> opa(count, g.tb ? CUBLAS_OP_T : CUBLAS_OP_N),
      opb(count, g.ta ? CUBLAS_OP_T : CUBLAS_OP_N);
  const std::vector<int> n(count, blas_int(g.n)), lda(count, blas_int(g.ldb)),
      ldb(count, blas_int(g.lda)), ldc(count, blas_int(g.ldc)), ones(count, 1);
  const std::vector<float> alpha(count, g.alpha), beta(count, g.beta);
#if defined(CUBLAS_VERSION) && CUBLAS_VERSION < 120500
  // cuBLAS before 12.5 has no grouped GEMM: the same products, one call each.
  (void)dev_ptrs, (void)st, (void)ones;
  for (size_t i = 0; i < count; ++i) {
    blas_check(
        cublasSgemm(h, opa[i], opb[i], n[i], g.m[i], g.k[i], &alpha[i],
                    static_cast<const float*>(g.b[i]), lda[i], static_cast<const float*>(g.a[i]),
                    ldb[i], &beta[i], static_cast<float*>(g.c[i]), ldc[i]),
        "cublasSgemm");
  }
#else
  std::vector<const void*> host;
  host.reserve(3 * count);
  host.insert(host.end(), g.b.begin(), g.b.end());
  host.insert(host.end(), g.a.begin(), g.a.end());
  host.insert(host.end(), g.c.begin(), g.c.end());
  LOOM_MOE_CUDA(cudaMemcpyAsync(dev_ptrs, host.data(), host.size() * sizeof(void*),
                                cudaMemcpyHostToDevice, st));
  blas_check(cublasGemmGroupedBatchedEx(
                 h, opa.data(), opb.data(), n.data(), g.m.data(), g.k.data(), alpha.data(),
                 dev_ptrs, CUDA_R_32F, lda.data(), dev_ptrs + count, CUDA_R_32F, ldb.data(),
                 beta.data(), const_cast<void* const*>(dev_ptrs + 2 * count), CUDA_R_32F,
                 ldc.data(), static_cast<int>(count), ones.data(), CUBLAS_COMPUTE_32F),
             "cublasGemmGroupedBatchedEx");
#endif
}

// The segments of the experts' rows on the device: offsets[e] .. offsets[e + 1] are expert
// e's (local_experts + 1 entries), and room for the pointer arrays of one grouped call.
struct Segments {
  const int64_t* offsets = nullptr;
  const void** ptrs = nullptr;
  int64_t total = 0;  // rows of all experts
};

// Bytes of the segments' offsets (256-byte aligned), and of the scratch with the pointers.
size_t offsets_bytes(int local_experts) {
  return ((static_cast<size_t>(local_experts) + 1) * sizeof(int64_t) + 255) / 256 * 256;
}
size_t segments_bytes(int local_experts) {
  return offsets_bytes(local_experts) + 3 * static_cast<size_t>(local_experts) * sizeof(void*);
}

Segments upload_segments(int local_experts, const int64_t* rows, const Device& dev) {
  std::vector<int64_t> off(static_cast<size_t>(local_experts) + 1, 0);
  for (int e = 0; e < local_experts; ++e) off[e + 1] = off[e] + std::max<int64_t>(rows[e], 0);
  const size_t off_bytes = offsets_bytes(local_experts);
  char* base = static_cast<char*>(dev.blas->scratch(dev.device, segments_bytes(local_experts)));
  LOOM_MOE_CUDA(cudaMemcpyAsync(base, off.data(), off.size() * sizeof(int64_t),
                                cudaMemcpyHostToDevice, as_stream(dev.stream)));
  Segments s;
  s.offsets = reinterpret_cast<const int64_t*>(base);
  s.ptrs = reinterpret_cast<const void**>(base + off_bytes);
  s.total = off.back();
  return s;
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

// The expert of row r: the segment whose [offsets[e], offsets[e + 1]) holds it.
__device__ int segment_of(const int64_t* offsets, int experts, int64_t r) {
  int lo = 0, hi = experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= r) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// y[r, c] += b[e(r), c] over all segments; with h: h = act(y)
__global__ void bias_act_kernel(float* y, const float* b, const int64_t* offsets, int experts,
                                int64_t n, int64_t width, float* h, int act) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n * width;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / width;
    y[i] += b[segment_of(offsets, experts, r) * width + i % width];
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

// g[e, c] += sum over expert e's rows r (ascending) of d[r, c], for every segment e
__global__ void colsum_kernel(float* g, const float* d, const int64_t* offsets, int experts,
                              int64_t width) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < experts * width;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = i / width, c = i % width;
    float acc = g[i];
    for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) acc += d[r * width + c];
    g[i] = acc;
  }
}

cublasHandle_t handle_on(const Device& dev) {
  auto h = static_cast<cublasHandle_t>(dev.blas->handle(dev.device));
  blas_check(cublasSetStream(h, as_stream(dev.stream)), "cublasSetStream");
  return h;
}

}  // namespace

Blas::~Blas() {
  if (handle_ != nullptr || scratch_ != nullptr) {
    int previous = 0;
    if (cudaGetDevice(&previous) == cudaSuccess) {
      (void)cudaSetDevice(device_);
      if (handle_ != nullptr) (void)cublasDestroy(static_cast<cublasHandle_t>(handle_));
      if (scratch_ != nullptr) (void)cudaFree(scratch_);
      (void)cudaSetDevice(previous);
    }
  }
}

void* Blas::scratch(int device, size_t bytes) {
  (void)handle(device);  // the same one-device rule
  if (bytes > scratch_bytes_) {
    // cudaFree waits for the device, so no enqueued work still reads the old block.
    if (scratch_ != nullptr) LOOM_MOE_CUDA(cudaFree(scratch_));
    scratch_ = nullptr;
    scratch_bytes_ = 0;
    const size_t grown = std::max<size_t>(bytes, 4096);
    LOOM_MOE_CUDA(cudaMalloc(&scratch_, grown));
    scratch_bytes_ = grown;
  }
  return scratch_;
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

void reserve_experts(const Device& dev, int local_experts) {
  const loom::sdk::CudaDeviceGuard guard(dev.device);
  (void)dev.blas->scratch(dev.device, segments_bytes(std::max(local_experts, 1)));
}

void experts_forward(Activation act, int local_experts, const int64_t* rows, int64_t model_dim,
                     int64_t hidden_dim, const float* in, const ExpertWeights<float>& w, float* pre,
                     float* h, float* out, const Device& dev) {
  const int64_t M = model_dim, H = hidden_dim;
  const Segments seg = upload_segments(local_experts, rows, dev);
  if (seg.total == 0) return;
  const cudaStream_t st = as_stream(dev.stream);
  cublasHandle_t bh = handle_on(dev);
  Grouped g1{false, true, H, M, M, H};  // pre = in . w1^T; then h = act(pre + b1)
  Grouped g2{false, true, M, H, H, M};  // out = h . w2^T; then out += b2
  int64_t off = 0;
  for (int e = 0; e < local_experts; ++e) {
    const int64_t n = rows[e];
    if (n <= 0) continue;
    g1.add(n, M, in + off * M, w.w1 + e * H * M, pre + off * H);
    g2.add(n, H, h + off * H, w.w2 + e * M * H, out + off * M);
    off += n;
  }
  run_grouped(bh, g1, seg.ptrs, st);
  bias_act_kernel<<<blocks_for(seg.total * H), kThreads, 0, st>>>(
      pre, w.b1, seg.offsets, local_experts, seg.total, H, h, static_cast<int>(act));
  check_launch("bias_act");
  run_grouped(bh, g2, seg.ptrs, st);
  bias_act_kernel<<<blocks_for(seg.total * M), kThreads, 0, st>>>(
      out, w.b2, seg.offsets, local_experts, seg.total, M, nullptr, 0);
  check_launch("bias");
}

void experts_backward(Activation act, int local_experts, const int64_t* rows, int64_t model_dim,
                      int64_t hidden_dim, const float* in, const float* pre, const float* dout,
                      const ExpertWeights<float>& w, const ExpertGrads<float>& g, float* h,
                      float* dh, float* din, const Device& dev) {
  const int64_t M = model_dim, H = hidden_dim;
  const Segments seg = upload_segments(local_experts, rows, dev);
  if (seg.total == 0) return;
  const cudaStream_t st = as_stream(dev.stream);
  cublasHandle_t bh = handle_on(dev);
  Grouped dh_of{false, false, H, M, H, H};     // dh = dout . w2
  Grouped gw2{true, false, H, M, H, H, 1.0f};  // g.w2 += dout^T . h
  Grouped gw1{true, false, M, H, M, M, 1.0f};  // g.w1 += dh^T . in
  Grouped din_of{false, false, M, H, M, M};    // din = dh . w1
  int64_t off = 0;
  for (int e = 0; e < local_experts; ++e) {
    const int64_t n = rows[e];
    if (n <= 0) continue;
    dh_of.add(n, M, dout + off * M, w.w2 + e * M * H, dh + off * H);
    gw2.add(M, n, dout + off * M, h + off * H, g.w2 + e * M * H);
    gw1.add(H, n, dh + off * H, in + off * M, g.w1 + e * H * M);
    if (din != nullptr) din_of.add(n, H, dh + off * H, w.w1 + e * H * M, din + off * M);
    off += n;
  }
  act_kernel<<<blocks_for(seg.total * H), kThreads, 0, st>>>(pre, h, seg.total * H,
                                                             static_cast<int>(act));
  check_launch("act");
  run_grouped(bh, dh_of, seg.ptrs, st);
  run_grouped(bh, gw2, seg.ptrs, st);
  colsum_kernel<<<blocks_for(local_experts * M), kThreads, 0, st>>>(g.b2, dout, seg.offsets,
                                                                    local_experts, M);
  check_launch("colsum");
  act_grad_kernel<<<blocks_for(seg.total * H), kThreads, 0, st>>>(pre, dh, seg.total * H,
                                                                  static_cast<int>(act));
  check_launch("act_grad");
  run_grouped(bh, gw1, seg.ptrs, st);
  colsum_kernel<<<blocks_for(local_experts * H), kThreads, 0, st>>>(g.b1, dh, seg.offsets,
                                                                    local_experts, H);
  check_launch("colsum");
  run_grouped(bh, din_of, seg.ptrs, st);
}

}  // namespace loom::moe::cuda
