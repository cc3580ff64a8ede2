// The CUDA side of stream_order.hpp (built into the kernels library when CUDA is on).
#include "stream_order.hpp"

#include <cuda_runtime_api.h>
#include <loom/sdk/cuda.hpp>

#include <string>

namespace loom::optim::cuda {
namespace {

// Runs `fn` with `device` current (restored after); a CUDA failure comes back as its
// message (call, file, line), success as an empty string, as stream_order.hpp promises.
template <class Fn>
std::string on_device(int device, Fn&& fn) {
  try {
    const loom::sdk::CudaDeviceGuard on(device);
    fn();
    return {};
  } catch (const loom::sdk::Error& e) {
    return e.what();
  }
}

}  // namespace

std::string event_record(void** event, void* stream, int device) {
  return on_device(device, [&] {
    if (*event == nullptr) {
      cudaEvent_t e = nullptr;
      LOOM_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      *event = e;
    }
    LOOM_CUDA_CHECK(
        cudaEventRecord(static_cast<cudaEvent_t>(*event), static_cast<cudaStream_t>(stream)));
  });
}

std::string event_wait(void* event, void* stream, int device) {
  if (event == nullptr) return {};
  return on_device(device, [&] {
    LOOM_CUDA_CHECK(
        cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0));
  });
}

std::string event_synchronize(void* event) {
  if (event == nullptr) return {};
  const cudaError_t r = cudaEventSynchronize(static_cast<cudaEvent_t>(event));
  return r == cudaSuccess ? std::string()
                          : loom::sdk::cuda_failure(r, "cudaEventSynchronize", __FILE__, __LINE__);
}

void event_destroy(void* event) {
  if (event != nullptr) (void)cudaEventDestroy(static_cast<cudaEvent_t>(event));
}

}  // namespace loom::optim::cuda
