// Ternary (2-bit, TWN) weights of the xtc quantizer. Groups as in binary.hpp. Per group,
// Delta = threshold * mean |w| (float32: the group's fixed-order sum of |w| divided by its
// length, times threshold), the kept weights are those with |w| > Delta, and alpha = the mean
// |w| of the kept ones (0 when none is kept). Codes (loom/quant_format.h TERNARY): 0 -> 0
// (|w| <= Delta), 1 -> +alpha (w > Delta), 2 -> -alpha (w < -Delta); 3 is invalid. Two bits
// per element, LSB first: element i in bits 2 (i % 4) .. 2 (i % 4) + 1 of byte i / 4.
#pragma once

#include <cstdint>

#include <loom/quantizers/binary.hpp>

namespace loom::quant {

// --- scalar reference ----------------------------------------------------------------------

// Codes (packed_bytes_of(s, 2) bytes, written whole) and scales alpha (s.groups()); threshold
// > 0. Returns the row-major index of the first non-finite weight; else s.numel() + g for the
// first group g whose Delta (threshold * mean |w|) overflows float32; else -1 (as binary.hpp).
int64_t ternary_quantize_ref(const float* w, const GroupedShape& s, float threshold,
                             uint8_t* packed, float* scales);
// Returns the row-major index of the first code 3 (w then unspecified), or -1.
int64_t ternary_dequantize_ref(const uint8_t* packed, const float* scales, const GroupedShape& s,
                               float* w);
// y [m, rows] = x . W^T (+ bias): per group alpha * (sum of x where code 1 - sum where code 2).
// Returns the index of the first code 3, or -1.
int64_t ternary_matmul_ref(const float* x, int64_t m, const uint8_t* packed, const float* scales,
                           const GroupedShape& s, const float* bias, float* y);

// --- fast CPU kernels (Highway, run-time dispatch, over the host pool) ---------------------

int64_t ternary_quantize(const float* w, const GroupedShape& s, float threshold, uint8_t* packed,
                         float* scales);
// w holds bf16 (bf16 true) or float16 patterns: the codes, scales and first bad element of
// ternary_quantize on their float32 widening, without a float32 copy of w.
int64_t ternary_quantize16(const uint16_t* w, bool bf16, const GroupedShape& s, float threshold,
                           uint8_t* packed, float* scales);
int64_t ternary_dequantize(const uint8_t* packed, const float* scales, const GroupedShape& s,
                           float* w);
int64_t ternary_matmul(const float* x, int64_t m, const uint8_t* packed, const float* scales,
                       const GroupedShape& s, const float* bias, float* y);

}  // namespace loom::quant
