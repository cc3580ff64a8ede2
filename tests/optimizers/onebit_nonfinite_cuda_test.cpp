// The 1-bit optimizers on CUDA tensors, 2 ranks as threads on one GPU (thread_comm): a NaN or
// an Inf in rank 1's device gradient only, once in warmup and once after the freeze, makes
// both ranks skip that step (the flag is agreed with an allreduce MAX on the device), leaves
// parameters and exported state byte-identical, and the runs equal ones that never saw the
// bad steps. Skips without a device or without the thread_comm test plugin.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <loom/embed.h>
#include <loom/kinds/optimizer.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "thread_comm_dir.hpp"

namespace {

bool have_device() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return n > 0;
}

const std::vector<int64_t> kSizes = {1000, 37, 4096 * 2 + 5};

std::vector<uint8_t> state(loom_instance* opt) {
  size_t size = 0;
  EXPECT_EQ(loom_instance_export_state(opt, nullptr, 0, &size), 0) << loom_last_error();
  std::vector<uint8_t> buf(size);
  EXPECT_EQ(loom_instance_export_state(opt, buf.data(), buf.size(), &size), 0) << loom_last_error();
  buf.resize(size);
  return buf;
}

uint64_t skipped(loom_instance* opt) {
  loom_optimizer_comm_info ci{};
  ci.struct_size = LOOM_OPTIMIZER_COMM_INFO_SIZE;
  EXPECT_EQ(loom_optimizer_get_comm_info(opt, &ci), 0) << loom_last_error();
  return ci.skipped_steps;
}

