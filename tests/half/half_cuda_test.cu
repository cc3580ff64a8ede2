// plugins/common/half.hpp in device code against the same functions on the host, bit for
// bit: every fp16 / bf16 pattern widened on the device, and the probe floats of
// tests/half/reference.hpp narrowed on the device. Runs on a GPU, or on the CPU under the CUDA
// emulation (tests/cuda_emulation); skips without a device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "common/half.hpp"
#include "reference.hpp"

namespace {

namespace h = loom::plugins::half;

__global__ void widen_kernel(uint32_t n, uint32_t* f16_out, uint32_t* bf16_out) {
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  f16_out[i] = h::float_bits(h::f16_to_f32(static_cast<uint16_t>(i)));
  bf16_out[i] = h::float_bits(h::bf16_to_f32(static_cast<uint16_t>(i)));
}

__global__ void narrow_kernel(const uint32_t* in, uint32_t n, uint16_t* f16_out,
                              uint16_t* bf16_out) {
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float f = h::bits_float(in[i]);
  f16_out[i] = h::f32_to_f16(f);
  bf16_out[i] = h::f32_to_bf16(f);
}

template <class T>
struct Device {
  explicit Device(size_t count) : n(count) {
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&ptr), count * sizeof(T)), cudaSuccess);
  }
  ~Device() { cudaFree(ptr); }
  std::vector<T> to_host() const {
    std::vector<T> v(n);
    EXPECT_EQ(cudaMemcpy(v.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }
  T* ptr = nullptr;
  size_t n;
};

class HalfCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      (void)cudaGetLastError();
      GTEST_SKIP() << "no CUDA device";
    }
  }
};

TEST_F(HalfCuda, WideningMatchesTheHostForEveryPattern) {
  constexpr uint32_t n = 0x10000;
  Device<uint32_t> f16(n), bf16(n);
  widen_kernel<<<n / 256, 256>>>(n, f16.ptr, bf16.ptr);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint32_t> a = f16.to_host();
  const std::vector<uint32_t> b = bf16.to_host();
  int failures = 0;
  for (uint32_t i = 0; i < n; ++i) {
    const auto x = static_cast<uint16_t>(i);
    if (a[i] != h::float_bits(h::f16_to_f32(x)) && failures++ < 10) {
      ADD_FAILURE() << "f16 " << i << ": device " << a[i];
    }
    if (b[i] != h::float_bits(h::bf16_to_f32(x)) && failures++ < 10) {
      ADD_FAILURE() << "bf16 " << i << ": device " << b[i];
    }
  }
  EXPECT_EQ(failures, 0);
}

TEST_F(HalfCuda, NarrowingMatchesTheHostAndTheReference) {
  const std::vector<uint32_t> in = half_ref::probe_floats();
  const auto n = static_cast<uint32_t>(in.size());
  Device<uint32_t> din(n);
  Device<uint16_t> f16(n), bf16(n);
  ASSERT_EQ(cudaMemcpy(din.ptr, in.data(), n * sizeof(uint32_t), cudaMemcpyHostToDevice),
            cudaSuccess);
  narrow_kernel<<<(n + 255) / 256, 256>>>(din.ptr, n, f16.ptr, bf16.ptr);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint16_t> a = f16.to_host();
  const std::vector<uint16_t> b = bf16.to_host();
  int failures = 0;
  for (uint32_t i = 0; i < n; ++i) {
    const float f = h::bits_float(in[i]);
    const uint16_t want16 = h::f32_to_f16(f);
    const uint16_t wantb = h::f32_to_bf16(f);
    const bool ok = a[i] == want16 && b[i] == wantb && want16 == half_ref::to_f16(f) &&
                    wantb == half_ref::to_bf16(f);
    if (!ok && failures++ < 10) {
      ADD_FAILURE() << std::hex << "f32 0x" << in[i] << ": device f16 0x" << a[i] << " bf16 0x"
                    << b[i] << ", host f16 0x" << want16 << " bf16 0x" << wantb;
    }
  }
  EXPECT_EQ(failures, 0);
}

}  // namespace
