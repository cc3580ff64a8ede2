// int_cuda.hpp and xtc_cuda.hpp without CUDA: every call UNIMPLEMENTED (int_cuda.cu,
// binary.cu and ternary.cu are the real ones).
#include <loom/sdk/no_cuda.hpp>
#include <loom/sdk/tensor.hpp>

#include <string>

#include "float_stage.hpp"
#include "int_cuda.hpp"
#include "xtc_cuda.hpp"

namespace loom::quant::cuda {

namespace {
[[noreturn]] void refuse() { loom::sdk::throw_built_without_cuda("a CUDA tensor"); }
[[noreturn]] void refuse(int device) {
  loom::sdk::throw_built_without_cuda("the tensors are on " +
                                      loom::sdk::device_string(DLDevice{kDLCUDA, device}));
}
}  // namespace

int64_t quantize_int(const float*, const Groups&, const IntScheme&, int32_t, uint8_t*, float*,
                     uint8_t*, void*, int64_t*) {
  refuse();
}
void dequantize_int(const IntWeight&, float*, void*) { refuse(); }
int64_t quantize_rows_int8(const float*, int64_t, int64_t, int8_t*, float*, void*) { refuse(); }
void widen_to_int8(const IntWeight&, int8_t*, void*) { refuse(); }
void matmul_weight_only(const float*, int64_t, const IntWeight&, const float*, float*, void*) {
  refuse();
}
void int8_epilogue(const int32_t*, int64_t, int64_t, const float*, const float*, int64_t, int64_t,
                   const float*, bool, float*, void*) {
  refuse();
}
void int8_gemm_simple(const int8_t*, const int8_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                      int32_t*, void*) {
  refuse();
}

int64_t binary_quantize(const float*, const GroupedShape&, uint8_t*, float*, void*, int device,
                        void*, int64_t*) {
  refuse(device);
}
int64_t ternary_quantize(const float*, const GroupedShape&, float, uint8_t*, float*, void*,
                         int device, void*, int64_t*) {
  refuse(device);
}
void binary_dequantize(const uint8_t*, const float*, const GroupedShape&, float*, int device,
                       void*) {
  refuse(device);
}
int64_t ternary_dequantize(const uint8_t*, const float*, const GroupedShape&, float*, void*,
                           int device, void*) {
  refuse(device);
}
void binary_matmul(const float*, int64_t, const uint8_t*, const float*, const GroupedShape&,
                   const float*, float*, int device, void*) {
  refuse(device);
}
int64_t ternary_matmul(const float*, int64_t, const uint8_t*, const float*, const GroupedShape&,
                       const float*, float*, void*, int device, void*) {
  refuse(device);
}

void widen_floats(int device, const void*, f16::Storage, float*, int64_t, void*) { refuse(device); }
void narrow_floats(int device, const float*, f16::Storage, void*, int64_t, void*) {
  refuse(device);
}

}  // namespace loom::quant::cuda
