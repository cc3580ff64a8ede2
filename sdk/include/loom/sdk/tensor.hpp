// DLTensor helpers: sizes, layout and dtype predicates, and expect_* checks that throw
// Error(INVALID_ARGUMENT) with a message naming the offending tensor.
#ifndef LOOM_SDK_TENSOR_HPP
#define LOOM_SDK_TENSOR_HPP

#include <dlpack/dlpack.h>
#include <loom/sdk/status.hpp>

#include <climits>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace loom::sdk {

inline int64_t numel(const DLTensor& t) {
  int64_t n = 1;
  for (int32_t i = 0; i < t.ndim; ++i) n *= t.shape[i];
  return n;
}

// Bytes per element (lanes included); 0 for sub-byte types.
inline std::size_t element_bytes(DLDataType dtype) {
  return static_cast<std::size_t>(dtype.bits) * dtype.lanes / 8;
}

inline std::size_t nbytes(const DLTensor& t) {
  return static_cast<std::size_t>(numel(t)) * element_bytes(t.dtype);
}

// Row-major and dense. Strides of size-1 dimensions do not matter (as in PyTorch), and
// NULL strides mean row-major by definition.
inline bool is_contiguous(const DLTensor& t) {
  if (t.strides == nullptr) return true;
  int64_t expected = 1;
  for (int32_t i = t.ndim - 1; i >= 0; --i) {
    if (t.shape[i] == 0) return true;
    if (t.shape[i] != 1 && t.strides[i] != expected) return false;
    expected *= t.shape[i];
  }
  return true;
}

// A compact 1-D view of `data`: shape[0] elements of `dtype` on `device`, with its stride
// set (every DLTensor the SDK builds sets strides, so a receiver never depends on the NULL
// convention). `shape` must outlive the view; the unit stride is static and read-only.
inline DLTensor flat_view(void* data, DLDevice device, DLDataType dtype, int64_t* shape) {
  static const int64_t kUnitStride = 1;
  return DLTensor{data, device, 1, dtype, shape, const_cast<int64_t*>(&kUnitStride), 0};  // NOLINT
}

inline bool is_dtype(const DLTensor& t, uint8_t code, uint8_t bits) {
  return t.dtype.code == code && t.dtype.bits == bits && t.dtype.lanes == 1;
}
inline bool is_fp32(const DLTensor& t) { return is_dtype(t, kDLFloat, 32); }
inline bool is_fp16(const DLTensor& t) { return is_dtype(t, kDLFloat, 16); }
inline bool is_bf16(const DLTensor& t) { return is_dtype(t, kDLBfloat, 16); }

// kDLCUDAHost (pinned) memory is host memory as far as a CPU kernel is concerned.
inline bool is_cpu(const DLDevice& d) {
  return d.device_type == kDLCPU || d.device_type == kDLCUDAHost;
}
inline bool is_cpu(const DLTensor& t) { return is_cpu(t.device); }
inline bool is_cuda(const DLDevice& d) { return d.device_type == kDLCUDA; }
inline bool is_cuda(const DLTensor& t) { return is_cuda(t.device); }
inline bool same_device(const DLDevice& a, const DLDevice& b) {
  return a.device_type == b.device_type && a.device_id == b.device_id;
}

inline bool same_shape(const DLTensor& a, const DLTensor& b) {
  if (a.ndim != b.ndim) return false;
  for (int32_t i = 0; i < a.ndim; ++i) {
    if (a.shape[i] != b.shape[i]) return false;
  }
  return true;
}

// The first element, byte_offset applied.
template <class T>
T* data_as(const DLTensor& t) {
  return reinterpret_cast<T*>(static_cast<char*>(t.data) + t.byte_offset);
}

// "[4,5]"
inline std::string shape_string(const DLTensor& t) {
  std::string s = "[";
  for (int32_t i = 0; i < t.ndim; ++i) {
    if (i > 0) s += ",";
    s += std::to_string(t.shape[i]);
  }
  return s + "]";
}

