// zeroquant (kind loom.quantizer/1): ZeroQuant's group-wise INT weight quantization (2..8
// bits, symmetric or with zero points, groups along K, the exact range or DeepSpeed's) and
// token-wise dynamic INT8 activations, with real packed storage and matmuls that compute with
// it: W8A8 / W4A8 (x quantized per token, an INT8 x INT8 -> INT32 GEMM with the dequantization
// fused into its epilogue: oneDNN on the CPU, cuBLASLt on CUDA) or weight-only (float x times
// codes decoded in registers, the decode case). The kernels are loom_quant_core's; this file
// reads the parameters, lays out formats and dispatches by device. docs/quantization.md
// describes it for users.
#include <loom/sdk.hpp>
#include <loom/sdk/kinds/quantizer.hpp>
#include <loom/sdk/no_cuda.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "common/half.hpp"
#include "float_stage.hpp"
#include "int8_gemm.hpp"
#include "int_kernels.hpp"
#include "quant_core.hpp"
#include "zeroquant_cuda.hpp"

namespace {

namespace lq = loom::quant;
using loom::sdk::Context;
using loom::sdk::Error;

constexpr const char* kExact = "exact";
constexpr const char* kDeepSpeed = "deepspeed";

uint64_t align256(uint64_t v) { return (v + 255) / 256 * 256; }

[[noreturn]] void bad_param(const std::string& message, const char* param) {
  throw Error(LOOM_ERR_INVALID_ARGUMENT, message, param);
}

struct Params {
  lq::IntScheme scheme;
  int64_t group_size = 0;
  int64_t activation_bits = 8;
};

Params read_params(const Context& c) {
  Params p;
  const int64_t bits = c.get_int("bits");
  p.scheme.symmetric = c.get_bool("symmetric");
  if (bits < 2 || bits > 8) {
    bad_param("bits is " + std::to_string(bits) + "; zeroquant codes have 2 to 8 bits", "bits");
  }
  p.scheme.bits = static_cast<uint32_t>(bits);
  const std::string range = c.get_string("range");
  if (range == kExact) {
    p.scheme.range = lq::Range::kExact;
  } else if (range == kDeepSpeed) {
    p.scheme.range = lq::Range::kDeepSpeed;
  } else {
    bad_param("range is '" + range + "'; use 'exact' or 'deepspeed'", "range");
  }
  p.group_size = c.get_int("group_size");
  if (p.group_size < 0) {
    bad_param("group_size is " + std::to_string(p.group_size) +
                  "; use 0 (one group per output row) or a positive element count",
              "group_size");
  }
  p.activation_bits = c.get_int("activation_bits");
  if (p.activation_bits != 0 && p.activation_bits != 8) {
    bad_param("activation_bits is " + std::to_string(p.activation_bits) +
                  "; use 8 (W8A8 / W4A8: x quantized per token) or 0 (weight-only: float x)",
              "activation_bits");
  }
  std::string why;
  if (p.activation_bits == 8 && !lq::int8_matmul_supports(p.scheme, &why)) {
    bad_param("symmetric false with bits 8 and activation_bits 8: " + why, "symmetric");
  }
  return p;
}

const float* as_float(const DLTensor* t) {
  return t == nullptr
             ? nullptr
             : reinterpret_cast<const float*>(static_cast<const char*>(t->data) + t->byte_offset);
}
float* as_float_mut(DLTensor* t) {
  return reinterpret_cast<float*>(static_cast<char*>(t->data) + t->byte_offset);
}
const uint8_t* as_bytes(const DLTensor* t) {
  return t == nullptr
             ? nullptr
             : reinterpret_cast<const uint8_t*>(static_cast<const char*>(t->data) + t->byte_offset);
}
uint8_t* as_bytes_mut(DLTensor* t) {
  return t == nullptr ? nullptr
                      : reinterpret_cast<uint8_t*>(static_cast<char*>(t->data) + t->byte_offset);
}

bool on_cuda(const DLTensor& t) {
  if (loom::sdk::is_cpu(t.device)) return false;
  if (loom::sdk::is_cuda(t.device)) {
    if (!lq::have_cuda()) loom::sdk::throw_built_without_cuda("zeroquant: x is a CUDA tensor");
    return true;
  }
  throw Error(LOOM_ERR_INVALID_ARGUMENT, "zeroquant: x is on device type " +
                                             std::to_string(t.device.device_type) +
                                             "; zeroquant runs on CPU and CUDA tensors");
}

class ZeroQuant : public loom::sdk::Quantizer {
 public:
  static loom::sdk::Schema schema() {
    using loom::sdk::Bool;
    using loom::sdk::Int;
    using loom::sdk::String;
    return {
        Int("bits", 8,
            "Bits per weight code, 2 to 8. 8 (INT8) and 4 (INT4, two codes per byte, element 0 "
            "in the low nibble) are the tuned paths; other widths are packed end to end and "
            "may straddle bytes.")
            .int_range(2, 8),
        Bool("symmetric", true,
             "true: signed codes, x = s q, no zero points. false: unsigned codes 0 .. 2^bits - 1 "
             "with a uint8 zero point per group, x = s (q - z); the group's range is widened to "
             "hold 0, so 0 decodes exactly."),
        Int("group_size", 0,
            "Weight elements per scale along K (the input features, axis 1 of W [N, K]). 0: one "
            "group per output row (per-channel scales, the fastest matmul). Otherwise groups "
            "of this many consecutive elements of a row; the weight-only matmul takes a shorter "
            "last group, the INT8 GEMM (activation_bits 8) needs group_size to divide K.")
            .int_min(0),
        String("range", kExact,
               "How a group's scale is set. exact: the group's extreme lands on the largest code "
               "(symmetric s = max|x| / (2^(bits-1) - 1), codes +-(2^(bits-1) - 1); asymmetric "
               "s = (max - min) / (2^bits - 1)). deepspeed: DeepSpeed's simulated quantizer, "
               "which divides the range by 2^bits (symmetric s = 2 max|x| / 2^bits, codes "
               "-2^(bits-1) .. 2^(bits-1) - 1, the positive extreme clipped), bit for bit.")
            .choices({kExact, kDeepSpeed}),
        Int("activation_bits", 8,
            "8: matmul quantizes x per token (symmetric INT8, scale max|x_m| / 127) and runs "
            "an INT8 x INT8 -> INT32 GEMM with the dequantization fused into its epilogue "
            "(W8A8, or W4A8 with bits 4: the codes widened to int8, never to floats). 0: "
            "weight-only matmul, float x times the codes decoded in registers (the decode "
            "case: batch 1 to 16). The role ACTIVATION always gives INT8 codes per token.")
            .int_range(0, 8),
    };
  }

