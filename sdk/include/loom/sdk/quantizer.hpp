// Checked views of what a loom.quantizer/1 plugin receives (loom/kinds/quantizer.h). The
// SDK's QuantizerTable runs these before calling the class, so a class gets tensors that
// match the format its layout reports; a class (or a test) may call them too.
//
//   const loom::sdk::QuantTensors q = loom::sdk::quant_tensors(a.packed, a.scales,
//                                                              a.zero_points, layout, device);
//   const uint8_t* codes = q.codes;   // layout.packed_bytes bytes
#ifndef LOOM_SDK_QUANTIZER_HPP
#define LOOM_SDK_QUANTIZER_HPP

#include <loom/kinds/quantizer.h>
#include <loom/sdk/quant_format.hpp>
#include <loom/sdk/tensor.hpp>

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace loom::sdk {

inline const char* quantizer_role_name(int32_t role) {
  switch (role) {
    case LOOM_QUANTIZER_WEIGHT:
      return "weight";
    case LOOM_QUANTIZER_ACTIVATION:
      return "activation";
    default:
      return "unknown";
  }
}

// The float side of a quantizer call: float32, float16 or bfloat16, one lane.
inline bool is_quantizer_float(DLDataType t) {
  return t.lanes == 1 && ((t.code == kDLFloat && (t.bits == 32 || t.bits == 16)) ||
                          (t.code == kDLBfloat && t.bits == 16));
}

// Checks that `given` describes the same format as `expected` (what layout returned), field by
// field, naming the first that differs: "format.bits is 4, but the quantizer's layout for
// this shape is 8".
inline void expect_same_format(const loom_quant_format& given, const loom_quant_format& expected,
                               std::string_view what) {
  const std::string w(what);
  auto differ = [&](const char* field, const std::string& g, const std::string& e) {
    fail_argument(w + "." + field + " is " + g + ", but the quantizer's layout for this shape " +
                  "and role gives " + e);
  };
  auto num = [](auto v) { return std::to_string(v); };
  if (given.scheme != expected.scheme) differ("scheme", num(given.scheme), num(expected.scheme));
  if (given.bits != expected.bits) differ("bits", num(given.bits), num(expected.bits));
  if (given.flags != expected.flags) differ("flags", num(given.flags), num(expected.flags));
  if (given.packing != expected.packing)
    differ("packing", num(given.packing), num(expected.packing));
  if (given.group_size != expected.group_size)
    differ("group_size", num(given.group_size), num(expected.group_size));
  if (expected.group_size != 0 && given.axis != expected.axis)
    differ("axis", num(given.axis), num(expected.axis));
  if (given.ndim != expected.ndim) differ("ndim", num(given.ndim), num(expected.ndim));
  for (int32_t d = 0; d < expected.ndim; ++d) {
    if (given.shape[d] != expected.shape[d]) {
      differ(("shape[" + std::to_string(d) + "]").c_str(), num(given.shape[d]),
             num(expected.shape[d]));
    }
  }
  if (std::memcmp(&given.scale_dtype, &expected.scale_dtype, sizeof(DLDataType)) != 0) {
    differ("scale_dtype", dtype_string(given.scale_dtype), dtype_string(expected.scale_dtype));
  }
  if (std::memcmp(&given.zero_point_dtype, &expected.zero_point_dtype, sizeof(DLDataType)) != 0) {
    differ("zero_point_dtype", dtype_string(given.zero_point_dtype),
           dtype_string(expected.zero_point_dtype));
  }
}

// The packed side of a call, checked against a layout: codes uint8 1-D of packed_bytes,
// scales of the scale dtype with scale_count elements, zero points of their dtype with
// zero_point_count elements (NULL exactly when that is 0), all contiguous on `device`.
struct QuantTensors {
  uint8_t* codes = nullptr;
  void* scales = nullptr;
  void* zero_points = nullptr;  // NULL without zero points
};

inline QuantTensors quant_tensors(const DLTensor* packed, const DLTensor* scales,
                                  const DLTensor* zero_points,
                                  const loom_quantizer_layout_args& layout, DLDevice device) {
  QuantTensors q;
  const DLTensor& p = expect_tensor(packed, "packed");
  expect_packed(p, *layout.format, "packed");
  expect_device(p, device, "packed");
  q.codes = reinterpret_cast<uint8_t*>(static_cast<char*>(p.data) + p.byte_offset);
  const DLTensor& s = expect_tensor(scales, "scales");
  expect_dtype(s, layout.format->scale_dtype, "scales");
  expect_contiguous(s, "scales");
  expect_numel(s, layout.scale_count, "scales");
  expect_device(s, device, "scales");
  q.scales = static_cast<char*>(s.data) + s.byte_offset;
  if (layout.zero_point_count == 0) {
    if (zero_points != nullptr) {
      fail_argument("zero_points is given, but this format has none (symmetric codes): pass NULL");
    }
    return q;
  }
  if (zero_points == nullptr) {
    fail_argument("zero_points is NULL, but this format has " +
                  std::to_string(layout.zero_point_count) + " (asymmetric codes)");
  }
  const DLTensor& z = expect_tensor(zero_points, "zero_points");
  expect_dtype(z, layout.format->zero_point_dtype, "zero_points");
  expect_contiguous(z, "zero_points");
  expect_numel(z, layout.zero_point_count, "zero_points");
  expect_device(z, device, "zero_points");
  q.zero_points = static_cast<char*>(z.data) + z.byte_offset;
  return q;
}

// A 2-D contiguous float tensor ([N, K] or [M, K]); returns its first element.
inline void* quant_matrix(const DLTensor* t, std::string_view what) {
  const DLTensor& d = expect_tensor(t, what);
  if (d.ndim != 2) {
    fail_argument(std::string(what) + " has shape " + shape_string(d) + ", expected 2-D");
  }
  if (!is_quantizer_float(d.dtype)) {
    fail_argument(std::string(what) + " has dtype " + dtype_string(d.dtype) +
                  ", expected float32, float16 or bfloat16");
  }
  expect_contiguous(d, what);
  return static_cast<char*>(d.data) + d.byte_offset;
}

// Quantize's first_bad (since 1.7): int64, one element, contiguous, on x's device; returns
// its element.
inline int64_t* expect_first_bad(const DLTensor* t, DLDevice device) {
  const DLTensor& d = expect_tensor(t, "first_bad");
  expect_dtype(d, DLDataType{kDLInt, 64, 1}, "first_bad");
  expect_contiguous(d, "first_bad");
  expect_numel(d, 1, "first_bad");
  expect_device(d, device, "first_bad");
  return reinterpret_cast<int64_t*>(static_cast<char*>(d.data) + d.byte_offset);
}

// Writes a host quantize's outcome into first_bad (-1, an element's index, or numel + g):
// true when the caller asked for it that way, so the class reports nothing more; false when
// first_bad is NULL (the class then throws for bad >= 0). For host tensors only.
inline bool set_first_bad(const loom_quantizer_quantize_args& a, int64_t bad) {
  if (a.first_bad == nullptr) return false;
  *expect_first_bad(a.first_bad, a.first_bad->device) = bad;
  return true;
}

}  // namespace loom::sdk

#endif  // LOOM_SDK_QUANTIZER_HPP
