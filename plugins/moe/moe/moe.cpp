// moe: a Mixture-of-Experts layer (kind loom.moe/1) with DeepSpeed's parameters: top-k gating
// with capacity (or dropless), noisy gating, random token selection, the load-balancing aux
// loss and aux-loss-free bias balancing, index dispatch, grouped expert GEMMs, PR-MoE's
// residual MLP and expert parallelism over a loom.comm. The work is in plugins/moe/core; this
// file turns parameters and ABI calls into the core's configuration and checks what the SDK
// does not.
#include <loom/sdk.hpp>
#include <loom/sdk/kinds/moe.hpp>
#include <loom/sdk/moe.hpp>
#include <loom/sdk/no_cuda.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <loom/moe/dispatch.hpp>
#include <loom/moe/exchange.hpp>
#include <loom/moe/gating.hpp>
#include <loom/moe/layer.hpp>
#include <loom/moe/moe_cuda.hpp>

#include "common/float16_stage.hpp"

namespace {

namespace moe = loom::moe;
namespace f16 = loom::plugins::float16;
using loom::sdk::Context;

[[noreturn]] void fail(const std::string& message) {
  throw loom::sdk::Error(LOOM_ERR_INVALID_ARGUMENT, message);
}

moe::DropPolicy parse_drop_policy(const std::string& s) {
  if (s == "probs") return moe::DropPolicy::Probs;
  if (s == "position") return moe::DropPolicy::Position;
  fail("drop_policy = \"" + s + "\" is not a drop policy; expected \"probs\" or \"position\"");
}

moe::NoisePolicy parse_noise(const std::string& s) {
  if (s == "none" || s == "None") return moe::NoisePolicy::None;
  if (s == "Jitter") return moe::NoisePolicy::Jitter;
  if (s == "RSample") return moe::NoisePolicy::RSample;
  fail("noisy_gate_policy = \"" + s +
       "\" is not a noise policy; expected \"none\", \"Jitter\" or \"RSample\"");
}

moe::Activation parse_activation(const std::string& s) {
  if (s == "gelu") return moe::Activation::Gelu;
  if (s == "relu") return moe::Activation::Relu;
  if (s == "silu") return moe::Activation::Silu;
  fail("activation = \"" + s + "\" is not an activation; expected \"gelu\", \"relu\" or \"silu\"");
}

// The most experts (and so the most choices per token and ranks per expert-parallel group) a
// layer takes: counts and indices are int32 in the ABI and int in the core.
constexpr int64_t kMaxExperts = 65536;

// A count of experts as planned or passed to a call (0 there means the parameter), checked
// before it is narrowed to int.
int checked_experts(int64_t experts, const char* where) {
  if (experts < 1 || experts > kMaxExperts) {
    fail(std::string(where) + "num_experts = " + std::to_string(experts) + " is outside [1, " +
         std::to_string(kMaxExperts) + "]");
  }
  return static_cast<int>(experts);
}

// The cross-parameter rules, each as the problem it finds ("" when none), so validate_params
// can report every one at its key and plan can throw the first.
std::string k_problem(int64_t k, int64_t experts) {
  if (k <= experts) return {};
  return "k = " + std::to_string(k) + " is more than num_experts = " + std::to_string(experts) +
         ": a token cannot choose more experts than there are";
}

std::string ep_problem(int64_t experts, int64_t ep_size) {
  if (experts % ep_size == 0) return {};
  return "num_experts = " + std::to_string(experts) +
         " is not a multiple of ep_size = " + std::to_string(ep_size) +
         ": every rank of an expert-parallel group holds the same number of experts";
}

std::string positive_problem(double v, const char* name) {
  if (v > 0.0) return {};
  return std::string(name) + " = " + std::to_string(v) +
         " must be > 0 (it scales the tokens each expert takes; drop_tokens = false removes "
         "the limit)";
}

void check_k(int64_t k, int64_t experts, const char* where) {
  if (auto p = k_problem(k, experts); !p.empty()) fail(where + p);
}

void check_ep(int64_t experts, int64_t ep_size, const char* where) {
  if (auto p = ep_problem(experts, ep_size); !p.empty()) fail(where + p);
}

class MoeLayer : public loom::sdk::Moe {
 public:
  static loom::sdk::Schema schema() {
    using namespace loom::sdk;
    return {
        Int("num_experts", 8,
            "E: experts of the layer over all ranks of its expert-parallel group. The trainer "
            "may plan a layer with another count (pyramid layouts); k and ep_size are checked "
            "against the count planned.")
            .min(1)
            .max(kMaxExperts),
        Int("k", 1,
            "Experts each token chooses (top-k by gate probability, ties to the lower expert "
            "index). k > num_experts is refused.")
            .min(1)
            .max(kMaxExperts),
        Float("capacity_factor", 1.0,
              "Training capacity: each expert takes at most max(ceil(k * capacity_factor * S / "
              "E), min_capacity) of the S tokens of a rank, never more than S.")
            .greater_than(0),
        Float("eval_capacity_factor", 1.0, "The capacity factor in evaluation (training = 0).")
            .greater_than(0),
        Int("min_capacity", 4, "The least capacity per expert (then capped at the tokens).").min(0),
        Bool("drop_tokens", true,
             "true: choices beyond an expert's capacity are dropped (later choices first, "
             "see drop_policy); false: dropless, every choice is processed and the rows per "
             "expert vary."),
        String("drop_policy", "probs",
               "Which choices of one rank (first choices, second choices, ...) an expert keeps "
               "when they exceed its capacity: \"probs\" (higher gate probability first, ties "
               "by position) or \"position\" (earlier tokens first). Later choices are always "
               "dropped before earlier ones.")
            .choices({"probs", "position"}),
        Bool("use_rts", false,
             "Random token selection in training: within one choice rank an expert keeps "
             "tokens in a random order drawn from the seed (DeepSpeed defaults this to true; "
             "here it is off unless asked). Evaluation never draws."),
        String("noisy_gate_policy", "none",
               "Noise on the gate in training: \"none\", \"Jitter\" (the gate's input times "
               "U(1 - jitter_eps, 1 + jitter_eps) per element) or \"RSample\" (the choice's "
               "score is log p plus Gumbel noise, so the first choice is a sample of p; the "
               "combine weights stay the clean probabilities). "
               "DeepSpeed spells none as None, which is accepted too.")
            .choices({"none", "None", "Jitter", "RSample"}),
        Float("jitter_eps", 0.01, "The half-width of the Jitter policy's multiplicative noise.")
            .range(0, 1),
        Bool("use_residual", false,
             "PR-MoE: a dense MLP beside the experts, mixed per token by a learned coefficient "
             "c = softmax(x . coef_w^T + coef_b): y = c0 * moe(x) + c1 * mlp(x). The caller "
             "passes res_w1, res_b1, res_w2, res_b2, coef_w and coef_b."),
        Float("bias_update_rate", 0.0,
              "Aux-loss-free balancing: > 0 adds a per-expert bias (the caller's float32 [E] "
              "state) to the scores of the choice only, and after each training forward moves "
              "it by rate * sign(mean load - load of the expert), the load summed over the "
              "expert-parallel group. 0 turns it off.")
            .min(0),
        String("activation", "gelu",
               "The experts' activation: \"gelu\" (tanh approximation), \"relu\" or \"silu\".")
            .choices({"gelu", "relu", "silu"}),
        Int("ep_size", 1,
            "Ranks of an expert-parallel group (consecutive ranks of comm); each holds "
            "num_experts / ep_size experts. num_experts must be a multiple of it; > 1 needs "
            "comm.")
            .min(1)
            .max(kMaxExperts),
        Ref("comm", LOOM_KIND_COMM,
            "The data-parallel world (loom.comm/1) the expert-parallel groups are split from; "
            "its size must be a multiple of ep_size. Needed when ep_size > 1; without it "
            "reduce_gradients is the identity."),
        Bool("normalize_top1", false,
             "k = 1 only: false weighs the expert's output by its probability, as DeepSpeed "
             "does; true divides by it (weight 1)."),
    };
  }

