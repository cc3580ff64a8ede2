// The MoE layer on CUDA (moe_cuda.hpp): the gate, the routing (routing_cuda.cu), gather,
// experts, combine, PR-MoE and every adjoint on the device. The host gets the O(E) counts that
// size the exchange and the expert GEMMs, once per call.
#include <algorithm>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <loom/moe/moe_cuda.hpp>
#include <loom/moe/moe_math.hpp>
#include "common/float16_io_cuda.cuh"
#include "cuda_util.cuh"
#include "layer_layout.hpp"

namespace loom::moe::cuda {
namespace {

using detail::carve_saved;
using detail::carve_work;
using detail::kSavedMagic;
using detail::SavedHeader;

void need(bool ok, const std::string& what) {
  if (!ok) throw loom::sdk::Error(LOOM_ERR_INVALID_ARGUMENT, "moe: " + what);
}

void check_sizes(const LayerConfig& cfg, int64_t S, int64_t R, uint64_t sbytes, uint64_t wbytes) {
  need(S >= 0 && S <= cfg.max_tokens, "tokens " + std::to_string(S) +
                                          " outside [0, the plan's tokens " +
                                          std::to_string(cfg.max_tokens) + "]");
  const uint64_t ns = carve_saved<float>(cfg, S, R, nullptr).bytes;
  const uint64_t nw = carve_work<float>(cfg, S, R, nullptr).bytes;
  need(sbytes >= ns,
       "saved holds " + std::to_string(sbytes) + " bytes, the call needs " + std::to_string(ns));
  need(wbytes >= nw, "workspace holds " + std::to_string(wbytes) + " bytes, the call needs " +
                         std::to_string(nw));
}

template <class T>
void to_host(std::vector<T>& dst, const T* src, int64_t n, cudaStream_t st) {
  dst.resize(static_cast<size_t>(n));
  if (n > 0) {
    LOOM_MOE_CUDA(cudaMemcpyAsync(dst.data(), src, static_cast<size_t>(n) * sizeof(T),
                                  cudaMemcpyDeviceToHost, st));
  }
}

template <class T>
void to_device(T* dst, const T* src, int64_t n, cudaStream_t st) {
  if (n > 0) {
    LOOM_MOE_CUDA(
        cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * sizeof(T), cudaMemcpyHostToDevice, st));
  }
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

// PR-MoE's coefficient: c = softmax(x . coef_w^T + coef_b); y = c0 * a + c1 * b.
__global__ void coef_forward_kernel(const float* x, const float* cw, const float* cb,
                                    const float* a, const float* b, float* coef, float* y,
                                    int64_t S, int64_t M) {
  for (int64_t s = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; s < S;
       s += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float* xs = x + s * M;
    float z[2];
    for (int i = 0; i < 2; ++i) {
      float acc = 0.0f;
      for (int64_t m = 0; m < M; ++m) acc = acc + xs[m] * cw[i * M + m];
      z[i] = acc + cb[i];
    }
    const float mx = z[0] > z[1] ? z[0] : z[1];
    const float e0 = exp_fixed(z[0] - mx), e1 = exp_fixed(z[1] - mx);
    const float c0 = e0 / (e0 + e1), c1 = e1 / (e0 + e1);
    coef[s * 2] = c0;
    coef[s * 2 + 1] = c1;
    for (int64_t m = 0; m < M; ++m) y[s * M + m] = c0 * a[s * M + m] + c1 * b[s * M + m];
  }
}

__global__ void residual_prep_kernel(const float* dy, const float* coef, const float* a,
                                     const float* b, float* dmoe, float* dmlp, float* dz, int64_t S,
                                     int64_t M) {
  for (int64_t s = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; s < S;
       s += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float c0 = coef[s * 2], c1 = coef[s * 2 + 1];
    float dc0 = 0.0f, dc1 = 0.0f;
    for (int64_t m = 0; m < M; ++m) {
      const float d = dy[s * M + m];
      dmoe[s * M + m] = c0 * d;
      dmlp[s * M + m] = c1 * d;
      dc0 += d * a[s * M + m];
      dc1 += d * b[s * M + m];
    }
    const float dot = c0 * dc0 + c1 * dc1;
    dz[s * 2] = c0 * (dc0 - dot);
    dz[s * 2 + 1] = c1 * (dc1 - dot);
  }
}

__global__ void residual_dx_kernel(float* dx, const float* dres, const float* dz, const float* cw,
                                   int64_t S, int64_t M) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < S * M;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t s = i / M, m = i % M;
    dx[i] += dres[i] + dz[s * 2] * cw[m] + dz[s * 2 + 1] * cw[M + m];
  }
}

