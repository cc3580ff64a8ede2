// The onebit CUDA kernels against the CPU kernels, bit for bit (bytes, scales, errors and
// decoded values), the plugin on CUDA tensors through the embedding API, and bad data (NaN /
// Inf input, invalid scales) failing with the CPU codec's status. Skips when no GPU is present.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <loom/embed.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
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

// The kernels' fault word, freed at scope exit.
struct FaultWord {
  FaultWord() : ptr(cu::fault_word_alloc(0)) {}
  ~FaultWord() { cu::fault_word_free(ptr); }
  void* ptr;
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
      FaultWord fault;
      cu::copy_to_device(dx.ptr, x.data(), n * 4);
      cu::copy_to_device(de.ptr, e.data(), n * 4);
      cu::onebit_encode(static_cast<float*>(dx.ptr), static_cast<float*>(de.ptr), n, chunks,
                        static_cast<uint8_t*>(dout.ptr), dws.ptr, fault.ptr, nullptr);
      std::vector<uint8_t> got(want.size());
      std::vector<float> e_gpu(n);
      cu::copy_to_host(got.data(), dout.ptr, got.size());
      cu::copy_to_host(e_gpu.data(), de.ptr, n * 4);
      ASSERT_EQ(got, want);
      ASSERT_EQ(std::memcmp(e_gpu.data(), e_cpu.data(), n * 4), 0);

      // Decode with accumulate.
      std::vector<float> acc = random_values(n, rng);
      std::vector<float> acc_cpu = acc;
      ref::onebit_decode(want.data(), chunks, n / chunks, 0.25f, true, acc_cpu.data());
      cu::copy_to_device(ddec.ptr, acc.data(), n * 4);
      cu::onebit_decode(static_cast<uint8_t*>(dout.ptr), chunks, n / chunks, 0.25f, true,
                        static_cast<float*>(ddec.ptr), fault.ptr, nullptr);
      std::vector<float> acc_gpu(n);
      cu::copy_to_host(acc_gpu.data(), ddec.ptr, n * 4);
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
      cu::copy_to_device(ddec.ptr, acc.data(), c * 4);
      cu::onebit_decode_sum(static_cast<uint8_t*>(dout.ptr), chunks, c, 0.25f, true,
                            static_cast<float*>(ddec.ptr), fault.ptr, nullptr);
      std::vector<float> sum_gpu(c);
      cu::copy_to_host(sum_gpu.data(), ddec.ptr, c * 4);
      ASSERT_EQ(std::memcmp(sum_gpu.data(), sum_cpu.data(), c * 4), 0);
      EXPECT_EQ(cu::read_fault(fault.ptr, nullptr).fault, cu::Fault::kNone);
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
  cu::copy_to_device(dx.ptr, x.data(), n * 4);
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
  cu::copy_to_host(got.data(), dout.ptr, got.size());
  EXPECT_EQ(got, want);
  loom_close(s);
}

// Bad data on CUDA tensors fails with the CPU codec's code and message: NaN / Inf in input +
// error at encode (reported by the next decode, the first call that synchronizes), an invalid
// chunk scale at decode and decode_sum. Nothing is written, as on the CPU.
class OnebitCudaFaults : public OnebitCuda {
 protected:
  void SetUp() override {
    OnebitCuda::SetUp();
    if (IsSkipped()) return;
    ASSERT_EQ(loom_open_string("[loom]\nabi = 1\n[codec.c]\nplugin = \"onebit\"\n", "faults.toml",
                               nullptr, &session_),
              0)
        << loom_last_error();
    loom_instance* inst = nullptr;
    ASSERT_EQ(loom_find_instance(session_, "codec", "c", &inst), 0);
    vt_ = static_cast<const loom_codec_v1*>(loom_instance_vtable(inst));
    obj_ = loom_instance_object(inst);
  }
  void TearDown() override {
    if (session_ != nullptr) loom_close(session_);
  }

  // A call's status: {code, message}; {0, ""} on success.
  static std::pair<int, std::string> take(loom_status* st) {
    if (st == nullptr) return {0, ""};
    std::pair<int, std::string> r{st->code, st->message != nullptr ? st->message : ""};
    if (st->destroy != nullptr) st->destroy(st);
    return r;
  }

