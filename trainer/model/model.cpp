// Model: the float instantiation of Gpt (gpt.hpp); its kernels run on libloom's thread pool.
#include "model.hpp"

#include <loom/embed.h>
#include <loom/sdk/blas.hpp>

#include <memory>
#include <stdexcept>
#include <string>

#include "gpt.hpp"

namespace loom::trainer {
namespace {

using BlockFn = std::function<void(size_t, size_t)>;

void run_block(void* ctx, size_t begin, size_t end) {
  (*static_cast<const BlockFn*>(ctx))(begin, end);
}

// Wraps a float Mlp (the public plugin-facing interface) as the model's MlpT<float>.
class MlpAdapter final : public MlpT<float> {
 public:
  explicit MlpAdapter(std::unique_ptr<Mlp> m) : m_(std::move(m)) {}
  void forward(const float* x, float* y, int rows) override { m_->forward(x, y, rows); }
  void backward(const float* x, const float* dy, float* dx, int rows) override {
    m_->backward(x, dy, dx, rows);
  }
  std::vector<ParamRef<float>> parameters() override {
    std::vector<ParamRef<float>> out;
    for (auto& p : m_->parameters()) out.push_back({p.name, p.shape, p.value, p.grad, p.numel});
    return out;
  }
  double flops_per_token() const override { return m_->flops_per_token(); }
  void set_training(bool training) override { m_->set_training(training); }

 private:
  std::unique_ptr<Mlp> m_;
};

}  // namespace

namespace layers {
// libloom's process-wide pool: the one the plugins' kernels run on too.
void parallel_for(size_t n, size_t grain, const std::function<void(size_t, size_t)>& fn) {
  // Every sgemm runs single-threaded inside one of the pool's threads (layers::par_gemm
  // splits the output), so OpenBLAS's own threads would only oversubscribe the cores.
  sdk::blas::use_one_thread_per_call();
  if (loom_parallel_for(n, grain, &run_block, const_cast<BlockFn*>(&fn)) != LOOM_OK) {
    throw std::runtime_error(std::string("loom::trainer: ") + loom_last_error());
  }
}
int pool_threads() { return static_cast<int>(loom_thread_count()); }
}  // namespace layers

void set_num_threads(int threads) {
  sdk::blas::use_one_thread_per_call();
  if (loom_set_thread_count(threads < 1 ? 0 : static_cast<size_t>(threads)) != LOOM_OK) {
    throw std::runtime_error(std::string("loom::trainer: ") + loom_last_error());
  }
}

int num_threads() { return layers::pool_threads(); }

int parameter_block(const std::string& name) {
  if (name.rfind("h.", 0) != 0) return -1;
  const size_t dot = name.find('.', 2);
  if (dot == std::string::npos || dot == 2) return -1;
  int l = 0;
  for (size_t i = 2; i < dot; ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    l = l * 10 + (name[i] - '0');
    if (l > 1 << 20) return -1;
  }
  return l;
}

struct Model::Impl {
  Impl(const ModelConfig& cfg, uint64_t seed) : gpt(cfg, seed) { sync(); }
  void sync() {
    params.clear();
    for (auto& p : gpt.parameters()) params.push_back({p.name, p.shape, p.value, p.grad, p.numel});
  }
  Gpt<float> gpt;
  std::vector<ParamTensor> params;
};

Model::Model(const ModelConfig& cfg, uint64_t seed) : impl_(std::make_unique<Impl>(cfg, seed)) {}
Model::~Model() = default;

const ModelConfig& Model::config() const { return impl_->gpt.config(); }
std::vector<ParamTensor>& Model::parameters() { return impl_->params; }
size_t Model::num_parameters() const { return impl_->gpt.num_parameters(); }

float Model::forward_backward(const int32_t* tokens, const int32_t* targets, int batch, int seq) {
  return static_cast<float>(impl_->gpt.forward_backward(tokens, targets, batch, seq));
}
float Model::forward_loss(const int32_t* tokens, const int32_t* targets, int batch, int seq,
                          bool training) {
  return static_cast<float>(impl_->gpt.forward_loss(tokens, targets, batch, seq, training));
}
void Model::forward_logits(const int32_t* tokens, int batch, int seq, float* logits) {
  if (logits == nullptr) throw std::invalid_argument("loom::trainer::Model: null logits");
  impl_->gpt.forward_logits(tokens, batch, seq, logits);
}
void Model::zero_grad() { impl_->gpt.zero_grad(); }
double Model::flops_per_token(int seq) const { return impl_->gpt.flops_per_token(seq); }
const std::vector<int>& Model::kept() const { return impl_->gpt.kept(); }
int64_t Model::layer_tokens() const { return impl_->gpt.layer_tokens(); }
double Model::flops() const { return impl_->gpt.flops(); }

void Model::set_router(std::unique_ptr<RouterHook> router) {
  impl_->gpt.set_router(std::move(router));
  impl_->sync();
}

void Model::replace_mlp(int layer, std::unique_ptr<Mlp> mlp) {
  if (!mlp) throw std::invalid_argument("loom::trainer::Model::replace_mlp: null mlp");
  impl_->gpt.replace_mlp(layer, std::make_unique<MlpAdapter>(std::move(mlp)));
  impl_->sync();
}

void Model::set_grad_ready(std::function<void(int)> ready) {
  impl_->gpt.set_grad_ready(std::move(ready));
}

void Model::set_bf16(bool on) {
  impl_->gpt.set_bf16(on);
  impl_->sync();
}
bool Model::bf16() const { return impl_->gpt.bf16(); }

void Model::set_linear_hook(LinearHook* hook) { impl_->gpt.set_linear_hook(hook); }
void Model::set_distillation(const Distillation* d) { impl_->gpt.set_distillation(d); }
const DistillationTerms& Model::distillation_terms() const {
  return impl_->gpt.distillation_terms();
}
const float* Model::layer_output(int l) const {
  if (l < -1 || l >= impl_->gpt.config().layers) {
    throw std::invalid_argument("loom::trainer::Model::layer_output: layer " + std::to_string(l) +
                                " out of range");
  }
  return impl_->gpt.layer_output(l);
}
void Model::block_forward(int l, const float* x, float* y, int batch, int seq) {
  impl_->gpt.block_forward(l, x, y, batch, seq);
}
void Model::block_backward(int l, const float* dy, float* dx, int batch, int seq) {
  impl_->gpt.block_backward(l, dy, dx, batch, seq);
}
std::vector<ParamTensor> Model::block_parameters(int l) {
  std::vector<ParamTensor> out;
  for (auto& p : impl_->gpt.block_parameters(l))
    out.push_back({p.name, p.shape, p.value, p.grad, p.numel});
  return out;
}

}  // namespace loom::trainer