// Parameters and gradients on the device, ordered on `stream`.
class DeviceModel {
 public:
  explicit DeviceModel(cudaStream_t stream) : stream_(stream) {
    for (size_t k = 0; k < kSizes.size(); ++k) {
      std::vector<float> x(static_cast<size_t>(kSizes[k]));
      for (size_t i = 0; i < x.size(); ++i)
        x[i] = static_cast<float>(0.5 * std::sin(0.1 * static_cast<double>(i + k)));
      float* p = nullptr;
      float* g = nullptr;
      EXPECT_EQ(cudaMalloc(&p, x.size() * 4), cudaSuccess);
      EXPECT_EQ(cudaMalloc(&g, x.size() * 4), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(p, x.data(), x.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
      p_.push_back(p);
      g_.push_back(g);
    }
  }
  ~DeviceModel() {
    cudaStreamSynchronize(stream_);
    for (float* p : p_) cudaFree(p);
    for (float* g : g_) cudaFree(g);
  }
  DeviceModel(const DeviceModel&) = delete;
  DeviceModel& operator=(const DeviceModel&) = delete;

  std::vector<float> params() {
    std::vector<float> all;
    for (size_t k = 0; k < kSizes.size(); ++k) {
      std::vector<float> x(static_cast<size_t>(kSizes[k]));
      EXPECT_EQ(cudaMemcpyAsync(x.data(), p_[k], x.size() * 4, cudaMemcpyDeviceToHost, stream_),
                cudaSuccess);
      EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
      all.insert(all.end(), x.begin(), x.end());
    }
    return all;
  }

  // A gradient that depends on the rank and `seed`; when `bad`, `poison` replaces element 20
  // of tensor 2. `t` is the step number passed to the optimizer.
  int32_t step(loom_instance* opt, int rank, int seed, int t, float poison, bool bad,
               int32_t* found) {
    for (size_t k = 0; k < kSizes.size(); ++k) {
      std::vector<float> g(static_cast<size_t>(kSizes[k]));
      for (size_t i = 0; i < g.size(); ++i) {
        g[i] = static_cast<float>(std::sin(0.37 * static_cast<double>(i + 13 * k) + rank + seed));
      }
      if (bad && k == 2) g[20] = poison;
      EXPECT_EQ(cudaMemcpyAsync(g_[k], g.data(), g.size() * 4, cudaMemcpyHostToDevice, stream_),
                cudaSuccess);
      EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    }
    std::vector<int64_t> shapes = kSizes;
    std::vector<DLTensor> tp(kSizes.size()), tg(kSizes.size());
    std::vector<loom_optimizer_tensor> ts(kSizes.size());
    for (size_t k = 0; k < kSizes.size(); ++k) {
      tp[k] = DLTensor{p_[k], {kDLCUDA, 0}, 1, {kDLFloat, 32, 1}, &shapes[k], nullptr, 0};
      tg[k] = tp[k];
      tg[k].data = g_[k];
      ts[k] = {LOOM_OPTIMIZER_TENSOR_SIZE, 0, &tp[k], &tg[k], nullptr, nullptr};
    }
    const loom_optimizer_group group{
        LOOM_OPTIMIZER_GROUP_SIZE, 0, ts.data(), ts.size(), 1.0, NAN, 0, 0};
    loom_optimizer_step_args a{};
    a.struct_size = LOOM_OPTIMIZER_STEP_ARGS_SIZE;
    a.groups = &group;
    a.group_count = 1;
    a.lr = 1e-2;
    a.grad_scale = 1.0;
    a.step = t;
    a.stream = stream_;
    a.found_inf = found;
    return loom_optimizer_step(opt, &a);
  }

 private:
  cudaStream_t stream_;
  std::vector<float*> p_;
  std::vector<float*> g_;
};

std::string optimizer(const std::string& name, const std::string& variant) {
  std::string s =
      "[optimizer." + name + "]\nplugin = \"" + variant + "\"\ncomm = \"c\"\ncodec = \"k\"\n";
  if (variant == "zero_one_adam") {
    s += "var_freeze_step = 3\nlocal_step_scaler = 2\nlocal_step_clipper = 4\n";
  } else {
    s += "freeze_step = 3\n";
  }
  return s;
}

void run(const std::string& variant) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  const std::string dir = loom_test::thread_comm_dir();
  if (dir.empty()) GTEST_SKIP() << "the thread_comm test plugin is not found";
  static std::atomic<int> next{0};
  const std::string world =
      "onebit_nonfinite_" + std::to_string(::getpid()) + "_" + std::to_string(next++);
  const int kRanks = 2;
  const int kSteps = 10;
  const int kWarmBad = 2;
  const int kLateBad = 6;
  std::vector<std::vector<float>> out(kRanks);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < kRanks; ++rank) {
    threads.emplace_back([&, rank] {
      ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
      cudaStream_t stream = nullptr;
      ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
      {
        loom_open_options o{};
        o.struct_size = LOOM_OPEN_OPTIONS_SIZE;
        o.plugin_path = dir.c_str();
        o.log_level = -1;
        const std::string toml =
            "[codec.k]\nplugin = \"onebit\"\n[comm.c]\nplugin = "
            "\"thread_comm\"\nworld = \"" +
            world + "\"\nrank = " + std::to_string(rank) + "\nsize = 2\ntimeout_s = 60\n" +
            optimizer("a", variant) + optimizer("b", variant);
        loom_session* s = nullptr;
        ASSERT_EQ(loom_open_string(toml.c_str(), "nonfinite_cuda.toml", &o, &s), 0)
            << loom_last_error();
        loom_instance* a = nullptr;
        loom_instance* b = nullptr;
        EXPECT_EQ(loom_find_instance(s, "loom.optimizer/1", "a", &a), 0);
        EXPECT_EQ(loom_find_instance(s, "loom.optimizer/1", "b", &b), 0);
        {
          DeviceModel ma(stream), mb(stream);
          int tb = 0;
          for (int t = 1; t <= kSteps; ++t) {
            SCOPED_TRACE(variant + " step " + std::to_string(t) + " rank " + std::to_string(rank));
            const bool bad = t == kWarmBad || t == kLateBad;
            if (!bad) {
              ++tb;
              ASSERT_EQ(mb.step(b, rank, tb, tb, 0.0f, false, nullptr), 0) << loom_last_error();
            }
            const float poison = t == kWarmBad ? std::numeric_limits<float>::quiet_NaN()
                                               : -std::numeric_limits<float>::infinity();
            const auto p0 = ma.params();
            const auto s0 = state(a);
            int32_t found = -1;
            // `a` draws its finite gradients with b's count, so both runs see the same ones.
            ASSERT_EQ(ma.step(a, rank, bad ? 1000 + t : tb, t, poison, bad && rank == 1, &found), 0)
                << loom_last_error();
            EXPECT_EQ(found, bad ? 1 : 0);
            if (bad) {
              EXPECT_EQ(ma.params(), p0);
              EXPECT_EQ(state(a), s0);
            }
            EXPECT_EQ(ma.params(), mb.params());
          }
          EXPECT_EQ(state(a), state(b));
          EXPECT_EQ(skipped(a), 2u);
          EXPECT_EQ(skipped(b), 0u);
          out[static_cast<size_t>(rank)] = ma.params();
        }
        loom_close(s);
      }
      cudaStreamDestroy(stream);
    });
  }
  for (auto& t : threads) t.join();
  if (::testing::Test::HasFailure()) return;
  for (const float x : out[0]) ASSERT_TRUE(std::isfinite(x));
  if (variant != "zero_one_adam") {
    EXPECT_EQ(out[0], out[1]) << "the ranks diverged";  // 0/1 Adam's local steps: rank-local
  }
}

TEST(OnebitNonfiniteCuda, OnebitAdamSkipsOnEveryRank) { run("onebit_adam"); }
TEST(OnebitNonfiniteCuda, ZeroOneAdamSkipsOnEveryRank) { run("zero_one_adam"); }
TEST(OnebitNonfiniteCuda, OnebitLambSkipsOnEveryRank) { run("onebit_lamb"); }

}  // namespace
