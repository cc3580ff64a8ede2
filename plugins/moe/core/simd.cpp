// The host MoE core's vector kernels (simd.hpp), compiled once per Highway target and chosen at
// run time. The core is built with -ffp-contract=off, and these kernels use separate Mul and
// Add (never MulAdd), so no target fuses a product into a sum.
#include "simd.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "simd.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// clang-format off
#include <hwy/highway.h>
#include <hwy/contrib/math/math-inl.h>
// clang-format on

#include <cstddef>
#include <cstdint>

HWY_BEFORE_NAMESPACE();
namespace loom::moe::simd {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// At most kGateLanes lanes, so a padded expert count (a multiple of kGateLanes) is a multiple
// of the vector length on every target.
template <class T>
using GateTag = hn::CappedTag<T, kGateLanes>;

// lg[t * ldw + c] = sum over m (ascending) of xs[t][m] * w[m * ldw + c], for t < kGateTokens
// and c < ldw. Experts are in the lanes; each token has its own accumulator per column block,
// the product and the sum rounded apart, so every logit rounds as the plain loop's.
template <class T>
HWY_INLINE void GateLogits(const T* const* HWY_RESTRICT xs, int64_t M, const T* HWY_RESTRICT w,
                           int64_t ldw, T* HWY_RESTRICT lg) {
  const GateTag<T> d;
  const auto N = static_cast<int64_t>(hn::Lanes(d));
  using V = hn::Vec<GateTag<T>>;
  for (int64_t c = 0; c < ldw; c += N) {
    V a0 = hn::Zero(d), a1 = hn::Zero(d), a2 = hn::Zero(d), a3 = hn::Zero(d);
    V a4 = hn::Zero(d), a5 = hn::Zero(d), a6 = hn::Zero(d), a7 = hn::Zero(d);
    const T* wc = w + c;
    for (int64_t m = 0; m < M; ++m, wc += ldw) {
      const V wv = hn::LoadU(d, wc);
      a0 = hn::Add(a0, hn::Mul(hn::Set(d, xs[0][m]), wv));
      a1 = hn::Add(a1, hn::Mul(hn::Set(d, xs[1][m]), wv));
      a2 = hn::Add(a2, hn::Mul(hn::Set(d, xs[2][m]), wv));
      a3 = hn::Add(a3, hn::Mul(hn::Set(d, xs[3][m]), wv));
      a4 = hn::Add(a4, hn::Mul(hn::Set(d, xs[4][m]), wv));
      a5 = hn::Add(a5, hn::Mul(hn::Set(d, xs[5][m]), wv));
      a6 = hn::Add(a6, hn::Mul(hn::Set(d, xs[6][m]), wv));
      a7 = hn::Add(a7, hn::Mul(hn::Set(d, xs[7][m]), wv));
    }
    hn::StoreU(a0, d, lg + 0 * ldw + c);
    hn::StoreU(a1, d, lg + 1 * ldw + c);
    hn::StoreU(a2, d, lg + 2 * ldw + c);
    hn::StoreU(a3, d, lg + 3 * ldw + c);
    hn::StoreU(a4, d, lg + 4 * ldw + c);
    hn::StoreU(a5, d, lg + 5 * ldw + c);
    hn::StoreU(a6, d, lg + 6 * ldw + c);
    hn::StoreU(a7, d, lg + 7 * ldw + c);
  }
}
static_assert(kGateTokens == 8, "GateLogits runs eight tokens");

void GateLogitsF32(const float* const* xs, int64_t M, const float* w, int64_t ldw, float* lg) {
  GateLogits<float>(xs, M, w, ldw, lg);
}
void GateLogitsF64(const double* const* xs, int64_t M, const double* w, int64_t ldw, double* lg) {
  GateLogits<double>(xs, M, w, ldw, lg);
}

// GELU (tanh approximation) written through the logistic function, which needs no 1 + tanh
// (that sum cancels for negative x): with u = sqrt(2/pi) (x + 0.044715 x^3), e = exp(-2u) and
// s = 1 / (1 + e), 1 + tanh(u) = 2s and 1 - tanh(u)^2 = 4 s^2 e, so
//   gelu(x) = x s,   gelu'(x) = s + 2 x s^2 e du/dx,   du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2).
// Beyond |x| = kGeluEdge the results are those of float: gelu = x (x > 0) or -0 (x < 0),
// gelu' = 1 or 0, as the libm formula gives there; the polynomial never overflows inside.
constexpr float kGeluEdge = 10.0f;

template <class D, class V>
HWY_INLINE void GeluLogistic(D d, V x, V& s, V& e) {
  const V u = hn::Mul(hn::Set(d, 0.79788456080286535588f),
                      hn::Add(x, hn::Mul(hn::Mul(hn::Set(d, 0.044715f), x), hn::Mul(x, x))));
  // |2u| <= 88 for |x| <= kGeluEdge; the clamp keeps the lanes beyond the edge (replaced
  // afterwards) and NaN-free ones inside Exp's range
  const V t =
      hn::Min(hn::Max(hn::Mul(hn::Set(d, -2.0f), u), hn::Set(d, -88.0f)), hn::Set(d, 88.0f));
  e = hn::Exp(d, t);
  s = hn::Div(hn::Set(d, 1.0f), hn::Add(hn::Set(d, 1.0f), e));
}

template <class D, class V>
HWY_INLINE V GeluValue(D d, V x) {
  V s, e;
  GeluLogistic(d, x, s, e);
  V y = hn::Mul(x, s);
  y = hn::IfThenElse(hn::Gt(x, hn::Set(d, kGeluEdge)), x, y);
  return hn::IfThenElse(hn::Lt(x, hn::Set(d, -kGeluEdge)), hn::Mul(x, hn::Zero(d)), y);
}

template <class D, class V>
HWY_INLINE V GeluSlope(D d, V x) {
  V s, e;
  GeluLogistic(d, x, s, e);
  const V du =
      hn::Mul(hn::Set(d, 0.79788456080286535588f),
              hn::Add(hn::Set(d, 1.0f), hn::Mul(hn::Set(d, 3.0f * 0.044715f), hn::Mul(x, x))));
  const V q = hn::Mul(hn::Mul(s, s), e);
  V g = hn::Add(s, hn::Mul(hn::Mul(hn::Set(d, 2.0f), x), hn::Mul(q, du)));
  g = hn::IfThenElse(hn::Gt(x, hn::Set(d, kGeluEdge)), hn::Set(d, 1.0f), g);
  return hn::IfThenElse(hn::Lt(x, hn::Set(d, -kGeluEdge)), hn::Zero(d), g);
}

// out[i] = op(a[i], b[i]) over n values, full vectors then the tail through a padded buffer
// (zeros in the unused lanes, which are never stored).
template <class Op>
HWY_INLINE void Map2(const float* a, const float* b, float* out, int64_t n, Op op) {
  const hn::ScalableTag<float> d;
  const auto N = static_cast<int64_t>(hn::Lanes(d));
  int64_t i = 0;
  for (; i + N <= n; i += N) {
    hn::StoreU(op(d, hn::LoadU(d, a + i), hn::LoadU(d, b + i)), d, out + i);
  }
  if (i < n) {
    HWY_ALIGN float ta[HWY_MAX_BYTES / sizeof(float)] = {};
    HWY_ALIGN float tb[HWY_MAX_BYTES / sizeof(float)] = {};
    const int64_t r = n - i;
    for (int64_t j = 0; j < r; ++j) {
      ta[j] = a[i + j];
      tb[j] = b[i + j];
    }
    hn::Store(op(d, hn::Load(d, ta), hn::Load(d, tb)), d, ta);
    for (int64_t j = 0; j < r; ++j) out[i + j] = ta[j];
  }
}

void GeluForwardF32(const float* x, float* y, int64_t n) {
  Map2(x, x, y, n, [](auto d, auto v, auto) { return GeluValue(d, v); });
}

void GeluGradMulF32(const float* x, float* dy, int64_t n) {
  Map2(x, dy, dy, n, [](auto d, auto v, auto g) { return hn::Mul(g, GeluSlope(d, v)); });
}

void GeluSlopeF32(const float* x, float* g, int64_t n) {
  Map2(x, x, g, n, [](auto d, auto v, auto) { return GeluSlope(d, v); });
}

}  // namespace HWY_NAMESPACE
}  // namespace loom::moe::simd
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace loom::moe::simd {

HWY_EXPORT(GateLogitsF32);
HWY_EXPORT(GateLogitsF64);
HWY_EXPORT(GeluForwardF32);
HWY_EXPORT(GeluGradMulF32);
HWY_EXPORT(GeluSlopeF32);

void gate_logits(const float* const* xs, int64_t M, const float* w, int64_t ldw, float* lg) {
  HWY_DYNAMIC_DISPATCH(GateLogitsF32)(xs, M, w, ldw, lg);
}
void gate_logits(const double* const* xs, int64_t M, const double* w, int64_t ldw, double* lg) {
  HWY_DYNAMIC_DISPATCH(GateLogitsF64)(xs, M, w, ldw, lg);
}
void gelu_forward(const float* x, float* y, int64_t n) {
  HWY_DYNAMIC_DISPATCH(GeluForwardF32)(x, y, n);
}
void gelu_grad_mul(const float* x, float* dy, int64_t n) {
  HWY_DYNAMIC_DISPATCH(GeluGradMulF32)(x, dy, n);
}
void gelu_slope(const float* x, float* g, int64_t n) {
  HWY_DYNAMIC_DISPATCH(GeluSlopeF32)(x, g, n);
}

}  // namespace loom::moe::simd
#endif  // HWY_ONCE