  // Encodes x (+ e) on `device` (CUDA: x and e copied to the device; CPU: in place) into one
  // chunk; returns the encode's status, then (CUDA) the status of a decode that follows.
  std::pair<std::pair<int, std::string>, std::pair<int, std::string>> encode_then_decode(
      const std::vector<float>& x, const std::vector<float>& e, bool cuda,
      std::vector<float>* e_after) {
    const size_t n = x.size();
    int64_t shape = static_cast<int64_t>(n);
    std::vector<float> hx = x, he = e;
    std::vector<uint8_t> hout(4 + n / 8, 0xAB);
    DeviceBuffer dx(n * 4), de(n * 4), dout(hout.size()), ddec(n * 4);
    DLDevice dev = cuda ? DLDevice{kDLCUDA, 0} : DLDevice{kDLCPU, 0};
    if (cuda) {
      cu::copy_to_device(dx.ptr, x.data(), n * 4);
      cu::copy_to_device(de.ptr, e.data(), n * 4);
      cu::copy_to_device(dout.ptr, hout.data(), hout.size());
    }
    DLTensor xt{cuda ? dx.ptr : hx.data(), dev, 1, {kDLFloat, 32, 1}, &shape, nullptr, 0};
    DLTensor et{cuda ? de.ptr : he.data(), dev, 1, {kDLFloat, 32, 1}, &shape, nullptr, 0};
    loom_codec_encode_args a{};
    a.struct_size = LOOM_CODEC_ENCODE_ARGS_SIZE;
    a.chunk_count = 1;
    a.input = &xt;
    a.error = &et;
    a.output = cuda ? dout.ptr : hout.data();
    auto enc = take(vt_->encode(obj_, &a));
    std::pair<int, std::string> dec{0, ""};
    if (cuda) {
      DLTensor ot{ddec.ptr, dev, 1, {kDLFloat, 32, 1}, &shape, nullptr, 0};
      loom_codec_decode_args d{};
      d.struct_size = LOOM_CODEC_DECODE_ARGS_SIZE;
      d.chunk_count = 1;
      d.input = dout.ptr;
      d.output = &ot;
      d.alpha = 1.0f;
      dec = take(vt_->decode(obj_, &d));
      cu::copy_to_host(he.data(), de.ptr, n * 4);
      cu::copy_to_host(hout.data(), dout.ptr, hout.size());
    }
    // A failed encode writes no output byte.
    if (enc.first != 0 || dec.first != 0) {
      EXPECT_EQ(hout, std::vector<uint8_t>(hout.size(), 0xAB)) << "encode wrote output";
    }
    *e_after = he;
    return {enc, dec};
  }

  // Decodes `chunks` (host bytes, copied to the device for CUDA) into 8 * chunk elements per
  // chunk (sum: one chunk's worth); returns the status.
  std::pair<int, std::string> decode_junk(const std::vector<uint8_t>& chunks, uint32_t count,
                                          bool cuda, bool sum) {
    const size_t per = (chunks.size() / count - 4) * 8;
    const size_t n = sum ? per : per * count;
    int64_t shape = static_cast<int64_t>(n);
    std::vector<float> hout(n, 7.0f);
    DeviceBuffer din(chunks.size()), dout(n * 4);
    if (cuda) {
      cu::copy_to_device(din.ptr, chunks.data(), chunks.size());
      cu::copy_to_device(dout.ptr, hout.data(), n * 4);
    }
    DLDevice dev = cuda ? DLDevice{kDLCUDA, 0} : DLDevice{kDLCPU, 0};
    DLTensor ot{cuda ? dout.ptr : hout.data(), dev, 1, {kDLFloat, 32, 1}, &shape, nullptr, 0};
    loom_codec_decode_args d{};
    d.struct_size = LOOM_CODEC_DECODE_ARGS_SIZE;
    d.chunk_count = count;
    d.input = cuda ? din.ptr : chunks.data();
    d.output = &ot;
    d.alpha = 1.0f;
    auto r = take(sum ? vt_->decode_sum(obj_, &d) : vt_->decode(obj_, &d));
    if (cuda) cu::copy_to_host(hout.data(), dout.ptr, n * 4);
    EXPECT_EQ(hout, std::vector<float>(n, 7.0f)) << "decode wrote output";
    return r;
  }

  loom_session* session_ = nullptr;
  const loom_codec_v1* vt_ = nullptr;
  void* obj_ = nullptr;
};

