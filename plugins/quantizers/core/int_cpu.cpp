// The CPU kernels of int_kernels.hpp, compiled for every SIMD target Highway knows and
// dispatched at run time. Every operation of quantize and dequantize is one IEEE operation
// in the order the reference uses (division x / s, round half to even, clamp; s * (q - z)),
// and the group statistics are comparisons, so the codes and scales are the reference's on
// every target (this file is compiled with -ffp-contract=off).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "int_cpu.cpp"
#include <hwy/cache_control.h>
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "int_kernels.hpp"
#include "widen-inl.h"

#ifndef LOOM_QUANT_INT_CPU_SOURCES
#define LOOM_QUANT_INT_CPU_SOURCES
namespace loom::quant {
// The storage of quantize's x (QuantizeRows' `source`).
constexpr int32_t kSourceF32 = 0, kSourceBf16 = 1, kSourceF16 = 2;
}  // namespace loom::quant
#endif

HWY_BEFORE_NAMESPACE();
namespace loom::quant {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using DI = hn::RebindToSigned<DF>;
using D8 = hn::Rebind<int8_t, DF>;
using DU8 = hn::Rebind<uint8_t, DF>;
using DU32 = hn::RebindToUnsigned<DF>;

// A group's statistics, and whether all its elements are finite (one pass).
struct FiniteStats {
  GroupStats st;
  bool finite = true;
};

// Symmetric schemes need only max |x| (then min and max are left 0): one reduction.
HWY_INLINE FiniteStats Stats(const float* x, int64_t n, bool absmax_only) {
  const DF d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  FiniteStats f;
  if (n < N) {
    f.finite = first_non_finite(x, n) < 0;
    f.st = group_stats(x, n);
    return f;
  }
  GroupStats& s = f.st;
  const auto v0 = hn::LoadU(d, x);
  auto ok = hn::IsFinite(v0);
  int64_t i = N;
  if (absmax_only) {
    auto vabs = hn::Abs(v0);
    for (; i + N <= n; i += N) {
      const auto v = hn::LoadU(d, x + i);
      vabs = hn::Max(vabs, hn::Abs(v));
      ok = hn::And(ok, hn::IsFinite(v));
    }
    s.absmax = hn::GetLane(hn::MaxOfLanes(d, vabs));
    for (; i < n; ++i) s.absmax = std::max(s.absmax, std::fabs(x[i]));
  } else {
    auto vmin = v0;
    auto vmax = v0;
    for (; i + N <= n; i += N) {
      const auto v = hn::LoadU(d, x + i);
      vmin = hn::Min(vmin, v);
      vmax = hn::Max(vmax, v);
      ok = hn::And(ok, hn::IsFinite(v));
    }
    s.min = hn::GetLane(hn::MinOfLanes(d, vmin));
    s.max = hn::GetLane(hn::MaxOfLanes(d, vmax));
    for (; i < n; ++i) {
      s.min = std::min(s.min, x[i]);
      s.max = std::max(s.max, x[i]);
    }
    s.absmax = std::max(std::fabs(s.min), std::fabs(s.max));
  }
  f.finite = hn::AllTrue(d, ok) && first_non_finite(x + n - (n % N), n % N) < 0;
  return f;
}

// A span's groups as the encoder sees them: group g is x[g * len, min((g + 1) * len, n)),
// with scale[g], inv[g] (1 / s where that is a normal float, else 0: every vector of the
// group then takes the division) and zero[g].
struct SpanGroups {
  const float* x;
  int64_t count, len, n;
  const float* scale;
  const float* inv;
  const int32_t* zero;
};

// The codes, N elements at a time, each the reference's int_encode.
//
// round_half_even(a / s) comes from t = a * (1 / s), because a division costs several
// multiplies. With 1 / s a normal float, t and the rounded quotient differ by at most
// 3.01 * 2^-24 * |t| (two roundings against one). t is clamped to the code range [lo, hi]
// first (a quotient beyond it clamps to the same end), so |t| <= B = max(|lo|, |hi|), and
// when t lies more than B * 2^-22 inside (r - 0.5, r + 0.5) around r = round(t), the quotient
// rounds to r as well. A vector with a lane nearer a half-integer takes the division.
//
// Adding 1.5 * 2^23 rounds t half to even onto the integer grid (the sum's ulp is 1 and the
// constant is even), and the sum's low bits are then r in two's complement: its low byte is
// the code, symmetric or not (asymmetric "exact" adds z to it: round(t) + z).
//
// One group's encoder in registers. kShift (asymmetric, not "exact"): a = x + z * s.
// kZero (asymmetric "exact"): the code is round(t) + z, so t is clamped to [-z, qmax - z].
template <bool kShift, bool kZero>
struct GroupEncoder {
  DF d;
  hn::Vec<DF> vinv, vlo, vhi, vzf, margin, magic;
  hn::Vec<DI> vz;
  float scale;
  bool fast;

  GroupEncoder(const SpanGroups& s, int64_t g, float lo, float hi, float m)
      : vinv(hn::Set(d, s.inv[g])),
        vlo(hn::Set(d, kZero ? static_cast<float>(-s.zero[g]) : lo)),
        vhi(hn::Set(d, kZero ? hi - static_cast<float>(s.zero[g]) : hi)),
        vzf(hn::Set(d, kShift ? static_cast<float>(s.zero[g]) * s.scale[g] : 0.0f)),
        margin(hn::Set(d, m)),
        magic(hn::Set(d, 0x1.8p23f)),
        vz(hn::Set(DI(), kZero ? s.zero[g] : 0)),
        scale(s.scale[g]),
        fast(s.inv[g] != 0.0f) {}

