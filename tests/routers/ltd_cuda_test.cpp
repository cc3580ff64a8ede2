// random_ltd's CUDA selection against the host's, bit for bit (odd lengths, one kept, all
// but one kept, everything kept, 32768+ positions), then a gather and a scatter on the
// device with the device's rows against the host's. Skips without a CUDA device (the CUDA
// emulation provides one).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <loom/sdk/status.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "router_core.hpp"
#include "select.hpp"
#include "tensors.hpp"

namespace {

namespace ltd = loom::routers::ltd;
namespace lr = loom::routers;
using namespace routers_test;

constexpr DLDevice kCuda{kDLCUDA, 0};

class RouterCudaLtd : public ::testing::Test {
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

  // The device's rows for `j` (copied back).
  std::vector<int32_t> device_select(const ltd::SelectJob& j) {
    const auto n = static_cast<std::size_t>(j.batch * j.kept);
    void* idx = nullptr;
    void* ws = nullptr;
    EXPECT_EQ(cudaMalloc(&idx, n * sizeof(int32_t)), cudaSuccess);
    const uint64_t bytes = ltd::workspace_bytes(j.batch, j.seq_len, j.kept);
    if (bytes > 0) EXPECT_EQ(cudaMalloc(&ws, bytes), cudaSuccess);
    EXPECT_EQ(cudaMemset(idx, 0xff, n * sizeof(int32_t)), cudaSuccess);
    ltd::cuda::select(j, static_cast<int32_t*>(idx), ws, 0, stream_);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    std::vector<int32_t> out(n);
    EXPECT_EQ(cudaMemcpy(out.data(), idx, n * sizeof(int32_t), cudaMemcpyDeviceToHost),
              cudaSuccess);
    cudaFree(idx);
    cudaFree(ws);
    return out;
  }

  cudaStream_t stream_ = nullptr;
};

std::vector<int32_t> host_select(const ltd::SelectJob& j) {
  std::vector<int32_t> out(static_cast<std::size_t>(j.batch * j.kept), -1);
  ltd::select_cpu(j, out.data());
  return out;
}

TEST_F(RouterCudaLtd, SelectMatchesTheHostBitForBit) {
  const ltd::SelectJob jobs[] = {
      {1, 1, 1, 0, 3, 97, 40},             // odd length
      {2, 7, 2, 5, 2, 300, 1},             // one kept
      {3, 9, 4, 11, 2, 129, 128},          // all but one
      {4, 2, 1, 0, 2, 64, 64},             // everything (no workspace)
      {5, 200001, 3, 1000, 2, 2048, 128},  // GPT-like
      {0xffffffffffffull, 3, 7, 2, 1, 5000, 2500},
  };
  for (const ltd::SelectJob& j : jobs) {
    SCOPED_TRACE("S " + std::to_string(j.seq_len) + " K " + std::to_string(j.kept));
    EXPECT_EQ(device_select(j), host_select(j));
  }
}

TEST_F(RouterCudaLtd, LongSequence) {
  const ltd::SelectJob j{11, 4, 1, 3, 1, 32768 + 3, 4099};
  EXPECT_EQ(device_select(j), host_select(j));
}

TEST_F(RouterCudaLtd, SelectGatherScatterPipeline) {
  const int64_t B = 2, S = 200, C = 8;
  const ltd::SelectJob j{21, 3, 1, 0, B, S, 48};
  const auto idx = host_select(j);
  ASSERT_EQ(device_select(j), idx);
  const std::vector<unsigned char> full = random_bytes(static_cast<std::size_t>(B * S * C) * 2, 3);
  std::vector<unsigned char> hk(static_cast<std::size_t>(B * j.kept * C) * 2, 0);
  std::vector<int32_t> hidx = idx;
  std::vector<unsigned char> hfull = full;
  View hf(hfull.data(), {B, S, C}, uint_type(16));
  View hkv(hk.data(), {B, j.kept, C}, uint_type(16));
  View hi(hidx.data(), {B, j.kept}, kI32);
  lr::gather(loom::sdk::router_move(move_args(hf, hkv, hi)));
  void *df = nullptr, *dk = nullptr, *di = nullptr;
  ASSERT_EQ(cudaMalloc(&df, full.size()), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dk, hk.size()), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&di, idx.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(df, full.data(), full.size(), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(di, idx.data(), idx.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  View vf(df, {B, S, C}, uint_type(16), {}, kCuda);
  View vk(dk, {B, j.kept, C}, uint_type(16), {}, kCuda);
  View vi(di, {B, j.kept}, kI32, {}, kCuda);
  lr::gather(loom::sdk::router_move(move_args(vf, vk, vi, stream_)));
  // Scatter the gathered rows over zeros: the kept rows come back, the others stay 0.
  ASSERT_EQ(cudaMemsetAsync(df, 0, full.size(), stream_), cudaSuccess);
  lr::scatter(loom::sdk::router_move(move_args(vf, vk, vi, stream_)));
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  std::vector<unsigned char> dkept(hk.size()), dfull(full.size());
  ASSERT_EQ(cudaMemcpy(dkept.data(), dk, dkept.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dfull.data(), df, dfull.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(dkept, hk);
  std::vector<unsigned char> want(full.size(), 0);
  std::vector<unsigned char> zeros = want;
  View hz(want.data(), {B, S, C}, uint_type(16));
  lr::scatter(loom::sdk::router_move(move_args(hz, hkv, hi)));
  EXPECT_EQ(dfull, want);
  EXPECT_NE(dfull, zeros);
  cudaFree(df);
  cudaFree(dk);
  cudaFree(di);
}

}  // namespace
