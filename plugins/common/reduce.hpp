// Element-wise reductions of fp32 / fp16 / bf16 buffers on the host, as the host transports
// apply them to received chunks: half types are widened to fp32 (common/half.hpp), combined,
// and rounded once per reduction with the shared conversion rule (ties to even, NaN stays a
// quiet NaN).
#ifndef LOOM_PLUGINS_COMMON_REDUCE_HPP
#define LOOM_PLUGINS_COMMON_REDUCE_HPP

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "half.hpp"

namespace loom::plugins::reduce_ops {

using half::bf16_to_f32;
using half::f16_to_f32;
using half::f32_to_bf16;
using half::f32_to_f16;

enum class Dtype { kF32, kF16, kBF16 };
enum class Op { kSum, kMax, kMin };

template <Op op>
inline float combine(float a, float b) {
  if constexpr (op == Op::kSum) {
    return a + b;
  } else if constexpr (op == Op::kMax) {
    // +0 beats -0 whichever side it is on, so partners that combine (a, b) and (b, a)
    // get the same bits.
    if (std::isnan(a) || std::isnan(b)) return a + b;
    return (a > b || (a == b && std::signbit(b))) ? a : b;
  } else {
    if (std::isnan(a) || std::isnan(b)) return a + b;
    return (a < b || (a == b && !std::signbit(b))) ? a : b;
  }
}

template <Op op>
void reduce_f32(float* acc, const float* in, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) acc[i] = combine<op>(acc[i], in[i]);
}

template <Op op, float (*load)(uint16_t), uint16_t (*store)(float)>
void reduce_half(uint16_t* acc, const uint16_t* in, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) acc[i] = store(combine<op>(load(acc[i]), load(in[i])));
}

// acc[i] = acc[i] (op) in[i], in the tensor's dtype, accumulated in fp32.
template <Op op>
void reduce_typed(Dtype dt, void* acc, const void* in, std::size_t n) {
  switch (dt) {
    case Dtype::kF32:
      reduce_f32<op>(static_cast<float*>(acc), static_cast<const float*>(in), n);
      break;
    case Dtype::kF16:
      reduce_half<op, f16_to_f32, f32_to_f16>(static_cast<uint16_t*>(acc),
                                              static_cast<const uint16_t*>(in), n);
      break;
    case Dtype::kBF16:
      reduce_half<op, bf16_to_f32, f32_to_bf16>(static_cast<uint16_t*>(acc),
                                                static_cast<const uint16_t*>(in), n);
      break;
  }
}

inline void reduce(Op op, Dtype dt, void* acc, const void* in, std::size_t n) {
  switch (op) {
    case Op::kSum:
      reduce_typed<Op::kSum>(dt, acc, in, n);
      break;
    case Op::kMax:
      reduce_typed<Op::kMax>(dt, acc, in, n);
      break;
    case Op::kMin:
      reduce_typed<Op::kMin>(dt, acc, in, n);
      break;
  }
}

// x[i] /= divisor (the average's last step), rounded once for half types.
inline void divide(Dtype dt, void* x, std::size_t n, float divisor) {
  switch (dt) {
    case Dtype::kF32: {
      auto* p = static_cast<float*>(x);
      for (std::size_t i = 0; i < n; ++i) p[i] /= divisor;
      break;
    }
    case Dtype::kF16: {
      auto* p = static_cast<uint16_t*>(x);
      for (std::size_t i = 0; i < n; ++i) p[i] = f32_to_f16(f16_to_f32(p[i]) / divisor);
      break;
    }
    case Dtype::kBF16: {
      auto* p = static_cast<uint16_t*>(x);
      for (std::size_t i = 0; i < n; ++i) p[i] = f32_to_bf16(bf16_to_f32(p[i]) / divisor);
      break;
    }
  }
}

}  // namespace loom::plugins::reduce_ops

// The ucx transport's names for these.
namespace loom::plugins::ucx {
using namespace loom::plugins::reduce_ops;
}  // namespace loom::plugins::ucx

#endif  // LOOM_PLUGINS_COMMON_REDUCE_HPP
