// The GPT-2 style model, templated over the scalar type: Model (model.hpp) is Gpt<float>;
// the tests also build Gpt<double> to check the whole model's gradients against finite
// differences in double precision.
//
// Structure: Gpt = encoder (wte + wpe) -> Block x layers -> final LayerNorm -> logits through
// the tied head (lnf_out * wte^T) -> softmax cross-entropy. Each Block is
//   x_mid = x + proj(attention(qkv(ln1(x))));   y = x_mid + mlp(ln2(x_mid))
// and keeps its own activations for backward.
//
// Seams:
//  - MoE: a Block's MLP is a MlpT<T> (position-wise over rows). Gpt::replace_mlp swaps it, e.g.
//    for an MoE layer plugin; the block only calls mlp->forward/backward on its ln2 rows.
//  - Token drop: Block::forward/backward take any [B, T', C] activations. Gpt::set_router
//    installs a RouterHookT (router_hook.hpp) that the forward and backward consult for every
//    layer: a routed layer gathers the kept rows of each sequence, calls the block on them
//    (the causal mask then applies among the kept positions, in order), and scatters the
//    block's output back over the kept rows; the dropped rows pass through unchanged, and in
//    backward their gradient passes through unchanged too. A learned (gated) router scales
//    each kept token's update by its gate and owns a weight "h.L.router.w" per gated layer.
//  - Linear layers (linear_hook.hpp): Gpt::set_linear_hook installs a hook that evaluation
//    forwards call for the blocks' weight matmuls (qkv, attention proj, MLP fc and proj) and
//    the tied head it takes, e.g. a quantizer's matmul on packed codes.
//  - Distillation (linear_hook.hpp): Gpt::set_distillation adds a teacher's soft targets and
//    hidden states to a training forward's loss and their gradients to its backward.
//  - bf16 (Gpt<float>::set_bf16): parameters() are then fp32 master weights the forward
//    never reads; every forward first rounds them to bf16 into the weights the blocks hold,
//    and rounds each activation a layer writes (see set_bf16).
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <numbers>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "bf16.hpp"
#include "layers.hpp"
#include "linear_hook.hpp"
#include "model.hpp"
#include "router_hook.hpp"

namespace loom::trainer {

template <typename T>
struct ParamRef {
  std::string name;
  std::vector<int64_t> shape;
  T* value;
  T* grad;
  size_t numel;
};

// bf16 mode: rounds the n activations at p to bf16 in place (a no-op when off, and for any
// scalar type but float: only Gpt<float> has a bf16 mode).
template <typename T>
void round_activations(bool on, T* p, size_t n) {
  if constexpr (std::is_same_v<T, float>) {
    if (!on) return;
    layers::parallel_for(n, 4096, [&](size_t lo, size_t hi) { round_bf16_span(p + lo, hi - lo); });
  } else {
    (void)on, (void)p, (void)n;
  }
}

// A position-wise layer over rows of C features (the MLP slot of a Block).
template <typename T>
class MlpT {
 public:
  virtual ~MlpT() = default;
  virtual void forward(const T* x, T* y, int rows) = 0;                 // writes y
  virtual void backward(const T* x, const T* dy, T* dx, int rows) = 0;  // adds into dx
  virtual std::vector<ParamRef<T>> parameters() = 0;
  virtual double flops_per_token() const = 0;
  // Told before every model forward whether it is a training one (an MoE layer then uses its
  // training capacity and noise); a dense MLP ignores it.
  virtual void set_training(bool) {}
};

// fc (C -> 4C) + GELU + proj (4C -> C).
template <typename T>
class DenseMlp final : public MlpT<T> {
 public:
  DenseMlp(int C, ParamRef<T> fc_w, ParamRef<T> fc_b, ParamRef<T> proj_w, ParamRef<T> proj_b)
      : C_(C),
        fc_w_(std::move(fc_w)),
        fc_b_(std::move(fc_b)),
        proj_w_(std::move(proj_w)),
        proj_b_(std::move(proj_b)) {}

  void forward(const T* x, T* y, int rows) override {
    const size_t n = static_cast<size_t>(rows) * 4 * C_;
    if (h_.size() < n) {
      h_.resize(n);
      g_.resize(n);
      dg_.resize(n);
    }
    linear(LinearSlot::kMlpFc, h_.data(), x, fc_w_, fc_b_, rows, C_, 4 * C_);
    round_activations(bf16_, h_.data(), n);
    layers::gelu_forward(g_.data(), h_.data(), n);
    round_activations(bf16_, g_.data(), n);
    linear(LinearSlot::kMlpProj, y, g_.data(), proj_w_, proj_b_, rows, 4 * C_, C_);
  }

  // bf16 mode: the activations it keeps for backward (h, gelu(h)) are rounded to bf16.
  void set_bf16(bool on) { bf16_ = on; }

  // The linear hook the next forward uses (nullptr: the float sgemm) and the layer it is.
  void set_linear(LinearHookT<T>* hook, int layer) {
    hook_ = hook;
    layer_ = layer;
  }

  void backward(const T* x, const T* dy, T* dx, int rows) override {
    const size_t n = static_cast<size_t>(rows) * 4 * C_;
    std::fill(dg_.begin(), dg_.begin() + static_cast<std::ptrdiff_t>(n), T(0));
    layers::matmul_backward(dg_.data(), proj_w_.grad, proj_b_.grad, dy, g_.data(), proj_w_.value,
                            rows, 4 * C_, C_);
    // dh overwrites g (no longer needed): dh = gelu'(h) * dg
    std::fill(g_.begin(), g_.begin() + static_cast<std::ptrdiff_t>(n), T(0));
    layers::gelu_backward(g_.data(), h_.data(), dg_.data(), n);
    layers::matmul_backward(dx, fc_w_.grad, fc_b_.grad, g_.data(), x, fc_w_.value, rows, C_,
                            4 * C_);
  }

