// Host routing (gating.hpp). Compiled with -ffp-contract=off so the sums round as the CUDA
// kernels' (--fmad=false) do.
#include <loom/moe/gating.hpp>

#include <loom/sdk/parallel.hpp>
#include <loom/sdk/random.hpp>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include <loom/moe/moe_math.hpp>
#include "simd.hpp"

namespace loom::moe {

namespace {

uint32_t token_counter(const GateConfig& cfg, int64_t s) {
  return static_cast<uint32_t>(static_cast<uint64_t>(cfg.first_token + s));
}

template <class T>
T weight_eps() {
  return std::numeric_limits<T>::epsilon();
}

}  // namespace

int64_t expert_capacity(const GateConfig& cfg, int64_t tokens) {
  if (!cfg.drop_tokens) return 0;
  const double f = cfg.training ? cfg.capacity_factor : cfg.eval_capacity_factor;
  const double raw = std::ceil(static_cast<double>(cfg.k) * f * static_cast<double>(tokens) /
                               static_cast<double>(cfg.num_experts));
  int64_t c = raw > 9.0e18 ? INT64_MAX : static_cast<int64_t>(raw);
  c = std::max(c, cfg.min_capacity);
  return std::min(c, tokens);
}

float jitter_at(const GateConfig& cfg, int64_t s, int64_t m) {
  const sdk::CounterRng rng(cfg.seed, cfg.step, cfg.layer, token_counter(cfg, s), kPurposeJitter);
  return jitter_factor(rng.word(static_cast<uint64_t>(m)), cfg.jitter_eps);
}

namespace {

// The gate's logits come from the vector kernel (simd.hpp) kTokenBlock tokens at a time over
// the transposed weight: every logit its own sum in feature order, bit-identical to the plain
// per-expert loop and the CUDA kernel on every target.
constexpr int64_t kTokenBlock = simd::kGateTokens;
constexpr int64_t kLanes = simd::kGateLanes;

// exp_fixed (moe_math.hpp) bit for bit, without the library calls: floor by truncation and
// a correction, the power of two built from its exponent bits (n stays in [-125, 127] for the
// clamped argument, so p * 2^n is exact or rounds once, as ldexpf does).
inline float exp_fixed_fast(float x) {
  const bool keep = x > -87.0f;
  float xc = keep ? x : -87.0f;  // NaN too: the result is 0 then
  xc = xc > 88.0f ? 88.0f : xc;
  const float y = xc * 1.44269504f + 0.5f;
  float n = static_cast<float>(static_cast<int32_t>(y));
  n = n > y ? n - 1.0f : n;
  float r = xc - n * 0.693145752f;
  r = r - n * 1.42860677e-06f;
  float p = 1.98412698e-04f;
  p = p * r + 1.38888889e-03f;
  p = p * r + 8.33333333e-03f;
  p = p * r + 4.16666667e-02f;
  p = p * r + 1.66666667e-01f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const auto bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale = 0.0f;
  std::memcpy(&scale, &bits, sizeof scale);
  return keep ? p * scale : 0.0f;
}
inline double exp_fixed_fast(double x) { return exp_fixed(x); }

// Top-k of one token's scores (probabilities + bias + Gumbel noise under RSample), ties to
// the lower index; score and taken are scratch of E entries.
template <class T>
void top_k_token(const GateConfig& cfg, const T* ps, int64_t s, const float* bias, int32_t* out,
                 T* score, char* taken) {
  const int E = cfg.num_experts;
  const sdk::CounterRng rng(cfg.seed, cfg.step, cfg.layer, token_counter(cfg, s), kPurposeGumbel);
  for (int e = 0; e < E; ++e) {
    T v = cfg.rsample() ? gumbel_score(ps[e], rng.word(static_cast<uint64_t>(e))) : ps[e];
    if (bias != nullptr) v = v + static_cast<T>(bias[e]);
    score[e] = v;
    taken[e] = 0;
  }
  for (int j = 0; j < cfg.k; ++j) {
    int best = -1;
    for (int e = 0; e < E; ++e) {
      if (taken[e] != 0) continue;
      // strictly greater: ties go to the lower index
      if (best < 0 || score[e] > score[best]) best = e;
    }
    taken[best] = 1;
    out[j] = best;
  }
}

// The gate's probabilities and, when choice is not null, the top-k of each token in the same
// pass over the pool (one pass: the pool's start-up is paid once).
template <class T>
void gate_pass(const GateConfig& cfg, const T* x, int64_t tokens, int64_t model_dim,
               const T* gate_w, T* probs, const float* bias, int32_t* choice) {
  const int64_t E = cfg.num_experts;
  const int64_t M = model_dim;
  // gate_w [E, M] transposed to [M, Ep], experts innermost, padded with zero columns to a
  // multiple of kLanes (the padded logits are computed and dropped).
  const int64_t Ep = (E + kLanes - 1) / kLanes * kLanes;
  std::vector<T> wt(static_cast<size_t>(M * Ep), T(0));
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t m = 0; m < M; ++m) wt[static_cast<size_t>(m * Ep + e)] = gate_w[e * M + m];
  }
  const auto blocks = static_cast<size_t>((tokens + kTokenBlock - 1) / kTokenBlock);
  sdk::parallel_for(blocks, 4, [&](size_t lo, size_t hi) {
    std::vector<T> xg(cfg.jitter() ? static_cast<size_t>(kTokenBlock * M) : 0);
    std::vector<T> lg(static_cast<size_t>(kTokenBlock * Ep));
    std::vector<T> score(choice != nullptr ? static_cast<size_t>(E) : 0);
    std::vector<char> taken(choice != nullptr ? static_cast<size_t>(E) : 0);
    for (size_t bi = lo; bi < hi; ++bi) {
      const int64_t s0 = static_cast<int64_t>(bi) * kTokenBlock;
      const int64_t nt = std::min(kTokenBlock, tokens - s0);
      const T* xs[kTokenBlock];
      for (int64_t t = 0; t < kTokenBlock; ++t) {
        // a short last block repeats its last token (its logits are dropped)
        const int64_t s = s0 + std::min(t, nt - 1);
        xs[t] = x + s * M;
        if (cfg.jitter() && t < nt) {
          const sdk::CounterRng rng(cfg.seed, cfg.step, cfg.layer, token_counter(cfg, s),
                                    kPurposeJitter);
          T* g = xg.data() + t * M;
          for (int64_t m = 0; m < M; ++m) {
            g[m] = xs[t][m] * static_cast<T>(jitter_factor(rng.word(static_cast<uint64_t>(m)),
                                                           cfg.jitter_eps));
          }
          xs[t] = g;
        } else if (cfg.jitter()) {
          xs[t] = xs[nt - 1];
        }
      }
      simd::gate_logits(xs, M, wt.data(), Ep, lg.data());
      for (int64_t t = 0; t < nt; ++t) {
        const T* lt = lg.data() + t * Ep;
        T* ps = probs + (s0 + t) * E;
        T mx = -std::numeric_limits<T>::infinity();
        for (int64_t e = 0; e < E; ++e) mx = std::max(mx, lt[e]);
        for (int64_t e = 0; e < E; ++e) ps[e] = exp_fixed_fast(lt[e] - mx);
        T sum = T(0);
        for (int64_t e = 0; e < E; ++e) sum = sum + ps[e];
        for (int64_t e = 0; e < E; ++e) ps[e] = ps[e] / sum;
        if (choice != nullptr) {
          top_k_token(cfg, ps, s0 + t, bias, choice + (s0 + t) * cfg.k, score.data(), taken.data());
        }
      }
    }
  });
}

}  // namespace

