#include "device_memory.hpp"

#include <cstdlib>
#include <string>

#include "status.hpp"

#ifdef LOOM_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace loom::host {

void* host_alloc(size_t bytes, size_t align) noexcept {
  if (align == 0) align = 64;
  if ((align & (align - 1)) != 0 || align < sizeof(void*)) return nullptr;
  const size_t rounded = (bytes + align - 1) / align * align;  // aligned_alloc's contract
  return std::aligned_alloc(align, rounded == 0 ? align : rounded);
}

void host_free(void* ptr) noexcept { std::free(ptr); }

loom_status* device_alloc(DLDevice device, size_t bytes, void* stream, void** out) noexcept {
  if (out == nullptr) return make_status(LOOM_ERR_INVALID_ARGUMENT, "device_alloc: out is NULL");
  *out = nullptr;
  if (device.device_type == kDLCPU) {
    *out = host_alloc(bytes, 64);
    return *out != nullptr || bytes == 0
               ? nullptr
               : make_status(LOOM_ERR_RESOURCE_EXHAUSTED, "host allocation failed");
  }
#ifdef LOOM_HAVE_CUDA
  if (device.device_type == kDLCUDA) {
    int current = 0;
    cudaGetDevice(&current);
    if (current != device.device_id) cudaSetDevice(device.device_id);
    const cudaError_t err = cudaMallocAsync(out, bytes, static_cast<cudaStream_t>(stream));
    if (current != device.device_id) cudaSetDevice(current);
    if (err != cudaSuccess) {
      return make_status(
          err == cudaErrorMemoryAllocation ? LOOM_ERR_RESOURCE_EXHAUSTED : LOOM_ERR_UNAVAILABLE,
          (std::string("cudaMallocAsync of ") + std::to_string(bytes) + " bytes on cuda:" +
           std::to_string(device.device_id) + " failed: " + cudaGetErrorString(err))
              .c_str());
    }
    return nullptr;
  }
#else
  (void)stream;
#endif
  return make_status(LOOM_ERR_UNIMPLEMENTED,
                     ("device_alloc: device type " + std::to_string(device.device_type) +
                      " is not supported by this build of Loom")
                         .c_str());
}

loom_status* device_free(DLDevice device, void* ptr, void* stream) noexcept {
  if (device.device_type == kDLCPU) {
    host_free(ptr);
    return nullptr;
  }
#ifdef LOOM_HAVE_CUDA
  if (device.device_type == kDLCUDA) {
    const cudaError_t err = cudaFreeAsync(ptr, static_cast<cudaStream_t>(stream));
    return err == cudaSuccess
               ? nullptr
               : make_status(
                     LOOM_ERR_INTERNAL,
                     (std::string("cudaFreeAsync failed: ") + cudaGetErrorString(err)).c_str());
  }
#else
  (void)ptr;
  (void)stream;
#endif
  return make_status(LOOM_ERR_UNIMPLEMENTED,
                     "device_free: device type not supported by this build of Loom");
}

}  // namespace loom::host
