// [routing]: a router instance (random-LTD, a learned top-k router) as the model's router
// hook, and its accounting of each step (docs/routing.md).
#pragma once

#include <loom/embed.h>
#include <loom/kinds/router.h>

#include <algorithm>
#include <cstdlib>
#include <initializer_list>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "config.hpp"
#include "feature.hpp"
#include "router_hook.hpp"
#include "run.hpp"

namespace loom::trainer {

// 256-byte aligned scratch that grows on demand (a router's saved and workspace buffers).
class AlignedBytes {
 public:
  void* get(uint64_t n) {
    if (n == 0) return nullptr;
    if (n > size_) {
      const uint64_t r = (n + 255) / 256 * 256;
      void* q = std::aligned_alloc(256, r);
      if (q == nullptr) throw TrainError("out of memory for " + std::to_string(r) + " bytes");
      p_.reset(q);
      size_ = r;
    }
    return p_.get();
  }

 private:
  struct Free {
    void operator()(void* q) const { std::free(q); }
  };
  std::unique_ptr<void, Free> p_;
  uint64_t size_ = 0;
};

// A CPU DLTensor over the model's buffers, with its own shape.
struct Tensor {
  int64_t shape[3] = {0, 0, 0};
  DLTensor t{};
  Tensor(const void* data, std::initializer_list<int64_t> dims, DLDataType dtype) {
    int i = 0;
    for (const int64_t d : dims) shape[i++] = d;
    t.data = const_cast<void*>(data);
    t.device = {kDLCPU, 0};
    t.ndim = i;
    t.dtype = dtype;
    t.shape = shape;
  }
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  DLTensor* get() { return &t; }
};

constexpr DLDataType kF32{kDLFloat, 32, 1};
constexpr DLDataType kI32{kDLInt, 32, 1};

// The [routing] router instance as the model's router hook (router_hook.hpp): every call
// through libloom's checked table, on fp32 host tensors over the model's buffers. The plan of
// each (batch, seq_len, layer, training) is asked once per step; each layer keeps its own
// saved buffer (select -> backward), the workspace is shared. A layer holds a router weight
// when the router is learned and routes it at the run's seq_len (step 1, training).
class PluginRouter final : public RouterHook {
 public:
  PluginRouter(loom_instance* inst, std::string who, uint64_t seed, int seq_len, int channels)
      : inst_(inst), who_(std::move(who)), seed_(seed), seq_len_(seq_len), channels_(channels) {
    void* obj = nullptr;
    const void* table = nullptr;
    if (loom_instance_table(inst, LOOM_KIND_ROUTER, LOOM_ROUTER_V1_MIN_SIZE, &obj, &table) !=
        LOOM_OK) {
      throw ConfigError(who_ + ": " + loom_last_error());
    }
    obj_ = obj;
    vt_ = static_cast<const loom_router_v1*>(table);
    if (vt_->plan == nullptr || vt_->select == nullptr || vt_->gather == nullptr ||
        vt_->scatter == nullptr || vt_->advance == nullptr) {
      throw ConfigError(who_ + ": plugin '" + loom_instance_plugin(inst) +
                        "' lacks plan, select, gather, scatter or advance");
    }
  }

  // The step the next forwards belong to (plans are asked again for a new step), and this
  // rank's offset in the step's global batch.
  void set_step(int64_t step, int64_t first_sample) {
    if (step != step_) plans_.clear();
    step_ = step;
    first_sample_ = first_sample;
  }

  bool has_weight(int layer, int num_layers) override {
    const loom_router_plan_args p = ask_plan(layer, num_layers, 1, seq_len_, 1, 1);
    if ((p.flags & LOOM_ROUTER_LEARNED) != 0 && vt_->backward == nullptr) {
      throw ConfigError(who_ + ": plugin '" + loom_instance_plugin(inst_) +
                        "' says it is learned but has no backward");
    }
    const bool w = (p.flags & LOOM_ROUTER_LEARNED) != 0 && (p.flags & LOOM_ROUTER_ROUTED) != 0;
    if (static_cast<size_t>(layer) >= weights_.size()) {
      weights_.resize(static_cast<size_t>(layer) + 1, -1);
    }
    weights_[static_cast<size_t>(layer)] = w ? 1 : 0;
    return w;
  }

