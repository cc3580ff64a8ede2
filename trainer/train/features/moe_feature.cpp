// [moe] in the loop (moe_feature.hpp).
#include "moe_feature.hpp"

#include <algorithm>
#include <memory>

#include "checkpoint.hpp"

namespace loom::trainer {

MoeFeature::MoeFeature(loom_session* session, const TrainConfig& c, Model& model, Comm& comm,
                       loom_instance* opt, int world, int local_batch, double& aux_acc)
    : c_(c), comm_(comm), world_(world), aux_acc_(aux_acc) {
  who_ = c_.moe_at + ": [moe] instance '" + c_.moe + "'";
  if (loom_find_instance(session, "moe", c_.moe.c_str(), &inst_) != LOOM_OK) {
    throw ConfigError(who_ + ": " + loom_last_error());
  }
  std::vector<std::string> expert_names;  // the expert parameters (reduce_gradients)
  for (size_t i = 0; i < c_.moe_layers.size(); ++i) {
    MoeLayerOptions o;
    o.who = who_;
    o.layer = c_.moe_layers[i];
    o.num_layers = c_.model.layers;
    o.dim = c_.model.dim;
    o.hidden = c_.moe_hidden > 0 ? c_.moe_hidden : 4 * c_.model.dim;
    o.experts = c_.moe_experts[i];
    o.tokens = static_cast<int64_t>(local_batch) * c_.seq_len;
    o.seed = c_.seed;
    o.aux_loss_coef = c_.moe_aux_loss_coef;
    o.bf16 = c_.precision == "bf16";
    auto layer = std::make_unique<MoeLayer>(inst_, o);
    if (i == 0) ep_ = layer->plan().ep_size;
    if (layer->plan().ep_size != ep_) {
      throw ConfigError(who_ + ": layer " + std::to_string(o.layer) + " planned ep_size " +
                        std::to_string(layer->plan().ep_size) + ", another " + std::to_string(ep_));
    }
    for (const auto& n : layer->expert_parameter_names()) expert_names.push_back(n);
    moe_.push_back(layer.get());
    model.replace_mlp(o.layer, std::move(layer));
  }
  if (ep_ > 1 && optimizer_comm_info(opt).owns_communication != 0) {
    throw ConfigError(who_ + ": ep_size " + std::to_string(ep_) +
                      " shards the experts over the ranks, but the optimizer '" +
                      loom_instance_plugin(opt) +
                      "' averages every gradient over all ranks itself, which would mix "
                      "different experts; use an optimizer the trainer averages for (adam, "
                      "lamb), or ep_size = 1");
  }
  if (ep_ > 1) {
    const std::string comm_name = moe_instance_comm(session, c_);
    if (comm_name != c_.comm) {
      throw ConfigError(who_ + ": ep_size " + std::to_string(ep_) +
                        " exchanges tokens over its comm " +
                        (comm_name.empty() ? std::string("(none)") : "'" + comm_name + "'") +
                        ", but the trainer's ranks are [manifest] comm '" + c_.comm +
                        "': give the instance comm = \"" + c_.comm + "\"");
    }
  }
  if (ep_ > 1 && world_ % ep_ != 0) {
    throw ConfigError(who_ + ": ep_size " + std::to_string(ep_) + " does not divide the " +
                      std::to_string(world_) + " ranks");
  }
  // The parameters are complete: later sections add none.
  for (const auto& p : model.parameters()) {
    expert_.push_back(std::find(expert_names.begin(), expert_names.end(), p.name) !=
                      expert_names.end());
  }
}

void MoeFeature::before_forward(int64_t step, const Batch& b, int64_t first_row) {
  for (MoeLayer* m : moe_) m->set_step(step, first_row * b.seq_len);
}

void MoeFeature::after_backward(int64_t, StepResult& r) {
  for (const MoeLayer* m : moe_) r.aux += c_.moe_aux_loss_coef * m->aux_loss();
}

// Expert parallelism: the experts' gradients by the instance (over the expert-data-parallel
// group), the rest by the world average. Without it every rank holds every expert and the
// world average is theirs too (the instance's reduce_gradients averages over its own comm,
// which it then need not have).
bool MoeFeature::reduces_own(size_t param) const { return ep_ > 1 && expert_[param]; }

void MoeFeature::reduce_gradients() {
  if (ep_ <= 1) return;
  for (MoeLayer* m : moe_) m->reduce_gradients();
}

// With expert parallelism each rank holds only its experts: their squares are summed over the
// world (each expert set held by world / ep_size ranks), so every rank clips by the same norm.
bool MoeFeature::owns_norm(size_t param) const { return expert_[param]; }

double MoeFeature::norm_squares(double local) {
  if (ep_ <= 1) return local;
  return comm_.sum({local})[0] / static_cast<double>(world_ / ep_);
}

// Every rank of an expert-parallel group makes the same forwards (they exchange tokens), so
// each rank gets the same number of windows.
size_t MoeFeature::eval_windows(size_t windows) const {
  if (ep_ > 1 && windows >= static_cast<size_t>(world_)) windows -= windows % world_;
  return windows;
}

void MoeFeature::before_eval(int64_t step) {
  for (MoeLayer* m : moe_) m->set_step(step, 0);
}

void MoeFeature::banner(BannerPart part, std::ostream& out) const {
  if (part != BannerPart::kModel) return;
  out << "loom train: MoE layers by '" << c_.moe << "' (" << loom_instance_plugin(inst_) << "):";
  for (size_t i = 0; i < moe_.size(); ++i) {
    const loom_moe_plan_args& p = moe_[i]->plan();
    out << (i ? ", " : " ") << c_.moe_layers[i] << " (" << p.experts << " experts, top-" << p.top_k
        << (moe_[i]->residual() ? ", residual" : "") << ")";
  }
  out << "; expert hidden " << (c_.moe_hidden > 0 ? c_.moe_hidden : 4 * c_.model.dim)
      << ", aux_loss_coef " << c_.moe_aux_loss_coef
      << (ep_ > 1 ? ", ep_size " + std::to_string(ep_) : std::string()) << std::endl;
}

// The MoE layers of this step: aux loss (mean over the ranks), load per expert and dropped
// choices (summed over the ranks).
void MoeFeature::log_metrics(const StepResult&, double mean_aux, nlohmann::json& j) {
  nlohmann::json moe_json = nlohmann::json::array();
  std::vector<double> v;
  for (const MoeLayer* m : moe_) {
    v.push_back(m->aux_loss());
    v.push_back(static_cast<double>(m->dropped()));
    for (const int64_t l : m->load()) v.push_back(static_cast<double>(l));
  }
  v = comm_.sum(v);
  size_t o = 0;
  for (size_t i = 0; i < moe_.size(); ++i) {
    nlohmann::json e = {{"layer", c_.moe_layers[i]},
                        {"experts", moe_[i]->experts()},
                        {"aux_loss", v[o] / world_},
                        {"dropped", static_cast<int64_t>(v[o + 1])}};
    std::vector<int64_t> load;
    for (int k = 0; k < moe_[i]->experts(); ++k)
      load.push_back(static_cast<int64_t>(v[o + 2 + static_cast<size_t>(k)]));
    e["load"] = load;
    o += 2 + static_cast<size_t>(moe_[i]->experts());
    moe_json.push_back(std::move(e));
  }
  j["aux_loss"] = mean_aux;
  j["moe"] = moe_json;
}

namespace {

// Rank 0's seconds in each phase of the MoE layers' training calls (docs/moe.md says what each
// counts), "other" the rest of those calls (the SDK's checks, the plan), and "calls" all of
// them; each also as a share of the training steps' time.
nlohmann::json phase_json(const MoeLayer::PhaseSeconds& p, double train_step_s) {
  const double other =
      std::max(0.0, p.calls - (p.gate + p.dispatch + p.exchange + p.experts + p.combine));
  const std::pair<const char*, double> parts[] = {
      {"gate", p.gate},       {"dispatch", p.dispatch}, {"exchange", p.exchange},
      {"experts", p.experts}, {"combine", p.combine},   {"other", other},
      {"calls", p.calls}};
  nlohmann::json seconds, share;
  for (const auto& [name, v] : parts) {
    seconds[name] = v;
    share[name] = train_step_s > 0 ? v / train_step_s : 0.0;
  }
  return {{"seconds", seconds}, {"share_of_steps", share}};
}

}  // namespace

void MoeFeature::summary(nlohmann::json& s, double train_step_s) const {
  nlohmann::json layers = nlohmann::json::array();
  MoeLayer::PhaseSeconds all;
  for (size_t i = 0; i < moe_.size(); ++i) {
    const MoeLayer::PhaseSeconds& p = moe_[i]->phase_seconds();
    layers.push_back({{"layer", c_.moe_layers[i]},
                      {"experts", moe_[i]->experts()},
                      {"top_k", moe_[i]->plan().top_k},
                      {"residual", moe_[i]->residual()},
                      {"phases", phase_json(p, train_step_s)}});
    all.gate += p.gate;
    all.dispatch += p.dispatch;
    all.exchange += p.exchange;
    all.experts += p.experts;
    all.combine += p.combine;
    all.calls += p.calls;
  }
  s["moe"] = {{"layers", layers},
              {"ep_size", ep_},
              {"aux_loss_coef", c_.moe_aux_loss_coef},
              {"phases", phase_json(all, train_step_s)}};
}

void MoeFeature::save_state(const std::filesystem::path& dir, const std::string& rs) {
  save_blob((dir / ("moe." + rs + ".bin")).string(), BlobKind::kMoe, encode());
}

// The [moe] state first: a config without the layers would otherwise meet their weights.
void MoeFeature::load_state_before_weights(const std::filesystem::path& dir,
                                           const std::string& rs) {
  const std::string mfile = (dir / ("moe." + rs + ".bin")).string();
  if (!std::filesystem::exists(mfile)) {
    throw CheckpointError(dir.string() + ": has no moe." + rs +
                          ".bin: it was written by a run without [moe]; resume with the "
                          "config it was written with");
  }
  decode(load_blob(mfile, BlobKind::kMoe), mfile);
}

std::vector<uint8_t> MoeFeature::encode() const {
  MoeState s;
  s.aux_acc = aux_acc_;
  for (size_t i = 0; i < moe_.size(); ++i) {
    s.layers.push_back({c_.moe_layers[i], moe_[i]->experts(), moe_[i]->expert_bias()});
  }
  return encode_moe_state(s);
}

void MoeFeature::decode(const std::vector<uint8_t>& b, const std::string& file) {
  const MoeState s = decode_moe_state(b, file);
  if (s.layers.size() != moe_.size()) {
    throw CheckpointError(file + ": holds " + std::to_string(s.layers.size()) +
                          " MoE layers, the config " + std::to_string(moe_.size()) +
                          "; resume with the config it was written with");
  }
  for (size_t i = 0; i < moe_.size(); ++i) {
    const MoeLayerState& l = s.layers[i];
    const std::vector<float>& bias = moe_[i]->expert_bias();
    if (l.layer != c_.moe_layers[i] || l.experts != moe_[i]->experts() ||
        l.bias.size() != bias.size()) {
      throw CheckpointError(
          file + ": MoE layer #" + std::to_string(i) + " is layer " + std::to_string(l.layer) +
          " with " + std::to_string(l.experts) + " experts (" + std::to_string(l.bias.size()) +
          " biases), the config's layer " + std::to_string(c_.moe_layers[i]) + " with " +
          std::to_string(moe_[i]->experts()) + " (" + std::to_string(bias.size()) +
          "); resume with the config it was written with");
    }
  }
  for (size_t i = 0; i < moe_.size(); ++i) moe_[i]->expert_bias() = s.layers[i].bias;
  aux_acc_ = s.aux_acc;
}

void NoMoeFeature::load_state_before_weights(const std::filesystem::path& dir,
                                             const std::string& rs) {
  if (std::filesystem::exists(dir / ("moe." + rs + ".bin"))) {
    throw CheckpointError(dir.string() +
                          ": was written with [moe] layers, which this config lacks; resume "
                          "with the config it was written with");
  }
}

}  // namespace loom::trainer
