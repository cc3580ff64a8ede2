// seqlen and vocabulary_rarity through the host with CUDA tensors: the same scores and counts,
// bit for bit, as with host tensors, on a borrowed stream; a bad token comes back as a status
// naming it. Skips without a CUDA device (the CUDA emulation provides one).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <loom/embed.h>
#include <loom/kinds/curriculum.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "samples.hpp"

namespace {

using namespace curriculum_test;

constexpr const char* kKind = LOOM_KIND_CURRICULUM;
constexpr DLDevice kCuda{kDLCUDA, 0};

struct Metric {
  loom_instance* inst = nullptr;
  void* obj = nullptr;
  const loom_curriculum_v1* t = nullptr;
  std::string error;
  Metric(loom_session* s, const char* name) {
    EXPECT_EQ(loom_find_instance(s, kKind, name, &inst), 0) << loom_last_error();
    const void* table = nullptr;
    EXPECT_EQ(loom_instance_table(inst, kKind, LOOM_CURRICULUM_V1_MIN_SIZE, &obj, &table), 0)
        << loom_last_error();
    t = static_cast<const loom_curriculum_v1*>(table);
  }
  int32_t take(loom_status* st) {
    std::array<char, 1024> msg{};
    const int32_t rc = loom_instance_take_status(inst, st, msg.data(), msg.size());
    error = msg.data();
    return rc;
  }
};

template <class T>
T* device_copy(const std::vector<T>& host) {
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, std::max<std::size_t>(1, host.size() * sizeof(T))), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
            cudaSuccess);
  return static_cast<T*>(p);
}

template <class T>
std::vector<T> host_copy(const T* dev, std::size_t n) {
  std::vector<T> out(n);
  EXPECT_EQ(cudaMemcpy(out.data(), dev, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

TEST(CurriculumCudaPlugins, DeviceTensorsScoreAsHostTensors) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    GTEST_SKIP() << "no CUDA device";
  }
  loom_open_options o{};
  o.struct_size = LOOM_OPEN_OPTIONS_SIZE;
  o.log_level = -1;
  loom_session* s = nullptr;
  ASSERT_EQ(loom_open_string("[curriculum.len]\nplugin = \"seqlen\"\npad_token = 3\n"
                             "[curriculum.voc]\nplugin = \"vocabulary_rarity\"\n",
                             "test.toml", &o, &s),
            0)
      << loom_last_error();
  Metric len(s, "len"), voc(s, "voc");
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  constexpr uint32_t kVocab = 700;
  HostBatch h = random_batch(21, 500, 200, kVocab);
  const auto n = static_cast<int64_t>(h.offsets.size()) - 1;
  const auto nt = static_cast<int64_t>(h.tokens.size());
  std::vector<int32_t> tok32(h.tokens.begin(), h.tokens.end());
  int32_t* dtok = device_copy(tok32);
  int64_t* doff = device_copy(h.offsets);
  std::vector<double> zeros(n, 0);
  double* dscores = device_copy(zeros);
  std::vector<int64_t> zero_stats(kVocab, 0);
  int64_t* dstats = device_copy(zero_stats);
  Tensor htok(tok32.data(), nt, kI32), hoff(h.offsets.data(), n + 1, kI64);
  Tensor dt(dtok, nt, kI32, kCuda), dof(doff, n + 1, kI64, kCuda);
  std::vector<double> hscores(n);
  Tensor hout(hscores.data(), n, kF64), dout(dscores, n, kF64, kCuda);
  std::vector<int64_t> hstats(kVocab, 0);
  Tensor hst(hstats.data(), kVocab, kI64), dst(dstats, kVocab, kI64, kCuda);

  auto a = score_args(htok, hoff, kVocab, nullptr, hout);
  ASSERT_EQ(len.take(len.t->score(len.obj, &a)), 0) << len.error;
  auto b = score_args(dt, dof, kVocab, nullptr, dout, stream);
  ASSERT_EQ(len.take(len.t->score(len.obj, &b)), 0) << len.error;
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(host_copy(dscores, n), hscores);

  auto c = count_args(htok, hoff, kVocab, hst);
  ASSERT_EQ(voc.take(voc.t->count(voc.obj, &c)), 0) << voc.error;
  auto d = count_args(dt, dof, kVocab, dst, stream);
  ASSERT_EQ(voc.take(voc.t->count(voc.obj, &d)), 0) << voc.error;
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(host_copy(dstats, kVocab), hstats);

  auto e = score_args(htok, hoff, kVocab, hst.get(), hout);
  ASSERT_EQ(voc.take(voc.t->score(voc.obj, &e)), 0) << voc.error;
  auto f = score_args(dt, dof, kVocab, dst.get(), dout, stream);
  ASSERT_EQ(voc.take(voc.t->score(voc.obj, &f)), 0) << voc.error;
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  const auto got = host_copy(dscores, n);
  EXPECT_EQ(std::memcmp(got.data(), hscores.data(), n * sizeof(double)), 0);

  // A token out of range in device memory: an error naming it, nothing added to the stats.
  const int32_t bad = static_cast<int32_t>(kVocab) + 5;
  ASSERT_EQ(cudaMemcpy(dtok + 77, &bad, sizeof(bad), cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(voc.take(voc.t->count(voc.obj, &d)), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(voc.error.find("samples.tokens[77] is 705"), std::string::npos) << voc.error;
  EXPECT_EQ(host_copy(dstats, kVocab), hstats);
  EXPECT_EQ(len.take(len.t->score(len.obj, &b)), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(len.error.find("samples.tokens[77] is 705"), std::string::npos) << len.error;

  // Bad offsets: the same text for device offsets (checked by the kernels) as for host offsets
  // (checked by the SDK before the plugin runs).
  for (const std::vector<int64_t>& bad_off :
       {std::vector<int64_t>{0, 5, 3, 9}, std::vector<int64_t>{0, 5, nt + 1, nt + 2},
        std::vector<int64_t>{0, 5, -4, 9}}) {
    std::vector<int64_t> off4 = bad_off;
    int64_t* doff4 = device_copy(off4);
    Tensor ho(off4.data(), 4, kI64), dofb(doff4, 4, kI64, kCuda);
    std::vector<double> hs3(3);
    double* ds3 = device_copy(hs3);
    Tensor hs(hs3.data(), 3, kF64), dsb(ds3, 3, kF64, kCuda);
    auto hb = score_args(htok, ho, kVocab, nullptr, hs);
    auto db = score_args(dt, dofb, kVocab, nullptr, dsb, stream);
    EXPECT_EQ(len.take(len.t->score(len.obj, &hb)), LOOM_ERR_INVALID_ARGUMENT);
    const std::string host_error = len.error;
    EXPECT_EQ(len.take(len.t->score(len.obj, &db)), LOOM_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(len.error, host_error);
    EXPECT_NE(host_error.find("samples.offsets[2] = "), std::string::npos) << host_error;
    cudaFree(doff4);
    cudaFree(ds3);
  }

  for (void* p : {static_cast<void*>(dtok), static_cast<void*>(doff), static_cast<void*>(dscores),
                  static_cast<void*>(dstats)}) {
    cudaFree(p);
  }
  cudaStreamDestroy(stream);
  loom_close(s);
}

}  // namespace
