// The gate on CUDA: probabilities with the host's rounding (one thread per logit, summed in
// feature order with one accumulator; the softmax per token with exp_fixed; --fmad=false),
// and the gradients the gate sends to x and gate_w (one thread per output element, sums in
// the host's order).
#include <cmath>

#include <loom/sdk/random.hpp>

#include <loom/moe/gating.hpp>
#include <loom/moe/moe_cuda.hpp>
#include <loom/moe/moe_math.hpp>
#include "cuda_util.cuh"

namespace loom::moe::cuda {
namespace {

struct GateArgs {
  const float* x;
  const float* w;
  float* probs;
  int64_t tokens, M;
  int E;
  bool jitter;
  float eps;
  uint64_t seed;
  int64_t step;
  uint32_t layer;
  int64_t first_token;
};

__device__ float jitter_of(const GateArgs& a, int64_t s, int64_t m) {
  const loom::sdk::CounterRng rng(a.seed, a.step, a.layer,
                                  static_cast<uint32_t>(static_cast<uint64_t>(a.first_token + s)),
                                  kPurposeJitter);
  return jitter_factor(rng.word(static_cast<uint64_t>(m)), a.eps);
}

// One thread per (token, expert): the logit summed in feature order with one accumulator.
__global__ void gate_logits_kernel(GateArgs a) {
  const int64_t n = a.tokens * a.E;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t s = i / a.E, e = i % a.E;
    const float* xs = a.x + s * a.M;
    const float* w = a.w + e * a.M;
    float acc = 0.0f;
    for (int64_t m = 0; m < a.M; ++m) {
      const float xm = a.jitter ? xs[m] * jitter_of(a, s, m) : xs[m];
      acc = acc + xm * w[m];
    }
    a.probs[i] = acc;
  }
}

// One thread per token: the max-subtracted softmax in place, summed in expert order.
__global__ void gate_softmax_kernel(GateArgs a) {
  for (int64_t s = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; s < a.tokens;
       s += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float* p = a.probs + s * a.E;
    // std::max(mx, p[e]) from -inf, as the host: a NaN logit is passed over
    float mx = -INFINITY;
    for (int e = 0; e < a.E; ++e) mx = mx < p[e] ? p[e] : mx;
    float sum = 0.0f;
    for (int e = 0; e < a.E; ++e) {
      p[e] = exp_fixed(p[e] - mx);
      sum = sum + p[e];
    }
    for (int e = 0; e < a.E; ++e) p[e] = p[e] / sum;
  }
}

__global__ void gate_dx_kernel(GateArgs a, const float* dl, float* dx) {
  const int64_t n = a.tokens * a.M;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t s = i / a.M, m = i % a.M;
    float acc = 0.0f;
    for (int e = 0; e < a.E; ++e) acc += dl[s * a.E + e] * a.w[e * a.M + m];
    if (a.jitter) acc *= jitter_of(a, s, m);
    dx[i] += acc;
  }
}

__global__ void gate_dw_kernel(GateArgs a, const float* dl, float* dw) {
  const int64_t n = static_cast<int64_t>(a.E) * a.M;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = i / a.M, m = i % a.M;
    float g = dw[i];
    for (int64_t s = 0; s < a.tokens; ++s) {
      const float d = dl[s * a.E + e];
      if (d == 0.0f) continue;
      const float xv = a.x[s * a.M + m];
      g += d * (a.jitter ? xv * jitter_of(a, s, m) : xv);
    }
    dw[i] = g;
  }
}

GateArgs args_of(const GateConfig& cfg, const float* x, int64_t tokens, int64_t M, const float* w) {
  GateArgs a{};
  a.x = x;
  a.w = w;
  a.tokens = tokens;
  a.M = M;
  a.E = cfg.num_experts;
  a.jitter = cfg.jitter();
  a.eps = cfg.jitter_eps;
  a.seed = cfg.seed;
  a.step = cfg.step;
  a.layer = cfg.layer;
  a.first_token = cfg.first_token;
  return a;
}

}  // namespace

void gate_probs(const GateConfig& cfg, const float* x, int64_t tokens, int64_t model_dim,
                const float* gate_w, float* probs, void* stream) {
  if (tokens <= 0) return;
  GateArgs a = args_of(cfg, x, tokens, model_dim, gate_w);
  a.probs = probs;
  gate_logits_kernel<<<blocks_for(tokens * cfg.num_experts), kThreads, 0, as_stream(stream)>>>(a);
  check_launch("gate_logits");
  gate_softmax_kernel<<<blocks_for(tokens), kThreads, 0, as_stream(stream)>>>(a);
  check_launch("gate_softmax");
}

void gate_input_grads(const GateConfig& cfg, const float* x, int64_t tokens, int64_t model_dim,
                      const float* gate_w, const float* dlogits, float* dx, float* dgate_w,
                      void* stream) {
  if (tokens <= 0) return;
  const GateArgs a = args_of(cfg, x, tokens, model_dim, gate_w);
  gate_dx_kernel<<<blocks_for(tokens * model_dim), kThreads, 0, as_stream(stream)>>>(a, dlogits,
                                                                                     dx);
  check_launch("gate_dx");
  gate_dw_kernel<<<blocks_for(cfg.num_experts * model_dim), kThreads, 0, as_stream(stream)>>>(
      a, dlogits, dgate_w);
  check_launch("gate_dw");
}

}  // namespace loom::moe::cuda
