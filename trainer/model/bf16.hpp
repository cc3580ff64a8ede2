// bfloat16 in the trainer: the conversions its bf16 mode ([train] precision = "bf16") and the
// bf16 gradient wire ([gradients] wire = "bf16") use. Integer-only, so the result does not
// depend on the compiler's floating-point flags or the CPU: round to nearest, ties to even;
// a NaN stays a (quiet) NaN of the same sign, an infinity stays an infinity, a finite value
// that rounds past the largest bf16 becomes an infinity (as IEEE rounding does).
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

namespace loom::trainer {

inline uint16_t to_bf16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  // A NaN: keep the sign and the top of the payload, and set the quiet bit (a payload held
  // only in the low 16 bits would otherwise round to an infinity).
  if ((x & 0x7fffffffU) > 0x7f800000U) return static_cast<uint16_t>((x >> 16) | 0x40);
  return static_cast<uint16_t>((x + 0x7fffU + ((x >> 16) & 1U)) >> 16);
}

inline float from_bf16(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

// f rounded to the nearest bf16, as a float (exactly representable in bf16).
inline float round_bf16(float f) { return from_bf16(to_bf16(f)); }

// p[i] = round_bf16(p[i]) for i < n (the loop vectorises: no branch but the NaN select).
inline void round_bf16_span(float* p, size_t n) {
  for (size_t i = 0; i < n; ++i) p[i] = round_bf16(p[i]);
}

}  // namespace loom::trainer
