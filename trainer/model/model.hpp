// The reference trainer's model: a GPT-2 style decoder-only transformer (token + position
// embeddings, pre-LayerNorm blocks with causal multi-head attention and a GELU MLP of 4*dim,
// a final LayerNorm, an output head tied to the token embedding), with forward and backward
// written out by hand in C++ (OpenBLAS sgemm for every matmul, threaded elementwise kernels).
//
// Seams for later work (see model.cpp for details):
//  - MoE: each Block holds its MLP behind the `Mlp` interface below (forward/backward over N
//    token rows, plus its parameters). An MoE layer plugin replaces a block's DenseMlp with
//    its own Mlp through Model::replace_mlp().
//  - Token drop (random-LTD and friends): Block::forward/backward work on any [B, T', C]
//    activations, where the T' rows of each sequence may be a sorted subset of the
//    positions (the causal mask is applied in subset order). A router gathers the kept rows,
//    runs the block, and scatters the outputs back, leaving the dropped rows unchanged:
//    Model::set_router installs a RouterHook (router_hook.hpp) the model consults per layer.
//  - Quantization (linear_hook.hpp): Model::set_linear_hook routes the evaluation forwards'
//    weight matmuls through a hook (a quantizer's matmul on packed codes);
//    Model::set_distillation adds a teacher's terms to the training loss; block_forward /
//    block_backward run one block alone (layer-by-layer distillation).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "linear_hook.hpp"
#include "router_hook.hpp"

namespace loom::trainer {

struct ModelConfig {
  int vocab_size = 256;
  int context = 128;
  int layers = 4;
  int heads = 4;
  int dim = 128;
};

// The block a parameter belongs to: L for "h.L.rest", -1 for any other name.
int parameter_block(const std::string& name);

struct ParamTensor {
  std::string name;
  std::vector<int64_t> shape;
  float* value;
  float* grad;
  size_t numel;
};

// Threads used by the model's kernels: libloom's process-wide pool (loom_set_thread_count),
// which runs the split sgemms and the elementwise loops and the plugins' kernels too;
// OpenBLAS itself stays single-threaded. Defaults to LOOM_NUM_THREADS, else the cores divided
// by the number of ranks on this node (OMPI_COMM_WORLD_LOCAL_SIZE, MPI_LOCALNRANKS, or
// torchrun's LOCAL_WORLD_SIZE), else all cores. n < 1 restores the default. Call it before
// using a model, not from inside one of its calls.
void set_num_threads(int threads);
int num_threads();

// A position-wise MLP over N rows of `dim` features. forward() keeps whatever it needs for
// backward() of the same rows; backward() ADDS into dx and into its parameters' grads.
class Mlp {
 public:
  virtual ~Mlp() = default;
  virtual void forward(const float* x, float* y, int rows) = 0;
  virtual void backward(const float* x, const float* dy, float* dx, int rows) = 0;
  virtual std::vector<ParamTensor> parameters() = 0;
  virtual double flops_per_token() const = 0;  // forward+backward
  // Called before every model forward: whether it is a training forward (forward_backward,
  // or forward_loss with training) or an evaluation one. The default ignores it.
  virtual void set_training(bool) {}
};

class Model {
 public:
  // GPT-2 init: weights normal(0, 0.02), residual projections (attn.proj.w, mlp.proj.w)
  // scaled by 1/sqrt(2*layers), biases 0, LayerNorm gains 1. Throws std::invalid_argument
  // on a bad config (non-positive sizes, dim not divisible by heads).
  Model(const ModelConfig& cfg, uint64_t seed);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const;
  // Stable pointers into contiguous fp32 storage (all values in one buffer, all grads in
  // another, in this order).
  std::vector<ParamTensor>& parameters();
  size_t num_parameters() const;

  // tokens/targets: batch*seq int32 (seq <= context). Returns the mean cross-entropy loss;
  // accumulates (adds) gradients into ParamTensor::grad scaled so they are
  // d(mean loss)/d(param). Throws std::invalid_argument on bad shapes or out-of-range
  // tokens/targets.
  // forward_backward is a training forward (training = 1 for the router); forward_loss is an
  // evaluation one unless `training`.
  float forward_backward(const int32_t* tokens, const int32_t* targets, int batch, int seq);
  float forward_loss(const int32_t* tokens, const int32_t* targets, int batch, int seq,
                     bool training = false);
  // Writes the logits [batch, seq, vocab] (no grads), e.g. for sampling.
  void forward_logits(const int32_t* tokens, int batch, int seq, float* logits);
  void zero_grad();
  double flops_per_token(int seq) const;  // fwd+bwd model FLOPs per token, for MFU (no routing)
  // The last forward: positions per sequence each layer processed (seq when not routed), the
  // layer tokens (batch times their sum over layers) and its fwd+bwd FLOPs with routing.
  const std::vector<int>& kept() const;
  int64_t layer_tokens() const;
  double flops() const;

  // The token-routing seam (router_hook.hpp): installs the hook the forward and backward
  // consult for every layer; the learned router weights "h.L.router.w" [dim] of the layers
  // it says has_weight are appended to parameters() after their layer's MLP (own storage,
  // initialised to 0). nullptr removes it. Call before building views of parameters().
  void set_router(std::unique_ptr<RouterHook> router);

  // The gradient-communication seam: `ready(l)` runs during each training backward as soon as
  // block l's gradients (its parameters "h.l.*") are final, from the last block down, and
  // ready(-1) at its end, when every other gradient is. An empty function removes it.
  void set_grad_ready(std::function<void(int)> ready);

  // The MoE seam: replaces layer `layer`'s MLP. The new Mlp's parameters are appended to
  // parameters() (they live in its own storage, not in the contiguous buffer).
  void replace_mlp(int layer, std::unique_ptr<Mlp> mlp);

  // The linear-layer seam (linear_hook.hpp): not owned, nullptr removes it. Only evaluation
  // forwards (forward_loss without training, forward_logits) use it.
  void set_linear_hook(LinearHook* hook);
  // Distillation terms for the training forwards that follow (linear_hook.hpp); not owned,
  // nullptr turns it off. forward_backward then returns CE + the weighted terms.
  void set_distillation(const Distillation* d);
  const DistillationTerms& distillation_terms() const;

  // bf16 mode (docs/trainer.md, "bf16 mode"): parameters() become the fp32 master weights,
  // which every forward rounds to bf16 into the weights the layers read; the activations at
  // the layers' boundaries are rounded to bf16; gradients, logits and loss stay fp32. Call it
  // before the first forward and before building views of parameters() (it moves them).
  void set_bf16(bool on);
  bool bf16() const;

  // Layer l's output of the last forward [batch, seq, dim] (l = -1: the embedding).
  const float* layer_output(int l) const;
  // Block l alone, no router and no hook: y = block(x), x and y [batch, seq, dim] (x must stay
  // unchanged until block_backward); block_backward writes dx and ADDS into the block's grads.
  void block_forward(int l, const float* x, float* y, int batch, int seq);
  void block_backward(int l, const float* dy, float* dx, int batch, int seq);
  std::vector<ParamTensor> block_parameters(int l);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom::trainer