  // The codes of x[i .. i + N) in the low bits of int32 lanes: through 1 / s, or through the
  // division when a lane could round otherwise (about one vector in a thousand at 8 bits).
  HWY_INLINE hn::Vec<DI> Codes(const float* HWY_RESTRICT x) const {
    auto a = hn::LoadU(d, x);
    if constexpr (kShift) a = hn::Add(a, vzf);
    auto t = hn::Min(hn::Max(hn::Mul(a, vinv), vlo), vhi);
    auto m = hn::Add(t, magic);
    const auto safe = hn::Lt(hn::Abs(hn::Sub(t, hn::Sub(m, magic))), margin);
    if (HWY_UNLIKELY(!fast || !hn::AllTrue(d, safe))) {
      const auto q = hn::Round(hn::Div(a, hn::Set(d, scale)));
      m = hn::Add(hn::Min(hn::Max(q, vlo), vhi), magic);
    }
    const auto c = hn::BitCast(DI(), m);
    if constexpr (kZero) return hn::Add(c, vz);
    return c;
  }
};

// The codes of a span's groups, into `out` (the span's first byte): one byte per code
// (kNibbles false: bits 8, or a row of bytes for pack_codes), or two 4-bit codes per byte
// (every group starts on a byte), where two vectors of codes give one vector of bytes with the
// even elements in one nibble and the odd ones in the other. While a group is encoded from
// L1, the same group of the next span (`ahead`, when not null) is fetched.
template <bool kShift, bool kZero, bool kNibbles>
HWY_NOINLINE void EncodeSpan(const SpanGroups& s, const IntScheme& q, int32_t packing,
                             uint8_t* HWY_RESTRICT out, const float* ahead) {
  const DI di;
  const DU32 du32;
  const DU8 du8;
  const int64_t N = static_cast<int64_t>(hn::Lanes(di));
  float lo = 0.0f, hi = static_cast<float>((1u << q.bits) - 1u);
  if (q.symmetric) {
    hi = static_cast<float>((1u << (q.bits - 1)) - 1u);
    lo = q.range == Range::kExact ? -hi : -hi - 1.0f;
  }
  // |t| <= max(|lo|, |hi|), which is at most 2^bits - 1 for kZero's [-z, qmax - z].
  const float margin = 0.5f - std::max(std::fabs(lo), std::fabs(hi)) * 0x1p-22f;
  const auto low = hn::Set(di, 0x0F);
  const int even_shift = packing == LOOM_QUANT_PACK_LSB_FIRST ? 0 : 4;
  const int odd_shift = 4 - even_shift;
  HWY_ALIGN float tail[2 * hn::MaxLanes(DF())];
  HWY_ALIGN uint8_t bytes[hn::MaxLanes(DF())];
  for (int64_t g = 0; g < s.count; ++g) {
    const GroupEncoder<kShift, kZero> e(s, g, lo, hi, margin);
    const float* x = s.x + g * s.len;
    const int64_t n = std::min(s.len, s.n - g * s.len);
    if (ahead != nullptr) {
      for (int64_t b = 0; b < n; b += 16) hwy::Prefetch(ahead + g * s.len + b);
    }
    if constexpr (kNibbles) {
      uint8_t* o = out + g * s.len / 2;
      const auto pack = [&](const float* src) {
        const auto c0 = e.Codes(src);
        const auto c1 = e.Codes(src + N);
        const auto even = hn::ShiftLeftSame(hn::And(hn::ConcatEven(di, c1, c0), low), even_shift);
        const auto odd = hn::ShiftLeftSame(hn::And(hn::ConcatOdd(di, c1, c0), low), odd_shift);
        return hn::TruncateTo(du8, hn::BitCast(du32, hn::Or(even, odd)));
      };
      int64_t i = 0;
      for (; i + 2 * N <= n; i += 2 * N) hn::StoreU(pack(x + i), du8, o + i / 2);
      if (i < n) {
        std::fill(tail, tail + 2 * N, 0.0f);
        std::memcpy(tail, x + i, static_cast<std::size_t>(n - i) * sizeof(float));
        hn::StoreU(pack(tail), du8, bytes);
        std::memcpy(o + i / 2, bytes, static_cast<std::size_t>(n - i) / 2);
      }
    } else {
      uint8_t* o = out + g * s.len;
      const auto codes = [&](const float* src) {
        return hn::TruncateTo(du8, hn::BitCast(du32, e.Codes(src)));
      };
      int64_t i = 0;
      for (; i + N <= n; i += N) hn::StoreU(codes(x + i), du8, o + i);
      if (i < n) {
        std::fill(tail, tail + N, 0.0f);
        std::memcpy(tail, x + i, static_cast<std::size_t>(n - i) * sizeof(float));
        hn::StoreU(codes(tail), du8, bytes);
        std::memcpy(o + i, bytes, static_cast<std::size_t>(n - i));
      }
    }
  }
}

HWY_INLINE void Encode(const SpanGroups& s, const IntScheme& q, bool nibbles, int32_t packing,
                       uint8_t* out, const float* ahead) {
  const bool shift = !q.symmetric && q.range != Range::kExact;
  const bool zero = !q.symmetric && q.range == Range::kExact;
  if (nibbles) {
    if (shift) return EncodeSpan<true, false, true>(s, q, packing, out, ahead);
    if (zero) return EncodeSpan<false, true, true>(s, q, packing, out, ahead);
    return EncodeSpan<false, false, true>(s, q, packing, out, ahead);
  }
  if (shift) return EncodeSpan<true, false, false>(s, q, packing, out, ahead);
  if (zero) return EncodeSpan<false, true, false>(s, q, packing, out, ahead);
  return EncodeSpan<false, false, false>(s, q, packing, out, ahead);
}

constexpr int64_t kSpan = 64;  // groups per span (a multiple of every target's lanes)

// Lane g of the result: the maximum (kMax) or minimum of the lanes of v[g], for N = Lanes
// vectors. Each round halves the vectors by combining neighbouring lanes of a pair, so the
// groups stay in order: after round k a vector holds 2^k groups' partial results.
template <bool kMax>
HWY_INLINE hn::Vec<DF> ReduceEach(hn::Vec<DF>* v) {
  const DF d;
  for (std::size_t count = hn::Lanes(d); count > 1; count /= 2) {
    for (std::size_t j = 0; j < count / 2; ++j) {
      const auto even = hn::ConcatEven(d, v[2 * j + 1], v[2 * j]);
      const auto odd = hn::ConcatOdd(d, v[2 * j + 1], v[2 * j]);
      v[j] = kMax ? hn::Max(even, odd) : hn::Min(even, odd);
    }
  }
  return v[0];
}

// The parameters of groups [0, count) of a span whose groups are all `len` elements, len a
// multiple of N: their statistics a group at a time (the pass that streams the span from
// memory), reduced N groups at a time, then scales, reciprocals and zero points N groups at a
// time, each the same float int_group_params gives (its std::min and std::max written out).
// Returns false when an element is not finite.
HWY_INLINE bool SpanParams(const float* x, int64_t count, int64_t len, const IntScheme& q,
                           float* scale, float* inv, int32_t* zero) {
  const DF d;
  const DI di;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const bool sym = q.symmetric;
  const auto zero_v = hn::Zero(d);
  const auto one = hn::Set(d, 1.0f);
  const auto div =
      hn::Set(d, sym ? (q.range == Range::kExact ? static_cast<float>((1u << (q.bits - 1)) - 1u)
                                                 : static_cast<float>(1u << (q.bits - 1)))
                     : (q.range == Range::kExact ? static_cast<float>((1u << q.bits) - 1u)
                                                 : static_cast<float>(1u << q.bits)));
  const auto qmax = hn::Set(d, static_cast<float>((1u << q.bits) - 1u));
  const auto min_normal = hn::Set(d, std::numeric_limits<float>::min());
  const auto inf_bits = hn::Set(di, 0x7F800000);
  auto ok = hn::IsFinite(zero_v);
  hn::Vec<DF> hi[hn::MaxLanes(DF())];
  hn::Vec<DF> lo[hn::MaxLanes(DF())];
  for (int64_t g0 = 0; g0 < count; g0 += N) {
    for (int64_t j = 0; j < N; ++j) {
      if (g0 + j >= count) {  // padding: a copy of the last group's
        hi[j] = hi[j - 1];
        if (!sym) lo[j] = lo[j - 1];
        continue;
      }
      const float* p = x + (g0 + j) * len;
      if (sym) {
        // max |x| over the bits of |x| as integers (the same order for every non-negative
        // float), which is finite exactly when every element is: NaN and inf sort above.
        auto vbits = hn::BitCast(di, hn::Abs(hn::LoadU(d, p)));
        for (int64_t i = N; i < len; i += N) {
          vbits = hn::Max(vbits, hn::BitCast(di, hn::Abs(hn::LoadU(d, p + i))));
        }
        ok = hn::And(ok, hn::RebindMask(d, hn::Lt(vbits, inf_bits)));
        hi[j] = hn::BitCast(d, vbits);
        continue;
      }
      auto v = hn::LoadU(d, p);
      ok = hn::And(ok, hn::IsFinite(v));
      auto vhi = v;
      auto vlo = v;
      for (int64_t i = N; i < len; i += N) {
        v = hn::LoadU(d, p + i);
        ok = hn::And(ok, hn::IsFinite(v));
        vhi = hn::Max(vhi, v);
        vlo = hn::Min(vlo, v);
      }
      hi[j] = vhi;
      lo[j] = vlo;
    }
    const auto mx = ReduceEach<true>(hi);
    hn::Vec<DF> s;
    auto z = zero_v;
    if (sym) {
      s = hn::Div(mx, div);
      s = hn::IfThenElse(hn::Gt(s, zero_v), s, one);
    } else {
      const auto mn = ReduceEach<false>(lo);
      const auto l = hn::IfThenElse(hn::Lt(zero_v, mn), zero_v, mn);  // std::min(min, 0)
      const auto h = hn::IfThenElse(hn::Lt(mx, zero_v), zero_v, mx);  // std::max(max, 0)
      s = hn::Div(hn::Sub(h, l), div);
      s = hn::IfThenElse(hn::AndNot(hn::Gt(s, zero_v), hn::IsFinite(s)), one, s);
      z = hn::Round(hn::Div(hn::Neg(l), s));
      z = hn::IfThenElse(hn::Lt(z, zero_v), zero_v, z);  // std::max(z, 0)
      z = hn::IfThenElse(hn::Lt(qmax, z), qmax, z);      // std::min(z, qmax)
      // A NaN z (a group with a NaN: the span is refused) must not reach the conversion.
      z = hn::IfThenElseZero(hn::IsFinite(z), z);
    }
    const auto r = hn::Div(one, s);
    const auto usable = hn::And(hn::IsFinite(r), hn::Ge(hn::Abs(r), min_normal));
    HWY_ALIGN float s_buf[hn::MaxLanes(DF())];
    HWY_ALIGN float r_buf[hn::MaxLanes(DF())];
    HWY_ALIGN int32_t z_buf[hn::MaxLanes(DF())];
    hn::Store(s, d, s_buf);
    hn::Store(hn::IfThenElseZero(usable, r), d, r_buf);  // 0: take the division
    hn::Store(hn::ConvertTo(di, z), di, z_buf);
    const int64_t m = std::min(N, count - g0);
    std::memcpy(scale + g0, s_buf, static_cast<std::size_t>(m) * sizeof(float));
    std::memcpy(inv + g0, r_buf, static_cast<std::size_t>(m) * sizeof(float));
    std::memcpy(zero + g0, z_buf, static_cast<std::size_t>(m) * sizeof(int32_t));
  }
  return hn::AllTrue(d, ok);
}

// Quantizes rows [r0, r1) (r0 a multiple of aligned_rows, so the rows' bytes are theirs).
// Returns false when a row is not finite. A row goes a span of groups (about 8 KiB) at a
// time: the parameters of every group (the pass that streams the span from memory), then the
// codes from L1 while the next span is fetched. Groups of whole vectors take their
// parameters N at a time (SpanParams); others one at a time. 8-bit codes, and 4-bit codes
// when every group starts on a byte, are written straight into `packed`; other widths go
// through a row of bytes and pack_codes.
// `source`: x's storage, kSourceF32 (x is float*), or kSourceBf16 / kSourceF16 (x holds 16-bit
// patterns): each row is then widened into a buffer of its own first.
bool QuantizeRows(const void* xv, int32_t source, const Groups* gs, const IntScheme* q,
                  int32_t packing, uint8_t* packed, float* scales, uint8_t* zeros, int64_t r0,
                  int64_t r1) {
  const auto* x = static_cast<const float*>(xv);
  std::vector<float> wide(source == kSourceF32 ? 0 : static_cast<std::size_t>(gs->cols));  // a span
  const int64_t N = static_cast<int64_t>(hn::Lanes(DF()));
  const bool bytes = q->bits == 8;
  const bool nibbles = q->bits == 4 && gs->cols % 2 == 0 && gs->group % 2 == 0;
  const bool vector_params = gs->whole() && gs->group % N == 0;
  std::vector<uint8_t> codes(bytes || nibbles ? 0 : static_cast<std::size_t>(gs->cols));
  const int64_t span = std::clamp<int64_t>(2048 / gs->group, 1, kSpan);
  float scale[kSpan], inv[kSpan];
  int32_t zero[kSpan];
  for (int64_t r = r0; r < r1; ++r) {
    // (a 16-bit x is widened span by span below: no float row then)
    const float* row = source == kSourceF32 ? x + r * gs->cols : nullptr;
    for (int64_t g0 = 0; g0 < gs->groups_per_row; g0 += span) {
      const int64_t g1 = std::min(gs->groups_per_row, g0 + span);
      const int64_t c0 = gs->begin(g0);
      // The span's elements as float32: x's own, or a 16-bit span widened into L1.
      const float* at = source == kSourceF32 ? row + c0 : nullptr;
      if (source != kSourceF32) {
        const auto* x16 = static_cast<const uint16_t*>(xv) + r * gs->cols;
        WidenRow(x16 + c0, source == kSourceBf16, gs->end(g1 - 1) - c0, wide.data());
        at = wide.data();
        // The next span comes from memory while this one is encoded from cache.
        const int64_t ahead16 = r * gs->cols + gs->end(g1 - 1);
        const int64_t ahead_n =
            std::min<int64_t>(gs->end(g1 - 1) - c0, gs->rows * gs->cols - ahead16);
        PrefetchRow16(static_cast<const uint16_t*>(xv) + ahead16, ahead_n);
      }
      if (vector_params) {
        if (!SpanParams(at, g1 - g0, gs->group, *q, scale, inv, zero)) {
          return false;
        }
      } else {
        for (int64_t g = g0; g < g1; ++g) {
          const FiniteStats f =
              Stats(at + (gs->begin(g) - c0), gs->end(g) - gs->begin(g), q->symmetric);
          if (!f.finite) return false;
          const GroupParams p = int_group_params(f.st, *q);
          scale[g - g0] = p.scale;
          zero[g - g0] = p.zero;
          const float i = 1.0f / p.scale;
          inv[g - g0] =
              std::isfinite(i) && std::fabs(i) >= std::numeric_limits<float>::min() ? i : 0.0f;
        }
      }
      std::memcpy(scales + r * gs->groups_per_row + g0, scale,
                  static_cast<std::size_t>(g1 - g0) * sizeof(float));
      if (!q->symmetric) {
        for (int64_t g = g0; g < g1; ++g) {
          zeros[r * gs->groups_per_row + g] = static_cast<uint8_t>(zero[g - g0]);
        }
      }
      const SpanGroups sg{at, g1 - g0, gs->group, gs->end(g1 - 1) - c0, scale, inv, zero};
      const int64_t next = r * gs->cols + c0 + span * gs->group;  // the next span's start
      const float* ahead = source == kSourceF32 && next + span * gs->group <= gs->rows * gs->cols
                               ? x + next
                               : nullptr;
      uint8_t* out = bytes ? packed + r * gs->cols + c0
                           : (nibbles ? packed + (r * gs->cols + c0) / 2 : codes.data() + c0);
      Encode(sg, *q, nibbles, packing, out, ahead);
    }
    if (!bytes && !nibbles) {
      pack_codes(codes.data(), static_cast<uint64_t>(r * gs->cols), static_cast<uint64_t>(gs->cols),
                 q->bits, packing, packed);
    }
  }
  return true;
}

// The decoded value of codes (bytes of `bits`-bit codes) as int32: sign-extended when
// symmetric, minus the zero point when not.
HWY_INLINE hn::Vec<DI> Centre(hn::Vec<DI> v, bool symmetric, hn::Vec<DI> vh, hn::Vec<DI> vz) {
  return symmetric ? hn::Sub(hn::Xor(v, vh), vh) : hn::Sub(v, vz);
}

void DequantizeRows(const IntWeight* w, float* x, int64_t r0, int64_t r1) {
  const DF d;
  const DI di;
  const DU8 du8;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const Groups& gs = w->gs;
  const IntScheme& q = w->q;
  const auto vh = hn::Set(di, static_cast<int32_t>(1u << (q.bits - 1)));
  std::vector<uint8_t> codes(static_cast<std::size_t>(gs.cols));
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* c = codes.data();
    if (q.bits == 8) {
      c = w->packed + r * gs.cols;
    } else {
      unpack_codes(w->packed, static_cast<uint64_t>(r * gs.cols), static_cast<uint64_t>(gs.cols),
                   q.bits, w->packing, codes.data());
    }
    float* out = x + r * gs.cols;
    for (int64_t g = 0; g < gs.groups_per_row; ++g) {
      GroupParams p;
      p.scale = w->scales[r * gs.groups_per_row + g];
      p.zero = q.symmetric ? 0 : w->zeros[r * gs.groups_per_row + g];
      const auto vs = hn::Set(d, p.scale);
      const auto vz = hn::Set(di, p.zero);
      int64_t i = gs.begin(g);
      const int64_t end = gs.end(g);
      for (; i + N <= end; i += N) {
        const auto v = Centre(hn::PromoteTo(di, hn::LoadU(du8, c + i)), q.symmetric, vh, vz);
        hn::StoreU(hn::Mul(vs, hn::ConvertTo(d, v)), d, out + i);
      }
      for (; i < end; ++i) {
        const int32_t v = q.symmetric ? sign_extend(c[i], q.bits) : static_cast<int32_t>(c[i]);
        out[i] = int_decode(v, p, q.symmetric);
      }
    }
  }
}