template <class T>
void gate_probs(const GateConfig& cfg, const T* x, int64_t tokens, int64_t model_dim,
                const T* gate_w, T* probs) {
  gate_pass<T>(cfg, x, tokens, model_dim, gate_w, probs, nullptr, nullptr);
}

template <class T>
void top_k_choices(const GateConfig& cfg, const T* probs, int64_t tokens, const float* bias,
                   int32_t* choice) {
  const int E = cfg.num_experts;
  const int k = cfg.k;
  sdk::parallel_for(static_cast<size_t>(tokens), 64, [&](size_t lo, size_t hi) {
    std::vector<T> score(static_cast<size_t>(E));
    std::vector<char> taken(static_cast<size_t>(E));
    for (size_t si = lo; si < hi; ++si) {
      const auto s = static_cast<int64_t>(si);
      top_k_token(cfg, probs + s * E, s, bias, choice + s * k, score.data(), taken.data());
    }
  });
}

template <class T>
int64_t apply_capacity(const GateConfig& cfg, const T* probs, const int32_t* choice, int64_t tokens,
                       int64_t capacity, int32_t* route) {
  const int E = cfg.num_experts;
  const int k = cfg.k;
  const int64_t n = tokens * k;
  if (!cfg.drop_tokens) {
    std::copy(choice, choice + n, route);
    return 0;
  }
  // Counting sort of (token, rank j) by bucket (expert, j), tokens ascending in each.
  std::vector<int64_t> start(static_cast<size_t>(E) * k + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t b = int64_t{choice[i]} * k + (i % k);
    ++start[static_cast<size_t>(b) + 1];
  }
  for (size_t b = 1; b < start.size(); ++b) start[b] += start[b - 1];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t b = int64_t{choice[i]} * k + (i % k);
    order[static_cast<size_t>(fill[static_cast<size_t>(b)]++)] = i / k;  // the token
  }
  std::vector<uint32_t> key;
  if (cfg.rts()) {
    key.resize(static_cast<size_t>(tokens));
    for (int64_t s = 0; s < tokens; ++s) {
      const sdk::CounterRng rng(cfg.seed, cfg.step, cfg.layer, token_counter(cfg, s), kPurposeRts);
      key[static_cast<size_t>(s)] = rng.word(0);
    }
  }
  int64_t dropped = 0;
  for (int e = 0; e < E; ++e) {
    int64_t left = capacity;
    for (int j = 0; j < k; ++j) {
      const size_t b = static_cast<size_t>(e) * k + static_cast<size_t>(j);
      auto first = order.begin() + start[b];
      auto last = order.begin() + start[b + 1];
      if (first == last) continue;
      if (cfg.rts()) {
        std::stable_sort(first, last, [&](int64_t a, int64_t c) {
          return key[static_cast<size_t>(a)] < key[static_cast<size_t>(c)];
        });
      } else if (cfg.drop_policy == DropPolicy::Probs) {
        std::stable_sort(first, last, [&](int64_t a, int64_t c) {
          return kept_before(probs[a * E + e], probs[c * E + e]);
        });
      }
      for (auto it = first; it != last; ++it) {
        const int64_t i = *it * k + j;
        if (left > 0) {
          route[i] = e;
          --left;
        } else {
          route[i] = -1;
          ++dropped;
        }
      }
    }
  }
  return dropped;
}

