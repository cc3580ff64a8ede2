// zeroquant_cuda.hpp. The INT8 GEMM: cuBLASLt's int8 x int8 -> int32 matmul (compute type
// 32I, the TN layout every GPU runs: y^T [N, M] = W [N, K] . xq^T, column-major) per K group,
// each followed by the epilogue kernel; a shape cuBLASLt does not take (N, K, the group size
// or an address not a multiple of 4) runs the core's simple int8 kernel instead, with the
// same int32 result.
#include "zeroquant_cuda.hpp"

#include <loom/sdk/status.hpp>

#include <cuda_runtime_api.h>
#include <loom/sdk/cuda.hpp>

#include <map>
#include <string>

#include "int8_gemm.hpp"
#include "int_cuda.hpp"
#if LOOM_QUANT_HAVE_CUBLASLT
#include <cublasLt.h>
#endif

namespace loom::quant {

bool have_cuda() { return true; }

int64_t zq_cuda_quantize(int device, const float* x, const Groups& gs, const IntScheme& q,
                         uint8_t* packed, float* scales, uint8_t* zeros, void* stream,
                         int64_t* first_bad) {
  loom::sdk::CudaDeviceGuard guard(device);
  return cuda::quantize_int(x, gs, q, LOOM_QUANT_PACK_LSB_FIRST, packed, scales, zeros, stream,
                            first_bad);
}

void zq_cuda_read_float(int device, const float* p, float* out) {
  loom::sdk::CudaDeviceGuard guard(device);
  LOOM_CUDA_CHECK(cudaMemcpy(out, p, sizeof(float), cudaMemcpyDeviceToHost));
}

void zq_cuda_dequantize(int device, const IntWeight& w, float* x, void* stream) {
  loom::sdk::CudaDeviceGuard guard(device);
  cuda::dequantize_int(w, x, stream);
}

namespace {

#if LOOM_QUANT_HAVE_CUBLASLT
void lt_check(cublasStatus_t s, const char* call) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    throw loom::sdk::Error(LOOM_ERR_UNAVAILABLE, std::string("zeroquant matmul: ") + call +
                                                     " failed: " + cublasLtGetStatusName(s));
  }
}

// One cuBLASLt handle per device per thread, destroyed when the thread ends.
struct Handles {
  std::map<int, cublasLtHandle_t> by_device;
  ~Handles() {
    for (auto& [device, h] : by_device) (void)cublasLtDestroy(h);
  }
};

cublasLtHandle_t lt_handle(int device) {
  thread_local Handles handles;
  auto it = handles.by_device.find(device);
  if (it != handles.by_device.end()) return it->second;
  cublasLtHandle_t h = nullptr;
  lt_check(cublasLtCreate(&h), "cublasLtCreate");
  handles.by_device.emplace(device, h);
  return h;
}

// RAII for the descriptors of one matmul.
struct LtMatmul {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~LtMatmul() {
    if (pref != nullptr) cublasLtMatmulPreferenceDestroy(pref);
    if (c != nullptr) cublasLtMatrixLayoutDestroy(c);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (desc != nullptr) cublasLtMatmulDescDestroy(desc);
  }
};

