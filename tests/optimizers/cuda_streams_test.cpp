// Optimizers that keep device state across calls, stepped on a different stream each call
// (docs/abi.md, Streams): adam, lamb and the 1-bit family (onebit_adam, zero_one_adam,
// onebit_lamb, whose compressed allreduce keeps buffers too).
//   - CudaStreams.*AlternatingMatchesOneStream: the same steps on one stream and on streams
//     that change every call (two non-blocking streams and the legacy default stream) give
//     bit-identical parameters and state blobs. The test itself never orders its streams
//     (each step's gradient is its own buffer, written before the first step), so only the
//     optimizer's own ordering (an event recorded at the end of a call, waited on by the next
//     call's stream) makes the results right: under the CUDA emulation a missing wait runs
//     the later stream's kernels on state that is still stale (poisoned as NaN).
//   - CudaStreams.*DestroyAfterStreamChange: after the steps moved from stream A to stream B,
//     A is destroyed; the export and the optimizer's destruction must then touch B only (the
//     emulation reports any use of a destroyed stream, and ASan any use after free).
// 1-bit variants run on a world of one and on 2 thread ranks (thread_comm), where the
// compressed allreduce runs every compression step (the destroy case: 2 ranks, 1 for the
// slower onebit_lamb, whose compressed allreduce is then built but never run). Skips without a
// device, and the 1-bit cases also without the thread_comm test plugin.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <loom/embed.h>
#include <loom/kinds/optimizer.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "thread_comm_dir.hpp"

