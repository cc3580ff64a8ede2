// The CUDA side of stream_order.hpp (built into the kernels library when CUDA is on).
#include "stream_order.hpp"

#include <cuda_runtime_api.h>

#include <string>

namespace loom::optim::cuda {
namespace {

std::string failure(cudaError_t e, const char* what) {
  return std::string(what) + " failed: " + cudaGetErrorString(e);
}

// Makes `device` current for a scope and restores the caller's device.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      (void)cudaGetLastError();
      return;
    }
    if (previous_ != device) {
      error_ = cudaSetDevice(device);
      changed_ = error_ == cudaSuccess;
    }
  }
  ~DeviceScope() {
    if (changed_) (void)cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  cudaError_t error() const { return error_; }

 private:
  int previous_ = 0;
  bool changed_ = false;
  cudaError_t error_ = cudaSuccess;
};

}  // namespace

std::string event_record(void** event, void* stream, int device) {
  DeviceScope scope(device);
  if (scope.error() != cudaSuccess) return failure(scope.error(), "cudaSetDevice");
  if (*event == nullptr) {
    cudaEvent_t e = nullptr;
    const cudaError_t r = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    if (r != cudaSuccess) return failure(r, "cudaEventCreateWithFlags");
    *event = e;
  }
  const cudaError_t r =
      cudaEventRecord(static_cast<cudaEvent_t>(*event), static_cast<cudaStream_t>(stream));
  return r == cudaSuccess ? std::string() : failure(r, "cudaEventRecord");
}

std::string event_wait(void* event, void* stream, int device) {
  if (event == nullptr) return {};
  DeviceScope scope(device);
  if (scope.error() != cudaSuccess) return failure(scope.error(), "cudaSetDevice");
  const cudaError_t r =
      cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0);
  return r == cudaSuccess ? std::string() : failure(r, "cudaStreamWaitEvent");
}

std::string event_synchronize(void* event) {
  if (event == nullptr) return {};
  const cudaError_t r = cudaEventSynchronize(static_cast<cudaEvent_t>(event));
  return r == cudaSuccess ? std::string() : failure(r, "cudaEventSynchronize");
}

void event_destroy(void* event) {
  if (event != nullptr) (void)cudaEventDestroy(static_cast<cudaEvent_t>(event));
}

}  // namespace loom::optim::cuda
