// What every quantizer of plugins/quantizers shares (kind loom.quantizer/1): packing and
// unpacking of codes for any loom_quant_format (loom/quant_format.h: 1..8 bits, both bit
// orders, codes straddling bytes, odd sizes), the iteration over groups along K of a
// [rows, cols] matrix and their statistics, and the scalar reference encoders of the integer
// schemes. The fast kernels (Highway on the CPU, CUDA) live in int_kernels.hpp and
// int_cuda.hpp and agree with the reference here bit for bit.
#pragma once

#include <loom/quant_format.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

namespace loom::quant {

// ---- Packing --------------------------------------------------------------------------------

// Bytes that `count` codes of `bits` bits take: ceil(count * bits / 8).
constexpr uint64_t packed_size(uint64_t count, uint32_t bits) { return (count * bits + 7) / 8; }

// The code of stream element `i` (an unsigned value of `bits` bits, 1..8) in `packed`,
// read as loom/quant_format.h defines for `packing` (LOOM_QUANT_PACK_LSB_FIRST or
// LOOM_QUANT_PACK_MSB_FIRST). Reads only the bytes the code occupies.
inline uint32_t read_code(const uint8_t* packed, uint64_t i, uint32_t bits, int32_t packing) {
  const uint64_t k = i * bits;
  const uint64_t byte = k >> 3;
  const uint32_t off = static_cast<uint32_t>(k & 7);
  const uint32_t mask = (1u << bits) - 1u;
  const bool two = off + bits > 8;
  if (packing == LOOM_QUANT_PACK_LSB_FIRST) {
    uint32_t v = packed[byte];
    if (two) v |= static_cast<uint32_t>(packed[byte + 1]) << 8;
    return (v >> off) & mask;
  }
  uint32_t v = static_cast<uint32_t>(packed[byte]) << 8;
  if (two) v |= packed[byte + 1];
  return (v >> (16u - off - bits)) & mask;
}

// Stores `code` (its low `bits` bits) as stream element `i`; the other bits of the bytes it
// touches are kept.
inline void write_code(uint8_t* packed, uint64_t i, uint32_t bits, int32_t packing, uint32_t code) {
  const uint64_t k = i * bits;
  const uint64_t byte = k >> 3;
  const uint32_t off = static_cast<uint32_t>(k & 7);
  const uint32_t mask = (1u << bits) - 1u;
  const bool two = off + bits > 8;
  code &= mask;
  if (packing == LOOM_QUANT_PACK_LSB_FIRST) {
    const uint32_t field = code << off;
    const uint32_t m = mask << off;
    packed[byte] = static_cast<uint8_t>((packed[byte] & ~m) | field);
    if (two) packed[byte + 1] = static_cast<uint8_t>((packed[byte + 1] & ~(m >> 8)) | (field >> 8));
    return;
  }
  const uint32_t shift = 16u - off - bits;
  const uint32_t field = code << shift;
  const uint32_t m = mask << shift;
  packed[byte] = static_cast<uint8_t>((packed[byte] & ~(m >> 8)) | (field >> 8));
  if (two) packed[byte + 1] = static_cast<uint8_t>((packed[byte + 1] & ~m) | (field & 0xFFu));
}

// Writes codes[0 .. count) (each taken modulo 2^bits) as stream elements
// [first, first + count) of `packed`. Bits outside those elements are kept, so two calls may
// run at once only when their ranges share no byte (see aligned_rows). Byte-aligned ranges
// of 8-, 4-, 2- and 1-bit codes go a byte at a time.
void pack_codes(const uint8_t* codes, uint64_t first, uint64_t count, uint32_t bits,
                int32_t packing, uint8_t* packed);

// Reads stream elements [first, first + count) of `packed` into codes[0 .. count).
void unpack_codes(const uint8_t* packed, uint64_t first, uint64_t count, uint32_t bits,
                  int32_t packing, uint8_t* codes);

// The smallest row count r >= 1 with r * cols * bits a multiple of 8: blocks of r rows of a
// packed [rows, cols] tensor start on byte boundaries, so they may be packed concurrently.
inline int64_t aligned_rows(int64_t cols, uint32_t bits) {
  const uint64_t rowbits = static_cast<uint64_t>(cols) * bits;
  for (int64_t r = 1; r <= 8; r *= 2) {
    if ((rowbits * static_cast<uint64_t>(r)) % 8 == 0) return r;
  }
  return 8;
}

// Sign-extends a `bits`-bit two's complement code.
constexpr int32_t sign_extend(uint32_t code, uint32_t bits) {
  const uint32_t m = 1u << (bits - 1);
  return static_cast<int32_t>((code ^ m)) - static_cast<int32_t>(m);
}

// ---- Groups along K ------------------------------------------------------------------------

// A [rows, cols] matrix with groups of `group` consecutive elements along each row (the last
// group of a row may be shorter): scale (g) of row r sits at r * groups_per_row + g.
struct Groups {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t group = 0;  // >= 1 (cols when cols is 0: a single empty group is never visited)
  int64_t groups_per_row = 0;

