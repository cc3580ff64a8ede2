// The float side of a quantizer call (x, y, bias) in float32, bfloat16 or float16. The
// kernels compute in float32: a 16-bit tensor is widened into a float32 region of the call's
// workspace (exact), and a 16-bit output is computed there and rounded back, to nearest even
// (common/float16_io.hpp, the same bits on the host and on CUDA). layout sizes the regions
// (staging_bytes per tensor) after the scheme's own workspace, so a 16-bit call allocates
// nothing. A quantize of a 16-bit x therefore gives exactly the codes of its float32 widening.
#pragma once

#include <loom/sdk/tensor.hpp>

#include <cstdint>

#include "common/float16_io.hpp"

namespace loom::quant {

namespace f16 = loom::plugins::float16;

namespace cuda {
// float16_io's widen / narrow (add false) on device `device` (int_cuda.cu; the stub refuses).
void widen_floats(int device, const void* src, f16::Storage s, float* dst, int64_t n, void* stream);
void narrow_floats(int device, const float* src, f16::Storage s, void* dst, int64_t n,
                   void* stream);
}  // namespace cuda

// The storage of a float tensor the SDK has checked (float32, bfloat16 or float16).
inline f16::Storage storage_of(const DLDataType& t) {
  f16::Storage s = f16::Storage::kF32;
  (void)f16::storage_of(t, &s);
  return s;
}

inline bool is_16bit(const DLDataType& t) { return storage_of(t) != f16::Storage::kF32; }

inline void* data_of(const DLTensor& t) { return static_cast<char*>(t.data) + t.byte_offset; }

// Float32 staging carved from a workspace, region by region from `offset` (256-byte aligned).
class FloatStage {
 public:
  FloatStage(void* workspace, uint64_t offset)
      : next_(workspace == nullptr ? nullptr : static_cast<char*>(workspace) + offset) {}

  // t's values as float32: t's own data when float32, else a widened copy in the next region.
  // NULL for a NULL t.
  const float* in(const DLTensor* t, void* stream) {
    if (t == nullptr) return nullptr;
    const f16::Storage s = storage_of(t->dtype);
    const void* data = data_of(*t);
    if (s == f16::Storage::kF32) return static_cast<const float*>(data);
    const int64_t n = loom::sdk::numel(*t);
    float* dst = take(n);
    if (loom::sdk::is_cuda(t->device)) {
      cuda::widen_floats(t->device.device_id, data, s, dst, n, stream);
    } else {
      f16::widen(data, s, dst, n);
    }
    return dst;
  }

  // Where a kernel writes t's values: t's own data when float32, else the next region, which
  // `finish` then rounds into t.
  float* out(DLTensor* t) {
    if (storage_of(t->dtype) == f16::Storage::kF32) {
      return static_cast<float*>(data_of(*t));
    }
    return take(loom::sdk::numel(*t));
  }

  static void finish(const float* values, DLTensor* t, void* stream) {
    const f16::Storage s = storage_of(t->dtype);
    if (s == f16::Storage::kF32) return;
    void* data = data_of(*t);
    const int64_t n = loom::sdk::numel(*t);
    if (loom::sdk::is_cuda(t->device)) {
      cuda::narrow_floats(t->device.device_id, values, s, data, n, stream);
    } else {
      f16::narrow(values, s, data, n);
    }
  }

 private:
  float* take(int64_t n) {
    auto* p = reinterpret_cast<float*>(next_);
    next_ += f16::staging_bytes(n);
    return p;
  }
  char* next_;
};

}  // namespace loom::quant