void WidenRows(const IntWeight* w, int8_t* out, int64_t r0, int64_t r1) {
  const DI di;
  const DU8 du8;
  const D8 d8;
  const int64_t N = static_cast<int64_t>(hn::Lanes(di));
  const Groups& gs = w->gs;
  const IntScheme& q = w->q;
  const auto vh = hn::Set(di, static_cast<int32_t>(1u << (q.bits - 1)));
  std::vector<uint8_t> codes(static_cast<std::size_t>(gs.cols));
  for (int64_t r = r0; r < r1; ++r) {
    unpack_codes(w->packed, static_cast<uint64_t>(r * gs.cols), static_cast<uint64_t>(gs.cols),
                 q.bits, w->packing, codes.data());
    int8_t* o = out + r * gs.cols;
    for (int64_t g = 0; g < gs.groups_per_row; ++g) {
      const int32_t z = q.symmetric ? 0 : w->zeros[r * gs.groups_per_row + g];
      const auto vz = hn::Set(di, z);
      int64_t i = gs.begin(g);
      const int64_t end = gs.end(g);
      for (; i + N <= end; i += N) {
        const auto v =
            Centre(hn::PromoteTo(di, hn::LoadU(du8, codes.data() + i)), q.symmetric, vh, vz);
        hn::StoreU(hn::DemoteTo(d8, v), d8, o + i);
      }
      for (; i < end; ++i) {
        o[i] = static_cast<int8_t>(q.symmetric ? sign_extend(codes[i], q.bits)
                                               : static_cast<int32_t>(codes[i]) - z);
      }
    }
  }
}