  // group_size 0 = one group per row.
  static Groups of(int64_t rows, int64_t cols, int64_t group_size) {
    Groups g;
    g.rows = rows;
    g.cols = cols;
    g.group = group_size > 0 ? group_size : std::max<int64_t>(cols, 1);
    g.groups_per_row = cols == 0 ? 0 : (cols + g.group - 1) / g.group;
    return g;
  }
  int64_t count() const { return rows * groups_per_row; }
  int64_t begin(int64_t g) const { return g * group; }
  int64_t end(int64_t g) const { return std::min(cols, (g + 1) * group); }
  bool whole() const { return groups_per_row == 0 || cols % group == 0; }
};

// Calls fn(row, g, col_begin, col_end) for every group of rows [row_begin, row_end) in
// order (row-major: the order of the scale tensor).
template <class Fn>
void for_each_group(const Groups& gs, int64_t row_begin, int64_t row_end, Fn&& fn) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    for (int64_t g = 0; g < gs.groups_per_row; ++g) fn(r, g, gs.begin(g), gs.end(g));
  }
}

// Minimum, maximum and maximum magnitude of a group (exact: comparisons only).
struct GroupStats {
  float min = 0.0f;
  float max = 0.0f;
  float absmax = 0.0f;
};
GroupStats group_stats(const float* x, int64_t n);

// The index of the first non-finite element of x[0 .. n), or -1.
int64_t first_non_finite(const float* x, int64_t n);

// ---- Integer schemes ------------------------------------------------------------------------

// "exact" uses the whole code range with the extreme on it (symmetric: max|x| / (2^(b-1) - 1);
// asymmetric: (max - min) / (2^b - 1)); "deepspeed" is DeepSpeed's simulated quantizer,
// which divides the range by 2^b (symmetric: 2 max|x| / 2^b, codes -2^(b-1) .. 2^(b-1) - 1).
enum class Range : int32_t { kExact = 0, kDeepSpeed = 1 };

struct IntScheme {
  uint32_t bits = 8;  // 2..8 symmetric, 1..8 asymmetric
  bool symmetric = true;
  Range range = Range::kExact;
};

// A group's scale and zero point (0 when symmetric).
struct GroupParams {
  float scale = 1.0f;
  int32_t zero = 0;
};

