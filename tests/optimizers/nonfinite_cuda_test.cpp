// Steps with a NaN or an Inf gradient on CUDA tensors: the finite-check kernel
// (kernels/finite.hpp flag_nonfinite) against a plain loop, and adam, adamw and lamb skipping
// such steps on device tensors (nonfinite_scenario.hpp). Skips when there is no CUDA device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/finite.hpp"
#include "nonfinite_scenario.hpp"

namespace {

using loom::optim::DType;
using loom::optim::FiniteInput;

bool have_device() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return n > 0;
}

loom_test::Memory cuda_memory() {
  loom_test::Memory m;
  m.device = {kDLCUDA, 0};
  m.alloc = [](size_t bytes) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, bytes == 0 ? 1 : bytes), cudaSuccess);
    return p;
  };
  m.release = [](void* p) { EXPECT_EQ(cudaFree(p), cudaSuccess); };
  m.to_device = [](void* d, const void* s, size_t b) {
    EXPECT_EQ(cudaMemcpy(d, s, b, cudaMemcpyHostToDevice), cudaSuccess);
  };
  m.to_host = [](void* d, const void* s, size_t b) {
    EXPECT_EQ(cudaMemcpy(d, s, b, cudaMemcpyDeviceToHost), cudaSuccess);
  };
  return m;
}

float half_to_float(uint16_t h) {
  const int e = (h >> 10) & 31;
  const int m = h & 1023;
  double v = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  if (e == 31) v = m != 0 ? NAN : INFINITY;
  return static_cast<float>((h & 0x8000) != 0 ? -v : v);
}

