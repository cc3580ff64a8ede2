// CUDA emulation (tests/cuda_emulation, LOOM_CUDA_EMULATION=ON): the CUDA runtime API (host
// side) for running Loom's CUDA paths on the CPU. A verification tool, not NVIDIA's header:
// only what Loom uses. The state lives in libloom_cuda_emulation.so (cudart.cpp), which the
// build aliases as CUDA::cudart and CUDA::cudart_static.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>

#define EMU_API __attribute__((visibility("default")))

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
};

enum cudaError_t : int {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInitializationError = 3,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidMemcpyDirection = 21,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorNotReady = 600,
  cudaErrorIllegalAddress = 700,
  cudaErrorUnknown = 999,
};
typedef cudaError_t cudaError;
enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4
};
enum cudaMemoryType {
  cudaMemoryTypeUnregistered = 0,
  cudaMemoryTypeHost = 1,
  cudaMemoryTypeDevice = 2,
  cudaMemoryTypeManaged = 3
};
struct cudaPointerAttributes {
  cudaMemoryType type;
  int device;
  void* devicePointer;
  void* hostPointer;
};
struct CUstream_st;
struct CUevent_st;
typedef CUstream_st* cudaStream_t;
typedef CUevent_st* cudaEvent_t;
#define cudaStreamDefault 0x00
#define cudaStreamNonBlocking 0x01
#define cudaEventDefault 0x00
#define cudaEventBlockingSync 0x01
#define cudaEventDisableTiming 0x02
#define cudaStreamLegacy ((cudaStream_t)0x1)
#define cudaStreamPerThread ((cudaStream_t)0x2)

extern "C" {
EMU_API cudaError_t cudaGetDeviceCount(int* count);
EMU_API cudaError_t cudaSetDevice(int device);
EMU_API cudaError_t cudaGetDevice(int* device);
EMU_API cudaError_t cudaMalloc(void** p, size_t bytes);
EMU_API cudaError_t cudaFree(void* p);
EMU_API cudaError_t cudaMallocAsync(void** p, size_t bytes, cudaStream_t s);
EMU_API cudaError_t cudaFreeAsync(void* p, cudaStream_t s);
EMU_API cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind);
EMU_API cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                                    cudaStream_t s);
EMU_API cudaError_t cudaMemset(void* p, int v, size_t bytes);
EMU_API cudaError_t cudaMemsetAsync(void* p, int v, size_t bytes, cudaStream_t s);
EMU_API cudaError_t cudaStreamCreate(cudaStream_t* s);
EMU_API cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags);
EMU_API cudaError_t cudaStreamDestroy(cudaStream_t s);
EMU_API cudaError_t cudaStreamSynchronize(cudaStream_t s);
EMU_API cudaError_t cudaStreamQuery(cudaStream_t s);
EMU_API cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags);
EMU_API cudaError_t cudaDeviceSynchronize(void);
EMU_API cudaError_t cudaEventCreate(cudaEvent_t* e);
EMU_API cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned flags);
EMU_API cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s);
EMU_API cudaError_t cudaEventSynchronize(cudaEvent_t e);
EMU_API cudaError_t cudaEventQuery(cudaEvent_t e);
EMU_API cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t a, cudaEvent_t b);
EMU_API cudaError_t cudaEventDestroy(cudaEvent_t e);
EMU_API const char* cudaGetErrorString(cudaError_t e);
EMU_API const char* cudaGetErrorName(cudaError_t e);
EMU_API cudaError_t cudaGetLastError(void);
EMU_API cudaError_t cudaPeekAtLastError(void);
EMU_API cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* a, const void* p);
}

namespace emu {
// Enqueues a kernel on stream s (checks the stream's device against the current one).
EMU_API cudaError_t enqueue_kernel(cudaStream_t s, const char* name, std::function<void()> fn);
// Device of a device allocation containing p, or -1 (host / unknown).
EMU_API int device_of(const void* p);
// Bytes from p to the end of the device allocation containing it (0 when p is not in one), and
// that allocation's device (-1 when none).
EMU_API size_t device_bytes_from(const void* p, int* device);
EMU_API void report(const char* fmt, ...);
EMU_API void set_last_error(cudaError_t e);
EMU_API int current_device();
// Problems reported so far (the "EMU-CUDA:" lines).
EMU_API int problems();
}  // namespace emu