  // Every cross-parameter problem at once: the host reports one status per instance, so the
  // first problem's key is blamed and the message lists the others with theirs.
  static void validate_params(Context& params) {
    const int64_t experts = params.get_int("num_experts");
    const int64_t ep = params.get_int("ep_size");
    std::vector<std::pair<std::string, std::string>> problems;  // (key, problem)
    auto note = [&](const char* key, std::string problem) {
      if (!problem.empty()) problems.emplace_back(key, std::move(problem));
    };
    note("k", k_problem(params.get_int("k"), experts));
    note("ep_size", ep_problem(experts, ep));
    note("capacity_factor",
         positive_problem(params.get_float("capacity_factor"), "capacity_factor"));
    note("eval_capacity_factor",
         positive_problem(params.get_float("eval_capacity_factor"), "eval_capacity_factor"));
    if (ep > 1 && params.find_ref<loom_comm_v1>("comm").name().empty()) {
      note("ep_size", "ep_size = " + std::to_string(ep) +
                          " needs comm (a loom.comm instance to split the expert-parallel "
                          "groups from)");
    }
    if (!problems.empty()) {
      std::string message = problems[0].second;
      for (size_t i = 1; i < problems.size(); ++i) {
        message += "; and parameter '" + problems[i].first + "': " + problems[i].second;
      }
      throw loom::sdk::Error(LOOM_ERR_INVALID_ARGUMENT, message, problems[0].first);
    }
    (void)parse_drop_policy(params.get_string("drop_policy"));
    (void)parse_noise(params.get_string("noisy_gate_policy"));
    (void)parse_activation(params.get_string("activation"));
  }

