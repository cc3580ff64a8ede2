// random_ltd's CUDA selection against the host's, bit for bit (odd lengths, one kept, all
// but one kept, everything kept, 32768+ positions), then a gather and a scatter on the
// device with the device's rows against the host's. Skips without a CUDA device (the CUDA
// emulation provides one).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <loom/embed.h>
#include <loom/kinds/router.h>
#include <loom/sdk/status.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include <loom/routers/router_core.hpp>
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
    if (bytes > 0) {
      EXPECT_EQ(cudaMalloc(&ws, bytes), cudaSuccess);
    }
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

// Keys with many ties (Philox keys practically never tie): the radix select's tie branches
// (a bucket taken in part, all eight passes, the first equal keys by position) against the
// host's nth_element, with the expected rows checked independently on small cases.
TEST_F(RouterCudaLtd, TiedKeysMatchTheHost) {
  struct Case {
    const char* name;
    int64_t batch, seq_len, kept;
    uint64_t (*key)(int64_t b, int64_t p);
  };
  const Case cases[] = {
      {"all equal", 2, 700, 300, [](int64_t, int64_t) { return uint64_t{42}; }},
      {"five values", 3, 2049, 1000,
       [](int64_t b, int64_t p) { return static_cast<uint64_t>((p * 7 + b) % 5) << 61; }},
      // Equal top 56 bits: only the last pass tells the keys apart.
      {"low byte", 2, 4099, 1234,
       [](int64_t b, int64_t p) {
         return uint64_t{0xabcdef0123456700} | static_cast<uint64_t>((p * 13 + b) % 3);
       }},
      {"two values, max key", 1, 5000, 2500,
       [](int64_t, int64_t p) { return p % 2 == 0 ? ~uint64_t{0} : ~uint64_t{0} - 1; }},
      {"one kept of ties", 2, 300, 1, [](int64_t, int64_t p) { return uint64_t(p % 4 != 3); }},
      {"all kept", 2, 64, 64, [](int64_t, int64_t) { return uint64_t{0}; }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const auto n = static_cast<std::size_t>(c.batch * c.seq_len);
    std::vector<uint64_t> keys(n);
    for (int64_t b = 0; b < c.batch; ++b) {
      for (int64_t p = 0; p < c.seq_len; ++p)
        keys[static_cast<std::size_t>(b * c.seq_len + p)] = c.key(b, p);
    }
    const auto m = static_cast<std::size_t>(c.batch * c.kept);
    std::vector<int32_t> want(m, -1);
    ltd::select_keys_cpu(keys.data(), c.batch, c.seq_len, c.kept, want.data());
    void* dkeys = nullptr;
    void* didx = nullptr;
    ASSERT_EQ(cudaMalloc(&dkeys, n * 8), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&didx, m * 4), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(dkeys, keys.data(), n * 8, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemset(didx, 0xff, m * 4), cudaSuccess);
    ltd::cuda::select_keys(static_cast<const uint64_t*>(dkeys), c.batch, c.seq_len, c.kept,
                           static_cast<int32_t*>(didx), 0, stream_);
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    std::vector<int32_t> got(m);
    ASSERT_EQ(cudaMemcpy(got.data(), didx, m * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    cudaFree(dkeys);
    cudaFree(didx);
    EXPECT_EQ(got, want);
    // Independently: a stable sort by key gives the set, then position order.
    for (int64_t b = 0; b < c.batch; ++b) {
      std::vector<int32_t> order(static_cast<std::size_t>(c.seq_len));
      for (int64_t p = 0; p < c.seq_len; ++p)
        order[static_cast<std::size_t>(p)] = static_cast<int32_t>(p);
      const uint64_t* row = keys.data() + b * c.seq_len;
      std::stable_sort(order.begin(), order.end(),
                       [row](int32_t x, int32_t y) { return row[x] < row[y]; });
      order.resize(static_cast<std::size_t>(c.kept));
      std::sort(order.begin(), order.end());
      const std::vector<int32_t> mine(got.begin() + b * c.kept, got.begin() + (b + 1) * c.kept);
      EXPECT_EQ(mine, order) << "sequence " << b;
    }
  }
  // Bad sizes are refused, not launched.
  EXPECT_THROW(ltd::cuda::select_keys(nullptr, 1, 4, 5, nullptr, 0, stream_), loom::sdk::Error);
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

// Through the host: the plugin's plan and select with device indices and workspace, then
// gather and scatter on the device, against the same calls on host tensors.
TEST_F(RouterCudaLtd, PluginOnDeviceMatchesHost) {
  loom_open_options o{};
  o.struct_size = LOOM_OPEN_OPTIONS_SIZE;
  o.log_level = -1;
  loom_session* session = nullptr;
  const char* toml =
      "[router.ltd]\nplugin = \"random_ltd\"\nmin_value = 16\nmax_value = 300\n"
      "require_steps = 100\n";
  ASSERT_EQ(loom_open_string(toml, "test.toml", &o, &session), 0) << loom_last_error();
  loom_instance* inst = nullptr;
  ASSERT_EQ(loom_find_instance(session, LOOM_KIND_ROUTER, "ltd", &inst), 0) << loom_last_error();
  void* obj = nullptr;
  const void* table = nullptr;
  ASSERT_EQ(loom_instance_table(inst, LOOM_KIND_ROUTER, LOOM_ROUTER_V1_MIN_SIZE, &obj, &table), 0);
  const auto* t = static_cast<const loom_router_v1*>(table);
  auto take = [&](loom_status* st) {
    std::array<char, 1024> msg{};
    const int32_t rc = loom_instance_take_status(inst, st, msg.data(), msg.size());
    EXPECT_EQ(rc, 0) << msg.data();
    return rc;
  };
  const int64_t B = 3, S = 300, C = 4, step = 40;
  loom_router_plan_args p{};
  p.struct_size = LOOM_ROUTER_PLAN_ARGS_SIZE;
  p.batch = B;
  p.seq_len = S;
  p.channels = C;
  p.step = step;
  p.layer = 1;
  p.num_layers = 4;
  p.training = 1;
  p.dtype = kF32;
  ASSERT_EQ(take(t->plan(obj, &p)), 0);
  const int64_t K = p.kept;
  ASSERT_EQ(K, 112);  // t = 39: floor(39 / 100 * 284 + 16) = 126, down to a multiple of 16
  ASSERT_EQ(p.workspace_bytes, static_cast<uint64_t>(B * S * 8));
  // Device buffers; the workspace 256-byte aligned inside a larger allocation.
  void *didx = nullptr, *dws = nullptr, *dx = nullptr, *dk = nullptr, *dout = nullptr;
  ASSERT_EQ(cudaMalloc(&didx, static_cast<std::size_t>(B * K) * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dws, p.workspace_bytes + 256), cudaSuccess);
  void* ws = static_cast<char*>(dws) + (256 - reinterpret_cast<uintptr_t>(dws) % 256) % 256;
  View di(didx, {B, K}, kI32, {}, kCuda);
  loom_router_select_args a{};
  a.struct_size = LOOM_ROUTER_SELECT_ARGS_SIZE;
  a.seed = 99;
  a.step = step;
  a.batch = B;
  a.seq_len = S;
  a.channels = C;
  a.first_sample = 7;
  a.layer = 1;
  a.num_layers = 4;
  a.training = 1;
  a.indices = di.get();
  a.workspace = ws;
  a.workspace_bytes = p.workspace_bytes;
  a.stream = stream_;
  ASSERT_EQ(take(t->select(obj, &a)), 0);
  // The same select into host indices.
  std::vector<int32_t> hidx(static_cast<std::size_t>(B * K), -1);
  std::vector<unsigned char> hws(p.workspace_bytes + 256);
  View hi(hidx.data(), {B, K}, kI32);
  loom_router_select_args h = a;
  h.indices = hi.get();
  h.workspace = hws.data() + (256 - reinterpret_cast<uintptr_t>(hws.data()) % 256) % 256;
  h.stream = nullptr;
  ASSERT_EQ(take(t->select(obj, &h)), 0);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  std::vector<int32_t> got(hidx.size());
  ASSERT_EQ(cudaMemcpy(got.data(), didx, got.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(got, hidx);
  // gather + scatter on both.
  const std::vector<unsigned char> x = random_bytes(static_cast<std::size_t>(B * S * C) * 4, 5);
  std::vector<unsigned char> hx = x, hk(static_cast<std::size_t>(B * K * C) * 4), hout(x.size(), 0);
  ASSERT_EQ(cudaMalloc(&dx, x.size()), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dk, hk.size()), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dout, x.size()), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dx, x.data(), x.size(), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(dout, 0, x.size()), cudaSuccess);
  View hxv(hx.data(), {B, S, C}, kF32), hkv(hk.data(), {B, K, C}, kF32),
      hov(hout.data(), {B, S, C}, kF32);
  View dxv(dx, {B, S, C}, kF32, {}, kCuda), dkv(dk, {B, K, C}, kF32, {}, kCuda),
      dov(dout, {B, S, C}, kF32, {}, kCuda);
  const loom_router_move_args hg = move_args(hxv, hkv, hi), hs = move_args(hov, hkv, hi);
  const loom_router_move_args dg = move_args(dxv, dkv, di, stream_),
                              ds = move_args(dov, dkv, di, stream_);
  ASSERT_EQ(take(t->gather(obj, &hg)), 0);
  ASSERT_EQ(take(t->scatter(obj, &hs)), 0);
  ASSERT_EQ(take(t->gather(obj, &dg)), 0);
  ASSERT_EQ(take(t->scatter(obj, &ds)), 0);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  std::vector<unsigned char> gk(hk.size()), gout(hout.size());
  ASSERT_EQ(cudaMemcpy(gk.data(), dk, gk.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(gout.data(), dout, gout.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(gk, hk);
  EXPECT_EQ(gout, hout);
  for (void* ptr : {didx, dws, dx, dk, dout}) cudaFree(ptr);
  loom_close(session);
}

}  // namespace
