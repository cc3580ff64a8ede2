// loom/sdk/cuda.hpp: the device guard restores the caller's device, also when the scope
// throws, and LOOM_CUDA_CHECK names the call, file and line. Needs two CUDA devices (the
// CUDA emulation gives two); skips otherwise.
#include <gtest/gtest.h>
#include <loom/sdk/cuda.hpp>

#include <stdexcept>
#include <string>

namespace {

int current_device() {
  int d = -1;
  EXPECT_EQ(cudaGetDevice(&d), cudaSuccess);
  return d;
}

void need_two_devices() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2) {
    (void)cudaGetLastError();
    GTEST_SKIP() << "needs two CUDA devices";
  }
}

}  // namespace

TEST(SdkCudaGuard, SetsTheDeviceForTheScopeAndRestoresTheCallers) {
  need_two_devices();
  if (IsSkipped()) return;
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  {
    const loom::sdk::CudaDeviceGuard g(1);
    EXPECT_EQ(current_device(), 1);
    {
      const loom::sdk::CudaDeviceGuard same(1);  // nested, same device: nothing to undo
      EXPECT_EQ(current_device(), 1);
    }
    EXPECT_EQ(current_device(), 1);
  }
  EXPECT_EQ(current_device(), 0);
  try {
    const loom::sdk::CudaDeviceGuard g(1);
    throw std::runtime_error("the call failed");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(current_device(), 0);
}

TEST(SdkCudaGuard, ABadDeviceIsAnErrorAndChangesNothing) {
  need_two_devices();
  if (IsSkipped()) return;
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  try {
    const loom::sdk::CudaDeviceGuard g(99);
    FAIL() << "device 99 was accepted";
  } catch (const loom::sdk::Error& e) {
    EXPECT_EQ(e.code(), LOOM_ERR_UNAVAILABLE);
    EXPECT_NE(std::string(e.what()).find("cudaSetDevice failed at cuda.hpp:"), std::string::npos)
        << e.what();
  }
  (void)cudaGetLastError();
  EXPECT_EQ(current_device(), 1);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
}

TEST(SdkCudaCheck, NamesTheCallFileAndLine) {
  need_two_devices();
  if (IsSkipped()) return;
  try {
    LOOM_CUDA_CHECK(cudaSetDevice(-5));
    FAIL() << "cudaSetDevice(-5) passed";
  } catch (const loom::sdk::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("cudaSetDevice(-5) failed at cuda_guard_test.cpp:"), std::string::npos)
        << what;
    EXPECT_EQ(e.code(), LOOM_ERR_UNAVAILABLE);
  }
  (void)cudaGetLastError();
  EXPECT_NO_THROW(LOOM_CUDA_CHECK(cudaSetDevice(0)));
}
