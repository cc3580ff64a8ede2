// A call's float tensors seen as float32 (float16_io.hpp): float32 tensors as they are, 16-bit
// ones through float32 regions carved from the call's workspace, widened on the way in and
// rounded back on the way out. The device conversions are the core's (its CUDA interface, or
// its stub that refuses), passed in as DeviceConvert.
#pragma once

#include <loom/sdk/tensor.hpp>

#include <cstdint>

#include "float16_io.hpp"

namespace loom::plugins::float16 {

// A core's CUDA widen / narrow (the device made current, work enqueued on `stream`).
struct DeviceConvert {
  void (*widen)(int device, const void* src, Storage s, float* dst, int64_t n, void* stream);
  void (*narrow)(int device, const float* src, Storage s, void* dst, int64_t n, void* stream);
};

// The storage of a float tensor the SDK has checked (float32, bfloat16 or float16).
inline Storage storage_or_f32(const DLDataType& t) {
  Storage s = Storage::kF32;
  (void)storage_of(t, &s);
  return s;
}

inline bool is_16bit(const DLDataType& t) { return storage_or_f32(t) != Storage::kF32; }

inline void* data_of(const DLTensor& t) { return static_cast<char*>(t.data) + t.byte_offset; }

// Float32 staging carved from a workspace, region by region from `offset` (256-byte aligned).
class FloatStage {
 public:
  FloatStage(void* workspace, uint64_t offset, DeviceConvert cuda)
      : next_(workspace == nullptr ? nullptr : static_cast<char*>(workspace) + offset),
        cuda_(cuda) {}

  // t's values as float32: t's own data when float32, else a widened copy in the next region.
  // NULL for a NULL t.
  // With n >= 0, only t's first n elements are staged (a tensor larger than the call uses).
  const float* in(const DLTensor* t, void* stream, int64_t n = -1) {
    if (t == nullptr) return nullptr;
    const Storage s = storage_or_f32(t->dtype);
    const void* data = data_of(*t);
    if (s == Storage::kF32) return static_cast<const float*>(data);
    if (n < 0) n = loom::sdk::numel(*t);
    float* dst = take(n);
    if (loom::sdk::is_cuda(t->device)) {
      cuda_.widen(t->device.device_id, data, s, dst, n, stream);
    } else {
      widen(data, s, dst, n);
    }
    return dst;
  }

  // Where a kernel writes t's values: t's own data when float32, else the next region, which
  // `finish` then rounds into t.
  float* out(DLTensor* t, int64_t n = -1) {
    if (storage_or_f32(t->dtype) == Storage::kF32) {
      return static_cast<float*>(data_of(*t));
    }
    return take(n < 0 ? loom::sdk::numel(*t) : n);
  }

  // t's values as a float32 buffer a kernel adds into (a gradient): t's own data when float32,
  // else a widened copy, which `finish` rounds back (one rounding per call).
  float* inout(const DLTensor* t, void* stream) { return const_cast<float*>(in(t, stream)); }

  void finish(const float* values, const DLTensor* t, void* stream, int64_t n = -1) {
    const Storage s = storage_or_f32(t->dtype);
    if (s == Storage::kF32) return;
    void* data = data_of(*t);
    if (n < 0) n = loom::sdk::numel(*t);
    if (loom::sdk::is_cuda(t->device)) {
      cuda_.narrow(t->device.device_id, values, s, data, n, stream);
    } else {
      narrow(values, s, data, n);
    }
  }

 private:
  float* take(int64_t n) {
    auto* p = reinterpret_cast<float*>(next_);
    next_ += staging_bytes(n);
    return p;
  }
  char* next_;
  DeviceConvert cuda_;
};

}  // namespace loom::plugins::float16
