// [routing] in the loop (routing_feature.hpp).
#include "routing_feature.hpp"

#include "checkpoint.hpp"

namespace loom::trainer {

RoutingFeature::RoutingFeature(loom_session* session, const TrainConfig& c, Model& model, int world)
    : c_(c), model_(model), world_(world) {
  who_ = c_.router_at + ": [routing] router '" + c_.router + "'";
  if (loom_find_instance(session, "router", c_.router.c_str(), &inst_) != LOOM_OK) {
    throw ConfigError(who_ + ": " + loom_last_error());
  }
  auto hook = std::make_unique<PluginRouter>(inst_, who_, c_.seed, c_.seq_len, c_.model.dim);
  router_ = hook.get();
  model_.set_router(std::move(hook));
  for (const auto& p : model_.parameters()) {
    if (p.name.size() > 9 && p.name.compare(p.name.size() - 9, 9, ".router.w") == 0) {
      weights_ += (weights_.empty() ? "" : ", ") + p.name;
    }
  }
}

// The router sees the step and this rank's first row in the step's global batch.
void RoutingFeature::before_forward(int64_t step, const Batch&, int64_t first_row) {
  router_->set_step(step, first_row);
}

void RoutingFeature::after_backward(int64_t, StepResult& r) { r.kept = model_.kept(); }

// The router's accounting of the step (every rank; the same numbers on each), which must
// agree with what the model ran.
void RoutingFeature::after_step(int64_t step, const Batch& b, const StepResult& r,
                                const TrainerState& st) {
  const loom_router_advance_args a =
      router_->advance(step, static_cast<int64_t>(b.rows) * world_, r.seq_len, c_.model.layers);
  if (a.layer_tokens < 0 || static_cast<uint64_t>(a.layer_tokens) != r.layer_tokens ||
      a.consumed_layer_tokens != st.layer_tokens + r.layer_tokens) {
    throw TrainError(who_ + ": advance (step " + std::to_string(step) + ") counted " +
                     std::to_string(a.layer_tokens) + " layer tokens (" +
                     std::to_string(a.consumed_layer_tokens) + " consumed), but the model ran " +
                     std::to_string(r.layer_tokens) + " (" +
                     std::to_string(st.layer_tokens + r.layer_tokens) + ")");
  }
}

// Evaluation forwards pass training = 0 at the last step run (1 before any).
void RoutingFeature::before_eval(int64_t step) { router_->set_step(step, 0); }

void RoutingFeature::banner(BannerPart part, std::ostream& out) const {
  if (part != BannerPart::kModel) return;
  out << "loom train: token routing by '" << c_.router << "' (" << loom_instance_plugin(inst_)
      << ")" << (weights_.empty() ? std::string() : "; learned weights " + weights_) << std::endl;
}

void RoutingFeature::log_metrics(const StepResult& r, double, nlohmann::json& j) {
  j["kept"] = r.kept;
}

void RoutingFeature::save_state(const std::filesystem::path& dir, const std::string& rs) {
  save_blob((dir / ("router." + rs + ".bin")).string(), BlobKind::kRouter,
            export_instance_state(inst_, "router"));
}

void RoutingFeature::load_state(const std::filesystem::path& dir, const std::string& rs) {
  const std::string rfile = (dir / ("router." + rs + ".bin")).string();
  if (!std::filesystem::exists(rfile)) {
    throw CheckpointError(dir.string() + ": has no router." + rs +
                          ".bin: it was written by a run without [routing]; resume with the "
                          "config it was written with");
  }
  const auto state = load_blob(rfile, BlobKind::kRouter);
  if (loom_instance_import_state(inst_, state.data(), state.size()) != LOOM_OK) {
    throw CheckpointError(rfile + ": the router '" + c_.router +
                          "' refused its state: " + loom_last_error());
  }
}

void NoRoutingFeature::load_state(const std::filesystem::path& dir, const std::string& rs) {
  if (std::filesystem::exists(dir / ("router." + rs + ".bin"))) {
    throw CheckpointError(dir.string() +
                          ": was written with a [routing] router, which this config lacks; "
                          "resume with the config it was written with");
  }
}

}  // namespace loom::trainer
