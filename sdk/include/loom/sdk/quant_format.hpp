// Checking a loom_quant_format (loom/quant_format.h) and the packed uint8 tensor it
// describes: what the packed data must measure, and how many scales it needs.
//
//   const int64_t shape[] = {rows, cols};
//   loom_quant_format f{};
//   f.struct_size = LOOM_QUANT_FORMAT_SIZE;
//   f.scheme = LOOM_QUANT_INT;
//   f.bits = 4;
//   f.flags = LOOM_QUANT_SYMMETRIC;
//   f.packing = LOOM_QUANT_PACK_LSB_FIRST;
//   f.axis = 1;
//   f.group_size = 128;
//   f.ndim = 2;
//   f.shape = shape;
//   f.scale_dtype = {kDLFloat, 16, 1};
//   loom::sdk::expect_packed(codes, f, "weight codes");   // throws Error naming what is wrong
#ifndef LOOM_SDK_QUANT_FORMAT_HPP
#define LOOM_SDK_QUANT_FORMAT_HPP

#include <loom/quant_format.h>
#include <loom/sdk/status.hpp>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>

namespace loom::sdk {
namespace quant_detail {

[[noreturn]] inline void invalid(const std::string& what, const std::string& message) {
  throw Error(LOOM_ERR_INVALID_ARGUMENT, what + ": " + message);
}

inline bool is_float_dtype(DLDataType t) {
  return t.lanes == 1 && ((t.code == kDLFloat && (t.bits == 32 || t.bits == 16)) ||
                          (t.code == kDLBfloat && t.bits == 16));
}

inline bool is_none_dtype(DLDataType t) { return t.code == 0 && t.bits == 0 && t.lanes == 0; }

inline std::string dtype_text(DLDataType t) {
  return "{code " + std::to_string(t.code) + ", bits " + std::to_string(t.bits) + ", lanes " +
         std::to_string(t.lanes) + "}";
}

// a * b, or throws OUT_OF_RANGE when it does not fit in uint64.
inline uint64_t mul(uint64_t a, uint64_t b, const std::string& what) {
  if (a != 0 && b > std::numeric_limits<uint64_t>::max() / a) {
    throw Error(LOOM_ERR_OUT_OF_RANGE, what + ": the tensor is too large to address");
  }
  return a * b;
}

}  // namespace quant_detail

// The descriptor copied into a zeroed full-size struct after checking it: size, scheme,
// bits for the scheme, flags, packing, shape, axis and group size, scale and zero-point
// dtypes. Throws Error(INVALID_ARGUMENT) naming `what` and the field.
inline loom_quant_format check_quant_format(const loom_quant_format* format,
                                            const std::string& what) {
  using quant_detail::invalid;
  if (format == nullptr) invalid(what, "the quant format is NULL");
  constexpr uint32_t kMin = LOOM_STRUCT_SIZE(loom_quant_format, zero_point_dtype);
  if (format->struct_size < kMin) {
    invalid(what, "quant format struct_size " + std::to_string(format->struct_size) +
                      " is smaller than " + std::to_string(kMin));
  }
  loom_quant_format f{};
  std::memcpy(&f, format, sizeof f < format->struct_size ? sizeof f : format->struct_size);
  if ((f.flags & ~LOOM_QUANT_KNOWN_FLAGS) != 0) {
    invalid(
        what, "unknown quant format flags 0x" + [&] {
          char buf[16];
          std::snprintf(buf, sizeof buf, "%x", f.flags & ~LOOM_QUANT_KNOWN_FLAGS);
          return std::string(buf);
        }());
  }
  const bool symmetric = (f.flags & LOOM_QUANT_SYMMETRIC) != 0;
  switch (f.scheme) {
    case LOOM_QUANT_INT:
      if (f.bits < (symmetric ? 2U : 1U) || f.bits > 8) {
        invalid(what, std::string(symmetric ? "symmetric" : "asymmetric") + " int codes of " +
                          std::to_string(f.bits) + " bits (use " + (symmetric ? "2" : "1") +
                          " to 8)");
      }
      break;
    case LOOM_QUANT_BINARY:
    case LOOM_QUANT_TERNARY: {
      const uint32_t need = f.scheme == LOOM_QUANT_BINARY ? 1 : 2;
      const char* name = f.scheme == LOOM_QUANT_BINARY ? "binary" : "ternary";
      if (f.bits != need) {
        invalid(what, std::string(name) + " codes have " + std::to_string(need) + " bit" +
                          (need == 1 ? "" : "s") + ", not " + std::to_string(f.bits));
      }
      if (!symmetric)
        invalid(what, std::string(name) + " codes are symmetric: set LOOM_QUANT_SYMMETRIC");
      break;
    }
    default:
      invalid(what, "unknown quant scheme " + std::to_string(f.scheme));
  }
  if (f.packing != LOOM_QUANT_PACK_LSB_FIRST && f.packing != LOOM_QUANT_PACK_MSB_FIRST) {
    invalid(what, "unknown packing order " + std::to_string(f.packing));
  }
  if (f.ndim < 0) invalid(what, "ndim " + std::to_string(f.ndim) + " is negative");
  if (f.ndim > 0 && f.shape == nullptr) invalid(what, "shape is NULL");
  for (int32_t d = 0; d < f.ndim; ++d) {
    if (f.shape[d] < 0) {
      invalid(what,
              "shape[" + std::to_string(d) + "] = " + std::to_string(f.shape[d]) + " is negative");
    }
  }
  if (f.group_size < 0)
    invalid(what, "group_size " + std::to_string(f.group_size) + " is negative");
  if (f.group_size > 0 && (f.axis < 0 || f.axis >= f.ndim)) {
    invalid(what, "axis " + std::to_string(f.axis) + " is not a dimension of a " +
                      std::to_string(f.ndim) + "-d tensor");
  }
  if (!quant_detail::is_float_dtype(f.scale_dtype)) {
    invalid(what, "scale dtype " + quant_detail::dtype_text(f.scale_dtype) +
                      " is not float32, float16 or bfloat16");
  }
  const bool has_zero_points = f.scheme == LOOM_QUANT_INT && !symmetric;
  if (has_zero_points) {
    const DLDataType z = f.zero_point_dtype;
    const bool byte = z.lanes == 1 && z.bits == 8 && (z.code == kDLUInt || z.code == kDLInt);
    const bool same = std::memcmp(&z, &f.scale_dtype, sizeof z) == 0;
    if (!byte && !same) {
      invalid(what, "zero point dtype " + quant_detail::dtype_text(z) +
                        " is not uint8, int8 or the scale dtype");
    }
  } else if (!quant_detail::is_none_dtype(f.zero_point_dtype)) {
    invalid(what, "symmetric codes have no zero points, but zero_point_dtype is " +
                      quant_detail::dtype_text(f.zero_point_dtype));
  }
  return f;
}

// Elements of the logical tensor. `f` must have passed check_quant_format.
inline uint64_t quant_numel(const loom_quant_format& f, const std::string& what = "quant format") {
  uint64_t n = 1;
  for (int32_t d = 0; d < f.ndim; ++d)
    n = quant_detail::mul(n, static_cast<uint64_t>(f.shape[d]), what);
  return n;
}

// Bytes the packed codes take: ceil(numel * bits / 8).
inline uint64_t packed_bytes(const loom_quant_format& f, const std::string& what = "quant format") {
  const uint64_t bits = quant_detail::mul(quant_numel(f, what), f.bits, what);
  return bits / 8 + (bits % 8 != 0 ? 1 : 0);
}

// Scales (and zero points) the format needs: 1 for group_size 0, else the element count
// with shape[axis] replaced by ceil(shape[axis] / group_size).
inline uint64_t quant_group_count(const loom_quant_format& f,
                                  const std::string& what = "quant format") {
  if (f.group_size == 0) return 1;
  uint64_t n = 1;
  for (int32_t d = 0; d < f.ndim; ++d) {
    auto len = static_cast<uint64_t>(f.shape[d]);
    if (d == f.axis) {
      const auto g = static_cast<uint64_t>(f.group_size);
      len = len / g + (len % g != 0 ? 1 : 0);
    }
    n = quant_detail::mul(n, len, what);
  }
  return n;
}

// Checks `format` and that `packed` is what it describes: a 1-D contiguous uint8 tensor
// (kDLUInt, 8 bits, 1 lane) of exactly packed_bytes() bytes. Returns the checked format.
inline loom_quant_format expect_packed(const DLTensor& packed, const loom_quant_format& format,
                                       const std::string& what) {
  const loom_quant_format f = check_quant_format(&format, what);
  const DLDataType t = packed.dtype;
  if (t.code != kDLUInt || t.bits != 8 || t.lanes != 1) {
    quant_detail::invalid(
        what, "packed codes must be a uint8 tensor, not dtype " + quant_detail::dtype_text(t));
  }
  if (packed.ndim != 1 || packed.shape == nullptr) {
    quant_detail::invalid(what, "packed codes must be a 1-d tensor of bytes, not " +
                                    std::to_string(packed.ndim) + "-d");
  }
  if (packed.strides != nullptr && packed.shape[0] > 1 && packed.strides[0] != 1) {
    quant_detail::invalid(
        what, "packed codes must be contiguous (stride " + std::to_string(packed.strides[0]) + ")");
  }
  const uint64_t need = packed_bytes(f, what);
  if (packed.shape[0] < 0 || static_cast<uint64_t>(packed.shape[0]) != need) {
    quant_detail::invalid(what, "packed codes hold " + std::to_string(packed.shape[0]) +
                                    " bytes, but " + std::to_string(quant_numel(f, what)) +
                                    " codes of " + std::to_string(f.bits) + " bits take " +
                                    std::to_string(need));
  }
  if (need > 0 && packed.data == nullptr) quant_detail::invalid(what, "packed codes have no data");
  return f;
}

}  // namespace loom::sdk

#endif  // LOOM_SDK_QUANT_FORMAT_HPP