// "float32", "bfloat16", "int8x4"
//
// Built by appending to one string: GCC 12 at -O3 reports a false -Wrestrict for
// `"literal" + std::to_string(...)` (operator+(const char*, std::string&&)) once this is
// inlined into a plugin, which breaks -Werror builds.
inline std::string dtype_string(DLDataType d) {
  std::string s;
  switch (d.code) {
    case kDLInt:
      s.append("int");
      break;
    case kDLUInt:
      s.append("uint");
      break;
    case kDLFloat:
      s.append("float");
      break;
    case kDLBfloat:
      s.append("bfloat");
      break;
    default:
      s.append("dtype").append(std::to_string(d.code)).push_back('_');
      break;
  }
  s.append(std::to_string(d.bits));
  if (d.lanes != 1) s.append("x").append(std::to_string(d.lanes));
  return s;
}

// "cpu", "cuda:1" (appended like dtype_string, for the same reason)
inline std::string device_string(DLDevice d) {
  std::string s;
  switch (d.device_type) {
    case kDLCPU:
      return "cpu";
    case kDLCUDA:
      s.append("cuda");
      break;
    case kDLCUDAHost:
      return "cuda_host";
    default:
      s.append("device").append(std::to_string(static_cast<int>(d.device_type)));
      break;
  }
  s.push_back(':');
  s.append(std::to_string(d.device_id));
  return s;
}

// ---- checks; `what` names the tensor in the message, e.g. "grad 3".

inline void fail_argument(const std::string& message) {
  throw Error(LOOM_ERR_INVALID_ARGUMENT, message);
}

// Most dimensions a tensor may have (PyTorch's limit as well).
constexpr int32_t kMaxNdim = 64;

// Checks that a DLTensor's description can be read safely, before anything else looks at it:
// ndim in [0, kMaxNdim] with a shape array when ndim > 0, every dim >= 0, an element count,
// a byte count and (with strides) a reach of the strides that fit in int64_t; dtype with at
// least one bit and one lane; a device type and id DLPack allows (type >= kDLCPU, id >= 0).
// After it, numel, nbytes, is_contiguous and shape_string cannot overflow. Messages name the
// tensor: "param 0.3: dim 1 is -1". Layout, dtype and device *requirements* (contiguous,
// float32, CPU) are the plugin's, with the expect_* checks below.
inline void validate_tensor(const DLTensor& t, std::string_view what) {
  const std::string w(what);
  constexpr int64_t kMax = INT64_MAX;
  if (t.ndim < 0 || t.ndim > kMaxNdim) {
    fail_argument(w + ": ndim is " + std::to_string(t.ndim) + "; must be 0 to " +
                  std::to_string(kMaxNdim));
  }
  if (t.ndim > 0 && t.shape == nullptr) {
    fail_argument(w + ": ndim is " + std::to_string(t.ndim) + " but shape is NULL");
  }
  bool empty = false;
  for (int32_t i = 0; i < t.ndim; ++i) {
    if (t.shape[i] < 0) {
      fail_argument(w + ": dim " + std::to_string(i) + " is " + std::to_string(t.shape[i]));
    }
    if (t.shape[i] == 0) empty = true;
  }
  if (t.dtype.bits == 0 || t.dtype.lanes == 0) {
    fail_argument(w + ": dtype " + dtype_string(t.dtype) + " has no bits or no lanes");
  }
  if (static_cast<int>(t.device.device_type) < static_cast<int>(kDLCPU) || t.device.device_id < 0) {
    fail_argument(w + ": device type " + std::to_string(static_cast<int>(t.device.device_type)) +
                  " id " + std::to_string(t.device.device_id) + " is not a DLPack device");
  }
  // Element count, then bytes (bits * lanes per element, sub-byte types rounded up).
  int64_t n = 1;
  if (!empty) {
    for (int32_t i = 0; i < t.ndim; ++i) {
      if (t.shape[i] != 0 && n > kMax / t.shape[i]) {
        fail_argument(w + ": shape " + shape_string(t) + " has more than 2^63 - 1 elements");
      }
      n *= t.shape[i];
    }
  } else {
    n = 0;
  }
  // Whether `count` elements fit in 2^63 - 1 bytes (sub-byte and odd widths rounded up).
  const int64_t bits_per_element = static_cast<int64_t>(t.dtype.bits) * t.dtype.lanes;
  const auto bytes_fit = [&](int64_t count) {
    if (bits_per_element % 8 == 0) return count <= kMax / (bits_per_element / 8);
    return count <= (kMax - 7) / bits_per_element;
  };
  if (!bytes_fit(n)) {
    fail_argument(w + ": shape " + shape_string(t) + " of " + dtype_string(t.dtype) +
                  " is more than 2^63 - 1 bytes");
  }
  // Strides: the farthest element they reach (in elements) must fit as well; NULL strides
  // are row-major, covered by the element count.
  if (t.strides != nullptr && !empty) {
    int64_t reach = 0;
    for (int32_t i = 0; i < t.ndim; ++i) {
      if (t.shape[i] <= 1) continue;
      const int64_t st = t.strides[i];
      if (st == INT64_MIN) {
        fail_argument(w + ": stride " + std::to_string(i) + " is " + std::to_string(st));
      }
      const int64_t a = st < 0 ? -st : st;
      const int64_t span = t.shape[i] - 1;
      if (a != 0 && (span > kMax / a || reach > kMax - a * span)) {
        fail_argument(w + ": stride " + std::to_string(i) + " (" + std::to_string(st) +
                      ") reaches beyond 2^63 - 1 elements");
      }
      reach += a * span;
    }
    if (reach == kMax || !bytes_fit(reach + 1)) {
      fail_argument(w + ": its strides reach more than 2^63 - 1 bytes");
    }
  }
}

