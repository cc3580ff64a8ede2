// trainer_quant: a test-only loom.quantizer/1 plugin built with the SDK, so the trainer's
// quantization paths run end to end without the real quantizers. Role WEIGHT, float32 on the
// CPU: symmetric per-row INT codes in the range of `bits` bits (s = max|w_row| / (2^(bits-1)
// - 1), 1 for an all-zero row; q = round half to even of w / s), stored one per byte (an
// 8-bit symmetric format with one group per row). matmul multiplies float x by the codes and
// applies the row scale after the sum (weight-only); it never decodes W.
#include <loom/sdk/kinds/quantizer.hpp>
#include <loom/sdk/quantizer.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

using loom::sdk::Context;

class TrainerQuant : public loom::sdk::Quantizer {
 public:
  static loom::sdk::Schema schema() {
    return {loom::sdk::Int("bits", 8, "The codes' range: symmetric INT of this many bits.")
                .min(2)
                .max(8)};
  }

  explicit TrainerQuant(Context& ctx) : bits_(static_cast<int>(ctx.get_int("bits"))) {}

  void layout(loom_quantizer_layout_args& a) {
    if (a.role != LOOM_QUANTIZER_WEIGHT || a.dtype.code != kDLFloat || a.dtype.bits != 32) {
      throw loom::sdk::Error(LOOM_ERR_INVALID_ARGUMENT,
                             "trainer_quant: only float32 weights [N, K]");
    }
    loom_quant_format& f = *a.format;
    f.scheme = LOOM_QUANT_INT;
    f.bits = 8;
    f.flags = LOOM_QUANT_SYMMETRIC;
    f.packing = LOOM_QUANT_PACK_LSB_FIRST;
    f.axis = 1;
    f.group_size = std::max<int64_t>(1, a.shape[1]);
    f.scale_dtype = DLDataType{kDLFloat, 32, 1};
    a.workspace_bytes = 0;
    a.matmul_workspace_bytes = 0;
  }

  void quantize(const loom_quantizer_quantize_args& a, const loom_quantizer_layout_args& l) {
    const auto q = loom::sdk::quant_tensors(a.packed, a.scales, a.zero_points, l, a.x->device);
    const float* w = static_cast<const float*>(a.x->data);
    const int64_t n = a.x->shape[0], k = a.x->shape[1];
    auto* codes = reinterpret_cast<int8_t*>(q.codes);
    auto* scales = static_cast<float*>(q.scales);
    const float qmax = static_cast<float>((1 << (bits_ - 1)) - 1);
    for (int64_t r = 0; r < n; ++r) {
      float mx = 0;
      for (int64_t j = 0; j < k; ++j) {
        const float v = w[r * k + j];
        if (!std::isfinite(v)) {
          throw loom::sdk::Error(LOOM_ERR_INVALID_ARGUMENT,
                                 "trainer_quant: x[" + std::to_string(r) + ", " +
                                     std::to_string(j) + "] is not finite");
        }
        mx = std::max(mx, std::fabs(v));
      }
      const float s = mx == 0 ? 1.0f : mx / qmax;
      scales[r] = s;
      for (int64_t j = 0; j < k; ++j) {
        codes[r * k + j] =
            static_cast<int8_t>(std::clamp(std::nearbyint(w[r * k + j] / s), -qmax, qmax));
      }
    }
  }

  void dequantize(const loom_quantizer_quantize_args& a, const loom_quantizer_layout_args& l) {
    const auto q = loom::sdk::quant_tensors(a.packed, a.scales, a.zero_points, l, a.x->device);
    float* w = static_cast<float*>(a.x->data);
    const int64_t n = a.x->shape[0], k = a.x->shape[1];
    const auto* codes = reinterpret_cast<const int8_t*>(q.codes);
    const auto* scales = static_cast<const float*>(q.scales);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t j = 0; j < k; ++j) w[r * k + j] = scales[r] * codes[r * k + j];
  }

  void matmul(const loom_quantizer_matmul_args& a, const loom_quantizer_layout_args& l) {
    const auto q = loom::sdk::quant_tensors(a.packed, a.scales, a.zero_points, l, a.x->device);
    const int64_t m = a.x->shape[0], k = a.x->shape[1], n = l.format->shape[0];
    const float* x = static_cast<const float*>(a.x->data);
    float* y = static_cast<float*>(a.y->data);
    const float* bias = a.bias != nullptr ? static_cast<const float*>(a.bias->data) : nullptr;
    const auto* codes = reinterpret_cast<const int8_t*>(q.codes);
    const auto* scales = static_cast<const float*>(q.scales);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t r = 0; r < n; ++r) {
        float acc = 0;
        for (int64_t j = 0; j < k; ++j) acc += x[i * k + j] * static_cast<float>(codes[r * k + j]);
        y[i * n + r] = acc * scales[r] + (bias != nullptr ? bias[r] : 0.0f);
      }
    }
  }

 private:
  int bits_;
};

}  // namespace

LOOM_PLUGIN("trainer_quant", "1.0.0", "Per-row INT weights with a weight-only matmul (tests only)",
            loom::sdk::factory<TrainerQuant>());
