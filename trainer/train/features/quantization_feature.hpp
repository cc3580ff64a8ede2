// [quantization]: quantization-aware training and distillation around the forward and
// backward, ZeroQuant's layer-by-layer distillation before training, and the quantized
// evaluations (quantization.hpp has the procedures; docs/quantization.md).
#pragma once

#include <loom/embed.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "config.hpp"
#include "dataset.hpp"
#include "durable_file.hpp"
#include "feature.hpp"
#include "quantization.hpp"
#include "run.hpp"

namespace loom::trainer {

class QuantizationFeature final : public Feature {
 public:
  // The quantizer instance, the tensors it takes, the fp32 weights the model starts from and
  // the teacher. Every tensor packs (the quantizer refuses a shape it cannot take, naming it)
  // before anything runs. Throws ConfigError.
  QuantizationFeature(loom_session* session, const TrainConfig& c, Model& model);

  std::optional<float> forward_backward(const Batch& b, StepResult& r) override;
  void log_metrics(const StepResult& r, double mean_aux, nlohmann::json& j) override;
  void summary(nlohmann::json& s, double train_step_s) const override;

  // ZeroQuant's layer-by-layer distillation, on batches of the dataset's default draw (the
  // same rows on every rank, so the blocks' weights stay identical across ranks); its lines
  // printed on rank 0 and recorded in `metrics` when open.
  void distill_layers(const Dataset& ds, int local_batch, bool root, AppendFile& metrics);

  // While alive, the model's evaluation forwards run through the quantizer's matmuls; pass it
  // to record_eval when done.
  std::unique_ptr<QuantizedEval> quantized_eval() {
    return std::make_unique<QuantizedEval>(model_, *quant_, names_);
  }
  void record_eval(const QuantizedEval& qe) {
    packed_bytes_ = qe.packed_bytes();
    float_bytes_ = qe.float_bytes();
    calls_ = qe.matmul_calls();
  }
  // The float weights' final eval loss, for summary.json.
  void set_fp32_eval(double loss) { fp32_eval_ = loss; }

  const std::string& plugin() const { return plugin_; }
  const std::vector<std::string>& names() const { return names_; }
  uint64_t packed_bytes() const { return packed_bytes_; }
  uint64_t float_bytes() const { return float_bytes_; }
  int64_t matmul_calls() const { return calls_; }
  const std::vector<nlohmann::json>& lkd_log() const { return lkd_log_; }

 private:
  const TrainConfig& c_;
  Model& model_;
  std::unique_ptr<WeightQuantizer> quant_;
  std::string who_, plugin_;
  std::vector<std::string> names_;
  std::optional<Model> teacher_;  // the fp32 teacher of LKD and KD
  std::vector<float> tlogits_;
  std::vector<nlohmann::json> lkd_log_;
  uint64_t packed_bytes_ = 0, float_bytes_ = 0;
  int64_t calls_ = 0;
  double fp32_eval_ = NAN;
};

}  // namespace loom::trainer
