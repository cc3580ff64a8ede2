// zeroquant_cuda.hpp.
#include "zeroquant_cuda.hpp"

#include <loom/sdk/status.hpp>

#if LOOM_QUANT_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <loom/sdk/cuda.hpp>

#include "int_cuda.hpp"
#endif

namespace loom::quant {

#if LOOM_QUANT_HAVE_CUDA

namespace {
constexpr uint64_t align64(uint64_t v) { return (v + 63) / 64 * 64; }
}  // namespace

bool cuda_built() { return true; }

int64_t zq_cuda_quantize(int device, const float* x, const Groups& gs, const IntScheme& q,
                         uint8_t* packed, float* scales, uint8_t* zeros, void* stream) {
  loom::sdk::CudaDeviceGuard guard(device);
  return cuda::quantize_int(x, gs, q, LOOM_QUANT_PACK_LSB_FIRST, packed, scales, zeros, stream);
}

void zq_cuda_read_float(int device, const float* p, float* out) {
  loom::sdk::CudaDeviceGuard guard(device);
  LOOM_CUDA_CHECK(cudaMemcpy(out, p, sizeof(float), cudaMemcpyDeviceToHost));
}

void zq_cuda_dequantize(int device, const IntWeight& w, float* x, void* stream) {
  loom::sdk::CudaDeviceGuard guard(device);
  cuda::dequantize_int(w, x, stream);
}

int64_t zq_cuda_matmul(int device, const float* x, int64_t m, const IntWeight& w, const float* bias,
                       float* y, bool int8_activations, void* workspace, uint64_t acc_offset,
                       void* stream) {
  loom::sdk::CudaDeviceGuard guard(device);
  if (!int8_activations) {
    cuda::matmul_weight_only(x, m, w, bias, y, stream);
    return -1;
  }
  (void)workspace;
  (void)acc_offset;
  throw loom::sdk::Error(LOOM_ERR_UNIMPLEMENTED,
                         "zeroquant matmul: the CUDA INT8 GEMM (activation_bits 8) is not in "
                         "this build yet; use activation_bits 0 on CUDA");
}

#else

bool cuda_built() { return false; }

namespace {
[[noreturn]] void no_cuda() {
  throw loom::sdk::Error(LOOM_ERR_UNIMPLEMENTED, "zeroquant: this build has no CUDA");
}
}  // namespace

int64_t zq_cuda_quantize(int, const float*, const Groups&, const IntScheme&, uint8_t*, float*,
                         uint8_t*, void*) {
  no_cuda();
}
void zq_cuda_read_float(int, const float*, float*) { no_cuda(); }
void zq_cuda_dequantize(int, const IntWeight&, float*, void*) { no_cuda(); }
int64_t zq_cuda_matmul(int, const float*, int64_t, const IntWeight&, const float*, float*, bool,
                       void*, uint64_t, void*) {
  no_cuda();
}

#endif

}  // namespace loom::quant