  static void validate_params(Context& c) { (void)read_params(c); }

  explicit ZeroQuant(Context& ctx) : p_(read_params(ctx)) {}

  void layout(loom_quantizer_layout_args& a) {
    if (!loom::sdk::is_quantizer_float(a.dtype)) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT, "zeroquant layout: dtype " +
                                                 loom::sdk::dtype_string(a.dtype) +
                                                 " is not float32, bfloat16 or float16");
    }
    const int64_t rows = a.shape[0];
    const int64_t k = a.shape[1];
    // A 16-bit x is quantized from (and dequantized to) a float32 copy in the workspace.
    const bool staged = lq::is_16bit(a.dtype);
    if (staged) a.workspace_bytes = lq::f16::staging_bytes(rows * k);
    loom_quant_format& f = *a.format;
    f.scheme = LOOM_QUANT_INT;
    f.packing = LOOM_QUANT_PACK_LSB_FIRST;
    f.axis = 1;
    f.scale_dtype = {kDLFloat, 32, 1};
    if (a.role == LOOM_QUANTIZER_ACTIVATION) {
      f.bits = 8;
      f.flags = LOOM_QUANT_SYMMETRIC;
      f.group_size = std::max<int64_t>(k, 1);
      return;
    }
    f.bits = p_.scheme.bits;
    f.flags = p_.scheme.symmetric ? LOOM_QUANT_SYMMETRIC : 0u;
    f.group_size = p_.group_size > 0 ? p_.group_size : std::max<int64_t>(k, 1);
    if (!p_.scheme.symmetric) f.zero_point_dtype = {kDLUInt, 8, 1};
    if (p_.activation_bits == 8 && p_.group_size > 0 && k % p_.group_size != 0) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  "group_size " + std::to_string(p_.group_size) +
                      " does not divide K = " + std::to_string(k) +
                      " (the weight's columns): the INT8 GEMM (activation_bits 8) runs one GEMM "
                      "per whole K group; use a group size that divides K, 0 (one group per "
                      "row), or activation_bits 0",
                  "group_size");
    }
    // The INT8 GEMM accumulates a K group in int32: |acc| <= 127 * 128 * kg must fit.
    constexpr int64_t kMaxInt8Group = std::numeric_limits<int32_t>::max() / (127 * 128);
    if (p_.activation_bits == 8 && f.group_size > kMaxInt8Group) {
      throw Error(
          LOOM_ERR_INVALID_ARGUMENT,
          (p_.group_size > 0 ? "group_size " + std::to_string(p_.group_size)
                             : "group_size 0 (one group of K = " + std::to_string(k) + ")") +
              " is over " + std::to_string(kMaxInt8Group) +
              ", the longest K group whose INT8 x INT8 sum fits the GEMM's int32 "
              "accumulator (activation_bits 8); use a smaller group_size or "
              "activation_bits 0",
          "group_size");
    }
    if ((a.flags & LOOM_QUANTIZER_HAS_MATMUL) != 0) {
      const int64_t m = a.matmul_rows;
      if (p_.activation_bits == 8) a.flags |= LOOM_QUANTIZER_INT8_ACTIVATIONS;
      a.matmul_workspace_bytes = matmul_own_bytes(m, rows, k);
      if (staged) {
        // x [m, K], y [m, N] and bias [N] in float32, after the scheme's own regions.
        a.matmul_workspace_bytes += lq::f16::staging_bytes(m * k) +
                                    lq::f16::staging_bytes(m * rows) + lq::f16::staging_bytes(rows);
      }
    }
  }

  void quantize(const loom_quantizer_quantize_args& a, const loom_quantizer_layout_args& l) {
    const DLTensor& x = *a.x;
    const int64_t rows = x.shape[0];
    const int64_t k = x.shape[1];
    // On the CPU the kernel widens a 16-bit x row by row itself; CUDA stages it (float_stage).
    const bool device = on_cuda(x);
    const lq::f16::Storage storage = lq::f16::storage_or_f32(x.dtype);
    const bool direct16 = !device && storage != lq::f16::Storage::kF32;
    const auto* x16 = static_cast<const uint16_t*>(lq::f16::data_of(x));
    auto stage = lq::float_stage(a.workspace, 0);
    const float* xs = direct16 ? nullptr : stage.in(a.x, a.stream);
    uint8_t* packed = as_bytes_mut(a.packed);
    float* scales = as_float_mut(a.scales);
    uint8_t* zeros = as_bytes_mut(a.zero_points);
    const bool weight = a.role == LOOM_QUANTIZER_WEIGHT;
    const lq::IntScheme q = weight ? p_.scheme : lq::IntScheme{8, true, lq::Range::kExact};
    const lq::Groups gs = lq::Groups::of(rows, k, l.format->group_size);
    int64_t bad = -1;
    if (device) {
      // With first_bad the check's outcome stays on the device: nothing waits for it here.
      int64_t* first_bad =
          a.first_bad != nullptr ? loom::sdk::expect_first_bad(a.first_bad, x.device) : nullptr;
      bad = lq::zq_cuda_quantize(x.device.device_id, xs, gs, q, packed, scales, zeros, a.stream,
                                 first_bad);
    } else {
      bad = direct16
                ? lq::quantize_int16(x16, storage == lq::f16::Storage::kBF16, gs, q,
                                     LOOM_QUANT_PACK_LSB_FIRST, packed, scales, zeros)
                : lq::quantize_int(xs, gs, q, LOOM_QUANT_PACK_LSB_FIRST, packed, scales, zeros);
      if (bad < 0) bad = overflowed_group(scales, gs, rows * k);
      if (loom::sdk::set_first_bad(a, bad)) return;
    }
    if (bad >= rows * k) {
      const int64_t g = bad - rows * k;
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  "zeroquant quantize: group " + std::to_string(g % gs.groups_per_row) +
                      " of row " + std::to_string(g / gs.groups_per_row) +
                      " of x spans a range wider than float32 holds (max - min overflows)");
    }
    if (bad >= 0) {
      float v = 0.0f;
      if (device) {
        lq::zq_cuda_read_float(x.device.device_id, xs + bad, &v);
      } else if (direct16) {
        v = storage == lq::f16::Storage::kBF16 ? loom::plugins::half::bf16_to_f32(x16[bad])
                                               : loom::plugins::half::f16_to_f32(x16[bad]);
      } else {
        v = xs[bad];
      }
      throw Error(LOOM_ERR_INVALID_ARGUMENT, std::string("zeroquant quantize: ") +
                                                 (weight ? "weight" : "activation") + " x" +
                                                 index_text(bad, k) + " is " + value_text(v) +
                                                 " (quantize takes finite values only)");
    }
  }

  // numel + the first group whose scale overflowed float32 (finite x, max - min too wide), or
  // -1 (host scales).
  static int64_t overflowed_group(const float* scales, const lq::Groups& gs, int64_t numel) {
    for (int64_t g = 0; g < gs.count(); ++g) {
      if (!std::isfinite(scales[g])) return numel + g;
    }
    return -1;
  }

  void dequantize(const loom_quantizer_quantize_args& a, const loom_quantizer_layout_args& l) {
    const DLTensor& x = *a.x;
    const bool weight = a.role == LOOM_QUANTIZER_WEIGHT;
    const lq::IntScheme q = weight ? p_.scheme : lq::IntScheme{8, true, lq::Range::kExact};
    lq::IntWeight w;
    w.packed = as_bytes(a.packed);
    w.scales = as_float(a.scales);
    w.zeros = as_bytes(a.zero_points);
    w.gs = lq::Groups::of(x.shape[0], x.shape[1], l.format->group_size);
    w.q = q;
    w.packing = LOOM_QUANT_PACK_LSB_FIRST;
    auto stage = lq::float_stage(a.workspace, 0);
    float* xs = stage.out(a.x);
    if (on_cuda(x)) {
      lq::zq_cuda_dequantize(x.device.device_id, w, xs, a.stream);
    } else {
      lq::dequantize_int(w, xs);
    }
    stage.finish(xs, a.x, a.stream);
  }

  void matmul(const loom_quantizer_matmul_args& a, const loom_quantizer_layout_args& l) {
    const DLTensor& x = *a.x;
    const int64_t m = x.shape[0];
    const int64_t n = l.format->shape[0];
    const int64_t k = l.format->shape[1];
    const lq::IntWeight w =
        weight_of(as_bytes(a.packed), as_float(a.scales), as_bytes(a.zero_points), n, k);
    // A 16-bit call's float32 x, bias and y follow the scheme's regions for m rows.
    auto stage = lq::float_stage(a.workspace, matmul_own_bytes(m, n, k));
    const float* xs = stage.in(a.x, a.stream);
    const float* bias = stage.in(a.bias, a.stream);
    float* y = stage.out(a.y);
    run_matmul(x, xs, m, w, bias, y, a.workspace, a.stream);
    stage.finish(y, a.y, a.stream);
  }

 private:
  void run_matmul(const DLTensor& x, const float* xs, int64_t m, const lq::IntWeight& w,
                  const float* bias, float* y, void* workspace, void* stream) const {
    const int64_t k = w.gs.cols;
    if (on_cuda(x)) {
      const int64_t bad = lq::zq_cuda_matmul(x.device.device_id, xs, m, w, bias, y,
                                             p_.activation_bits == 8, workspace, stream);
      if (bad >= 0) throw non_finite_x(bad, k, nullptr);
      return;
    }
    if (p_.activation_bits == 8) {
      if (!lq::have_int8_gemm()) {
        throw Error(LOOM_ERR_UNIMPLEMENTED,
                    "zeroquant matmul: this build has no CPU INT8 GEMM (oneDNN, libdnnl-dev, was "
                    "not found when it was configured); use activation_bits 0");
      }
      int64_t bad = -1;
      try {
        bad = lq::int8_matmul(xs, m, w, bias, y, workspace);
      } catch (const std::runtime_error& e) {
        throw Error(LOOM_ERR_INTERNAL, std::string("zeroquant matmul: ") + e.what());
      }
      if (bad >= 0) throw non_finite_x(bad, k, xs);
      return;
    }
    lq::matmul_weight_only(xs, m, w, bias, y, static_cast<float*>(workspace));
  }

  // The matmul workspace of the scheme itself for m rows of a weight [n, k] (the same regions
  // on the CPU and on CUDA: carve_int8_workspace).
  uint64_t matmul_own_bytes(int64_t m, int64_t n, int64_t k) const {
    if (p_.activation_bits == 8) {
      return m == 0 ? 0
                    : align256(lq::int8_matmul_workspace_bytes(
                          m, weight_of(nullptr, nullptr, nullptr, n, k)));
    }
    return align256(static_cast<uint64_t>(lq::weight_only_workspace_floats(m, k)) * 4u);
  }

  static std::string index_text(int64_t i, int64_t cols) {
    const int64_t c = cols > 0 ? cols : 1;
    return "[" + std::to_string(i / c) + ", " + std::to_string(i % c) + "]";
  }

  static std::string value_text(float v) {
    return std::isnan(v) ? "nan" : (v > 0 ? "inf" : "-inf");
  }

  static Error non_finite_x(int64_t bad, int64_t k, const float* host) {
    const std::string what = host != nullptr ? value_text(host[bad]) : "not finite";
    return Error(LOOM_ERR_INVALID_ARGUMENT, "zeroquant matmul: x" + index_text(bad, k) + " is " +
                                                what +
                                                " (the per-token INT8 quantization of x takes "
                                                "finite values only)");
  }

  lq::IntWeight weight_of(const uint8_t* packed, const float* scales, const uint8_t* zeros,
                          int64_t n, int64_t k) const {
    lq::IntWeight w;
    w.packed = packed;
    w.scales = scales;
    w.zeros = p_.scheme.symmetric ? nullptr : zeros;
    w.gs = lq::Groups::of(n, k, p_.group_size);
    w.q = p_.scheme;
    w.packing = LOOM_QUANT_PACK_LSB_FIRST;
    return w;
  }

  Params p_;
};

}  // namespace

LOOM_PLUGIN("zeroquant", "1.0.0",
            "Quantizer: ZeroQuant's group-wise INT2..8 weights and token-wise INT8 activations, "
            "with W8A8 / W4A8 INT8 GEMMs (oneDNN, cuBLASLt) and a weight-only INT4 matmul",
            loom::sdk::factory<ZeroQuant>());
