// The host MoE layer (layer.hpp).
#include <loom/moe/layer.hpp>

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

#include <loom/moe/dispatch.hpp>
#include "layer_layout.hpp"

namespace loom::moe {

using detail::carve_saved;
using detail::carve_work;
using detail::check_layout;
using detail::kSavedMagic;
using detail::num_experts;
using detail::SavedHeader;
using detail::SavedView;
using detail::WorkView;

namespace {

// Adds the time since the previous lap to one phase of `times` (nothing when it is null).
class Laps {
 public:
  explicit Laps(PhaseTimes* times) : times_(times) {
    if (times_ != nullptr) last_ = Clock::now();
  }
  void to(uint64_t PhaseTimes::*phase) {
    if (times_ == nullptr) return;
    const auto now = Clock::now();
    times_->*phase += static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(now - last_).count());
    last_ = now;
  }

 private:
  using Clock = std::chrono::steady_clock;
  PhaseTimes* times_;
  Clock::time_point last_{};
};

void need(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("moe: " + what);
}

void check_config(const LayerConfig& cfg) {
  need(cfg.gate.num_experts >= 1, "num_experts must be >= 1");
  need(cfg.gate.k >= 1 && cfg.gate.k <= cfg.gate.num_experts,
       "k (" + std::to_string(cfg.gate.k) + ") must be in [1, num_experts (" +
           std::to_string(cfg.gate.num_experts) + ")]");
  need(cfg.model_dim >= 1 && cfg.hidden_dim >= 1, "model_dim and hidden_dim must be >= 1");
  need(cfg.ep_size >= 1 && cfg.local_experts * cfg.ep_size == cfg.gate.num_experts,
       "local_experts * ep_size must equal num_experts");
}

template <class T>
void check_buffers(const LayerConfig& cfg, int64_t tokens, int64_t rows, const void* saved,
                   uint64_t sbytes, const void* work, uint64_t wbytes) {
  check_config(cfg);
  need(tokens >= 0 && tokens <= cfg.max_tokens, "tokens " + std::to_string(tokens) +
                                                    " outside [0, the plan's tokens " +
                                                    std::to_string(cfg.max_tokens) + "]");
  const uint64_t ns = carve_saved<T>(cfg, tokens, rows, nullptr).bytes;
  const uint64_t nw = carve_work<T>(cfg, tokens, rows, nullptr).bytes;
  const std::string why = rows > max_expert_rows(cfg)
                              ? " (the experts received " + std::to_string(rows) +
                                    " rows, more than this plan's " +
                                    std::to_string(max_expert_rows(cfg)) +
                                    ": plan with the most tokens any rank passes)"
                              : "";
  need(saved != nullptr && sbytes >= ns, "saved holds " + std::to_string(sbytes) +
                                             " bytes, the call needs " + std::to_string(ns) + why);
  need(work != nullptr && wbytes >= nw, "workspace holds " + std::to_string(wbytes) +
                                            " bytes, the call needs " + std::to_string(nw) + why);
}

std::vector<int64_t> local_rows(const LayerConfig& cfg, const int64_t* recv_counts) {
  std::vector<int64_t> rows(static_cast<size_t>(cfg.local_experts), 0);
  for (int le = 0; le < cfg.local_experts; ++le) {
    for (int src = 0; src < cfg.ep_size; ++src) {
      rows[static_cast<size_t>(le)] += recv_counts[le * cfg.ep_size + src];
    }
  }
  return rows;
}

DLDevice host_device() { return DLDevice{kDLCPU, 0}; }

}  // namespace

int64_t max_expert_rows(const LayerConfig& cfg) {
  const int64_t all = static_cast<int64_t>(cfg.ep_size) * cfg.max_tokens * cfg.gate.k;
  if (!cfg.gate.drop_tokens) return all;
  const int64_t c = expert_capacity(cfg.gate, cfg.max_tokens);
  return std::min(all, static_cast<int64_t>(cfg.ep_size) * cfg.local_experts * c);
}

uint64_t saved_bytes(const LayerConfig& cfg, size_t elem) {
  return elem == 8 ? carve_saved<double>(cfg, cfg.max_tokens, max_expert_rows(cfg), nullptr).bytes
                   : carve_saved<float>(cfg, cfg.max_tokens, max_expert_rows(cfg), nullptr).bytes;
}

uint64_t workspace_bytes(const LayerConfig& cfg, size_t elem) {
  return elem == 8 ? carve_work<double>(cfg, cfg.max_tokens, max_expert_rows(cfg), nullptr).bytes
                   : carve_work<float>(cfg, cfg.max_tokens, max_expert_rows(cfg), nullptr).bytes;
}

