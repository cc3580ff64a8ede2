// loom_router_core's CUDA gather/scatter against the host's, bit for bit: every element
// width, both layouts, aligned rows (16-byte units) and rows that only allow narrower units.
// Skips without a CUDA device (the CUDA emulation provides one).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <loom/sdk/status.hpp>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <loom/routers/router_core.hpp>
#include "tensors.hpp"

namespace {

using namespace routers_test;
namespace lr = loom::routers;

constexpr DLDevice kCuda{kDLCUDA, 0};

class RouterCudaCore : public ::testing::Test {
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

struct Dev {
  void* p = nullptr;
  std::size_t n = 0;
  explicit Dev(const void* host, std::size_t bytes) : n(bytes) {
    EXPECT_EQ(cudaMalloc(&p, bytes == 0 ? 1 : bytes), cudaSuccess);
    if (bytes > 0) {
      EXPECT_EQ(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  std::vector<unsigned char> read() const {
    std::vector<unsigned char> out(n);
    EXPECT_EQ(cudaMemcpy(out.data(), p, n, cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
};

// One gather and one scatter of the same tensors on host and device; `shift` bytes of
// offset into each buffer (an element multiple) force narrower copy units.
void compare(int bits, int64_t B, int64_t S, int64_t K, int64_t C, bool position_major,
             std::size_t shift, cudaStream_t stream, uint64_t seed) {
  SCOPED_TRACE("bits " + std::to_string(bits) + " B " + std::to_string(B) + " S " +
               std::to_string(S) + " K " + std::to_string(K) + " C " + std::to_string(C) +
               (position_major ? " [S, B, C]" : "") + " shift " + std::to_string(shift));
  const std::size_t e = static_cast<std::size_t>(bits) / 8;
  const auto full_bytes = static_cast<std::size_t>(B * S * C) * e + shift;
  const auto kept_bytes = static_cast<std::size_t>(B * K * C) * e + shift;
  const std::vector<unsigned char> full = random_bytes(full_bytes, seed);
  const std::vector<unsigned char> background = random_bytes(full_bytes, seed + 1);
  const std::vector<unsigned char> kept0(kept_bytes, 0x5A);
  const std::vector<int32_t> idx = random_rows(B, S, K, seed + 2);
  const DLDataType dt = uint_type(bits);
  // Host.
  std::vector<unsigned char> hk = kept0, hout = background;
  std::vector<unsigned char> hfull = full;
  View hf(hfull.data() + shift, {B, S, C}, dt,
          position_major ? std::vector<int64_t>{C, B * C, 1} : std::vector<int64_t>{});
  View hkv(hk.data() + shift, {B, K, C}, dt,
           position_major ? std::vector<int64_t>{C, B * C, 1} : std::vector<int64_t>{});
  View ho(hout.data() + shift, {B, S, C}, dt,
          position_major ? std::vector<int64_t>{C, B * C, 1} : std::vector<int64_t>{});
  std::vector<int32_t> hidx = idx;
  View hi(hidx.data(), {B, K}, kI32);
  lr::gather(loom::sdk::router_move(move_args(hf, hkv, hi)));
  lr::scatter(loom::sdk::router_move(move_args(ho, hkv, hi)));
  // Device.
  Dev df(full.data(), full_bytes), dk(kept0.data(), kept_bytes),
      dout(background.data(), full_bytes);
  Dev di(idx.data(), idx.size() * sizeof(int32_t));
  View vf(static_cast<char*>(df.p) + shift, {B, S, C}, dt,
          position_major ? std::vector<int64_t>{C, B * C, 1} : std::vector<int64_t>{}, kCuda);
  View vk(static_cast<char*>(dk.p) + shift, {B, K, C}, dt,
          position_major ? std::vector<int64_t>{C, B * C, 1} : std::vector<int64_t>{}, kCuda);
  View vo(static_cast<char*>(dout.p) + shift, {B, S, C}, dt,
          position_major ? std::vector<int64_t>{C, B * C, 1} : std::vector<int64_t>{}, kCuda);
  View vi(di.p, {B, K}, kI32, {}, kCuda);
  lr::gather(loom::sdk::router_move(move_args(vf, vk, vi, stream)));
  lr::scatter(loom::sdk::router_move(move_args(vo, vk, vi, stream)));
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(dk.read(), hk) << "gather";
  EXPECT_EQ(dout.read(), hout) << "scatter";
}

TEST_F(RouterCudaCore, GatherScatterMatchHostBitForBit) {
  uint64_t seed = 1;
  for (const int bits : {8, 16, 32, 64}) {
    for (const bool pm : {false, true}) {
      compare(bits, 2, 40, 13, 16, pm, 0, stream_, seed++);       // 16-byte units
      compare(bits, 3, 21, 5, 3, pm, 0, stream_, seed++);         // odd rows: narrower units
      compare(bits, 2, 33, 9, 8, pm, bits / 8, stream_, seed++);  // misaligned bases
    }
  }
  // Long rows (more than 256 units per row) and everything kept.
  compare(32, 2, 12, 12, 1200, false, 0, stream_, seed++);
}

TEST_F(RouterCudaCore, LongSequence) { compare(16, 1, 32768 + 5, 2500, 8, false, 0, stream_, 77); }

TEST_F(RouterCudaCore, OutOfRangeDeviceIndicesAreSkipped) {
  // Device indices are not read back; a row outside the sequence writes nothing.
  const int64_t B = 1, S = 4, K = 2, C = 4;
  std::vector<float> full(static_cast<std::size_t>(B * S * C), 1.0f);
  std::vector<float> kept(static_cast<std::size_t>(B * K * C), 2.0f);
  std::vector<int32_t> idx = {1, 99};
  Dev df(full.data(), full.size() * 4), dk(kept.data(), kept.size() * 4);
  Dev di(idx.data(), idx.size() * 4);
  View vf(df.p, {B, S, C}, kF32, {}, kCuda);
  View vk(dk.p, {B, K, C}, kF32, {}, kCuda);
  View vi(di.p, {B, K}, kI32, {}, kCuda);
  lr::scatter(loom::sdk::router_move(move_args(vf, vk, vi, stream_)));
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  const auto out = df.read();
  std::vector<float> got(full.size());
  std::memcpy(got.data(), out.data(), out.size());
  for (int64_t p = 0; p < S; ++p) {
    for (int64_t c = 0; c < C; ++c) {
      EXPECT_EQ(got[static_cast<std::size_t>(p * C + c)], p == 1 ? 2.0f : 1.0f) << p;
    }
  }
}

}  // namespace