TEST_F(OnebitCudaFaults, NonFiniteInputFailsLikeTheCpu) {
  const size_t n = 4096;
  for (float bad : {std::nanf(""), INFINITY, -INFINITY, 3e38f}) {  // 3e38^2 overflows fp32
    SCOPED_TRACE("bad=" + std::to_string(bad));
    std::vector<float> x(n, 0.5f), e(n, 0.25f);
    x[1234] = bad;
    std::vector<float> e_cpu, e_gpu;
    const auto cpu = encode_then_decode(x, e, false, &e_cpu);
    const auto gpu = encode_then_decode(x, e, true, &e_gpu);
    ASSERT_EQ(cpu.first.first, LOOM_ERR_INVALID_ARGUMENT) << cpu.first.second;
    EXPECT_EQ(gpu.first.first, 0) << "CUDA encode does not synchronize: " << gpu.first.second;
    EXPECT_EQ(gpu.second.first, cpu.first.first) << gpu.second.second;
    EXPECT_EQ(gpu.second.second.rfind(cpu.first.second, 0), 0u)
        << "CUDA: " << gpu.second.second << "\nCPU:  " << cpu.first.second;
    EXPECT_EQ(e_cpu, e) << "CPU encode changed the error buffer";
    EXPECT_EQ(e_gpu, e) << "CUDA encode changed the error buffer";
    // The fault was reported once: the next good encode and decode succeed.
    std::vector<float> good(n, 0.5f), e0(n, 0.0f), unused;
    const auto again = encode_then_decode(good, e0, true, &unused);
    EXPECT_EQ(again.first.first, 0) << again.first.second;
    EXPECT_EQ(again.second.first, 0) << again.second.second;
  }
  // Error buffer NaN, input finite.
  std::vector<float> x(n, 0.5f), e(n, 0.0f), e_gpu;
  e[7] = std::nanf("");
  const auto gpu = encode_then_decode(x, e, true, &e_gpu);
  EXPECT_EQ(gpu.second.first, LOOM_ERR_INVALID_ARGUMENT) << gpu.second.second;
}

TEST_F(OnebitCudaFaults, InvalidScalesFailLikeTheCpu) {
  const uint32_t count = 3;
  const size_t bytes = 4 + 64;  // 512 elements per chunk
  for (float bad : {std::nanf(""), INFINITY, -1.0f}) {
    for (uint32_t where : {0u, 2u}) {
      SCOPED_TRACE("bad=" + std::to_string(bad) + " chunk=" + std::to_string(where));
      std::vector<uint8_t> chunks(count * bytes, 0x5A);
      for (uint32_t c = 0; c < count; ++c) {
        const float s = c == where ? bad : 0.5f;
        std::memcpy(chunks.data() + c * bytes, &s, 4);
      }
      for (bool sum : {false, true}) {
        const auto cpu = decode_junk(chunks, count, false, sum);
        const auto gpu = decode_junk(chunks, count, true, sum);
        ASSERT_EQ(cpu.first, LOOM_ERR_DATA_LOSS) << cpu.second;
        EXPECT_EQ(gpu.first, cpu.first) << gpu.second;
        EXPECT_EQ(gpu.second.rfind(cpu.second, 0), 0u)
            << "CUDA: " << gpu.second << "\nCPU:  " << cpu.second;
      }
    }
  }
  // -0 is a valid scale on both.
  std::vector<uint8_t> chunks(bytes, 0x5A);
  const float neg_zero = -0.0f;
  std::memcpy(chunks.data(), &neg_zero, 4);
  std::vector<float> out(512);
  int64_t shape = 512;
  DeviceBuffer din(bytes), dout(512 * 4);
  cu::copy_to_device(din.ptr, chunks.data(), bytes);
  DLTensor ot{dout.ptr, {kDLCUDA, 0}, 1, {kDLFloat, 32, 1}, &shape, nullptr, 0};
  loom_codec_decode_args d{};
  d.struct_size = LOOM_CODEC_DECODE_ARGS_SIZE;
  d.chunk_count = 1;
  d.input = din.ptr;
  d.output = &ot;
  d.alpha = 1.0f;
  EXPECT_EQ(take(vt_->decode(obj_, &d)).first, 0);
}

}  // namespace