  std::vector<ParamRef<T>> parameters() override { return {fc_w_, fc_b_, proj_w_, proj_b_}; }
  double flops_per_token() const override { return 6.0 * 8.0 * C_ * static_cast<double>(C_); }

 private:
  void linear(LinearSlot s, T* y, const T* x, const ParamRef<T>& w, const ParamRef<T>& b, int rows,
              int in, int out) {
    if (hook_ != nullptr && hook_->handles(layer_, s)) {
      hook_->forward(layer_, s, x, y, rows, in, out, b.value);
    } else {
      layers::matmul_forward(y, x, w.value, b.value, rows, in, out);
    }
  }

  int C_;
  ParamRef<T> fc_w_, fc_b_, proj_w_, proj_b_;
  std::vector<T> h_, g_, dg_;  // pre-activation, GELU output (dh in backward), dg
  LinearHookT<T>* hook_ = nullptr;
  int layer_ = 0;
  bool bf16_ = false;
};

template <typename T>
struct BlockParams {
  ParamRef<T> ln1_w, ln1_b, qkv_w, qkv_b, proj_w, proj_b, ln2_w, ln2_b;
};

// Scratch shared by all blocks during backward.
template <typename T>
struct BlockScratch {
  std::vector<T> dmid, dln, datty, dqkv, datt;
  void reserve(size_t N, int C, int NH, size_t B, size_t Tn) {
    const size_t nc = N * C;
    if (dmid.size() < nc) {
      dmid.resize(nc);
      dln.resize(nc);
      datty.resize(nc);
      dqkv.resize(3 * nc);
    }
    if (datt.size() < B * NH * Tn * Tn) datt.resize(B * NH * Tn * Tn);
  }
};

template <typename T>
class Block {
 public:
  Block(int C, int NH, BlockParams<T> p, std::unique_ptr<MlpT<T>> mlp)
      : C_(C), NH_(NH), p_(std::move(p)), mlp_(std::move(mlp)) {}

  MlpT<T>& mlp() { return *mlp_; }
  void set_mlp(std::unique_ptr<MlpT<T>> mlp) { mlp_ = std::move(mlp); }
  const BlockParams<T>& params() const { return p_; }

  // The linear hook the next forward uses (nullptr: the float sgemm), as layer `layer`; a
  // dense MLP gets it too (a replaced one does not).
  void set_linear(LinearHookT<T>* hook, int layer) {
    hook_ = hook;
    layer_ = layer;
    if (auto* d = dynamic_cast<DenseMlp<T>*>(mlp_.get())) d->set_linear(hook, layer);
  }

  // bf16 mode: every activation the block writes (the LayerNorms' outputs, qkv, the attention
  // output, the matmuls' outputs, x_mid, y; a dense MLP's h and gelu(h)) is rounded to bf16.
  // The attention probabilities and the LayerNorm statistics stay fp32.
  void set_bf16(bool on) {
    bf16_ = on;
    if (auto* d = dynamic_cast<DenseMlp<T>*>(mlp_.get())) d->set_bf16(on);
  }

  // x, y: [B, Tn, C] (y != x). Keeps x's address: x must stay unchanged until backward.
  void forward(const T* x, T* y, int B, int Tn) {
    const size_t N = static_cast<size_t>(B) * Tn;
    const size_t nc = N * C_;
    if (ln1_.size() < nc) {
      ln1_.resize(nc);
      ln2_.resize(nc);
      atty_.resize(nc);
      mid_.resize(nc);
      tmp_.resize(nc);
      qkv_.resize(3 * nc);
      stats_.resize(4 * N);
    }
    if (att_.size() < static_cast<size_t>(B) * NH_ * Tn * Tn)
      att_.resize(static_cast<size_t>(B) * NH_ * Tn * Tn);
    x_ = x;
    const int n = static_cast<int>(N);
    T* s = stats_.data();
    layers::layernorm_forward(ln1_.data(), s, s + N, x, p_.ln1_w.value, p_.ln1_b.value, n, C_);
    round_activations(bf16_, ln1_.data(), nc);
    linear(LinearSlot::kQkv, qkv_.data(), ln1_.data(), p_.qkv_w, p_.qkv_b, n, C_, 3 * C_);
    round_activations(bf16_, qkv_.data(), 3 * nc);
    layers::attention_forward(atty_.data(), att_.data(), qkv_.data(), B, Tn, C_, NH_);
    round_activations(bf16_, atty_.data(), nc);
    linear(LinearSlot::kAttnProj, tmp_.data(), atty_.data(), p_.proj_w, p_.proj_b, n, C_, C_);
    round_activations(bf16_, tmp_.data(), nc);
    layers::residual_forward(mid_.data(), x, tmp_.data(), nc);
    round_activations(bf16_, mid_.data(), nc);
    layers::layernorm_forward(ln2_.data(), s + 2 * N, s + 3 * N, mid_.data(), p_.ln2_w.value,
                              p_.ln2_b.value, n, C_);
    round_activations(bf16_, ln2_.data(), nc);
    mlp_->forward(ln2_.data(), tmp_.data(), n);
    round_activations(bf16_, tmp_.data(), nc);
    layers::residual_forward(y, mid_.data(), tmp_.data(), nc);
    round_activations(bf16_, y, nc);
  }

