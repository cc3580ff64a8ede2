// CUDA helpers for plugins with device code (include only where the CUDA runtime headers
// are available): one error check that names the call, file and line, and a guard that
// makes a tensor's device current for a call and restores the caller's afterwards, so a
// plugin never leaves the trainer on a device it did not choose.
#pragma once

#include <cuda_runtime_api.h>
#include <loom/sdk/status.hpp>

#include <cstddef>
#include <string>

namespace loom::sdk {

// "cudaMemcpyAsync failed at kernels.cu:120: invalid argument (cudaErrorInvalidValue)".
inline std::string cuda_failure(cudaError_t e, const char* call, const char* file, int line) {
  std::string where = file;
  const auto slash = where.find_last_of('/');
  if (slash != std::string::npos) where = where.substr(slash + 1);
  return std::string(call) + " failed at " + where + ":" + std::to_string(line) + ": " +
         cudaGetErrorString(e) + " (" + cudaGetErrorName(e) + ")";
}

// Throws loom::sdk::Error (UNAVAILABLE: the device or driver failed) when `e` is an error.
inline void cuda_check(cudaError_t e, const char* call, const char* file, int line) {
  if (e != cudaSuccess) throw Error(LOOM_ERR_UNAVAILABLE, cuda_failure(e, call, file, line));
}

// Sets the current device for a scope and restores the one that was current before.
class CudaDeviceGuard {
 public:
  explicit CudaDeviceGuard(int device) {
    cuda_check(cudaGetDevice(&previous_), "cudaGetDevice", __FILE__, __LINE__);
    if (device != previous_) {
      cuda_check(cudaSetDevice(device), "cudaSetDevice", __FILE__, __LINE__);
      changed_ = true;
    }
  }
  ~CudaDeviceGuard() {
    if (changed_) (void)cudaSetDevice(previous_);  // best effort: a destructor cannot throw
  }
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

// Device scratch (a per-call workspace) allocated on a stream and freed, stream-ordered, when
// the scope ends, also when a check throws.
class CudaScratch {
 public:
  CudaScratch(std::size_t bytes, cudaStream_t stream) : stream_(stream) {
    cuda_check(cudaMallocAsync(&p_, bytes, stream), "cudaMallocAsync", __FILE__, __LINE__);
  }
  ~CudaScratch() {
    if (p_ != nullptr) (void)cudaFreeAsync(p_, stream_);
  }
  CudaScratch(const CudaScratch&) = delete;
  CudaScratch& operator=(const CudaScratch&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(p_);
  }

 private:
  void* p_ = nullptr;
  cudaStream_t stream_;
};

}  // namespace loom::sdk

// LOOM_CUDA_CHECK(cudaMalloc(&p, n)): throws loom::sdk::Error naming the call, file and line.
#define LOOM_CUDA_CHECK(call) ::loom::sdk::cuda_check((call), #call, __FILE__, __LINE__)
