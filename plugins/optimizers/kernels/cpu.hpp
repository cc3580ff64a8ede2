// Fused CPU kernels of the optimizers (Highway runtime dispatch, threaded with
// loom::plugins::parallel_for). Plain C++ interface: no SDK or DLPack types, so the
// benchmark and the CUDA side can share the argument structs.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/half.hpp"

namespace loom::optim {

enum class DType : uint8_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

// One tensor: p is the fp32 parameter (or the fp32 master copy), g its gradient in
// `gtype`, m and v the fp32 moments; `low` (optional) is the low-precision parameter
// written from the updated p with round-to-nearest-even.
struct TensorRef {
  float* p = nullptr;
  const void* g = nullptr;
  DType gtype = DType::kF32;
  float* m = nullptr;
  float* v = nullptr;
  void* low = nullptr;
  DType ltype = DType::kBF16;
  std::size_t n = 0;
};

// A decay rate and its complement for the kernels: both computed from the double the user
// gave and rounded to fp32 once. `rest` is 1 - beta in double, not 1 - float(beta): the
// latter is off by up to 2^-25 absolute, 1.3e-5 relative at beta = 0.999 and 1.4e-3 at
// 0.99999, which would make every Adam update that much larger than torch.optim's.
struct Decay {
  float beta = 0.0f;
  float rest = 1.0f;  // 1 - beta
};
constexpr Decay decay_of(double beta) {
  return {static_cast<float>(beta), static_cast<float>(1.0 - beta)};
}

// Adam / AdamW as torch.optim.Adam(W) computes it, per element:
//   g = grad * inv_scale + l2 * p            (l2: coupled weight decay, Adam)
//   m = beta1 * m + omb1 * g
//   v = beta2 * v + omb2 * g * g
//   p = p * decay - step_size * m / (sqrt(v) * inv_bc2_sqrt + eps)
// Every scalar is computed in double on the host and rounded to fp32 once (set_betas):
// omb1 = 1 - beta1, omb2 = 1 - beta2; decay = 1 - lr * wd for AdamW (else 1);
// step_size = lr / bias_correction1; inv_bc2_sqrt = 1 / sqrt(bias_correction2) (1 without
// bias correction).
struct AdamHyper {
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float omb1 = 0.1f;    // 1 - beta1, from double
  float omb2 = 0.001f;  // 1 - beta2, from double
  float eps = 1e-8f;
  float inv_scale = 1.0f;
  float l2 = 0.0f;
  float decay = 1.0f;
  float step_size = 1e-3f;
  float inv_bc2_sqrt = 1.0f;
  void set_betas(double b1, double b2) {
    beta1 = static_cast<float>(b1);
    beta2 = static_cast<float>(b2);
    omb1 = static_cast<float>(1.0 - b1);
    omb2 = static_cast<float>(1.0 - b2);
  }
};

// LAMB, per element (both passes):
//   pass 1: g, m, v as in Adam (no l2), u = m * inv_bc1 / (sqrt(v) * inv_bc2_sqrt + eps)
//           + wd * p; returns sum(p^2) and sum(u^2)
//   pass 2: p = p - lr_coeff * u   (lr_coeff = lr * trust ratio)
// The scalars are computed in double and rounded once, as for Adam.
struct LambHyper {
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float omb1 = 0.1f;    // 1 - beta1, from double
  float omb2 = 0.001f;  // 1 - beta2, from double
  float eps = 1e-8f;
  float inv_scale = 1.0f;
  float wd = 0.0f;
  float inv_bc1 = 1.0f;
  float inv_bc2_sqrt = 1.0f;
  void set_betas(double b1, double b2) {
    beta1 = static_cast<float>(b1);
    beta2 = static_cast<float>(b2);
    omb1 = static_cast<float>(1.0 - b1);
    omb2 = static_cast<float>(1.0 - b2);
  }
};

void adam_cpu(const TensorRef& t, const AdamHyper& h);
// Pass 1 of LAMB; sums are accumulated in a fixed order (independent of the thread count).
void lamb_moments_cpu(const TensorRef& t, const LambHyper& h, double* sum_p2, double* sum_u2);
void lamb_apply_cpu(const TensorRef& t, const LambHyper& h, float lr_coeff);

// m = b1.beta * m + b1.rest * g * inv_scale (the 1-bit family's momentum step).
void momentum_cpu(float* m, const void* g, DType gtype, std::size_t n, Decay b1, float inv_scale);
// Writes p (fp32) into low with round-to-nearest-even.
void copy_out_cpu(const float* p, void* low, DType ltype, std::size_t n);
// Reads n gradient elements into fp32, times inv_scale.
void load_grad_cpu(const void* g, DType gtype, std::size_t n, float inv_scale, float* out);

// Scalar conversions: the shared rule of common/half.hpp (round to nearest even, NaN stays a
// quiet NaN with its sign, overflow to Inf, subnormals exact).
using loom::plugins::half::bf16_to_f32;
using loom::plugins::half::f16_to_f32;
using loom::plugins::half::f32_to_bf16;
using loom::plugins::half::f32_to_f16;

}  // namespace loom::optim
