// The layout of the MoE layer's `saved` and workspace buffers, shared by the host layer
// (layer.cpp) and the CUDA one (layer_cuda.cu). Internal to plugins/moe/core.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include <loom/moe/layer.hpp>
#include <loom/moe/moe_cuda.hpp>  // route_scratch_words

namespace loom::moe::detail {

constexpr uint64_t kSavedMagic = 0x4C4F4F4D4D4F4531ull;  // "LOOMMOE1"

// `saved` records the layout and the routing inputs of the forward that wrote it; backward
// refuses a configuration that differs (check_layout).
struct SavedHeader {
  uint64_t magic;
  int64_t tokens;
  int64_t send_rows;
  int64_t recv_rows;
  int64_t capacity;
  uint64_t elem;
  int64_t num_experts;
  int64_t k;
  int64_t model_dim;
  int64_t hidden_dim;
  int64_t residual;
  int64_t ep_size;
  int64_t ep_rank;
  int64_t layer;
  uint64_t seed;
  int64_t step;
  int64_t first_token;
  int64_t training;
};

inline SavedHeader make_header(const LayerConfig& cfg, int64_t tokens, int64_t send_rows,
                               int64_t recv_rows, int64_t capacity, uint64_t elem) {
  return SavedHeader{kSavedMagic,
                     tokens,
                     send_rows,
                     recv_rows,
                     capacity,
                     elem,
                     cfg.gate.num_experts,
                     cfg.gate.k,
                     cfg.model_dim,
                     cfg.hidden_dim,
                     cfg.residual ? 1 : 0,
                     cfg.ep_size,
                     cfg.ep_rank,
                     cfg.gate.layer,
                     cfg.gate.seed,
                     cfg.gate.step,
                     cfg.gate.first_token,
                     cfg.gate.training ? 1 : 0};
}

// "" when `saved` was written by a forward of this configuration, else which field differs.
inline std::string check_layout(const LayerConfig& cfg, const SavedHeader& h) {
  const SavedHeader want = make_header(cfg, h.tokens, 0, 0, 0, h.elem);
  auto diff = [](const char* name, auto got, auto forward) {
    return "backward's " + std::string(name) + " (" + std::to_string(got) +
           ") differs from the forward's that wrote saved (" + std::to_string(forward) + ")";
  };
  if (h.num_experts != want.num_experts)
    return diff("num_experts", want.num_experts, h.num_experts);
  if (h.k != want.k) return diff("k", want.k, h.k);
  if (h.model_dim != want.model_dim) return diff("model_dim", want.model_dim, h.model_dim);
  if (h.hidden_dim != want.hidden_dim) return diff("hidden_dim", want.hidden_dim, h.hidden_dim);
  if (h.residual != want.residual) return diff("use_residual", want.residual, h.residual);
  if (h.ep_size != want.ep_size) return diff("ep_size", want.ep_size, h.ep_size);
  if (h.ep_rank != want.ep_rank) return diff("ep_rank", want.ep_rank, h.ep_rank);
  if (h.layer != want.layer) return diff("layer", want.layer, h.layer);
  if (h.seed != want.seed) return diff("seed", want.seed, h.seed);
  if (h.step != want.step) return diff("step", want.step, h.step);
  if (h.first_token != want.first_token)
    return diff("first_token", want.first_token, h.first_token);
  if (h.training != want.training) return diff("training", want.training, h.training);
  return "";
}

// Carves 256-byte aligned regions out of a buffer (or only counts them when base is null).
struct Carver {
  char* base;
  uint64_t off = 0;
  template <class U>
  U* take(int64_t n) {
    off = (off + 255u) & ~uint64_t{255u};
    U* p = base == nullptr ? nullptr : reinterpret_cast<U*>(base + off);
    off += static_cast<uint64_t>(std::max<int64_t>(n, 0)) * sizeof(U);
    return p;
  }
};

template <class T>
struct SavedView {
  SavedHeader* hdr;
  T* probs;
  int32_t* choice;
  int32_t* route;
  T* weights;
  int64_t* slot;
  int64_t* send_counts;
  int64_t* recv_counts;
  T* expert_in;
  T* expert_pre;
  T* out_send;
  T* moe_out;
  T* mlp_pre;
  T* mlp_out;
  T* coef;
  uint64_t bytes;
};

template <class T>
struct WorkView {
  T* rows_send;
  T* recv_a;
  T* recv_b;
  T* h;
  T* dh;
  T* dweights;
  T* dlogits;
  T* h2;
  T* dh2;
  T* dmlp;
  T* dmoe;
  T* dres;
  T* dz;
  int64_t* route_scratch;  // the CUDA routing's (moe_cuda.hpp); the host layer leaves it unused
  uint64_t bytes;
};

inline int64_t num_experts(const LayerConfig& cfg) { return cfg.gate.num_experts; }

// `saved` and the workspace hold regions sized by the call's tokens S first, then those sized
// by the rows R this rank's experts received (known only after the exchange's counts), so
// backward finds everything from S and the R recorded in the header.
template <class T>
SavedView<T> carve_saved(const LayerConfig& cfg, int64_t S, int64_t R, void* base) {
  Carver c{static_cast<char*>(base)};
  const int64_t E = num_experts(cfg), k = cfg.gate.k;
  const int64_t M = cfg.model_dim, H = cfg.hidden_dim;
  const int64_t res = cfg.residual ? 1 : 0;
  SavedView<T> v{};
  v.hdr = c.take<SavedHeader>(1);
  v.probs = c.take<T>(S * E);
  v.choice = c.take<int32_t>(S * k);
  v.route = c.take<int32_t>(S * k);
  v.weights = c.take<T>(S * k);
  v.slot = c.take<int64_t>(S * k);
  v.send_counts = c.take<int64_t>(E);
  v.recv_counts = c.take<int64_t>(E);
  v.out_send = c.take<T>(S * k * M);
  v.moe_out = c.take<T>(res * S * M);
  v.mlp_pre = c.take<T>(res * S * H);
  v.mlp_out = c.take<T>(res * S * M);
  v.coef = c.take<T>(res * S * 2);
  v.expert_in = c.take<T>(R * M);
  v.expert_pre = c.take<T>(R * H);
  v.bytes = (c.off + 255u) & ~uint64_t{255u};
  return v;
}

template <class T>
WorkView<T> carve_work(const LayerConfig& cfg, int64_t S, int64_t R, void* base) {
  Carver c{static_cast<char*>(base)};
  const int64_t E = num_experts(cfg), k = cfg.gate.k;
  const int64_t M = cfg.model_dim, H = cfg.hidden_dim;
  const int64_t res = cfg.residual ? 1 : 0;
  WorkView<T> v{};
  v.rows_send = c.take<T>(S * k * M);
  v.dweights = c.take<T>(S * k);
  v.dlogits = c.take<T>(S * E);
  v.h2 = c.take<T>(res * S * H);
  v.dh2 = c.take<T>(res * S * H);
  v.dmlp = c.take<T>(res * S * M);
  v.dmoe = c.take<T>(res * S * M);
  v.dres = c.take<T>(res * S * M);
  v.dz = c.take<T>(res * S * 2);
  v.route_scratch = c.take<int64_t>(cuda::route_scratch_words(cfg.gate.num_experts, cfg.gate.k, S));
  v.recv_a = c.take<T>(R * M);
  v.recv_b = c.take<T>(R * M);
  v.h = c.take<T>(R * H);
  v.dh = c.take<T>(R * H);
  v.bytes = (c.off + 255u) & ~uint64_t{255u};
  return v;
}

}  // namespace loom::moe::detail
