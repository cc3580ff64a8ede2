// xtc: binary (BWN) and ternary (TWN) weights with real packed storage, kind loom.quantizer/1,
// as XTC's extreme compression uses them. A weight W [N, K] is cut into groups along K
// (group_size; 0 = one group per output row); each group keeps one float32 scale alpha.
//   binary:  alpha = mean |w|, code 1 (+alpha) for w >= 0, 0 (-alpha) for w < 0;
//   ternary: Delta = threshold * mean |w|, alpha = mean |w| over |w| > Delta (0 if none),
//            codes 0 (0), 1 (+alpha), 2 (-alpha).
// The matmul is weight-only (float x) and reads the 1- or 2-bit codes directly. The kernels
// are in ../core (binary.*, ternary.*, xtc_cuda.hpp); this file checks what the SDK does not
// (role, dtype, the values) and dispatches by device.
#include <loom/sdk.hpp>
#include <loom/sdk/kinds/quantizer.hpp>

#include <cmath>
#include <cstdint>
#include <string>

#include <loom/quantizers/binary.hpp>
#include "float_stage.hpp"
#include "ternary.hpp"
#include "xtc_cuda.hpp"

namespace {

using loom::quant::GroupedShape;
using loom::sdk::Context;

[[noreturn]] void fail_argument(const std::string& message) {
  throw loom::sdk::Error(LOOM_ERR_INVALID_ARGUMENT, message);
}

enum class Mode { kBinary, kTernary };

Mode parse_mode(const std::string& m) {
  if (m == "binary") return Mode::kBinary;
  if (m == "ternary") return Mode::kTernary;
  fail_argument("mode = \"" + m + "\" is not an xtc mode; expected \"binary\" or \"ternary\"");
}

// The largest threshold. TWN uses about 0.7, and a threshold of n or more zeroes every weight
// of an n-element group (no |w| exceeds n times the group's mean |w|), so far larger values
// are mistakes; the bound also keeps the float32 threshold finite (quantize still refuses a
// group whose Delta = threshold * mean |w| overflows).
constexpr double kMaxThreshold = 1e3;

void check_threshold(double t) {
  if (!(t > 0.0) || !(t <= kMaxThreshold)) {
    fail_argument("threshold = " + std::to_string(t) +
                  " must be in (0, 1000]: ternary keeps the weights with |w| > threshold * "
                  "mean |w| of their group");
  }
}

void check_group_size(int64_t g) {
  if (g < 0) {
    fail_argument("group_size = " + std::to_string(g) +
                  " is negative; use 0 (one group per output row) or the elements per group");
  }
}

// "row r, column c" of element e of a [rows, cols] matrix.
std::string element(int64_t e, int64_t cols) {
  return "(" + std::to_string(e / cols) + ", " + std::to_string(e % cols) + ")";
}

class Xtc : public loom::sdk::Quantizer {
 public:
  static loom::sdk::Schema schema() {
    return {
        loom::sdk::String("mode", "ternary",
                          "\"ternary\" (2-bit codes: 0, +alpha, -alpha; weights with |w| <= "
                          "Delta become 0) or \"binary\" (1-bit codes: +alpha for w >= 0, so a "
                          "zero weight decodes to +alpha, and -alpha for w < 0).")
            .choices({"binary", "ternary"}),
        loom::sdk::Int("group_size", 0,
                       "Weights per scale along each row (the input-feature axis K); 0 means one "
                       "group per output row (group_size K). The last group of a row may be "
                       "shorter.")
            .min(0),
        loom::sdk::Float("threshold", 0.7,
                         "Ternary only: Delta = threshold * mean |w| of the group; weights with "
                         "|w| > Delta keep their sign, alpha is the mean |w| of those kept. "
                         "In (0, 1000].")
            .greater_than(0)
            .max(kMaxThreshold),
    };
  }

  static void validate_params(Context& params) {
    (void)parse_mode(params.get_string("mode"));
    check_group_size(params.get_int("group_size"));
    check_threshold(params.get_float("threshold"));
  }

  explicit Xtc(Context& ctx)
      : mode_(parse_mode(ctx.get_string("mode"))),
        group_size_(ctx.get_int("group_size")),
        threshold_(static_cast<float>(ctx.get_float("threshold"))) {
    check_group_size(group_size_);
    check_threshold(ctx.get_float("threshold"));
  }

