// zeroquant_cuda.hpp without CUDA: have_cuda() is false and every call UNIMPLEMENTED
// (zeroquant_cuda.cpp is the real one).
#include <loom/sdk/no_cuda.hpp>

#include "zeroquant_cuda.hpp"

namespace loom::quant {

bool have_cuda() { return false; }

namespace {
[[noreturn]] void no_cuda() { loom::sdk::throw_built_without_cuda("zeroquant: a CUDA tensor"); }
}  // namespace

int64_t zq_cuda_quantize(int, const float*, const Groups&, const IntScheme&, uint8_t*, float*,
                         uint8_t*, void*, int64_t*) {
  no_cuda();
}
void zq_cuda_read_float(int, const float*, float*) { no_cuda(); }
void zq_cuda_dequantize(int, const IntWeight&, float*, void*) { no_cuda(); }
int64_t zq_cuda_matmul(int, const float*, int64_t, const IntWeight&, const float*, float*, bool,
                       void*, void*) {
  no_cuda();
}

}  // namespace loom::quant