// The scale and zero point of a group from its statistics. Symmetric: s from max|x| (s = 1
// when max|x| is 0 or s would underflow to 0). Asymmetric: the range [min(min, 0),
// max(max, 0)] (it always holds 0, so the zero point fits the codes), s from its width (1
// when it is 0), z = clamp(round_half_even(-min / s), 0, 2^b - 1). A range whose width
// overflows float gives a non-finite scale; callers refuse it.
inline GroupParams int_group_params(const GroupStats& st, const IntScheme& q) {
  GroupParams p;
  if (q.symmetric) {
    const float a = st.absmax;
    const float div = q.range == Range::kExact ? static_cast<float>((1u << (q.bits - 1)) - 1u)
                                               : static_cast<float>(1u << (q.bits - 1));
    // deepspeed: 2a / 2^b, computed as a / 2^(b-1) (the same float for every normal a, and no
    // overflow of 2a).
    float s = a / div;
    if (!(s > 0.0f)) s = 1.0f;
    p.scale = s;
    return p;
  }
  const float lo = std::min(st.min, 0.0f);
  const float hi = std::max(st.max, 0.0f);
  const float div = q.range == Range::kExact ? static_cast<float>((1u << q.bits) - 1u)
                                             : static_cast<float>(1u << q.bits);
  float s = (hi - lo) / div;
  if (!(s > 0.0f) && std::isfinite(s)) s = 1.0f;
  p.scale = s;
  const float qmax = static_cast<float>((1u << q.bits) - 1u);
  const float z = std::nearbyint(-lo / s);
  p.zero = static_cast<int32_t>(std::min(std::max(z, 0.0f), qmax));
  return p;
}

// The code of x in a group (symmetric: a signed value; asymmetric: 0 .. 2^b - 1), rounding
// half to even on an IEEE quotient x / s:
//   exact symmetric:     clamp(round(x / s), -(2^(b-1) - 1), 2^(b-1) - 1)
//   deepspeed symmetric: clamp(round(x / s), -2^(b-1), 2^(b-1) - 1)
//   exact asymmetric:    clamp(round(x / s) + z, 0, 2^b - 1)
//   deepspeed asymmetric (DeepSpeed's order of operations, its zero point -z s as a float):
//                        clamp(round((x + z s) / s), 0, 2^b - 1)
inline int32_t int_encode(float x, const GroupParams& p, const IntScheme& q) {
  if (q.symmetric) {
    const float hi = static_cast<float>((1u << (q.bits - 1)) - 1u);
    const float lo = q.range == Range::kExact ? -hi : -hi - 1.0f;
    const float r = std::nearbyint(x / p.scale);
    return static_cast<int32_t>(std::min(std::max(r, lo), hi));
  }
  const float qmax = static_cast<float>((1u << q.bits) - 1u);
  float r;
  if (q.range == Range::kExact) {
    r = std::nearbyint(x / p.scale) + static_cast<float>(p.zero);
  } else {
    const float zf = static_cast<float>(p.zero) * p.scale;
    r = std::nearbyint((x + zf) / p.scale);
  }
  return static_cast<int32_t>(std::min(std::max(r, 0.0f), qmax));
}

// The value of a code: s * q (symmetric, q signed) or s * (q - z).
inline float int_decode(int32_t q, const GroupParams& p, bool symmetric) {
  return symmetric ? p.scale * static_cast<float>(q) : p.scale * static_cast<float>(q - p.zero);
}

// Reference (scalar, one element at a time) quantization of a [rows, cols] float matrix,
// groups along each row: codes written as loom/quant_format.h packs them, `scales` (and
// `zeros`, asymmetric) one per group in row-major order. Input must be finite. The packed
// buffer's unused trailing bits are set to 0.
void reference_quantize(const float* x, const Groups& gs, const IntScheme& q, int32_t packing,
                        uint8_t* packed, float* scales, uint8_t* zeros);

// Reference dequantization: x[r, c] = decode(code, scale and zero point of its group).
void reference_dequantize(const uint8_t* packed, const float* scales, const uint8_t* zeros,
                          const Groups& gs, const IntScheme& q, int32_t packing, float* x);

// Reference token-wise INT8 activation quantization of x [rows, cols]: per row
// s = max|x_r| / 127 (1 when 0), q = clamp(round_half_even(x / s), -127, 127).
void reference_quantize_rows_int8(const float* x, int64_t rows, int64_t cols, int8_t* q,
                                  float* scales);

// The message naming a non-finite element: "x[row, col] is nan" (or inf, -inf).
std::string non_finite_message(const char* tensor, const float* x, int64_t cols, int64_t index);

}  // namespace loom::quant