// One tensor of random 16-bit patterns (any dtype: the bits are read as fp32 pairs, bf16 or
// fp16) with a host copy for the reference.
struct DeviceGrad {
  DType type;
  std::vector<uint16_t> bits;  // fp32 tensors use two per element
  void* dev = nullptr;
  size_t n = 0;
  DeviceGrad(DType t, size_t count, std::mt19937& rng) : type(t), n(count) {
    bits.resize(t == DType::kF32 ? 2 * n : n);
    std::uniform_int_distribution<int> d(-3000, 3000);
    for (size_t i = 0; i < n; ++i) set(i, static_cast<float>(d(rng)) / 128.0f);
    EXPECT_EQ(cudaMalloc(&dev, bits.size() * 2 + 2), cudaSuccess);
  }
  ~DeviceGrad() { cudaFree(dev); }
  DeviceGrad(const DeviceGrad&) = delete;
  DeviceGrad& operator=(const DeviceGrad&) = delete;
  void set(size_t i, float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if (type == DType::kF32) {
      std::memcpy(&bits[2 * i], &u, 4);
    } else if (type == DType::kBF16) {
      bits[i] = static_cast<uint16_t>(u >> 16);  // the values used are exact in bf16
    } else {
      // Exact for the values used (multiples of 2^-7 below 32), and NaN / Inf.
      if (std::isnan(f)) {
        bits[i] = 0x7E00;
      } else if (std::isinf(f)) {
        bits[i] = f > 0 ? 0x7C00 : 0xFC00;
      } else if (f == 0.0f) {
        bits[i] = 0;
      } else {
        int e = 0;
        const double m = std::frexp(std::fabs(static_cast<double>(f)), &e);
        bits[i] = static_cast<uint16_t>((f < 0 ? 0x8000 : 0) | ((e - 1 + 15) << 10) |
                                        static_cast<uint16_t>(std::ldexp(m * 2.0 - 1.0, 10)));
      }
    }
  }
  float get(size_t i) const {
    if (type == DType::kF32) {
      float f;
      std::memcpy(&f, &bits[2 * i], 4);
      return f;
    }
    if (type == DType::kBF16) {
      const uint32_t u = static_cast<uint32_t>(bits[i]) << 16;
      float f;
      std::memcpy(&f, &u, 4);
      return f;
    }
    return half_to_float(bits[i]);
  }
  void upload() {
    ASSERT_EQ(cudaMemcpy(dev, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  }
  FiniteInput input() const { return {dev, type, n}; }
};

float run_flag(const std::vector<FiniteInput>& in, float inv_scale, float start) {
  float* flag = nullptr;
  EXPECT_EQ(cudaMalloc(&flag, 4), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(flag, &start, 4, cudaMemcpyHostToDevice), cudaSuccess);
  cudaStream_t s = nullptr;
  EXPECT_EQ(cudaStreamCreate(&s), cudaSuccess);
  EXPECT_EQ(loom::optim::cuda::flag_nonfinite(in.data(), in.size(), inv_scale, flag, s), "");
  float out = -1.0f;
  EXPECT_EQ(cudaMemcpyAsync(&out, flag, 4, cudaMemcpyDeviceToHost, s), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess);
  EXPECT_EQ(cudaFree(flag), cudaSuccess);
  return out;
}

// 40 tensors (two launches), sizes from 0 to a few chunks, every dtype: a clean list leaves
// the flag 0, one non-finite element anywhere (each tensor in turn, first / middle / last
// element) sets it, as does a finite value that overflows once scaled; a flag already set
// stays set.
TEST(FiniteKernelCuda, MatchesReference) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(23);
  const DType types[] = {DType::kF32, DType::kBF16, DType::kF16};
  std::vector<std::unique_ptr<DeviceGrad>> grads;
  const size_t sizes[] = {0, 1, 255, 256, 257, 4095, 4096, 4097, 10000, 3};
  for (int i = 0; i < 40; ++i) {
    grads.push_back(std::make_unique<DeviceGrad>(types[i % 3], sizes[i % 10], rng));
    grads.back()->upload();
  }
  std::vector<FiniteInput> in;
  for (const auto& g : grads) in.push_back(g->input());
  EXPECT_EQ(run_flag(in, 0.5f, 0.0f), 0.0f);
  EXPECT_EQ(run_flag(in, 0.5f, 1.0f), 1.0f) << "the kernel never clears the flag";
  EXPECT_EQ(run_flag(in, 0.0f, 0.0f), 0.0f) << "inv_scale 0: finite * 0 is finite";
  EXPECT_EQ(run_flag(in, std::numeric_limits<float>::infinity(), 0.0f), 1.0f);
  int checked = 0;
  for (size_t t = 0; t < grads.size(); ++t) {
    DeviceGrad& g = *grads[t];
    if (g.n == 0) continue;
    for (const size_t at : {size_t{0}, g.n / 2, g.n - 1}) {
      for (const float bad :
           {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
            -std::numeric_limits<float>::infinity()}) {
        const float keep = g.get(at);
        g.set(at, bad);
        g.upload();
        EXPECT_EQ(run_flag(in, 0.5f, 0.0f), 1.0f) << "tensor " << t << " element " << at;
        g.set(at, keep);
        g.upload();
        ++checked;
      }
    }
  }
  EXPECT_EQ(run_flag(in, 0.5f, 0.0f), 0.0f) << "restored";
  // Overflow once scaled: 16 * 2^125 is finite as inv_scale, the product is not; the
  // reference agrees on each dtype's value.
  const float big = std::ldexp(1.0f, 125);
  for (const auto& g : grads) {
    float m = 0.0f;
    for (size_t i = 0; i < g->n; ++i) m = std::max(m, std::fabs(g->get(i)));
    if (g->n == 0) continue;
    const bool want_finite = std::isfinite(m * big);
    EXPECT_EQ(run_flag({g->input()}, big, 0.0f), want_finite ? 0.0f : 1.0f);
  }
  EXPECT_GT(checked, 100);
}

const loom_test::Bad kBads[] = {loom_test::Bad::kNaN, loom_test::Bad::kInf, loom_test::Bad::kNegInf,
                                loom_test::Bad::kOverflow};

TEST(SkipNonfiniteCuda, AdamAdamwLambSkipTheStepOnDeviceTensors) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  const loom_test::Memory mem = cuda_memory();
  const char* cases[][2] = {{"adam", "adam_w_mode = false\nweight_decay = 0.01\n"},
                            {"adam", "weight_decay = 0.01\n"},
                            {"lamb", "weight_decay = 0.01\n"}};
  for (const auto& c : cases) {
    for (const loom_test::Bad bad : kBads) {
      loom_test::run_skip_scenario(mem, c[0], c[1], /*f16_grads=*/false, bad, 3);
    }
    loom_test::run_skip_scenario(mem, c[0], c[1], /*f16_grads=*/true, loom_test::Bad::kInf, 2);
  }
}

TEST(SkipNonfiniteCuda, OlderCallersStillSkip) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  const loom_test::Memory mem = cuda_memory();
  for (const char* plugin : {"adam", "lamb"}) loom_test::run_old_caller_scenario(mem, plugin);
}

}  // namespace