  // dy: gradient of y; writes dx (the gradient of x); adds into the parameter grads.
  void backward(const T* dy, T* dx, int B, int Tn, BlockScratch<T>& sc) {
    const size_t N = static_cast<size_t>(B) * Tn;
    const size_t nc = N * C_;
    const int n = static_cast<int>(N);
    sc.reserve(N, C_, NH_, static_cast<size_t>(B), static_cast<size_t>(Tn));
    const T* s = stats_.data();
    auto zero = [](std::vector<T>& v, size_t count) {
      std::fill(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(count), T(0));
    };
    // y = mid + mlp(ln2(mid))
    std::copy(dy, dy + nc, sc.dmid.begin());
    zero(sc.dln, nc);
    mlp_->backward(ln2_.data(), dy, sc.dln.data(), n);
    layers::layernorm_backward(sc.dmid.data(), p_.ln2_w.grad, p_.ln2_b.grad, sc.dln.data(),
                               mid_.data(), p_.ln2_w.value, s + 2 * N, s + 3 * N, n, C_);
    // mid = x + proj(attention(qkv(ln1(x))))
    zero(sc.datty, nc);
    layers::matmul_backward(sc.datty.data(), p_.proj_w.grad, p_.proj_b.grad, sc.dmid.data(),
                            atty_.data(), p_.proj_w.value, n, C_, C_);
    zero(sc.dqkv, 3 * nc);
    layers::attention_backward(sc.dqkv.data(), sc.datt.data(), sc.datty.data(), qkv_.data(),
                               att_.data(), B, Tn, C_, NH_);
    zero(sc.dln, nc);
    layers::matmul_backward(sc.dln.data(), p_.qkv_w.grad, p_.qkv_b.grad, sc.dqkv.data(),
                            ln1_.data(), p_.qkv_w.value, n, C_, 3 * C_);
    std::copy(sc.dmid.begin(), sc.dmid.begin() + static_cast<std::ptrdiff_t>(nc), dx);
    layers::layernorm_backward(dx, p_.ln1_w.grad, p_.ln1_b.grad, sc.dln.data(), x_, p_.ln1_w.value,
                               s, s + N, n, C_);
  }

 private:
  void linear(LinearSlot s, T* y, const T* x, const ParamRef<T>& w, const ParamRef<T>& b, int rows,
              int in, int out) {
    if (hook_ != nullptr && hook_->handles(layer_, s)) {
      hook_->forward(layer_, s, x, y, rows, in, out, b.value);
    } else {
      layers::matmul_forward(y, x, w.value, b.value, rows, in, out);
    }
  }

  int C_;
  int NH_;
  BlockParams<T> p_;
  std::unique_ptr<MlpT<T>> mlp_;
  LinearHookT<T>* hook_ = nullptr;
  int layer_ = 0;
  bool bf16_ = false;
  const T* x_ = nullptr;
  std::vector<T> ln1_, ln2_, qkv_, att_, atty_, mid_, tmp_, stats_;
};

inline void validate_config(const ModelConfig& c) {
  auto bad = [](const std::string& what) {
    throw std::invalid_argument("loom::trainer::Model: " + what);
  };
  if (c.vocab_size < 1 || c.vocab_size > (1 << 22)) bad("vocab_size must be in [1, 4194304]");
  if (c.context < 1 || c.context > 65536) bad("context must be in [1, 65536]");
  if (c.layers < 1 || c.layers > 1024) bad("layers must be in [1, 1024]");
  if (c.heads < 1 || c.dim < 1 || c.dim > 65536) bad("heads and dim must be positive");
  if (c.dim % c.heads != 0) bad("dim must be divisible by heads");
  const double params = static_cast<double>(c.vocab_size + c.context) * c.dim +
                        static_cast<double>(c.layers) * 12.0 * c.dim * c.dim;
  if (params > 4.0e9) bad("model too large (more than 4e9 parameters)");
}

template <typename T>
class Gpt {
 public:
  Gpt(const ModelConfig& cfg, uint64_t seed) : cfg_(cfg) {
    validate_config(cfg);
    const size_t C = static_cast<size_t>(cfg.dim);
    const size_t V = static_cast<size_t>(cfg.vocab_size);
    const size_t L = static_cast<size_t>(cfg.layers);
    struct Spec {
      std::string name;
      std::vector<int64_t> shape;
      int init;  // 0: zeros, 1: ones, 2: normal 0.02, 3: normal 0.02/sqrt(2L)
    };
    auto i64 = [](size_t v) { return static_cast<int64_t>(v); };
    std::vector<Spec> specs;
    specs.push_back({"wte", {i64(V), i64(C)}, 2});
    specs.push_back({"wpe", {i64(cfg.context), i64(C)}, 2});
    for (size_t l = 0; l < L; ++l) {
      const std::string p = "h." + std::to_string(l) + ".";
      specs.push_back({p + "ln1.w", {i64(C)}, 1});
      specs.push_back({p + "ln1.b", {i64(C)}, 0});
      specs.push_back({p + "attn.qkv.w", {i64(3 * C), i64(C)}, 2});
      specs.push_back({p + "attn.qkv.b", {i64(3 * C)}, 0});
      specs.push_back({p + "attn.proj.w", {i64(C), i64(C)}, 3});
      specs.push_back({p + "attn.proj.b", {i64(C)}, 0});
      specs.push_back({p + "ln2.w", {i64(C)}, 1});
      specs.push_back({p + "ln2.b", {i64(C)}, 0});
      specs.push_back({p + "mlp.fc.w", {i64(4 * C), i64(C)}, 2});
      specs.push_back({p + "mlp.fc.b", {i64(4 * C)}, 0});
      specs.push_back({p + "mlp.proj.w", {i64(C), i64(4 * C)}, 3});
      specs.push_back({p + "mlp.proj.b", {i64(C)}, 0});
    }
    specs.push_back({"lnf.w", {i64(C)}, 1});
    specs.push_back({"lnf.b", {i64(C)}, 0});
    size_t total = 0;
    for (const auto& s : specs) {
      size_t n = 1;
      for (const int64_t d : s.shape) n *= static_cast<size_t>(d);
      total += n;
    }
    values_.assign(total, T(0));
    grads_.assign(total, T(0));
    Rng rng(seed);
    const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(L));
    size_t off = 0;
    std::vector<ParamRef<T>> all;
    for (const auto& s : specs) {
      size_t n = 1;
      for (const int64_t d : s.shape) n *= static_cast<size_t>(d);
      T* v = values_.data() + off;
      for (size_t i = 0; i < n; ++i) {
        switch (s.init) {
          case 1:
            v[i] = T(1);
            break;
          case 2:
            v[i] = static_cast<T>(0.02 * rng.normal());
            break;
          case 3:
            v[i] = static_cast<T>(residual_std * rng.normal());
            break;
          default:
            v[i] = T(0);
            break;
        }
      }
      all.push_back({s.name, s.shape, v, grads_.data() + off, n});
      off += n;
    }
    wte_ = all[0];
    wpe_ = all[1];
    for (size_t l = 0; l < L; ++l) {
      const size_t b = 2 + l * 12;
      BlockParams<T> bp{all[b],     all[b + 1], all[b + 2], all[b + 3],
                        all[b + 4], all[b + 5], all[b + 6], all[b + 7]};
      auto mlp =
          std::make_unique<DenseMlp<T>>(cfg.dim, all[b + 8], all[b + 9], all[b + 10], all[b + 11]);
      blocks_.push_back(std::make_unique<Block<T>>(cfg.dim, cfg.heads, bp, std::move(mlp)));
    }
    lnf_w_ = all[2 + L * 12];
    lnf_b_ = all[3 + L * 12];
    rebuild_params();
  }