namespace {

constexpr int kSteps = 12;
constexpr double kLr = 1e-2;
// Several sizes: two 4096-element blocks with a tail, odd lengths, one element (small, since
// the emulation runs LAMB's reduction kernels one OS thread per CUDA thread).
const std::vector<int64_t> kSizes = {1000, 37, 4096 + 5, 1, 300};
constexpr std::size_t kGroup0 = 3;  // tensors 0..2 in group 0 (lr_scale 1), the rest in group 1

bool have_device() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

bool is_onebit(const std::string& v) { return v != "adam" && v != "lamb"; }

std::string fresh_world() {
  static std::atomic<int> next{0};
  return "cuda_streams_" + std::to_string(::getpid()) + "_" + std::to_string(next++);
}

// An optimizer section; the 1-bit ones reach compression within kSteps (0/1 Adam: variance
// steps at 1, 2, 4, frozen from 6, then local steps with syncs).
std::string optimizer(const std::string& name, const std::string& v) {
  std::string s = "[optimizer." + name + "]\nplugin = \"" + v + "\"\nweight_decay = 0.01\n";
  if (v == "zero_one_adam") {
    s += "comm = \"c\"\ncodec = \"k\"\nvar_freeze_step = 6\nvar_update_scaler = 2\n"
         "local_step_scaler = 2\nlocal_step_clipper = 4\n";
  } else if (is_onebit(v)) {
    s += "comm = \"c\"\ncodec = \"k\"\nfreeze_step = 4\n";
  }
  return s;
}

// The session's comm and codec (1-bit variants only).
std::string comm(const std::string& world, int rank, int size) {
  return "[codec.k]\nplugin = \"onebit\"\n[comm.c]\nplugin = \"thread_comm\"\nworld = \"" + world +
         "\"\nrank = " + std::to_string(rank) + "\nsize = " + std::to_string(size) +
         "\ntimeout_s = 60\n";
}

struct Session {
  Session(const std::string& toml, const std::string& plugin_dir) {
    loom_open_options o{};
    o.struct_size = LOOM_OPEN_OPTIONS_SIZE;
    o.plugin_path = plugin_dir.empty() ? nullptr : plugin_dir.c_str();
    o.log_level = -1;
    if (loom_open_string(toml.c_str(), "cuda_streams_test.toml", &o, &s) != LOOM_OK) {
      error = loom_last_error();
      s = nullptr;
    }
  }
  ~Session() { close(); }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
  void close() {
    loom_close(s);
    s = nullptr;
  }
  loom_instance* opt(const std::string& name) {
    loom_instance* i = nullptr;
    EXPECT_EQ(loom_find_instance(s, "loom.optimizer/1", name.c_str(), &i), LOOM_OK)
        << loom_last_error();
    return i;
  }
  loom_session* s = nullptr;
  std::string error;
};

// Device parameters, and one device gradient per step (a rank-dependent function of the step
// and the element, not of the parameters), all written before the first step.
class Model {
 public:
  explicit Model(int rank) {
    for (std::size_t k = 0; k < kSizes.size(); ++k) {
      std::vector<float> x(static_cast<std::size_t>(kSizes[k]));
      for (std::size_t i = 0; i < x.size(); ++i) {
        x[i] = static_cast<float>(0.5 *
                                  std::sin(0.1 * static_cast<double>(i) + static_cast<double>(k)));
      }
      float* d = nullptr;
      EXPECT_EQ(cudaMalloc(&d, bytes(k)), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(d, x.data(), bytes(k), cudaMemcpyHostToDevice), cudaSuccess);
      params_.push_back(d);
    }
    grads_.resize(kSteps + 1);
    for (int t = 1; t <= kSteps; ++t) {
      for (std::size_t k = 0; k < kSizes.size(); ++k) {
        std::vector<float> g(static_cast<std::size_t>(kSizes[k]));
        for (std::size_t i = 0; i < g.size(); ++i) {
          g[i] = static_cast<float>(std::sin(0.37 * static_cast<double>(i + 13 * k) + rank) +
                                    0.3 * std::cos(1.3 * t + static_cast<double>(i)));
        }
        float* d = nullptr;
        EXPECT_EQ(cudaMalloc(&d, bytes(k)), cudaSuccess);
        EXPECT_EQ(cudaMemcpy(d, g.data(), bytes(k), cudaMemcpyHostToDevice), cudaSuccess);
        grads_[static_cast<std::size_t>(t)].push_back(d);
      }
    }
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  ~Model() {
    (void)cudaDeviceSynchronize();
    for (float* p : params_) cudaFree(p);
    for (auto& step : grads_) {
      for (float* g : step) cudaFree(g);
    }
  }
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  int32_t step(loom_instance* opt, int t, cudaStream_t stream) {
    std::vector<int64_t> shapes = kSizes;
    std::vector<DLTensor> tp(kSizes.size()), tg(kSizes.size());
    std::vector<loom_optimizer_tensor> ts(kSizes.size());
    for (std::size_t k = 0; k < kSizes.size(); ++k) {
      tp[k] = DLTensor{params_[k], {kDLCUDA, 0}, 1, {kDLFloat, 32, 1}, &shapes[k], nullptr, 0};
      tg[k] = tp[k];
      tg[k].data = grads_[static_cast<std::size_t>(t)][k];
      ts[k] = {LOOM_OPTIMIZER_TENSOR_SIZE, 0, &tp[k], &tg[k], nullptr, nullptr};
    }
    loom_optimizer_group groups[2] = {
        {LOOM_OPTIMIZER_GROUP_SIZE, 0, ts.data(), kGroup0, 1.0, NAN, 0, 0},
        {LOOM_OPTIMIZER_GROUP_SIZE, 0, ts.data() + kGroup0, kSizes.size() - kGroup0, 0.5, NAN, 0,
         0}};
    loom_optimizer_step_args a{LOOM_OPTIMIZER_STEP_ARGS_SIZE, 0, groups, 2, kLr, 1.0, t, stream};
    return loom_optimizer_step(opt, &a);
  }

  // The parameters, copied on `stream` (the one of the last step: nothing else is waited for).
  std::vector<float> params(cudaStream_t stream) {
    std::vector<float> all;
    for (std::size_t k = 0; k < kSizes.size(); ++k) {
      std::vector<float> x(static_cast<std::size_t>(kSizes[k]));
      EXPECT_EQ(cudaMemcpyAsync(x.data(), params_[k], bytes(k), cudaMemcpyDeviceToHost, stream),
                cudaSuccess);
      EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      all.insert(all.end(), x.begin(), x.end());
    }
    return all;
  }

 private:
  static std::size_t bytes(std::size_t k) { return static_cast<std::size_t>(kSizes[k]) * 4; }
  std::vector<float*> params_;
  std::vector<std::vector<float*>> grads_;
};

std::vector<char> export_blob(loom_instance* opt) {
  size_t size = 0;
  EXPECT_EQ(loom_instance_export_state(opt, nullptr, 0, &size), LOOM_OK) << loom_last_error();
  std::vector<char> blob(size);
  EXPECT_EQ(loom_instance_export_state(opt, blob.data(), size, &size), LOOM_OK)
      << loom_last_error();
  return blob;
}

// Two non-blocking streams of this thread's device.
struct Streams {
  Streams() {
    EXPECT_EQ(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking), cudaSuccess);
    EXPECT_EQ(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking), cudaSuccess);
  }
  ~Streams() {
    if (a != nullptr) cudaStreamDestroy(a);
    if (b != nullptr) cudaStreamDestroy(b);
  }
  Streams(const Streams&) = delete;
  Streams& operator=(const Streams&) = delete;
  // Step t's stream when it changes every call: A on odd steps, B on even ones, the legacy
  // default stream on steps 5 and 10; the last step (12) is on B.
  cudaStream_t changing(int t) const {
    if (t % 5 == 0) return nullptr;
    return t % 2 == 1 ? a : b;
  }
  cudaStream_t a = nullptr;
  cudaStream_t b = nullptr;
};

