// What the MoE CUDA tests share: a fixture that skips without a CUDA device and owns a
// stream, and Dev, a device copy of a host vector.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <vector>

namespace moe_test {

class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) GTEST_SKIP() << "no CUDA device";
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  cudaStream_t stream_ = nullptr;
};

// A device copy of a host vector (or of n zero bytes).
template <class T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(const std::vector<T>& host) : n(host.size()) {
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&p), std::max<size_t>(n, 1) * sizeof(T)),
              cudaSuccess);
    const cudaError_t rc =
        n > 0 ? cudaMemcpy(p, host.data(), n * sizeof(T), cudaMemcpyHostToDevice) : cudaSuccess;
    EXPECT_EQ(rc, cudaSuccess);
  }
  explicit Dev(size_t count) : Dev(std::vector<T>(count)) {}
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  std::vector<T> read() const {
    std::vector<T> out(n);
    const cudaError_t rc =
        n > 0 ? cudaMemcpy(out.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost) : cudaSuccess;
    EXPECT_EQ(rc, cudaSuccess);
    return out;
  }
};

}  // namespace moe_test
