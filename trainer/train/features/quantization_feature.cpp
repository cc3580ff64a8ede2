// [quantization] in the loop (quantization_feature.hpp).
#include "quantization_feature.hpp"

#include <chrono>
#include <cstdio>

#include "checkpoint.hpp"

namespace loom::trainer {

QuantizationFeature::QuantizationFeature(loom_session* session, const TrainConfig& c, Model& model)
    : c_(c), model_(model) {
  who_ = c_.quantizer_at + ": [quantization] quantizer '" + c_.quantizer + "'";
  loom_instance* qi = nullptr;
  if (loom_find_instance(session, "quantizer", c_.quantizer.c_str(), &qi) != LOOM_OK) {
    throw ConfigError(who_ + ": " + loom_last_error());
  }
  quant_ = plugin_quantizer(qi, who_, c_.precision == "bf16");
  plugin_ = loom_instance_plugin(qi);
  names_ = quantized_tensor_names(c_);
  if (!c_.weights.empty()) {
    try {
      load_safetensors(c_.weights, model_.parameters());
    } catch (const std::exception& e) {
      throw ConfigError(c_.weights_at + ": [quantization] weights: " + e.what());
    }
  }
  if (!c_.teacher.empty()) {
    teacher_.emplace(c_.model, c_.seed);
    try {
      load_safetensors(c_.teacher, teacher_->parameters());
    } catch (const std::exception& e) {
      throw ConfigError((c_.teacher_at.empty() ? c_.weights_at : c_.teacher_at) +
                        ": [quantization] teacher: " + e.what());
    }
  }
  QuantizedEval probe(model_, *quant_, names_);
}

// Quantization-aware: the forward and backward see dequantize(quantize(W)), the gradient
// lands on the float weights (straight-through). kd without qat: the same distillation in
// float (a QAT run's control).
std::optional<float> QuantizationFeature::forward_backward(const Batch& b, StepResult& r) {
  if (!c_.qat && !c_.kd) return std::nullopt;
  Distillation d;
  if (c_.kd) {
    tlogits_.resize(static_cast<size_t>(b.rows) * b.seq_len * c_.model.vocab_size);
    teacher_->forward_logits(b.x, b.rows, b.seq_len, tlogits_.data());
    d.teacher_logits = tlogits_.data();
    d.logit_weight = c_.kd_weight;
    for (int l = 0; l < c_.model.layers; ++l) d.teacher_hidden.push_back(teacher_->layer_output(l));
    d.hidden_weight = c_.hidden_weight;
    model_.set_distillation(&d);
  }
  float loss = 0;
  {
    std::optional<FakeQuantScope> fq;
    if (c_.qat) fq.emplace(model_, *quant_, names_);
    loss = model_.forward_backward(b.x, b.y, b.rows, b.seq_len);
  }
  model_.set_distillation(nullptr);
  if (c_.kd) r.kd = model_.distillation_terms();
  return loss;
}

void QuantizationFeature::log_metrics(const StepResult& r, double, nlohmann::json& j) {
  if (r.kd) {
    j["kd_ce"] = r.kd->ce;
    j["kd_soft_ce"] = r.kd->soft_ce;
    j["kd_hidden_mse"] = r.kd->hidden_mse;
  }
}

void QuantizationFeature::summary(nlohmann::json& s, double) const {
  s["quantizer"] = c_.quantizer;
  s["quantizer_plugin"] = plugin_;
  s["quantized_tensors"] = names_;
  s["qat"] = c_.qat;
  s["kd"] = c_.kd;
  s["lkd_steps"] = c_.lkd_steps;
  s["packed_bytes"] = packed_bytes_;
  s["float_bytes"] = float_bytes_;
  s["final_fp32_eval_loss"] = fp32_eval_;
}

void QuantizationFeature::distill_layers(const Dataset& ds, int local_batch, bool root,
                                         AppendFile& metrics) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto res = layerwise_distill(model_, *teacher_, *quant_, names_, c_.lkd_steps, c_.lkd_lr,
                                     [&](int64_t i, std::vector<int32_t>& tokens, int& b, int& t) {
                                       std::vector<int32_t> targets;
                                       fill_batch(ds, c_, i + 1, 0, local_batch, tokens, targets);
                                       b = local_batch;
                                       t = c_.seq_len;
                                     });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!root) return;
  for (const auto& r : res) {
    std::printf("lkd layer %d: block MSE %.6g -> %.6g (%lld steps)\n", r.layer, r.mse_before,
                r.mse_after, static_cast<long long>(c_.lkd_steps));
    nlohmann::json j = {{"type", "lkd"},
                        {"step", 0},
                        {"layer", r.layer},
                        {"mse_before", r.mse_before},
                        {"mse_after", r.mse_after},
                        {"lkd_steps", c_.lkd_steps}};
    lkd_log_.push_back(j);
    if (metrics.is_open()) metrics.append(j.dump());
  }
  std::printf("lkd: %d blocks in %.1f s\n", c_.model.layers, secs);
  std::fflush(stdout);
}

}  // namespace loom::trainer