// Activation rows sharing one decode of the weight. 4 on every target: the 4-bit path reads
// x's even and odd halves of R rows, 2 R streams whose rows lie a power of two apart (K / 2
// floats) and so share an L1 set; at R = 8 the 16 streams overran the set's 8 ways and
// M = 8 and 16 ran at a third of M = 4's rate per row.
constexpr int64_t kRowBlock = 4;

// The K tile of the weight-only kernel: x's tile for a block of rows stays in L1 while a
// block of output columns runs over it.
constexpr int64_t kTile = 512;
constexpr int64_t kColBlock = 16;

// Columns [c0, c1) of one output column n for rows mb .. mb + R - 1: each group's products
// accumulate in R vectors, which are scaled by the group's scale and added into the running
// vectors `tot` (R x Lanes floats) and scalar tails `tails` (R floats). xe/xo: x's even and
// odd columns (the 4-bit path; NULL otherwise).
template <int R>
HWY_INLINE void WeightOnlyTile(const float* x, int64_t mb, const IntWeight* w, const float* xe,
                               const float* xo, int64_t n, int64_t t0, int64_t t1, float* tot,
                               float* tails, uint8_t* chunk) {
  const DF d;
  const DI di;
  const DU8 du8;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const Groups& gs = w->gs;
  const IntScheme& q = w->q;
  const int64_t K = gs.cols;
  const int64_t half = K / 2;
  const int64_t stride = weight_only_row_stride(K);
  const auto vh = hn::Set(di, static_cast<int32_t>(1u << (q.bits - 1)));
  const auto mask4 = hn::Set(du8, uint8_t{0x0F});
  hn::Vec<DF> total[R];
  for (int r = 0; r < R; ++r) total[r] = hn::LoadU(d, tot + r * N);
  for (int64_t c0 = t0; c0 < t1;) {
    const int64_t g = c0 / gs.group;
    const int64_t c1 = std::min(t1, (g + 1) * gs.group);
    const float s = w->scales[n * gs.groups_per_row + g];
    const int32_t z = q.symmetric ? 0 : w->zeros[n * gs.groups_per_row + g];
    const auto vz = hn::Set(di, z);
    hn::Vec<DF> acc[R];
    for (int r = 0; r < R; ++r) acc[r] = hn::Zero(d);
    float tail[R];
    for (int r = 0; r < R; ++r) tail[r] = 0.0f;
    int64_t c = c0;
    if (xe != nullptr) {
      // Byte j of the row holds columns 2j (low nibble) and 2j + 1 (high nibble).
      const uint8_t* bytes = w->packed + n * half;
      int64_t j = c0 / 2;
      const int64_t j1 = c1 / 2;
      // The odd columns accumulate apart from the even ones (two independent FMA chains per
      // row instead of one of twice the depth: at M = 1 the chain's latency bounded the
      // kernel); a group's two sums are added before its scale is applied.
      hn::Vec<DF> acc_hi[R];
      for (int r = 0; r < R; ++r) acc_hi[r] = hn::Zero(d);
      for (; j + N <= j1; j += N) {
        const auto b = hn::LoadU(du8, bytes + j);
        const auto lo =
            hn::ConvertTo(d, Centre(hn::PromoteTo(di, hn::And(b, mask4)), q.symmetric, vh, vz));
        const auto hi =
            hn::ConvertTo(d, Centre(hn::PromoteTo(di, hn::ShiftRight<4>(b)), q.symmetric, vh, vz));
        for (int r = 0; r < R; ++r) {
          const float* e = xe + (mb + r) * stride + j;
          const float* o = xo + (mb + r) * stride + j;
          acc[r] = hn::MulAdd(lo, hn::LoadU(d, e), acc[r]);
          acc_hi[r] = hn::MulAdd(hi, hn::LoadU(d, o), acc_hi[r]);
        }
      }
      for (int r = 0; r < R; ++r) acc[r] = hn::Add(acc[r], acc_hi[r]);
      c = 2 * j;
    } else {
      const uint8_t* codes = chunk;
      if (q.bits == 8) {
        codes = w->packed + n * K + c0;
      } else {
        unpack_codes(w->packed, static_cast<uint64_t>(n * K + c0), static_cast<uint64_t>(c1 - c0),
                     q.bits, w->packing, chunk);
      }
      int64_t i = 0;
      for (; i + N <= c1 - c0; i += N) {
        const auto v = hn::ConvertTo(
            d, Centre(hn::PromoteTo(di, hn::LoadU(du8, codes + i)), q.symmetric, vh, vz));
        for (int r = 0; r < R; ++r) {
          acc[r] = hn::MulAdd(v, hn::LoadU(d, x + (mb + r) * K + c0 + i), acc[r]);
        }
      }
      c = c0 + i;
    }
    for (; c < c1; ++c) {
      const uint32_t u = read_code(w->packed, static_cast<uint64_t>(n * K + c), q.bits, w->packing);
      const float v =
          static_cast<float>(q.symmetric ? sign_extend(u, q.bits) : static_cast<int32_t>(u) - z);
      for (int r = 0; r < R; ++r) tail[r] += v * x[(mb + r) * K + c];
    }
    const auto vs = hn::Set(d, s);
    for (int r = 0; r < R; ++r) {
      total[r] = hn::MulAdd(acc[r], vs, total[r]);
      tails[r] += s * tail[r];
    }
    c0 = c1;
  }
  for (int r = 0; r < R; ++r) hn::StoreU(total[r], d, tot + r * N);
}