// dcoef_w[i, m] += sum_s dz[s, i] x[s, m]; dcoef_b[i] += sum_s dz[s, i] (index M)
__global__ void coef_grad_kernel(const float* x, const float* dz, float* gw, float* gb, int64_t S,
                                 int64_t M) {
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < 2 * (M + 1);
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = t / (M + 1), m = t % (M + 1);
    float acc = m < M ? gw[i * M + m] : gb[i];
    for (int64_t s = 0; s < S; ++s) acc += dz[s * 2 + i] * (m < M ? x[s * M + m] : 1.0f);
    if (m < M) {
      gw[i * M + m] = acc;
    } else {
      gb[i] = acc;
    }
  }
}

}  // namespace

void layer_forward(const LayerConfig& cfg, Exchange& ex, const ForwardCall<float>& call,
                   LayerStats& stats, const Device& dev) {
  const int64_t S = call.tokens;
  const loom::sdk::CudaDeviceGuard guard(dev.device);
  const cudaStream_t st = as_stream(dev.stream);
  const int E = cfg.gate.num_experts;
  const int k = cfg.gate.k;
  const int64_t M = cfg.model_dim, H = cfg.hidden_dim;
  const DLDevice where{kDLCUDA, dev.device};
  auto sv = carve_saved<float>(cfg, S, 0, call.saved);
  auto wv = carve_work<float>(cfg, S, 0, call.workspace);

  RouteSummary routed;
  std::vector<float> bias;
  std::vector<int64_t> send_counts(static_cast<size_t>(E), 0);
  int64_t capacity = 0;
  // Local checks and routing; a rank that fails them still takes part in the counts
  // exchange (sending nothing) and in the agreement after it, so the expert-parallel group
  // stops together instead of waiting in the row exchange.
  std::string error;
  int64_t status = 0;
  try {
    check_sizes(cfg, S, 0, call.saved_bytes, call.workspace_bytes);
    gate_probs(cfg.gate, call.x, S, M, call.w.gate_w, sv.probs, dev.stream);
    capacity = expert_capacity(cfg.gate, S);
    const bool update_bias =
        cfg.gate.training && cfg.bias_update_rate > 0.0 && call.expert_bias != nullptr;
    if (update_bias) to_host(bias, call.expert_bias, E, st);  // read before the wait below
    route_on_device(cfg.gate, sv.probs, S, call.expert_bias, capacity,
                    RouteBuffers{sv.choice, sv.route, sv.weights, sv.slot}, wv.route_scratch,
                    routed, dev.stream);
    send_counts = routed.send_counts;
    reserve_experts(dev, cfg.local_experts);  // no allocation between the exchanges
  } catch (const std::exception& e) {
    error = e.what();
    status = -1;
    std::fill(send_counts.begin(), send_counts.end(), 0);
  }
  const Exchange::Plan plan = ex.plan(send_counts.data(), E);
  if (status == 0) {
    const uint64_t ns = carve_saved<float>(cfg, S, plan.recv_rows, nullptr).bytes;
    const uint64_t nw = carve_work<float>(cfg, S, plan.recv_rows, nullptr).bytes;
    const int64_t short_s = ns > call.saved_bytes ? static_cast<int64_t>(ns - call.saved_bytes) : 0;
    const int64_t short_w =
        nw > call.workspace_bytes ? static_cast<int64_t>(nw - call.workspace_bytes) : 0;
    status = std::max(short_s, short_w);
    if (status > 0) {
      try {
        check_sizes(cfg, S, plan.recv_rows, call.saved_bytes, call.workspace_bytes);
      } catch (const std::exception& e) {
        error = e.what();
      }
    }
  }
  const std::string stop = ex.agree_ep(status, error, "bytes of saved or workspace");
  if (!stop.empty()) throw loom::sdk::Error(LOOM_ERR_INVALID_ARGUMENT, stop);
  if (cfg.gate.training && cfg.bias_update_rate > 0.0 && call.expert_bias != nullptr) {
    // The load over every rank (the data-parallel copies too), so each copy's bias moves alike.
    std::vector<int64_t> total = routed.load;
    ex.sum_world(total.data(), E);
    update_expert_bias(bias.data(), total.data(), E, cfg.bias_update_rate);
    to_device(call.expert_bias, bias.data(), E, st);
  }
  sv = carve_saved<float>(cfg, S, plan.recv_rows, call.saved);
  wv = carve_work<float>(cfg, S, plan.recv_rows, call.workspace);
  to_device(sv.send_counts, send_counts.data(), E, st);
  to_device(sv.recv_counts, plan.recv_counts.data(), E, st);

  gather_rows(call.x, S, M, k, sv.slot, nullptr, wv.rows_send, dev.stream);
  const auto row_bytes = static_cast<int64_t>(M * sizeof(float));
  ex.forward(plan, wv.rows_send, sv.expert_in, row_bytes, where, dev.stream);
  const std::vector<int64_t> rows = local_rows(cfg, plan.recv_counts.data());
  experts_forward(cfg.activation, cfg.local_experts, rows.data(), M, H, sv.expert_in,
                  call.w.experts, sv.expert_pre, wv.h, wv.recv_a, dev);
  ex.reverse(plan, wv.recv_a, sv.out_send, row_bytes, where, dev.stream);
  float* moe_y = cfg.residual ? sv.moe_out : call.y;
  combine_rows(sv.out_send, S, M, k, sv.slot, sv.weights, moe_y, false, dev.stream);
  if (cfg.residual && S > 0) {
    const int64_t n = S;
    experts_forward(cfg.activation, 1, &n, M, H, call.x, call.w.residual, sv.mlp_pre, wv.h2,
                    sv.mlp_out, dev);
    coef_forward_kernel<<<blocks_for(S), kThreads, 0, st>>>(
        call.x, call.w.coef_w, call.w.coef_b, sv.moe_out, sv.mlp_out, sv.coef, call.y, S, M);
    check_launch("coef_forward");
  }
  if (call.route_experts != nullptr && S > 0) {
    LOOM_MOE_CUDA(cudaMemcpyAsync(call.route_experts, sv.route,
                                  static_cast<size_t>(S * k) * sizeof(int32_t),
                                  cudaMemcpyDeviceToDevice, st));
  }
  if (call.route_weights != nullptr && S > 0) {
    LOOM_MOE_CUDA(cudaMemcpyAsync(call.route_weights, sv.weights,
                                  static_cast<size_t>(S * k) * sizeof(float),
                                  cudaMemcpyDeviceToDevice, st));
  }
  const SavedHeader hdr =
      detail::make_header(cfg, S, routed.send_rows, plan.recv_rows, capacity, sizeof(float));
  to_device(sv.hdr, &hdr, 1, st);
  LOOM_MOE_CUDA(cudaStreamSynchronize(st));
  stats.aux_loss = routed.aux_loss;
  stats.dropped = routed.dropped;
  stats.expert_rows = plan.recv_rows;
  stats.capacity = capacity;
  if (stats.load != nullptr) std::copy(routed.load.begin(), routed.load.end(), stats.load);
}

