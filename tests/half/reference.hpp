// Reference conversions for the half tests, written from the definitions in exact double
// arithmetic (no bit tricks shared with plugins/common/half.hpp), and the float inputs the
// tests feed both the reference and the code under test.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace half_ref {

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline bool is_nan_bits(uint32_t x) { return (x & 0x7fffffffu) > 0x7f800000u; }

// The exact value of a finite fp16 pattern.
inline double f16_value(uint16_t h) {
  const int e = (h >> 10) & 0x1f;
  const int m = h & 0x3ff;
  const double v = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return (h & 0x8000) != 0 ? -v : v;
}

// fp32 -> fp16 for a non-NaN input: |x| / ulp rounded to nearest even, in double.
inline uint16_t to_f16(float f) {
  const uint32_t x = bits_of(f);
  const auto sign = static_cast<uint16_t>((x & 0x80000000u) != 0 ? 0x8000u : 0u);
  if (is_nan_bits(x)) {
    return static_cast<uint16_t>(sign | 0x7c00 | 0x200 | ((x >> 13) & 0x3ff));
  }
  const double a = std::fabs(static_cast<double>(f));
  if (std::isinf(a)) return static_cast<uint16_t>(sign | 0x7c00);
  if (a == 0.0) return sign;
  int e2 = std::ilogb(a);                                   // a in [2^e2, 2^(e2 + 1))
  if (e2 < -14) e2 = -14;                                   // the subnormal spacing
  const double q = std::nearbyint(std::ldexp(a, 10 - e2));  // exact scaling; ties to even
  const double r = std::ldexp(q, e2 - 10);                  // the rounded magnitude
  if (r >= 65536.0) return static_cast<uint16_t>(sign | 0x7c00);
  // Encode r (an fp16 value by construction).
  if (r < std::ldexp(1.0, -14)) return static_cast<uint16_t>(sign | static_cast<uint16_t>(q));
  const int e = std::ilogb(r);
  const auto m = static_cast<uint16_t>(std::ldexp(r, 10 - e) - 1024.0);
  return static_cast<uint16_t>(sign | ((e + 15) << 10) | m);
}

// fp32 -> bf16: |x| / ulp rounded to nearest even, in double.
inline uint16_t to_bf16(float f) {
  const uint32_t x = bits_of(f);
  const auto sign = static_cast<uint16_t>((x & 0x80000000u) != 0 ? 0x8000u : 0u);
  if (is_nan_bits(x)) return static_cast<uint16_t>((x >> 16) | 0x40);
  const double a = std::fabs(static_cast<double>(f));
  if (std::isinf(a)) return static_cast<uint16_t>(sign | 0x7f80);
  if (a == 0.0) return sign;
  int e2 = std::ilogb(a);
  if (e2 < -126) e2 = -126;  // fp32 (and bf16) subnormal spacing: 2^-133
  const double q = std::nearbyint(std::ldexp(a, 7 - e2));
  const double r = std::ldexp(q, e2 - 7);
  if (r >= std::ldexp(1.0, 128)) return static_cast<uint16_t>(sign | 0x7f80);
  const auto rf = static_cast<float>(r);  // exact: r is a bf16 value
  return static_cast<uint16_t>(sign | (bits_of(rf) >> 16));
}

// Float bit patterns that probe every rounding case: for each exponent and sign, mantissas
// whose dropped bits are 0, 1, just below / at / just above the halfway point and all ones
// (for both the fp16 (13 dropped bits) and bf16 (16 dropped bits) boundaries), with kept bits
// even and odd; every pattern around the fp16 overflow edge and the subnormal range; NaN
// payloads; and a stride through all 2^32 patterns plus random ones.
inline std::vector<uint32_t> probe_floats() {
  std::vector<uint32_t> v;
  const uint32_t low13[] = {0x0, 0x1, 0xfff, 0x1000, 0x1001, 0x1fff};
  const uint32_t low16[] = {0x0, 0x1, 0x7fff, 0x8000, 0x8001, 0xffff};
  for (uint32_t sign = 0; sign < 2; ++sign) {
    for (uint32_t e = 0; e < 256; ++e) {
      const uint32_t base = (sign << 31) | (e << 23);
      // fp16's exponent range (and the subnormal/underflow range below it): all 1024 kept
      // mantissa values; elsewhere a spread of them.
      const bool f16_range = e >= 100 && e <= 145;
      for (uint32_t k = 0; k < 1024; k += f16_range ? 1 : 37) {
        for (uint32_t lo : low13) v.push_back(base | (k << 13) | lo);
      }
      for (uint32_t k = 0; k < 128; ++k) {
        for (uint32_t lo : low16) v.push_back(base | (k << 16) | lo);
      }
    }
  }
  for (uint32_t x = 0x477fe000u; x <= 0x47800000u; ++x) {  // 65504 .. 65536: the overflow edge
    v.push_back(x);
    v.push_back(x | 0x80000000u);
  }
  for (uint32_t x = 0x7f7f0000u; x <= 0x7f800000u; ++x) v.push_back(x);            // bf16's edge
  for (uint32_t x = 0x33000000u - 64; x <= 0x33000000u + 64; ++x) v.push_back(x);  // 2^-25
  for (uint32_t m = 1; m < 0x800000u; m = m * 3 + 1) {  // NaN payloads, both signs, both kinds
    v.push_back(0x7f800000u | m);
    v.push_back(0xff800000u | m);
    v.push_back(0x7fc00000u | m);
  }
  for (uint64_t x = 0; x <= 0xffffffffull; x += 4093) v.push_back(static_cast<uint32_t>(x));
  std::mt19937 rng(20261201);
  for (int i = 0; i < 200000; ++i) v.push_back(static_cast<uint32_t>(rng()));
  return v;
}

}  // namespace half_ref
