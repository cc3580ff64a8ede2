// Declared public interface of loom_moe_core: bench/, the trainer and tests may include this
// header (as <loom/moe/layer.hpp>); the core's other headers are private to it.
//
// The whole MoE layer on the host: gate -> capacity -> dispatch -> exchange -> grouped expert
// GEMMs -> reverse exchange -> combine (-> PR-MoE mix), and its adjoint. The device path
// (layer_cuda.cu) keeps the same `saved` layout.
#pragma once

#include <cstddef>
#include <cstdint>

#include <loom/sdk/moe.hpp>

#include <loom/moe/exchange.hpp>
#include <loom/moe/experts.hpp>
#include <loom/moe/gating.hpp>

namespace loom::moe {

struct LayerConfig {
  GateConfig gate;
  Activation activation = Activation::Gelu;
  int64_t model_dim = 0;   // M
  int64_t hidden_dim = 0;  // H
  int64_t max_tokens = 0;  // the plan's tokens: bounds every buffer
  int local_experts = 0;   // E / ep
  int ep_size = 1;
  int ep_rank = 0;
  bool residual = false;
  double bias_update_rate = 0.0;
};

// The most rows this rank's experts can receive in one call.
int64_t max_expert_rows(const LayerConfig& cfg);

// Bytes of `saved` and of the workspace for elements of `elem` bytes (256-byte aligned
// regions).
uint64_t saved_bytes(const LayerConfig& cfg, size_t elem);
uint64_t workspace_bytes(const LayerConfig& cfg, size_t elem);

template <class T>
struct LayerWeights {
  const T* gate_w = nullptr;  // [E, M]
  ExpertWeights<T> experts;   // local experts
  ExpertWeights<T> residual;  // the dense MLP (one "expert"); PR-MoE only
  const T* coef_w = nullptr;  // [2, M]
  const T* coef_b = nullptr;  // [2]
};

template <class T>
struct LayerGrads {
  T* gate_w = nullptr;
  ExpertGrads<T> experts;
  ExpertGrads<T> residual;
  T* coef_w = nullptr;
  T* coef_b = nullptr;
};

// Host wall-clock nanoseconds a call spent in each phase, added to (the caller sums calls):
//   gate      the scores, softmax, choice and capacity;
//   dispatch  the slots (the sort by expert) and the gather of the tokens' rows;
//   exchange  the agreement and the counts and rows between the ranks (expert parallelism),
//             and the load's sum for the expert bias;
//   experts   the experts' MLPs and PR-MoE's residual MLP;
//   combine   the weighted sum of the rows back into tokens and PR-MoE's mix.
// Backward counts each phase's adjoint in its place (the gather of dy's rows is combine's,
// the sum into dx dispatch's). The CUDA layer enqueues without waiting and leaves them. The
// SDK's struct, so the plugin hands them to loom_moe_stats as they are.
using PhaseTimes = loom::sdk::MoePhases;

struct LayerStats {
  double aux_loss = 0.0;
  int64_t dropped = 0;
  int64_t expert_rows = 0;
  int64_t capacity = 0;
  int64_t* load = nullptr;  // [E] or null
};

template <class T>
struct ForwardCall {
  int64_t tokens = 0;
  const T* x = nullptr;  // [S, M]
  LayerWeights<T> w;
  float* expert_bias = nullptr;      // [E] or null; updated in training when the rate > 0
  T* y = nullptr;                    // [S, M] written
  int32_t* route_experts = nullptr;  // [S, k] optional
  float* route_weights = nullptr;    // [S, k] optional
  void* saved = nullptr;
  uint64_t saved_bytes = 0;
  void* workspace = nullptr;
  uint64_t workspace_bytes = 0;
  PhaseTimes* times = nullptr;  // added to, or null
};

template <class T>
struct BackwardCall {
  int64_t tokens = 0;
  const T* x = nullptr;
  LayerWeights<T> w;
  const T* dy = nullptr;
  T* dx = nullptr;  // written
  LayerGrads<T> g;  // added to
  double aux_loss_coef = 0.0;
  const void* saved = nullptr;
  uint64_t saved_bytes = 0;
  void* workspace = nullptr;
  uint64_t workspace_bytes = 0;
  PhaseTimes* times = nullptr;  // added to, or null
};

// Throws std::invalid_argument (bad sizes, small buffers) or std::runtime_error.
template <class T>
void layer_forward(const LayerConfig& cfg, Exchange& ex, const ForwardCall<T>& call,
                   LayerStats& stats);
template <class T>
void layer_backward(const LayerConfig& cfg, Exchange& ex, const BackwardCall<T>& call);

}  // namespace loom::moe
