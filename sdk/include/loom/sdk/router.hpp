// Checked views of the tensors a loom.router/1 plugin receives (loom/kinds/router.h). The
// SDK's RouterTable builds them before calling the class, so a class gets shapes, strides
// and devices that agree; a class (or a test) may call them too.
#ifndef LOOM_SDK_ROUTER_HPP
#define LOOM_SDK_ROUTER_HPP

#include <loom/kinds/router.h>
#include <loom/sdk/tensor.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

namespace loom::sdk {

// A [batch, positions, channels] tensor whose channels are contiguous; the batch and
// position strides are free (in elements, as DLPack counts them).
struct TokenTensor {
  void* data = nullptr;  // the first element (byte_offset applied)
  int64_t batch = 0;
  int64_t positions = 0;
  int64_t channels = 0;
  int64_t batch_stride = 0;     // elements between sequences
  int64_t position_stride = 0;  // elements between positions of a sequence
  std::size_t element_bytes = 0;
  DLDataType dtype{kDLFloat, 32, 1};
  DLDevice device{kDLCPU, 0};
};

// Checks `t` is a 3-D tensor of 8, 16, 32 or 64-bit single-lane elements with unit channel
// stride and non-negative other strides, and returns its view. `what` names it in errors.
inline TokenTensor token_tensor(const DLTensor* t, std::string_view what) {
  const DLTensor& d = expect_tensor(t, what);
  const std::string w(what);
  if (d.ndim != 3) {
    fail_argument(w + " has shape " + shape_string(d) + ", expected [batch, positions, channels]");
  }
  if (d.dtype.lanes != 1 ||
      (d.dtype.bits != 8 && d.dtype.bits != 16 && d.dtype.bits != 32 && d.dtype.bits != 64)) {
    fail_argument(w + " has dtype " + dtype_string(d.dtype) +
                  ", expected single-lane elements of 8, 16, 32 or 64 bits");
  }
  TokenTensor v;
  v.batch = d.shape[0];
  v.positions = d.shape[1];
  v.channels = d.shape[2];
  v.element_bytes = d.dtype.bits / 8u;
  v.dtype = d.dtype;
  v.device = d.device;
  if (d.strides == nullptr) {
    v.position_stride = v.channels;
    v.batch_stride = v.positions * v.channels;
  } else {
    if (v.channels > 1 && d.strides[2] != 1) {
      fail_argument(w + " has channel stride " + std::to_string(d.strides[2]) +
                    "; the channels of a token must be contiguous (stride 1)");
    }
    if (d.strides[0] < 0 || d.strides[1] < 0) {
      fail_argument(w + " has a negative stride (" + std::to_string(d.strides[0]) + ", " +
                    std::to_string(d.strides[1]) + ")");
    }
    v.batch_stride = d.strides[0];
    v.position_stride = d.strides[1];
  }
  if (d.byte_offset % v.element_bytes != 0) {
    fail_argument(w + " has byte_offset " + std::to_string(d.byte_offset) +
                  ", not a multiple of its element size");
  }
  v.data = static_cast<char*>(d.data) + d.byte_offset;
  return v;
}

// Checks that the rows (the [batch, position] pairs) of a tensor a router writes do not share
// an element, so writing one row never changes another (and threads writing different rows
// never race). Only extents above 1 constrain: with the two strides sorted, s1 (extent n1)
// must hold a row (s1 >= channels) and s2 must clear the n1 rows of s1 ((n1 - 1) * s1 +
// channels). Layouts that interleave rows more finely than that are refused too.
inline void expect_disjoint_rows(const TokenTensor& v, std::string_view what) {
  if (v.batch < 1 || v.positions < 1 || v.channels < 1) return;
  struct Axis {
    const char* name;
    const char* items;
    int64_t stride;
    int64_t extent;
  };
  Axis axes[2] = {{"batch", "sequences", v.batch_stride, v.batch},
                  {"position", "positions", v.position_stride, v.positions}};
  int n = 0;
  Axis used[2] = {axes[0], axes[1]};
  for (const Axis& a : axes) {
    if (a.extent > 1) used[n++] = a;
  }
  if (n == 0) return;
  if (n == 2 && used[1].stride < used[0].stride) std::swap(used[0], used[1]);
  const std::string w(what);
  const std::string why = " (a router writes every row of " + w + ", so rows must not overlap)";
  if (used[0].stride < v.channels) {
    fail_argument(w + " has " + used[0].name + " stride " + std::to_string(used[0].stride) +
                  " over " + std::to_string(used[0].extent) + " " + used[0].items +
                  ", less than its " + std::to_string(v.channels) + " channels" + why);
  }
  if (n == 1) return;
  int64_t span = 0;
  if (__builtin_mul_overflow(used[0].extent - 1, used[0].stride, &span) ||
      __builtin_add_overflow(span, v.channels, &span) || used[1].stride < span) {
    fail_argument(w + " has " + used[1].name + " stride " + std::to_string(used[1].stride) +
                  ", less than the span of its " + std::to_string(used[0].extent) + " " +
                  used[0].items + " at " + used[0].name + " stride " +
                  std::to_string(used[0].stride) + " (" + std::to_string(used[0].extent - 1) +
                  " * " + std::to_string(used[0].stride) + " + " + std::to_string(v.channels) +
                  " channels)" + why);
  }
}

// Checks a [batch, kept] int32 contiguous indices tensor and returns its first element.
inline const int32_t* router_indices(const DLTensor* t, int64_t batch, int64_t kept,
                                     std::string_view what) {
  const DLTensor& d = expect_tensor(t, what);
  const std::string w(what);
  expect_dtype(d, DLDataType{kDLInt, 32, 1}, what);
  expect_contiguous(d, what);
  if (d.ndim != 2 || d.shape[0] != batch || d.shape[1] != kept) {
    fail_argument(w + " has shape " + shape_string(d) + ", expected [" + std::to_string(batch) +
                  ", " + std::to_string(kept) + "] (batch, kept)");
  }
  return reinterpret_cast<const int32_t*>(static_cast<const char*>(d.data) + d.byte_offset);
}

// Host indices: every row strictly increasing within [0, seq_len). The message names the
// first bad element.
inline void check_router_rows(const int32_t* idx, int64_t batch, int64_t kept, int64_t seq_len,
                              std::string_view what) {
  for (int64_t b = 0; b < batch; ++b) {
    const int32_t* row = idx + b * kept;
    for (int64_t j = 0; j < kept; ++j) {
      const int64_t v = row[j];
      if (v < 0 || v >= seq_len || (j > 0 && v <= row[j - 1])) {
        fail_argument(std::string(what) + "[" + std::to_string(b) + ", " + std::to_string(j) +
                      "] = " + std::to_string(v) +
                      (v < 0 || v >= seq_len
                           ? " is outside the " + std::to_string(seq_len) + " positions"
                           : " does not increase on [" + std::to_string(b) + ", " +
                                 std::to_string(j - 1) + "] = " + std::to_string(row[j - 1])));
      }
    }
  }
}

// The checked arguments of gather and scatter.
struct RouterMove {
  TokenTensor full;  // [batch, seq_len, channels]
  TokenTensor kept;  // [batch, kept, channels]
  const int32_t* indices = nullptr;
  int64_t batch = 0, seq_len = 0, kept_count = 0, channels = 0;
  DLDevice device{kDLCPU, 0};
  void* stream = nullptr;
};

// Which tensor a move writes: gather writes kept, scatter writes full.
enum class RouterMoveKind { kGather, kScatter };

// Checks gather/scatter arguments: shapes that agree, one dtype, one device; on host memory
// also the index rows (check_router_rows), so a kernel may index without checks. With a
// kind, also that the destination's rows do not overlap (expect_disjoint_rows); the SDK's
// table always passes one.
inline RouterMove router_move(const loom_router_move_args& a) {
  RouterMove m;
  m.full = token_tensor(a.full, "full");
  m.kept = token_tensor(a.kept, "kept");
  m.batch = m.full.batch;
  m.seq_len = m.full.positions;
  m.kept_count = m.kept.positions;
  m.channels = m.full.channels;
  if (m.kept.batch != m.batch || m.kept.channels != m.channels) {
    fail_argument("kept has shape [" + std::to_string(m.kept.batch) + ", " +
                  std::to_string(m.kept.positions) + ", " + std::to_string(m.kept.channels) +
                  "] but full has [" + std::to_string(m.batch) + ", " + std::to_string(m.seq_len) +
                  ", " + std::to_string(m.channels) + "] (batch and channels must agree)");
  }
  if (m.kept_count > m.seq_len) {
    fail_argument("kept has " + std::to_string(m.kept_count) + " positions per sequence but full " +
                  "has only " + std::to_string(m.seq_len));
  }
  if (m.kept.dtype.code != m.full.dtype.code || m.kept.dtype.bits != m.full.dtype.bits) {
    fail_argument("kept has dtype " + dtype_string(m.kept.dtype) + " but full has " +
                  dtype_string(m.full.dtype));
  }
  if (m.seq_len > INT32_MAX) {
    fail_argument("full has " + std::to_string(m.seq_len) +
                  " positions; int32 indices address at most 2^31 - 1");
  }
  m.indices = router_indices(a.indices, m.batch, m.kept_count, "indices");
  if (!same_device(m.kept.device, m.full.device)) {
    fail_argument("kept is on " + device_string(m.kept.device) + " but full is on " +
                  device_string(m.full.device));
  }
  expect_device(*a.indices, m.full.device, "indices");
  m.device = m.full.device;
  m.stream = a.stream;
  if (is_cpu(m.device)) check_router_rows(m.indices, m.batch, m.kept_count, m.seq_len, "indices");
  return m;
}

inline RouterMove router_move(const loom_router_move_args& a, RouterMoveKind kind) {
  RouterMove m = router_move(a);
  if (kind == RouterMoveKind::kGather) {
    expect_disjoint_rows(m.kept, "kept");
  } else {
    expect_disjoint_rows(m.full, "full");
  }
  return m;
}

}  // namespace loom::sdk

#endif  // LOOM_SDK_ROUTER_HPP
