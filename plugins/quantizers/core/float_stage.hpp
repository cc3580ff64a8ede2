// The quantizers' float side (x, y, bias) in float32, bfloat16 or float16: common/
// float16_stage.hpp over this core's CUDA conversions (int_cuda.cu, quant_cuda_stub.cpp).
// layout sizes the float32 regions (staging_bytes per tensor) after the scheme's own
// workspace, so a 16-bit call allocates nothing; a quantize of a 16-bit x gives exactly the
// codes of its float32 widening, and 16-bit outputs are the float32 results rounded to
// nearest even.
#pragma once

#include <loom/sdk/tensor.hpp>

#include <cstdint>

#include "common/float16_stage.hpp"

namespace loom::quant {

namespace f16 = loom::plugins::float16;

namespace cuda {
// float16_io's widen / narrow on device `device` (int_cuda.cu; the stub refuses).
void widen_floats(int device, const void* src, f16::Storage s, float* dst, int64_t n, void* stream);
void narrow_floats(int device, const float* src, f16::Storage s, void* dst, int64_t n,
                   void* stream);
}  // namespace cuda

using f16::is_16bit;

// A FloatStage over this core's CUDA conversions.
inline f16::FloatStage float_stage(void* workspace, uint64_t offset) {
  return f16::FloatStage(workspace, offset,
                         f16::DeviceConvert{cuda::widen_floats, cuda::narrow_floats});
}

}  // namespace loom::quant
