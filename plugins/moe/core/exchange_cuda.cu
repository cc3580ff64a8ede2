// The device half of Exchange::reduce_gradients: the division of a summed gradient by the
// world size, in place on the caller's stream (so a transport that reduces device memory
// itself never sends the gradients through the host).
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

}  // namespace loom::moe::cuda