template <class T>
void combine_weights(const GateConfig& cfg, const T* probs, const int32_t* route, int64_t tokens,
                     T* weights) {
  const int E = cfg.num_experts;
  const int k = cfg.k;
  for (int64_t s = 0; s < tokens; ++s) {
    token_weights(probs + s * E, route + s * k, k, cfg.normalize_top1, weight_eps<T>(),
                  weights + s * k);
  }
}

std::vector<double> aux_load_share(const GateConfig& cfg, const int32_t* choice, int64_t tokens) {
  const int E = cfg.num_experts;
  const int k = cfg.k;
  std::vector<double> ce(static_cast<size_t>(E), 0.0);
  if (tokens <= 0) return ce;
  const bool all = k > 2;
  std::vector<int64_t> count(static_cast<size_t>(E), 0);
  for (int64_t s = 0; s < tokens; ++s) {
    for (int j = 0; j < (all ? k : 1); ++j) ++count[static_cast<size_t>(choice[s * k + j])];
  }
  const double denom = static_cast<double>(tokens) * (all ? k : 1);
  for (int e = 0; e < E; ++e) ce[static_cast<size_t>(e)] = static_cast<double>(count[e]) / denom;
  return ce;
}

template <class T>
double aux_loss(const GateConfig& cfg, const T* probs, const int32_t* choice, int64_t tokens) {
  if (tokens <= 0) return 0.0;
  const int E = cfg.num_experts;
  const std::vector<double> ce = aux_load_share(cfg, choice, tokens);
  double total = 0.0;
  for (int e = 0; e < E; ++e) {
    double me = 0.0;
    for (int64_t s = 0; s < tokens; ++s) me += static_cast<double>(probs[s * E + e]);
    me /= static_cast<double>(tokens);
    total += me * ce[static_cast<size_t>(e)];
  }
  return static_cast<double>(E) * total;
}