  explicit MoeLayer(Context& ctx) : comm_(ctx.find_ref<loom_comm_v1>("comm")) {
    validate_params(ctx);
    num_experts_ = ctx.get_int("num_experts");
    gate_.k = static_cast<int>(ctx.get_int("k"));
    gate_.capacity_factor = ctx.get_float("capacity_factor");
    gate_.eval_capacity_factor = ctx.get_float("eval_capacity_factor");
    gate_.min_capacity = ctx.get_int("min_capacity");
    gate_.drop_tokens = ctx.get_bool("drop_tokens");
    gate_.drop_policy = parse_drop_policy(ctx.get_string("drop_policy"));
    gate_.use_rts = ctx.get_bool("use_rts");
    gate_.noise = parse_noise(ctx.get_string("noisy_gate_policy"));
    gate_.jitter_eps = static_cast<float>(ctx.get_float("jitter_eps"));
    gate_.normalize_top1 = ctx.get_bool("normalize_top1");
    residual_ = ctx.get_bool("use_residual");
    bias_rate_ = ctx.get_float("bias_update_rate");
    activation_ = parse_activation(ctx.get_string("activation"));
    ep_size_ = static_cast<int>(ctx.get_int("ep_size"));
    if (ep_size_ > 1 && !comm_) {
      fail("ep_size = " + std::to_string(ep_size_) +
           " needs comm (a loom.comm instance to split the expert-parallel groups from)");
    }
    if (comm_) {
      const int32_t world = comm_.call(&loom_comm_v1::size);
      if (world < 1 || world % ep_size_ != 0) {
        fail("comm '" + comm_.name() + "' has " + std::to_string(world) +
             " ranks, not a multiple of ep_size = " + std::to_string(ep_size_));
      }
    }
    try {
      exchange_ = std::make_unique<moe::Exchange>(comm_ ? comm_.vtable() : nullptr,
                                                  comm_ ? comm_.instance() : nullptr, ep_size_);
    } catch (const std::invalid_argument& e) {
      fail(e.what());
    }
  }

  void plan(loom_moe_plan_args& a) {
    f16::Storage storage{};
    if (!f16::storage_of(a.dtype, &storage)) {
      fail("dtype " + loom::sdk::dtype_string(a.dtype) +
           " is not supported: moe takes float32, bfloat16 or float16");
    }
    const moe::LayerConfig c =
        config(a.tokens, a.model_dim, a.hidden_dim, a.num_experts, a.training != 0, "plan: ");
    check_fits(c);
    a.flags = (residual_ ? LOOM_MOE_RESIDUAL : 0u) | (gate_.drop_tokens ? 0u : LOOM_MOE_DROPLESS) |
              (bias_rate_ > 0.0 ? LOOM_MOE_EXPERT_BIAS : 0u);
    a.experts = c.gate.num_experts;
    a.local_experts = c.local_experts;
    a.ep_size = c.ep_size;
    a.ep_rank = c.ep_rank;
    a.top_k = c.gate.k;
    a.activation = static_cast<int32_t>(activation_);
    a.capacity = moe::expert_capacity(c.gate, a.tokens);
    a.max_expert_rows = moe::max_expert_rows(c);
    a.saved_bytes = moe::saved_bytes(c, sizeof(float));
    a.workspace_bytes = own_workspace(c);
    if (storage != f16::Storage::kF32) a.workspace_bytes += staging_bytes(c);
  }