  RoutePlan plan(int layer, int num_layers, int batch, int seq, bool training) override {
    if (static_cast<size_t>(layer) >= current_.size()) {
      current_.resize(static_cast<size_t>(num_layers));
      saved_.resize(static_cast<size_t>(num_layers));
      weights_.resize(std::max(weights_.size(), static_cast<size_t>(num_layers)), -1);
    }
    const Key key{batch, seq, layer, training};
    auto it =
        std::find_if(plans_.begin(), plans_.end(), [&](const auto& e) { return e.first == key; });
    if (it == plans_.end()) {
      plans_.emplace_back(key, ask_plan(layer, num_layers, batch, seq, step_, training));
      it = plans_.end() - 1;
    }
    const loom_router_plan_args& p = it->second;
    current_[static_cast<size_t>(layer)] = p;
    int8_t& w = weights_[static_cast<size_t>(layer)];
    if (w < 0) w = has_weight(layer, num_layers) ? 1 : 0;
    if ((p.flags & LOOM_ROUTER_LEARNED) != 0 && (p.flags & LOOM_ROUTER_ROUTED) != 0 && w == 0) {
      // A learned router needs the layer's weight to select; the weights were fixed at the
      // start, from the plan of step 1 at the run's seq_len.
      throw TrainError(who_ + ": plan (step " + std::to_string(std::max<int64_t>(1, step_)) +
                       ", layer " + std::to_string(layer) + ", seq_len " + std::to_string(seq) +
                       (training ? "" : ", evaluation") +
                       ") routes a layer that holds no router weight: the trainer gives a "
                       "learned router's layer its weight h." +
                       std::to_string(layer) +
                       ".router.w only when the plan of step 1 at the run's seq_len " +
                       std::to_string(seq_len_) +
                       " (training) routes it, and that plan kept every position of this "
                       "layer (a learned router must route the same layers at every step and "
                       "length)");
    }
    RoutePlan r;
    r.kept = static_cast<int>(p.kept);
    r.routed = (p.flags & LOOM_ROUTER_ROUTED) != 0;
    r.gated = (p.flags & LOOM_ROUTER_LEARNED) != 0 && w == 1;
    return r;
  }

  void select(int layer, int num_layers, int batch, int seq, int channels, bool training,
              const float* x, const float* weight, int32_t* indices, float* gates) override {
    const loom_router_plan_args& p = current_[static_cast<size_t>(layer)];
    Tensor xt(x, {batch, seq, channels}, kF32);
    Tensor wt(weight, {channels}, kF32);
    Tensor it(indices, {batch, p.kept}, kI32);
    Tensor gt(gates, {batch, p.kept}, kF32);
    loom_router_select_args a{};
    a.struct_size = LOOM_ROUTER_SELECT_ARGS_SIZE;
    a.seed = seed_;
    a.step = step_;
    a.batch = batch;
    a.seq_len = seq;
    a.channels = channels;
    a.first_sample = first_sample_;
    a.layer = layer;
    a.num_layers = num_layers;
    a.training = training ? 1u : 0u;
    a.x = xt.get();
    a.weight = weight != nullptr ? wt.get() : nullptr;
    a.indices = it.get();
    a.gates = gates != nullptr ? gt.get() : nullptr;
    a.saved = saved_[static_cast<size_t>(layer)].get(p.saved_bytes);
    a.saved_bytes = p.saved_bytes;
    a.workspace = workspace_.get(p.workspace_bytes);
    a.workspace_bytes = p.workspace_bytes;
    check(vt_->select(obj_, &a), "select", layer, step_);
  }

  void gather(int layer, const float* full, float* kept, const int32_t* indices, int batch, int seq,
              int kept_count, int channels) override {
    move(vt_->gather, "gather", layer, full, kept, indices, batch, seq, kept_count, channels);
  }
  void scatter(int layer, float* full, const float* kept, const int32_t* indices, int batch,
               int seq, int kept_count, int channels) override {
    move(vt_->scatter, "scatter", layer, full, kept, indices, batch, seq, kept_count, channels);
  }

  void backward(int layer, int, int batch, int seq, int channels, const float* x,
                const float* weight, const int32_t* indices, const float* dgates, float* dx,
                float* dweight) override {
    const loom_router_plan_args& p = current_[static_cast<size_t>(layer)];
    Tensor xt(x, {batch, seq, channels}, kF32);
    Tensor wt(weight, {channels}, kF32);
    Tensor it(indices, {batch, p.kept}, kI32);
    Tensor dgt(dgates, {batch, p.kept}, kF32);
    Tensor dxt(dx, {batch, seq, channels}, kF32);
    Tensor dwt(dweight, {channels}, kF32);
    loom_router_backward_args a{};
    a.struct_size = LOOM_ROUTER_BACKWARD_ARGS_SIZE;
    a.batch = batch;
    a.seq_len = seq;
    a.channels = channels;
    a.x = xt.get();
    a.weight = wt.get();
    a.indices = it.get();
    a.dgates = dgt.get();
    a.dx = dxt.get();
    a.dweight = dwt.get();
    a.saved = saved_[static_cast<size_t>(layer)].get(p.saved_bytes);
    a.saved_bytes = p.saved_bytes;
    a.workspace = workspace_.get(p.workspace_bytes);
    a.workspace_bytes = p.workspace_bytes;
    check(vt_->backward(obj_, &a), "backward", layer, step_);
  }

