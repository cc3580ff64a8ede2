// DeviceOps: how the SDK's collectives (CompressedAllreduce and the hierarchical one) move
// device memory that neither the codec nor the transport moves for them, and the ordering
// events they use across streams. The header itself does not link CUDA: define
// LOOM_SDK_CUDA_RUNTIME before including it to get cuda_device_ops() over the CUDA runtime
// (then link CUDA::cudart).
#ifndef LOOM_SDK_DEVICE_OPS_HPP
#define LOOM_SDK_DEVICE_OPS_HPP

#include <loom/sdk/status.hpp>

#include <cstddef>
#include <functional>
#include <string>

#ifdef LOOM_SDK_CUDA_RUNTIME
#include <cuda_runtime_api.h>
#endif

namespace loom::sdk {

// What the compressed allreduce needs to move device memory that neither the codec nor the
// transport does for it. Unused (and may stay empty) for host memory. Each throws Error on
// failure.
struct DeviceOps {
  // Device to device, ordered on `stream`.
  std::function<void(void* dst, const void* src, std::size_t bytes, void* stream)> copy;
  // Sets `bytes` bytes to zero, ordered on `stream`.
  std::function<void(void* dst, std::size_t bytes, void* stream)> zero;
  // Synchronous copies between host and device (state export/import only).
  std::function<void(void* host_dst, const void* device_src, std::size_t bytes, void* stream)>
      to_host;
  std::function<void(void* device_dst, const void* host_src, std::size_t bytes, void* stream)>
      from_host;
  // Ordering across streams (optional; needed to run on more than one stream). Creates
  // *event on first use (on the buffers' device) and records it after the work queued so far
  // on `stream`.
  std::function<void(void** event, void* stream)> record_event;
  // Work queued on `stream` after this starts after the event's last record.
  std::function<void(void* event, void* stream)> wait_event;
  // Destroys an event record_event created (at destruction).
  std::function<void(void* event)> destroy_event;
};

#ifdef LOOM_SDK_CUDA_RUNTIME
// DeviceOps over the CUDA runtime.
inline DeviceOps cuda_device_ops() {
  auto ok = [](cudaError_t e, const char* what) {
    if (e != cudaSuccess) {
      throw Error(LOOM_ERR_INTERNAL, std::string(what) + ": " + cudaGetErrorString(e));
    }
  };
  DeviceOps ops;
  ops.copy = [ok](void* dst, const void* src, std::size_t bytes, void* stream) {
    ok(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice,
                       static_cast<cudaStream_t>(stream)),
       "cudaMemcpyAsync");
  };
  ops.zero = [ok](void* dst, std::size_t bytes, void* stream) {
    ok(cudaMemsetAsync(dst, 0, bytes, static_cast<cudaStream_t>(stream)), "cudaMemsetAsync");
  };
  ops.to_host = [ok](void* dst, const void* src, std::size_t bytes, void* stream) {
    ok(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, static_cast<cudaStream_t>(stream)),
       "cudaMemcpyAsync");
    ok(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "cudaStreamSynchronize");
  };
  ops.from_host = [ok](void* dst, const void* src, std::size_t bytes, void* stream) {
    ok(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, static_cast<cudaStream_t>(stream)),
       "cudaMemcpyAsync");
    ok(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "cudaStreamSynchronize");
  };
  // Events are created on the current device, which must be the buffers' device.
  ops.record_event = [ok](void** event, void* stream) {
    if (*event == nullptr) {
      cudaEvent_t e = nullptr;
      ok(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
      *event = e;
    }
    ok(cudaEventRecord(static_cast<cudaEvent_t>(*event), static_cast<cudaStream_t>(stream)),
       "cudaEventRecord");
  };
  ops.wait_event = [ok](void* event, void* stream) {
    ok(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0),
       "cudaStreamWaitEvent");
  };
  ops.destroy_event = [](void* event) { (void)cudaEventDestroy(static_cast<cudaEvent_t>(event)); };
  return ops;
}
#endif

}  // namespace loom::sdk

#endif  // LOOM_SDK_DEVICE_OPS_HPP
