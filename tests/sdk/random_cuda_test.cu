// loom/sdk/random.hpp on the device: a kernel draws the same words and the same bounded
// integers as the host for every (sample, draw), so a CPU and a CUDA path agree exactly.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <loom/sdk/random.hpp>

#include <cstdint>
#include <vector>

namespace {

__global__ void draw(uint64_t seed, int64_t step, uint32_t layer, uint32_t samples, uint32_t draws,
                     uint32_t* words, uint32_t* bounded) {
  const uint32_t s = blockIdx.x * blockDim.x + threadIdx.x;
  if (s >= samples) return;
  loom::sdk::CounterRng rng(seed, step, layer, s, /*purpose=*/3);
  for (uint32_t d = 0; d < draws; ++d) words[s * draws + d] = rng.next_u32();
  bounded[s] = rng.below(1000u + s);
}

TEST(CounterRngOnDevice, MatchesTheHostBitForBit) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    GTEST_SKIP() << "needs a CUDA device (or the CUDA emulation)";
  }
  constexpr uint32_t kSamples = 300, kDraws = 9;
  uint32_t* d_words = nullptr;
  uint32_t* d_bounded = nullptr;
  ASSERT_EQ(cudaMalloc(&d_words, kSamples * kDraws * sizeof(uint32_t)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_bounded, kSamples * sizeof(uint32_t)), cudaSuccess);
  draw<<<(kSamples + 127) / 128, 128>>>(0xfeedbeefcafe1234ull, 5000000000ll, 11, kSamples, kDraws,
                                        d_words, d_bounded);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint32_t> words(kSamples * kDraws), bounded(kSamples);
  ASSERT_EQ(
      cudaMemcpy(words.data(), d_words, words.size() * sizeof(uint32_t), cudaMemcpyDeviceToHost),
      cudaSuccess);
  ASSERT_EQ(cudaMemcpy(bounded.data(), d_bounded, bounded.size() * sizeof(uint32_t),
                       cudaMemcpyDeviceToHost),
            cudaSuccess);
  cudaFree(d_words);
  cudaFree(d_bounded);
  for (uint32_t s = 0; s < kSamples; ++s) {
    loom::sdk::CounterRng rng(0xfeedbeefcafe1234ull, 5000000000ll, 11, s, 3);
    for (uint32_t d = 0; d < kDraws; ++d) ASSERT_EQ(words[s * kDraws + d], rng.next_u32()) << s;
    ASSERT_EQ(bounded[s], rng.below(1000u + s)) << s;
  }
}

}  // namespace