  const ModelConfig& config() const { return cfg_; }
  std::vector<ParamRef<T>>& parameters() { return params_; }
  size_t num_parameters() const {
    size_t n = 0;
    for (const auto& p : params_) n += p.numel;
    return n;
  }

  void replace_mlp(int layer, std::unique_ptr<MlpT<T>> mlp) {
    if (layer < 0 || layer >= cfg_.layers || !mlp)
      throw std::invalid_argument("loom::trainer::Model::replace_mlp: bad layer or null mlp");
    blocks_[static_cast<size_t>(layer)]->set_mlp(std::move(mlp));
    rebuild_params();
  }

  // Installs (or, with nullptr, removes) the router hook. Every layer the hook says
  // has_weight gets a router weight "h.L.router.w" [C], initialised to 0, after the layer's
  // MLP in parameters() (in its own storage, like a replaced MLP's).
  void set_router(std::unique_ptr<RouterHookT<T>> hook) {
    router_ = std::move(hook);
    const size_t L = blocks_.size();
    router_w_.assign(L, {});
    router_g_.assign(L, {});
    routes_.assign(L, {});
    if (router_) {
      for (size_t l = 0; l < L; ++l) {
        if (router_->has_weight(static_cast<int>(l), cfg_.layers)) {
          router_w_[l].assign(static_cast<size_t>(cfg_.dim), T(0));
          router_g_[l].assign(static_cast<size_t>(cfg_.dim), T(0));
        }
      }
    }
    rebuild_params();
  }
  RouterHookT<T>* router() { return router_.get(); }

  // bf16 mode (float only), before the first forward: parameters() become fp32 master
  // weights (their current values), the only copy an optimizer or a checkpoint sees. Every
  // forward then first writes the master weights rounded to bf16 (nearest even) into the
  // weights the layers read, so the forward and backward run on bf16 weights and the
  // gradients (fp32) land in the same grad buffers. Each layer boundary's activations (the
  // embedding, every block's output and the activations it keeps for backward, the final
  // LayerNorm) are rounded to bf16; matmuls accumulate in fp32 (sgemm), and the logits, the
  // loss and every gradient stay fp32. A replaced MLP (an MoE layer) and the router weights
  // keep their own storage: the MoE layer rounds at its plugin's boundary itself.
  void set_bf16(bool on) {
    if (!std::is_same_v<T, float> && on) {
      throw std::invalid_argument("loom::trainer::Model: bf16 mode is for float models");
    }
    if (on == bf16_) return;
    bf16_ = on;
    if (on) {
      master_ = values_;
    } else {
      values_ = master_;
      master_.clear();
      master_.shrink_to_fit();
    }
    for (auto& b : blocks_) b->set_bf16(on);
    rebuild_params();
  }
  bool bf16() const { return bf16_; }

  // Called during each training backward once a block's gradients are final (l, from the last
  // block down) and at its end (-1: every other gradient). Empty: not called.
  void set_grad_ready(std::function<void(int)> ready) { grad_ready_ = std::move(ready); }

  // The linear-layer seam (linear_hook.hpp): evaluation forwards run the slots the hook
  // handles through it. Not owned; nullptr removes it.
  void set_linear_hook(LinearHookT<T>* hook) { linear_hook_ = hook; }
  // Distillation for the training forwards that follow (linear_hook.hpp); nullptr turns it
  // off. Not owned: *d and what it points to must outlive the next backward.
  void set_distillation(const DistillationT<T>* d) {
    if (d != nullptr && !d->teacher_hidden.empty() &&
        d->teacher_hidden.size() != static_cast<size_t>(cfg_.layers)) {
      throw std::invalid_argument("loom::trainer::Model: distillation has " +
                                  std::to_string(d->teacher_hidden.size()) +
                                  " hidden targets for " + std::to_string(cfg_.layers) + " layers");
    }
    distill_ = d;
  }
  const DistillationTerms& distillation_terms() const { return terms_; }

  // One block alone (layer-by-layer distillation): x, y [B, Tn, C] (x unchanged until
  // block_backward); no router, no linear hook.
  void block_forward(int l, const T* x, T* y, int B, int Tn) {
    check_layer(l);
    refresh_weights();
    blocks_[static_cast<size_t>(l)]->set_linear(nullptr, l);
    blocks_[static_cast<size_t>(l)]->forward(x, y, B, Tn);
  }
  // dy: the gradient of the last block_forward's y; writes dx; adds into the block's grads.
  void block_backward(int l, const T* dy, T* dx, int B, int Tn) {
    check_layer(l);
    blocks_[static_cast<size_t>(l)]->backward(dy, dx, B, Tn, scratch_);
  }
  // Block l's parameters (h.l.*, its MLP's included; not a router weight).
  std::vector<ParamRef<T>> block_parameters(int l) {
    check_layer(l);
    auto& b = blocks_[static_cast<size_t>(l)];
    const auto& p = b->params();
    std::vector<ParamRef<T>> out{p.ln1_w,  p.ln1_b,  p.qkv_w, p.qkv_b,
                                 p.proj_w, p.proj_b, p.ln2_w, p.ln2_b};
    for (auto& r : b->mlp().parameters()) out.push_back(r);
    for (auto& r : out) r = to_master(r);
    return out;
  }

