// The float elementwise spans of layers.hpp (GELU and the softmax exps), compiled for every
// SIMD target Highway knows and dispatched at run time to the best one this CPU has, so one
// binary runs on any x86-64 CPU and still uses the machine's full vector width.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "layers.hpp"

HWY_BEFORE_NAMESPACE();
namespace loom::trainer::layers {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

// fast_exp of layers.hpp, lane-wise: the same clamp, range reduction and polynomial, so
// every target agrees with the scalar function to rounding.
HWY_INLINE VF Exp(DF d, VF in) {
  const hn::RebindToSigned<DF> di;
  const VF x = hn::Min(hn::Max(in, hn::Set(d, -87.0f)), hn::Set(d, 88.0f));
  const VF t = hn::Mul(x, hn::Set(d, 1.44269504088896341f));
  // round(t) as the scalar code does it: truncate t + 128.5 (positive), subtract 128.
  const auto k = hn::Sub(hn::ConvertTo(di, hn::Add(t, hn::Set(d, 128.5f))), hn::Set(di, 128));
  const VF kf = hn::ConvertTo(d, k);
  const VF r = hn::Add(hn::Sub(x, hn::Mul(kf, hn::Set(d, 0.693359375f))),
                       hn::Mul(kf, hn::Set(d, 2.12194440e-4f)));
  const VF z = hn::Mul(r, r);
  VF p = hn::Set(d, 1.9875691500e-4f);
  p = hn::Add(hn::Mul(p, r), hn::Set(d, 1.3981999507e-3f));
  p = hn::Add(hn::Mul(p, r), hn::Set(d, 8.3334519073e-3f));
  p = hn::Add(hn::Mul(p, r), hn::Set(d, 4.1665795894e-2f));
  p = hn::Add(hn::Mul(p, r), hn::Set(d, 1.6666665459e-1f));
  p = hn::Add(hn::Mul(p, r), hn::Set(d, 5.0000001201e-1f));
  p = hn::Add(hn::Add(hn::Mul(p, z), r), hn::Set(d, 1.0f));
  const VF scale = hn::BitCast(d, hn::ShiftLeft<23>(hn::Add(k, hn::Set(di, 127))));
  // x86's min/max return their second operand for a NaN: keep NaN a NaN, as the scalar
  // code does, so a diverging loss shows instead of turning into exp(-87).
  return hn::IfThenElse(hn::IsNaN(in), in, hn::Mul(p, scale));
}

HWY_INLINE VF Tanh(DF d, VF x) {
  const VF one = hn::Set(d, 1.0f);
  const VF two = hn::Set(d, 2.0f);
  return hn::Sub(one, hn::Div(two, hn::Add(Exp(d, hn::Mul(two, x)), one)));
}

// u = sqrt(2/pi) * (x + 0.044715 x^3)
HWY_INLINE VF GeluArg(DF d, VF x) {
  const VF x3 = hn::Mul(hn::Mul(x, x), x);
  return hn::Mul(hn::Set(d, kGeluScale<float>), hn::Add(x, hn::Mul(hn::Set(d, 0.044715f), x3)));
}

void GeluForward(float* out, const float* inp, size_t n) {
  const DF d;
  const size_t lanes = hn::Lanes(d);
  size_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    const VF x = hn::LoadU(d, inp + i);
    const VF th = Tanh(d, GeluArg(d, x));
    hn::StoreU(hn::Mul(hn::Mul(hn::Set(d, 0.5f), x), hn::Add(hn::Set(d, 1.0f), th)), d, out + i);
  }
  gelu_forward_span<float>(out + i, inp + i, n - i);
}

void GeluBackward(float* dinp, const float* inp, const float* dout, size_t n) {
  const DF d;
  const size_t lanes = hn::Lanes(d);
  const VF half = hn::Set(d, 0.5f);
  const VF one = hn::Set(d, 1.0f);
  size_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    const VF x = hn::LoadU(d, inp + i);
    const VF th = Tanh(d, GeluArg(d, x));
    const VF du = hn::Mul(hn::Set(d, kGeluScale<float>),
                          hn::Add(one, hn::Mul(hn::Mul(hn::Set(d, 3.0f * 0.044715f), x), x)));
    const VF g = hn::Add(hn::Mul(half, hn::Add(one, th)),
                         hn::Mul(hn::Mul(hn::Mul(half, x), hn::Sub(one, hn::Mul(th, th))), du));
    const VF acc = hn::Add(hn::LoadU(d, dinp + i), hn::Mul(g, hn::LoadU(d, dout + i)));
    hn::StoreU(acc, d, dinp + i);
  }
  gelu_backward_span<float>(dinp + i, inp + i, dout + i, n - i);
}

float ExpSum(float* x, size_t n, float shift) {
  const DF d;
  const size_t lanes = hn::Lanes(d);
  const VF s = hn::Set(d, shift);
  VF acc0 = hn::Zero(d);
  VF acc1 = hn::Zero(d);
  size_t i = 0;
  for (; i + 2 * lanes <= n; i += 2 * lanes) {
    const VF e0 = Exp(d, hn::Sub(hn::LoadU(d, x + i), s));
    const VF e1 = Exp(d, hn::Sub(hn::LoadU(d, x + i + lanes), s));
    hn::StoreU(e0, d, x + i);
    hn::StoreU(e1, d, x + i + lanes);
    acc0 = hn::Add(acc0, e0);
    acc1 = hn::Add(acc1, e1);
  }
  float sum = hn::GetLane(hn::SumOfLanes(d, hn::Add(acc0, acc1)));
  for (; i < n; ++i) {
    x[i] = fast_exp(x[i] - shift);
    sum += x[i];
  }
  return sum;
}

const char* TargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace loom::trainer::layers
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace loom::trainer::layers {

HWY_EXPORT(GeluForward);
HWY_EXPORT(GeluBackward);
HWY_EXPORT(ExpSum);
HWY_EXPORT(TargetName);

void gelu_forward_span(float* out, const float* inp, size_t n) {
  HWY_DYNAMIC_DISPATCH(GeluForward)(out, inp, n);
}

void gelu_backward_span(float* dinp, const float* inp, const float* dout, size_t n) {
  HWY_DYNAMIC_DISPATCH(GeluBackward)(dinp, inp, dout, n);
}

float exp_sum_span(float* x, size_t n, float shift) {
  return HWY_DYNAMIC_DISPATCH(ExpSum)(x, n, shift);
}

const char* kernel_target() { return HWY_DYNAMIC_DISPATCH(TargetName)(); }

std::string cap_simd_from_env() {
  const char* v = std::getenv("LOOM_SIMD_MAX");
  if (v == nullptr || *v == '\0') return "";
  struct Cap {
    const char* name;
    int64_t target;
  };
  static constexpr Cap kCaps[] = {{"avx512", HWY_AVX3},
                                  {"avx2", HWY_AVX2},
                                  {"sse4", HWY_SSE4},
                                  {"ssse3", HWY_SSSE3},
                                  {"baseline", HWY_EMU128}};
  std::string known;
  for (const Cap& c : kCaps) {
    if (std::strcmp(v, c.name) == 0) {
      // Highway ranks targets by bit: every lower bit is a better target than `c.target`.
      hwy::DisableTargets(c.target - 1);
      return c.name;
    }
    known += std::string(known.empty() ? "" : ", ") + c.name;
  }
  throw std::invalid_argument(std::string("LOOM_SIMD_MAX='") + v + "' is not one of " + known);
}

}  // namespace loom::trainer::layers
#endif  // HWY_ONCE