void layer_backward(const LayerConfig& cfg, Exchange& ex, const BackwardCall<float>& call,
                    const Device& dev) {
  const int64_t S = call.tokens;
  const loom::sdk::CudaDeviceGuard guard(dev.device);
  const cudaStream_t st = as_stream(dev.stream);
  const int E = cfg.gate.num_experts;
  const int k = cfg.gate.k;
  const int64_t M = cfg.model_dim, H = cfg.hidden_dim;
  const DLDevice where{kDLCUDA, dev.device};
  // Local checks, then one agreement over the expert-parallel group before its row exchange.
  std::string error;
  int64_t R = 0;
  Exchange::Plan plan;
  plan.num_experts = E;
  plan.local_experts = cfg.local_experts;
  plan.ep = cfg.ep_size;
  try {
    check_sizes(cfg, S, 0, call.saved_bytes, call.workspace_bytes);
    // The header and the forward's counts (their place depends on S only) in one wait.
    std::vector<SavedHeader> hdr;
    to_host(hdr, static_cast<const SavedHeader*>(call.saved), 1, st);
    const auto sv0 = carve_saved<float>(cfg, S, 0, const_cast<void*>(call.saved));
    to_host(plan.send_counts, sv0.send_counts, E, st);
    to_host(plan.recv_counts, sv0.recv_counts, E, st);
    LOOM_MOE_CUDA(cudaStreamSynchronize(st));
    need(hdr[0].magic == kSavedMagic && hdr[0].elem == sizeof(float),
         "saved was not written by this layer's forward");
    need(hdr[0].tokens == S, "backward's tokens (" + std::to_string(S) +
                                 ") differ from its forward's (" + std::to_string(hdr[0].tokens) +
                                 ")");
    const std::string layout = detail::check_layout(cfg, hdr[0]);
    need(layout.empty(), layout);
    R = hdr[0].recv_rows;
    check_sizes(cfg, S, R, call.saved_bytes, call.workspace_bytes);
    reserve_experts(dev, cfg.local_experts);  // no allocation between the exchanges
  } catch (const std::exception& e) {
    error = e.what();
  }
  const std::string stop = ex.agree_ep(error.empty() ? 0 : -1, error, "bytes");
  if (!stop.empty()) throw loom::sdk::Error(LOOM_ERR_INVALID_ARGUMENT, stop);
  const auto sv = carve_saved<float>(cfg, S, R, const_cast<void*>(call.saved));
  auto wv = carve_work<float>(cfg, S, R, call.workspace);

  const float* dmoe = call.dy;
  if (cfg.residual && S > 0) {
    residual_prep_kernel<<<blocks_for(S), kThreads, 0, st>>>(
        call.dy, sv.coef, sv.moe_out, sv.mlp_out, wv.dmoe, wv.dmlp, wv.dz, S, M);
    check_launch("residual_prep");
    dmoe = wv.dmoe;
  }
  combine_weight_grad(sv.out_send, dmoe, S, M, k, sv.slot, wv.dweights, dev.stream);
  gather_rows(dmoe, S, M, k, sv.slot, sv.weights, wv.rows_send, dev.stream);
  plan.recv_rows = R;
  const auto row_bytes = static_cast<int64_t>(M * sizeof(float));
  ex.forward(plan, wv.rows_send, wv.recv_a, row_bytes, where, dev.stream);
  const std::vector<int64_t> rows = local_rows(cfg, plan.recv_counts.data());
  experts_backward(cfg.activation, cfg.local_experts, rows.data(), M, H, sv.expert_in,
                   sv.expert_pre, wv.recv_a, call.w.experts, call.g.experts, wv.h, wv.dh, wv.recv_b,
                   dev);
  ex.reverse(plan, wv.recv_b, wv.rows_send, row_bytes, where, dev.stream);
  combine_rows(wv.rows_send, S, M, k, sv.slot, nullptr, call.dx, false, dev.stream);

  gate_dlogits(cfg.gate, S, sv.probs, sv.choice, sv.route, wv.dweights, call.aux_loss_coef,
               wv.dlogits, wv.route_scratch, dev.stream);
  gate_input_grads(cfg.gate, call.x, S, M, call.w.gate_w, wv.dlogits, call.dx, call.g.gate_w,
                   dev.stream);
  if (cfg.residual && S > 0) {
    const int64_t n = S;
    experts_backward(cfg.activation, 1, &n, M, H, call.x, sv.mlp_pre, wv.dmlp, call.w.residual,
                     call.g.residual, wv.h2, wv.dh2, wv.dres, dev);
    residual_dx_kernel<<<blocks_for(S * M), kThreads, 0, st>>>(call.dx, wv.dres, wv.dz,
                                                               call.w.coef_w, S, M);
    check_launch("residual_dx");
    coef_grad_kernel<<<blocks_for(2 * (M + 1)), kThreads, 0, st>>>(call.x, wv.dz, call.g.coef_w,
                                                                   call.g.coef_b, S, M);
    check_launch("coef_grad");
  }
  LOOM_MOE_CUDA(cudaStreamSynchronize(st));
}

