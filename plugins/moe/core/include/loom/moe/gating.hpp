// Declared public interface of loom_moe_core: bench/, the trainer and tests may include this
// header (as <loom/moe/gating.hpp>); the core's other headers are private to it.
//
// Routing of a MoE layer from fp32 gate logits (the host implementation; gating_cuda.cu is
// the device one and rounds alike). Everything is a pure function of the inputs and of
// (seed, step, layer, first_token): see GateConfig.
//
//   logits[s, e] = x_gate[s] . gate_w[e]   (a dot product in feature order, one accumulator)
//   p = softmax(logits)                   (max-subtracted, sum in expert order)
//   score = p, or log p + Gumbel noise under RSample in training (a sample of p), (+ bias);
//           top-k by score, ties to
//           the lower expert index; choice j = 0 is the highest score
//   capacity: an expert keeps its first C choices ordered by (choice rank j, then a random
//           key per token under use_rts in training, else p descending ("probs") or position
//           ascending ("position"), ties by position)
//   weights: k = 1: p (1 with normalize_top1); k >= 2: p_j / max(sum of kept p, eps)
//   aux loss: E * sum_e mean_s(p[s, e]) * ce_e, ce_e the share of first choices (k <= 2) or of
//           all choices (k > 2) that went to e, before capacity
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace loom::moe {

enum class DropPolicy : int { Probs = 0, Position = 1 };
enum class NoisePolicy : int { None = 0, Jitter = 1, RSample = 2 };

// The counter RNG's purposes (CounterRng's `purpose`): one stream per use.
inline constexpr uint32_t kPurposeJitter = 0x4D6F4A01u;
inline constexpr uint32_t kPurposeGumbel = 0x4D6F4702u;
inline constexpr uint32_t kPurposeRts = 0x4D6F5203u;

struct GateConfig {
  int num_experts = 8;  // E
  int k = 1;
  bool training = false;
  bool drop_tokens = true;
  double capacity_factor = 1.0;
  double eval_capacity_factor = 1.0;
  int64_t min_capacity = 4;
  DropPolicy drop_policy = DropPolicy::Probs;
  bool use_rts = false;
  NoisePolicy noise = NoisePolicy::None;
  float jitter_eps = 0.01f;
  bool normalize_top1 = false;
  // the noise's counters
  uint64_t seed = 0;
  int64_t step = 0;
  uint32_t layer = 0;
  int64_t first_token = 0;

  bool jitter() const { return training && noise == NoisePolicy::Jitter; }
  bool rsample() const { return training && noise == NoisePolicy::RSample; }
  bool rts() const { return training && use_rts; }
};

// Tokens per expert per rank for S tokens: max(ceil(k * f * S / E), min_capacity), at most S;
// 0 when dropless.
int64_t expert_capacity(const GateConfig& cfg, int64_t tokens);

// What routing writes (caller-owned, sized for S tokens).
template <class T>
struct RouteOut {
  T* probs = nullptr;         // [S, E]
  int32_t* choice = nullptr;  // [S, k] the top-k experts, before capacity
  int32_t* route = nullptr;   // [S, k] choice, or -1 where capacity dropped it
  T* weights = nullptr;       // [S, k] combine weights (0 where dropped)
  int64_t* load = nullptr;    // [E] choices to each expert before capacity
  // scalars
  int64_t capacity = 0;
  int64_t dropped = 0;
  double aux_loss = 0.0;
};

// x [S, M], gate_w [E, M], bias [E] or null. Throws std::invalid_argument on bad sizes.
template <class T>
void route_tokens(const GateConfig& cfg, const T* x, int64_t tokens, int64_t model_dim,
                  const T* gate_w, const float* bias, RouteOut<T>& out);

// The steps of route_tokens, for the device path and the tests.
// Gate probabilities (and the choice's scores) of token rows [0, S).
template <class T>
void gate_probs(const GateConfig& cfg, const T* x, int64_t tokens, int64_t model_dim,
                const T* gate_w, T* probs);
// Top-k of token s's scores (probs + bias + noise), ties to the lower index.
template <class T>
void top_k_choices(const GateConfig& cfg, const T* probs, int64_t tokens, const float* bias,
                   int32_t* choice);
// Capacity: route = choice or -1; returns the dropped count.
template <class T>
int64_t apply_capacity(const GateConfig& cfg, const T* probs, const int32_t* choice, int64_t tokens,
                       int64_t capacity, int32_t* route);
// Combine weights from probs and route.
template <class T>
void combine_weights(const GateConfig& cfg, const T* probs, const int32_t* route, int64_t tokens,
                     T* weights);
// ce_e (the load share the aux loss uses) from the choices.
std::vector<double> aux_load_share(const GateConfig& cfg, const int32_t* choice, int64_t tokens);
template <class T>
double aux_loss(const GateConfig& cfg, const T* probs, const int32_t* choice, int64_t tokens);

// Aux-loss-free balancing: bias_e += rate * sign(mean - load_e) with load summed over the
// expert-parallel group.
void update_expert_bias(float* bias, const int64_t* load, int num_experts, double rate);

// The routing's adjoint: from dweights [S, k] (the loss's gradient w.r.t. the combine weights)
// and the aux loss's coefficient, ADDS to dx [S, M] and dgate_w [E, M]. probs, choice, route
// as forward wrote them. dlogits [S, E] is scratch (written).
template <class T>
void gate_backward(const GateConfig& cfg, const T* x, int64_t tokens, int64_t model_dim,
                   const T* gate_w, const T* probs, const int32_t* choice, const int32_t* route,
                   const T* dweights, double aux_loss_coef, T* dlogits, T* dx, T* dgate_w);

// The first half of gate_backward: dlogits [S, E] (written) from dweights and the aux loss.
template <class T>
void gate_dlogits(const GateConfig& cfg, int64_t tokens, const T* probs, const int32_t* choice,
                  const int32_t* route, const T* dweights, double aux_loss_coef, T* dlogits);

// The jitter factor of token s (global index first_token + s), feature m.
float jitter_at(const GateConfig& cfg, int64_t s, int64_t m);

}  // namespace loom::moe
