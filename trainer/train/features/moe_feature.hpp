// [moe]: the listed blocks' MLPs as Mixture-of-Experts layers over a loom.moe/1 instance
// (moe_layer.hpp), with expert parallelism's gradient reduction and norm (docs/moe.md).
#pragma once

#include <loom/embed.h>

#include <string>
#include <vector>

#include "config.hpp"
#include "feature.hpp"
#include "moe_layer.hpp"
#include "run.hpp"

namespace loom::trainer {

class MoeFeature final : public Feature {
 public:
  // Each listed block's MLP becomes a MoeLayer over the instance (which plans it and makes
  // its weights, parameters of the model from then on). `opt`: the optimizer instance, which
  // must leave the gradient communication to the trainer under expert parallelism.
  // `aux_acc`: the trainer's sum of StepResult::aux since the last log line, which the
  // checkpoints keep here. Throws ConfigError.
  MoeFeature(loom_session* session, const TrainConfig& c, Model& model, Comm& comm,
             loom_instance* opt, int world, int local_batch, double& aux_acc);

  void before_forward(int64_t step, const Batch& b, int64_t first_row) override;
  void after_backward(int64_t step, StepResult& r) override;
  bool reduces_own(size_t param) const override;
  void reduce_gradients() override;
  bool owns_norm(size_t param) const override;
  double norm_squares(double local) override;
  size_t eval_windows(size_t windows) const override;
  void before_eval(int64_t step) override;
  void banner(BannerPart part, std::ostream& out) const override;
  void log_metrics(const StepResult& r, double mean_aux, nlohmann::json& j) override;
  void summary(nlohmann::json& s, double train_step_s) const override;
  void save_state(const std::filesystem::path& dir, const std::string& rs) override;
  void load_state_before_weights(const std::filesystem::path& dir, const std::string& rs) override;

 private:
  // The [moe] trainer state (trainer_state.hpp has its layout).
  std::vector<uint8_t> encode() const;
  // Checks the file's layers against the config's before taking any of it.
  void decode(const std::vector<uint8_t>& b, const std::string& file);

  const TrainConfig& c_;
  Comm& comm_;
  int world_;
  double& aux_acc_;
  loom_instance* inst_ = nullptr;
  std::vector<MoeLayer*> moe_;  // the MoE layers, owned by the model, as [moe] lists them
  std::string who_;
  int ep_ = 1;                // the instance's ep_size
  std::vector<bool> expert_;  // per parameter: an expert parameter
};

// A config without [moe]: refuses a checkpoint written with MoE layers (before the weights,
// which would not match).
class NoMoeFeature final : public Feature {
 public:
  void load_state_before_weights(const std::filesystem::path& dir, const std::string& rs) override;
};

}  // namespace loom::trainer
