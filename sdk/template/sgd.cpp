// SGD with momentum, dampening, Nesterov and weight decay, as torch.optim.SGD computes it:
//
//   g = grad / grad_scale + weight_decay * p
//   b = g                                   on the first step
//   b = momentum * b + (1 - dampening) * g  afterwards
//   g = g + momentum * b  (nesterov)  or  g = b
//   p = p - lr * lr_scale * g
//
// fp32 parameters and gradients in host memory. A starting point for your own optimizer:
// the structure (validate everything, then update; state with a versioned header) is what
// matters, not the arithmetic.
#include <loom/sdk.hpp>
#include <loom/sdk/kinds/optimizer.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace {

using loom::sdk::Context;
using loom::sdk::Error;

class Sgd : public loom::sdk::Optimizer {
 public:
  static loom::sdk::Schema schema() {
    using namespace loom::sdk;
    return {
        Float("momentum", 0.0, "Momentum factor; 0 disables the momentum buffer.").range(0, 1),
        Float("dampening", 0.0, "Dampening for momentum.").range(0, 1),
        Bool("nesterov", false, "Use Nesterov momentum (needs momentum > 0, dampening 0)."),
        Float("weight_decay", 0.0, "L2 penalty added to the gradient.").min(0),
    };
  }

  // Checks between parameters, run by `loom check` and before any instance is created; the
  // third argument names the key the host reports the error at (FILE:LINE:COL).
  // torch.optim.SGD refuses the same combination.
  static void validate_params(Context& params) {
    if (params.get_bool("nesterov") &&
        (params.get_float("momentum") <= 0.0 || params.get_float("dampening") != 0.0)) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT, "nesterov needs momentum > 0 and dampening = 0",
                  "nesterov");
    }
  }

  explicit Sgd(Context& ctx)
      : ctx_(ctx),
        momentum_(ctx.get_float("momentum")),
        dampening_(ctx.get_float("dampening")),
        nesterov_(ctx.get_bool("nesterov")),
        weight_decay_(ctx.get_float("weight_decay")) {}

  void step(const loom_optimizer_step_args& args) {
    // Check every tensor before touching any: a bad argument must leave parameters as they
    // were.
    validate(args);
    if (!std::isfinite(args.grad_scale) || args.grad_scale <= 0.0) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  "grad_scale must be positive, got " + std::to_string(args.grad_scale));
    }
    const bool first = buffers_.empty();
    if (first && momentum_ != 0.0) allocate(args);

    const float inv_scale = static_cast<float>(1.0 / args.grad_scale);
    for (std::size_t g = 0; g < args.group_count; ++g) {
      const loom_optimizer_group group = loom::sdk::element(args.groups, g);
      const float lr = static_cast<float>(args.lr * group.lr_scale);
      const float wd =
          static_cast<float>(std::isnan(group.weight_decay) ? weight_decay_ : group.weight_decay);
      for (std::size_t t = 0; t < group.tensor_count; ++t) {
        const loom_optimizer_tensor tensor = loom::sdk::element(group.tensors, t);
        float* p = loom::sdk::data_as<float>(*tensor.param);
        const float* grad = loom::sdk::data_as<const float>(*tensor.grad);
        float* buf = momentum_ != 0.0 ? buffers_[g][t].data() : nullptr;
        update(p, grad, buf, static_cast<std::size_t>(loom::sdk::numel(*tensor.param)), inv_scale,
               lr, wd, first);
      }
    }
    ++steps_;
  }

  // Format v1: header, step count, then per group its tensor count and per tensor its
  // momentum buffer (empty when momentum is 0).
  void export_state(loom::sdk::StateWriter& out) {
    out.write_header(kMagic, kVersion);
    out.write_pod<uint64_t>(steps_);
    out.write_pod<uint64_t>(buffers_.size());
    for (const auto& group : buffers_) {
      out.write_pod<uint64_t>(group.size());
      for (const auto& buf : group) out.write_vector(buf);
    }
  }

  // Parses into temporaries and commits only at the end, so a bad blob changes nothing.
  void import_state(std::span<const std::byte> blob) {
    loom::sdk::StateReader in(blob);
    in.read_header(kMagic, kVersion);
    const auto steps = in.read_pod<uint64_t>();
    const auto group_count = in.read_pod<uint64_t>();
    if (group_count > in.remaining()) throw Error(LOOM_ERR_DATA_LOSS, "corrupt group count");
    std::vector<std::vector<std::vector<float>>> buffers(static_cast<std::size_t>(group_count));
    for (auto& group : buffers) {
      const auto tensor_count = in.read_pod<uint64_t>();
      if (tensor_count > in.remaining()) throw Error(LOOM_ERR_DATA_LOSS, "corrupt tensor count");
      group.resize(static_cast<std::size_t>(tensor_count));
      for (auto& buf : group) buf = in.read_vector<float>();
    }
    in.expect_end();
    if (momentum_ != 0.0 && steps > 0 && buffers.empty()) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  "state has no momentum buffers but this instance uses momentum");
    }
    steps_ = steps;
    // Without momentum there is nothing to keep (the run may have turned momentum off).
    if (momentum_ != 0.0) buffers_ = std::move(buffers);
    ctx_.debug("restored state at step " + std::to_string(steps_));
  }

 private:
  static constexpr const char* kMagic = "loom.sgd";
  static constexpr uint32_t kVersion = 1;

  void validate(const loom_optimizer_step_args& args) const {
    if (args.group_count != 0 && args.groups == nullptr) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT, "groups is NULL");
    }
    if (!buffers_.empty() && buffers_.size() != args.group_count) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT, "got " + std::to_string(args.group_count) +
                                                 " groups, the first step had " +
                                                 std::to_string(buffers_.size()));
    }
    for (std::size_t g = 0; g < args.group_count; ++g) {
      const loom_optimizer_group group = loom::sdk::element(args.groups, g);
      if (group.tensor_count != 0 && group.tensors == nullptr) {
        throw Error(LOOM_ERR_INVALID_ARGUMENT, "group " + std::to_string(g) + " has no tensors");
      }
      if (!buffers_.empty() && buffers_[g].size() != group.tensor_count) {
        throw Error(LOOM_ERR_INVALID_ARGUMENT,
                    "group " + std::to_string(g) + " has " + std::to_string(group.tensor_count) +
                        " tensors, the first step had " + std::to_string(buffers_[g].size()));
      }
      for (std::size_t t = 0; t < group.tensor_count; ++t) {
        const std::string id = std::to_string(g) + "." + std::to_string(t);
        const loom_optimizer_tensor tensor = loom::sdk::element(group.tensors, t);
        if (tensor.master != nullptr) {
          throw Error(LOOM_ERR_UNIMPLEMENTED,
                      "param " + id + " has a master copy; sgd " + "supports fp32 parameters only");
        }
        const DLTensor& p = loom::sdk::expect_tensor(tensor.param, "param " + id);
        const DLTensor& grad = loom::sdk::expect_tensor(tensor.grad, "grad " + id);
        loom::sdk::expect_fp32(p, "param " + id);
        loom::sdk::expect_fp32(grad, "grad " + id);
        loom::sdk::expect_cpu(p, "param " + id);
        loom::sdk::expect_cpu(grad, "grad " + id);
        loom::sdk::expect_contiguous(p, "param " + id);
        loom::sdk::expect_contiguous(grad, "grad " + id);
        loom::sdk::expect_same_shape(grad, "grad " + id, p, "param " + id);
        if (!buffers_.empty() &&
            buffers_[g][t].size() != static_cast<std::size_t>(loom::sdk::numel(p))) {
          throw Error(LOOM_ERR_INVALID_ARGUMENT, "param " + id + " has " +
                                                     std::to_string(loom::sdk::numel(p)) +
                                                     " elements, its momentum buffer " +
                                                     std::to_string(buffers_[g][t].size()));
        }
      }
    }
  }

  void allocate(const loom_optimizer_step_args& args) {
    buffers_.resize(args.group_count);
    for (std::size_t g = 0; g < args.group_count; ++g) {
      const loom_optimizer_group group = loom::sdk::element(args.groups, g);
      buffers_[g].resize(group.tensor_count);
      for (std::size_t t = 0; t < group.tensor_count; ++t) {
        const loom_optimizer_tensor tensor = loom::sdk::element(group.tensors, t);
        buffers_[g][t].assign(static_cast<std::size_t>(loom::sdk::numel(*tensor.param)), 0.0f);
      }
    }
  }

  void update(float* p, const float* grad, float* buf, std::size_t n, float inv_scale, float lr,
              float wd, bool first) const {
    const auto momentum = static_cast<float>(momentum_);
    const auto keep = static_cast<float>(1.0 - dampening_);
    for (std::size_t i = 0; i < n; ++i) {
      float d = grad[i] * inv_scale + wd * p[i];
      if (buf != nullptr) {
        buf[i] = first ? d : momentum * buf[i] + keep * d;
        d = nesterov_ ? d + momentum * buf[i] : buf[i];
      }
      p[i] -= lr * d;
    }
  }

  Context ctx_;
  double momentum_;
  double dampening_;
  bool nesterov_;
  double weight_decay_;
  uint64_t steps_ = 0;
  // [group][tensor] -> momentum buffer; empty until the first step (or without momentum).
  std::vector<std::vector<std::vector<float>>> buffers_;
};

}  // namespace

LOOM_PLUGIN("sgd", "1.0.0", "SGD with momentum, dampening, Nesterov and weight decay",
            loom::sdk::factory<Sgd>());