// acc [m, n] row-major = xq[:, k0..k0+kg) . wq[:, k0..k0+kg)^T through cuBLASLt; false when it
// has no algorithm for the problem (nothing run).
bool lt_int8_gemm(int device, const int8_t* xq, const int8_t* wq, int64_t m, int64_t n, int64_t k,
                  int64_t k0, int64_t kg, int32_t* acc, cudaStream_t stream) {
  cublasLtHandle_t h = lt_handle(device);
  LtMatmul mm;
  lt_check(cublasLtMatmulDescCreate(&mm.desc, CUBLAS_COMPUTE_32I, CUDA_R_32I),
           "cublasLtMatmulDescCreate");
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  lt_check(cublasLtMatmulDescSetAttribute(mm.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta),
           "cublasLtMatmulDescSetAttribute");
  lt_check(cublasLtMatmulDescSetAttribute(mm.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb),
           "cublasLtMatmulDescSetAttribute");
  // A = W^T as stored ([kg, n] column-major, ld k), B = xq^T ([kg, m], ld k), D [n, m] ld n.
  lt_check(cublasLtMatrixLayoutCreate(&mm.a, CUDA_R_8I, static_cast<uint64_t>(kg),
                                      static_cast<uint64_t>(n), k),
           "cublasLtMatrixLayoutCreate");
  lt_check(cublasLtMatrixLayoutCreate(&mm.b, CUDA_R_8I, static_cast<uint64_t>(kg),
                                      static_cast<uint64_t>(m), k),
           "cublasLtMatrixLayoutCreate");
  lt_check(cublasLtMatrixLayoutCreate(&mm.c, CUDA_R_32I, static_cast<uint64_t>(n),
                                      static_cast<uint64_t>(m), n),
           "cublasLtMatrixLayoutCreate");
  lt_check(cublasLtMatmulPreferenceCreate(&mm.pref), "cublasLtMatmulPreferenceCreate");
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(h, mm.desc, mm.a, mm.b, mm.c, mm.c,
                                                           mm.pref, 1, &result, &found);
  if (hs != CUBLAS_STATUS_SUCCESS || found == 0) return false;
  const int32_t alpha = 1, beta = 0;
  lt_check(cublasLtMatmul(h, mm.desc, &alpha, wq + k0, mm.a, xq + k0, mm.b, &beta, acc, mm.c, acc,
                          mm.c, &result.algo, nullptr, 0, stream),
           "cublasLtMatmul");
  return true;
}
#endif

bool aligned4(const void* p) { return reinterpret_cast<uintptr_t>(p) % 4 == 0; }

}  // namespace

int64_t zq_cuda_matmul(int device, const float* x, int64_t m, const IntWeight& w, const float* bias,
                       float* y, bool int8_activations, void* workspace, void* stream) {
  loom::sdk::CudaDeviceGuard guard(device);
  if (!int8_activations) {
    cuda::matmul_weight_only(x, m, w, bias, y, stream);
    return -1;
  }
  const int64_t n = w.gs.rows;
  const int64_t k = w.gs.cols;
  const Int8Workspace ws = carve_int8_workspace(workspace, m, w);
  const int64_t bad = cuda::quantize_rows_int8(x, m, k, ws.xq, ws.sx, stream);
  if (bad >= 0) return bad;
  const int8_t* wq = reinterpret_cast<const int8_t*>(w.packed);
  if (ws.wide != nullptr) {
    cuda::widen_to_int8(w, ws.wide, stream);
    wq = ws.wide;
  }
  const int64_t groups = w.gs.groups_per_row;
  if (m == 0 || n == 0) return -1;
  if (groups == 0) {
    // K = 0: y is the bias (or 0).
    LOOM_CUDA_CHECK(cudaMemsetAsync(ws.acc, 0, static_cast<std::size_t>(m * n) * sizeof(int32_t),
                                    static_cast<cudaStream_t>(stream)));
    cuda::int8_epilogue(ws.acc, m, n, ws.sx, w.scales, 1, 0, bias, true, y, stream);
    return -1;
  }
  const int64_t group = w.gs.group;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t k0 = g * group;
    const int64_t kg = std::min(k, k0 + group) - k0;
    bool done = false;
#if LOOM_QUANT_HAVE_CUBLASLT
    if (n % 4 == 0 && k % 4 == 0 && kg % 4 == 0 && k0 % 4 == 0 && aligned4(wq) && aligned4(ws.xq)) {
      done = lt_int8_gemm(device, ws.xq, wq, m, n, k, k0, kg, ws.acc,
                          static_cast<cudaStream_t>(stream));
    }
#else
    (void)aligned4;
#endif
    if (!done) cuda::int8_gemm_simple(ws.xq, wq, m, n, k, k0, kg, ws.acc, stream);
    cuda::int8_epilogue(ws.acc, m, n, ws.sx, w.scales, groups, g, bias, g == 0, y, stream);
  }
  return -1;
}

}  // namespace loom::quant