  // training: a training forward (routers drop tokens; evaluation keeps what the router's
  // plan for training = 0 says).
  double forward_backward(const int32_t* tokens, const int32_t* targets, int B, int Tn) {
    const double loss = forward(tokens, targets, B, Tn, true, true);
    backward(tokens, B, Tn);
    return loss;
  }
  double forward_loss(const int32_t* tokens, const int32_t* targets, int B, int Tn,
                      bool training = false) {
    return forward(tokens, targets, B, Tn, true, training);
  }
  void forward_logits(const int32_t* tokens, int B, int Tn, T* out) {
    forward(tokens, nullptr, B, Tn, false, false);
    std::copy(logits_.begin(),
              logits_.begin() +
                  static_cast<std::ptrdiff_t>(static_cast<size_t>(B) * Tn * cfg_.vocab_size),
              out);
  }
  void zero_grad() {
    std::fill(grads_.begin(), grads_.end(), T(0));
    for (auto& p : params_) {  // parameters of replaced MLPs live outside grads_
      if (p.grad < grads_.data() || p.grad >= grads_.data() + grads_.size())
        std::fill(p.grad, p.grad + p.numel, T(0));
    }
  }
  // Every layer processing every token (no routing).
  double flops_per_token(int seq) const {
    const double C = cfg_.dim;
    double f = 6.0 * C * cfg_.vocab_size;  // tied head
    for (const auto& b : blocks_) f += 6.0 * 4.0 * C * C + b->mlp().flops_per_token();
    f += 6.0 * cfg_.layers * static_cast<double>(seq) * C;  // causal attention
    return f;
  }
  // The last forward: positions each layer processed per sequence (seq for an unrouted
  // layer), their sum over layers times the batch (the layer tokens), and its forward +
  // backward FLOPs as flops_per_token counts them, with each layer's matmuls over its kept
  // tokens and its attention over the kept square (the head over every token).
  const std::vector<int>& kept() const { return kept_; }
  int64_t layer_tokens() const { return layer_tokens_; }
  double flops() const {
    const double C = cfg_.dim;
    const double N = static_cast<double>(last_B_) * last_T_;
    double f = 6.0 * C * cfg_.vocab_size * N;
    for (size_t l = 0; l < blocks_.size() && l < kept_.size(); ++l) {
      const double k = kept_[l];
      f += (6.0 * 4.0 * C * C + blocks_[l]->mlp().flops_per_token()) * last_B_ * k;
      f += 6.0 * C * last_B_ * k * k;
    }
    return f;
  }
  // Layer l's output of the last forward ([B, T, C]; l = -1: the embedding), for tests.
  const T* layer_output(int l) const {
    if (l < -1 || static_cast<size_t>(l + 1) >= resid_.size()) {
      throw std::invalid_argument("loom::trainer::Model: no output of layer " + std::to_string(l) +
                                  " (out of range, or no forward yet)");
    }
    return resid_[static_cast<size_t>(l + 1)].data();
  }

 private:
  void check_layer(int l) const {
    if (l < 0 || l >= cfg_.layers) {
      throw std::invalid_argument("loom::trainer::Model: layer " + std::to_string(l) +
                                  " out of range [0, " + std::to_string(cfg_.layers) + ")");
    }
  }

