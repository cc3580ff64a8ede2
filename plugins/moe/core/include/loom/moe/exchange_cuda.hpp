// Part of the MoE core's declared public interface (moe_cuda.hpp needs it).
// The CUDA runtime calls of the expert-parallel exchange (exchange.cpp), behind plain
// functions so exchange.cpp has no CUDA code of its own. Built twice (docs/sdk.md "CPU and
// CUDA"): by exchange_cuda.cu with CUDA, by moe_cuda_stub.cpp without (have_cuda false, the
// rest UNIMPLEMENTED, the cleanup calls no-ops). A CUDA failure throws loom::sdk::Error
// (INTERNAL) "moe exchange: <what>: <CUDA's message>".
#pragma once

#include <cstddef>
#include <cstdint>

namespace loom::moe::cuda {

// Whether this build has the CUDA half (false: moe_cuda_stub.cpp).
bool have_cuda();

// v[i] = v[i] / by on the stream.
void divide_in_place(float* v, int64_t n, float by, void* stream);

// A device-to-device copy queued on the stream.
void copy_on_device(void* dst, const void* src, std::size_t bytes, void* stream);
// Device to host, or host to device, then the stream synchronised (bytes may be 0).
void copy_to_host(void* dst, const void* src, std::size_t bytes, void* stream);
void copy_to_device(void* dst, const void* src, std::size_t bytes, void* stream);
// Synchronous copies on the legacy default stream (host <-> device).
void copy_to_host_now(void* dst, const void* src, std::size_t bytes);
void copy_to_device_now(void* dst, const void* src, std::size_t bytes);
void synchronize(void* stream);

int current_device();
// Device memory on the current device; free_on frees p (allocated on `device`) from any
// current device, best effort (never throws: it runs in destructors).
void* allocate(std::size_t bytes, const char* what);
void free_on(int device, void* p) noexcept;

// Makes `device` current for a scope and restores the caller's afterwards.
class DeviceScope {
 public:
  explicit DeviceScope(int device);
  ~DeviceScope();
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

}  // namespace loom::moe::cuda
