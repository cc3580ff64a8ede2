// The onebit CUDA kernels against the CPU kernels, bit for bit (bytes, scales, errors and
// decoded values), and the plugin on CUDA tensors through the embedding API. Skips when no
// GPU is present.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <loom/embed.h>

#include <cstring>
#include <random>
#include <vector>

#include "codec_kernels.hpp"
#include "onebit_cuda.h"
#include "reference.hpp"

namespace {

namespace cu = loom::codecs::cuda;

class OnebitCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cu::device_available()) GTEST_SKIP() << "no CUDA device";
  }
};

struct DeviceBuffer {
  explicit DeviceBuffer(size_t bytes) {
    EXPECT_EQ(cudaMalloc(&ptr, bytes == 0 ? 1 : bytes), cudaSuccess);
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  void* ptr = nullptr;
};

std::vector<float> random_values(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> g(0.05f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = g(rng);
  for (size_t i = 0; i < n; i += 5) v[i] = (i / 5) % 2 == 0 ? 0.0f : -0.0f;
  return v;
}

TEST_F(OnebitCuda, MatchesCpuBitForBit) {
  std::mt19937 rng(3);
  for (size_t n : {size_t{16}, size_t{2056}, size_t{(1u << 20) + 16 * 3}, size_t{3 * 1000064}}) {
    for (uint32_t chunks : {1u, 2u}) {
      if (n % (8 * chunks) != 0) continue;  // the codec's contract: n % (8 * chunk_count) == 0
      SCOPED_TRACE("n=" + std::to_string(n) + " chunks=" + std::to_string(chunks));
      const std::vector<float> x = random_values(n, rng);
      std::vector<float> e = random_values(n, rng);
      for (auto& v : e) v *= 0.1f;
      std::vector<float> e_cpu = e;
      const auto want = ref::onebit_encode(x, &e_cpu, chunks);  // == CPU kernels (kernel test)

      DeviceBuffer dx(n * 4), de(n * 4), dout(want.size()),
          dws(cu::onebit_encode_workspace_bytes(n)), ddec(n * 4);
      ASSERT_EQ(cu::copy_to_device(dx.ptr, x.data(), n * 4), "");
      ASSERT_EQ(cu::copy_to_device(de.ptr, e.data(), n * 4), "");
      ASSERT_EQ(cu::onebit_encode(static_cast<float*>(dx.ptr), static_cast<float*>(de.ptr), n,
                                  chunks, static_cast<uint8_t*>(dout.ptr), dws.ptr, nullptr),
                "");
      std::vector<uint8_t> got(want.size());
      std::vector<float> e_gpu(n);
      ASSERT_EQ(cu::copy_to_host(got.data(), dout.ptr, got.size()), "");
      ASSERT_EQ(cu::copy_to_host(e_gpu.data(), de.ptr, n * 4), "");
      ASSERT_EQ(got, want);
      ASSERT_EQ(std::memcmp(e_gpu.data(), e_cpu.data(), n * 4), 0);

      // Decode with accumulate.
      std::vector<float> acc = random_values(n, rng);
      std::vector<float> acc_cpu = acc;
      ref::onebit_decode(want.data(), chunks, n / chunks, 0.25f, true, acc_cpu.data());
      ASSERT_EQ(cu::copy_to_device(ddec.ptr, acc.data(), n * 4), "");
      ASSERT_EQ(cu::onebit_decode(static_cast<uint8_t*>(dout.ptr), chunks, n / chunks, 0.25f, true,
                                  static_cast<float*>(ddec.ptr), nullptr),
                "");
      std::vector<float> acc_gpu(n);
      ASSERT_EQ(cu::copy_to_host(acc_gpu.data(), ddec.ptr, n * 4), "");
      ASSERT_EQ(std::memcmp(acc_gpu.data(), acc_cpu.data(), n * 4), 0);

      // The chunks' sum into one chunk (the server step), against the CPU kernel.
      const size_t c = n / chunks;
      std::vector<float> sum_cpu(acc.begin(), acc.begin() + static_cast<std::ptrdiff_t>(c));
      std::vector<const uint8_t*> bits;
      std::vector<float> vals;
      for (uint32_t j = 0; j < chunks; ++j) {
        float s;
        std::memcpy(&s, want.data() + j * (4 + c / 8), 4);
        bits.push_back(want.data() + j * (4 + c / 8) + 4);
        vals.push_back(0.25f * s);
      }
      loom::codecs::onebit_unpack_sum(bits.data(), vals.data(), chunks, c, true, sum_cpu.data());
      ASSERT_EQ(cu::copy_to_device(ddec.ptr, acc.data(), c * 4), "");
      ASSERT_EQ(cu::onebit_decode_sum(static_cast<uint8_t*>(dout.ptr), chunks, c, 0.25f, true,
                                      static_cast<float*>(ddec.ptr), nullptr),
                "");
      std::vector<float> sum_gpu(c);
      ASSERT_EQ(cu::copy_to_host(sum_gpu.data(), ddec.ptr, c * 4), "");
      ASSERT_EQ(std::memcmp(sum_gpu.data(), sum_cpu.data(), c * 4), 0);
    }
  }
}

// The plugin picks the CUDA kernels for kDLCUDA tensors.
TEST_F(OnebitCuda, PluginEncodesCudaTensors) {
  loom_session* s = nullptr;
  ASSERT_EQ(loom_open_string("[loom]\nabi = 1\n[codec.c]\nplugin = \"onebit\"\n", "cuda.toml",
                             nullptr, &s),
            0)
      << loom_last_error();
  loom_instance* inst = nullptr;
  ASSERT_EQ(loom_find_instance(s, "codec", "c", &inst), 0);
  auto* vt = static_cast<const loom_codec_v1*>(loom_instance_vtable(inst));
  void* obj = loom_instance_object(inst);
  ASSERT_EQ(vt->supports_device(obj, DLDevice{kDLCUDA, 0}), 1);
  const size_t n = 4096;
  std::mt19937 rng(9);
  const auto x = random_values(n, rng);
  const auto want = ref::onebit_encode(x, nullptr, 4);
  DeviceBuffer dx(n * 4), dout(want.size());
  ASSERT_EQ(cu::copy_to_device(dx.ptr, x.data(), n * 4), "");
  int64_t shape = static_cast<int64_t>(n);
  DLTensor xt{dx.ptr, {kDLCUDA, 0}, 1, {kDLFloat, 32, 1}, &shape, nullptr, 0};
  loom_codec_encode_args a{};
  a.struct_size = LOOM_CODEC_ENCODE_ARGS_SIZE;
  a.chunk_count = 4;
  a.input = &xt;
  a.output = dout.ptr;
  loom_status* st = vt->encode(obj, &a);
  ASSERT_EQ(st, nullptr) << st->message;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint8_t> got(want.size());
  ASSERT_EQ(cu::copy_to_host(got.data(), dout.ptr, got.size()), "");
  EXPECT_EQ(got, want);
  loom_close(s);
}

}  // namespace
