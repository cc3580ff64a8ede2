// Declared public interface of loom_quant_core: bench/, the trainer and tests may include this
// header (as <loom/quantizers/binary.hpp>); the core's other headers are private to it.
//
// Binary (1-bit, BWN) weights of the xtc quantizer, and what its ternary sibling
// (ternary.hpp) shares: the grouped shape, the fixed-order group sum and bit access.
//
// A weight W [rows, cols] (out features, in features) is cut into groups of `group_size`
// consecutive elements along each row (the last group of a row may be shorter), one float32
// scale alpha per group. Binary: alpha = mean |w| of the group, code 1 (+alpha) for w >= 0 and
// 0 (-alpha) for w < 0, so a zero weight decodes to +alpha: one bit has no code for 0.
// Codes are packed LSB first, element i of the row-major stream in bit i % 8 of byte i / 8
// (loom/quant_format.h); rows are not padded to whole bytes.
//
// The mean is the group's sum of |w| in a fixed order (group_abs_sum below) divided by its
// length in float32, so the scalar reference, the Highway kernels and the CUDA kernels agree
// bit for bit. Every function takes host pointers except those in the cuda namespace.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

namespace loom::quant {

// W [rows, cols] in groups of group_size (>= 1) along each row.
struct GroupedShape {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t group_size = 1;

  int64_t groups_per_row() const { return cols == 0 ? 0 : (cols + group_size - 1) / group_size; }
  int64_t groups() const { return rows * groups_per_row(); }
  int64_t numel() const { return rows * cols; }
};

// The partial sums every group sum keeps: element i of a group goes to partial i % 16.
inline constexpr int kSumLanes = 16;

// The sum of the group's values a_i (i in [0, n)) in the fixed order: 16 running float sums,
// partial[i % 16] += a_i for i ascending, then folded as partial[j] += partial[j + h] for
// h = 8, 4, 2, 1. Every kernel (Highway, CUDA) reproduces exactly this order.
inline float fold_partials(float* partial) {
  for (int h = kSumLanes / 2; h >= 1; h /= 2) {
    for (int j = 0; j < h; ++j) partial[j] = partial[j] + partial[j + h];
  }
  return partial[0];
}

// Sum of |w_i| over the group in the fixed order; with above >= 0, only of the |w_i| > above
// (the others add 0), and *kept counts them.
inline float group_abs_sum_ref(const float* w, int64_t n, float above, int64_t* kept) {
  float partial[kSumLanes] = {};
  int64_t k = 0;
  for (int64_t i = 0; i < n; ++i) {
    float a = std::fabs(w[i]);
    if (above >= 0.0f) {
      if (a > above) {
        ++k;
      } else {
        a = 0.0f;
      }
    }
    partial[i % kSumLanes] = partial[i % kSumLanes] + a;
  }
  if (kept != nullptr) *kept = above >= 0.0f ? k : n;
  return fold_partials(partial);
}

// Bits [bit, bit + count) of an LSB-first stream of `bytes` bytes, bit `bit` in bit 0 of the
// result (count <= 32). Never reads past the stream.
inline uint32_t load_bits(const uint8_t* p, uint64_t bytes, uint64_t bit, int count) {
  const uint64_t first = bit / 8;
  const int shift = static_cast<int>(bit % 8);
  const int need = (shift + count + 7) / 8;  // bytes covering the bits
  uint64_t word = 0;
  for (int b = 0; b < need && first + static_cast<uint64_t>(b) < bytes; ++b) {
    word |= static_cast<uint64_t>(p[first + static_cast<uint64_t>(b)]) << (8 * b);
  }
  word >>= shift;
  return static_cast<uint32_t>(count >= 32 ? word : word & ((uint64_t{1} << count) - 1));
}

// The whole packed byte count of rows * cols codes of `bits` bits.
inline uint64_t packed_bytes_of(const GroupedShape& s, int bits) {
  const auto b = static_cast<uint64_t>(s.numel()) * static_cast<uint64_t>(bits);
  return (b + 7) / 8;
}

// Scratch the CUDA kernels take (xtc_cuda.hpp): a first-bad index per group (or row), a
// Delta per group and the reduced index, each 256-byte aligned.
inline uint64_t xtc_cuda_workspace_bytes(const GroupedShape& s) {
  auto up = [](uint64_t b) { return (b + 255) / 256 * 256; };
  const auto groups = static_cast<uint64_t>(s.groups());
  const auto rows = static_cast<uint64_t>(s.rows);
  return up(8 * (groups > rows ? groups : rows)) + up(4 * groups) + 256;
}

// --- Binary: scalar reference --------------------------------------------------------------

// Codes (packed, packed_bytes_of(s, 1) bytes, written whole) and scales (s.groups()). Returns
// the row-major index of the first non-finite weight (nothing meaningful written); else
// s.numel() + g for the first group g (row-major over the scales) whose finite weights' |w| sum
// overflows float32, so alpha would be inf; else -1. The fast kernels and CUDA return the same.
int64_t binary_quantize_ref(const float* w, const GroupedShape& s, uint8_t* packed, float* scales);
// w = alpha * (code ? +1 : -1).
void binary_dequantize_ref(const uint8_t* packed, const float* scales, const GroupedShape& s,
                           float* w);
// y [m, rows] = x [m, cols] . W^T (+ bias [rows] when not null), each group's contribution
// alpha * (sum of x where code 1 - sum of x where code 0), accumulated in float.
void binary_matmul_ref(const float* x, int64_t m, const uint8_t* packed, const float* scales,
                       const GroupedShape& s, const float* bias, float* y);

// --- Binary: fast CPU kernels (Highway, run-time dispatch, over the host pool) --------------

int64_t binary_quantize(const float* w, const GroupedShape& s, uint8_t* packed, float* scales);
// w holds bf16 (bf16 true) or float16 patterns: the codes, scales and first bad element of
// binary_quantize on their float32 widening, without a float32 copy of w.
int64_t binary_quantize16(const uint16_t* w, bool bf16, const GroupedShape& s, uint8_t* packed,
                          float* scales);
void binary_dequantize(const uint8_t* packed, const float* scales, const GroupedShape& s, float* w);
// From bit masks: never expands W to floats in memory.
void binary_matmul(const float* x, int64_t m, const uint8_t* packed, const float* scales,
                   const GroupedShape& s, const float* bias, float* y);

// The SIMD target Highway dispatches the xtc kernels to on this CPU (e.g. "AVX3").
const char* xtc_simd_target();

}  // namespace loom::quant
