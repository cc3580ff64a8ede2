// topk_router through the host with CUDA tensors: select (indices, gates, saved) and backward
// (dx, dweight) the same bits as with host tensors, for fp32 and fp64, sigmoid and linear
// gates, tied scores, strided x, and sequences shorter and longer than a select block.
// Skips without a CUDA device (the CUDA emulation provides one).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <loom/embed.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "topk_helpers.hpp"

namespace {

using namespace topk_test;

constexpr DLDevice kCuda{kDLCUDA, 0};

// Device memory, 256-byte aligned (the plan's rule for saved and workspace).
struct DeviceBuffer {
  void* base = nullptr;
  void* p = nullptr;
  explicit DeviceBuffer(std::size_t n) {
    EXPECT_EQ(cudaMalloc(&base, std::max<std::size_t>(n, 1) + 256), cudaSuccess);
    p = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(base) + 255) / 256 * 256);
  }
  DeviceBuffer(const void* host, std::size_t n) : DeviceBuffer(n) {
    EXPECT_EQ(cudaMemcpy(p, host, n, cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~DeviceBuffer() { (void)cudaFree(base); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <class T>
  std::vector<T> read(std::size_t count) const {
    std::vector<T> out(count);
    EXPECT_EQ(cudaMemcpy(out.data(), p, count * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
};

bool have_device() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// x stored [seq_len, batch, channels] (strided view) when `transposed`.
template <class T>
void compare(const char* params, Problem<T> pr, bool transposed) {
  SCOPED_TRACE(std::string(params) + " batch " + std::to_string(pr.batch) + " seq_len " +
               std::to_string(pr.seq_len) + (transposed ? " transposed" : ""));
  Session s("[router.r]\nplugin = \"topk_router\"\n" + std::string(params) + "\n");
  ASSERT_TRUE(s.error.empty()) << s.error;
  Router r(s, "r");
  // Host reference (contiguous x).
  Selection<T> host = select_host(r, pr);
  ASSERT_EQ(host.rc, 0) << r.error;
  std::vector<T> dg(host.gates.size());
  for (std::size_t k = 0; k < dg.size(); ++k) dg[k] = static_cast<T>(std::cos(0.7 * double(k)));
  std::vector<T> hdx(pr.x.size(), T(0.125)), hdw(pr.w.size(), T(-1));
  ASSERT_EQ(backward_host(r, pr, host, dg, hdx, hdw), 0) << r.error;

  const int64_t B = pr.batch, S = pr.seq_len, C = pr.channels;
  loom_router_plan_args p = plan_args(B, S, C, pr.layer, pr.num_layers, Problem<T>::dtype());
  ASSERT_EQ(r.plan(p), 0) << r.error;
  const int64_t K = p.kept;
  ASSERT_EQ(K, host.kept);
  // x on the device, maybe as [S, B, C] storage.
  std::vector<T> xs(pr.x.size());
  std::vector<int64_t> strides;
  if (transposed) {
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t q = 0; q < S; ++q) {
        for (int64_t c = 0; c < C; ++c) {
          xs[static_cast<std::size_t>((q * B + b) * C + c)] = pr.at(b, q, c);
        }
      }
    }
    strides = {C, B * C, 1};
  } else {
    xs = pr.x;
  }
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  const std::size_t E = sizeof(T);
  DeviceBuffer dx_(xs.data(), xs.size() * E), dw_(pr.w.data(), pr.w.size() * E);
  DeviceBuffer didx(static_cast<std::size_t>(B * K) * 4),
      dgates(static_cast<std::size_t>(B * K) * E);
  DeviceBuffer dsaved(p.saved_bytes), dws(p.workspace_bytes);
  View x(dx_.p, {B, S, C}, Problem<T>::dtype(), strides, kCuda);
  View w(dw_.p, {C}, Problem<T>::dtype(), {}, kCuda);
  View idx(didx.p, {B, K}, kI32, {}, kCuda);
  View g(dgates.p, {B, K}, Problem<T>::dtype(), {}, kCuda);
  loom_router_select_args a{};
  a.struct_size = LOOM_ROUTER_SELECT_ARGS_SIZE;
  a.step = 1;
  a.batch = B;
  a.seq_len = S;
  a.channels = C;
  a.layer = pr.layer;
  a.num_layers = pr.num_layers;
  a.training = 1;
  a.x = x.get();
  a.weight = w.get();
  a.indices = idx.get();
  a.gates = g.get();
  a.saved = dsaved.p;
  a.saved_bytes = p.saved_bytes;
  a.workspace = dws.p;
  a.workspace_bytes = p.workspace_bytes;
  a.stream = stream;
  ASSERT_EQ(r.take(r.t->select(r.obj, &a)), 0) << r.error;
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(didx.read<int32_t>(static_cast<std::size_t>(B * K)), host.indices);
  const std::vector<T> gates = dgates.read<T>(static_cast<std::size_t>(B * K));
  const std::vector<double> saved = dsaved.read<double>(static_cast<std::size_t>(B * K));
  EXPECT_EQ(std::memcmp(gates.data(), host.gates.data(), gates.size() * E), 0) << "gates";
  EXPECT_EQ(std::memcmp(saved.data(), host.saved.data(), saved.size() * 8), 0) << "saved";

  // backward: dx in x's layout, starting from the host's initial values.
  std::vector<T> dx0(xs.size(), T(0.125));
  DeviceBuffer ddx(dx0.data(), dx0.size() * E);
  std::vector<T> dw0(pr.w.size(), T(-1));
  DeviceBuffer ddw(dw0.data(), dw0.size() * E);
  DeviceBuffer ddg(dg.data(), dg.size() * E);
  View dxv(ddx.p, {B, S, C}, Problem<T>::dtype(), strides, kCuda);
  View dwv(ddw.p, {C}, Problem<T>::dtype(), {}, kCuda);
  View dgv(ddg.p, {B, K}, Problem<T>::dtype(), {}, kCuda);
  loom_router_backward_args ba{};
  ba.struct_size = LOOM_ROUTER_BACKWARD_ARGS_SIZE;
  ba.batch = B;
  ba.seq_len = S;
  ba.channels = C;
  ba.x = x.get();
  ba.weight = w.get();
  ba.indices = idx.get();
  ba.dgates = dgv.get();
  ba.dx = dxv.get();
  ba.dweight = dwv.get();
  ba.saved = dsaved.p;
  ba.saved_bytes = p.saved_bytes;
  ba.workspace = dws.p;
  ba.workspace_bytes = p.workspace_bytes;
  ba.stream = stream;
  ASSERT_EQ(r.take(r.t->backward(r.obj, &ba)), 0) << r.error;
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  std::vector<T> got_dx = ddx.read<T>(xs.size());
  std::vector<T> dx_bsc(xs.size());
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t q = 0; q < S; ++q) {
      for (int64_t c = 0; c < C; ++c) {
        const int64_t from = transposed ? (q * B + b) * C + c : (b * S + q) * C + c;
        dx_bsc[static_cast<std::size_t>((b * S + q) * C + c)] =
            got_dx[static_cast<std::size_t>(from)];
      }
    }
  }
  EXPECT_EQ(std::memcmp(dx_bsc.data(), hdx.data(), hdx.size() * E), 0) << "dx";
  const std::vector<T> got_dw = ddw.read<T>(pr.w.size());
  EXPECT_EQ(std::memcmp(got_dw.data(), hdw.data(), hdw.size() * E), 0) << "dweight";
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

TEST(TopKRouterCuda, SelectAndBackwardMatchHostBitForBit) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  compare("capacity = 0.3", random_problem<float>(3, 45, 19, 1), false);
  compare("capacity = 0.3\ngate = \"linear\"", random_problem<double>(2, 45, 19, 2), true);
  compare("capacity = 0.6", random_problem<double>(2, 5, 3, 3), false);      // fewer than a block
  compare("capacity = 0.125", random_problem<float>(2, 700, 8, 4), true);    // runs per thread
  compare("capacity = 0.2", random_problem<double>(1, 33000, 2, 6), false);  // a long sequence
}

TEST(TopKRouterCuda, TiedScoresMatchHost) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  Problem<double> pr = random_problem<double>(3, 300, 2, 5);
  pr.w = {1.0, 0.0};
  for (int64_t b = 0; b < pr.batch; ++b) {
    for (int64_t q = 0; q < pr.seq_len; ++q) {
      pr.at(b, q, 0) = static_cast<double>((q * 5 + b) % 3);
      pr.at(b, q, 1) = q % 7 == 0 ? -0.0 : 0.0;
    }
  }
  pr.at(0, 10, 0) = -0.0;
  pr.at(1, 4, 0) = std::nan("");
  compare("capacity = 0.5", pr, false);
  compare("capacity = 0.01\ngate = \"linear\"", pr, false);
}

}  // namespace