  void forward(const loom_moe_forward_args& a, const loom_moe_plan_args& p) {
    const bool device = on_cuda(a.x->device);
    moe::LayerConfig c =
        config(p.tokens, a.model_dim, a.hidden_dim, a.num_experts, a.training != 0, "forward: ");
    c.gate.seed = a.seed;
    c.gate.step = a.step;
    c.gate.layer = static_cast<uint32_t>(a.layer);
    c.gate.first_token = a.first_token;
    moe::ForwardCall<float> call;
    call.tokens = a.tokens;
    // A 16-bit call runs the float32 layer on copies at the start of the workspace (the
    // core's part follows them).
    f16::FloatStage stage = float_stage(a.workspace, 0);
    call.x = stage.in(a.x, a.stream);
    call.w = staged_weights(*a.weights, stage, a.stream);
    call.expert_bias = a.expert_bias != nullptr
                           ? static_cast<float*>(loom::sdk::first_element(*a.expert_bias))
                           : nullptr;
    call.y = stage.out(a.y);
    call.route_experts = a.route_experts != nullptr
                             ? static_cast<int32_t*>(loom::sdk::first_element(*a.route_experts))
                             : nullptr;
    call.route_weights = a.route_weights != nullptr
                             ? static_cast<float*>(loom::sdk::first_element(*a.route_weights))
                             : nullptr;
    call.saved = a.saved;
    call.saved_bytes = a.saved_bytes;
    const uint64_t staged = f16::is_16bit(a.x->dtype) ? staging_bytes(c) : 0;
    call.workspace = static_cast<char*>(a.workspace) + staged;
    call.workspace_bytes = a.workspace_bytes - staged;
    moe::LayerStats stats;
    if (a.stats != nullptr) stats.load = a.stats->load;
    moe::PhaseTimes times;
    call.times = &times;
    run([&] {
      if (device) {
        moe::cuda::layer_forward(c, *exchange_, call, stats, cuda_device(a.x->device, a.stream));
      } else {
        moe::layer_forward<float>(c, *exchange_, call, stats);
      }
    });
    stage.finish(call.y, a.y, a.stream);
    if (a.stats != nullptr) {
      a.stats->aux_loss = stats.aux_loss;
      a.stats->dropped = stats.dropped;
      a.stats->expert_rows = stats.expert_rows;
      loom::sdk::set_moe_phases(a.stats, times);
    }
  }

  void backward(const loom_moe_backward_args& a, const loom_moe_plan_args& p) {
    const bool device = on_cuda(a.x->device);
    moe::LayerConfig c =
        config(p.tokens, a.model_dim, a.hidden_dim, a.num_experts, a.training != 0, "backward: ");
    c.gate.seed = a.seed;
    c.gate.step = a.step;
    c.gate.layer = static_cast<uint32_t>(a.layer);
    c.gate.first_token = a.first_token;
    moe::BackwardCall<float> call;
    call.tokens = a.tokens;
    f16::FloatStage stage = float_stage(a.workspace, 0);
    call.x = stage.in(a.x, a.stream);
    call.w = staged_weights(*a.weights, stage, a.stream);
    call.dy = stage.in(a.dy, a.stream);
    call.dx = stage.out(a.dx);
    // 16-bit gradients are added in float32 and rounded once, at the end of the call.
    const TensorList grads = tensors(*a.grads);
    float* g[kWeightTensors] = {};
    for (int i = 0; i < kWeightTensors; ++i) g[i] = stage.inout(grads[i], a.stream);
    call.g.gate_w = g[0];
    call.g.experts = {g[1], g[2], g[3], g[4]};
    call.g.residual = {g[5], g[6], g[7], g[8]};
    call.g.coef_w = g[9];
    call.g.coef_b = g[10];
    call.aux_loss_coef = a.aux_loss_coef;
    call.saved = a.saved;
    call.saved_bytes = a.saved_bytes;
    const uint64_t staged = f16::is_16bit(a.x->dtype) ? staging_bytes(c) : 0;
    call.workspace = static_cast<char*>(a.workspace) + staged;
    call.workspace_bytes = a.workspace_bytes - staged;
    moe::PhaseTimes times;
    call.times = &times;
    run([&] {
      if (device) {
        moe::cuda::layer_backward(c, *exchange_, call, cuda_device(a.x->device, a.stream));
      } else {
        moe::layer_backward<float>(c, *exchange_, call);
      }
    });
    stage.finish(call.dx, a.dx, a.stream);
    for (int i = 0; i < kWeightTensors; ++i) {
      if (grads[i] != nullptr) stage.finish(g[i], grads[i], a.stream);
    }
    loom::sdk::set_moe_phases(a.stats, times);
  }

