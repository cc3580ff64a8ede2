// 16-bit weights widened to float32 a span at a time, for the CPU quantize kernels that take
// bf16 or float16 without a staging copy (int_cpu.cpp, binary.cpp, ternary.cpp). Compiled
// once per SIMD target like the kernels that include it.

// Per-target include guard (Highway's convention for -inl headers).
#if defined(LOOM_QUANT_WIDEN_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef LOOM_QUANT_WIDEN_INL_H_
#undef LOOM_QUANT_WIDEN_INL_H_
#else
#define LOOM_QUANT_WIDEN_INL_H_
#endif

#include <hwy/cache_control.h>
#include <hwy/highway.h>

#include <cstdint>

#include "common/half.hpp"

HWY_BEFORE_NAMESPACE();
namespace loom::quant {
namespace HWY_NAMESPACE {

// src[0, n) widened to float32 in out, exactly: bf16 is float32's top half (vectors);
// float16 through common/half.hpp's conversion (one element at a time: the rare case).
HWY_INLINE void WidenRow(const uint16_t* src, bool bf16, int64_t n, float* out) {
  namespace hn = hwy::HWY_NAMESPACE;
  if (!bf16) {
    for (int64_t i = 0; i < n; ++i) out[i] = loom::plugins::half::f16_to_f32(src[i]);
    return;
  }
  const hn::ScalableTag<float> d;
  const hn::RebindToUnsigned<decltype(d)> du;
  const hn::Rebind<uint16_t, decltype(d)> d16;
  const auto N = static_cast<int64_t>(hn::Lanes(d));
  int64_t i = 0;
  for (; i + N <= n; i += N) {
    const auto w = hn::ShiftLeft<16>(hn::PromoteTo(du, hn::LoadU(d16, src + i)));
    hn::StoreU(hn::BitCast(d, w), d, out + i);
  }
  for (; i < n; ++i) out[i] = loom::plugins::half::bf16_to_f32(src[i]);
}

// Prefetches the 16-bit elements [0, n) of src (the span after the one being encoded).
HWY_INLINE void PrefetchRow16(const uint16_t* src, int64_t n) {
  const auto* p = reinterpret_cast<const char*>(src);
  for (int64_t b = 0; b < n * 2; b += 64) hwy::Prefetch(p + b);
}

}  // namespace HWY_NAMESPACE
}  // namespace loom::quant
HWY_AFTER_NAMESPACE();

#endif  // LOOM_QUANT_WIDEN_INL_H_