void update_expert_bias(float* bias, const int64_t* load, int num_experts, double rate) {
  if (rate <= 0.0 || num_experts <= 0) return;
  double sum = 0.0;
  for (int e = 0; e < num_experts; ++e) sum += static_cast<double>(load[e]);
  const double mean = sum / num_experts;
  for (int e = 0; e < num_experts; ++e) {
    const double d = mean - static_cast<double>(load[e]);
    const float sign = d > 0.0 ? 1.0f : (d < 0.0 ? -1.0f : 0.0f);
    bias[e] = bias[e] + static_cast<float>(rate) * sign;
  }
}

template <class T>
void route_tokens(const GateConfig& cfg, const T* x, int64_t tokens, int64_t model_dim,
                  const T* gate_w, const float* bias, RouteOut<T>& out) {
  if (cfg.num_experts < 1 || cfg.k < 1 || cfg.k > cfg.num_experts || tokens < 0 || model_dim < 1) {
    throw std::invalid_argument("moe routing: bad sizes (E " + std::to_string(cfg.num_experts) +
                                ", k " + std::to_string(cfg.k) + ", tokens " +
                                std::to_string(tokens) + ", M " + std::to_string(model_dim) + ")");
  }
  const int E = cfg.num_experts;
  const int k = cfg.k;
  gate_pass(cfg, x, tokens, model_dim, gate_w, out.probs, bias, out.choice);
  out.capacity = expert_capacity(cfg, tokens);
  out.dropped = apply_capacity(cfg, out.probs, out.choice, tokens, out.capacity, out.route);
  combine_weights(cfg, out.probs, out.route, tokens, out.weights);
  if (out.load != nullptr) {
    std::fill(out.load, out.load + E, int64_t{0});
    for (int64_t i = 0; i < tokens * k; ++i) ++out.load[out.choice[i]];
  }
  out.aux_loss = aux_loss(cfg, out.probs, out.choice, tokens);
}

template <class T>
void gate_dlogits(const GateConfig& cfg, int64_t tokens, const T* probs, const int32_t* choice,
                  const int32_t* route, const T* dweights, double aux_loss_coef, T* dlogits) {
  if (tokens <= 0) return;
  const int E = cfg.num_experts;
  const int k = cfg.k;
  const std::vector<double> ce = aux_load_share(cfg, choice, tokens);
  std::vector<T> aux_grad(static_cast<size_t>(E));
  for (int e = 0; e < E; ++e) {
    aux_grad[static_cast<size_t>(e)] =
        static_cast<T>(aux_loss_coef * static_cast<double>(E) * ce[static_cast<size_t>(e)] /
                       static_cast<double>(tokens));
  }
  sdk::parallel_for(static_cast<size_t>(tokens), 64, [&](size_t lo, size_t hi) {
    for (size_t si = lo; si < hi; ++si) {
      const auto s = static_cast<int64_t>(si);
      T* dp = dlogits + s * E;
      for (int e = 0; e < E; ++e) dp[e] = aux_grad[static_cast<size_t>(e)];
      token_dlogits(probs + s * E, route + s * k, dweights + s * k, E, k, cfg.normalize_top1,
                    weight_eps<T>(), dp);
    }
  });
}

