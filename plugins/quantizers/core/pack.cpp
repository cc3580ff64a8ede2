// Packing of codes into the bit stream of loom/quant_format.h, group statistics, and the
// scalar reference encoders of the integer schemes (quant_core.hpp).
#include <cstdio>
#include <cstring>

#include "quant_core.hpp"

namespace loom::quant {
namespace {

// Codes per byte for a byte-at-a-time path (bits 1, 2, 4), or 0.
constexpr uint32_t per_byte(uint32_t bits) {
  return bits == 1 || bits == 2 || bits == 4 ? 8 / bits : 0;
}

}  // namespace

void pack_codes(const uint8_t* codes, uint64_t first, uint64_t count, uint32_t bits,
                int32_t packing, uint8_t* packed) {
  if (count == 0) return;
  if (bits == 8) {
    std::memcpy(packed + first, codes, count);
    return;
  }
  uint64_t i = 0;
  const uint32_t n = per_byte(bits);
  const uint32_t mask = (1u << bits) - 1u;
  // Elements before the first byte boundary, one at a time.
  if (n != 0) {
    for (; i < count && ((first + i) * bits) % 8 != 0; ++i) {
      write_code(packed, first + i, bits, packing, codes[i]);
    }
    uint8_t* out = packed + (first + i) * bits / 8;
    for (; i + n <= count; i += n) {
      uint32_t b = 0;
      for (uint32_t j = 0; j < n; ++j) {
        const uint32_t c = codes[i + j] & mask;
        b |= packing == LOOM_QUANT_PACK_LSB_FIRST ? c << (j * bits) : c << (8 - (j + 1) * bits);
      }
      *out++ = static_cast<uint8_t>(b);
    }
  }
  for (; i < count; ++i) write_code(packed, first + i, bits, packing, codes[i]);
}

void unpack_codes(const uint8_t* packed, uint64_t first, uint64_t count, uint32_t bits,
                  int32_t packing, uint8_t* codes) {
  if (count == 0) return;
  if (bits == 8) {
    std::memcpy(codes, packed + first, count);
    return;
  }
  uint64_t i = 0;
  const uint32_t n = per_byte(bits);
  const uint32_t mask = (1u << bits) - 1u;
  if (n != 0) {
    for (; i < count && ((first + i) * bits) % 8 != 0; ++i) {
      codes[i] = static_cast<uint8_t>(read_code(packed, first + i, bits, packing));
    }
    const uint8_t* in = packed + (first + i) * bits / 8;
    for (; i + n <= count; i += n) {
      const uint32_t b = *in++;
      for (uint32_t j = 0; j < n; ++j) {
        const uint32_t shift = packing == LOOM_QUANT_PACK_LSB_FIRST ? j * bits : 8 - (j + 1) * bits;
        codes[i + j] = static_cast<uint8_t>((b >> shift) & mask);
      }
    }
  }
  for (; i < count; ++i)
    codes[i] = static_cast<uint8_t>(read_code(packed, first + i, bits, packing));
}

GroupStats group_stats(const float* x, int64_t n) {
  GroupStats s;
  if (n <= 0) return s;
  s.min = x[0];
  s.max = x[0];
  for (int64_t i = 1; i < n; ++i) {
    s.min = std::min(s.min, x[i]);
    s.max = std::max(s.max, x[i]);
  }
  s.absmax = std::max(std::fabs(s.min), std::fabs(s.max));
  return s;
}

int64_t first_non_finite(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) return i;
  }
  return -1;
}

std::string non_finite_message(const char* tensor, const float* x, int64_t cols, int64_t index) {
  const float v = x[index];
  const char* what = std::isnan(v) ? "nan" : (v > 0 ? "inf" : "-inf");
  const int64_t c = cols > 0 ? cols : 1;
  return std::string(tensor) + "[" + std::to_string(index / c) + ", " + std::to_string(index % c) +
         "] is " + what + " (quantize takes finite values only)";
}

void reference_quantize(const float* x, const Groups& gs, const IntScheme& q, int32_t packing,
                        uint8_t* packed, float* scales, uint8_t* zeros) {
  const uint64_t total = static_cast<uint64_t>(gs.rows) * static_cast<uint64_t>(gs.cols);
  const uint64_t bytes = packed_size(total, q.bits);
  if (bytes > 0) packed[bytes - 1] = 0;
  for_each_group(gs, 0, gs.rows, [&](int64_t r, int64_t g, int64_t c0, int64_t c1) {
    const float* row = x + r * gs.cols;
    const GroupParams p = int_group_params(group_stats(row + c0, c1 - c0), q);
    scales[r * gs.groups_per_row + g] = p.scale;
    if (!q.symmetric) zeros[r * gs.groups_per_row + g] = static_cast<uint8_t>(p.zero);
    for (int64_t c = c0; c < c1; ++c) {
      const int32_t code = int_encode(row[c], p, q);
      write_code(packed, static_cast<uint64_t>(r * gs.cols + c), q.bits, packing,
                 static_cast<uint32_t>(code));
    }
  });
}

void reference_dequantize(const uint8_t* packed, const float* scales, const uint8_t* zeros,
                          const Groups& gs, const IntScheme& q, int32_t packing, float* x) {
  for_each_group(gs, 0, gs.rows, [&](int64_t r, int64_t g, int64_t c0, int64_t c1) {
    GroupParams p;
    p.scale = scales[r * gs.groups_per_row + g];
    p.zero = q.symmetric ? 0 : zeros[r * gs.groups_per_row + g];
    for (int64_t c = c0; c < c1; ++c) {
      const uint32_t u = read_code(packed, static_cast<uint64_t>(r * gs.cols + c), q.bits, packing);
      const int32_t v = q.symmetric ? sign_extend(u, q.bits) : static_cast<int32_t>(u);
      x[r * gs.cols + c] = int_decode(v, p, q.symmetric);
    }
  });
}

void reference_quantize_rows_int8(const float* x, int64_t rows, int64_t cols, int8_t* q,
                                  float* scales) {
  const IntScheme scheme{8, true, Range::kExact};
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * cols;
    const GroupParams p = int_group_params(group_stats(row, cols), scheme);
    scales[r] = p.scale;
    for (int64_t c = 0; c < cols; ++c)
      q[r * cols + c] = static_cast<int8_t>(int_encode(row[c], p, scheme));
  }
}

}  // namespace loom::quant