template <class T>
void layer_forward(const LayerConfig& cfg, Exchange& ex, const ForwardCall<T>& call,
                   LayerStats& stats) {
  const int64_t S = call.tokens;
  check_config(cfg);
  const int E = cfg.gate.num_experts;
  const int k = cfg.gate.k;
  const int64_t M = cfg.model_dim, H = cfg.hidden_dim;
  SavedView<T> sv{};
  WorkView<T> wv{};
  std::vector<int64_t> load(static_cast<size_t>(E), 0);
  std::vector<int64_t> send_counts(static_cast<size_t>(E), 0);
  RouteOut<T> ro;
  int64_t send_rows = 0;
  Laps lap(call.times);
  // Local checks and routing; a rank that fails them still takes part in the counts
  // exchange (sending nothing) and in the agreement after it, so every rank of the
  // expert-parallel group stops together instead of waiting in the row exchange.
  std::string error;
  int64_t status = 0;
  try {
    check_buffers<T>(cfg, S, 0, call.saved, call.saved_bytes, call.workspace, call.workspace_bytes);
    need(S == 0 || (call.x != nullptr && call.y != nullptr), "x and y are required");
    need(call.w.gate_w != nullptr && call.w.experts.w1 != nullptr && call.w.experts.b1 != nullptr &&
             call.w.experts.w2 != nullptr && call.w.experts.b2 != nullptr,
         "the gate and expert weights are required");
    need(!cfg.residual || (call.w.residual.w1 != nullptr && call.w.residual.b1 != nullptr &&
                           call.w.residual.w2 != nullptr && call.w.residual.b2 != nullptr &&
                           call.w.coef_w != nullptr && call.w.coef_b != nullptr),
         "use_residual needs res_w1, res_b1, res_w2, res_b2, coef_w and coef_b");
    sv = carve_saved<T>(cfg, S, 0, call.saved);
    ro.probs = sv.probs;
    ro.choice = sv.choice;
    ro.route = sv.route;
    ro.weights = sv.weights;
    ro.load = load.data();
    route_tokens(cfg.gate, call.x, S, M, call.w.gate_w, call.expert_bias, ro);
    lap.to(&PhaseTimes::gate_ns);
    send_rows = build_slots(sv.route, S, k, E, sv.send_counts, sv.slot);
    std::copy(sv.send_counts, sv.send_counts + E, send_counts.begin());
  } catch (const std::exception& e) {
    error = e.what();
    status = -1;
    std::fill(send_counts.begin(), send_counts.end(), 0);
  }
  lap.to(&PhaseTimes::dispatch_ns);
  const Exchange::Plan plan = ex.plan(send_counts.data(), E);
  // the expert-layout regions, now that the rows are known
  if (status == 0) {
    const uint64_t ns = carve_saved<T>(cfg, S, plan.recv_rows, nullptr).bytes;
    const uint64_t nw = carve_work<T>(cfg, S, plan.recv_rows, nullptr).bytes;
    const int64_t short_s = ns > call.saved_bytes ? static_cast<int64_t>(ns - call.saved_bytes) : 0;
    const int64_t short_w =
        nw > call.workspace_bytes ? static_cast<int64_t>(nw - call.workspace_bytes) : 0;
    status = std::max(short_s, short_w);
    if (status > 0) {
      try {
        check_buffers<T>(cfg, S, plan.recv_rows, call.saved, call.saved_bytes, call.workspace,
                         call.workspace_bytes);
      } catch (const std::exception& e) {
        error = e.what();
      }
    }
  }
  const std::string stop = ex.agree_ep(status, error, "bytes of saved or workspace");
  if (!stop.empty()) throw std::invalid_argument(stop);
  if (cfg.gate.training && cfg.bias_update_rate > 0.0 && call.expert_bias != nullptr) {
    // The load over every rank (the data-parallel copies too), so each copy's bias moves alike.
    std::vector<int64_t> total = load;
    ex.sum_world(total.data(), E);
    update_expert_bias(call.expert_bias, total.data(), E, cfg.bias_update_rate);
  }
  sv = carve_saved<T>(cfg, S, plan.recv_rows, call.saved);
  wv = carve_work<T>(cfg, S, plan.recv_rows, call.workspace);
  std::copy(plan.recv_counts.begin(), plan.recv_counts.end(), sv.recv_counts);
  lap.to(&PhaseTimes::exchange_ns);
  gather_rows<T>(call.x, S, M, k, sv.slot, nullptr, wv.rows_send);
  lap.to(&PhaseTimes::dispatch_ns);
  const auto row_bytes = static_cast<int64_t>(M * sizeof(T));
  ex.forward(plan, wv.rows_send, sv.expert_in, row_bytes, host_device(), nullptr);
  lap.to(&PhaseTimes::exchange_ns);
  const std::vector<int64_t> rows = local_rows(cfg, sv.recv_counts);
  experts_forward<T>(cfg.activation, cfg.local_experts, rows.data(), M, H, sv.expert_in,
                     call.w.experts, sv.expert_pre, wv.h, wv.recv_a);
  lap.to(&PhaseTimes::experts_ns);
  ex.reverse(plan, wv.recv_a, sv.out_send, row_bytes, host_device(), nullptr);
  lap.to(&PhaseTimes::exchange_ns);
  T* moe_y = cfg.residual ? sv.moe_out : call.y;
  combine_rows<T>(sv.out_send, S, M, k, sv.slot, sv.weights, moe_y, false);
  lap.to(&PhaseTimes::combine_ns);

  if (cfg.residual && S > 0) {
    const int64_t n = S;
    experts_forward<T>(cfg.activation, 1, &n, M, H, call.x, call.w.residual, sv.mlp_pre, wv.h2,
                       sv.mlp_out);
    lap.to(&PhaseTimes::experts_ns);
    for (int64_t s = 0; s < S; ++s) {
      const T* xs = call.x + s * M;
      T z[2];
      for (int i = 0; i < 2; ++i) {
        T acc = T(0);
        for (int64_t m = 0; m < M; ++m) acc = acc + xs[m] * call.w.coef_w[i * M + m];
        z[i] = acc + call.w.coef_b[i];
      }
      const T mx = std::max(z[0], z[1]);
      const T e0 = exp_fixed(z[0] - mx), e1 = exp_fixed(z[1] - mx);
      const T c0 = e0 / (e0 + e1), c1 = e1 / (e0 + e1);
      sv.coef[s * 2] = c0;
      sv.coef[s * 2 + 1] = c1;
      T* ys = call.y + s * M;
      const T* a = sv.moe_out + s * M;
      const T* b = sv.mlp_out + s * M;
      for (int64_t m = 0; m < M; ++m) ys[m] = c0 * a[m] + c1 * b[m];
    }
  }

  if (call.route_experts != nullptr) std::copy(sv.route, sv.route + S * k, call.route_experts);
  if (call.route_weights != nullptr) {
    for (int64_t i = 0; i < S * k; ++i) call.route_weights[i] = static_cast<float>(sv.weights[i]);
  }
  *sv.hdr = detail::make_header(cfg, S, send_rows, plan.recv_rows, ro.capacity, sizeof(T));
  stats.aux_loss = ro.aux_loss;
  stats.dropped = ro.dropped;
  stats.expert_rows = plan.recv_rows;
  stats.capacity = ro.capacity;
  if (stats.load != nullptr) std::copy(load.begin(), load.end(), stats.load);
  lap.to(&PhaseTimes::combine_ns);
}

