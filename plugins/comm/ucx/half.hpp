// fp16 and bf16 <-> fp32 conversions (round to nearest even), and the element-wise reductions
// the ucx transport applies to received chunks. Half types are accumulated in fp32 and rounded
// once per reduction.
#ifndef LOOM_PLUGINS_COMM_UCX_HALF_HPP
#define LOOM_PLUGINS_COMM_UCX_HALF_HPP

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>

namespace loom::plugins::ucx {

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000U) << 16;
  const uint32_t exp = (h >> 10) & 0x1fU;
  const uint32_t mant = h & 0x3ffU;
  if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000U | (mant << 13));
  if (exp == 0) {
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;  // 2^-24, exact
    return sign != 0 ? -v : v;
  }
  return std::bit_cast<float>(sign | ((exp + 112U) << 23) | (mant << 13));
}

inline uint16_t f32_to_f16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const auto sign = static_cast<uint16_t>((x >> 16) & 0x8000U);
  const uint32_t abs = x & 0x7fffffffU;
  if (abs >= 0x7f800000U) {  // inf, nan (kept quiet)
    const uint32_t nan = abs > 0x7f800000U ? (0x200U | ((abs >> 13) & 0x3ffU)) : 0U;
    return static_cast<uint16_t>(sign | 0x7c00U | nan);
  }
  if (abs >= 0x477ff000U) return static_cast<uint16_t>(sign | 0x7c00U);  // >= 65520: inf
  if (abs < 0x38800000U) {  // below 2^-14: a half subnormal (or zero)
    const float a = std::bit_cast<float>(abs) * 16777216.0f;  // * 2^24, exact
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(a)));
  }
  uint32_t r = abs + 0xfffU + ((abs >> 13) & 1U);  // round to nearest even
  r -= (127U - 15U) << 23;
  return static_cast<uint16_t>(sign | (r >> 13));
}

inline float bf16_to_f32(uint16_t h) {
  return std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
}

inline uint16_t f32_to_bf16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffU) > 0x7f800000U) return static_cast<uint16_t>((x >> 16) | 0x40U);
  return static_cast<uint16_t>((x + 0x7fffU + ((x >> 16) & 1U)) >> 16);
}

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

}  // namespace loom::plugins::ucx

#endif  // LOOM_PLUGINS_COMM_UCX_HALF_HPP
