// Declared public interface of loom_moe_core: bench/, the trainer and tests may include this
// header (as <loom/moe/moe_cuda.hpp>); the core's other headers are private to it.
//
// The CUDA half of the MoE core behind a plain C++ interface (the plugin, compiled by the host
// compiler, calls it). Tensors, `saved` and the workspace are device memory on `stream`. The
// whole layer runs there, the routing too, with the host path's rounding, so both choose the
// same experts; the host sees only O(E) counts per call, which size the exchange and the
// expert GEMMs. CUDA builds only; failures throw loom::sdk::Error (UNAVAILABLE for the
// device, INVALID_ARGUMENT for bad input).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <loom/moe/exchange_cuda.hpp>  // have_cuda() and the exchange's runtime calls
#include <loom/moe/layer.hpp>

namespace loom::plugins::float16 {
enum class Storage : uint8_t;  // plugins/common/float16_io.hpp
}  // namespace loom::plugins::float16

namespace loom::moe::cuda {

// A cuBLAS handle for one device, created on first use, and the device scratch the experts'
// grouped GEMMs read their pointer arrays and segment offsets from.
class Blas {
 public:
  Blas() = default;
  ~Blas();
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;
  void* handle(int device);  // cublasHandle_t
  // At least `bytes` of device memory on `device`, kept for later calls (grown as needed;
  // work is enqueued on one stream per instance, so a later call's copy into it runs after
  // the earlier call's kernels read it).
  void* scratch(int device, size_t bytes);