namespace {

struct AloneRouting {
  std::unique_ptr<loom::sdk::CudaScratch> slot;  // [S k] slots, then alone_slots' scratch
  std::unique_ptr<loom::sdk::CudaScratch> send;  // the rows this rank sends
  Exchange::Plan plan;
};

// The slots of a caller's routing, built on the device; the buffers are allocated here,
// before the counts exchange, so that a failure stops every rank of the group together.
AloneRouting alone_routing(Exchange& ex, int E, int k, int64_t S, int64_t model_dim,
                           const int32_t* route_experts, int64_t row_capacity, cudaStream_t st) {
  AloneRouting r;
  std::vector<int64_t> counts(static_cast<size_t>(E), 0);
  std::string error;
  int64_t status = 0;
  try {
    const int64_t pairs = std::max<int64_t>(S * k, 1);
    r.slot = std::make_unique<loom::sdk::CudaScratch>(
        static_cast<size_t>(pairs + 2 * E + 1) * sizeof(int64_t), st);
    int64_t* slot = r.slot->as<int64_t>();
    const AloneSlots a = alone_slots(route_experts, S, k, E, slot, slot + pairs, st);
    if (a.bad_pair >= 0) {
      error = "moe: route_experts[" + std::to_string(a.bad_pair / k) + ", " +
              std::to_string(a.bad_pair % k) + "] = " + std::to_string(a.bad_value) +
              " is outside [-1, " + std::to_string(E) + ")";
      status = -1;
    } else {
      r.send = std::make_unique<loom::sdk::CudaScratch>(
          static_cast<size_t>(std::max<int64_t>(a.send_rows, 1) * model_dim) * sizeof(float), st);
      counts = a.counts;
    }
  } catch (const std::exception& e) {
    error = e.what();
    status = -1;
  }
  if (status != 0) std::fill(counts.begin(), counts.end(), 0);
  // A bad route or too few rows on one rank stops every rank of the group together (after
  // the counts exchange, before the rows').
  r.plan = ex.plan(counts.data(), E);
  if (status == 0 && r.plan.recv_rows > row_capacity) {
    status = r.plan.recv_rows - row_capacity;
    error = "moe: rows has " + std::to_string(row_capacity) + " rows but the routing sends " +
            std::to_string(r.plan.recv_rows) +
            " to this rank's experts (size it by the plan's max_expert_rows)";
  }
  const std::string stop = ex.agree_ep(status, error, "rows");
  if (!stop.empty()) throw loom::sdk::Error(LOOM_ERR_INVALID_ARGUMENT, stop);
  return r;
}

}  // namespace

