// exchange_cuda.hpp: the exchange's CUDA runtime calls, and the device half of
// Exchange::reduce_gradients: the division of a summed gradient by the world size, in place on
// the caller's stream (so a transport that reduces device memory itself never sends the
// gradients through the host).
#include <loom/sdk/status.hpp>

#include <string>

#include <loom/moe/exchange_cuda.hpp>
#include "cuda_util.cuh"

namespace loom::moe::cuda {
namespace {

__global__ void divide_kernel(float* v, int64_t n, float by) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    v[i] = v[i] / by;
  }
}

}  // namespace

void divide_in_place(float* v, int64_t n, float by, void* stream) {
  if (n <= 0) return;
  divide_kernel<<<blocks_for(n), kThreads, 0, as_stream(stream)>>>(v, n, by);
  check_launch("divide_in_place");
}

namespace {
void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw loom::sdk::Error(LOOM_ERR_INTERNAL,
                           std::string("moe exchange: ") + what + ": " + cudaGetErrorString(e));
  }
}

void copy_sync(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind, void* stream,
               const char* what) {
  auto s = as_stream(stream);
  if (bytes != 0) cuda_ok(cudaMemcpyAsync(dst, src, bytes, kind, s), what);
  cuda_ok(cudaStreamSynchronize(s), "cudaStreamSynchronize");
}
}  // namespace

bool have_cuda() { return true; }

void copy_on_device(void* dst, const void* src, std::size_t bytes, void* stream) {
  cuda_ok(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, as_stream(stream)),
          "cudaMemcpyAsync (device to device)");
}
void copy_to_host(void* dst, const void* src, std::size_t bytes, void* stream) {
  copy_sync(dst, src, bytes, cudaMemcpyDeviceToHost, stream, "cudaMemcpyAsync (to host)");
}
void copy_to_device(void* dst, const void* src, std::size_t bytes, void* stream) {
  copy_sync(dst, src, bytes, cudaMemcpyHostToDevice, stream, "cudaMemcpyAsync (to device)");
}
void copy_to_host_now(void* dst, const void* src, std::size_t bytes) {
  cuda_ok(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy (counts)");
}
void copy_to_device_now(void* dst, const void* src, std::size_t bytes) {
  cuda_ok(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy (counts)");
}
void synchronize(void* stream) {
  cuda_ok(cudaStreamSynchronize(as_stream(stream)), "cudaStreamSynchronize");
}

int current_device() {
  int device = 0;
  cuda_ok(cudaGetDevice(&device), "cudaGetDevice");
  return device;
}
void* allocate(std::size_t bytes, const char* what) {
  void* p = nullptr;
  cuda_ok(cudaMalloc(&p, bytes), what);
  return p;
}
void free_on(int device, void* p) noexcept {
  if (p == nullptr) return;
  int current = 0;
  if (cudaGetDevice(&current) != cudaSuccess) return;
  if (current != device) (void)cudaSetDevice(device);
  (void)cudaFree(p);
  if (current != device) (void)cudaSetDevice(current);
}

DeviceScope::DeviceScope(int device) {
  LOOM_MOE_CUDA(cudaGetDevice(&previous_));
  if (device != previous_) {
    LOOM_MOE_CUDA(cudaSetDevice(device));
    changed_ = true;
  }
}
DeviceScope::~DeviceScope() {
  if (changed_) (void)cudaSetDevice(previous_);  // best effort: a destructor cannot throw
}

}  // namespace loom::moe::cuda