  // rows (expert layout) = the routed rows of x, weighted when route_weights is given. A
  // 16-bit call gathers float32 copies (one rounding of each weighted row, as the layer's).
  void dispatch(const loom_moe_dispatch_args& a) {
    const int64_t cap = staged_rows(a);
    check_staging(a, cap, "dispatch");
    f16::FloatStage stage = float_stage(a.workspace, 0);
    const float* x = stage.in(a.x, a.stream);
    float* rows = stage.out(a.rows, cap * a.model_dim);
    const auto* weights =
        a.route_weights != nullptr
            ? static_cast<const float*>(loom::sdk::first_element(*a.route_weights))
            : nullptr;
    if (on_cuda(a.x->device)) {
      const int64_t experts =
          checked_experts(a.num_experts != 0 ? a.num_experts : num_experts_, "");
      run([&] {
        moe::cuda::dispatch_alone(
            *exchange_, static_cast<int>(experts), a.top_k, a.tokens, a.model_dim, x,
            static_cast<const int32_t*>(loom::sdk::first_element(*a.route_experts)), weights, rows,
            cap, a.counts, cuda_device(a.x->device, a.stream));
      });
    } else {
      Routing r = routing(a, cap);
      std::vector<float> send(static_cast<size_t>(r.send_rows * a.model_dim));
      moe::gather_rows<float>(x, a.tokens, a.model_dim, r.k, r.slot.data(), r.weights, send.data());
      run([&] {
        exchange_->forward(r.plan, send.data(), rows,
                           a.model_dim * static_cast<int64_t>(sizeof(float)), a.x->device,
                           a.stream);
      });
      const std::vector<int64_t> local = local_counts(r.plan);
      for (size_t e = 0; e < local.size(); ++e) a.counts[e] = local[e];
    }
    // Only the rows written are rounded back; the rest of `rows` stays the caller's.
    int64_t used = 0;
    for (int64_t e = 0; e < a.counts_count; ++e) used += a.counts[e];
    stage.finish(rows, a.rows, a.stream, used * a.model_dim);
  }

  // y = the rows brought back to their tokens and summed per token (weighted when given).
  void combine(const loom_moe_dispatch_args& a) {
    const int64_t cap = staged_rows(a);
    check_staging(a, cap, "combine");
    f16::FloatStage stage = float_stage(a.workspace, 0);
    const float* rows = stage.in(a.rows, a.stream, cap * a.model_dim);
    float* y = stage.out(a.x);
    const auto* weights =
        a.route_weights != nullptr
            ? static_cast<const float*>(loom::sdk::first_element(*a.route_weights))
            : nullptr;
    if (on_cuda(a.x->device)) {
      const int64_t experts =
          checked_experts(a.num_experts != 0 ? a.num_experts : num_experts_, "");
      run([&] {
        moe::cuda::combine_alone(
            *exchange_, static_cast<int>(experts), a.top_k, a.tokens, a.model_dim, rows, cap,
            static_cast<const int32_t*>(loom::sdk::first_element(*a.route_experts)), weights, y,
            cuda_device(a.x->device, a.stream));
      });
    } else {
      Routing r = routing(a, cap);
      std::vector<float> send(static_cast<size_t>(r.send_rows * a.model_dim));
      run([&] {
        exchange_->reverse(r.plan, rows, send.data(),
                           a.model_dim * static_cast<int64_t>(sizeof(float)), a.x->device,
                           a.stream);
      });
      moe::combine_rows<float>(send.data(), a.tokens, a.model_dim, r.k, r.slot.data(), r.weights, y,
                               false);
    }
    stage.finish(y, a.x, a.stream);
  }