  // xorshift-based normal generator (Box-Muller), the same on every platform.
  struct Rng {
    explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull) {}
    uint64_t next() {
      s ^= s >> 12;
      s ^= s << 25;
      s ^= s >> 27;
      return s * 0x2545F4914F6CDD1Dull;
    }
    double uniform() { return (static_cast<double>(next() >> 11) + 0.5) * 0x1.0p-53; }
    double normal() {
      if (has_spare) {
        has_spare = false;
        return spare;
      }
      const double u = uniform();
      const double v = uniform();
      const double r = std::sqrt(-2.0 * std::log(u));
      spare = r * std::sin(2.0 * std::numbers::pi * v);
      has_spare = true;
      return r * std::cos(2.0 * std::numbers::pi * v);
    }
    uint64_t s;
    double spare = 0;
    bool has_spare = false;
  };

  void rebuild_params() {
    params_.clear();
    params_.push_back(wte_);
    params_.push_back(wpe_);
    for (auto& b : blocks_) {
      const auto& p = b->params();
      for (const auto* r :
           {&p.ln1_w, &p.ln1_b, &p.qkv_w, &p.qkv_b, &p.proj_w, &p.proj_b, &p.ln2_w, &p.ln2_b})
        params_.push_back(*r);
      for (auto& r : b->mlp().parameters()) params_.push_back(r);
      const auto l = static_cast<size_t>(&b - blocks_.data());
      if (l < router_w_.size() && !router_w_[l].empty()) {
        params_.push_back({"h." + std::to_string(l) + ".router.w",
                           {static_cast<int64_t>(cfg_.dim)},
                           router_w_[l].data(),
                           router_g_[l].data(),
                           router_w_[l].size()});
      }
    }
    params_.push_back(lnf_w_);
    params_.push_back(lnf_b_);
    for (auto& p : params_) p = to_master(p);
  }

  // In bf16 mode, a parameter of the contiguous buffer as the outside sees it: its master
  // weights. Parameters in their own storage (a replaced MLP's, the router weights) as they are.
  ParamRef<T> to_master(ParamRef<T> p) {
    if (bf16_ && p.value >= values_.data() && p.value < values_.data() + values_.size()) {
      p.value = master_.data() + (p.value - values_.data());
    }
    return p;
  }

  // bf16 mode: the weights the layers read, from the master weights (once per forward).
  void refresh_weights() {
    if constexpr (std::is_same_v<T, float>) {
      if (!bf16_) return;
      const float* m = master_.data();
      float* v = values_.data();
      layers::parallel_for(values_.size(), 4096, [&](size_t lo, size_t hi) {
        for (size_t i = lo; i < hi; ++i) v[i] = round_bf16(m[i]);
      });
    }
  }

  void check_inputs(const int32_t* tokens, const int32_t* targets, bool need_targets, int B,
                    int Tn) const {
    auto bad = [](const std::string& what) {
      throw std::invalid_argument("loom::trainer::Model: " + what);
    };
    if (tokens == nullptr || (need_targets && targets == nullptr)) bad("null tokens/targets");
    if (B < 1 || Tn < 1) bad("batch and seq must be positive");
    if (Tn > cfg_.context)
      bad("seq " + std::to_string(Tn) + " exceeds context " + std::to_string(cfg_.context));
    if (static_cast<double>(B) * Tn * 4.0 * cfg_.dim > 2.0e9 ||
        static_cast<double>(B) * Tn * cfg_.vocab_size > 2.0e9)
      bad("batch too large");
    const size_t N = static_cast<size_t>(B) * Tn;
    for (size_t i = 0; i < N; ++i) {
      if (tokens[i] < 0 || tokens[i] >= cfg_.vocab_size)
        bad("token " + std::to_string(tokens[i]) + " at " + std::to_string(i) +
            " out of range [0, " + std::to_string(cfg_.vocab_size) + ")");
      if (need_targets && (targets[i] < 0 || targets[i] >= cfg_.vocab_size))
        bad("target " + std::to_string(targets[i]) + " at " + std::to_string(i) +
            " out of range [0, " + std::to_string(cfg_.vocab_size) + ")");
    }
  }

  double forward(const int32_t* tokens, const int32_t* targets, int B, int Tn, bool loss,
                 bool training) {
    check_inputs(tokens, targets, loss, B, Tn);
    const size_t N = static_cast<size_t>(B) * Tn;
    const int n = static_cast<int>(N);
    const int C = cfg_.dim;
    const int V = cfg_.vocab_size;
    const size_t nc = N * C;
    if (resid_.size() != static_cast<size_t>(cfg_.layers) + 1 || resid_[0].size() < nc) {
      resid_.assign(static_cast<size_t>(cfg_.layers) + 1, std::vector<T>(nc));
      lnf_.resize(nc);
      dlnf_.resize(nc);
      lnf_stats_.resize(2 * N);
      logits_.resize(N * V);
      probs_.resize(N * V);
      dresid_a_.resize(nc);
      dresid_b_.resize(nc);
    }
    if (logits_.size() < N * V) {
      logits_.resize(N * V);
      probs_.resize(N * V);
    }
    refresh_weights();
    layers::encoder_forward(resid_[0].data(), tokens, wte_.value, wpe_.value, B, Tn, C);
    round_activations(bf16_, resid_[0].data(), nc);
    last_B_ = B;
    last_T_ = Tn;
    kept_.assign(blocks_.size(), Tn);
    layer_tokens_ = 0;
    for (auto& b : blocks_) b->mlp().set_training(training);
    // Evaluation forwards only: a training forward's backward needs the float weights.
    LinearHookT<T>* hook = training ? nullptr : linear_hook_;
    for (size_t l = 0; l < blocks_.size(); ++l) {
      blocks_[l]->set_linear(hook, static_cast<int>(l));
      if (router_) {
        routed_forward(l, B, Tn, training);
      } else {
        blocks_[l]->forward(resid_[l].data(), resid_[l + 1].data(), B, Tn);
      }
      // A routed layer's scatter of gated rows wrote new values; the rest are bf16 already.
      if (router_) round_activations(bf16_, resid_[l + 1].data(), nc);
      layer_tokens_ += static_cast<int64_t>(B) * kept_[l];
    }
    layers::layernorm_forward(lnf_.data(), lnf_stats_.data(), lnf_stats_.data() + N,
                              resid_.back().data(), lnf_w_.value, lnf_b_.value, n, C);
    round_activations(bf16_, lnf_.data(), nc);
    if (hook != nullptr && hook->handles(-1, LinearSlot::kHead)) {
      hook->forward(-1, LinearSlot::kHead, lnf_.data(), logits_.data(), n, C, V, nullptr);
    } else {
      layers::matmul_forward<T>(logits_.data(), lnf_.data(), wte_.value, nullptr, n, C, V);
    }
    if (!loss) return 0.0;
    targets_ = targets;
    distilled_ = training && distill_ != nullptr;
    const double ce = layers::crossentropy_forward(probs_.data(), logits_.data(), targets, n, V);
    if (!distilled_) return ce;
    return ce + distill_forward(ce, n, V, C);
  }

  // The distillation terms of a training forward (probs_ and logits_ hold the student's);
  // returns their weighted sum and records them. Teacher softmax into tprobs_.
  double distill_forward(double ce, int n, int V, int C) {
    const DistillationT<T>& d = *distill_;
    terms_ = {ce, 0.0, 0.0};
    const size_t N = static_cast<size_t>(n);
    if (d.teacher_logits != nullptr) {
      if (tprobs_.size() < N * V) tprobs_.resize(N * V);
      std::vector<double> row(N);
      const T* tl = d.teacher_logits;
      const T* sl = logits_.data();
      T* q = tprobs_.data();
      layers::parallel_for(N, 8, [&](size_t lo, size_t hi) {
        for (size_t i = lo; i < hi; ++i) {
          const T* t = tl + i * V;
          const T* s = sl + i * V;
          T* qi = q + i * V;
          T tmx = t[0], smx = s[0];
          for (int v = 1; v < V; ++v) {
            tmx = std::max(tmx, t[v]);
            smx = std::max(smx, s[v]);
          }
          double tsum = 0, ssum = 0;
          for (int v = 0; v < V; ++v) {
            qi[v] = static_cast<T>(std::exp(static_cast<double>(t[v] - tmx)));
            tsum += static_cast<double>(qi[v]);
            ssum += std::exp(static_cast<double>(s[v] - smx));
          }
          const double lse = static_cast<double>(smx) + std::log(ssum);
          double sce = 0;
          for (int v = 0; v < V; ++v) {
            qi[v] = static_cast<T>(static_cast<double>(qi[v]) / tsum);
            sce += static_cast<double>(qi[v]) * (lse - static_cast<double>(s[v]));
          }
          row[i] = sce;
        }
      });
      double sum = 0;
      for (const double r : row) sum += r;
      terms_.soft_ce = sum / static_cast<double>(N);
    }
    hidden_count_ = 0;
    double mse = 0;
    for (size_t l = 0; l < d.teacher_hidden.size(); ++l) {
      const T* t = d.teacher_hidden[l];
      if (t == nullptr) continue;
      ++hidden_count_;
      const T* h = resid_[l + 1].data();
      double acc = 0;
      for (size_t i = 0; i < N * C; ++i) {
        const double e = static_cast<double>(h[i]) - static_cast<double>(t[i]);
        acc += e * e;
      }
      mse += acc / static_cast<double>(N * C);
    }
    if (hidden_count_ > 0) terms_.hidden_mse = mse / hidden_count_;
    return d.logit_weight * terms_.soft_ce + d.hidden_weight * terms_.hidden_mse;
  }

  void backward(const int32_t* tokens, int B, int Tn) {
    const size_t N = static_cast<size_t>(B) * Tn;
    const int n = static_cast<int>(N);
    const int C = cfg_.dim;
    const int V = cfg_.vocab_size;
    const size_t nc = N * C;
    // logits reuse as dlogits
    layers::crossentropy_backward(logits_.data(), probs_.data(), targets_, n, V);
    const DistillationT<T>* d = distilled_ ? distill_ : nullptr;
    if (d != nullptr && d->teacher_logits != nullptr && d->logit_weight != 0) {
      // d(w * SCE)/dlogits = w * (p - q) / N
      const T s = static_cast<T>(d->logit_weight / static_cast<double>(n));
      T* g = logits_.data();
      const T* p = probs_.data();
      const T* q = tprobs_.data();
      layers::parallel_for(N, 8, [&](size_t lo, size_t hi) {
        for (size_t i = lo * V; i < hi * V; ++i) g[i] += s * (p[i] - q[i]);
      });
    }
    std::fill(dlnf_.begin(), dlnf_.begin() + static_cast<std::ptrdiff_t>(nc), T(0));
    layers::matmul_backward<T>(dlnf_.data(), wte_.grad, nullptr, logits_.data(), lnf_.data(),
                               wte_.value, n, C, V);
    std::fill(dresid_a_.begin(), dresid_a_.begin() + static_cast<std::ptrdiff_t>(nc), T(0));
    layers::layernorm_backward(dresid_a_.data(), lnf_w_.grad, lnf_b_.grad, dlnf_.data(),
                               resid_.back().data(), lnf_w_.value, lnf_stats_.data(),
                               lnf_stats_.data() + N, n, C);
    T* dy = dresid_a_.data();
    T* dx = dresid_b_.data();
    for (size_t l = blocks_.size(); l-- > 0;) {
      if (d != nullptr && hidden_count_ > 0 && d->hidden_weight != 0 &&
          d->teacher_hidden[l] != nullptr) {
        // d(w * MSE)/dh_l = w * 2 (h_l - t_l) / (count * N * C)
        const T s = static_cast<T>(2.0 * d->hidden_weight /
                                   (static_cast<double>(hidden_count_) * static_cast<double>(nc)));
        const T* h = resid_[l + 1].data();
        const T* t = d->teacher_hidden[l];
        for (size_t i = 0; i < nc; ++i) dy[i] += s * (h[i] - t[i]);
      }
      if (router_ && routes_[l].active) {
        routed_backward(l, dy, dx, B, Tn);
      } else {
        blocks_[l]->backward(dy, dx, B, Tn, scratch_);
      }
      std::swap(dy, dx);
      if (grad_ready_) grad_ready_(static_cast<int>(l));
    }
    layers::encoder_backward(wte_.grad, wpe_.grad, dy, tokens, B, Tn, C);
    if (grad_ready_) grad_ready_(-1);
  }

  // One layer under the router (see router_hook.hpp): resid_[l] -> resid_[l + 1].
  void routed_forward(size_t l, int B, int Tn, bool training) {
    const int C = cfg_.dim;
    const int layer = static_cast<int>(l);
    const RoutePlan p = router_->plan(layer, cfg_.layers, B, Tn, training);
    if (p.kept < 1 || p.kept > Tn || (p.routed && p.kept == Tn) || (!p.routed && p.kept != Tn)) {
      throw std::invalid_argument("loom::trainer::Model: the router planned " +
                                  std::to_string(p.kept) + " kept positions of " +
                                  std::to_string(Tn) + " for layer " + std::to_string(l) +
                                  (p.routed ? " (routed)" : " (not routed)"));
    }
    if (p.gated && router_w_[l].empty()) {
      throw std::invalid_argument("loom::trainer::Model: the router gates layer " +
                                  std::to_string(l) + ", which has no router weight");
    }
    Route& r = routes_[l];
    r.active = p.routed || p.gated;
    r.gated = p.gated;
    r.kept = p.kept;
    T* x = resid_[l].data();
    T* out = resid_[l + 1].data();
    if (!r.active) {
      blocks_[l]->forward(x, out, B, Tn);
      return;
    }
    const int K = p.kept;
    const size_t nk = static_cast<size_t>(B) * K;
    const size_t nkc = nk * C;
    const size_t nc = static_cast<size_t>(B) * Tn * C;
    r.idx.resize(nk);
    r.gates.resize(p.gated ? nk : 0);
    r.xk.resize(nkc);
    r.yk.resize(nkc);
    router_->select(layer, cfg_.layers, B, Tn, C, training, x,
                    router_w_[l].empty() ? nullptr : router_w_[l].data(), r.idx.data(),
                    p.gated ? r.gates.data() : nullptr);
    router_->gather(layer, x, r.xk.data(), r.idx.data(), B, Tn, K, C);
    blocks_[l]->forward(r.xk.data(), r.yk.data(), B, K);
    std::copy(x, x + nc, out);
    if (p.gated) {
      // z = x_kept + gate * (y_kept - x_kept), row by row.
      if (route_tmp_.size() < nkc) route_tmp_.resize(nkc);
      T* z = route_tmp_.data();
      const T* xk = r.xk.data();
      const T* yk = r.yk.data();
      const T* g = r.gates.data();
      layers::parallel_for(nk, 16, [&](size_t lo, size_t hi) {
        for (size_t i = lo; i < hi; ++i) {
          for (int c = 0; c < C; ++c) {
            const size_t o = i * C + c;
            z[o] = xk[o] + g[i] * (yk[o] - xk[o]);
          }
        }
      });
      router_->scatter(layer, out, z, r.idx.data(), B, Tn, K, C);
    } else {
      router_->scatter(layer, out, r.yk.data(), r.idx.data(), B, Tn, K, C);
    }
    kept_[l] = K;
  }

  // dy: the gradient of resid_[l + 1]; writes dx, the gradient of resid_[l].
  void routed_backward(size_t l, const T* dy, T* dx, int B, int Tn) {
    const int C = cfg_.dim;
    Route& r = routes_[l];
    const int K = r.kept;
    const size_t nk = static_cast<size_t>(B) * K;
    const size_t nkc = nk * C;
    const size_t nc = static_cast<size_t>(B) * Tn * C;
    for (auto* v : {&route_dyk_, &route_dxk_, &route_tmp_}) {
      if (v->size() < nkc) v->resize(nkc);
    }
    if (route_dgates_.size() < nk) route_dgates_.resize(nk);
    T* dyk = route_dyk_.data();
    T* dxk = route_dxk_.data();
    router_->gather(static_cast<int>(l), dy, dyk, r.idx.data(), B, Tn, K, C);
    if (r.gated) {
      const T* xk = r.xk.data();
      const T* yk = r.yk.data();
      const T* g = r.gates.data();
      T* dg = route_dgates_.data();
      T* dyb = route_tmp_.data();
      layers::parallel_for(nk, 16, [&](size_t lo, size_t hi) {
        for (size_t i = lo; i < hi; ++i) {
          T s = 0;
          for (int c = 0; c < C; ++c) {
            const size_t o = i * C + c;
            s += dyk[o] * (yk[o] - xk[o]);
            dyb[o] = g[i] * dyk[o];
          }
          dg[i] = s;
        }
      });
      blocks_[l]->backward(dyb, dxk, B, K, scratch_);
      layers::parallel_for(nk, 16, [&](size_t lo, size_t hi) {
        for (size_t i = lo; i < hi; ++i) {
          for (int c = 0; c < C; ++c) dxk[i * C + c] += (T(1) - g[i]) * dyk[i * C + c];
        }
      });
    } else {
      blocks_[l]->backward(dyk, dxk, B, K, scratch_);
    }
    std::copy(dy, dy + nc, dx);
    router_->scatter(static_cast<int>(l), dx, dxk, r.idx.data(), B, Tn, K, C);
    if (r.gated) {
      router_->backward(static_cast<int>(l), cfg_.layers, B, Tn, C, resid_[l].data(),
                        router_w_[l].data(), r.idx.data(), route_dgates_.data(), dx,
                        router_g_[l].data());
    }
  }

  // A routed layer's state between forward and backward.
  struct Route {
    bool active = false;  // the select/gather path ran
    bool gated = false;
    int kept = 0;
    std::vector<int32_t> idx;
    std::vector<T> gates, xk, yk;
  };

  ModelConfig cfg_;
  std::vector<T> values_, grads_;
  bool bf16_ = false;
  std::vector<T> master_;  // bf16 mode: the fp32 master weights (parameters() point here)
  std::vector<ParamRef<T>> params_;
  ParamRef<T> wte_, wpe_, lnf_w_, lnf_b_;
  std::vector<std::unique_ptr<Block<T>>> blocks_;
  std::vector<std::vector<T>> resid_;
  std::vector<T> lnf_, dlnf_, lnf_stats_, logits_, probs_, dresid_a_, dresid_b_;
  BlockScratch<T> scratch_;
  const int32_t* targets_ = nullptr;
  std::function<void(int)> grad_ready_;
  std::unique_ptr<RouterHookT<T>> router_;
  std::vector<std::vector<T>> router_w_, router_g_;  // per layer; empty: no weight
  std::vector<Route> routes_;
  std::vector<T> route_tmp_, route_dyk_, route_dxk_, route_dgates_;
  std::vector<int> kept_;
  int64_t layer_tokens_ = 0;
  int last_B_ = 0, last_T_ = 0;
  LinearHookT<T>* linear_hook_ = nullptr;
  const DistillationT<T>* distill_ = nullptr;
  bool distilled_ = false;  // the last loss forward distilled (its backward adds the terms)
  int hidden_count_ = 0;
  DistillationTerms terms_;
  std::vector<T> tprobs_;  // the teacher's softmax of the last distilled forward
};

}  // namespace loom::trainer