// Non-NULL, a valid description (validate_tensor), and data unless it has no elements.
inline const DLTensor& expect_tensor(const DLTensor* t, std::string_view what) {
  if (t == nullptr) fail_argument(std::string(what) + " is NULL");
  validate_tensor(*t, what);
  if (t->data == nullptr && numel(*t) != 0) fail_argument(std::string(what) + " has no data");
  return *t;
}

inline void expect_dtype(const DLTensor& t, DLDataType dtype, std::string_view what) {
  if (t.dtype.code != dtype.code || t.dtype.bits != dtype.bits || t.dtype.lanes != dtype.lanes) {
    fail_argument(std::string(what) + " has dtype " + dtype_string(t.dtype) + ", expected " +
                  dtype_string(dtype));
  }
}
inline void expect_fp32(const DLTensor& t, std::string_view what) {
  expect_dtype(t, DLDataType{kDLFloat, 32, 1}, what);
}
inline void expect_contiguous(const DLTensor& t, std::string_view what) {
  if (!is_contiguous(t)) fail_argument(std::string(what) + " is not contiguous");
}
inline void expect_cpu(const DLTensor& t, std::string_view what) {
  if (!is_cpu(t)) {
    fail_argument(std::string(what) + " is on " + device_string(t.device) +
                  ", expected host memory");
  }
}
inline void expect_device(const DLTensor& t, DLDevice device, std::string_view what) {
  if (!same_device(t.device, device)) {
    fail_argument(std::string(what) + " is on " + device_string(t.device) + ", expected " +
                  device_string(device));
  }
}
// "grad 3 has shape [4,5] but param 3 has [4,4]"
inline void expect_same_shape(const DLTensor& a, std::string_view a_what, const DLTensor& b,
                              std::string_view b_what) {
  if (!same_shape(a, b)) {
    fail_argument(std::string(a_what) + " has shape " + shape_string(a) + " but " +
                  std::string(b_what) + " has " + shape_string(b));
  }
}
inline void expect_same_device(const DLTensor& a, std::string_view a_what, const DLTensor& b,
                               std::string_view b_what) {
  if (!same_device(a.device, b.device)) {
    fail_argument(std::string(a_what) + " is on " + device_string(a.device) + " but " +
                  std::string(b_what) + " is on " + device_string(b.device));
  }
}
inline void expect_numel(const DLTensor& t, int64_t n, std::string_view what) {
  if (numel(t) != n) {
    fail_argument(std::string(what) + " has " + std::to_string(numel(t)) + " elements, expected " +
                  std::to_string(n));
  }
}

}  // namespace loom::sdk

#endif  // LOOM_SDK_TENSOR_HPP
