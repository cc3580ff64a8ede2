// CUDA emulation (tests/cuda_emulation): checks that the emulator itself catches what it is
// there to catch (docs/gpu.md "Without a GPU"). Built only with LOOM_CUDA_EMULATION=ON, through
// loom_cuda_sources() like the product's .cu files, so the launch rewriter is tested too.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <vector>

namespace {

__global__ void fill(float* p, int n, float v) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) p[i] = v;
}

// Needs every thread of the block at once, though its own body shows no barrier or shared
// memory: the rewriter must find them in the __device__ functions it calls and launch it
// cooperatively (sequentially, __syncthreads aborts).
__device__ float* scratch() {
  __shared__ float s[64];
  return s;
}

__device__ void tree_sum(float* s) {
  __syncthreads();
  for (unsigned k = blockDim.x / 2; k > 0; k >>= 1) {
    if (threadIdx.x < k) s[threadIdx.x] += s[threadIdx.x + k];
    __syncthreads();
  }
}

__global__ void block_sum(const float* p, float* out) {
  float* s = scratch();
  s[threadIdx.x] = p[blockIdx.x * blockDim.x + threadIdx.x];
  tree_sum(s);
  if (threadIdx.x == 0) out[blockIdx.x] = s[0];
}

// The checks below report on purpose: count them instead of aborting.
class CudaEmulation : public ::testing::Test {
 protected:
  void SetUp() override {
    unsetenv("EMU_CUDA_ABORT");
    ASSERT_EQ(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override { EXPECT_EQ(cudaStreamDestroy(s_), cudaSuccess); }
  cudaStream_t s_ = nullptr;
};

TEST_F(CudaEmulation, StreamWorkRunsOnlyAtSyncPoints) {
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 64 * sizeof(float)), cudaSuccess);
  fill<<<1, 64, 0, s_>>>(d, 64, 1.0f);
  float h = 0.0f;
  // The legacy stream does not wait for a non-blocking stream: still the poison (NaN).
  ASSERT_EQ(cudaMemcpy(&h, d, sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_TRUE(std::isnan(h));
  ASSERT_EQ(cudaStreamSynchronize(s_), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(&h, d, sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(h, 1.0f);
  EXPECT_EQ(cudaFree(d), cudaSuccess);
}

TEST_F(CudaEmulation, CooperativeKernelsSeeTheirBarriers) {
  float* d = nullptr;
  float* out = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 128 * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&out, 2 * sizeof(float)), cudaSuccess);
  fill<<<2, 64, 0, s_>>>(d, 128, 0.5f);
  block_sum<<<2, 64, 0, s_>>>(d, out);
  std::vector<float> h(2);
  ASSERT_EQ(cudaMemcpyAsync(h.data(), out, 2 * sizeof(float), cudaMemcpyDeviceToHost, s_),
            cudaSuccess);
  EXPECT_EQ(h[0], 32.0f);
  EXPECT_EQ(h[1], 32.0f);
  EXPECT_EQ(cudaFree(d), cudaSuccess);
  EXPECT_EQ(cudaFree(out), cudaSuccess);
}

TEST_F(CudaEmulation, ReportsHostPointersAndOverruns) {
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 64 * sizeof(float)), cudaSuccess);
  std::vector<float> host(128);
  int before = emu::problems();
  fill<<<1, 64, 0, s_>>>(host.data(), 64, 1.0f);  // a host pointer into a kernel
  EXPECT_EQ(emu::problems(), before + 1);
  before = emu::problems();
  EXPECT_NE(cudaMemcpy(host.data(), d, 128 * sizeof(float), cudaMemcpyDeviceToHost),
            cudaSuccess);  // past the allocation
  EXPECT_EQ(emu::problems(), before + 1);
  before = emu::problems();
  EXPECT_NE(cudaMemcpy(d, host.data(), sizeof(float), cudaMemcpyDeviceToHost),
            cudaSuccess);  // the kinds swapped
  EXPECT_EQ(emu::problems(), before + 1);
  ASSERT_EQ(cudaStreamSynchronize(s_), cudaSuccess);
  EXPECT_EQ(cudaFree(d), cudaSuccess);
}

}  // namespace
