#include "moe_layer.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numbers>
#include <stdexcept>
#include <utility>

#include "bf16.hpp"

namespace loom::trainer {

namespace {

constexpr DLDataType kF32{kDLFloat, 32, 1};
constexpr DLDataType kBf16{kDLBfloat, 16, 1};

// The dtype of the activations and weights the plugin gets: bf16 in bf16 mode (it computes in
// fp32 and rounds its outputs), else fp32. The weight gradients are fp32 either way.
DLDataType plugin_dtype(bool bf16) { return bf16 ? kBf16 : kF32; }

// A normal stream keyed by (seed, layer, tensor, expert): splitmix64 to seed, xorshift64* and
// Box-Muller to draw (the same on every platform).
class InitRng {
 public:
  InitRng(uint64_t seed, int layer, int tensor, int expert) {
    uint64_t z = seed;
    for (const uint64_t v : {static_cast<uint64_t>(layer), static_cast<uint64_t>(tensor),
                             static_cast<uint64_t>(expert)})
      z = mix(z ^ (v + 0x9E3779B97F4A7C15ull));
    s_ = z != 0 ? z : 0x2545F4914F6CDD1Dull;
  }
  double normal() {
    const double u = uniform(), v = uniform();
    return std::sqrt(-2.0 * std::log(u)) * std::cos(2.0 * std::numbers::pi * v);
  }

