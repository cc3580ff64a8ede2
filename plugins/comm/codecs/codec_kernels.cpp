// CPU kernels of the bundled codecs; see codec_kernels.hpp for the exact semantics.
// Highway compiles the per-target part of this file once per SIMD target and picks the best
// one the CPU supports at run time.
#include "codec_kernels.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/parallel_for.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "codec_kernels.cpp"
#include <hwy/cache_control.h>
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace loom::codecs {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Reverses the bit order inside each byte of w (8 bytes at once; bytes are loaded and stored
// little-endian, as on every supported target).
inline uint64_t ReverseBitsInBytes(uint64_t w) {
  w = (w >> 4 & 0x0F0F0F0F0F0F0F0Full) | (w & 0x0F0F0F0F0F0F0F0Full) << 4;
  w = (w >> 2 & 0x3333333333333333ull) | (w & 0x3333333333333333ull) << 2;
  return (w >> 1 & 0x5555555555555555ull) | (w & 0x5555555555555555ull) << 1;
}

// The sum of squares of one full block of kNormBlock elements, lane structure of 16.
float BlockSumSquares(const float* HWY_RESTRICT x, const float* HWY_RESTRICT e) {
  const hn::CappedTag<float, kNormLanes> d;
  using V = hn::Vec<decltype(d)>;
  const size_t L = hn::Lanes(d);
  const size_t per_row = kNormLanes / L;
  V acc[kNormLanes];
  for (size_t v = 0; v < per_row; ++v) acc[v] = hn::Zero(d);
  constexpr size_t kRows = kNormBlock / kNormLanes;
  if (e != nullptr) {
    for (size_t row = 0; row < kRows; ++row) {
      for (size_t v = 0; v < per_row; ++v) {
        const size_t i = row * kNormLanes + v * L;
        const V b = hn::Add(hn::LoadU(d, x + i), hn::LoadU(d, e + i));
        acc[v] = hn::Add(acc[v], hn::Mul(b, b));
      }
    }
  } else {
    for (size_t row = 0; row < kRows; ++row) {
      for (size_t v = 0; v < per_row; ++v) {
        const V b = hn::LoadU(d, x + row * kNormLanes + v * L);
        acc[v] = hn::Add(acc[v], hn::Mul(b, b));
      }
    }
  }
  float lanes[kNormLanes];
  for (size_t v = 0; v < per_row; ++v) hn::StoreU(acc[v], d, lanes + v * L);
  for (size_t step = kNormLanes / 2; step >= 1; step /= 2) {
    for (size_t i = 0; i < step; ++i) lanes[i] = lanes[i] + lanes[i + step];
  }
  return lanes[0];
}

// The mask's lanes as bits, lane 0 in bit 0.
template <class D, class M>
inline uint64_t MaskBits(D d, M m) {
  uint8_t bytes[8] = {};
  hn::StoreMaskBits(d, m, bytes);
  uint64_t w = 0;
  const size_t L = hn::Lanes(d);
  std::memcpy(&w, bytes, (L + 7) / 8);
  if (L < 64) w &= (uint64_t{1} << L) - 1;
  return w;
}

void SignPack(const float* HWY_RESTRICT x, float* HWY_RESTRICT e, size_t n, float scale,
              uint8_t* HWY_RESTRICT bits) {
  const hn::ScalableTag<float> d;
  const size_t L = hn::Lanes(d);
  const auto zero = hn::Zero(d);
  const auto pos = hn::Set(d, scale);
  const auto neg = hn::Set(d, -scale);
  size_t i = 0;
  if (L <= 64 && 64 % L == 0) {
    for (; i + 64 <= n; i += 64) {
      uint64_t word = 0;
      for (size_t k = 0; k < 64; k += L) {
        auto b = hn::LoadU(d, x + i + k);
        if (e != nullptr) b = hn::Add(b, hn::LoadU(d, e + i + k));
        const auto m = hn::Ge(b, zero);
        if (e != nullptr) hn::StoreU(hn::Sub(b, hn::IfThenElse(m, pos, neg)), d, e + i + k);
        word |= MaskBits(d, m) << k;
      }
      word = ReverseBitsInBytes(word);  // lane order -> MSB-first in each byte
      std::memcpy(bits + i / 8, &word, sizeof(word));
    }
  }
  for (; i < n; i += 8) {
    uint8_t byte = 0;
    for (size_t j = 0; j < 8; ++j) {
      const float b = e != nullptr ? x[i + j] + e[i + j] : x[i + j];
      const bool bit = b >= 0.0f;
      byte = static_cast<uint8_t>(byte | (bit ? 1u : 0u) << (7 - j));
      if (e != nullptr) e[i + j] = b - (bit ? scale : -scale);
    }
    bits[i / 8] = byte;
  }
}

void Unpack(const uint8_t* HWY_RESTRICT bits, size_t n, float v, bool accumulate,
            float* HWY_RESTRICT out, bool nontemporal) {
  const hn::ScalableTag<float> d;
  const size_t L = hn::Lanes(d);
  const auto pos = hn::Set(d, v);
  const auto neg = hn::Set(d, -v);
  size_t i = 0;
  // Streaming stores skip the read-for-ownership of an output that will not stay in cache.
  const bool stream =
      nontemporal && !accumulate && reinterpret_cast<uintptr_t>(out) % (L * sizeof(float)) == 0;
  if (L <= 64 && 64 % L == 0) {
    for (; i + 64 <= n; i += 64) {
      uint64_t word;
      std::memcpy(&word, bits + i / 8, sizeof(word));
      word = ReverseBitsInBytes(word);  // MSB-first bytes -> lane order
      for (size_t k = 0; k < 64; k += L) {
        uint8_t mb[8];
        const uint64_t w = word >> k;
        std::memcpy(mb, &w, sizeof(mb));
        const auto m = hn::LoadMaskBits(d, mb);
        auto val = hn::IfThenElse(m, pos, neg);
        if (accumulate) val = hn::Add(hn::LoadU(d, out + i + k), val);
        if (stream) {
          hn::Stream(val, d, out + i + k);
        } else {
          hn::StoreU(val, d, out + i + k);
        }
      }
    }
    if (stream) hwy::FlushStream();
  }
  for (; i < n; ++i) {
    const bool bit = ((bits[i / 8] >> (7 - i % 8)) & 1u) != 0;
    const float val = bit ? v : -v;
    out[i] = accumulate ? out[i] + val : val;
  }
}

// Unpack of `count` chunks summed in chunk order (count >= 1); `words` is scratch for count
// 64-bit words.
void UnpackSum(const uint8_t* const* HWY_RESTRICT bits, const float* HWY_RESTRICT v, size_t count,
               size_t n, bool accumulate, float* HWY_RESTRICT out, bool nontemporal,
               uint64_t* HWY_RESTRICT words) {
  const hn::ScalableTag<float> d;
  const size_t L = hn::Lanes(d);
  size_t i = 0;
  const bool stream =
      nontemporal && !accumulate && reinterpret_cast<uintptr_t>(out) % (L * sizeof(float)) == 0;
  if (L <= 64 && 64 % L == 0) {
    for (; i + 64 <= n; i += 64) {
      for (size_t j = 0; j < count; ++j) {
        uint64_t w;
        std::memcpy(&w, bits[j] + i / 8, sizeof(w));
        words[j] = ReverseBitsInBytes(w);  // MSB-first bytes -> lane order
      }
      for (size_t k = 0; k < 64; k += L) {
        auto acc = hn::Zero(d);
        for (size_t j = 0; j < count; ++j) {
          uint8_t mb[8];
          const uint64_t w = words[j] >> k;
          std::memcpy(mb, &w, sizeof(mb));
          const auto val =
              hn::IfThenElse(hn::LoadMaskBits(d, mb), hn::Set(d, v[j]), hn::Set(d, -v[j]));
          // The first term starts the sum (or is added to out), as unpack without / with
          // accumulate would do, so the rounding matches chunk-by-chunk decoding exactly.
          if (j == 0) {
            acc = accumulate ? hn::Add(hn::LoadU(d, out + i + k), val) : val;
          } else {
            acc = hn::Add(acc, val);
          }
        }
        if (stream) {
          hn::Stream(acc, d, out + i + k);
        } else {
          hn::StoreU(acc, d, out + i + k);
        }
      }
    }
    if (stream) hwy::FlushStream();
  }
  for (; i < n; ++i) {
    float acc = 0.0f;
    for (size_t j = 0; j < count; ++j) {
      const bool bit = ((bits[j][i / 8] >> (7 - i % 8)) & 1u) != 0;
      const float val = bit ? v[j] : -v[j];
      acc = j == 0 ? (accumulate ? out[i] + val : val) : acc + val;
    }
    out[i] = acc;
  }
}

// ef8 pass 1: max |x + e|; false when a value is not finite.
bool MaxAbs(const float* HWY_RESTRICT x, const float* HWY_RESTRICT e, size_t n,
            float* HWY_RESTRICT max_abs) {
  const hn::ScalableTag<float> d;
  const size_t L = hn::Lanes(d);
  const auto limit = hn::Set(d, 3.402823466e38f);
  auto m = hn::Zero(d);
  auto ok = hn::Eq(m, m);  // all true
  size_t i = 0;
  for (; i + L <= n; i += L) {
    auto b = hn::LoadU(d, x + i);
    if (e != nullptr) b = hn::Add(b, hn::LoadU(d, e + i));
    const auto a = hn::Abs(b);
    ok = hn::And(ok, hn::Le(a, limit));  // false for inf and NaN
    m = hn::Max(m, a);
  }
  float lanes[64];
  hn::StoreU(m, d, lanes);
  float best = 0.0f;
  bool finite = hn::AllTrue(d, ok);
  for (size_t k = 0; k < L; ++k) best = lanes[k] > best ? lanes[k] : best;
  for (; i < n; ++i) {
    const float a = std::fabs(e != nullptr ? x[i] + e[i] : x[i]);
    finite &= a <= 3.402823466e38f;
    best = a > best ? a : best;
  }
  *max_abs = best;
  return finite;
}

// ef8 pass 2: q = clamp(round_even(b * inv), +-127), e = b - q * scale.
void Quantize(const float* HWY_RESTRICT x, float* HWY_RESTRICT e, size_t n, float max_abs,
              int8_t* HWY_RESTRICT q) {
  const float scale = max_abs / 127.0f;
  const float inv = max_abs > 0.0f ? 127.0f / max_abs : 0.0f;
  const hn::ScalableTag<float> d;
  const hn::Rebind<int32_t, decltype(d)> di;
  const hn::Rebind<int8_t, decltype(d)> d8;
  const size_t L = hn::Lanes(d);
  const auto vinv = hn::Set(d, inv);
  const auto vscale = hn::Set(d, scale);
  const auto hi = hn::Set(d, 127.0f);
  const auto lo = hn::Set(d, -127.0f);
  size_t i = 0;
  for (; i + L <= n; i += L) {
    auto b = hn::LoadU(d, x + i);
    if (e != nullptr) b = hn::Add(b, hn::LoadU(d, e + i));
    const auto r = hn::Min(hn::Max(hn::Round(hn::Mul(b, vinv)), lo), hi);
    hn::StoreU(hn::DemoteTo(d8, hn::ConvertTo(di, r)), d8, q + i);
    if (e != nullptr) hn::StoreU(hn::Sub(b, hn::Mul(r, vscale)), d, e + i);
  }
  for (; i < n; ++i) {
    const float b = e != nullptr ? x[i] + e[i] : x[i];
    float r = std::nearbyint(b * inv);
    r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
    q[i] = static_cast<int8_t>(r);
    if (e != nullptr) e[i] = b - r * scale;
  }
}

const char* TargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace loom::codecs
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace loom::codecs {

HWY_EXPORT(BlockSumSquares);
HWY_EXPORT(SignPack);
HWY_EXPORT(Unpack);
HWY_EXPORT(UnpackSum);
HWY_EXPORT(TargetName);
HWY_EXPORT(MaxAbs);
HWY_EXPORT(Quantize);

namespace {

// The partial block at the end, in the same lane order as a full one.
float tail_sum_squares(const float* x, const float* e, std::size_t n) {
  float lanes[kNormLanes] = {};
  for (std::size_t i = 0; i < n; ++i) {
    const float b = e != nullptr ? x[i] + e[i] : x[i];
    lanes[i % kNormLanes] = lanes[i % kNormLanes] + b * b;
  }
  for (std::size_t step = kNormLanes / 2; step >= 1; step /= 2) {
    for (std::size_t i = 0; i < step; ++i) lanes[i] = lanes[i] + lanes[i + step];
  }
  return lanes[0];
}

}  // namespace

double onebit_sum_squares(const float* x, const float* e, std::size_t n) {
  const std::size_t blocks = (n + kNormBlock - 1) / kNormBlock;
  std::vector<float> partial(blocks);
  auto fn = HWY_DYNAMIC_DISPATCH(BlockSumSquares);
  loom::plugins::parallel_for(blocks, 16, [&](std::size_t b0, std::size_t b1) {
    for (std::size_t b = b0; b < b1; ++b) {
      const std::size_t at = b * kNormBlock;
      const float* eb = e != nullptr ? e + at : nullptr;
      partial[b] = at + kNormBlock <= n ? fn(x + at, eb) : tail_sum_squares(x + at, eb, n - at);
    }
  });
  double total = 0.0;
  for (std::size_t s = 0; s < blocks; s += kNormSuper) {
    double super = 0.0;
    const std::size_t end = std::min(blocks, s + kNormSuper);
    for (std::size_t b = s; b < end; ++b) super += static_cast<double>(partial[b]);
    total += super;
  }
  return total;
}

float onebit_scale(double sum_squares, std::size_t n) {
  if (n == 0) return 0.0f;
  return static_cast<float>(std::sqrt(sum_squares / static_cast<double>(n)));
}

void onebit_sign_pack(const float* x, float* e, std::size_t n, float scale, uint8_t* bits) {
  HWY_DYNAMIC_DISPATCH(SignPack)(x, e, n, scale, bits);
}

void onebit_unpack(const uint8_t* bits, std::size_t n, float v, bool accumulate, float* out,
                   bool nontemporal) {
  HWY_DYNAMIC_DISPATCH(Unpack)(bits, n, v, accumulate, out, nontemporal);
}

void onebit_unpack_sum(const uint8_t* const* bits, const float* v, std::size_t count, std::size_t n,
                       bool accumulate, float* out, bool nontemporal) {
  if (count == 0) {
    if (!accumulate) std::fill(out, out + n, 0.0f);
    return;
  }
  std::vector<uint64_t> words(count);
  HWY_DYNAMIC_DISPATCH(UnpackSum)(bits, v, count, n, accumulate, out, nontemporal, words.data());
}

const char* simd_target_name() { return HWY_DYNAMIC_DISPATCH(TargetName)(); }

// ---- ef8

bool ef8_max_abs(const float* x, const float* e, std::size_t n, float* max_abs) {
  return HWY_DYNAMIC_DISPATCH(MaxAbs)(x, e, n, max_abs);
}

void ef8_quantize(const float* x, float* e, std::size_t n, float max_abs, int8_t* q) {
  HWY_DYNAMIC_DISPATCH(Quantize)(x, e, n, max_abs, q);
}

void ef8_dequantize(const int8_t* q, std::size_t n, float v, bool accumulate, float* out) {
  if (accumulate) {
    for (std::size_t i = 0; i < n; ++i) out[i] = out[i] + v * static_cast<float>(q[i]);
  } else {
    for (std::size_t i = 0; i < n; ++i) out[i] = v * static_cast<float>(q[i]);
  }
}

}  // namespace loom::codecs
#endif  // HWY_ONCE