template <int R>
HWY_INLINE void WeightOnlyRows(const float* x, int64_t mb, const IntWeight* w, const float* xe,
                               const float* xo, int64_t n, int64_t t0, int64_t t1, float* tot,
                               float* tails, uint8_t* chunk) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(DF()));
  WeightOnlyTile<R>(x, mb, w, xe, xo, n, t0, t1, tot + mb * N, tails + mb, chunk);
}

// Weight-only matmul of output columns [n0, n1), all m rows: blocks of kColBlock columns;
// for each K tile, every column of the block, every block of rows.
void WeightOnlyCols(const float* x, int64_t m, const IntWeight* w, const float* bias, float* y,
                    const float* xe, const float* xo, int64_t n0, int64_t n1) {
  const DF d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const int64_t K = w->gs.cols;
  HWY_ALIGN uint8_t chunk[kTile];
  // Running sums: per column of the block, per row, a vector and a scalar tail.
  std::vector<float> tot(static_cast<std::size_t>(kColBlock * m * N));
  std::vector<float> tails(static_cast<std::size_t>(kColBlock * m));
  for (int64_t nb = n0; nb < n1; nb += kColBlock) {
    const int64_t ncols = std::min(kColBlock, n1 - nb);
    std::fill(tot.begin(), tot.end(), 0.0f);
    std::fill(tails.begin(), tails.end(), 0.0f);
    for (int64_t t0 = 0; t0 < K; t0 += kTile) {
      const int64_t t1 = std::min(K, t0 + kTile);
      for (int64_t jn = 0; jn < ncols; ++jn) {
        float* tn = tot.data() + jn * m * N;
        float* ln = tails.data() + jn * m;
        int64_t mb = 0;
        for (; mb + kRowBlock <= m; mb += kRowBlock) {
          WeightOnlyRows<kRowBlock>(x, mb, w, xe, xo, nb + jn, t0, t1, tn, ln, chunk);
        }
        if (m - mb >= 4 && kRowBlock > 4) {
          WeightOnlyRows<4>(x, mb, w, xe, xo, nb + jn, t0, t1, tn, ln, chunk);
          mb += 4;
        }
        switch (m - mb) {
          case 3:
            WeightOnlyRows<3>(x, mb, w, xe, xo, nb + jn, t0, t1, tn, ln, chunk);
            break;
          case 2:
            WeightOnlyRows<2>(x, mb, w, xe, xo, nb + jn, t0, t1, tn, ln, chunk);
            break;
          case 1:
            WeightOnlyRows<1>(x, mb, w, xe, xo, nb + jn, t0, t1, tn, ln, chunk);
            break;
          default:
            break;
        }
      }
    }
    for (int64_t jn = 0; jn < ncols; ++jn) {
      const float b = bias != nullptr ? bias[nb + jn] : 0.0f;
      for (int64_t r = 0; r < m; ++r) {
        const float v = hn::GetLane(hn::SumOfLanes(d, hn::LoadU(d, tot.data() + (jn * m + r) * N)));
        y[r * w->gs.rows + nb + jn] = v + tails[static_cast<std::size_t>(jn * m + r)] + b;
      }
    }
  }
}