void dispatch_alone(Exchange& ex, int num_experts, int k, int64_t tokens, int64_t model_dim,
                    const float* x, const int32_t* route_experts, const float* route_weights,
                    float* rows, int64_t row_capacity, int64_t* local_counts, const Device& dev) {
  const loom::sdk::CudaDeviceGuard guard(dev.device);
  const cudaStream_t st = as_stream(dev.stream);
  const AloneRouting r =
      alone_routing(ex, num_experts, k, tokens, model_dim, route_experts, row_capacity, st);
  gather_rows(x, tokens, model_dim, k, r.slot->as<const int64_t>(), route_weights,
              r.send->as<float>(), dev.stream);
  ex.forward(r.plan, r.send->as<void>(), rows, model_dim * static_cast<int64_t>(sizeof(float)),
             DLDevice{kDLCUDA, dev.device}, dev.stream);
  for (int le = 0; le < r.plan.local_experts; ++le) {
    int64_t n = 0;
    for (int src = 0; src < r.plan.ep; ++src) {
      n += r.plan.recv_counts[static_cast<size_t>(le * r.plan.ep + src)];
    }
    local_counts[le] = n;
  }
  LOOM_MOE_CUDA(cudaStreamSynchronize(st));
}

void combine_alone(Exchange& ex, int num_experts, int k, int64_t tokens, int64_t model_dim,
                   const float* rows, int64_t row_capacity, const int32_t* route_experts,
                   const float* route_weights, float* y, const Device& dev) {
  const loom::sdk::CudaDeviceGuard guard(dev.device);
  const cudaStream_t st = as_stream(dev.stream);
  const AloneRouting r =
      alone_routing(ex, num_experts, k, tokens, model_dim, route_experts, row_capacity, st);
  ex.reverse(r.plan, rows, r.send->as<void>(), model_dim * static_cast<int64_t>(sizeof(float)),
             DLDevice{kDLCUDA, dev.device}, dev.stream);
  combine_rows(r.send->as<const float>(), tokens, model_dim, k, r.slot->as<const int64_t>(),
               route_weights, y, false, dev.stream);
  LOOM_MOE_CUDA(cudaStreamSynchronize(st));
}

void widen_floats(int device, const void* src, loom::plugins::float16::Storage s, float* dst,
                  int64_t n, void* stream) {
  if (n <= 0) return;
  loom::sdk::CudaDeviceGuard guard(device);
  namespace f16 = loom::plugins::float16;
  f16::widen_kernel<<<f16::grid_for(n), 256, 0, as_stream(stream)>>>(src, static_cast<int>(s), dst,
                                                                     n);
  check_launch("widen_kernel");
}

void narrow_floats(int device, const float* src, loom::plugins::float16::Storage s, void* dst,
                   int64_t n, void* stream) {
  if (n <= 0) return;
  loom::sdk::CudaDeviceGuard guard(device);
  namespace f16 = loom::plugins::float16;
  f16::narrow_kernel<<<f16::grid_for(n), 256, 0, as_stream(stream)>>>(src, static_cast<int>(s), dst,
                                                                      n);
  check_launch("narrow_kernel");
}

}  // namespace loom::moe::cuda