  void layout(loom_quantizer_layout_args& a) {
    if (a.role != LOOM_QUANTIZER_WEIGHT) {
      fail_argument(std::string("role ") + loom::sdk::quantizer_role_name(a.role) +
                    ": xtc quantizes weights only (its matmul takes float activations)");
    }
    check_dtype(a.dtype, "the weight");
    const GroupedShape s = shape_of(a.shape[0], a.shape[1]);
    loom_quant_format& f = *a.format;
    f.scheme = mode_ == Mode::kBinary ? LOOM_QUANT_BINARY : LOOM_QUANT_TERNARY;
    f.bits = mode_ == Mode::kBinary ? 1 : 2;
    f.flags = LOOM_QUANT_SYMMETRIC;
    f.packing = LOOM_QUANT_PACK_LSB_FIRST;
    f.axis = 1;
    f.group_size = s.group_size;
    f.scale_dtype = DLDataType{kDLFloat, 32, 1};
    a.flags = LOOM_QUANTIZER_HAS_MATMUL;
    a.workspace_bytes = own_bytes(s);
    a.matmul_workspace_bytes = own_bytes(s);
    if (loom::quant::is_16bit(a.dtype)) {
      // The float32 copies of a 16-bit call, after the kernels' own region: the weight for
      // quantize and dequantize; x [m, K], bias [N] and y [m, N] for the matmul.
      namespace f16 = loom::quant::f16;
      a.workspace_bytes += f16::staging_bytes(s.numel());
      a.matmul_workspace_bytes += f16::staging_bytes(a.matmul_rows * s.cols) +
                                  f16::staging_bytes(s.rows) +
                                  f16::staging_bytes(a.matmul_rows * s.rows);
    }
  }

  void quantize(const loom_quantizer_quantize_args& a, const loom_quantizer_layout_args& l) {
    const GroupedShape s = shape_of(l.shape[0], l.shape[1]);
    (void)loom::sdk::quant_matrix(a.x, "x");
    // On the CPU the kernels widen a 16-bit x a span at a time themselves; CUDA stages it.
    namespace f16 = loom::quant::f16;
    const f16::Storage storage = f16::storage_or_f32(a.x->dtype);
    const bool direct16 = !on_cuda(a.x->device) && storage != f16::Storage::kF32;
    auto stage = loom::quant::float_stage(a.workspace, own_bytes(s));
    const float* w = direct16 ? nullptr : stage.in(a.x, a.stream);
    const loom::sdk::QuantTensors q =
        loom::sdk::quant_tensors(a.packed, a.scales, nullptr, l, a.x->device);
    auto* scales = static_cast<float*>(q.scales);
    int64_t bad = -1;
    if (on_cuda(a.x->device)) {
      const int dev = a.x->device.device_id;
      // With first_bad the check's outcome stays on the device: nothing waits for it here.
      int64_t* first_bad =
          a.first_bad != nullptr ? loom::sdk::expect_first_bad(a.first_bad, a.x->device) : nullptr;
      bad = mode_ == Mode::kBinary
                ? loom::quant::cuda::binary_quantize(w, s, q.codes, scales, a.workspace, dev,
                                                     a.stream, first_bad)
                : loom::quant::cuda::ternary_quantize(w, s, threshold_, q.codes, scales,
                                                      a.workspace, dev, a.stream, first_bad);
    } else {
      const auto* w16 = static_cast<const uint16_t*>(f16::data_of(*a.x));
      const bool bf16 = storage == f16::Storage::kBF16;
      if (mode_ == Mode::kBinary) {
        bad = direct16 ? loom::quant::binary_quantize16(w16, bf16, s, q.codes, scales)
                       : loom::quant::binary_quantize(w, s, q.codes, scales);
      } else {
        bad = direct16 ? loom::quant::ternary_quantize16(w16, bf16, s, threshold_, q.codes, scales)
                       : loom::quant::ternary_quantize(w, s, threshold_, q.codes, scales);
      }
      if (loom::sdk::set_first_bad(a, bad)) return;
    }
    if (bad >= s.numel()) {
      const int64_t g = bad - s.numel();
      const int64_t gpr = s.groups_per_row();
      fail_argument("x: group " + std::to_string(g % gpr) + " of row " + std::to_string(g / gpr) +
                    ": the weights are finite but " +
                    (mode_ == Mode::kBinary ? "their |w| sum overflows float32 (alpha = inf)"
                                            : "Delta = threshold * mean |w| overflows float32") +
                    "; scale the weights down");
    }
    if (bad >= 0) {
      fail_argument("x" + element(bad, s.cols) +
                    " is not finite (NaN or infinite); xtc quantizes finite weights only");
    }
  }

