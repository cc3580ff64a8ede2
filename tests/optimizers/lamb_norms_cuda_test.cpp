// LAMB's CUDA norms (kernels/cuda.hpp lamb_norms, the pass lamb() runs): deterministic and
// close to the CPU's. Determinism is checked where it could break on a GPU: the same tensor
// alone, behind other tensors in the same launch (other block indices), in a later launch (more
// than 24 tensors), run again, and with its blocks run last to first (under the CUDA
// emulation, EMU_CUDA_BLOCK_ORDER=reverse: float atomics would change bits there) must give
// bit-identical norms. Agreement: against
// lamb_moments_cpu on odd sizes within the stated relative 1e-5 (both sum fp32 values; the CPU
// in fp32 SIMD lanes, CUDA in fp64), and against a long double sum within 1e-12 (the CUDA
// sums are fp64 throughout). Skips without a CUDA device.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu.hpp"
#include "kernels/cuda.hpp"

namespace {

namespace cu = loom::optim::cuda;
using loom::optim::DType;
using loom::optim::LambHyper;
using loom::optim::TensorRef;

constexpr double kCpuTolerance = 1e-5;  // relative, CUDA vs lamb_moments_cpu (docs/optimizers.md)

class LambNormsCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cu::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

// One tensor's host data; m and v start random (a later step), g is fp32.
struct HostTensor {
  HostTensor(std::size_t n, uint32_t seed) : p(n), g(n), m(n), v(n) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d(0.0f, 1.0f);
    for (std::size_t i = 0; i < n; ++i) {
      p[i] = d(rng);
      g[i] = d(rng) * 0.1f;
      m[i] = d(rng) * 0.01f;
      v[i] = std::fabs(d(rng)) * 1e-4f;
    }
  }
  std::vector<float> p, g, m, v;
};

// The same tensor in device memory, re-uploaded before every pass (pass 1 updates m and v).
class DeviceTensor {
 public:
  explicit DeviceTensor(const HostTensor& h) : h_(h) {
    for (auto** ptr : {&p_, &g_, &m_, &v_}) {
      void* raw = nullptr;
      EXPECT_EQ(cu::alloc(&raw, std::max<std::size_t>(h.p.size(), 1) * 4, 0), "");
      *ptr = static_cast<float*>(raw);
    }
  }
  ~DeviceTensor() {
    for (float* ptr : {p_, g_, m_, v_}) cu::free(ptr);
  }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  TensorRef fresh() {
    const std::size_t bytes = h_.p.size() * 4;
    if (bytes != 0) {
      EXPECT_EQ(cu::copy_to_device(p_, h_.p.data(), bytes, nullptr), "");
      EXPECT_EQ(cu::copy_to_device(g_, h_.g.data(), bytes, nullptr), "");
      EXPECT_EQ(cu::copy_to_device(m_, h_.m.data(), bytes, nullptr), "");
      EXPECT_EQ(cu::copy_to_device(v_, h_.v.data(), bytes, nullptr), "");
    }
    TensorRef t;
    t.p = p_;
    t.g = g_;
    t.gtype = DType::kF32;
    t.m = m_;
    t.v = v_;
    t.n = h_.p.size();
    return t;
  }

 private:
  const HostTensor& h_;
  float* p_ = nullptr;
  float* g_ = nullptr;
  float* m_ = nullptr;
  float* v_ = nullptr;
};

LambHyper hyper() {
  LambHyper h;
  h.set_betas(0.9, 0.999);
  h.eps = 1e-6f;
  h.wd = 0.01f;
  h.inv_bc1 = 1.0f / 0.19f;
  h.inv_bc2_sqrt = 1.0f / std::sqrt(0.001999f);
  return h;
}

// The norms of tensors [0, count) on the device, each uploaded fresh.
std::vector<double> device_norms(std::vector<DeviceTensor*> ts) {
  std::vector<TensorRef> refs;
  for (DeviceTensor* t : ts) refs.push_back(t->fresh());
  std::vector<double> out(2 * refs.size(), -1.0);
  EXPECT_EQ(cu::lamb_norms(refs.data(), refs.size(), hyper(), out.data(), nullptr), "");
  return out;
}

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

