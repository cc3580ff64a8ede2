// Fused CPU optimizer kernels: one pass over p, g, m, v per element, compiled for every
// SIMD target Highway knows and dispatched at run time to the best one the CPU has.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu.hpp"

HWY_BEFORE_NAMESPACE();
namespace loom::optim {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;

// Elements processed between copy-outs of the low-precision parameter, so the fp32 values
// are still in L1 when they are converted.
constexpr std::size_t kTile = 2048;

template <DType G>
HWY_INLINE hn::Vec<DF> LoadG(DF d, const void* g, std::size_t i) {
  if constexpr (G == DType::kF32) {
    return hn::LoadU(d, static_cast<const float*>(g) + i);
  } else if constexpr (G == DType::kBF16) {
    const hn::Rebind<uint16_t, DF> d16;
    const hn::RebindToUnsigned<DF> du;
    const auto w = hn::PromoteTo(du, hn::LoadU(d16, static_cast<const uint16_t*>(g) + i));
    return hn::BitCast(d, hn::ShiftLeft<16>(w));
  } else {
    const hn::Rebind<hwy::float16_t, DF> d16;
    return hn::PromoteTo(d, hn::LoadU(d16, static_cast<const hwy::float16_t*>(g) + i));
  }
}

template <DType G>
HWY_INLINE float LoadG1(const void* g, std::size_t i) {
  if constexpr (G == DType::kF32) {
    return static_cast<const float*>(g)[i];
  } else if constexpr (G == DType::kBF16) {
    return bf16_to_f32(static_cast<const uint16_t*>(g)[i]);
  } else {
    return f16_to_f32(static_cast<const uint16_t*>(g)[i]);
  }
}

// bf16 with round-to-nearest-even (Highway's DemoteTo truncates); NaN stays a quiet NaN.
HWY_INLINE void StoreBF16(DF d, hn::Vec<DF> v, uint16_t* out) {
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<uint16_t, DF> d16;
  const auto bits = hn::BitCast(du, v);
  const auto lsb = hn::And(hn::ShiftRight<16>(bits), hn::Set(du, 1u));
  auto r = hn::ShiftRight<16>(hn::Add(bits, hn::Add(lsb, hn::Set(du, 0x7FFFu))));
  const auto qnan = hn::Or(hn::ShiftRight<16>(bits), hn::Set(du, 0x40u));
  r = hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(v)), qnan, r);
  hn::StoreU(hn::DemoteTo(d16, hn::BitCast(di, r)), d16, out);
  (void)d;
}

void CopyOutRange(const float* p, void* low, DType lt, std::size_t begin, std::size_t end) {
  if (lt == DType::kBF16) {
    const DF d;
    const std::size_t N = hn::Lanes(d);
    auto* out = static_cast<uint16_t*>(low);
    std::size_t i = begin;
    for (; i + N <= end; i += N) StoreBF16(d, hn::LoadU(d, p + i), out + i);
    for (; i < end; ++i) out[i] = f32_to_bf16(p[i]);
  } else {
    // Highway's fp16 demotion rounds differently per target; the scalar one is exact RNE.
    auto* out = static_cast<uint16_t*>(low);
    for (std::size_t i = begin; i < end; ++i) out[i] = f32_to_f16(p[i]);
  }
}

