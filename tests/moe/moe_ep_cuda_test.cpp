// The MoE exchange (plugins/moe/core/exchange.cpp) on CUDA memory, over the thread_comm test
// transport (2 and 4 ranks as threads of this process, one device): rows and gradients on
// the device, once with the transport taking device buffers itself and once through a copy
// of its table that says it cannot (so the exchange stages through host memory), and once
// through a table that takes device memory only, as nccl does (so the counts travel in device
// memory as well). The same
// checks as the host test: the counts, the order of the rows after forward and reverse, and
// reduce_gradients as the sum over the expert-data-parallel group divided by the world size.
// Skips without a CUDA device; the CUDA emulation pass runs it on the CPU.
#include <cuda_runtime.h>
#include <loom/embed.h>
#include <loom/kinds/comm.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include <loom/moe/exchange.hpp>
#include "thread_comm_dir.hpp"

namespace {

using loom::moe::Exchange;

bool have_gpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

void on_threads(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back(fn, r);
  for (auto& t : threads) t.join();
}

// The thread_comm table with the device entries saying "host memory only".
int32_t host_only(void*, DLDevice d) { return d.device_type == kDLCPU ? 1 : 0; }
loom_status* host_only2(void*, loom_comm_device_args* a) {
  a->supported = a->device.device_type == kDLCPU ? 1 : 0;
  return nullptr;
}

// The thread_comm table made to look like a device-only transport (as nccl is): it says it
// takes CUDA memory only, and counts the calls that still pass host tensors.
std::atomic<int> g_host_calls{0};
const loom_comm_v1* g_real = nullptr;
bool on_host(const DLTensor* t) { return t != nullptr && t->device.device_type == kDLCPU; }
int32_t device_only(void*, DLDevice d) { return d.device_type == kDLCUDA ? 1 : 0; }
loom_status* device_only2(void*, loom_comm_device_args* a) {
  a->supported = a->device.device_type == kDLCUDA ? 1 : 0;
  return nullptr;
}
loom_status* a2a_device_only(void* c, const loom_all_to_all_args* a) {
  if (on_host(a->send) || on_host(a->recv)) ++g_host_calls;
  return g_real->all_to_all(c, a);
}
loom_status* allgather_device_only(void* c, const loom_allgather_args* a) {
  if (on_host(a->send) || on_host(a->recv)) ++g_host_calls;
  return g_real->allgather(c, a);
}
loom_status* allreduce_device_only(void* c, const loom_allreduce_args* a) {
  if (on_host(a->send) || on_host(a->recv)) ++g_host_calls;
  return g_real->allreduce(c, a);
}

// One rank's session with a thread_comm instance.
struct Rank {
  Rank(const std::string& world, int rank, int size) {
    const std::string toml = "[comm.c]\nplugin = \"thread_comm\"\nworld = \"" + world +
                             "\"\nrank = " + std::to_string(rank) +
                             "\nsize = " + std::to_string(size) + "\ntimeout_s = 30.0\n";
    loom_open_options o{};
    o.struct_size = LOOM_OPEN_OPTIONS_SIZE;
    const std::string dir = loom_test::thread_comm_dir();
    o.plugin_path = dir.c_str();
    o.log_level = -1;
    if (loom_open_string(toml.c_str(), "moe_ep_cuda_test.toml", &o, &s) != LOOM_OK) {
      error = loom_last_error();
      s = nullptr;
      return;
    }
    loom_instance* c = nullptr;
    if (loom_find_instance(s, LOOM_KIND_COMM, "c", &c) != LOOM_OK) return;
    comm = loom_instance_object(c);
    vt = static_cast<const loom_comm_v1*>(loom_instance_vtable(c));
    host_vt = *vt;
    host_vt.supports_device = &host_only;
    host_vt.supports_device2 = &host_only2;
    device_vt = *vt;
    device_vt.supports_device = &device_only;
    device_vt.supports_device2 = &device_only2;
    device_vt.all_to_all = &a2a_device_only;
    device_vt.allgather = &allgather_device_only;
    device_vt.allreduce = &allreduce_device_only;
    g_real = vt;  // the same table on every rank
  }
  ~Rank() { loom_close(s); }
  Rank(const Rank&) = delete;
  Rank& operator=(const Rank&) = delete;
  loom_session* s = nullptr;
  void* comm = nullptr;
  const loom_comm_v1* vt = nullptr;
  loom_comm_v1 host_vt{};
  loom_comm_v1 device_vt{};
  std::string error;
};

int64_t rows_of(int w, int e) {
  if (w == 1) return 0;  // one rank sends nothing
  return (w * 3 + e * 5) % 4 + (e % 3 == 0 ? 0 : w % 2);
}
constexpr int kWords = 3;
constexpr int64_t kRowBytes = kWords * 4;
void fill_row(int32_t* r, int w, int e, int64_t j) {
  r[0] = w;
  r[1] = e;
  r[2] = w * 1000003 + e * 1009 + static_cast<int32_t>(j);
}

struct Dev {
  void* p = nullptr;
  explicit Dev(std::size_t bytes) {
    EXPECT_EQ(cudaMalloc(&p, bytes == 0 ? 4 : bytes), cudaSuccess);
  }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
};

void round_trip(const loom_comm_v1* vt, void* comm, int rank, int size, int ep,
                cudaStream_t stream) {
  const int local = 3, E = ep * local;
  Exchange ex(vt, comm, ep);
  std::vector<int64_t> sc(static_cast<std::size_t>(E));
  int64_t sent = 0;
  for (int e = 0; e < E; ++e) sent += sc[static_cast<std::size_t>(e)] = rows_of(rank, e);
  std::vector<int32_t> send(static_cast<std::size_t>(sent * kWords));
  int64_t o = 0;
  for (int e = 0; e < E; ++e) {
    for (int64_t j = 0; j < rows_of(rank, e); ++j) fill_row(&send[(o++) * kWords], rank, e, j);
  }
  const Exchange::Plan p = ex.plan(sc.data(), E);
  const int first = rank / ep * ep;
  const DLDevice dev{kDLCUDA, 0};
  Dev dsend(send.size() * 4), drecv(static_cast<std::size_t>(p.recv_rows * kRowBytes));
  ASSERT_EQ(cudaMemcpy(dsend.p, send.data(), send.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  ex.forward(p, dsend.p, drecv.p, kRowBytes, dev, stream);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  std::vector<int32_t> recv(static_cast<std::size_t>(p.recv_rows * kWords));
  ASSERT_EQ(cudaMemcpy(recv.data(), drecv.p, recv.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  int bad = 0;
  o = 0;
  int32_t want[kWords];
  for (int l = 0; l < local; ++l) {
    const int e = ex.ep_rank() * local + l;
    for (int r = 0; r < ep; ++r) {
      for (int64_t j = 0; j < rows_of(first + r, e); ++j) {
        fill_row(want, first + r, e, j);
        bad += std::memcmp(want, &recv[(o++) * kWords], kRowBytes) != 0 ? 1 : 0;
      }
    }
  }
  EXPECT_EQ(o, p.recv_rows);
  EXPECT_EQ(bad, 0) << "rows out of place after forward, ep " << ep;
  for (int64_t i = 0; i < p.recv_rows; ++i) recv[i * kWords + 2] += 7;
  ASSERT_EQ(cudaMemcpy(drecv.p, recv.data(), recv.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  Dev dback(send.size() * 4);
  ex.reverse(p, drecv.p, dback.p, kRowBytes, dev, stream);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  std::vector<int32_t> back(send.size());
  ASSERT_EQ(cudaMemcpy(back.data(), dback.p, back.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  bad = 0;
  o = 0;
  for (int e = 0; e < E; ++e) {
    for (int64_t j = 0; j < rows_of(rank, e); ++j) {
      fill_row(want, rank, e, j);
      want[2] += 7;
      bad += std::memcmp(want, &back[(o++) * kWords], kRowBytes) != 0 ? 1 : 0;
    }
  }
  EXPECT_EQ(bad, 0) << "rows out of place after reverse, ep " << ep;

  // The small sums the layer makes (loads, bounds), on host values.
  std::vector<int64_t> load(sc);
  ex.sum_ep(load.data(), E);
  for (int e = 0; e < E; ++e) {
    int64_t want_sum = 0;
    for (int r = 0; r < ep; ++r) want_sum += rows_of(first + r, e);
    EXPECT_EQ(load[static_cast<std::size_t>(e)], want_sum) << "sum_ep expert " << e;
  }
  EXPECT_EQ(ex.max_ep(100 + rank), 100 + first + ep - 1);

  // reduce_gradients on a device tensor
  const std::size_t n = 1001;
  std::vector<float> g(n);
  auto grad = [](int w, std::size_t i) {
    return static_cast<float>((static_cast<int>(i) * 3 + w * 5) % 9 - 4);
  };
  for (std::size_t i = 0; i < n; ++i) g[i] = grad(rank, i);
  Dev dg(n * 4);
  ASSERT_EQ(cudaMemcpy(dg.p, g.data(), n * 4, cudaMemcpyHostToDevice), cudaSuccess);
  int64_t shape = static_cast<int64_t>(n);
  DLTensor t{dg.p, dev, 1, {kDLFloat, 32, 1}, &shape, nullptr, 0};
  DLTensor* ts[] = {&t};
  ex.reduce_gradients(ts, 1, stream);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(g.data(), dg.p, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  bad = 0;
  for (std::size_t i = 0; i < n; ++i) {
    float sum = 0;
    for (int w = rank % ep; w < size; w += ep) sum += grad(w, i);
    bad += g[i] != sum / static_cast<float>(size) ? 1 : 0;
  }
  EXPECT_EQ(bad, 0) << "reduce_gradients, ep " << ep;
}

TEST(MoeEpCuda, DeviceRowsAndGradientsNativeAndStagedThroughTheHost) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  int world = 0;
  for (int p : {2, 4}) {
    // 0: the transport takes device buffers; 1: host only (staged); 2: device only (the
    // counts go through device memory too)
    for (int mode : {0, 1, 2}) {
      const std::string name = "moe_ep_cuda_" + std::to_string(world++);
      on_threads(p, [&](int rank) {
        ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
        cudaStream_t s = nullptr;
        ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
        {
          Rank c(name, rank, p);
          ASSERT_NE(c.vt, nullptr) << c.error;
          const loom_comm_v1* vt = mode == 0 ? c.vt : mode == 1 ? &c.host_vt : &c.device_vt;
          // thread_comm has no split: the ep sizes that need none (1: the world is the
          // expert-data-parallel group; p: it is the expert-parallel group).
          for (int ep : {1, p}) {
            SCOPED_TRACE("p " + std::to_string(p) + " mode " + std::to_string(mode) + " ep " +
                         std::to_string(ep));
            round_trip(vt, c.comm, rank, p, ep, s);
          }
        }
        cudaStreamDestroy(s);
      });
    }
  }
  EXPECT_EQ(g_host_calls.load(), 0) << "host tensors passed to a device-only transport";
}

}  // namespace
