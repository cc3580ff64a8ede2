// The "loom.quantizer/1" kind in the SDK (loom/kinds/quantizer.h): the base class a weight or
// activation quantizer derives from and the table the SDK builds from it. The checked views a
// quantizer receives (quant_matrix, quant_tensors, expect_same_format) are in
// loom/sdk/quantizer.hpp, included here.
#ifndef LOOM_SDK_KINDS_QUANTIZER_HPP
#define LOOM_SDK_KINDS_QUANTIZER_HPP

#include <loom/kinds/quantizer.h>
#include <loom/sdk/kinds/table.hpp>
#include <loom/sdk/moe.hpp>
#include <loom/sdk/plugin.hpp>
#include <loom/sdk/quant_format.hpp>
#include <loom/sdk/quantizer.hpp>
#include <loom/sdk/tensor.hpp>

#include <cstdint>
#include <cstring>
#include <string>

namespace loom::sdk {

// "loom.quantizer/1" (since 1.5): weight and activation quantization.
//   required: void layout(loom_quantizer_layout_args&)                       [any]
//             void quantize(const loom_quantizer_quantize_args&,
//                           const loom_quantizer_layout_args& layout)        [any]
//             void dequantize(const loom_quantizer_quantize_args&,
//                             const loom_quantizer_layout_args& layout)      [any]
//   optional: void matmul(const loom_quantizer_matmul_args&,
//                         const loom_quantizer_layout_args& layout)          [any]
//   Before layout the SDK checks role, ndim 2, the shape, a float dtype, matmul_rows >= 0
//   and the caller's format struct; it zeroes every output, points the format's ndim and
//   shape at the caller's and sets LOOM_QUANTIZER_HAS_MATMUL when the class has matmul and
//   the role is WEIGHT (a layout clears it for a format its matmul does not take). After it,
//   the table clears HAS_MATMUL (and INT8_ACTIVATIONS, matmul_workspace_bytes) when there is
//   no matmul for the format, checks the format (check_quant_format) and fills packed_bytes,
//   scale_count and zero_point_count from it; a class that set one of them differently, or a
//   broken format, is the plugin's bug (INTERNAL). Before quantize and dequantize (and
//   matmul, for W [N, K] from the format's shape and x [M, K]) it lays out the call's shape
//   and role itself and hands that layout to the class, after checking against it: the
//   given format field by field (expect_same_format), x 2-D float contiguous, packed,
//   scales and zero points (quant_tensors), the workspace; for matmul also that the layout
//   has HAS_MATMUL (else UNIMPLEMENTED), K agreeing, bias [N] and y [M, N] of x's dtype;
//   every tensor on x's device. The values (NaN, codes 3 of ternary data) are the class's.
//   Quantize's first_bad (since 1.7), when given: int64, one element, contiguous, on x's
//   device; a 1.6 caller's shorter args reach the class as a full struct with it NULL, and
//   dequantize always sees it NULL. A class reports through it with set_first_bad
//   (loom/sdk/quantizer.hpp) on the host; on CUDA it writes the device value on the stream.
struct Quantizer {
  static constexpr const char* kKind = LOOM_KIND_QUANTIZER;
  using sdk_kind = Quantizer;
};

namespace detail {

template <class T>
constexpr bool kQuantizerMultiplies = requires(T& t, const loom_quantizer_matmul_args& a,
                                               const loom_quantizer_layout_args& l) {
  t.matmul(a, l);
};

template <class T>
struct QuantizerTable {
  using E = Entry<T>;

  static constexpr uint32_t kKnownFlags =
      LOOM_QUANTIZER_HAS_MATMUL | LOOM_QUANTIZER_INT8_ACTIVATIONS;

  static void check_role(int32_t role, const std::string& call) {
    if (role != LOOM_QUANTIZER_WEIGHT && role != LOOM_QUANTIZER_ACTIVATION) {
      fail_argument(call + ": role " + std::to_string(role) +
                    " is not LOOM_QUANTIZER_WEIGHT (1) or LOOM_QUANTIZER_ACTIVATION (2)");
    }
  }