  void reduce_gradients(const loom_moe_reduce_args& a) {
    run([&] { exchange_->reduce_gradients(a.tensors, a.count, a.stream); });
  }

 private:
  struct Routing {
    int k = 1;
    std::vector<int64_t> counts, slot;
    int64_t send_rows = 0;
    const float* weights = nullptr;
    moe::Exchange::Plan plan;
  };

  // `have`: the rows of `rows` this call may use.
  Routing routing(const loom_moe_dispatch_args& a, int64_t have) {
    const int64_t experts = checked_experts(a.num_experts != 0 ? a.num_experts : num_experts_, "");
    Routing r;
    r.k = a.top_k;
    r.counts.resize(static_cast<size_t>(experts));
    r.slot.resize(static_cast<size_t>(a.tokens * a.top_k));
    const auto* route = static_cast<const int32_t*>(loom::sdk::first_element(*a.route_experts));
    // A bad route or too few rows on one rank stops every rank of the expert-parallel group
    // together (after the counts exchange, before the rows').
    std::string error;
    int64_t status = 0;
    try {
      r.send_rows = moe::build_slots(route, a.tokens, a.top_k, static_cast<int>(experts),
                                     r.counts.data(), r.slot.data());
    } catch (const std::exception& e) {
      error = std::string("moe: ") + e.what();
      status = -1;
      std::fill(r.counts.begin(), r.counts.end(), 0);
    }
    r.weights = a.route_weights != nullptr
                    ? static_cast<const float*>(loom::sdk::first_element(*a.route_weights))
                    : nullptr;
    run([&] { r.plan = exchange_->plan(r.counts.data(), static_cast<int>(experts)); });
    if (status == 0 && have < r.plan.recv_rows) {
      status = r.plan.recv_rows - have;
      error = "moe: rows has " + std::to_string(have) + " rows but the routing sends " +
              std::to_string(r.plan.recv_rows) +
              " to this rank's experts (size it by the plan's max_expert_rows)";
    }
    std::string stop;
    run([&] { stop = exchange_->agree_ep(status, error, "rows"); });
    if (!stop.empty()) throw loom::sdk::Error(LOOM_ERR_INVALID_ARGUMENT, stop);
    return r;
  }

  // ---- 16-bit calls: the float32 layer on copies staged at the start of the workspace
  // (common/float16_stage.hpp), in a region plan sizes (staging_bytes) before the core's.
  static constexpr int kWeightTensors = 11;
  using TensorList = std::array<const DLTensor*, kWeightTensors>;

  static TensorList tensors(const loom_moe_weights& w) {
    return {w.gate_w, w.w1,     w.b1,     w.w2,     w.b2,    w.res_w1,
            w.res_b1, w.res_w2, w.res_b2, w.coef_w, w.coef_b};
  }

  static uint64_t own_workspace(const moe::LayerConfig& c) {
    return (moe::workspace_bytes(c, sizeof(float)) + 255u) / 256u * 256u;
  }

  // The staging of the largest call of a plan: backward's x, dy, dx, weights and gradients,
  // or dispatch's / combine's x and rows.
  static uint64_t staging_bytes(const moe::LayerConfig& c) {
    const int64_t e = c.gate.num_experts, el = c.local_experts, m = c.model_dim, h = c.hidden_dim;
    uint64_t weights = f16::staging_bytes(e * m) + 2 * f16::staging_bytes(el * h * m) +
                       f16::staging_bytes(el * h) + f16::staging_bytes(el * m);
    if (c.residual) {
      weights += 2 * f16::staging_bytes(h * m) + f16::staging_bytes(h) + f16::staging_bytes(m) +
                 f16::staging_bytes(2 * m) + f16::staging_bytes(2);
    }
    const uint64_t tokens = f16::staging_bytes(c.max_tokens * m);
    const uint64_t layer = 3 * tokens + 2 * weights;
    const uint64_t alone = tokens + f16::staging_bytes(alone_rows(c) * m);
    return std::max(layer, alone);
  }