// x's even and odd columns, for the 4-bit path: xe[r, j] = x[r, 2j], xo[r, j] = x[r, 2j + 1].
void Deinterleave(const float* x, int64_t m, int64_t k, float* xe, float* xo) {
  const int64_t half = k / 2;
  const int64_t stride = weight_only_row_stride(k);
  for (int64_t r = 0; r < m; ++r) {
    const float* row = x + r * k;
    for (int64_t j = 0; j < half; ++j) {
      xe[r * stride + j] = row[2 * j];
      xo[r * stride + j] = row[2 * j + 1];
    }
  }
}

void EpilogueRows(const int32_t* acc, int64_t n, const float* sx, const float* sw,
                  const float* bias, bool first, float* y, int64_t r0, int64_t r1) {
  const DF d;
  const DI di;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  for (int64_t i = r0; i < r1; ++i) {
    const auto vx = hn::Set(d, sx[i]);
    const int32_t* a = acc + i * n;
    float* out = y + i * n;
    int64_t j = 0;
    for (; j + N <= n; j += N) {
      auto t = hn::Mul(hn::Mul(hn::ConvertTo(d, hn::LoadU(di, a + j)), hn::LoadU(d, sw + j)), vx);
      if (!first) {
        t = hn::Add(hn::LoadU(d, out + j), t);
      } else if (bias != nullptr) {
        t = hn::Add(t, hn::LoadU(d, bias + j));
      }
      hn::StoreU(t, d, out + j);
    }
    for (; j < n; ++j) {
      const float t = static_cast<float>(a[j]) * sw[j] * sx[i];
      out[j] = !first ? out[j] + t : (bias != nullptr ? t + bias[j] : t);
    }
  }
}

