// The trainer's Mixture-of-Experts MLP: a Block's MLP slot (Model::replace_mlp) run by a
// loom.moe/1 instance through libloom's checked table (abi/include/loom/kinds/moe.h).
//
// The layer owns its weights as trainer parameters, so the manifest's optimizer updates them
// like every other weight and the checkpoints hold them:
//   h.L.moe.gate.w [E, M]       the router (replicated on every rank)
//   h.L.moe.experts.w1 [E_l, H, M], .b1 [E_l, H], .w2 [E_l, M, H], .b2 [E_l, M]
//                               this rank's E_l = E / ep_size experts (global experts
//                               ep_rank * E_l ...), the "expert parameters"
//   h.L.moe.res.fc.w [H, M], .fc.b [H], .proj.w [M, H], .proj.b [M], h.L.moe.coef.w [2, M],
//   h.L.moe.coef.b [2]          PR-MoE's residual MLP and mixing coefficient (the plan's
//                               LOOM_MOE_RESIDUAL only; replicated)
// initialised as the dense MLP is (weights normal 0.02, output projections 0.02 / sqrt(2L),
// biases 0), each expert from its own stream of (seed, layer, tensor, global expert) so that
// a run with expert parallelism starts from the same weights as one without.
//
// With aux-loss-free balancing (LOOM_MOE_EXPERT_BIAS) the layer also holds the per-expert
// bias [E], trainer state (not a parameter) that the instance updates in training forwards
// and the checkpoints save.
#pragma once

#include <loom/embed.h>
#include <loom/kinds/moe.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model.hpp"

namespace loom::trainer {

struct MoeLayerOptions {
  std::string who;  // prefix of every error, e.g. "cfg.toml:12:1: [moe] instance 'x'"
  int layer = 0;
  int num_layers = 1;
  int dim = 0;         // M
  int hidden = 0;      // H
  int experts = 0;     // E; 0: the instance's num_experts
  int64_t tokens = 0;  // the most rows one forward passes (this rank)
  uint64_t seed = 0;   // the run's seed: initialisation and the routing's counter
  double aux_loss_coef = 0.01;
  // bf16 mode ([train] precision = "bf16"): the plugin gets bf16 tensors, the weights rounded
  // from the fp32 master weights, and fp32 weight gradients.
  bool bf16 = false;
};

// 256-byte aligned bytes that grow on demand.
class MoeBuffer {
 public:
  void* get(uint64_t n);

 private:
  struct Free {
    void operator()(void* q) const;
  };
  std::unique_ptr<void, Free> p_;
  uint64_t size_ = 0;
};

class MoeLayer final : public Mlp {
 public:
  // Plans the layer (training and evaluation at o.tokens) and makes its weights. Throws
  // std::runtime_error prefixed with o.who on a plan the instance refuses.
  MoeLayer(loom_instance* inst, const MoeLayerOptions& o);
  ~MoeLayer() override;

  // The plan of one layer, as `loom check` asks it. Throws std::runtime_error naming `who`.
  static loom_moe_plan_args plan_layer(loom_instance* inst, const std::string& who, int layer,
                                       int num_layers, int dim, int hidden, int experts,
                                       int64_t tokens, bool training, bool bf16 = false);

  // The step the next forwards belong to (1-based) and this rank's first row in the step's
  // global batch (the routing's noise counter).
  void set_step(int64_t step, int64_t first_token) {
    step_ = step;
    first_token_ = first_token;
  }
  void set_training(bool training) override { training_ = training; }

  void forward(const float* x, float* y, int rows) override;
  void backward(const float* x, const float* dy, float* dx, int rows) override;
  std::vector<ParamTensor> parameters() override;
  double flops_per_token() const override;

  const loom_moe_plan_args& plan() const { return train_plan_; }
  int experts() const { return train_plan_.experts; }
  bool residual() const { return (train_plan_.flags & LOOM_MOE_RESIDUAL) != 0; }
  bool has_expert_bias() const { return (train_plan_.flags & LOOM_MOE_EXPERT_BIAS) != 0; }
  // The expert parameters' names (averaged by reduce_gradients, not the world average).
  std::vector<std::string> expert_parameter_names() const;
  // Averages the expert gradients over the expert-data-parallel group (collective).
  void reduce_gradients();

  // The last training forward's statistics (this rank).
  // Seconds of the training forwards and backwards so far: in each phase as the plugin reports
  // it (loom_moe_stats' phase times, since ABI 1.7; 0 from an older plugin or on CUDA), and the
  // calls' whole wall time.
  struct PhaseSeconds {
    double gate = 0, dispatch = 0, exchange = 0, experts = 0, combine = 0, calls = 0;
  };
  const PhaseSeconds& phase_seconds() const { return phases_; }

  double aux_loss() const { return aux_loss_; }
  int64_t dropped() const { return dropped_; }
  int64_t expert_rows() const { return expert_rows_; }
  const std::vector<int64_t>& load() const { return load_; }
  // The aux-loss-free bias [E] (empty without LOOM_MOE_EXPERT_BIAS).
  std::vector<float>& expert_bias() { return bias_; }

 private:
  struct Tensor;
  void check(loom_status* st, const char* what);
  loom_moe_weights weights(bool grads, std::vector<std::unique_ptr<Tensor>>& keep);
  // bf16 mode: the weights the plugin reads, rounded from the master weights (each forward).
  void round_weights();
  // bf16 mode: the rows at `x` as bf16 in `out` (a tensor's storage); else x itself.
  const void* plugin_rows(const float* x, int rows, std::vector<uint16_t>& out) const;

  loom_instance* inst_;
  void* obj_ = nullptr;
  const loom_moe_v1* vt_ = nullptr;
  MoeLayerOptions o_;
  loom_moe_plan_args train_plan_{}, eval_plan_{};
  struct Param {
    std::string name;
    std::vector<int64_t> shape;
    std::vector<float> value, grad;
  };
  std::vector<Param> params_;  // gate, w1, b1, w2, b2[, res_w1, res_b1, res_w2, res_b2, coef_w,
                               // coef_b]
  std::vector<float> bias_, dx_;
  // bf16 mode: the rounded weights (one per parameter) and the bf16 rows of the plugin calls'
  // activations.
  std::vector<std::vector<uint16_t>> round16_;
  std::vector<uint16_t> x16_, y16_, dy16_, dx16_;
  PhaseSeconds phases_;
  void add_phases(const loom_moe_stats& s, double call_seconds);
  MoeBuffer saved_, workspace_;
  int64_t step_ = 1, first_token_ = 0;
  bool training_ = true;
  bool saved_training_ = true;  // the last forward's mode (backward follows a training one)
  int saved_rows_ = -1;
  double aux_loss_ = 0;
  int64_t dropped_ = 0, expert_rows_ = 0;
  std::vector<int64_t> load_, load_tmp_;
};

}  // namespace loom::trainer