  // The rows a 16-bit dispatch or combine stages: the most either capacity (training or
  // evaluation) lets the routing send, so the workspace of any plan of these tokens holds them.
  static int64_t alone_rows(moe::LayerConfig c) {
    c.gate.training = true;
    const int64_t train = moe::max_expert_rows(c);
    c.gate.training = false;
    return std::max(train, moe::max_expert_rows(c));
  }

  // A 16-bit dispatch / combine stages x and `cap` rows in the workspace (the SDK checks no
  // workspace for these calls): one too short, misaligned or NULL is refused on every rank of
  // the group together, before any exchange, as a short `rows` is.
  void check_staging(const loom_moe_dispatch_args& a, int64_t cap, const char* call) {
    int64_t status = 0;
    std::string error;
    if (f16::is_16bit(a.x->dtype)) {
      const uint64_t need =
          f16::staging_bytes(a.tokens * a.model_dim) + f16::staging_bytes(cap * a.model_dim);
      const bool aligned = reinterpret_cast<uintptr_t>(a.workspace) % 256 == 0;
      if (a.workspace == nullptr || a.workspace_bytes < need || !aligned) {
        status = a.workspace_bytes < need ? static_cast<int64_t>(need - a.workspace_bytes) : -1;
        error = std::string("moe ") + call + ": a " + loom::sdk::dtype_string(a.x->dtype) +
                " call stages x and rows in float32 in its workspace, which needs " +
                std::to_string(need) +
                " bytes, 256-byte aligned (the plan's workspace_bytes); it " +
                (a.workspace == nullptr ? std::string("is NULL")
                                        : "has " + std::to_string(a.workspace_bytes) + " bytes" +
                                              (aligned ? "" : ", misaligned"));
      }
    }
    std::string stop;
    run([&] { stop = exchange_->agree_ep(status, error, "bytes of workspace"); });
    if (!stop.empty()) throw loom::sdk::Error(LOOM_ERR_INVALID_ARGUMENT, stop);
  }

  static f16::FloatStage float_stage(void* workspace, uint64_t offset) {
    return f16::FloatStage(workspace, offset,
                           f16::DeviceConvert{moe::cuda::widen_floats, moe::cuda::narrow_floats});
  }

  static moe::LayerWeights<float> staged_weights(const loom_moe_weights& w, f16::FloatStage& stage,
                                                 void* stream) {
    const TensorList t = tensors(w);
    const float* f[kWeightTensors] = {};
    for (int i = 0; i < kWeightTensors; ++i) f[i] = stage.in(t[i], stream);
    moe::LayerWeights<float> out;
    out.gate_w = f[0];
    out.experts = {f[1], f[2], f[3], f[4]};
    out.residual = {f[5], f[6], f[7], f[8]};
    out.coef_w = f[9];
    out.coef_b = f[10];
    return out;
  }

  // The rows of a dispatch / combine's `rows` that are used: all of them in float32; in 16
  // bits at most alone_rows, the float32 copy the workspace stages (a routing that sends more
  // is refused on every rank, as for a short `rows`).
  int64_t staged_rows(const loom_moe_dispatch_args& a) const {
    const int64_t have = a.rows->shape[0];
    if (!f16::is_16bit(a.x->dtype)) return have;
    const moe::LayerConfig c = config(a.tokens, a.model_dim, 1, a.num_experts, false, "dispatch: ");
    return std::min(have, alone_rows(c));
  }

  static std::vector<int64_t> local_counts(const moe::Exchange::Plan& p) {
    std::vector<int64_t> out(static_cast<size_t>(p.local_experts), 0);
    for (int le = 0; le < p.local_experts; ++le) {
      for (int src = 0; src < p.ep; ++src) {
        out[static_cast<size_t>(le)] += p.recv_counts[static_cast<size_t>(le * p.ep + src)];
      }
    }
    return out;
  }