// Exact int8 dot products for the INT8 GEMM where oneDNN's kernels are not exact (CPUs
// without VNNI): acc[i, j] = sum over c in [k0, k0 + kg) of xq[i, c] * wq[j, c], rows
// [r0, r1), every column j < n; xq [m, k] and wq [n, k] row-major. Codes are widened to int16
// and multiplied pairwise into int32 (each pair at most 2 * 128 * 128 = 32768 in magnitude,
// exact in int32), so no intermediate saturates.
template <int R>
HWY_INLINE void Int8DotBlock(const int8_t* xq, const int8_t* wq, int64_t n, int64_t k, int64_t k0,
                             int64_t kg, int64_t i0, int32_t* acc) {
  const hn::ScalableTag<int16_t> d16;
  const hn::Rebind<int8_t, decltype(d16)> d8;
  const hn::Repartition<int32_t, decltype(d16)> d32;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d16));
  for (int64_t j = 0; j < n; ++j) {
    const int8_t* wr = wq + j * k + k0;
    hn::Vec<decltype(d32)> s0[R], s1[R];
    for (int r = 0; r < R; ++r) {
      s0[r] = hn::Zero(d32);
      s1[r] = hn::Zero(d32);
    }
    int64_t c = 0;
    for (; c + L <= kg; c += L) {
      const auto wv = hn::PromoteTo(d16, hn::LoadU(d8, wr + c));
      for (int r = 0; r < R; ++r) {
        const auto xv = hn::PromoteTo(d16, hn::LoadU(d8, xq + (i0 + r) * k + k0 + c));
        s0[r] = hn::ReorderWidenMulAccumulate(d32, xv, wv, s0[r], s1[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      int32_t t = hn::GetLane(hn::SumOfLanes(d32, hn::Add(s0[r], s1[r])));
      const int8_t* xr = xq + (i0 + r) * k + k0;
      for (int64_t cc = c; cc < kg; ++cc) t += int32_t{xr[cc]} * int32_t{wr[cc]};
      acc[(i0 + r) * n + j] = t;
    }
  }
}

void Int8DotRows(const int8_t* xq, const int8_t* wq, int64_t n, int64_t k, int64_t k0, int64_t kg,
                 int32_t* acc, int64_t r0, int64_t r1) {
  int64_t i = r0;
  for (; i + 4 <= r1; i += 4) Int8DotBlock<4>(xq, wq, n, k, k0, kg, i, acc);
  for (; i < r1; ++i) Int8DotBlock<1>(xq, wq, n, k, k0, kg, i, acc);
}

}  // namespace HWY_NAMESPACE
}  // namespace loom::quant
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "common/parallel_for.hpp"

namespace loom::quant {

HWY_EXPORT(QuantizeRows);
HWY_EXPORT(DequantizeRows);
HWY_EXPORT(WidenRows);
HWY_EXPORT(WeightOnlyCols);
HWY_EXPORT(Deinterleave);
HWY_EXPORT(EpilogueRows);
HWY_EXPORT(Int8DotRows);

namespace {

// Rows per parallel block: about 64 KiB of input, a multiple of the rows that start on a
// byte boundary.
std::size_t row_grain(int64_t cols, uint32_t bits) {
  const int64_t align = aligned_rows(cols, bits);
  int64_t rows = std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(cols, 1));
  rows = (rows + align - 1) / align * align;
  return static_cast<std::size_t>(rows);
}

}  // namespace

namespace {

// quantize_int over x of `source` storage; false when a row is not finite.
bool quantize_any(const void* x, int32_t source, const Groups& gs, const IntScheme& q,
                  int32_t packing, uint8_t* packed, float* scales, uint8_t* zeros) {
  const uint64_t total = static_cast<uint64_t>(gs.rows) * static_cast<uint64_t>(gs.cols);
  const uint64_t bytes = packed_size(total, q.bits);
  if (bytes == 0) return true;
  packed[bytes - 1] = 0;
  std::atomic<bool> bad{false};
  loom::plugins::parallel_for(
      static_cast<std::size_t>(gs.rows), row_grain(gs.cols, q.bits),
      [&](std::size_t b, std::size_t e) {
        if (!HWY_DYNAMIC_DISPATCH(QuantizeRows)(x, source, &gs, &q, packing, packed, scales, zeros,
                                                static_cast<int64_t>(b), static_cast<int64_t>(e))) {
          bad.store(true, std::memory_order_relaxed);
        }
      });
  return !bad.load();
}

}  // namespace