template <DType G>
void AdamTile(const TensorRef& t, const AdamHyper& h, std::size_t begin, std::size_t end) {
  const DF d;
  const std::size_t N = hn::Lanes(d);
  const auto b1 = hn::Set(d, h.beta1);
  const auto omb1 = hn::Set(d, h.omb1);
  const auto b2 = hn::Set(d, h.beta2);
  const auto omb2 = hn::Set(d, h.omb2);
  const auto eps = hn::Set(d, h.eps);
  const auto inv_scale = hn::Set(d, h.inv_scale);
  const auto l2 = hn::Set(d, h.l2);
  const auto decay = hn::Set(d, h.decay);
  const auto neg_step = hn::Set(d, -h.step_size);
  const auto inv_bc2 = hn::Set(d, h.inv_bc2_sqrt);
  float* HWY_RESTRICT p = t.p;
  float* HWY_RESTRICT m = t.m;
  float* HWY_RESTRICT v = t.v;
  std::size_t i = begin;
  for (; i + N <= end; i += N) {
    const auto pv = hn::LoadU(d, p + i);
    const auto g = hn::MulAdd(LoadG<G>(d, t.g, i), inv_scale, hn::Mul(l2, pv));
    const auto mv = hn::MulAdd(b1, hn::LoadU(d, m + i), hn::Mul(omb1, g));
    const auto vv = hn::MulAdd(b2, hn::LoadU(d, v + i), hn::Mul(hn::Mul(omb2, g), g));
    const auto denom = hn::MulAdd(hn::Sqrt(vv), inv_bc2, eps);
    hn::StoreU(mv, d, m + i);
    hn::StoreU(vv, d, v + i);
    hn::StoreU(hn::MulAdd(pv, decay, hn::Mul(neg_step, hn::Div(mv, denom))), d, p + i);
  }
  for (; i < end; ++i) {
    const float g = LoadG1<G>(t.g, i) * h.inv_scale + h.l2 * p[i];
    m[i] = h.beta1 * m[i] + h.omb1 * g;
    v[i] = h.beta2 * v[i] + h.omb2 * g * g;
    const float denom = std::sqrt(v[i]) * h.inv_bc2_sqrt + h.eps;
    p[i] = p[i] * h.decay - h.step_size * (m[i] / denom);
  }
}

template <DType G>
void AdamRangeT(const TensorRef& t, const AdamHyper& h, std::size_t begin, std::size_t end) {
  if (t.low == nullptr) {
    AdamTile<G>(t, h, begin, end);
    return;
  }
  for (std::size_t b = begin; b < end; b += kTile) {
    const std::size_t e = std::min(end, b + kTile);
    AdamTile<G>(t, h, b, e);
    CopyOutRange(t.p, t.low, t.ltype, b, e);
  }
}

void AdamRange(const TensorRef* t, const AdamHyper* h, std::size_t begin, std::size_t end) {
  switch (t->gtype) {
    case DType::kF32:
      return AdamRangeT<DType::kF32>(*t, *h, begin, end);
    case DType::kBF16:
      return AdamRangeT<DType::kBF16>(*t, *h, begin, end);
    case DType::kF16:
      return AdamRangeT<DType::kF16>(*t, *h, begin, end);
  }
}

template <DType G>
void LambMomentsT(const TensorRef& t, const LambHyper& h, std::size_t begin, std::size_t end,
                  double* sp, double* su) {
  const DF d;
  const std::size_t N = hn::Lanes(d);
  const auto b1 = hn::Set(d, h.beta1);
  const auto omb1 = hn::Set(d, h.omb1);
  const auto b2 = hn::Set(d, h.beta2);
  const auto omb2 = hn::Set(d, h.omb2);
  const auto eps = hn::Set(d, h.eps);
  const auto inv_scale = hn::Set(d, h.inv_scale);
  const auto wd = hn::Set(d, h.wd);
  const auto inv_bc1 = hn::Set(d, h.inv_bc1);
  const auto inv_bc2 = hn::Set(d, h.inv_bc2_sqrt);
  auto acc_p = hn::Zero(d);
  auto acc_u = hn::Zero(d);
  float* HWY_RESTRICT p = t.p;
  float* HWY_RESTRICT m = t.m;
  float* HWY_RESTRICT v = t.v;
  std::size_t i = begin;
  for (; i + N <= end; i += N) {
    const auto pv = hn::LoadU(d, p + i);
    const auto g = hn::Mul(LoadG<G>(d, t.g, i), inv_scale);
    const auto mv = hn::MulAdd(b1, hn::LoadU(d, m + i), hn::Mul(omb1, g));
    const auto vv = hn::MulAdd(b2, hn::LoadU(d, v + i), hn::Mul(hn::Mul(omb2, g), g));
    hn::StoreU(mv, d, m + i);
    hn::StoreU(vv, d, v + i);
    const auto u =
        hn::MulAdd(wd, pv, hn::Div(hn::Mul(mv, inv_bc1), hn::MulAdd(hn::Sqrt(vv), inv_bc2, eps)));
    acc_p = hn::MulAdd(pv, pv, acc_p);
    acc_u = hn::MulAdd(u, u, acc_u);
  }
  double tail_p = 0.0;
  double tail_u = 0.0;
  for (; i < end; ++i) {
    const float g = LoadG1<G>(t.g, i) * h.inv_scale;
    m[i] = h.beta1 * m[i] + h.omb1 * g;
    v[i] = h.beta2 * v[i] + h.omb2 * g * g;
    const float u = h.wd * p[i] + (m[i] * h.inv_bc1) / (std::sqrt(v[i]) * h.inv_bc2_sqrt + h.eps);
    tail_p += static_cast<double>(p[i]) * p[i];
    tail_u += static_cast<double>(u) * u;
  }
  *sp = static_cast<double>(hn::GetLane(hn::SumOfLanes(d, acc_p))) + tail_p;
  *su = static_cast<double>(hn::GetLane(hn::SumOfLanes(d, acc_u))) + tail_u;
}

