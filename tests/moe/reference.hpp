// Plain references for the MoE core tests: routing by sorting, dispatch by loops, the expert
// MLP by naive triple loops. Written from the routing rules, not from the core's code.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include <loom/moe/gating.hpp>
#include <loom/moe/moe_math.hpp>

namespace moe_test {

using loom::moe::GateConfig;

struct RefRoute {
  std::vector<int32_t> choice, route;
  std::vector<float> weights;
  int64_t dropped = 0;
  int64_t capacity = 0;
};

// scores = p + bias; keys: a token's RTS key (only read when rts)
inline RefRoute reference_route(const GateConfig& cfg, const std::vector<float>& p, int64_t S,
                                const std::vector<float>& bias, const std::vector<uint32_t>& keys) {
  const int E = cfg.num_experts, k = cfg.k;
  RefRoute r;
  r.choice.assign(static_cast<size_t>(S * k), -1);
  for (int64_t s = 0; s < S; ++s) {
    std::vector<int> idx(static_cast<size_t>(E));
    std::iota(idx.begin(), idx.end(), 0);
    auto score = [&](int e) {
      return p[static_cast<size_t>(s * E + e)] +
             (bias.empty() ? 0.0f : bias[static_cast<size_t>(e)]);
    };
    std::sort(idx.begin(), idx.end(), [&](int a, int b) {
      if (score(a) != score(b)) return score(a) > score(b);
      return a < b;
    });
    for (int j = 0; j < k; ++j)
      r.choice[static_cast<size_t>(s * k + j)] = idx[static_cast<size_t>(j)];
  }
  r.route = r.choice;
  if (cfg.drop_tokens) {
    const double f = cfg.training ? cfg.capacity_factor : cfg.eval_capacity_factor;
    int64_t c = static_cast<int64_t>(std::ceil(k * f * static_cast<double>(S) / E));
    c = std::min(std::max(c, cfg.min_capacity), S);
    r.capacity = c;
    for (int e = 0; e < E; ++e) {
      // (rank j, priority, position) for every choice of e
      std::vector<std::tuple<int, double, int64_t>> cand;
      for (int64_t s = 0; s < S; ++s) {
        for (int j = 0; j < k; ++j) {
          if (r.choice[static_cast<size_t>(s * k + j)] != e) continue;
          double pri = 0.0;
          if (cfg.training && cfg.use_rts) {
            pri = static_cast<double>(keys[static_cast<size_t>(s)]);
          } else if (cfg.drop_policy == loom::moe::DropPolicy::Probs) {
            pri = -static_cast<double>(p[static_cast<size_t>(s * E + e)]);
          }
          cand.emplace_back(j, pri, s);
        }
      }
      std::sort(cand.begin(), cand.end());
      for (size_t i = 0; i < cand.size(); ++i) {
        if (static_cast<int64_t>(i) >= c) {
          const auto [j, pri, s] = cand[i];
          r.route[static_cast<size_t>(s * k + j)] = -1;
          ++r.dropped;
        }
      }
    }
  }
  r.weights.assign(static_cast<size_t>(S * k), 0.0f);
  for (int64_t s = 0; s < S; ++s) {
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) {
      const int e = r.route[static_cast<size_t>(s * k + j)];
      if (e >= 0) sum += p[static_cast<size_t>(s * E + e)];
    }
    for (int j = 0; j < k; ++j) {
      const int e = r.route[static_cast<size_t>(s * k + j)];
      if (e < 0) continue;
      const float pe = p[static_cast<size_t>(s * E + e)];
      r.weights[static_cast<size_t>(s * k + j)] =
          k == 1 ? (cfg.normalize_top1 ? 1.0f : pe) : pe / std::max(sum, 1.1920929e-07f);
    }
  }
  return r;
}

template <class T>
std::vector<T> random_vec(size_t n, uint32_t seed, double scale = 1.0) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> d(-scale, scale);
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(d(gen));
  return v;
}

// Naive expert MLP over one segment: out = act(in w1^T + b1) w2^T + b2.
template <class T>
void naive_mlp(loom::moe::Activation act, int64_t n, int64_t M, int64_t H, const T* in, const T* w1,
               const T* b1, const T* w2, const T* b2, T* out) {
  std::vector<T> h(static_cast<size_t>(H));
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t i = 0; i < H; ++i) {
      double acc = b1[i];
      for (int64_t m = 0; m < M; ++m) acc += static_cast<double>(in[r * M + m]) * w1[i * M + m];
      h[static_cast<size_t>(i)] = loom::moe::act_forward(act, static_cast<T>(acc));
    }
    for (int64_t m = 0; m < M; ++m) {
      double acc = b2[m];
      for (int64_t i = 0; i < H; ++i)
        acc += static_cast<double>(h[static_cast<size_t>(i)]) * w2[m * H + i];
      out[r * M + m] = static_cast<T>(acc);
    }
  }
}

}  // namespace moe_test
