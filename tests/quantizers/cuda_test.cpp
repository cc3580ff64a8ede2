// The CUDA kernels of the quantizer core (int_cuda.hpp) against the CPU's: quantize,
// dequantize, token-wise INT8 activations and widening bit for bit for every bit width,
// symmetry, range, a set of group sizes and both packings; the weight-only matmul and the
// INT8 epilogue against the CPU within float rounding; non-finite input found and named.
// Skips without a CUDA device (the CUDA emulation provides one).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "int_cuda.hpp"
#include "int_kernels.hpp"
#include "quant_core.hpp"

namespace {

using loom::quant::Groups;
using loom::quant::IntScheme;
using loom::quant::IntWeight;
using loom::quant::Range;

class QuantCuda : public ::testing::Test {
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

template <class T>
struct Dev {
  T* p = nullptr;
  std::size_t n = 0;
  explicit Dev(std::size_t count) : n(count) {
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&p), (count == 0 ? 1 : count) * sizeof(T)),
              cudaSuccess);
  }
  explicit Dev(const std::vector<T>& host) : Dev(host.size()) {
    if (!host.empty()) {
      EXPECT_EQ(cudaMemcpy(p, host.data(), n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  std::vector<T> read() const {
    std::vector<T> out(n);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    if (n > 0) {
      EXPECT_EQ(cudaMemcpy(out.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return out;
  }
};

std::vector<float> sample(int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(rows * cols));
  for (auto& v : x) v = nd(rng);
  for (int64_t c = 0; c < cols && rows >= 2; ++c) {
    x[static_cast<std::size_t>(cols + c)] = c == 0 ? 127.0f : static_cast<float>(c % 9) - 3.5f;
  }
  return x;
}

TEST_F(QuantCuda, QuantizeDequantizeAndWidenMatchTheCpuBitForBit) {
  const int64_t rows = 3, cols = 45;
  const auto x = sample(rows, cols, 31);
  Dev<float> dx(x);
  for (bool sym : {true, false}) {
    for (uint32_t bits = sym ? 2 : 1; bits <= 8; ++bits) {
      for (Range range : {Range::kExact, Range::kDeepSpeed}) {
        for (int64_t group : {0, 7}) {
          {
            // Both orders over the widths (odd widths MSB_FIRST), to keep the emulated run short.
            const int32_t packing =
                bits % 2 == 1 ? LOOM_QUANT_PACK_MSB_FIRST : LOOM_QUANT_PACK_LSB_FIRST;
            SCOPED_TRACE("bits " + std::to_string(bits) + (sym ? " sym" : " asym") + " range " +
                         std::to_string(static_cast<int>(range)) + " group " +
                         std::to_string(group) + " packing " + std::to_string(packing));
            const IntScheme q{bits, sym, range};
            const Groups gs = Groups::of(rows, cols, group);
            const std::size_t bytes = loom::quant::packed_size(rows * cols, bits);
            std::vector<uint8_t> p(bytes);
            std::vector<float> s(gs.count());
            std::vector<uint8_t> z(gs.count());
            ASSERT_EQ(
                loom::quant::quantize_int(x.data(), gs, q, packing, p.data(), s.data(), z.data()),
                -1);
            Dev<uint8_t> dp(std::vector<uint8_t>(bytes, 0xCC));
            Dev<float> ds(gs.count());
            Dev<uint8_t> dz(gs.count());
            ASSERT_EQ(
                loom::quant::cuda::quantize_int(dx.p, gs, q, packing, dp.p, ds.p, dz.p, stream_),
                -1);
            ASSERT_EQ(dp.read(), p);
            const auto s_dev = ds.read();
            ASSERT_EQ(0, std::memcmp(s_dev.data(), s.data(), s.size() * sizeof(float)));
            if (!sym) {
              ASSERT_EQ(dz.read(), z);
            }
            const IntWeight w{dp.p, ds.p, sym ? nullptr : dz.p, gs, q, packing};
            Dev<float> dd(x.size());
            loom::quant::cuda::dequantize_int(w, dd.p, stream_);
            std::vector<float> d(x.size());
            loom::quant::dequantize_int({p.data(), s.data(), z.data(), gs, q, packing}, d.data());
            const auto d_dev = dd.read();
            ASSERT_EQ(0, std::memcmp(d_dev.data(), d.data(), d.size() * sizeof(float)));
            if (sym || bits <= 7) {
              Dev<int8_t> dw(x.size());
              loom::quant::cuda::widen_to_int8(w, dw.p, stream_);
              std::vector<int8_t> wide(x.size());
              loom::quant::widen_to_int8({p.data(), s.data(), z.data(), gs, q, packing},
                                         wide.data());
              ASSERT_EQ(dw.read(), wide);
            }
          }
        }
      }
    }
  }
}

TEST_F(QuantCuda, TokenWiseInt8AndNonFiniteInput) {
  const int64_t rows = 4, cols = 37;
  auto x = sample(rows, cols, 8);
  std::vector<int8_t> q(x.size());
  std::vector<float> s(rows);
  loom::quant::reference_quantize_rows_int8(x.data(), rows, cols, q.data(), s.data());
  Dev<float> dx(x);
  Dev<int8_t> dq(x.size());
  Dev<float> ds(rows);
  ASSERT_EQ(loom::quant::cuda::quantize_rows_int8(dx.p, rows, cols, dq.p, ds.p, stream_), -1);
  EXPECT_EQ(dq.read(), q);
  const auto s_dev = ds.read();
  EXPECT_EQ(0, std::memcmp(s_dev.data(), s.data(), s.size() * sizeof(float)));
  x[2 * cols + 5] = NAN;
  x[3 * cols + 1] = INFINITY;
  Dev<float> bad(x);
  EXPECT_EQ(loom::quant::cuda::quantize_rows_int8(bad.p, rows, cols, dq.p, ds.p, stream_),
            2 * cols + 5);
}

TEST_F(QuantCuda, WeightOnlyMatmulMatchesTheCpu) {
  const int64_t n = 10, k = 40;
  for (uint32_t bits : {4u, 8u, 3u}) {
    for (bool sym : {true, false}) {
      for (int64_t m : {1, 9}) {
        SCOPED_TRACE("bits " + std::to_string(bits) + (sym ? " sym" : " asym") + " m " +
                     std::to_string(m));
        const IntScheme q{bits, sym, Range::kExact};
        const Groups gs = Groups::of(n, k, 16);
        const auto wf = sample(n, k, 3);
        const auto x = sample(m, k, 4);
        std::vector<float> bias(n);
        for (int64_t j = 0; j < n; ++j) bias[j] = static_cast<float>(j) - 4.0f;
        std::vector<uint8_t> p(loom::quant::packed_size(n * k, bits));
        std::vector<float> s(gs.count());
        std::vector<uint8_t> z(gs.count());
        ASSERT_EQ(loom::quant::quantize_int(wf.data(), gs, q, LOOM_QUANT_PACK_LSB_FIRST, p.data(),
                                            s.data(), z.data()),
                  -1);
        std::vector<float> y(m * n);
        loom::quant::matmul_weight_only(
            x.data(), m, {p.data(), s.data(), z.data(), gs, q, LOOM_QUANT_PACK_LSB_FIRST},
            bias.data(), y.data(), nullptr);
        Dev<uint8_t> dp(p);
        Dev<float> ds(s), dbias(bias), dxx(x), dy(m * n);
        Dev<uint8_t> dz(z);
        loom::quant::cuda::matmul_weight_only(
            dxx.p, m, {dp.p, ds.p, dz.p, gs, q, LOOM_QUANT_PACK_LSB_FIRST}, dbias.p, dy.p, stream_);
        const auto yd = dy.read();
        for (int64_t i = 0; i < m * n; ++i) {
          EXPECT_NEAR(yd[i], y[i], 1e-4 * (1.0 + std::fabs(y[i]))) << i;
        }
      }
    }
  }
}

TEST_F(QuantCuda, Int8EpilogueScalesAndAccumulates) {
  const int64_t m = 2, n = 3, groups = 2;
  const std::vector<int32_t> acc0 = {10, -20, 30, 40, 50, -60};
  const std::vector<int32_t> acc1 = {1, 2, 3, 4, 5, 6};
  const std::vector<float> sx = {0.5f, 2.0f};
  const std::vector<float> sw = {1.0f, 0.25f, 2.0f, 0.5f, 4.0f, 1.0f};  // [n, groups]
  const std::vector<float> bias = {1.0f, -1.0f, 0.5f};
  Dev<int32_t> a0(acc0), a1(acc1);
  Dev<float> dsx(sx), dsw(sw), db(bias), dy(m * n);
  loom::quant::cuda::int8_epilogue(a0.p, m, n, dsx.p, dsw.p, groups, 0, db.p, true, dy.p, stream_);
  loom::quant::cuda::int8_epilogue(a1.p, m, n, dsx.p, dsw.p, groups, 1, db.p, false, dy.p, stream_);
  const auto y = dy.read();
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const float want = static_cast<float>(acc0[i * n + j]) * sw[j * 2] * sx[i] + bias[j] +
                         static_cast<float>(acc1[i * n + j]) * sw[j * 2 + 1] * sx[i];
      EXPECT_FLOAT_EQ(y[i * n + j], want);
    }
  }
}

}  // namespace