int64_t quantize_int(const float* x, const Groups& gs, const IntScheme& q, int32_t packing,
                     uint8_t* packed, float* scales, uint8_t* zeros) {
  if (quantize_any(x, kSourceF32, gs, q, packing, packed, scales, zeros)) return -1;
  return first_non_finite(x, gs.rows * gs.cols);
}

int64_t quantize_int16(const uint16_t* x, bool bf16, const Groups& gs, const IntScheme& q,
                       int32_t packing, uint8_t* packed, float* scales, uint8_t* zeros) {
  if (quantize_any(x, bf16 ? kSourceBf16 : kSourceF16, gs, q, packing, packed, scales, zeros)) {
    return -1;
  }
  // The first non-finite element: an all-ones exponent (bf16 0x7f80, float16 0x7c00).
  const uint16_t exp = bf16 ? 0x7f80u : 0x7c00u;
  for (int64_t i = 0; i < gs.rows * gs.cols; ++i) {
    if ((x[i] & exp) == exp) return i;
  }
  return -1;
}

void dequantize_int(const IntWeight& w, float* x) {
  loom::plugins::parallel_for(static_cast<std::size_t>(w.gs.rows), row_grain(w.gs.cols, 8),
                              [&](std::size_t b, std::size_t e) {
                                HWY_DYNAMIC_DISPATCH(DequantizeRows)
                                (&w, x, static_cast<int64_t>(b), static_cast<int64_t>(e));
                              });
}

void widen_to_int8(const IntWeight& w, int8_t* out) {
  // Up to 256 K codes (the trainer's layers) the widening takes microseconds: waking the pool
  // costs more than it saves.
  if (w.gs.rows * w.gs.cols <= (int64_t{1} << 18)) {
    HWY_DYNAMIC_DISPATCH(WidenRows)(&w, out, 0, w.gs.rows);
    return;
  }
  loom::plugins::parallel_for(static_cast<std::size_t>(w.gs.rows), row_grain(w.gs.cols, 8),
                              [&](std::size_t b, std::size_t e) {
                                HWY_DYNAMIC_DISPATCH(WidenRows)
                                (&w, out, static_cast<int64_t>(b), static_cast<int64_t>(e));
                              });
}

int64_t quantize_rows_int8(const float* x, int64_t rows, int64_t cols, int8_t* q, float* scales) {
  const IntScheme scheme{8, true, Range::kExact};
  return quantize_int(x, Groups::of(rows, cols, 0), scheme, LOOM_QUANT_PACK_LSB_FIRST,
                      reinterpret_cast<uint8_t*>(q), scales, nullptr);
}

void int8_epilogue(const int32_t* acc, int64_t m, int64_t n, const float* sx, const float* sw,
                   const float* bias, bool first, float* y) {
  const std::size_t grain =
      static_cast<std::size_t>(std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)));
  loom::plugins::parallel_for(
      static_cast<std::size_t>(m), grain, [&](std::size_t b, std::size_t e) {
        HWY_DYNAMIC_DISPATCH(EpilogueRows)
        (acc, n, sx, sw, bias, first, y, static_cast<int64_t>(b), static_cast<int64_t>(e));
      });
}

void int8_dot_exact(const int8_t* xq, const int8_t* wq, int64_t m, int64_t n, int64_t k, int64_t k0,
                    int64_t kg, int32_t* acc) {
  const std::size_t grain = static_cast<std::size_t>(
      std::max<int64_t>(4, (int64_t{1} << 18) / std::max<int64_t>(n * kg, 1)) / 4 * 4);
  loom::plugins::parallel_for(
      static_cast<std::size_t>(m), grain, [&](std::size_t b, std::size_t e) {
        HWY_DYNAMIC_DISPATCH(Int8DotRows)
        (xq, wq, n, k, k0, kg, acc, static_cast<int64_t>(b), static_cast<int64_t>(e));
      });
}

int64_t weight_only_workspace_floats(int64_t m, int64_t k) {
  return 2 * m * weight_only_row_stride(k);
}

void matmul_weight_only(const float* x, int64_t m, const IntWeight& w, const float* bias, float* y,
                        float* workspace) {
  const Groups& gs = w.gs;
  const int64_t K = gs.cols;
  // Two codes per byte with every group starting on a byte: the nibble path.
  const bool nibbles =
      w.q.bits == 4 && w.packing == LOOM_QUANT_PACK_LSB_FIRST && K % 2 == 0 && gs.group % 2 == 0;
  std::vector<float> own;
  const float* xe = nullptr;
  const float* xo = nullptr;
  if (nibbles && m > 0) {
    if (workspace == nullptr) {
      own.resize(static_cast<std::size_t>(weight_only_workspace_floats(m, K)));
      workspace = own.data();
    }
    xe = workspace;
    xo = workspace + m * weight_only_row_stride(K);
    HWY_DYNAMIC_DISPATCH(Deinterleave)
    (x, m, K, workspace, workspace + m * weight_only_row_stride(K));
  }
  if (m == 0) return;
  // About 64 K weights per block (a block of kColBlock columns at K = 4096): few enough
  // blocks that handing them out costs nothing next to streaming them.
  const std::size_t grain =
      static_cast<std::size_t>(std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1)));
  loom::plugins::parallel_for(
      static_cast<std::size_t>(gs.rows), grain, [&](std::size_t b, std::size_t e) {
        HWY_DYNAMIC_DISPATCH(WeightOnlyCols)
        (x, m, &w, bias, y, xe, xo, static_cast<int64_t>(b), static_cast<int64_t>(e));
      });
}

}  // namespace loom::quant
#endif  // HWY_ONCE