 private:
  void* handle_ = nullptr;
  int device_ = -1;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
};

struct Device {
  int device = 0;
  void* stream = nullptr;  // cudaStream_t
  Blas* blas = nullptr;
};

// The layer on device memory (float32); same contract as layer_forward / layer_backward.
// expert_bias, route_experts and route_weights are device pointers too; stats are host.
void layer_forward(const LayerConfig& cfg, Exchange& ex, const ForwardCall<float>& call,
                   LayerStats& stats, const Device& dev);
void layer_backward(const LayerConfig& cfg, Exchange& ex, const BackwardCall<float>& call,
                    const Device& dev);

// dispatch / combine alone (loom_moe_dispatch_args) on device memory: route_experts and
// route_weights (or null) [S, k] device; rows [row_capacity, M] device in the expert layout;
// local_counts (dispatch, host [local_experts]).
void dispatch_alone(Exchange& ex, int num_experts, int k, int64_t tokens, int64_t model_dim,
                    const float* x, const int32_t* route_experts, const float* route_weights,
                    float* rows, int64_t row_capacity, int64_t* local_counts, const Device& dev);
void combine_alone(Exchange& ex, int num_experts, int k, int64_t tokens, int64_t model_dim,
                   const float* rows, int64_t row_capacity, const int32_t* route_experts,
                   const float* route_weights, float* y, const Device& dev);

// The routing on the device (routing_cuda.cu), bit-identical to the host's functions
// (gating.hpp: top_k_choices, apply_capacity, combine_weights, aux_loss; dispatch.hpp:
// build_slots): from gate_probs' probabilities [S, E] and bias [E] (device, or null) it
// writes, on device, each token's choices, its route after capacity, its combine weights and
// its slots [S, k]. `scratch` is device memory of route_scratch_words int64 words (the
// layer's workspace holds them). It then
// waits for the stream and returns what the host needs, O(E) numbers: the rows per expert
// (the exchange's counts and the expert GEMMs' sizes), the choices per expert, the drops and
// the aux loss.
struct RouteBuffers {
  int32_t* choice;
  int32_t* route;
  float* weights;
  int64_t* slot;
};
struct RouteSummary {
  std::vector<int64_t> send_counts;  // [E] kept rows per expert
  std::vector<int64_t> load;         // [E] choices per expert, before capacity
  int64_t send_rows = 0;
  int64_t dropped = 0;
  double aux_loss = 0.0;
};
// order and places [S k] each, keys [S], per bucket [E k] three times, per expert [E] twice,
// and the summary [2 E + 2]
inline int64_t route_scratch_words(int num_experts, int k, int64_t tokens) {
  const int64_t E = num_experts;
  return 2 * tokens * k + tokens + 3 * E * k + 2 * E + (2 * E + 2);
}
void route_on_device(const GateConfig& cfg, const float* probs, int64_t tokens, const float* bias,
                     int64_t capacity, const RouteBuffers& out, int64_t* scratch,
                     RouteSummary& summary, void* stream);
// The host's gate_dlogits on the device (enqueued, no wait); scratch: num_experts * k words.
void gate_dlogits(const GateConfig& cfg, int64_t tokens, const float* probs, const int32_t* choice,
                  const int32_t* route, const float* dweights, double aux_loss_coef, float* dlogits,
                  int64_t* scratch, void* stream);
// dispatch / combine alone: build_slots over a caller's route_experts [S, k] (device), slots
// [S, k] on device; scratch: 2 * num_experts + 1 words. Waits for the stream.
struct AloneSlots {
  std::vector<int64_t> counts;  // [E] rows per expert
  int64_t send_rows = 0;
  int64_t bad_pair = -1;  // the first pair outside [-1, E), or -1
  int32_t bad_value = 0;
};
AloneSlots alone_slots(const int32_t* route, int64_t tokens, int k, int num_experts, int64_t* slot,
                       int64_t* scratch, void* stream);

// The kernels, for the layer and the tests (device pointers, launched on `stream`).
void gate_probs(const GateConfig& cfg, const float* x, int64_t tokens, int64_t model_dim,
                const float* gate_w, float* probs, void* stream);
// dx += (dlogits . gate_w) * jitter; dgate_w += dlogits^T (x * jitter)
void gate_input_grads(const GateConfig& cfg, const float* x, int64_t tokens, int64_t model_dim,
                      const float* gate_w, const float* dlogits, float* dx, float* dgate_w,
                      void* stream);
void gather_rows(const float* x, int64_t tokens, int64_t model_dim, int k, const int64_t* slot,
                 const float* weights, float* rows, void* stream);
void combine_rows(const float* rows, int64_t tokens, int64_t model_dim, int k, const int64_t* slot,
                  const float* weights, float* y, bool accumulate, void* stream);
void combine_weight_grad(const float* rows, const float* dy, int64_t tokens, int64_t model_dim,
                         int k, const int64_t* slot, float* dweights, void* stream);
// Reserves the device scratch experts_forward / experts_backward use for up to
// `local_experts` experts (Blas::scratch), so a layer allocates before its exchanges, where
// a failure can still stop every rank together, and not between them.
void reserve_experts(const Device& dev, int local_experts);
// rows: host counts per local expert
void experts_forward(Activation act, int local_experts, const int64_t* rows, int64_t model_dim,
                     int64_t hidden_dim, const float* in, const ExpertWeights<float>& w, float* pre,
                     float* h, float* out, const Device& dev);
void experts_backward(Activation act, int local_experts, const int64_t* rows, int64_t model_dim,
                      int64_t hidden_dim, const float* in, const float* pre, const float* dout,
                      const ExpertWeights<float>& w, const ExpertGrads<float>& g, float* h,
                      float* dh, float* din, const Device& dev);

// A 16-bit tensor widened to float32, and float32 rounded back to nearest even
// (plugins/common/float16_io.hpp's rule), on device `device` and `stream`: the plugin's 16-bit
// calls stage through the workspace with these (common/float16_stage.hpp).
void widen_floats(int device, const void* src, loom::plugins::float16::Storage s, float* dst,
                  int64_t n, void* stream);
void narrow_floats(int device, const float* src, loom::plugins::float16::Storage s, void* dst,
                   int64_t n, void* stream);

}  // namespace loom::moe::cuda
