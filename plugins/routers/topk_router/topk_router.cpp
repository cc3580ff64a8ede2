// topk_router: a learned token router in the style of Mixture-of-Depths (kind loom.router/1).
// Each routed layer keeps the `capacity` fraction of a sequence's positions whose score
// x . w (w: a weight the trainer owns, one per routed layer) is largest, and returns a gate
// per kept token (sigmoid or linear of its score) through which w learns. The kernels are in
// topk_kernels.hpp; this file checks what the SDK does not and dispatches by device.
#include <loom/sdk.hpp>
#include <loom/sdk/kinds/router.hpp>

#include <cstdint>
#include <span>
#include <string>

#include <loom/routers/router_core.hpp>
#include "topk_kernels.hpp"

namespace {

namespace topk = loom::routers::topk;
using loom::sdk::Context;
using loom::sdk::fail_argument;

[[noreturn]] void fail(const std::string& message) {
  throw loom::sdk::Error(LOOM_ERR_INVALID_ARGUMENT, message);
}

constexpr double kDefaultCapacity = 0.125;

topk::Gate parse_gate(const std::string& g) {
  if (g == "sigmoid") return topk::Gate::kSigmoid;
  if (g == "linear") return topk::Gate::kLinear;
  fail("gate = \"" + g + "\" is not a gate; expected \"sigmoid\" or \"linear\"");
}

void check_capacity(double c) {
  if (!(c > 0.0) || c > 1.0) {
    fail_argument("capacity = " + std::to_string(c) +
                  " is outside (0, 1]; it is the fraction of a sequence's positions a routed "
                  "layer keeps (at least one is always kept, so 0 is not allowed)");
  }
}

// fp32 or fp64 hidden states; `what` names the tensor.
topk::Dtype dtype_of(const DLDataType& t, const char* what) {
  if (t.code == kDLFloat && t.bits == 32 && t.lanes == 1) return topk::Dtype::kF32;
  if (t.code == kDLFloat && t.bits == 64 && t.lanes == 1) return topk::Dtype::kF64;
  fail(std::string(what) + " has dtype " + loom::sdk::dtype_string(t) +
       "; topk_router scores float32 or float64 hidden states");
}

class TopkRouter : public loom::sdk::Router {
 public:
  static loom::sdk::Schema schema() {
    return {
        loom::sdk::Float("capacity", kDefaultCapacity,
                         "Fraction of a sequence's positions each routed layer processes, in "
                         "(0, 1]: it keeps round(capacity * seq_len) of them (at least 1), the "
                         "same count in training and evaluation.")
            .greater_than(0)
            .max(1),
        loom::routers::RoutedLayers::param(),
        loom::sdk::String("gate", "sigmoid",
                          "How a kept token's score s scales the layer's update of it: "
                          "\"sigmoid\" (sigmoid(s), in (0, 1)) or \"linear\" (s itself).")
            .choices({"sigmoid", "linear"}),
    };
  }

  static void validate_params(Context& params) {
    check_capacity(params.get_float("capacity"));
    (void)parse_gate(params.get_string("gate"));
    loom::routers::RoutedLayers::validate(params);
  }

  explicit TopkRouter(Context& ctx)
      : capacity_(ctx.get_float("capacity")),
        gate_(parse_gate(ctx.get_string("gate"))),
        layers_(loom::routers::RoutedLayers::from(ctx)) {
    check_capacity(capacity_);
  }

  void plan(loom_router_plan_args& a) {
    (void)dtype_of(a.dtype, "x");
    a.kept = kept(a.layer, a.num_layers, a.seq_len);
    a.saved_bytes = topk::saved_bytes(a.batch, a.kept);
    a.workspace_bytes = topk::workspace_bytes(a.batch, a.seq_len, a.channels, a.kept);
  }

  void select(const loom_router_select_args& a) {
    const loom::sdk::TokenTensor x = loom::sdk::token_tensor(a.x, "x");
    topk::SelectData d;
    d.shape = shape(a.batch, a.seq_len, a.channels, a.indices->shape[1], a.x->dtype);
    d.x = {x.data, x.batch_stride, x.position_stride};
    d.weight = loom::sdk::data_as<const void>(*a.weight);
    d.indices = loom::sdk::data_as<int32_t>(*a.indices);
    d.gates = loom::sdk::data_as<void>(*a.gates);
    d.saved = static_cast<double*>(a.saved);
    d.scores = static_cast<double*>(a.workspace);
    if (on_cuda(x.device)) {
      topk::cuda::select(d, x.device.device_id, a.stream);
    } else {
      topk::select_cpu(d);
    }
  }

