// The CPU finite check of the gradients (kernels/finite.hpp), compiled for every SIMD
// target Highway knows and dispatched at run time, as kernels/cpu.cpp is.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/finite.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <atomic>
#include <cmath>
#include <cstdint>

#include "kernels/finite.hpp"

HWY_BEFORE_NAMESPACE();
namespace loom::optim {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;

// fp16 to fp32 with integer operations, exact for every input: Highway's PromoteTo from
// float16 is emulated on targets without F16C (SSE4) and does not keep NaN and Inf there.
HWY_INLINE hn::Vec<DF> HalfToFloat(DF d, const uint16_t* h) {
  const hn::Rebind<uint16_t, DF> d16;
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const auto w = hn::PromoteTo(du, hn::LoadU(d16, h));
  const auto sign = hn::ShiftLeft<16>(hn::And(w, hn::Set(du, 0x8000u)));
  const auto exp = hn::And(w, hn::Set(du, 0x7C00u));
  const auto body = hn::ShiftLeft<13>(hn::And(w, hn::Set(du, 0x7FFFu)));
  // Normal: the exponent rebiased by 127 - 15 = 112; Inf and NaN: the all-ones exponent.
  const auto normal = hn::Add(body, hn::Set(du, 0x38000000u));
  const auto special = hn::Or(body, hn::Set(du, 0x7F800000u));
  // Zero and subnormal: mantissa * 2^-24, exact in fp32.
  const auto man = hn::BitCast(di, hn::And(w, hn::Set(du, 0x3FFu)));
  const auto sub = hn::BitCast(du, hn::Mul(hn::ConvertTo(d, man), hn::Set(d, 1.0f / 16777216.0f)));
  auto bits = hn::IfThenElse(hn::Eq(exp, hn::Set(du, 0x7C00u)), special, normal);
  bits = hn::IfThenElse(hn::Eq(exp, hn::Zero(du)), sub, bits);
  return hn::BitCast(d, hn::Or(bits, sign));
}

template <DType G>
HWY_INLINE hn::Vec<DF> LoadGrad(DF d, const void* g, std::size_t i) {
  if constexpr (G == DType::kF32) {
    return hn::LoadU(d, static_cast<const float*>(g) + i);
  } else if constexpr (G == DType::kBF16) {
    const hn::Rebind<uint16_t, DF> d16;
    const hn::RebindToUnsigned<DF> du;
    const auto w = hn::PromoteTo(du, hn::LoadU(d16, static_cast<const uint16_t*>(g) + i));
    return hn::BitCast(d, hn::ShiftLeft<16>(w));
  } else {
    return HalfToFloat(d, static_cast<const uint16_t*>(g) + i);
  }
}

template <DType G>
HWY_INLINE float LoadGrad1(const void* g, std::size_t i) {
  if constexpr (G == DType::kF32) {
    return static_cast<const float*>(g)[i];
  } else if constexpr (G == DType::kBF16) {
    return bf16_to_f32(static_cast<const uint16_t*>(g)[i]);
  } else {
    return f16_to_f32(static_cast<const uint16_t*>(g)[i]);
  }
}

// True when every g[i] * inv_scale in [begin, end) is finite.
template <DType G>
bool RangeFiniteT(const void* g, std::size_t begin, std::size_t end, float inv_scale) {
  const DF d;
  const std::size_t N = hn::Lanes(d);
  const auto s = hn::Set(d, inv_scale);
  auto bad = hn::FirstN(d, 0);  // no lane set
  std::size_t i = begin;
  for (; i + N <= end; i += N) {
    bad = hn::Or(bad, hn::Not(hn::IsFinite(hn::Mul(LoadGrad<G>(d, g, i), s))));
  }
  bool ok = hn::AllFalse(d, bad);
  for (; i < end; ++i) ok = ok && std::isfinite(LoadGrad1<G>(g, i) * inv_scale);
  return ok;
}

bool RangeFinite(const FiniteInput* t, std::size_t begin, std::size_t end, float inv_scale) {
  switch (t->gtype) {
    case DType::kF32:
      return RangeFiniteT<DType::kF32>(t->g, begin, end, inv_scale);
    case DType::kBF16:
      return RangeFiniteT<DType::kBF16>(t->g, begin, end, inv_scale);
    case DType::kF16:
      return RangeFiniteT<DType::kF16>(t->g, begin, end, inv_scale);
  }
  return false;
}

}  // namespace HWY_NAMESPACE
}  // namespace loom::optim
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "common/parallel_for.hpp"

namespace loom::optim {

HWY_EXPORT(RangeFinite);

bool all_finite_cpu(const FiniteInput& t, float inv_scale) {
  std::atomic<bool> ok{true};
  loom::plugins::parallel_for(t.n, std::size_t{1} << 16, [&](std::size_t b, std::size_t e) {
    if (!ok.load(std::memory_order_relaxed)) return;
    if (!HWY_DYNAMIC_DISPATCH(RangeFinite)(&t, b, e, inv_scale)) {
      ok.store(false, std::memory_order_relaxed);
    }
  });
  return ok.load();
}

}  // namespace loom::optim
#endif  // HWY_ONCE
