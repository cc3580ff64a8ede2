// The float elementwise spans of layers.hpp, compiled once per instruction set (AVX-512,
// AVX2, baseline) and chosen at load time, so the release build stays portable while GELU
// and the softmax exps run at the machine's vector width.
#include "layers.hpp"

#if defined(__x86_64__) && (defined(__clang__) || defined(__GNUC__))
#define LOOM_TRAINER_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define LOOM_TRAINER_CLONES
#endif

namespace loom::trainer::layers {

LOOM_TRAINER_CLONES void gelu_forward_span(float* out, const float* inp, size_t n) {
  gelu_forward_span<float>(out, inp, n);
}

LOOM_TRAINER_CLONES void gelu_backward_span(float* dinp, const float* inp, const float* dout,
                                            size_t n) {
  gelu_backward_span<float>(dinp, inp, dout, n);
}

LOOM_TRAINER_CLONES float exp_sum_span(float* x, size_t n, float shift) {
  return exp_sum_span<float>(x, n, shift);
}

}  // namespace loom::trainer::layers