template <class T>
void layer_backward(const LayerConfig& cfg, Exchange& ex, const BackwardCall<T>& call) {
  const int64_t S = call.tokens;
  check_config(cfg);
  const int E = cfg.gate.num_experts;
  const int k = cfg.gate.k;
  const int64_t M = cfg.model_dim, H = cfg.hidden_dim;
  // Local checks, then one agreement over the expert-parallel group before its row exchange.
  Laps lap(call.times);
  std::string error;
  int64_t R = 0;
  try {
    check_buffers<T>(cfg, S, 0, call.saved, call.saved_bytes, call.workspace, call.workspace_bytes);
    need(S == 0 || (call.x != nullptr && call.dy != nullptr && call.dx != nullptr),
         "x, dy and dx are required");
    need(call.g.gate_w != nullptr && call.g.experts.w1 != nullptr && call.g.experts.b1 != nullptr &&
             call.g.experts.w2 != nullptr && call.g.experts.b2 != nullptr,
         "the gate and expert gradients are required");
    need(!cfg.residual || (call.g.residual.w1 != nullptr && call.g.residual.b1 != nullptr &&
                           call.g.residual.w2 != nullptr && call.g.residual.b2 != nullptr &&
                           call.g.coef_w != nullptr && call.g.coef_b != nullptr),
         "use_residual needs the residual MLP's and the coefficient's gradients");
    const auto* hdr = static_cast<const SavedHeader*>(call.saved);
    need(hdr->magic == kSavedMagic && hdr->elem == sizeof(T),
         "saved was not written by this layer's forward");
    need(hdr->tokens == S, "backward's tokens (" + std::to_string(S) +
                               ") differ from its forward's (" + std::to_string(hdr->tokens) + ")");
    const std::string layout = check_layout(cfg, *hdr);
    need(layout.empty(), layout);
    R = hdr->recv_rows;
    check_buffers<T>(cfg, S, R, call.saved, call.saved_bytes, call.workspace, call.workspace_bytes);
  } catch (const std::exception& e) {
    error = e.what();
  }
  const std::string stop = ex.agree_ep(error.empty() ? 0 : -1, error, "bytes");
  if (!stop.empty()) throw std::invalid_argument(stop);
  // const_cast: carving only computes addresses; backward never writes `saved`.
  const SavedView<T> sv = carve_saved<T>(cfg, S, R, const_cast<void*>(call.saved));
  WorkView<T> wv = carve_work<T>(cfg, S, R, call.workspace);
  lap.to(&PhaseTimes::exchange_ns);

  const T* dmoe = call.dy;
  if (cfg.residual) {
    for (int64_t s = 0; s < S; ++s) {
      const T c0 = sv.coef[s * 2], c1 = sv.coef[s * 2 + 1];
      const T* d = call.dy + s * M;
      const T* a = sv.moe_out + s * M;
      const T* b = sv.mlp_out + s * M;
      T dc0 = T(0), dc1 = T(0);
      for (int64_t m = 0; m < M; ++m) {
        wv.dmoe[s * M + m] = c0 * d[m];
        wv.dmlp[s * M + m] = c1 * d[m];
        dc0 += d[m] * a[m];
        dc1 += d[m] * b[m];
      }
      const T dot = c0 * dc0 + c1 * dc1;
      wv.dz[s * 2] = c0 * (dc0 - dot);
      wv.dz[s * 2 + 1] = c1 * (dc1 - dot);
    }
    dmoe = wv.dmoe;
  }

  combine_weight_grad<T>(sv.out_send, dmoe, S, M, k, sv.slot, wv.dweights);
  gather_rows<T>(dmoe, S, M, k, sv.slot, sv.weights, wv.rows_send);
  lap.to(&PhaseTimes::combine_ns);
  Exchange::Plan plan;
  plan.num_experts = E;
  plan.local_experts = cfg.local_experts;
  plan.ep = cfg.ep_size;
  plan.send_counts.assign(sv.send_counts, sv.send_counts + E);
  plan.recv_counts.assign(sv.recv_counts, sv.recv_counts + E);
  plan.recv_rows = R;
  const auto row_bytes = static_cast<int64_t>(M * sizeof(T));
  ex.forward(plan, wv.rows_send, wv.recv_a, row_bytes, host_device(), nullptr);
  lap.to(&PhaseTimes::exchange_ns);
  const std::vector<int64_t> rows = local_rows(cfg, sv.recv_counts);
  experts_backward<T>(cfg.activation, cfg.local_experts, rows.data(), M, H, sv.expert_in,
                      sv.expert_pre, wv.recv_a, call.w.experts, call.g.experts, wv.h, wv.dh,
                      wv.recv_b);
  lap.to(&PhaseTimes::experts_ns);
  ex.reverse(plan, wv.recv_b, wv.rows_send, row_bytes, host_device(), nullptr);
  lap.to(&PhaseTimes::exchange_ns);
  combine_rows<T>(wv.rows_send, S, M, k, sv.slot, nullptr, call.dx, false);
  lap.to(&PhaseTimes::dispatch_ns);
  gate_backward<T>(cfg.gate, call.x, S, M, call.w.gate_w, sv.probs, sv.choice, sv.route,
                   wv.dweights, call.aux_loss_coef, wv.dlogits, call.dx, call.g.gate_w);
  lap.to(&PhaseTimes::gate_ns);

  if (cfg.residual && S > 0) {
    const int64_t n = S;
    experts_backward<T>(cfg.activation, 1, &n, M, H, call.x, sv.mlp_pre, wv.dmlp, call.w.residual,
                        call.g.residual, wv.h2, wv.dh2, wv.dres);
    lap.to(&PhaseTimes::experts_ns);
    for (int64_t s = 0; s < S; ++s) {
      const T* xs = call.x + s * M;
      T* dxs = call.dx + s * M;
      const T* dr = wv.dres + s * M;
      const T z0 = wv.dz[s * 2], z1 = wv.dz[s * 2 + 1];
      for (int64_t m = 0; m < M; ++m) {
        dxs[m] += dr[m] + z0 * call.w.coef_w[m] + z1 * call.w.coef_w[M + m];
        call.g.coef_w[m] += z0 * xs[m];
        call.g.coef_w[M + m] += z1 * xs[m];
      }
      call.g.coef_b[0] += z0;
      call.g.coef_b[1] += z1;
    }
    lap.to(&PhaseTimes::combine_ns);
  }
}

template void layer_forward<float>(const LayerConfig&, Exchange&, const ForwardCall<float>&,
                                   LayerStats&);
template void layer_forward<double>(const LayerConfig&, Exchange&, const ForwardCall<double>&,
                                    LayerStats&);
template void layer_backward<float>(const LayerConfig&, Exchange&, const BackwardCall<float>&);
template void layer_backward<double>(const LayerConfig&, Exchange&, const BackwardCall<double>&);

}  // namespace loom::moe
