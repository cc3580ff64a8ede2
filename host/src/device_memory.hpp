// Memory the host hands to plugins: aligned host memory, and CUDA device memory
// (stream-ordered) when this build has CUDA.
#pragma once

#include <loom/abi.h>

#include <cstddef>

namespace loom::host {

void* host_alloc(size_t bytes, size_t align) noexcept;
void host_free(void* ptr) noexcept;
loom_status* device_alloc(DLDevice device, size_t bytes, void* stream, void** out) noexcept;
loom_status* device_free(DLDevice device, void* ptr, void* stream) noexcept;

}  // namespace loom::host