 private:
  static uint64_t mix(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() {
    s_ ^= s_ >> 12;
    s_ ^= s_ << 25;
    s_ ^= s_ >> 27;
    return (static_cast<double>((s_ * 0x2545F4914F6CDD1Dull) >> 11) + 0.5) * 0x1.0p-53;
  }
  uint64_t s_;
};

std::string plan_text(const loom_moe_plan_args& p) {
  return "experts " + std::to_string(p.experts) + ", k " + std::to_string(p.top_k) + ", ep_size " +
         std::to_string(p.ep_size);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

void* MoeBuffer::get(uint64_t n) {
  if (n == 0) return nullptr;
  if (n > size_) {
    const uint64_t r = (n + 255) / 256 * 256;
    void* q = std::aligned_alloc(256, r);
    if (q == nullptr) throw std::runtime_error("out of memory for " + std::to_string(r) + " bytes");
    std::memset(q, 0, r);
    p_.reset(q);
    size_ = r;
  }
  return p_.get();
}
void MoeBuffer::Free::operator()(void* q) const { std::free(q); }

// A CPU DLTensor (fp32 unless told) over a vector, with its own shape.
struct MoeLayer::Tensor {
  std::vector<int64_t> shape;
  DLTensor t{};
  Tensor(const void* data, std::vector<int64_t> dims, DLDataType dtype = kF32)
      : shape(std::move(dims)) {
    t.data = const_cast<void*>(data);
    t.device = {kDLCPU, 0};
    t.ndim = static_cast<int32_t>(shape.size());
    t.dtype = dtype;
    t.shape = shape.data();
  }
};

loom_moe_plan_args MoeLayer::plan_layer(loom_instance* inst, const std::string& who, int layer,
                                        int num_layers, int dim, int hidden, int experts,
                                        int64_t tokens, bool training, bool bf16) {
  void* obj = nullptr;
  const void* table = nullptr;
  if (loom_instance_table(inst, LOOM_KIND_MOE, LOOM_MOE_V1_MIN_SIZE, &obj, &table) != LOOM_OK) {
    throw std::runtime_error(who + ": " + loom_last_error());
  }
  const auto* vt = static_cast<const loom_moe_v1*>(table);
  if (vt->plan == nullptr) {
    throw std::runtime_error(who + ": plugin '" + loom_instance_plugin(inst) + "' has no plan");
  }
  loom_moe_plan_args p{};
  p.struct_size = LOOM_MOE_PLAN_ARGS_SIZE;
  p.tokens = std::max<int64_t>(1, tokens);
  p.model_dim = dim;
  p.hidden_dim = hidden;
  p.num_experts = experts;
  p.layer = layer;
  p.num_layers = num_layers;
  p.training = training ? 1u : 0u;
  p.dtype = plugin_dtype(bf16);
  char msg[1024] = {0};
  if (loom_instance_take_status(inst, vt->plan(obj, &p), msg, sizeof(msg)) != LOOM_OK) {
    throw std::runtime_error(who + ": plan (layer " + std::to_string(layer) +
                             (experts > 0 ? ", experts " + std::to_string(experts) : "") +
                             "): " + (msg[0] != '\0' ? std::string(msg) : loom_last_error()));
  }
  if (p.experts < 1 || p.local_experts < 1 || p.ep_size < 1 || p.top_k < 1 ||
      static_cast<int64_t>(p.local_experts) * p.ep_size != p.experts || p.ep_rank < 0 ||
      p.ep_rank >= p.ep_size || (experts > 0 && p.experts != experts)) {
    throw std::runtime_error(who + ": plan (layer " + std::to_string(layer) +
                             ") returned an inconsistent layout (" + plan_text(p) +
                             ", local_experts " + std::to_string(p.local_experts) + ", ep_rank " +
                             std::to_string(p.ep_rank) + ")");
  }
  return p;
}

MoeLayer::MoeLayer(loom_instance* inst, const MoeLayerOptions& o) : inst_(inst), o_(o) {
  if (o.dim < 1 || o.hidden < 1 || o.tokens < 1 || o.layer < 0 || o.layer >= o.num_layers) {
    throw std::invalid_argument(o.who + ": bad MoE layer shape");
  }
  const void* table = nullptr;
  if (loom_instance_table(inst, LOOM_KIND_MOE, LOOM_MOE_V1_MIN_SIZE, &obj_, &table) != LOOM_OK) {
    throw std::runtime_error(o.who + ": " + loom_last_error());
  }
  vt_ = static_cast<const loom_moe_v1*>(table);
  if (vt_->forward == nullptr || vt_->backward == nullptr || vt_->reduce_gradients == nullptr) {
    throw std::runtime_error(o.who + ": plugin '" + loom_instance_plugin(inst) +
                             "' lacks forward, backward or reduce_gradients");
  }
  train_plan_ = plan_layer(inst, o.who, o.layer, o.num_layers, o.dim, o.hidden, o.experts, o.tokens,
                           true, o.bf16);
  eval_plan_ = plan_layer(inst, o.who, o.layer, o.num_layers, o.dim, o.hidden, o.experts, o.tokens,
                          false, o.bf16);
  const int64_t E = train_plan_.experts, El = train_plan_.local_experts;
  const int64_t M = o.dim, H = o.hidden;
  const int first = train_plan_.ep_rank * train_plan_.local_experts;
  const std::string p = "h." + std::to_string(o.layer) + ".moe.";
  const double std_in = 0.02;
  const double std_out = 0.02 / std::sqrt(2.0 * static_cast<double>(o.num_layers));
  // init: 0 zeros, 2 normal 0.02, 3 normal 0.02/sqrt(2L); per_expert: one stream per expert.
  struct Spec {
    std::string name;
    std::vector<int64_t> shape;
    int init;
    bool per_expert;
  };
  std::vector<Spec> specs{{p + "gate.w", {E, M}, 2, false},
                          {p + "experts.w1", {El, H, M}, 2, true},
                          {p + "experts.b1", {El, H}, 0, true},
                          {p + "experts.w2", {El, M, H}, 3, true},
                          {p + "experts.b2", {El, M}, 0, true}};
  if (residual()) {
    specs.push_back({p + "res.fc.w", {H, M}, 2, false});
    specs.push_back({p + "res.fc.b", {H}, 0, false});
    specs.push_back({p + "res.proj.w", {M, H}, 3, false});
    specs.push_back({p + "res.proj.b", {M}, 0, false});
    specs.push_back({p + "coef.w", {2, M}, 2, false});
    specs.push_back({p + "coef.b", {2}, 0, false});
  }
  for (size_t t = 0; t < specs.size(); ++t) {
    const Spec& s = specs[t];
    size_t n = 1;
    for (const int64_t d : s.shape) n *= static_cast<size_t>(d);
    Param prm{s.name, s.shape, std::vector<float>(n, 0.0f), std::vector<float>(n, 0.0f)};
    if (s.init != 0) {
      const double sd = s.init == 2 ? std_in : std_out;
      const size_t parts = s.per_expert ? static_cast<size_t>(El) : 1;
      const size_t each = n / parts;
      for (size_t e = 0; e < parts; ++e) {
        InitRng rng(o.seed, o.layer, static_cast<int>(t), s.per_expert ? first + int(e) : -1);
        for (size_t i = 0; i < each; ++i)
          prm.value[e * each + i] = static_cast<float>(sd * rng.normal());
      }
    }
    params_.push_back(std::move(prm));
  }
  if (has_expert_bias()) bias_.assign(static_cast<size_t>(E), 0.0f);
  load_.assign(static_cast<size_t>(E), 0);
  load_tmp_.assign(static_cast<size_t>(E), 0);
}

MoeLayer::~MoeLayer() = default;

void MoeLayer::check(loom_status* st, const char* what) {
  if (st == nullptr) return;
  char msg[1024] = {0};
  if (loom_instance_take_status(inst_, st, msg, sizeof(msg)) == LOOM_OK) return;
  throw std::runtime_error(o_.who + ": " + what + " (step " + std::to_string(step_) + ", layer " +
                           std::to_string(o_.layer) +
                           "): " + (msg[0] != '\0' ? std::string(msg) : loom_last_error()));
}

loom_moe_weights MoeLayer::weights(bool grads, std::vector<std::unique_ptr<Tensor>>& keep) {
  loom_moe_weights w{};
  w.struct_size = LOOM_MOE_WEIGHTS_SIZE;
  const DLTensor** slots[] = {&w.gate_w, &w.w1,     &w.b1,     &w.w2,     &w.b2,    &w.res_w1,
                              &w.res_b1, &w.res_w2, &w.res_b2, &w.coef_w, &w.coef_b};
  for (size_t i = 0; i < params_.size(); ++i) {
    Param& p = params_[i];
    if (grads || !o_.bf16) {  // gradients: always fp32, the master weights' own
      keep.push_back(std::make_unique<Tensor>(grads ? p.grad.data() : p.value.data(), p.shape));
    } else {
      keep.push_back(std::make_unique<Tensor>(round16_[i].data(), p.shape, kBf16));
    }
    *slots[i] = &keep.back()->t;
  }
  return w;
}

void MoeLayer::round_weights() {
  if (!o_.bf16) return;
  round16_.resize(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const std::vector<float>& v = params_[i].value;
    round16_[i].resize(v.size());
    for (size_t k = 0; k < v.size(); ++k) round16_[i][k] = to_bf16(v[k]);
  }
}

const void* MoeLayer::plugin_rows(const float* x, int rows, std::vector<uint16_t>& out) const {
  if (!o_.bf16) return x;
  const size_t n = static_cast<size_t>(rows) * static_cast<size_t>(o_.dim);
  out.resize(n);
  for (size_t i = 0; i < n; ++i) out[i] = x != nullptr ? to_bf16(x[i]) : uint16_t{0};
  return out.data();
}

void MoeLayer::forward(const float* x, float* y, int rows) {
  if (rows > train_plan_.tokens) {  // a larger batch than planned: plan again
    train_plan_ = plan_layer(inst_, o_.who, o_.layer, o_.num_layers, o_.dim, o_.hidden, o_.experts,
                             rows, true, o_.bf16);
    eval_plan_ = plan_layer(inst_, o_.who, o_.layer, o_.num_layers, o_.dim, o_.hidden, o_.experts,
                            rows, false, o_.bf16);
  }
  const loom_moe_plan_args& p = training_ ? train_plan_ : eval_plan_;
  round_weights();
  std::vector<std::unique_ptr<Tensor>> keep;
  const loom_moe_weights w = weights(false, keep);
  // bf16 mode: x is bf16 already (the block rounds it), and so is y after the block rounds it.
  const DLDataType dt = plugin_dtype(o_.bf16);
  Tensor xt(plugin_rows(x, rows, x16_), {rows, o_.dim}, dt);
  Tensor yt(dt.bits == 16 ? plugin_rows(nullptr, rows, y16_) : y, {rows, o_.dim}, dt);
  Tensor bt(bias_.data(), {static_cast<int64_t>(bias_.size())});
  loom_moe_stats stats{};
  stats.struct_size = LOOM_MOE_STATS_SIZE;
  stats.load = load_tmp_.data();
  stats.load_count = static_cast<int64_t>(load_tmp_.size());
  loom_moe_forward_args a{};
  a.struct_size = LOOM_MOE_FORWARD_ARGS_SIZE;
  a.seed = o_.seed;
  a.step = step_;
  a.tokens = rows;
  a.first_token = first_token_;
  a.model_dim = o_.dim;
  a.hidden_dim = o_.hidden;
  a.num_experts = p.experts;
  a.layer = o_.layer;
  a.num_layers = o_.num_layers;
  a.training = training_ ? 1u : 0u;
  a.x = &xt.t;
  a.weights = &w;
  a.expert_bias = has_expert_bias() ? &bt.t : nullptr;
  a.y = &yt.t;
  a.stats = &stats;
  const uint64_t saved_bytes = std::max(train_plan_.saved_bytes, eval_plan_.saved_bytes);
  const uint64_t ws_bytes = std::max(train_plan_.workspace_bytes, eval_plan_.workspace_bytes);
  a.saved = saved_.get(saved_bytes);
  a.saved_bytes = saved_bytes;
  a.workspace = workspace_.get(ws_bytes);
  a.workspace_bytes = ws_bytes;
  const auto t0 = std::chrono::steady_clock::now();
  check(vt_->forward(obj_, &a), training_ ? "forward" : "forward (evaluation)");
  if (dt.bits == 16) {
    for (size_t i = 0; i < y16_.size(); ++i) y[i] = from_bf16(y16_[i]);
  }
  if (training_) add_phases(stats, seconds_since(t0));
  saved_training_ = training_;
  saved_rows_ = rows;
  if (training_) {
    aux_loss_ = stats.aux_loss;
    dropped_ = stats.dropped;
    expert_rows_ = stats.expert_rows;
    load_ = load_tmp_;
  }
}

void MoeLayer::backward(const float* x, const float* dy, float* dx, int rows) {
  if (!saved_training_ || rows != saved_rows_) {
    throw std::runtime_error(o_.who + ": backward (layer " + std::to_string(o_.layer) +
                             ") without the training forward of the same rows before it");
  }
  const size_t n = static_cast<size_t>(rows) * static_cast<size_t>(o_.dim);
  if (dx_.size() < n) dx_.resize(n);
  std::vector<std::unique_ptr<Tensor>> keep;
  const loom_moe_weights w = weights(false, keep);
  const loom_moe_weights g = weights(true, keep);
  // The weights round_weights() made for the forward (the optimizer has not stepped since).
  const DLDataType dt = plugin_dtype(o_.bf16);
  Tensor xt(plugin_rows(x, rows, x16_), {rows, o_.dim}, dt);
  Tensor dyt(plugin_rows(dy, rows, dy16_), {rows, o_.dim}, dt);
  Tensor dxt(dt.bits == 16 ? plugin_rows(nullptr, rows, dx16_) : dx_.data(), {rows, o_.dim}, dt);
  loom_moe_backward_args a{};
  a.struct_size = LOOM_MOE_BACKWARD_ARGS_SIZE;
  a.seed = o_.seed;
  a.step = step_;
  a.tokens = rows;
  a.first_token = first_token_;
  a.model_dim = o_.dim;
  a.hidden_dim = o_.hidden;
  a.num_experts = train_plan_.experts;
  a.layer = o_.layer;
  a.num_layers = o_.num_layers;
  a.training = 1;
  a.aux_loss_coef = o_.aux_loss_coef;
  a.x = &xt.t;
  a.weights = &w;
  a.dy = &dyt.t;
  a.dx = &dxt.t;
  a.grads = &g;
  const uint64_t saved_bytes = std::max(train_plan_.saved_bytes, eval_plan_.saved_bytes);
  const uint64_t ws_bytes = std::max(train_plan_.workspace_bytes, eval_plan_.workspace_bytes);
  a.saved = saved_.get(saved_bytes);
  a.saved_bytes = saved_bytes;
  a.workspace = workspace_.get(ws_bytes);
  a.workspace_bytes = ws_bytes;
  loom_moe_stats stats{};
  stats.struct_size = LOOM_MOE_STATS_SIZE;
  a.stats = &stats;
  const auto t0 = std::chrono::steady_clock::now();
  check(vt_->backward(obj_, &a), "backward");
  add_phases(stats, seconds_since(t0));
  if (dt.bits == 16) {
    for (size_t i = 0; i < n; ++i) dx_[i] = from_bf16(dx16_[i]);
  }
  for (size_t i = 0; i < n; ++i) dx[i] += dx_[i];  // the seam adds into dx
}

void MoeLayer::add_phases(const loom_moe_stats& s, double call_seconds) {
  phases_.gate += static_cast<double>(s.gate_ns) * 1e-9;
  phases_.dispatch += static_cast<double>(s.dispatch_ns) * 1e-9;
  phases_.exchange += static_cast<double>(s.exchange_ns) * 1e-9;
  phases_.experts += static_cast<double>(s.experts_ns) * 1e-9;
  phases_.combine += static_cast<double>(s.combine_ns) * 1e-9;
  phases_.calls += call_seconds;
}

std::vector<ParamTensor> MoeLayer::parameters() {
  std::vector<ParamTensor> out;
  for (auto& p : params_)
    out.push_back({p.name, p.shape, p.value.data(), p.grad.data(), p.value.size()});
  return out;
}

std::vector<std::string> MoeLayer::expert_parameter_names() const {
  std::vector<std::string> out;
  for (size_t i = 1; i < 5 && i < params_.size(); ++i) out.push_back(params_[i].name);
  return out;
}

void MoeLayer::reduce_gradients() {
  std::vector<std::unique_ptr<Tensor>> keep;
  std::vector<DLTensor*> ts;
  for (size_t i = 1; i < 5; ++i) {
    Param& p = params_[i];
    keep.push_back(std::make_unique<Tensor>(
        p.grad.data(), std::vector<int64_t>{static_cast<int64_t>(p.grad.size())}));
    ts.push_back(&keep.back()->t);
  }
  loom_moe_reduce_args a{};
  a.struct_size = LOOM_MOE_REDUCE_ARGS_SIZE;
  a.tensors = ts.data();
  a.count = static_cast<int64_t>(ts.size());
  check(vt_->reduce_gradients(obj_, &a), "reduce_gradients");
}

double MoeLayer::flops_per_token() const {
  // forward + backward (3x the forward's 2 flops per multiply-add): the gate, k experts'
  // two matmuls, and PR-MoE's residual MLP and coefficient.
  const double M = o_.dim, H = o_.hidden;
  double f = 6.0 * M * train_plan_.experts + 6.0 * 2.0 * M * H * train_plan_.top_k;
  if (residual()) f += 6.0 * 2.0 * M * H + 6.0 * 2.0 * M;
  return f;
}

}  // namespace loom::trainer
