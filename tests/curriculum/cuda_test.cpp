// The metric kernels on CUDA tensors against the same calls on host tensors: bit-identical
// scores and counts for every token dtype, and the same error for the same bad data (with
// nothing added to the stats). Skips without a CUDA device (the CUDA emulation provides one).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <loom/sdk/status.hpp>

#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "kernels.hpp"
#include "metrics.hpp"
#include "samples.hpp"

namespace {

namespace cl = loom::data::curriculum;
using namespace curriculum_test;

constexpr DLDevice kCuda{kDLCUDA, 0};

class CurriculumCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cl::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  cudaStream_t stream_ = nullptr;
};

// Device copy of a host buffer, freed at scope end.
struct DeviceBuffer {
  void* p = nullptr;
  std::size_t bytes = 0;
  DeviceBuffer(const void* host, std::size_t n) : bytes(n) {
    EXPECT_EQ(cudaMalloc(&p, n == 0 ? 1 : n), cudaSuccess);
    if (n > 0) EXPECT_EQ(cudaMemcpy(p, host, n, cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <class T>
  std::vector<T> read(std::size_t count) const {
    std::vector<T> out(count);
    if (count > 0) {
      EXPECT_EQ(cudaMemcpy(out.data(), p, count * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return out;
  }
};

// A batch on both sides.
struct Both {
  HostBatch host;
  DLDataType dtype;
  std::vector<unsigned char> bytes;
  DeviceBuffer dtok, doff;
  Tensor htokens, hoffsets, dtokens, doffsets;
  Both(HostBatch h, DLDataType dt)
      : host(std::move(h)),
        dtype(dt),
        bytes(pack(host.tokens, dt)),
        dtok(bytes.data(), bytes.size()),
        doff(host.offsets.data(), host.offsets.size() * sizeof(int64_t)) {
    const auto nt = static_cast<int64_t>(host.tokens.size());
    const auto no = static_cast<int64_t>(host.offsets.size());
    htokens = Tensor(bytes.data(), nt, dt);
    hoffsets = Tensor(host.offsets.data(), no, kI64);
    dtokens = Tensor(dtok.p, nt, dt, kCuda);
    doffsets = Tensor(doff.p, no, kI64, kCuda);
  }
  int64_t samples() const { return static_cast<int64_t>(host.offsets.size()) - 1; }
};

bool same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const loom::sdk::Error& e) {
    EXPECT_EQ(e.code(), LOOM_ERR_INVALID_ARGUMENT) << e.what();
    return e.what();
  }
  return "(no error)";
}

TEST_F(CurriculumCuda, SameScoresAndCountsAsCpu) {
  constexpr uint32_t kVocab = 3000;
  for (DLDataType dt : {kU16, kI32, kI64}) {
    SCOPED_TRACE(std::to_string(dt.bits));
    Both b(random_batch(11 + dt.bits, 700, 300, kVocab), dt);
    const int64_t n = b.samples();
    // seqlen, no padding and padding 0
    for (int64_t pad : {int64_t{-1}, int64_t{0}}) {
      std::vector<double> hs(n, -1);
      Tensor hout(hs.data(), n, kF64);
      cl::seqlen_score(score_args(b.htokens, b.hoffsets, kVocab, nullptr, hout), pad);
      DeviceBuffer ds(hs.data(), n * sizeof(double));
      Tensor dout(ds.p, n, kF64, kCuda);
      cl::seqlen_score(score_args(b.dtokens, b.doffsets, kVocab, nullptr, dout, stream_), pad);
      ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
      EXPECT_TRUE(same_bits(hs, ds.read<double>(n))) << "pad " << pad;
    }
    // counts, starting from non-zero
    std::vector<int64_t> hc(kVocab, 2);
    Tensor hst(hc.data(), kVocab, kI64);
    cl::rarity_count(count_args(b.htokens, b.hoffsets, kVocab, hst));
    std::vector<int64_t> start(kVocab, 2);
    DeviceBuffer dc(start.data(), kVocab * sizeof(int64_t));
    Tensor dst(dc.p, kVocab, kI64, kCuda);
    cl::rarity_count(count_args(b.dtokens, b.doffsets, kVocab, dst, stream_));
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    EXPECT_EQ(dc.read<int64_t>(kVocab), hc);
    // rarity
    std::vector<double> hr(n, -1);
    Tensor hout(hr.data(), n, kF64);
    cl::rarity_score(score_args(b.htokens, b.hoffsets, kVocab, hst.get(), hout));
    DeviceBuffer dr(hr.data(), n * sizeof(double));
    Tensor dout(dr.p, n, kF64, kCuda);
    cl::rarity_score(score_args(b.dtokens, b.doffsets, kVocab, dst.get(), dout, stream_));
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    const auto got = dr.read<double>(n);
    EXPECT_TRUE(same_bits(hr, got));
    for (int64_t i = 0; i < n; ++i) {
      if (std::memcmp(&hr[i], &got[i], sizeof(double)) != 0) {
        ADD_FAILURE() << "sample " << i << ": cpu " << hr[i] << " cuda " << got[i];
        break;
      }
    }
  }
}

// A sample too long for the exact fixed-point sum: the same problem as the CPU's (the first such
// sample), and with a larger limit the same scores.
TEST_F(CurriculumCuda, RaritySampleTooLongAsCpu) {
  HostBatch h;
  h.tokens.assign(20, 1);
  h.offsets = {0, 5, 11, 20};
  Both b(h, kU16);
  cl::RarityTable table;
  table.value = {7, 9};
  table.max_tokens = 5;
  cl::SampleData hd;
  hd.tokens = b.bytes.data();
  hd.type = cl::TokenType::kU16;
  hd.token_count = 20;
  hd.offsets = b.host.offsets.data();
  hd.samples = 3;
  hd.vocab_size = 2;
  cl::SampleData dd = hd;
  dd.tokens = b.dtok.p;
  dd.offsets = static_cast<const int64_t*>(b.doff.p);
  std::vector<double> hs(3);
  DeviceBuffer ds(hs.data(), 3 * sizeof(double));
  const cl::Problem hp = cl::rarity_cpu(hd, table, hs.data());
  const cl::Problem dp = cl::cuda::rarity(dd, table, static_cast<double*>(ds.p), 0, stream_);
  EXPECT_EQ(hp.kind, cl::Problem::kSampleTooLong);
  EXPECT_EQ(dp.kind, hp.kind);
  EXPECT_EQ(dp.index, hp.index);
  EXPECT_EQ(dp.value, hp.value);
  EXPECT_EQ(dp.previous, hp.previous);
  table.max_tokens = 9;
  ASSERT_EQ(cl::rarity_cpu(hd, table, hs.data()).kind, cl::Problem::kNone);
  ASSERT_EQ(cl::cuda::rarity(dd, table, static_cast<double*>(ds.p), 0, stream_).kind,
            cl::Problem::kNone);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  EXPECT_TRUE(same_bits(hs, ds.read<double>(3)));
}

TEST_F(CurriculumCuda, SameErrorsAsCpu) {
  constexpr uint32_t kVocab = 10;
  HostBatch h;
  h.tokens = {1, 2, 3, 4, 5, 6, 7, 8};
  h.offsets = {0, 2, 4, 6, 8};
  struct Case {
    const char* what;
    HostBatch batch;
  };
  std::vector<Case> cases;
  cases.push_back({"token too large", h});
  cases.back().batch.tokens[5] = 10;
  cases.push_back({"token negative", h});
  cases.back().batch.tokens[6] = -1;
  cases.back().batch.tokens[7] = 99;
  cases.push_back({"offsets decreasing", h});
  cases.back().batch.offsets = {0, 4, 3, 6, 8};
  cases.push_back({"offsets decreasing and a bad token before", h});
  cases.back().batch.offsets = {0, 2, 4, 8, 6};
  cases.back().batch.tokens[0] = 50;
  cases.push_back({"offset beyond", h});
  cases.back().batch.offsets = {0, 2, 4, 6, 9};
  cases.push_back({"offset negative", h});
  cases.back().batch.offsets = {-2, 2, 4, 6, 8};
  cases.push_back({"a later offset negative", h});
  cases.back().batch.offsets = {0, 2, -1, 6, 8};
  cases.push_back({"decreasing then beyond", h});
  cases.back().batch.offsets = {0, 2, 1, 9, 8};
  cases.push_back({"first offset beyond", h});
  cases.back().batch.offsets = {9, 9, 9, 9, 9};
  for (auto& c : cases) {
    SCOPED_TRACE(c.what);
    Both b(c.batch, kI32);
    const int64_t n = b.samples();
    std::vector<double> hs(n);
    Tensor hout(hs.data(), n, kF64);
    DeviceBuffer ds(hs.data(), n * sizeof(double));
    Tensor dout(ds.p, n, kF64, kCuda);
    std::vector<int64_t> ones(kVocab, 1);
    Tensor hst(ones.data(), kVocab, kI64);
    DeviceBuffer dc(ones.data(), kVocab * sizeof(int64_t));
    Tensor dst(dc.p, kVocab, kI64, kCuda);
    const std::string cpu_seqlen = error_of(
        [&] { cl::seqlen_score(score_args(b.htokens, b.hoffsets, kVocab, nullptr, hout), -1); });
    EXPECT_NE(cpu_seqlen, "(no error)");
    EXPECT_EQ(error_of([&] {
                cl::seqlen_score(score_args(b.dtokens, b.doffsets, kVocab, nullptr, dout, stream_),
                                 -1);
              }),
              cpu_seqlen);
    EXPECT_EQ(
        error_of([&] {
          cl::rarity_score(score_args(b.dtokens, b.doffsets, kVocab, dst.get(), dout, stream_));
        }),
        error_of(
            [&] { cl::rarity_score(score_args(b.htokens, b.hoffsets, kVocab, hst.get(), hout)); }));
    EXPECT_EQ(error_of([&] {
                cl::rarity_count(count_args(b.dtokens, b.doffsets, kVocab, dst, stream_));
              }),
              error_of([&] { cl::rarity_count(count_args(b.htokens, b.hoffsets, kVocab, hst)); }));
    EXPECT_EQ(dc.read<int64_t>(kVocab), std::vector<int64_t>(kVocab, 1))
        << "a failed count added to the device stats";
  }
}

TEST_F(CurriculumCuda, MixedDevicesRefused) {
  Both b(random_batch(5, 4, 4, 10), kU16);
  std::vector<double> hs(4);
  Tensor hout(hs.data(), 4, kF64);
  EXPECT_NE(error_of([&] {
              cl::seqlen_score(score_args(b.dtokens, b.doffsets, 10, nullptr, hout, stream_), -1);
            }).find("scores is on cpu, expected cuda:0"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              cl::seqlen_score(score_args(b.dtokens, b.hoffsets, 10, nullptr, hout, stream_), -1);
            }).find("samples.offsets is on cpu but samples.tokens is on cuda:0"),
            std::string::npos);
  // Negative counts in device stats.
  std::vector<int64_t> neg(10, 1);
  neg[7] = -4;
  DeviceBuffer dc(neg.data(), 10 * sizeof(int64_t));
  Tensor dst(dc.p, 10, kI64, kCuda);
  DeviceBuffer ds(hs.data(), 4 * sizeof(double));
  Tensor dout(ds.p, 4, kF64, kCuda);
  EXPECT_NE(error_of([&] {
              cl::rarity_score(score_args(b.dtokens, b.doffsets, 10, dst.get(), dout, stream_));
            }).find("stats[7] is -4"),
            std::string::npos);
}

}  // namespace