TEST_F(LambNormsCuda, AgreeWithTheCpuOnOddSizes) {
  const LambHyper h = hyper();
  for (std::size_t n :
       {std::size_t{1}, std::size_t{7}, std::size_t{255}, std::size_t{4095}, std::size_t{4097},
        std::size_t{16385}, std::size_t{100003}, std::size_t{1048583}}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    const HostTensor host(n, static_cast<uint32_t>(n));
    DeviceTensor dev(host);
    const std::vector<double> got = device_norms({&dev});
    // The CPU kernel on a copy.
    HostTensor cpu = host;
    TensorRef t;
    t.p = cpu.p.data();
    t.g = cpu.g.data();
    t.m = cpu.m.data();
    t.v = cpu.v.data();
    t.n = n;
    double sp = 0.0;
    double su = 0.0;
    loom::optim::lamb_moments_cpu(t, h, &sp, &su);
    EXPECT_LE(std::fabs(got[0] - sp), kCpuTolerance * sp) << got[0] << " vs " << sp;
    EXPECT_LE(std::fabs(got[1] - su), kCpuTolerance * su) << got[1] << " vs " << su;
    // sum p^2 in long double: CUDA's fp64 sums are far closer than the tolerance above.
    long double exact = 0.0L;
    for (float x : host.p) exact += static_cast<long double>(x) * x;
    EXPECT_LE(std::fabs(static_cast<long double>(got[0]) - exact), 1e-12L * exact);
    EXPECT_GT(got[1], 0.0);
  }
}

TEST_F(LambNormsCuda, BitIdenticalAcrossRunsAndBatchings) {
  const HostTensor target_host(300007, 42);
  DeviceTensor target(target_host);
  // Neighbours of assorted sizes, some empty.
  std::vector<HostTensor> other_host;
  for (std::size_t i = 0; i < 30; ++i) {
    other_host.emplace_back(i % 7 == 3 ? 0 : 1 + 97 * i * i, static_cast<uint32_t>(i + 1));
  }
  std::vector<std::unique_ptr<DeviceTensor>> others;
  for (const HostTensor& o : other_host) others.push_back(std::make_unique<DeviceTensor>(o));

  const std::vector<double> alone = device_norms({&target});
  ASSERT_GT(alone[0], 0.0);
  // Run again, and with the blocks in reverse order (emulation; a GPU ignores the variable).
  const std::vector<double> again = device_norms({&target});
  EXPECT_TRUE(same_bits(alone[0], again[0]) && same_bits(alone[1], again[1]));
  ASSERT_EQ(setenv("EMU_CUDA_BLOCK_ORDER", "reverse", 1), 0);
  const std::vector<double> reversed = device_norms({&target});
  unsetenv("EMU_CUDA_BLOCK_ORDER");
  EXPECT_TRUE(same_bits(alone[0], reversed[0]) && same_bits(alone[1], reversed[1]))
      << alone[0] << " vs " << reversed[0];
  // Behind 5 neighbours in one launch, and behind 30 (so in the second launch).
  for (std::size_t before : {std::size_t{5}, std::size_t{30}}) {
    SCOPED_TRACE("after " + std::to_string(before) + " tensors");
    std::vector<DeviceTensor*> list;
    for (std::size_t i = 0; i < before; ++i) list.push_back(others[i].get());
    list.push_back(&target);
    const std::vector<double> r = device_norms(list);
    EXPECT_TRUE(same_bits(alone[0], r[2 * before])) << alone[0] << " vs " << r[2 * before];
    EXPECT_TRUE(same_bits(alone[1], r[2 * before + 1]));
    // Empty tensors report zero norms.
    for (std::size_t i = 0; i < before; ++i) {
      if (other_host[i].p.empty()) EXPECT_EQ(r[2 * i], 0.0);
    }
  }
  // First, with neighbours after it.
  std::vector<DeviceTensor*> list{&target};
  for (auto& o : others) list.push_back(o.get());
  const std::vector<double> first = device_norms(list);
  EXPECT_TRUE(same_bits(alone[0], first[0]) && same_bits(alone[1], first[1]));
}

}  // namespace