  // The class's layout into `full` (whose format points to a caller's descriptor that this
  // zeroes first), then the checks and the fields the table owns.
  static void layout_into(T& obj, loom_quantizer_layout_args& full) {
    loom_quant_format* f = full.format;
    const uint32_t format_size = f->struct_size;
    std::memset(static_cast<void*>(f), 0,
                format_size < sizeof(loom_quant_format) ? format_size : sizeof(loom_quant_format));
    f->struct_size = format_size;
    f->ndim = full.ndim;
    f->shape = full.shape;
    const bool can = kQuantizerMultiplies<T> && full.role == LOOM_QUANTIZER_WEIGHT;
    full.flags = can ? LOOM_QUANTIZER_HAS_MATMUL : 0u;
    full.reserved3 = 0;
    full.packed_bytes = 0;
    full.scale_count = 0;
    full.zero_point_count = 0;
    full.workspace_bytes = 0;
    full.matmul_workspace_bytes = 0;
    obj.layout(full);
    check_known_flags(full.flags, kKnownFlags, "layout");
    if (!can || (full.flags & LOOM_QUANTIZER_HAS_MATMUL) == 0) {
      full.flags = 0;
      full.matmul_workspace_bytes = 0;
    }
    if (f->ndim != full.ndim || f->shape != full.shape) {
      plugin_bug("layout", "changed the format's ndim or shape (they are the caller's)");
    }
    loom_quant_format checked{};
    try {
      checked = check_quant_format(f, "format");
    } catch (const Error& e) {
      plugin_bug("layout", std::string("returned a broken format: ") + e.what());
    }
    const uint64_t bytes = packed_bytes(checked);
    const auto groups = static_cast<int64_t>(quant_group_count(checked));
    const bool zeros =
        checked.scheme == LOOM_QUANT_INT && (checked.flags & LOOM_QUANT_SYMMETRIC) == 0;
    const int64_t zero_count = zeros ? groups : 0;
    if (full.packed_bytes != 0 && full.packed_bytes != bytes) {
      plugin_bug("layout", "gave packed_bytes " + std::to_string(full.packed_bytes) +
                               ", but its format takes " + std::to_string(bytes));
    }
    if (full.scale_count != 0 && full.scale_count != groups) {
      plugin_bug("layout", "gave scale_count " + std::to_string(full.scale_count) +
                               ", but its format has " + std::to_string(groups) + " groups");
    }
    if (full.zero_point_count != 0 && full.zero_point_count != zero_count) {
      plugin_bug("layout", "gave zero_point_count " + std::to_string(full.zero_point_count) +
                               ", but its format has " + std::to_string(zero_count));
    }
    full.packed_bytes = bytes;
    full.scale_count = groups;
    full.zero_point_count = zero_count;
  }

  static void check_layout_args(const loom_quantizer_layout_args& a, const std::string& call) {
    check_role(a.role, call);
    if (a.ndim != 2) {
      fail_argument(call + ": ndim is " + std::to_string(a.ndim) + "; a quantizer takes 2-D " +
                    (a.role == LOOM_QUANTIZER_WEIGHT ? "[N, K] weights" : "[M, K] activations"));
    }
    if (a.shape == nullptr) fail_argument(call + ": shape is NULL");
    for (int d = 0; d < 2; ++d) {
      if (a.shape[d] < 0) {
        fail_argument(call + ": shape[" + std::to_string(d) + "] is " + std::to_string(a.shape[d]));
      }
    }
    if (!is_quantizer_float(a.dtype)) {
      fail_argument(call + ": dtype " + dtype_string(a.dtype) +
                    " is not float32, float16 or bfloat16");
    }
    if (a.matmul_rows < 0) {
      fail_argument(call + ": matmul_rows is " + std::to_string(a.matmul_rows));
    }
    if (a.format == nullptr) fail_argument(call + ": format is NULL");
    check_struct_size(a.format->struct_size, LOOM_QUANT_FORMAT_SIZE, call + ": format");
  }

  // The layout the table makes for a call: its format lives in `out`, its shape in `shape`.
  static loom_quantizer_layout_args layout_for(T& obj, int32_t role, const int64_t* shape,
                                               DLDataType dtype, int64_t matmul_rows,
                                               loom_quant_format& out) {
    loom_quantizer_layout_args l{};
    l.struct_size = LOOM_QUANTIZER_LAYOUT_ARGS_SIZE;
    l.role = role;
    l.ndim = 2;
    l.shape = shape;
    l.dtype = dtype;
    l.matmul_rows = matmul_rows;
    out = loom_quant_format{};
    out.struct_size = LOOM_QUANT_FORMAT_SIZE;
    l.format = &out;
    check_layout_args(l, "quantizer layout");
    layout_into(obj, l);
    return l;
  }

  static loom_status* layout(void* instance, loom_quantizer_layout_args* args) noexcept {
    return E::checked(instance, args, LOOM_QUANTIZER_LAYOUT_ARGS_SIZE, "quantizer layout args",
                      [](loom_quantizer_layout_args& a, const Instance<T>& self) {
                        check_layout_args(a, "quantizer layout");
                        fill(&a, "quantizer layout args", [&](loom_quantizer_layout_args& full) {
                          layout_into(self.shared(), full);
                        });
                      });
  }

