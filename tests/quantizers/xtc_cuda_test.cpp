// The xtc CUDA kernels (plugins/quantizers/core/binary.cu, ternary.cu) against the CPU ones:
// quantize bit for bit (codes and scales), dequantize exactly, the matmuls within float
// rounding, and the same bad-input reports. Skips without a CUDA device (the CUDA emulation
// provides one).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <loom/quantizers/binary.hpp>
#include "ternary.hpp"
#include "xtc_cuda.hpp"

namespace {

using loom::quant::GroupedShape;

class XtcCuda : public ::testing::Test {
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

// Device memory holding a copy of a host vector (or n zero bytes).
struct Dev {
  void* p = nullptr;
  std::size_t n = 0;
  explicit Dev(std::size_t bytes) : n(bytes) {
    EXPECT_EQ(cudaMalloc(&p, bytes > 0 ? bytes : 1), cudaSuccess);
    EXPECT_EQ(cudaMemset(p, 0, bytes > 0 ? bytes : 1), cudaSuccess);
  }
  template <class T>
  explicit Dev(const std::vector<T>& v) : Dev(v.size() * sizeof(T)) {
    EXPECT_EQ(cudaMemcpy(p, v.data(), n, cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  template <class T>
  T* as() {
    return static_cast<T*>(p);
  }
  template <class T>
  std::vector<T> get() {
    std::vector<T> v(n / sizeof(T));
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(v.data(), p, n, cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }
};

std::vector<float> weights(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 0.05f);
  std::vector<float> w(static_cast<size_t>(n));
  for (auto& v : w) v = dist(rng);
  for (int64_t i = 0; i < n; i += 7) w[static_cast<size_t>(i)] = 0.0f;
  return w;
}

const GroupedShape kShapes[] = {{1, 1, 1}, {7, 13, 4}, {9, 37, 16}, {5, 130, 32}, {3, 300, 300}};

std::string name(const GroupedShape& s) {
  return std::to_string(s.rows) + "x" + std::to_string(s.cols) + " g" +
         std::to_string(s.group_size);
}

void expect_bits_equal(const std::vector<float>& a, const std::vector<float>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    uint32_t x, y;
    std::memcpy(&x, &a[i], 4);
    std::memcpy(&y, &b[i], 4);
    ASSERT_EQ(x, y) << "element " << i << ": " << a[i] << " vs " << b[i];
  }
}

TEST_F(XtcCuda, QuantizeMatchesTheCpuBitForBit) {
  for (const GroupedShape& s : kShapes) {
    SCOPED_TRACE(name(s));
    const auto w = weights(s.numel(), 1);
    Dev dw(w);
    Dev ws(loom::quant::xtc_cuda_workspace_bytes(s));
    const auto groups = static_cast<size_t>(s.groups());
    std::vector<float> sc(groups);
    {
      std::vector<uint8_t> p(loom::quant::packed_bytes_of(s, 1));
      ASSERT_EQ(loom::quant::binary_quantize(w.data(), s, p.data(), sc.data()), -1);
      Dev dp(p.size()), ds(groups * 4);
      ASSERT_EQ(loom::quant::cuda::binary_quantize(dw.as<float>(), s, dp.as<uint8_t>(),
                                                   ds.as<float>(), ws.p, 0, stream_),
                -1);
      EXPECT_EQ(dp.get<uint8_t>(), p);
      expect_bits_equal(ds.get<float>(), sc);
      // dequantize: exactly the CPU's values
      std::vector<float> back(w.size());
      loom::quant::binary_dequantize(p.data(), sc.data(), s, back.data());
      Dev dback(w.size() * 4);
      loom::quant::cuda::binary_dequantize(dp.as<uint8_t>(), ds.as<float>(), s, dback.as<float>(),
                                           0, stream_);
      expect_bits_equal(dback.get<float>(), back);
    }
    for (float threshold : {0.7f, 0.2f}) {
      std::vector<uint8_t> p(loom::quant::packed_bytes_of(s, 2));
      ASSERT_EQ(loom::quant::ternary_quantize(w.data(), s, threshold, p.data(), sc.data()), -1);
      Dev dp(p.size()), ds(groups * 4);
      ASSERT_EQ(loom::quant::cuda::ternary_quantize(dw.as<float>(), s, threshold, dp.as<uint8_t>(),
                                                    ds.as<float>(), ws.p, 0, stream_),
                -1);
      EXPECT_EQ(dp.get<uint8_t>(), p);
      expect_bits_equal(ds.get<float>(), sc);
      std::vector<float> back(w.size());
      ASSERT_EQ(loom::quant::ternary_dequantize(p.data(), sc.data(), s, back.data()), -1);
      Dev dback(w.size() * 4);
      ASSERT_EQ(loom::quant::cuda::ternary_dequantize(dp.as<uint8_t>(), ds.as<float>(), s,
                                                      dback.as<float>(), ws.p, 0, stream_),
                -1);
      expect_bits_equal(dback.get<float>(), back);
    }
  }
}

TEST_F(XtcCuda, MatmulsMatchTheCpu) {
  for (const GroupedShape& s : kShapes) {
    for (int64_t m : {1, 5}) {
      SCOPED_TRACE(name(s) + " m " + std::to_string(m));
      const auto w = weights(s.numel(), 2);
      auto x = weights(m * s.cols, 3);
      std::vector<float> bias(static_cast<size_t>(s.rows), 0.25f);
      std::vector<float> sc(static_cast<size_t>(s.groups()));
      std::vector<float> y(static_cast<size_t>(m * s.rows));
      Dev dx(x), db(bias), ds(sc.size() * 4), dy(y.size() * 4);
      Dev ws(loom::quant::xtc_cuda_workspace_bytes(s));
      std::vector<uint8_t> pb(loom::quant::packed_bytes_of(s, 1));
      ASSERT_EQ(loom::quant::binary_quantize(w.data(), s, pb.data(), sc.data()), -1);
      loom::quant::binary_matmul(x.data(), m, pb.data(), sc.data(), s, bias.data(), y.data());
      Dev dpb(pb);
      Dev dsb(sc);
      loom::quant::cuda::binary_matmul(dx.as<float>(), m, dpb.as<uint8_t>(), dsb.as<float>(), s,
                                       db.as<float>(), dy.as<float>(), 0, stream_);
      auto got = dy.get<float>();
      for (size_t i = 0; i < y.size(); ++i) ASSERT_NEAR(got[i], y[i], 1e-4f) << i;

      std::vector<uint8_t> pt(loom::quant::packed_bytes_of(s, 2));
      ASSERT_EQ(loom::quant::ternary_quantize(w.data(), s, 0.7f, pt.data(), sc.data()), -1);
      ASSERT_EQ(
          loom::quant::ternary_matmul(x.data(), m, pt.data(), sc.data(), s, nullptr, y.data()), -1);
      Dev dpt(pt);
      Dev dst(sc);
      ASSERT_EQ(
          loom::quant::cuda::ternary_matmul(dx.as<float>(), m, dpt.as<uint8_t>(), dst.as<float>(),
                                            s, nullptr, dy.as<float>(), ws.p, 0, stream_),
          -1);
      got = dy.get<float>();
      for (size_t i = 0; i < y.size(); ++i) ASSERT_NEAR(got[i], y[i], 1e-4f) << i;
    }
  }
}

TEST_F(XtcCuda, ReportTheSameBadElementsAsTheCpu) {
  const GroupedShape s{9, 37, 16};
  Dev ws(loom::quant::xtc_cuda_workspace_bytes(s));
  for (int64_t at : {int64_t{0}, int64_t{5 * 37 + 36}, int64_t{9 * 37 - 1}}) {
    auto w = weights(s.numel(), 4);
    w[static_cast<size_t>(at)] = std::numeric_limits<float>::quiet_NaN();
    if (at + 40 < s.numel()) w[static_cast<size_t>(at + 40)] = INFINITY;
    Dev dw(w), dp(loom::quant::packed_bytes_of(s, 2)), ds(static_cast<size_t>(s.groups()) * 4);
    EXPECT_EQ(loom::quant::cuda::binary_quantize(dw.as<float>(), s, dp.as<uint8_t>(),
                                                 ds.as<float>(), ws.p, 0, stream_),
              at);
    EXPECT_EQ(loom::quant::cuda::ternary_quantize(dw.as<float>(), s, 0.7f, dp.as<uint8_t>(),
                                                  ds.as<float>(), ws.p, 0, stream_),
              at);
  }
  // With first_bad the same index is written on the device and nothing waits for it.
  for (int64_t at : {int64_t{-1}, int64_t{5 * 37 + 36}}) {
    auto w = weights(s.numel(), 4);
    if (at >= 0) w[static_cast<size_t>(at)] = INFINITY;
    Dev dw(w), dp(loom::quant::packed_bytes_of(s, 2)), ds(static_cast<size_t>(s.groups()) * 4);
    Dev db(std::vector<int64_t>{77});
    EXPECT_EQ(
        loom::quant::cuda::binary_quantize(dw.as<float>(), s, dp.as<uint8_t>(), ds.as<float>(),
                                           ws.p, 0, stream_, db.as<int64_t>()),
        -1);
    EXPECT_EQ(db.get<int64_t>()[0], at);
    Dev dt(std::vector<int64_t>{77});
    EXPECT_EQ(
        loom::quant::cuda::ternary_quantize(dw.as<float>(), s, 0.7f, dp.as<uint8_t>(),
                                            ds.as<float>(), ws.p, 0, stream_, dt.as<int64_t>()),
        -1);
    EXPECT_EQ(dt.get<int64_t>()[0], at);
  }
  const auto w = weights(s.numel(), 5);
  std::vector<uint8_t> p(loom::quant::packed_bytes_of(s, 2));
  std::vector<float> sc(static_cast<size_t>(s.groups()));
  ASSERT_EQ(loom::quant::ternary_quantize(w.data(), s, 0.7f, p.data(), sc.data()), -1);
  for (int64_t at : {int64_t{3}, int64_t{4 * 37 + 2}}) {
    auto q = p;
    q[static_cast<size_t>(at / 4)] |= static_cast<uint8_t>(3u << (2 * (at % 4)));
    // a later one in an earlier row's neighbour does not win
    q.back() |= 0x3;
    Dev dq(q), ds(sc), dout(w.size() * 4), dx(std::vector<float>(static_cast<size_t>(s.cols)));
    Dev dy(static_cast<size_t>(s.rows) * 4);
    EXPECT_EQ(loom::quant::cuda::ternary_dequantize(dq.as<uint8_t>(), ds.as<float>(), s,
                                                    dout.as<float>(), ws.p, 0, stream_),
              at);
    EXPECT_EQ(loom::quant::cuda::ternary_matmul(dx.as<float>(), 1, dq.as<uint8_t>(), ds.as<float>(),
                                                s, nullptr, dy.as<float>(), ws.p, 0, stream_),
              at);
  }
}

}  // namespace