void LambMoments(const TensorRef* t, const LambHyper* h, std::size_t begin, std::size_t end,
                 double* sp, double* su) {
  switch (t->gtype) {
    case DType::kF32:
      return LambMomentsT<DType::kF32>(*t, *h, begin, end, sp, su);
    case DType::kBF16:
      return LambMomentsT<DType::kBF16>(*t, *h, begin, end, sp, su);
    case DType::kF16:
      return LambMomentsT<DType::kF16>(*t, *h, begin, end, sp, su);
  }
}

void LambApplyTile(const TensorRef& t, const LambHyper& h, float lr_coeff, std::size_t begin,
                   std::size_t end) {
  const DF d;
  const std::size_t N = hn::Lanes(d);
  const auto eps = hn::Set(d, h.eps);
  const auto wd = hn::Set(d, h.wd);
  const auto inv_bc1 = hn::Set(d, h.inv_bc1);
  const auto inv_bc2 = hn::Set(d, h.inv_bc2_sqrt);
  const auto neg_lr = hn::Set(d, -lr_coeff);
  float* HWY_RESTRICT p = t.p;
  const float* HWY_RESTRICT m = t.m;
  const float* HWY_RESTRICT v = t.v;
  std::size_t i = begin;
  for (; i + N <= end; i += N) {
    const auto pv = hn::LoadU(d, p + i);
    const auto u = hn::MulAdd(wd, pv,
                              hn::Div(hn::Mul(hn::LoadU(d, m + i), inv_bc1),
                                      hn::MulAdd(hn::Sqrt(hn::LoadU(d, v + i)), inv_bc2, eps)));
    hn::StoreU(hn::MulAdd(neg_lr, u, pv), d, p + i);
  }
  for (; i < end; ++i) {
    const float u = h.wd * p[i] + (m[i] * h.inv_bc1) / (std::sqrt(v[i]) * h.inv_bc2_sqrt + h.eps);
    p[i] = p[i] - lr_coeff * u;
  }
}

void LambApply(const TensorRef* t, const LambHyper* h, float lr_coeff, std::size_t begin,
               std::size_t end) {
  if (t->low == nullptr) {
    LambApplyTile(*t, *h, lr_coeff, begin, end);
    return;
  }
  for (std::size_t b = begin; b < end; b += kTile) {
    const std::size_t e = std::min(end, b + kTile);
    LambApplyTile(*t, *h, lr_coeff, b, e);
    CopyOutRange(t->p, t->low, t->ltype, b, e);
  }
}

template <DType G>
void MomentumT(float* m, const void* g, std::size_t begin, std::size_t end, Decay beta1,
               float inv_scale) {
  const DF d;
  const std::size_t N = hn::Lanes(d);
  const auto b1 = hn::Set(d, beta1.beta);
  const auto omb1 = hn::Set(d, beta1.rest);
  const auto s = hn::Set(d, inv_scale);
  std::size_t i = begin;
  for (; i + N <= end; i += N) {
    const auto gv = hn::Mul(LoadG<G>(d, g, i), s);
    hn::StoreU(hn::MulAdd(b1, hn::LoadU(d, m + i), hn::Mul(omb1, gv)), d, m + i);
  }
  for (; i < end; ++i) {
    m[i] = beta1.beta * m[i] + beta1.rest * (LoadG1<G>(g, i) * inv_scale);
  }
}