template <class T>
void gate_backward(const GateConfig& cfg, const T* x, int64_t tokens, int64_t model_dim,
                   const T* gate_w, const T* probs, const int32_t* choice, const int32_t* route,
                   const T* dweights, double aux_loss_coef, T* dlogits, T* dx, T* dgate_w) {
  if (tokens <= 0) return;
  const int E = cfg.num_experts;
  const int64_t M = model_dim;
  gate_dlogits(cfg, tokens, probs, choice, route, dweights, aux_loss_coef, dlogits);
  // dx[s] += (dlogits[s] . gate_w) * jitter;  dgate_w[e] += sum_s dlogits[s, e] * x_gate[s]
  sdk::parallel_for(static_cast<size_t>(tokens), 16, [&](size_t lo, size_t hi) {
    for (size_t si = lo; si < hi; ++si) {
      const auto s = static_cast<int64_t>(si);
      const T* dl = dlogits + s * E;
      T* dxs = dx + s * M;
      const sdk::CounterRng rng(cfg.seed, cfg.step, cfg.layer, token_counter(cfg, s),
                                kPurposeJitter);
      for (int64_t m = 0; m < M; ++m) {
        T acc = T(0);
        for (int e = 0; e < E; ++e) acc += dl[e] * gate_w[e * M + m];
        if (cfg.jitter()) {
          acc *= static_cast<T>(jitter_factor(rng.word(static_cast<uint64_t>(m)), cfg.jitter_eps));
        }
        dxs[m] += acc;
      }
    }
  });
  sdk::parallel_for(static_cast<size_t>(E), 1, [&](size_t lo, size_t hi) {
    for (size_t ei = lo; ei < hi; ++ei) {
      const auto e = static_cast<int64_t>(ei);
      T* g = dgate_w + e * M;
      for (int64_t s = 0; s < tokens; ++s) {
        const T d = dlogits[s * E + e];
        if (d == T(0)) continue;
        const T* xs = x + s * M;
        if (cfg.jitter()) {
          const sdk::CounterRng rng(cfg.seed, cfg.step, cfg.layer, token_counter(cfg, s),
                                    kPurposeJitter);
          for (int64_t m = 0; m < M; ++m) {
            g[m] += d * (xs[m] * static_cast<T>(jitter_factor(rng.word(static_cast<uint64_t>(m)),
                                                              cfg.jitter_eps)));
          }
        } else {
          for (int64_t m = 0; m < M; ++m) g[m] += d * xs[m];
        }
      }
    }
  });
}

#define LOOM_MOE_GATING_INSTANTIATE(T)                                                           \
  template void gate_probs<T>(const GateConfig&, const T*, int64_t, int64_t, const T*, T*);      \
  template void top_k_choices<T>(const GateConfig&, const T*, int64_t, const float*, int32_t*);  \
  template int64_t apply_capacity<T>(const GateConfig&, const T*, const int32_t*, int64_t,       \
                                     int64_t, int32_t*);                                         \
  template void combine_weights<T>(const GateConfig&, const T*, const int32_t*, int64_t, T*);    \
  template double aux_loss<T>(const GateConfig&, const T*, const int32_t*, int64_t);             \
  template void route_tokens<T>(const GateConfig&, const T*, int64_t, int64_t, const T*,         \
                                const float*, RouteOut<T>&);                                     \
  template void gate_backward<T>(const GateConfig&, const T*, int64_t, int64_t, const T*,        \
                                 const T*, const int32_t*, const int32_t*, const T*, double, T*, \
                                 T*, T*);
LOOM_MOE_GATING_INSTANTIATE(float)
LOOM_MOE_GATING_INSTANTIATE(double)
#undef LOOM_MOE_GATING_INSTANTIATE

}  // namespace loom::moe
