// The optimizers' CUDA interface without CUDA (kernels/cuda.hpp, kernels/onebit_cuda.hpp,
// kernels/finite.hpp's cuda part, stream_order.hpp's events): no devices, nothing to order or
// free, and every kernel UNIMPLEMENTED. collect() refuses CUDA tensors before these run.
#include <loom/sdk/no_cuda.hpp>

#include <string>

#include "kernels/cuda.hpp"
#include "kernels/finite.hpp"
#include "kernels/onebit_cuda.hpp"
#include "stream_order.hpp"

namespace loom::optim::cuda {

namespace {
[[noreturn]] void refuse() { loom::sdk::throw_built_without_cuda("an optimizer step on CUDA"); }
}  // namespace

bool have_cuda() { return false; }
int device_count() { return 0; }

std::string adam(const TensorRef*, std::size_t, const AdamHyper&, void*) { refuse(); }
std::string lamb(const TensorRef*, std::size_t, const LambHyper&, float, float, float, void*) {
  refuse();
}
std::string lamb_norms(const TensorRef*, std::size_t, const LambHyper&, double*, void*) {
  refuse();
}
std::string alloc(void**, std::size_t, int) { refuse(); }
void free(void*) {}
std::string memset_zero(void*, std::size_t, void*) { refuse(); }
std::string copy_to_host(void*, const void*, std::size_t, void*) { refuse(); }
std::string copy_to_device(void*, const void*, std::size_t, void*) { refuse(); }

std::string flag_nonfinite(const FiniteInput*, std::size_t, float, float*, void*) { refuse(); }

// No event is ever recorded without CUDA: waiting on or destroying none is nothing.
std::string event_record(void**, void*, int) { refuse(); }
std::string event_wait(void* event, void*, int) {
  if (event != nullptr) refuse();
  return {};
}
std::string event_synchronize(void* event) {
  if (event != nullptr) refuse();
  return {};
}
void event_destroy(void*) {}

namespace onebit {

std::string load_grad(const Segment*, std::size_t, float*, float, void*) { refuse(); }
std::string momentum(float*, const float*, std::size_t, Decay, void*) { refuse(); }
std::string momentum_segments(const Segment*, std::size_t, float*, const float*, float*, Decay,
                              void*) {
  refuse();
}
std::string mask_multiply(const Segment*, std::size_t, float*, void*) { refuse(); }
std::string apply_adam(const Segment*, std::size_t, float*, const float*, float, float, void*) {
  refuse();
}
std::string zero_one_local(const Segment*, std::size_t, const float*, const float*, float*, float,
                           float, float, void*) {
  refuse();
}
std::string zero_one_sync_pre(const Segment*, std::size_t, const float*, float*, float, float,
                              void*) {
  refuse();
}
std::string add_update(const Segment*, std::size_t, const float*, void*) { refuse(); }
std::string zero_one_sync_post(const Segment*, std::size_t, float*, const float*, float*, float,
                               float, float, void*) {
  refuse();
}
std::string copy_out(const Segment*, std::size_t, void*) { refuse(); }
std::string lamb_warmup_moments(const Segment*, std::size_t, const float*, float*, float*, Decay,
                                Decay, float, float, float, double*, void*) {
  refuse();
}
std::string sum_squares(const Segment*, std::size_t, const float*, double*, void*) { refuse(); }
std::string lamb_post(const Segment*, std::size_t, float*, const float*, const float*, float*,
                      Decay, Decay, float, float, float, float, LambPostStats*, void*) {
  refuse();
}
std::string lamb_apply(const Segment*, std::size_t, const float*, const float*, float, float, float,
                       void*) {
  refuse();
}
std::string copy_device(void*, const void*, std::size_t, void*) { refuse(); }

}  // namespace onebit
}  // namespace loom::optim::cuda
