// fp16 (IEEE binary16) and bf16 <-> fp32 conversions for every bundled plugin, on the host and
// (compiled by nvcc, or by the CUDA emulation) in device code. Integer arithmetic only, so the
// result does not depend on the floating-point environment (rounding mode, flush-to-zero,
// -use_fast_math) and the host and device paths give the same bits.
//
// The rule, for every conversion here:
//   - fp32 -> fp16 / bf16 rounds to nearest, ties to even.
//   - A NaN stays a NaN: the result is a quiet NaN with the input's sign and the leading
//     payload bits that fit (the quiet bit set, the rest truncated). A signalling NaN
//     therefore comes back quiet, as IEEE 754 requires of a narrowing conversion.
//   - Values whose magnitude rounds above the largest finite value become +-Inf (fp16: from
//     65520 = 65504 + half an ulp up, a tie that rounds to the even Inf); +-Inf stays +-Inf.
//   - fp16 subnormals are produced and read exactly (no flush to zero); fp32 values below
//     half the smallest fp16 subnormal (2^-25, itself a tie to 0) become a signed zero.
//   - fp16 / bf16 -> fp32 is exact for every pattern, NaN payloads and signalling bits
//     included, so fp16/bf16 -> fp32 -> fp16/bf16 returns every pattern unchanged except a
//     signalling NaN, which returns with its quiet bit set.
#ifndef LOOM_PLUGINS_COMMON_HALF_HPP
#define LOOM_PLUGINS_COMMON_HALF_HPP

#include <stdint.h>

#include <cstring>

#if defined(__CUDACC__)
#define LOOM_HALF_FN __host__ __device__ __forceinline__
#else
#define LOOM_HALF_FN inline
#endif

namespace loom::plugins::half {

LOOM_HALF_FN uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u = 0;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

LOOM_HALF_FN float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f = 0.0f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// ---- fp16
LOOM_HALF_FN uint16_t f32_bits_to_f16(uint32_t x) {
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) {  // NaN: quiet, sign and leading payload kept
    return static_cast<uint16_t>(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
  }
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520, or Inf
  if (ax >= 0x38800000u) {                                              // >= 2^-14: a normal half
    // Add just under half an ulp (plus one when the kept part is odd), then rebias the
    // exponent from 127 to 15; a carry out of the mantissa moves to the next binade.
    const uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u) - (112u << 23);
    return static_cast<uint16_t>(sign | (r >> 13));
  }
  if (ax <= 0x33000000u) return static_cast<uint16_t>(sign);  // <= 2^-25: a signed zero
  // A half subnormal: q = |x| / 2^-24 rounded to nearest even. |x| = m * 2^(e - 150) with the
  // 24-bit significand m and 102 <= e <= 112, so q = m >> (126 - e), 14 <= shift <= 24.
  const uint32_t e = ax >> 23;
  const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - e;
  uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t halfway = 1u << (shift - 1u);
  if (rem > halfway || (rem == halfway && (q & 1u) != 0)) ++q;  // 0x400: the smallest normal
  return static_cast<uint16_t>(sign | q);
}

LOOM_HALF_FN uint32_t f16_to_f32_bits(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) return sign | 0x7f800000u | (mant << 13);  // Inf, NaN (payload kept)
  if (exp != 0) return sign | ((exp + 112u) << 23) | (mant << 13);
  if (mant == 0) return sign;
  // Subnormal: mant * 2^-24, normalised (the leading one moved to bit 10).
  uint32_t e = 113u;
  while ((mant & 0x400u) == 0) {
    mant <<= 1;
    --e;
  }
  return sign | (e << 23) | ((mant & 0x3ffu) << 13);
}

LOOM_HALF_FN uint16_t f32_to_f16(float f) { return f32_bits_to_f16(float_bits(f)); }
LOOM_HALF_FN float f16_to_f32(uint16_t h) { return bits_float(f16_to_f32_bits(h)); }

// ---- bf16 (the upper half of an fp32)
LOOM_HALF_FN uint16_t f32_bits_to_bf16(uint32_t x) {
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // NaN
  // Ties to even; a finite value rounding past the largest bf16 carries into the Inf pattern.
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

LOOM_HALF_FN uint16_t f32_to_bf16(float f) { return f32_bits_to_bf16(float_bits(f)); }
LOOM_HALF_FN float bf16_to_f32(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

}  // namespace loom::plugins::half

#undef LOOM_HALF_FN

#endif  // LOOM_PLUGINS_COMMON_HALF_HPP
