// CUDA emulation (tests/cuda_emulation, LOOM_CUDA_EMULATION=ON): __half as Loom's kernels use
// it, a storage type plus the exact conversions (round to nearest even, NVIDIA's NaN).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
struct __half {
  uint16_t bits;
};
inline __half __ushort_as_half(uint16_t h) { return {h}; }
inline uint16_t __half_as_ushort(__half h) { return h.bits; }
inline float __half2float(__half h) {
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  const uint32_t e = (h.bits >> 10) & 0x1fu;
  const uint32_t m = h.bits & 0x3ffu;
  float f;
  if (e == 0) {
    f = std::ldexp(static_cast<float>(m), -24);  // zero or subnormal, exact
    if (sign) f = -f;
    return f;
  }
  uint32_t u;
  if (e == 31)
    u = sign | 0x7f800000u | (m << 13);
  else
    u = sign | ((e + 112u) << 23) | (m << 13);
  std::memcpy(&f, &u, 4);
  return f;
}
inline __half __float2half_rn(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return {static_cast<uint16_t>(0x7fffu)};  // NVIDIA canonical NaN
  if (ax == 0x7f800000u) return {static_cast<uint16_t>(sign | 0x7c00u)};
  if (ax >= 0x477ff000u) return {static_cast<uint16_t>(sign | 0x7c00u)};  // rounds to inf
  float a;
  std::memcpy(&a, &ax, 4);
  if (ax < 0x38800000u) {  // below the smallest normal half: multiples of 2^-24
    const double q = std::nearbyint(static_cast<double>(a) * 16777216.0);
    return {static_cast<uint16_t>(sign | static_cast<uint16_t>(q))};
  }
  const uint32_t mant = ax & 0x7fffffu;
  const uint32_t exp = (ax >> 23) - 127u + 15u;
  uint32_t h = (exp << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return {static_cast<uint16_t>(sign | h)};
}