void on_threads(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back(fn, r);
  for (auto& t : threads) t.join();
}

// `ranks` ranks (threads, each with its own session and streams): instance "one" steps on
// stream A throughout, "alt" on a stream that changes every call.
void alternating(const std::string& v, int ranks) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  const std::string dir = is_onebit(v) ? loom_test::thread_comm_dir() : "";
  if (is_onebit(v) && dir.empty()) GTEST_SKIP() << "the thread_comm test plugin is not found";
  const std::string world = fresh_world();
  on_threads(ranks, [&](int rank) {
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    Streams st;
    Session s(
        (is_onebit(v) ? comm(world, rank, ranks) : "") + optimizer("one", v) + optimizer("alt", v),
        dir);
    ASSERT_NE(s.s, nullptr) << s.error;
    Model one(rank);
    Model alt(rank);
    for (int t = 1; t <= kSteps; ++t) {
      ASSERT_EQ(one.step(s.opt("one"), t, st.a), LOOM_OK) << loom_last_error();
      ASSERT_EQ(alt.step(s.opt("alt"), t, st.changing(t)), LOOM_OK) << loom_last_error();
    }
    // alt first, on its last stream only: A still holds one's queued work.
    const std::vector<float> got = alt.params(st.changing(kSteps));
    const std::vector<float> want = one.params(st.a);
    ASSERT_EQ(got.size(), want.size());
    std::size_t differ = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      if (!(got[i] == want[i])) ++differ;
    }
    EXPECT_EQ(differ, 0u) << v << ", rank " << rank << " of " << ranks << ": " << differ << " of "
                          << got.size() << " parameters differ (first: " << got[0] << " vs "
                          << want[0] << ")";
    EXPECT_EQ(export_blob(s.opt("alt")), export_blob(s.opt("one")))
        << v << ", rank " << rank << ": the state blobs differ";
  });
}

// Steps on A, then on B; A is destroyed before the export and the optimizer's destruction.
void destroy_after_change(const std::string& v, int ranks) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  const std::string dir = is_onebit(v) ? loom_test::thread_comm_dir() : "";
  if (is_onebit(v) && dir.empty()) GTEST_SKIP() << "the thread_comm test plugin is not found";
  const std::string world = fresh_world();
  on_threads(ranks, [&](int rank) {
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    Streams st;
    Session s(
        (is_onebit(v) ? comm(world, rank, ranks) : "") + optimizer("ref", v) + optimizer("opt", v),
        dir);
    ASSERT_NE(s.s, nullptr) << s.error;
    Model ref(rank);
    Model m(rank);
    for (int t = 1; t <= kSteps; ++t) {
      ASSERT_EQ(ref.step(s.opt("ref"), t, st.b), LOOM_OK) << loom_last_error();
      ASSERT_EQ(m.step(s.opt("opt"), t, t <= kSteps / 2 ? st.a : st.b), LOOM_OK)
          << loom_last_error();
    }
    ASSERT_EQ(cudaStreamDestroy(st.a), cudaSuccess);
    st.a = nullptr;
    EXPECT_EQ(export_blob(s.opt("opt")), export_blob(s.opt("ref"))) << v << ", rank " << rank;
    EXPECT_EQ(m.params(st.b), ref.params(st.b)) << v << ", rank " << rank;
    s.close();  // frees the optimizers' device buffers: on B, never on the destroyed A
    EXPECT_EQ(cudaStreamSynchronize(st.b), cudaSuccess);
  });
}

TEST(CudaStreams, AdamAlternatingMatchesOneStream) { alternating("adam", 1); }
TEST(CudaStreams, LambAlternatingMatchesOneStream) { alternating("lamb", 1); }
TEST(CudaStreams, OnebitAdamAlternatingMatchesOneStream) {
  for (int ranks : {1, 2}) alternating("onebit_adam", ranks);
}
TEST(CudaStreams, ZeroOneAdamAlternatingMatchesOneStream) {
  for (int ranks : {1, 2}) alternating("zero_one_adam", ranks);
}
TEST(CudaStreams, OnebitLambAlternatingMatchesOneStream) {
  for (int ranks : {1, 2}) alternating("onebit_lamb", ranks);
}

TEST(CudaStreams, AdamDestroyAfterStreamChange) { destroy_after_change("adam", 1); }
TEST(CudaStreams, LambDestroyAfterStreamChange) { destroy_after_change("lamb", 1); }
TEST(CudaStreams, OnebitAdamDestroyAfterStreamChange) { destroy_after_change("onebit_adam", 2); }
TEST(CudaStreams, ZeroOneAdamDestroyAfterStreamChange) { destroy_after_change("zero_one_adam", 2); }
TEST(CudaStreams, OnebitLambDestroyAfterStreamChange) { destroy_after_change("onebit_lamb", 1); }

}  // namespace