  void backward(const loom_router_backward_args& a) {
    const int64_t kept = a.indices->shape[1];
    const loom::sdk::TokenTensor x = loom::sdk::token_tensor(a.x, "x");
    const loom::sdk::TokenTensor dx = loom::sdk::token_tensor(a.dx, "dx");
    const uint64_t want_saved = topk::saved_bytes(a.batch, kept);
    if (a.saved == nullptr || a.saved_bytes < want_saved) {
      fail_argument(
          "saved is " +
          (a.saved == nullptr ? std::string("NULL") : std::to_string(a.saved_bytes) + " bytes") +
          "; backward reads the " + std::to_string(want_saved) +
          " bytes select wrote there (batch * kept scores)");
    }
    const uint64_t want_ws = topk::workspace_bytes(a.batch, a.seq_len, a.channels, kept);
    if (a.workspace == nullptr || a.workspace_bytes < want_ws) {
      fail_argument("workspace is " +
                    (a.workspace == nullptr ? std::string("NULL")
                                            : std::to_string(a.workspace_bytes) + " bytes") +
                    " but the plan asks for " + std::to_string(want_ws) + " bytes");
    }
    topk::BackwardData d;
    d.shape = shape(a.batch, a.seq_len, a.channels, kept, a.x->dtype);
    d.x = {x.data, x.batch_stride, x.position_stride};
    d.weight = loom::sdk::data_as<const void>(*a.weight);
    d.indices = loom::sdk::data_as<const int32_t>(*a.indices);
    d.dgates = loom::sdk::data_as<const void>(*a.dgates);
    d.saved = static_cast<const double*>(a.saved);
    d.dx = dx.data;
    d.dx_batch_stride = dx.batch_stride;
    d.dx_position_stride = dx.position_stride;
    d.dweight = loom::sdk::data_as<void>(*a.dweight);
    d.partial = static_cast<double*>(a.workspace);
    d.ds = d.partial + a.batch * a.channels;
    if (on_cuda(x.device)) {
      topk::cuda::backward(d, x.device.device_id, a.stream);
    } else {
      if (loom::sdk::is_cpu(a.indices->device)) {
        loom::sdk::check_router_rows(d.indices, a.batch, kept, a.seq_len, "indices");
      }
      topk::backward_cpu(d);
    }
  }

  void gather(const loom::sdk::RouterMove& m) { loom::routers::gather(m); }
  void scatter(const loom::sdk::RouterMove& m) { loom::routers::scatter(m); }

  void advance(loom_router_advance_args& a) {
    counter_.advance(a, loom::routers::LayerTokenCounter::layer_tokens(
                            a.batch, a.num_layers,
                            [&](int32_t layer) { return kept(layer, a.num_layers, a.seq_len); }));
  }

  void export_state(loom::sdk::StateWriter& out) { counter_.export_state(out); }
  void import_state(std::span<const std::byte> blob) { counter_.import_state(blob); }

 private:
  int64_t kept(int32_t layer, int32_t num_layers, int64_t seq_len) const {
    return layers_.routed(layer, num_layers) ? topk::kept_count(capacity_, seq_len) : seq_len;
  }

  topk::Shape shape(int64_t batch, int64_t seq_len, int64_t channels, int64_t kept,
                    const DLDataType& dtype) const {
    topk::Shape s;
    s.batch = batch;
    s.seq_len = seq_len;
    s.channels = channels;
    s.kept = kept;
    s.dtype = dtype_of(dtype, "x");
    s.gate = gate_;
    return s;
  }

  // Host memory runs on the CPU kernels; CUDA memory on the CUDA ones (topk_cuda_stub.cpp
  // without CUDA: UNIMPLEMENTED).
  static bool on_cuda(const DLDevice& dev) {
    if (loom::sdk::is_cpu(dev)) return false;
    if (!loom::sdk::is_cuda(dev)) {
      fail_argument("x is on " + loom::sdk::device_string(dev) +
                    "; topk_router runs on host or CUDA memory");
    }
    return true;
  }

  double capacity_;
  topk::Gate gate_;
  loom::routers::RoutedLayers layers_;
  loom::routers::LayerTokenCounter counter_;
};

}  // namespace

LOOM_PLUGIN("topk_router", "1.0.0",
            "Learned token router (Mixture-of-Depths style): each routed layer processes the "
            "capacity fraction of positions with the largest score x . w, gated by the score",
            loom::sdk::factory<TopkRouter>());
