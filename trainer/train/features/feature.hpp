// The trainer's features: what a config section ([curriculum], [routing], [moe],
// [quantization], ...) adds to the plain data-parallel loop, each in a file of its own
// (docs/trainer.md "Features"). Trainer::train_step reads
//
//   batch -> forward and backward -> reduce the gradients -> clip, lr, optimizer step
//
// and calls each feature's hooks at those points, in the order of Trainer::features_. A hook
// a feature does not override does nothing. Every hook runs on every rank (hooks that
// communicate rely on it); hooks that only report write into JSON or text the trainer prints
// on rank 0.
#pragma once

#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "linear_hook.hpp"
#include "model.hpp"
#include "trainer_state.hpp"

namespace loom::trainer {

// One step's batch as the model runs it: this rank's rows of seq_len inputs and labels.
struct Batch {
  const int32_t* x = nullptr;
  const int32_t* y = nullptr;
  int rows = 0;
  int seq_len = 0;
};

// What one step measured, for its log line (the features fill in their parts).
struct StepResult {
  float loss = 0;
  double gnorm = 0;
  double lr = 0;
  bool owns = false;          // the optimizer did the gradient communication itself
  bool skipped = false;       // the optimizer skipped the step: a gradient was NaN or Inf
  int seq_len = 0;            // the step's sequence length (seq_len, or the schedule's, cut)
  double difficulty = NAN;    // the sampler's difficulty of the step's batch
  uint64_t layer_tokens = 0;  // the step's, all ranks
  std::vector<int> kept;      // positions per sequence each layer processed
  double aux = 0;             // the loss's auxiliary term ([moe]: aux_loss_coef x the aux losses)
  std::optional<DistillationTerms> kd;  // [quantization] kd: the loss's terms
};

// The banner's parts, printed in this order, each feature's lines in feature order.
enum class BannerPart {
  kData,      // where the batches come from
  kModel,     // what changes the model (routing, MoE layers)
  kSchedule,  // what changes the step (its sequence length)
};

class Feature {
 public:
  virtual ~Feature() = default;
  Feature() = default;
  Feature(const Feature&) = delete;
  Feature& operator=(const Feature&) = delete;

  // ---- one training step, in train_step's order

  // Puts this rank's rows of `step` into x and y (local_batch rows of seq_len); false leaves
  // the draw to the trainer (the run's seeded positions). The first feature that draws wins.
  virtual bool draw_batch(int64_t /*step*/, std::vector<int32_t>& /*x*/,
                          std::vector<int32_t>& /*y*/, StepResult& /*r*/) {
    return false;
  }
  // May change the batch the model runs (a shorter step of sequence-length warmup); sets
  // r.seq_len when it does.
  virtual void shape_batch(int64_t /*step*/, Batch& /*b*/, StepResult& /*r*/) {}
  // Before the forward: the step and this rank's first row in the step's global batch.
  virtual void before_forward(int64_t /*step*/, const Batch& /*b*/, int64_t /*first_row*/) {}
  // A feature that runs the forward and backward itself (around the model's
  // forward_backward: quantization-aware training, distillation) returns the loss.
  virtual std::optional<float> forward_backward(const Batch& /*b*/, StepResult& /*r*/) {
    return std::nullopt;
  }
  // After the backward, before the gradients are reduced: the step's statistics.
  virtual void after_backward(int64_t /*step*/, StepResult& /*r*/) {}

  // ---- gradient reduction (when the trainer, not the optimizer, communicates, on > 1 rank)

  // True for a parameter (an index into Model::parameters()) whose gradient this feature
  // reduces itself in reduce_gradients: the trainer's world average leaves it out.
  virtual bool reduces_own(size_t /*param*/) const { return false; }
  // The world average of the other gradients: a feature that does it itself returns true
  // (the communication overlap plugs in here: buckets started during the backward, waited
  // for here); else the trainer makes one allreduce of them. `params` are the indices.
  virtual bool average_gradients(const std::vector<size_t>& /*params*/) { return false; }
  // After the world average: the gradients reduces_own claims (collective).
  virtual void reduce_gradients() {}

  // ---- global-norm clipping

  // True for a parameter whose squares this feature sums apart (sharded over the ranks).
  virtual bool owns_norm(size_t /*param*/) const { return false; }
  // The global sum of the squares owns_norm claims, from this rank's (collective).
  virtual double norm_squares(double local) { return local; }

  // After the optimizer step (before the trainer counts the step's tokens into `st`).
  virtual void after_step(int64_t /*step*/, const Batch& /*b*/, const StepResult& /*r*/,
                          const TrainerState& /*st*/) {}

  // ---- evaluation

  // The heldout windows to evaluate, from `windows`.
  virtual size_t eval_windows(size_t windows) const { return windows; }
  // Before the evaluation forwards, which belong to `step` (the last step run, >= 1).
  virtual void before_eval(int64_t /*step*/) {}

  // ---- reports

  virtual void banner(BannerPart /*part*/, std::ostream& /*out*/) const {}
  // The step's log record, on every rank (it may communicate); `mean_aux` is r.aux's mean
  // since the last record over the ranks.
  virtual void log_metrics(const StepResult& /*r*/, double /*mean_aux*/, nlohmann::json& /*j*/) {}
  // summary.json; `train_step_s`: the time in train_step in this process.
  virtual void summary(nlohmann::json& /*s*/, double /*train_step_s*/) const {}

  // ---- checkpoints: this rank's files in `dir`, named with `rs` ("rank0", ...)

  virtual void save_state(const std::filesystem::path& /*dir*/, const std::string& /*rs*/) {}
  // Before the model's weights are read (state that changes the parameters' shapes).
  virtual void load_state_before_weights(const std::filesystem::path& /*dir*/,
                                         const std::string& /*rs*/) {}
  // After the weights and the optimizer's state.
  virtual void load_state(const std::filesystem::path& /*dir*/, const std::string& /*rs*/) {}
  // Last: refuses a file of this feature's that the config does not use.
  virtual void refuse_foreign_state(const std::filesystem::path& /*dir*/,
                                    const std::string& /*rs*/) {}
};

}  // namespace loom::trainer
