// moe_cuda.hpp and exchange_cuda.hpp without CUDA (or without cuBLAS): have_cuda() is false,
// every call UNIMPLEMENTED, and the cleanup calls do nothing (the *_cuda.cu files are the real
// ones). The plugin and the exchange refuse CUDA tensors before reaching these.
#include <loom/sdk/no_cuda.hpp>

#include <loom/moe/exchange_cuda.hpp>
#include <loom/moe/moe_cuda.hpp>

namespace loom::moe::cuda {

namespace {
[[noreturn]] void refuse() { loom::sdk::throw_built_without_cuda("moe: a CUDA tensor"); }
}  // namespace

bool have_cuda() { return false; }

Blas::~Blas() { (void)handle_, (void)device_, (void)scratch_, (void)scratch_bytes_; }
void* Blas::handle(int) { refuse(); }
void* Blas::scratch(int, size_t) { refuse(); }

void reserve_experts(const Device&, int) { refuse(); }
void layer_forward(const LayerConfig&, Exchange&, const ForwardCall<float>&, LayerStats&,
                   const Device&) {
  refuse();
}
void layer_backward(const LayerConfig&, Exchange&, const BackwardCall<float>&, const Device&) {
  refuse();
}
void dispatch_alone(Exchange&, int, int, int64_t, int64_t, const float*, const int32_t*,
                    const float*, float*, int64_t, int64_t*, const Device&) {
  refuse();
}
void combine_alone(Exchange&, int, int, int64_t, int64_t, const float*, int64_t, const int32_t*,
                   const float*, float*, const Device&) {
  refuse();
}
void gate_probs(const GateConfig&, const float*, int64_t, int64_t, const float*, float*, void*) {
  refuse();
}
void gate_input_grads(const GateConfig&, const float*, int64_t, int64_t, const float*, const float*,
                      float*, float*, void*) {
  refuse();
}
void route_on_device(const GateConfig&, const float*, int64_t, const float*, int64_t,
                     const RouteBuffers&, int64_t*, RouteSummary&, void*) {
  refuse();
}
void gate_dlogits(const GateConfig&, int64_t, const float*, const int32_t*, const int32_t*,
                  const float*, double, float*, int64_t*, void*) {
  refuse();
}
AloneSlots alone_slots(const int32_t*, int64_t, int, int, int64_t*, int64_t*, void*) { refuse(); }
void gather_rows(const float*, int64_t, int64_t, int, const int64_t*, const float*, float*, void*) {
  refuse();
}
void combine_rows(const float*, int64_t, int64_t, int, const int64_t*, const float*, float*, bool,
                  void*) {
  refuse();
}
void combine_weight_grad(const float*, const float*, int64_t, int64_t, int, const int64_t*, float*,
                         void*) {
  refuse();
}
void experts_forward(Activation, int, const int64_t*, int64_t, int64_t, const float*,
                     const ExpertWeights<float>&, float*, float*, float*, const Device&) {
  refuse();
}
void experts_backward(Activation, int, const int64_t*, int64_t, int64_t, const float*, const float*,
                      const float*, const ExpertWeights<float>&, const ExpertGrads<float>&, float*,
                      float*, float*, const Device&) {
  refuse();
}

void divide_in_place(float*, int64_t, float, void*) { refuse(); }
void copy_on_device(void*, const void*, std::size_t, void*) { refuse(); }
void copy_to_host(void*, const void*, std::size_t, void*) { refuse(); }
void copy_to_device(void*, const void*, std::size_t, void*) { refuse(); }
void copy_to_host_now(void*, const void*, std::size_t) { refuse(); }
void copy_to_device_now(void*, const void*, std::size_t) { refuse(); }
void synchronize(void*) { refuse(); }
int current_device() { refuse(); }
void* allocate(std::size_t, const char*) { refuse(); }
void free_on(int, void*) noexcept {}

DeviceScope::DeviceScope(int) { refuse(); }
DeviceScope::~DeviceScope() { (void)previous_, (void)changed_; }  // never constructed

void widen_floats(int, const void*, loom::plugins::float16::Storage, float*, int64_t, void*) {
  refuse();
}
void narrow_floats(int, const float*, loom::plugins::float16::Storage, void*, int64_t, void*) {
  refuse();
}

}  // namespace loom::moe::cuda