  void dequantize(const loom_quantizer_quantize_args& a, const loom_quantizer_layout_args& l) {
    const GroupedShape s = shape_of(l.shape[0], l.shape[1]);
    (void)loom::sdk::quant_matrix(a.x, "x");
    auto stage = loom::quant::float_stage(a.workspace, own_bytes(s));
    float* w = stage.out(a.x);
    const loom::sdk::QuantTensors q =
        loom::sdk::quant_tensors(a.packed, a.scales, nullptr, l, a.x->device);
    const auto* scales = static_cast<const float*>(q.scales);
    int64_t bad = -1;
    if (on_cuda(a.x->device)) {
      const int dev = a.x->device.device_id;
      if (mode_ == Mode::kBinary) {
        loom::quant::cuda::binary_dequantize(q.codes, scales, s, w, dev, a.stream);
      } else {
        bad = loom::quant::cuda::ternary_dequantize(q.codes, scales, s, w, a.workspace, dev,
                                                    a.stream);
      }
    } else if (mode_ == Mode::kBinary) {
      loom::quant::binary_dequantize(q.codes, scales, s, w);
    } else {
      bad = loom::quant::ternary_dequantize(q.codes, scales, s, w);
    }
    if (bad >= 0) invalid_code(bad, s);
    stage.finish(w, a.x, a.stream);
  }

  void matmul(const loom_quantizer_matmul_args& a, const loom_quantizer_layout_args& l) {
    const GroupedShape s = shape_of(l.shape[0], l.shape[1]);
    (void)loom::sdk::quant_matrix(a.x, "x");
    const int64_t m = a.x->shape[0];
    auto stage = loom::quant::float_stage(a.workspace, own_bytes(s));
    const float* x = stage.in(a.x, a.stream);
    const float* bias = stage.in(a.bias, a.stream);
    float* y = stage.out(a.y);
    const loom::sdk::QuantTensors q =
        loom::sdk::quant_tensors(a.packed, a.scales, nullptr, l, a.x->device);
    const auto* scales = static_cast<const float*>(q.scales);
    int64_t bad = -1;
    if (on_cuda(a.x->device)) {
      const int dev = a.x->device.device_id;
      if (mode_ == Mode::kBinary) {
        loom::quant::cuda::binary_matmul(x, m, q.codes, scales, s, bias, y, dev, a.stream);
      } else {
        bad = loom::quant::cuda::ternary_matmul(x, m, q.codes, scales, s, bias, y, a.workspace, dev,
                                                a.stream);
      }
    } else if (mode_ == Mode::kBinary) {
      loom::quant::binary_matmul(x, m, q.codes, scales, s, bias, y);
    } else {
      bad = loom::quant::ternary_matmul(x, m, q.codes, scales, s, bias, y);
    }
    if (bad >= 0) invalid_code(bad, s);
    stage.finish(y, a.y, a.stream);
  }

 private:
  GroupedShape shape_of(int64_t rows, int64_t cols) const {
    GroupedShape s;
    s.rows = rows;
    s.cols = cols;
    s.group_size = group_size_ == 0 ? (cols > 0 ? cols : 1) : group_size_;
    return s;
  }

  static void check_dtype(const DLDataType& t, const char* what) {
    if (!loom::sdk::is_quantizer_float(t)) {
      fail_argument(std::string(what) + " has dtype " + loom::sdk::dtype_string(t) +
                    "; xtc takes float32, bfloat16 or float16 weights and activations");
    }
  }

  // The CUDA kernels' own workspace (group sums); the float32 staging of a 16-bit call
  // follows it.
  static uint64_t own_bytes(const GroupedShape& s) {
    return (loom::quant::xtc_cuda_workspace_bytes(s) + 255u) / 256u * 256u;
  }

  [[noreturn]] static void invalid_code(int64_t e, const GroupedShape& s) {
    fail_argument("packed holds the invalid ternary code 3 at weight element " +
                  element(e, s.cols) + " (codes are 0, 1 = +alpha, 2 = -alpha)");
  }

  // Host memory runs on the CPU kernels, CUDA memory on the CUDA ones (without CUDA the core's
  // quant_cuda_stub.cpp: UNIMPLEMENTED).
  static bool on_cuda(const DLDevice& dev) {
    if (loom::sdk::is_cpu(dev)) return false;
    if (!loom::sdk::is_cuda(dev)) {
      fail_argument("the tensors are on " + loom::sdk::device_string(dev) +
                    "; xtc runs on host or CUDA memory");
    }
    return true;
  }

  Mode mode_;
  int64_t group_size_;
  float threshold_;
};

}  // namespace

LOOM_PLUGIN("xtc", "1.0.0",
            "Binary (1-bit) and ternary (2-bit) weights as in XTC, with group scales alpha = "
            "mean |w| of the kept weights, real packed storage and packed weight-only matmuls",
            loom::sdk::factory<Xtc>());