  moe::LayerConfig config(int64_t tokens, int64_t model_dim, int64_t hidden_dim,
                          int32_t num_experts, bool training, const char* where) const {
    const int64_t experts = checked_experts(num_experts != 0 ? num_experts : num_experts_, where);
    check_k(gate_.k, experts, where);
    check_ep(experts, ep_size_, where);
    moe::LayerConfig c;
    c.gate = gate_;
    c.gate.num_experts = static_cast<int>(experts);
    c.gate.training = training;
    c.activation = activation_;
    c.model_dim = model_dim;
    c.hidden_dim = hidden_dim;
    c.max_tokens = tokens;
    c.ep_size = exchange_->ep_size();
    c.ep_rank = exchange_->ep_rank();
    c.local_experts = static_cast<int>(experts / c.ep_size);
    c.residual = residual_;
    c.bias_update_rate = bias_rate_;
    return c;
  }

  // Every buffer's element count must fit 64-bit byte sizes (BLAS's and cuBLAS's int
  // dimensions are checked where the GEMMs run).
  static void check_fits(const moe::LayerConfig& c) {
    const auto S = static_cast<long double>(c.max_tokens);
    const auto k = static_cast<long double>(c.gate.k);
    const auto E = static_cast<long double>(c.gate.num_experts);
    const auto M = static_cast<long double>(c.model_dim);
    const auto H = static_cast<long double>(c.hidden_dim);
    const long double rows = static_cast<long double>(c.ep_size) * S * k;
    const long double biggest = std::max({S * E, rows * M, rows * H, S * H, E * H * M});
    if (biggest * 8.0L > 4.0e18L) {
      throw loom::sdk::Error(LOOM_ERR_OUT_OF_RANGE,
                             "plan: " + std::to_string(c.max_tokens) + " tokens of model_dim " +
                                 std::to_string(c.model_dim) + " and hidden_dim " +
                                 std::to_string(c.hidden_dim) + " with " +
                                 std::to_string(c.gate.num_experts) + " experts and k " +
                                 std::to_string(c.gate.k) + " do not fit 64-bit buffer sizes");
    }
  }

  // Host memory runs on the host path; CUDA memory on the CUDA one (moe_cuda_stub.cpp without
  // CUDA or cuBLAS: refused here, before any work).
  static bool on_cuda(const DLDevice& dev) {
    if (loom::sdk::is_cpu(dev)) return false;
    if (!loom::sdk::is_cuda(dev)) {
      fail("x is on " + loom::sdk::device_string(dev) + "; moe runs on host or CUDA memory");
    }
    if (!moe::cuda::have_cuda()) {
      loom::sdk::throw_built_without_cuda("x is on " + loom::sdk::device_string(dev));
    }
    return true;
  }

  moe::cuda::Device cuda_device(const DLDevice& dev, void* stream) {
    return moe::cuda::Device{dev.device_id, stream, &blas_};
  }
  moe::cuda::Blas blas_;

  // The core's std exceptions as statuses: bad input -> INVALID_ARGUMENT, else INTERNAL.
  template <class Fn>
  static void run(Fn&& fn) {
    try {
      fn();
    } catch (const loom::sdk::Error&) {
      throw;
    } catch (const std::invalid_argument& e) {
      throw loom::sdk::Error(LOOM_ERR_INVALID_ARGUMENT, e.what());
    } catch (const std::runtime_error& e) {
      throw loom::sdk::Error(LOOM_ERR_INTERNAL, e.what());
    }
  }

  loom::sdk::InstanceRef<loom_comm_v1> comm_;
  std::unique_ptr<moe::Exchange> exchange_;
  int64_t num_experts_ = 8;
  moe::GateConfig gate_;
  bool residual_ = false;
  double bias_rate_ = 0.0;
  moe::Activation activation_ = moe::Activation::Gelu;
  int ep_size_ = 1;
};

}  // namespace

LOOM_PLUGIN("moe", "1.0.0",
            "Mixture-of-Experts layer: top-k gating with capacity or dropless, noisy gating, "
            "random token selection, aux loss and aux-loss-free balancing, index dispatch, "
            "grouped expert GEMMs, PR-MoE and expert parallelism",
            loom::sdk::factory<MoeLayer>());