void Momentum(float* m, const void* g, DType gt, std::size_t begin, std::size_t end, Decay beta1,
              float inv_scale) {
  switch (gt) {
    case DType::kF32:
      return MomentumT<DType::kF32>(m, g, begin, end, beta1, inv_scale);
    case DType::kBF16:
      return MomentumT<DType::kBF16>(m, g, begin, end, beta1, inv_scale);
    case DType::kF16:
      return MomentumT<DType::kF16>(m, g, begin, end, beta1, inv_scale);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace loom::optim
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "common/parallel_for.hpp"

namespace loom::optim {

HWY_EXPORT(AdamRange);
HWY_EXPORT(LambMoments);
HWY_EXPORT(LambApply);
HWY_EXPORT(Momentum);
HWY_EXPORT(CopyOutRange);

namespace {
// Per-thread block size: big enough to amortise the dispatch, a multiple of every
// vector width.
constexpr std::size_t kGrain = 1 << 15;
// LAMB's norm partials: fixed chunks, so the sums do not depend on the thread count.
constexpr std::size_t kNormChunk = 1 << 14;
}  // namespace

void adam_cpu(const TensorRef& t, const AdamHyper& h) {
  loom::plugins::parallel_for(t.n, kGrain, [&](std::size_t b, std::size_t e) {
    HWY_DYNAMIC_DISPATCH(AdamRange)(&t, &h, b, e);
  });
}

void lamb_moments_cpu(const TensorRef& t, const LambHyper& h, double* sum_p2, double* sum_u2) {
  const std::size_t chunks = (t.n + kNormChunk - 1) / kNormChunk;
  std::vector<double> part(2 * chunks, 0.0);
  loom::plugins::parallel_for(chunks, 1, [&](std::size_t cb, std::size_t ce) {
    for (std::size_t c = cb; c < ce; ++c) {
      const std::size_t b = c * kNormChunk;
      const std::size_t e = std::min(t.n, b + kNormChunk);
      HWY_DYNAMIC_DISPATCH(LambMoments)(&t, &h, b, e, &part[2 * c], &part[2 * c + 1]);
    }
  });
  double sp = 0.0;
  double su = 0.0;
  for (std::size_t c = 0; c < chunks; ++c) {
    sp += part[2 * c];
    su += part[2 * c + 1];
  }
  *sum_p2 = sp;
  *sum_u2 = su;
}

void lamb_apply_cpu(const TensorRef& t, const LambHyper& h, float lr_coeff) {
  loom::plugins::parallel_for(t.n, kGrain, [&](std::size_t b, std::size_t e) {
    HWY_DYNAMIC_DISPATCH(LambApply)(&t, &h, lr_coeff, b, e);
  });
}

void momentum_cpu(float* m, const void* g, DType gtype, std::size_t n, Decay beta1,
                  float inv_scale) {
  loom::plugins::parallel_for(n, kGrain, [&](std::size_t b, std::size_t e) {
    HWY_DYNAMIC_DISPATCH(Momentum)(m, g, gtype, b, e, beta1, inv_scale);
  });
}

void copy_out_cpu(const float* p, void* low, DType ltype, std::size_t n) {
  loom::plugins::parallel_for(n, kGrain, [&](std::size_t b, std::size_t e) {
    HWY_DYNAMIC_DISPATCH(CopyOutRange)(p, low, ltype, b, e);
  });
}

void load_grad_cpu(const void* g, DType gtype, std::size_t n, float inv_scale, float* out) {
  for (std::size_t i = 0; i < n; ++i) {
    float x = 0.0f;
    switch (gtype) {
      case DType::kF32:
        x = static_cast<const float*>(g)[i];
        break;
      case DType::kBF16:
        x = bf16_to_f32(static_cast<const uint16_t*>(g)[i]);
        break;
      case DType::kF16:
        x = f16_to_f32(static_cast<const uint16_t*>(g)[i]);
        break;
    }
    out[i] = x * inv_scale;
  }
}

}  // namespace loom::optim
#endif  // HWY_ONCE