  // quantize and dequantize: the same checks.
  template <bool kQuantize>
  static loom_status* code(void* instance, const loom_quantizer_quantize_args* args) noexcept {
    const char* what = kQuantize ? "quantizer quantize args" : "quantizer dequantize args";
    return E::checked(
        instance, args, LOOM_QUANTIZER_QUANTIZE_ARGS_SIZE_1_5, what,
        [](const loom_quantizer_quantize_args& in, const Instance<T>& self) {
          loom_quantizer_quantize_args a =
              normalized(&in, kQuantize ? "quantizer quantize args" : "quantizer dequantize args");
          const std::string call = kQuantize ? "quantizer quantize" : "quantizer dequantize";
          check_role(a.role, call);
          if (a.format == nullptr) fail_argument(call + ": format is NULL");
          const loom_quant_format given = check_quant_format(a.format, "format");
          quant_matrix(a.x, "x");
          const DLTensor& x = *a.x;
          T& obj = self.shared();
          const int64_t shape[2] = {x.shape[0], x.shape[1]};
          loom_quant_format expected{};
          const loom_quantizer_layout_args l = layout_for(obj, a.role, shape, x.dtype, 0, expected);
          expect_same_format(given, expected, "format");
          quant_tensors(a.packed, a.scales, a.zero_points, l, x.device);
          check_buffer(a.workspace, a.workspace_bytes, l.workspace_bytes, "workspace", "layout");
          if constexpr (kQuantize) {
            if (a.first_bad != nullptr) {
              expect_first_bad(a.first_bad, x.device);
            }
            obj.quantize(a, l);
          } else {
            a.first_bad = nullptr;
            obj.dequantize(a, l);
          }
        });
  }

  static loom_status* matmul(void* instance, const loom_quantizer_matmul_args* args) noexcept {
    return E::checked(instance, args, LOOM_QUANTIZER_MATMUL_ARGS_SIZE, "quantizer matmul args",
                      [](const loom_quantizer_matmul_args& a, const Instance<T>& self) {
                        if (a.format == nullptr) fail_argument("quantizer matmul: format is NULL");
                        const loom_quant_format given = check_quant_format(a.format, "format");
                        if (given.ndim != 2) {
                          fail_argument("format.ndim is " + std::to_string(given.ndim) +
                                        "; the weight of a matmul is [N, K]");
                        }
                        quant_matrix(a.x, "x");
                        const DLTensor& x = *a.x;
                        const int64_t n = given.shape[0], k = given.shape[1], m = x.shape[0];
                        if (x.shape[1] != k) {
                          fail_argument("x has shape " + shape_string(x) + " but the weight is [" +
                                        std::to_string(n) + ", " + std::to_string(k) +
                                        "]: x's columns must be K " + std::to_string(k));
                        }
                        T& obj = self.shared();
                        const int64_t shape[2] = {n, k};
                        loom_quant_format expected{};
                        const loom_quantizer_layout_args l =
                            layout_for(obj, LOOM_QUANTIZER_WEIGHT, shape, x.dtype, m, expected);
                        if ((l.flags & LOOM_QUANTIZER_HAS_MATMUL) == 0) {
                          throw Error(LOOM_ERR_UNIMPLEMENTED,
                                      "quantizer matmul: this quantizer has no matmul for its " +
                                          std::to_string(expected.bits) +
                                          "-bit format of this weight");
                        }
                        expect_same_format(given, expected, "format");
                        quant_tensors(a.packed, a.scales, a.zero_points, l, x.device);
                        if (a.bias != nullptr) {
                          expect_moe_tensor(a.bias, {n}, x.dtype, x.device, "bias", "[N]");
                        }
                        expect_moe_tensor(a.y, {m, n}, x.dtype, x.device, "y", "[M, N]");
                        check_buffer(a.workspace, a.workspace_bytes, l.matmul_workspace_bytes,
                                     "workspace", "layout");
                        if constexpr (kQuantizerMultiplies<T>) obj.matmul(a, l);
                      });
  }

  static const loom_quantizer_v1* get() {
    static_assert(
        requires(T & t, loom_quantizer_layout_args & l, const loom_quantizer_quantize_args& q) {
          t.layout(l);
          t.quantize(q, l);
          t.dequantize(q, l);
        },
        "a Quantizer needs void layout(loom_quantizer_layout_args&), void quantize(const "
        "loom_quantizer_quantize_args&, const loom_quantizer_layout_args&) and void "
        "dequantize(const loom_quantizer_quantize_args&, const loom_quantizer_layout_args&)");
    static const loom_quantizer_v1 table = [] {
      loom_quantizer_v1 v{};
      v.struct_size = LOOM_QUANTIZER_V1_SIZE;
      v.layout = &layout;
      v.quantize = &code<true>;
      v.dequantize = &code<false>;
      if constexpr (kQuantizerMultiplies<T>) v.matmul = &matmul;
      return v;
    }();
    return &table;
  }
};

template <>
struct KindTraits<Quantizer> {
  template <class T>
  static const void* table() {
    return QuantizerTable<T>::get();
  }
};

}  // namespace detail
}  // namespace loom::sdk

#endif  // LOOM_SDK_KINDS_QUANTIZER_HPP
