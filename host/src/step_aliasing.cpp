#include "step_aliasing.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <tuple>
#include <vector>

namespace loom::host {
namespace {

// One array the step writes: where it was listed and the bytes it spans.
struct Span {
  size_t group = 0;
  size_t tensor = 0;
  bool master = false;
  const DLTensor* t = nullptr;
  int32_t device_type = 0;
  int32_t device_id = 0;
  uintptr_t begin = 0;  // first byte of the lowest element
  uintptr_t end = 0;    // one past the last byte of the highest element
  bool dense = false;   // its elements fill [begin, end) exactly, each byte once
};

// Element `i` of an ABI array, whose stride is the sender's struct_size (a newer or older
// minor than ours), copied into a zeroed struct; false when it is too short to hold the
// `need` bytes read here (the plugin then refuses the step with its own message).
template <class T>
bool element(const T* base, size_t i, uint32_t need, T& out) {
  if (base == nullptr || base->struct_size < need) return false;
  out = T{};
  const auto* bytes = reinterpret_cast<const unsigned char*>(base) + i * base->struct_size;
  std::memcpy(&out, bytes, std::min<size_t>(base->struct_size, sizeof(T)));
  return out.struct_size >= need;
}

// The bytes `t` spans; false for an empty tensor (nothing to update) and for one whose
// layout is malformed or overflows (left to the plugin to refuse).
bool measure(const DLTensor& t, Span& s) {
  if (t.data == nullptr || t.ndim < 0 || (t.ndim > 0 && t.shape == nullptr)) return false;
  const int64_t bits = int64_t{t.dtype.bits} * t.dtype.lanes;
  const int64_t item = (bits + 7) / 8;
  if (item <= 0) return false;
  int64_t numel = 1, lo = 0, hi = 0;              // hi, lo: element offsets of the extreme elements
  std::vector<std::pair<int64_t, int64_t>> dims;  // (|stride|, extent) of dims with extent > 1
  for (int32_t d = 0; d < t.ndim; ++d) {
    const int64_t n = t.shape[d];
    if (n < 0) return false;
    if (n == 0) return false;
    if (__builtin_mul_overflow(numel, n, &numel)) return false;
    if (t.strides == nullptr || n == 1) continue;
    int64_t reach = 0;
    if (__builtin_mul_overflow(n - 1, t.strides[d], &reach)) return false;
    if (__builtin_add_overflow(reach < 0 ? lo : hi, reach, reach < 0 ? &lo : &hi)) return false;
    dims.emplace_back(t.strides[d] < 0 ? -t.strides[d] : t.strides[d], n);
  }
  if (t.strides == nullptr) {
    hi = numel - 1;
    s.dense = true;
  } else {
    // Dense when, ordered by stride, each stride is the product of the extents below it
    // (a row-major, column-major or permuted layout, possibly flipped).
    std::sort(dims.begin(), dims.end());
    int64_t expected = 1;
    s.dense = true;
    for (const auto& [stride, n] : dims) {
      if (stride != expected) s.dense = false;
      if (__builtin_mul_overflow(expected, n, &expected)) return false;
    }
  }
  if (bits % 8 != 0) s.dense = false;  // packed sub-byte elements: the extent is approximate
  int64_t first = 0, past = 0;
  if (__builtin_mul_overflow(lo, item, &first) || __builtin_add_overflow(hi, 1, &past) ||
      __builtin_mul_overflow(past, item, &past)) {
    return false;
  }
  const uintptr_t origin = reinterpret_cast<uintptr_t>(t.data) + t.byte_offset;
  s.begin = origin + static_cast<uintptr_t>(first);  // wraps for a negative offset, as intended
  s.end = origin + static_cast<uintptr_t>(past);
  s.device_type = static_cast<int32_t>(t.device.device_type);
  s.device_id = t.device.device_id;
  return s.end > s.begin;
}

bool same_layout(const Span& a, const Span& b) {
  const DLTensor& x = *a.t;
  const DLTensor& y = *b.t;
  if (a.begin != b.begin || a.end != b.end || x.ndim != y.ndim || x.dtype.bits != y.dtype.bits ||
      x.dtype.lanes != y.dtype.lanes) {
    return false;
  }
  for (int32_t d = 0; d < x.ndim; ++d) {
    if (x.shape[d] != y.shape[d]) return false;
    if ((x.strides == nullptr) != (y.strides == nullptr)) return false;
    if (x.strides != nullptr && x.shape[d] > 1 && x.strides[d] != y.strides[d]) return false;
  }
  return true;
}

std::string label(const Span& s) {
  return "groups[" + std::to_string(s.group) + "].tensors[" + std::to_string(s.tensor) + "]." +
         (s.master ? "master" : "param");
}

bool listed_before(const Span& a, const Span& b) {
  return std::tie(a.group, a.tensor, a.master) < std::tie(b.group, b.tensor, b.master);
}

std::string describe(const Span& x, const Span& y) {
  const Span& a = listed_before(x, y) ? x : y;
  const Span& b = listed_before(x, y) ? y : x;
  std::string what;
  if (a.begin == b.begin && a.end == b.end) {
    what = " are the same array (" + std::to_string(a.end - a.begin) + " bytes)";
  } else {
    what = " overlap (" + std::to_string(std::min(a.end, b.end) - std::max(a.begin, b.begin)) +
           " bytes in common)";
  }
  return label(a) + " and " + label(b) + what +
         ": each array must be listed once, or the step would update it twice; nothing was "
         "updated";
}

}  // namespace

std::string find_aliased_arrays(const loom_optimizer_step_args& args) {
  if (args.struct_size < LOOM_STRUCT_SIZE(loom_optimizer_step_args, group_count) ||
      args.groups == nullptr) {
    return "";
  }
  std::vector<Span> spans;
  for (size_t g = 0; g < args.group_count; ++g) {
    loom_optimizer_group group;
    if (!element(args.groups, g, LOOM_STRUCT_SIZE(loom_optimizer_group, tensor_count), group)) {
      return "";
    }
    for (size_t t = 0; t < group.tensor_count && group.tensors != nullptr; ++t) {
      loom_optimizer_tensor tensor;
      if (!element(group.tensors, t, LOOM_STRUCT_SIZE(loom_optimizer_tensor, master), tensor)) {
        return "";
      }
      for (const bool master : {false, true}) {
        const DLTensor* written = master ? tensor.master : tensor.param;
        if (written == nullptr) continue;
        Span s;
        s.group = g;
        s.tensor = t;
        s.master = master;
        s.t = written;
        if (measure(*written, s)) spans.push_back(s);
      }
    }
  }
  // Sorted by device and first byte, two dense arrays share memory exactly when one begins
  // before the furthest end of those before it. Strided arrays with holes may interleave
  // without sharing a byte, so for them only an identical layout is reported.
  std::vector<size_t> order(spans.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t i, size_t j) {
    const Span& a = spans[i];
    const Span& b = spans[j];
    return std::tie(a.device_type, a.device_id, a.begin, a.end, i) <
           std::tie(b.device_type, b.device_id, b.begin, b.end, j);
  });
  const Span* furthest = nullptr;  // the dense array reaching furthest on this device so far
  for (size_t k = 0; k < order.size(); ++k) {
    const Span& s = spans[order[k]];
    const bool same_device = k > 0 && spans[order[k - 1]].device_type == s.device_type &&
                             spans[order[k - 1]].device_id == s.device_id;
    if (!same_device) furthest = nullptr;
    if (s.dense && furthest != nullptr && s.begin < furthest->end) return describe(*furthest, s);
    for (size_t j = k; j > 0 && same_device; --j) {
      const Span& p = spans[order[j - 1]];
      if (p.device_type != s.device_type || p.device_id != s.device_id || p.begin != s.begin) {
        break;
      }
      if (same_layout(p, s)) return describe(p, s);
    }
    if (s.dense && (furthest == nullptr || s.end > furthest->end)) furthest = &s;
  }
  return "";
}

}  // namespace loom::host