  // The step's accounting after its optimizer step: batch = the step's sequences over all
  // ranks. Returns the router's out arguments.
  loom_router_advance_args advance(int64_t step, int64_t batch, int64_t seq_len, int num_layers) {
    loom_router_advance_args a{};
    a.struct_size = LOOM_ROUTER_ADVANCE_ARGS_SIZE;
    a.step = step;
    a.batch = batch;
    a.seq_len = seq_len;
    a.num_layers = num_layers;
    char msg[1024] = {0};
    if (loom_instance_take_status(inst_, vt_->advance(obj_, &a), msg, sizeof(msg)) != LOOM_OK) {
      throw TrainError(who_ + ": advance (step " + std::to_string(step) +
                       "): " + (msg[0] != '\0' ? std::string(msg) : loom_last_error()));
    }
    return a;
  }

 private:
  using Key = std::tuple<int, int, int, bool>;

  loom_router_plan_args ask_plan(int layer, int num_layers, int batch, int seq, int64_t step,
                                 bool training) {
    loom_router_plan_args p{};
    p.struct_size = LOOM_ROUTER_PLAN_ARGS_SIZE;
    p.batch = batch;
    p.seq_len = seq;
    p.channels = channels_;
    p.step = std::max<int64_t>(1, step);
    p.layer = layer;
    p.num_layers = num_layers;
    p.training = training ? 1u : 0u;
    p.dtype = kF32;
    check(vt_->plan(obj_, &p), "plan", layer, p.step);
    if (p.kept < 1 || p.kept > seq) {
      throw TrainError(who_ + ": plan (step " + std::to_string(p.step) + ", layer " +
                       std::to_string(layer) + ") kept " + std::to_string(p.kept) + " of " +
                       std::to_string(seq) + " positions (1 .. seq_len)");
    }
    return p;
  }

  using MoveFn = loom_status* (*)(void*, const loom_router_move_args*);
  void move(MoveFn fn, const char* what, int layer, const float* full, const float* kept,
            const int32_t* indices, int batch, int seq, int kept_count, int channels) {
    Tensor ft(full, {batch, seq, channels}, kF32);
    Tensor kt(kept, {batch, kept_count, channels}, kF32);
    Tensor it(indices, {batch, kept_count}, kI32);
    loom_router_move_args a{};
    a.struct_size = LOOM_ROUTER_MOVE_ARGS_SIZE;
    a.full = ft.get();
    a.kept = kt.get();
    a.indices = it.get();
    check(fn(obj_, &a), what, layer, step_);
  }

  void check(loom_status* st, const char* what, int layer, int64_t step) {
    if (st == nullptr) return;
    char msg[1024] = {0};
    if (loom_instance_take_status(inst_, st, msg, sizeof(msg)) == LOOM_OK) return;
    throw TrainError(who_ + ": " + what + " (step " + std::to_string(step) +
                     (layer >= 0 ? ", layer " + std::to_string(layer) : std::string()) +
                     "): " + (msg[0] != '\0' ? std::string(msg) : loom_last_error()));
  }

  loom_instance* inst_;
  void* obj_ = nullptr;
  const loom_router_v1* vt_ = nullptr;
  std::string who_;
  uint64_t seed_;
  int seq_len_, channels_;
  int64_t step_ = 0, first_sample_ = 0;
  std::vector<std::pair<Key, loom_router_plan_args>> plans_;  // this step's
  std::vector<loom_router_plan_args> current_;                // per layer: the last plan
  std::vector<AlignedBytes> saved_;
  std::vector<int8_t> weights_;  // per layer: -1 not asked yet, 0/1
  AlignedBytes workspace_;
};
// The feature: the router installed in the model (which adds the learned router weights to
// the parameters), told each step and evaluation, its accounting checked against the model's
// after each step, its state in the checkpoints (router.RANK.bin).
class RoutingFeature final : public Feature {
 public:
  // Finds the [routing] router and installs it as `model`'s router hook. Throws ConfigError.
  RoutingFeature(loom_session* session, const TrainConfig& c, Model& model, int world);

  void before_forward(int64_t step, const Batch& b, int64_t first_row) override;
  void after_backward(int64_t step, StepResult& r) override;
  void after_step(int64_t step, const Batch& b, const StepResult& r,
                  const TrainerState& st) override;
  void before_eval(int64_t step) override;
  void banner(BannerPart part, std::ostream& out) const override;
  void log_metrics(const StepResult& r, double mean_aux, nlohmann::json& j) override;
  void save_state(const std::filesystem::path& dir, const std::string& rs) override;
  void load_state(const std::filesystem::path& dir, const std::string& rs) override;

 private:
  const TrainConfig& c_;
  Model& model_;
  int world_;
  loom_instance* inst_ = nullptr;
  PluginRouter* router_ = nullptr;  // the hook, owned by the model
  std::string who_;
  std::string weights_;  // the learned router weights' names, for the banner
};

// A config without [routing]: refuses a checkpoint written with a router (where a router's
// state would be read).
class NoRoutingFeature final : public Feature {
 public:
  void load_state(const std::filesystem::path& dir, const std::string& rs) override;
};

}  // namespace loom::trainer
