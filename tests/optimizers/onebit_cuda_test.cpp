// The 1-bit family (onebit_adam, zero_one_adam, onebit_lamb) on CUDA tensors, against the same
// plugins on host tensors:
//   - OnebitCudaDispatch.*: what a step refuses before touching anything (a comm without CUDA
//     support, tensors on another device than the state's, tensors on two devices). Needs no
//     GPU (the tensors' memory is never read): runs on every machine.
//   - OnebitCuda.WorldOfOne*: a world of one on CUDA vs on the CPU, across warmup and the
//     compression stage, with an exp_avg_mask and (onebit_adam) a non_freeze group: params
//     agree within kTightRel (see below).
//   - OnebitCuda.ThreadRanks*: 2 and 4 ranks as threads on one GPU (thread_comm), each with its
//     own session and stream: the CUDA params are identical on every rank after compression
//     steps (0/1 Adam: equal to rounding after a sync) and close (kLooseRel) to the CPU run
//     over the same thread_comm world.
//   - OnebitCuda.Checkpoint*: a CUDA checkpoint taken mid-compression resumes on the CPU and a
//     CPU one on CUDA (close to the uninterrupted CUDA run); a CUDA-to-CUDA resume is
//     bit-identical.
//   - OnebitCuda.UcxRefusesCudaTensors: the clear error, params unchanged.
// The GPU tests skip without a device; the multi-rank ones also without the thread_comm test
// plugin (build/test-plugins, or test-plugins beside this program's bin/ folder).
//
// Tolerances. The CUDA kernels evaluate each scalar loop operation by operation without FMA;
// the CPU's Highway kernels (adam_cpu, momentum_cpu, LAMB's passes) may contract to FMA and
// reduce in another order, so single elements differ by a few ulps per step. In a world of
// one nothing is compressed: elementwise |cuda - cpu| <= kTightRel * (1 + |cpu|). With 2+
// ranks, an element whose compressed momentum is within rounding of zero may get the other
// sign on one device (the 1-bit codec keeps only signs), which moves that one element by
// about lr: there the check is on the whole vector, |cuda - cpu|_2 <= kLooseRel * |cpu|_2.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <loom/embed.h>
#include <loom/kinds/comm.h>
#include <loom/kinds/optimizer.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "thread_comm_dir.hpp"

namespace {

constexpr double kTightRel = 1e-5;
constexpr double kLooseRel = 2e-3;
// Warmup 1..4, then compression; for 0/1 Adam step 12 is a sync step (local intervals 1, 1,
// 2, 2, 4: syncs at 7, 8, 10, 12), after which the ranks hold the same parameters again.
constexpr int kSteps = 12;
constexpr double kLr = 1e-2;

const std::vector<std::string> kVariants = {"onebit_adam", "zero_one_adam", "onebit_lamb"};

bool have_device() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

std::string fresh_world() {
  static std::atomic<int> next{0};
  return "onebit_cuda_" + std::to_string(::getpid()) + "_" + std::to_string(next++);
}

void on_threads(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back(fn, r);
  for (auto& t : threads) t.join();
}

// Variant parameters: a short warmup, then compression (0/1 Adam: variance steps at 1, 2, 4,
// frozen from 6, local-step intervals 1, 2, 4 with syncs).
std::string variant_params(const std::string& v) {
  std::string s = "weight_decay = 0.01\n";
  if (v == "zero_one_adam") {
    s += "var_freeze_step = 6\nvar_update_scaler = 2\nlocal_step_scaler = 2\n"
         "local_step_clipper = 4\n";
  } else {
    s += "freeze_step = 4\n";
  }
  return s;
}

std::string thread_comm(const std::string& name, const std::string& world, int rank, int size) {
  return "[comm." + name + "]\nplugin = \"thread_comm\"\nworld = \"" + world +
         "\"\nrank = " + std::to_string(rank) + "\nsize = " + std::to_string(size) +
         "\ntimeout_s = 60\n";
}

std::string optimizer(const std::string& name, const std::string& variant,
                      const std::string& comm) {
  return "[optimizer." + name + "]\nplugin = \"" + variant + "\"\ncomm = \"" + comm +
         "\"\ncodec = \"k\"\n" + variant_params(variant);
}

struct Session {
  explicit Session(const std::string& toml, const std::string& plugin_dir) {
    loom_open_options o{};
    o.struct_size = LOOM_OPEN_OPTIONS_SIZE;
    o.plugin_path = plugin_dir.empty() ? nullptr : plugin_dir.c_str();
    o.log_level = -1;
    const std::string full = "[codec.k]\nplugin = \"onebit\"\n" + toml;
    if (loom_open_string(full.c_str(), "onebit_cuda_test.toml", &o, &s) != LOOM_OK) {
      error = loom_last_error();
      s = nullptr;
    }
  }
  ~Session() { loom_close(s); }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
  loom_instance* opt(const std::string& name) {
    loom_instance* i = nullptr;
    EXPECT_EQ(loom_find_instance(s, "loom.optimizer/1", name.c_str(), &i), LOOM_OK)
        << loom_last_error();
    return i;
  }
  loom_session* s = nullptr;
  std::string error;
};

// The model: two groups (the second with lr_scale 0.5, non_freeze for onebit_adam), tensors of
// several sizes (several blocks, odd tails, one element), an exp_avg_mask on tensor 1.
const std::vector<int64_t> kSizes = {1000, 37, 4096 * 3 + 5, 1, 300};
constexpr std::size_t kGroup0 = 3;  // tensors 0..2 in group 0, the rest in group 1

std::vector<float> initial(std::size_t k) {
  std::vector<float> x(static_cast<std::size_t>(kSizes[k]));
  for (std::size_t i = 0; i < x.size(); ++i) {
    x[i] =
        static_cast<float>(0.5 * std::sin(0.1 * static_cast<double>(i) + static_cast<double>(k)));
  }
  return x;
}

std::vector<float> mask_values() {
  std::vector<float> m(static_cast<std::size_t>(kSizes[1]));
  for (std::size_t i = 0; i < m.size(); ++i) m[i] = i % 3 == 0 ? 0.0f : 1.0f;
  return m;
}

// A rank-dependent gradient of the current parameters.
void gradient(const std::vector<float>& x, int rank, int t, std::size_t k, std::vector<float>* g) {
  g->resize(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double target = std::sin(0.37 * static_cast<double>(i + 13 * k) + rank);
    const double noise = 0.1 * std::cos(1.3 * t + static_cast<double>(i) + rank);
    (*g)[i] = static_cast<float>(x[i] - target + noise);
  }
}

// One replica of the model's parameters, on the host or on the GPU (ordered on `stream`).
class Model {
 public:
  Model(bool cuda, cudaStream_t stream) : cuda_(cuda), stream_(stream) {
    for (std::size_t k = 0; k < kSizes.size(); ++k) host_.push_back(initial(k));
    grads_.resize(kSizes.size());
    mask_ = mask_values();
    if (cuda_) {
      dp_.resize(kSizes.size());
      dg_.resize(kSizes.size());
      for (std::size_t k = 0; k < kSizes.size(); ++k) {
        EXPECT_EQ(cudaMalloc(&dp_[k], bytes(k)), cudaSuccess);
        EXPECT_EQ(cudaMalloc(&dg_[k], bytes(k)), cudaSuccess);
      }
      EXPECT_EQ(cudaMalloc(&dmask_, mask_.size() * 4), cudaSuccess);
      EXPECT_EQ(
          cudaMemcpyAsync(dmask_, mask_.data(), mask_.size() * 4, cudaMemcpyHostToDevice, stream_),
          cudaSuccess);
      upload();
    }
  }
  ~Model() {
    if (cuda_) {
      cudaStreamSynchronize(stream_);
      for (auto* p : dp_) cudaFree(p);
      for (auto* p : dg_) cudaFree(p);
      cudaFree(dmask_);
    }
  }
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  // One optimizer step on gradients of the current parameters. `non_freeze`: the second
  // group's flag.
  int32_t step(loom_instance* opt, int rank, int t, bool non_freeze) {
    if (cuda_) download();
    for (std::size_t k = 0; k < kSizes.size(); ++k) gradient(host_[k], rank, t, k, &grads_[k]);
    if (cuda_) {
      for (std::size_t k = 0; k < kSizes.size(); ++k) {
        EXPECT_EQ(
            cudaMemcpyAsync(dg_[k], grads_[k].data(), bytes(k), cudaMemcpyHostToDevice, stream_),
            cudaSuccess);
      }
    }
    const DLDevice dev = cuda_ ? DLDevice{kDLCUDA, 0} : DLDevice{kDLCPU, 0};
    std::vector<int64_t> shapes = kSizes;
    std::vector<DLTensor> tp(kSizes.size()), tg(kSizes.size());
    std::vector<loom_optimizer_tensor> ts(kSizes.size());
    DLTensor tm{};
    for (std::size_t k = 0; k < kSizes.size(); ++k) {
      tp[k] = DLTensor{
          cuda_ ? dp_[k] : host_[k].data(), dev, 1, {kDLFloat, 32, 1}, &shapes[k], nullptr, 0};
      tg[k] = tp[k];
      tg[k].data = cuda_ ? dg_[k] : grads_[k].data();
      ts[k] = {LOOM_OPTIMIZER_TENSOR_SIZE, 0, &tp[k], &tg[k], nullptr, nullptr};
    }
    tm = tp[1];
    tm.data = cuda_ ? dmask_ : mask_.data();
    ts[1].exp_avg_mask = &tm;
    loom_optimizer_group groups[2] = {
        {LOOM_OPTIMIZER_GROUP_SIZE, 0, ts.data(), kGroup0, 1.0, NAN, 0, 0},
        {LOOM_OPTIMIZER_GROUP_SIZE, 0, ts.data() + kGroup0, kSizes.size() - kGroup0, 0.5, NAN,
         non_freeze ? LOOM_OPTIMIZER_GROUP_NON_FREEZE : 0u, 0}};
    loom_optimizer_step_args a{LOOM_OPTIMIZER_STEP_ARGS_SIZE, 0, groups, 2, kLr, 1.0, t,
                               cuda_ ? stream_ : nullptr};
    return loom_optimizer_step(opt, &a);
  }

  // Every tensor's parameters, concatenated (copied from the device first).
  std::vector<float> params() {
    if (cuda_) download();
    std::vector<float> all;
    for (const auto& x : host_) all.insert(all.end(), x.begin(), x.end());
    return all;
  }
  void set_params(const std::vector<float>& all) {
    std::size_t at = 0;
    for (auto& x : host_) {
      std::copy(all.begin() + static_cast<std::ptrdiff_t>(at),
                all.begin() + static_cast<std::ptrdiff_t>(at + x.size()), x.begin());
      at += x.size();
    }
    if (cuda_) upload();
  }

 private:
  std::size_t bytes(std::size_t k) const { return static_cast<std::size_t>(kSizes[k]) * 4; }
  void upload() {
    for (std::size_t k = 0; k < kSizes.size(); ++k) {
      EXPECT_EQ(cudaMemcpyAsync(dp_[k], host_[k].data(), bytes(k), cudaMemcpyHostToDevice, stream_),
                cudaSuccess);
    }
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  }
  void download() {
    for (std::size_t k = 0; k < kSizes.size(); ++k) {
      EXPECT_EQ(cudaMemcpyAsync(host_[k].data(), dp_[k], bytes(k), cudaMemcpyDeviceToHost, stream_),
                cudaSuccess);
    }
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  }

  bool cuda_;
  cudaStream_t stream_;
  std::vector<std::vector<float>> host_;
  std::vector<std::vector<float>> grads_;
  std::vector<float> mask_;
  std::vector<float*> dp_;
  std::vector<float*> dg_;
  float* dmask_ = nullptr;
};

void expect_tight(const std::vector<float>& got, const std::vector<float>& want,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  double worst = 0.0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double d = std::fabs(static_cast<double>(got[i]) - want[i]);
    worst = std::max(worst, d / (1.0 + std::fabs(want[i])));
    ASSERT_LE(d, kTightRel * (1.0 + std::fabs(want[i])))
        << what << ": element " << i << " cuda " << got[i] << " cpu " << want[i];
  }
  std::printf("%s: worst |cuda - cpu| / (1 + |cpu|) = %.3g\n", what.c_str(), worst);
}

void expect_close(const std::vector<float>& got, const std::vector<float>& want,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  double diff = 0.0;
  double norm = 0.0;
  double worst = 0.0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    diff += d * d;
    norm += static_cast<double>(want[i]) * want[i];
    worst = std::max(worst, std::fabs(d));
  }
  const double rel = std::sqrt(diff) / std::sqrt(norm);
  std::printf("%s: |cuda - cpu|_2 / |cpu|_2 = %.3g, max |cuda - cpu| = %.3g\n", what.c_str(), rel,
              worst);
  EXPECT_LE(rel, kLooseRel) << what;
}

// ------------------------------------------------------------------ no GPU needed

// A CUDA-tagged tensor whose memory is never read (every refusal below comes first).
struct FakeCudaStep {
  explicit FakeCudaStep(std::vector<DLDevice> devices) : shapes(devices.size(), 4) {
    for (std::size_t k = 0; k < devices.size(); ++k) {
      void* fake = reinterpret_cast<void*>(static_cast<uintptr_t>(0x1000 * (k + 1)));
      tp.push_back(DLTensor{fake, devices[k], 1, {kDLFloat, 32, 1}, &shapes[k], nullptr, 0});
    }
    for (std::size_t k = 0; k < devices.size(); ++k) {
      ts.push_back({LOOM_OPTIMIZER_TENSOR_SIZE, 0, &tp[k], &tp[k], nullptr, nullptr});
    }
    group = {LOOM_OPTIMIZER_GROUP_SIZE, 0, ts.data(), ts.size(), 1.0, NAN, 0, 0};
  }
  int32_t run(loom_instance* opt, int64_t t) {
    loom_optimizer_step_args a{LOOM_OPTIMIZER_STEP_ARGS_SIZE, 0, &group, 1, kLr, 1.0, t, nullptr};
    return loom_optimizer_step(opt, &a);
  }
  std::vector<int64_t> shapes;
  std::vector<DLTensor> tp;
  std::vector<loom_optimizer_tensor> ts;
  loom_optimizer_group group{};
};

int32_t host_step(loom_instance* opt, std::vector<float>& p, int64_t t) {
  std::vector<float> g(p.size(), 0.5f);
  int64_t shape = static_cast<int64_t>(p.size());
  DLTensor tp{p.data(), {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, &shape, nullptr, 0};
  DLTensor tg = tp;
  tg.data = g.data();
  loom_optimizer_tensor ts{LOOM_OPTIMIZER_TENSOR_SIZE, 0, &tp, &tg, nullptr, nullptr};
  loom_optimizer_group group{LOOM_OPTIMIZER_GROUP_SIZE, 0, &ts, 1, 1.0, NAN, 0, 0};
  loom_optimizer_step_args a{LOOM_OPTIMIZER_STEP_ARGS_SIZE, 0, &group, 1, kLr, 1.0, t, nullptr};
  return loom_optimizer_step(opt, &a);
}

TEST(OnebitCudaDispatch, RefusesUnsupportedDevicesBeforeTouchingAnything) {
  for (const auto& v : kVariants) {
    Session s("[comm.u]\nplugin = \"ucx\"\n" + optimizer("a", v, "u") + optimizer("b", v, "u") +
                  optimizer("c", v, "u"),
              "");
    ASSERT_NE(s.s, nullptr) << s.error;
    // The ucx transport moves host memory only: a CUDA step names the comm and the device.
    FakeCudaStep cuda({{kDLCUDA, 0}, {kDLCUDA, 0}});
    EXPECT_EQ(cuda.run(s.opt("a"), 1), LOOM_ERR_UNIMPLEMENTED) << v;
    const std::string e = loom_last_error();
    EXPECT_NE(e.find("comm 'u' cannot use cuda:0 memory"), std::string::npos) << e;
    EXPECT_NE(e.find("nccl"), std::string::npos) << e;
    // Its state stays on the device of the first step: a CUDA step after a CPU one.
    std::vector<float> p(4, 1.0f);
    ASSERT_EQ(host_step(s.opt("b"), p, 1), LOOM_OK) << loom_last_error();
    EXPECT_EQ(cuda.run(s.opt("b"), 2), LOOM_ERR_INVALID_ARGUMENT) << v;
    EXPECT_NE(std::string(loom_last_error()).find("fixed by its first step"), std::string::npos)
        << loom_last_error();
    const std::vector<float> before = p;
    ASSERT_EQ(host_step(s.opt("b"), p, 2), LOOM_OK) << loom_last_error();  // still usable
    EXPECT_NE(p, before);
    // Tensors on two CUDA devices.
    FakeCudaStep mixed({{kDLCUDA, 0}, {kDLCUDA, 1}});
    EXPECT_EQ(mixed.run(s.opt("c"), 1), LOOM_ERR_INVALID_ARGUMENT) << v;
    EXPECT_NE(std::string(loom_last_error()).find("a step mixes devices"), std::string::npos)
        << loom_last_error();
  }
}

// The host-only option (hierarchical) names itself on a CUDA step, before the transport is
// asked.
TEST(OnebitCudaDispatch, HierarchicalRefusesCudaSteps) {
  for (const auto& v : kVariants) {
    Session s("[comm.u]\nplugin = \"ucx\"\n" + optimizer("h", v, "u") + "hierarchical = true\n",
              "");
    ASSERT_NE(s.s, nullptr) << s.error;
    FakeCudaStep cuda({{kDLCUDA, 0}, {kDLCUDA, 0}});
    EXPECT_EQ(cuda.run(s.opt("h"), 1), LOOM_ERR_UNIMPLEMENTED) << v;
    EXPECT_NE(std::string(loom_last_error()).find("hierarchical = true runs on host memory"),
              std::string::npos)
        << loom_last_error();
  }
}

// ------------------------------------------------------------------ GPU

TEST(OnebitCuda, UcxRefusesCudaTensorsAndLeavesParamsUnchanged) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  for (const auto& v : kVariants) {
    Session s("[comm.u]\nplugin = \"ucx\"\n" + optimizer("o", v, "u"), "");
    ASSERT_NE(s.s, nullptr) << s.error;
    Model m(true, stream);
    const std::vector<float> before = m.params();
    EXPECT_EQ(m.step(s.opt("o"), 0, 1, false), LOOM_ERR_UNIMPLEMENTED) << v;
    EXPECT_NE(std::string(loom_last_error()).find("comm 'u' cannot use cuda:0 memory"),
              std::string::npos)
        << loom_last_error();
    EXPECT_EQ(m.params(), before) << v;
  }
  cudaStreamDestroy(stream);
}

// A world of one: the CUDA instance over a CUDA-capable comm (thread_comm, else nccl), the CPU
// one over a host comm (thread_comm, else ucx). Nothing is compressed in a world of one, but
// every update loop of both stages runs.
void world_of_one(const std::string& v) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  const std::string dir = loom_test::thread_comm_dir();
  const std::string world = fresh_world();
  const std::string comms =
      dir.empty() ? "[comm.h]\nplugin = \"ucx\"\n[comm.d]\nplugin = "
                    "\"nccl\"\n"
                  : thread_comm("h", world + "h", 0, 1) + thread_comm("d", world + "d", 0, 1);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  {
    Session s(comms + optimizer("cpu", v, "h") + optimizer("gpu", v, "d"), dir);
    ASSERT_NE(s.s, nullptr) << s.error;
    Model cpu(false, stream);
    Model gpu(true, stream);
    const bool nf = v == "onebit_adam";
    for (int t = 1; t <= kSteps; ++t) {
      ASSERT_EQ(cpu.step(s.opt("cpu"), 0, t, nf), LOOM_OK) << loom_last_error();
      ASSERT_EQ(gpu.step(s.opt("gpu"), 0, t, nf), LOOM_OK) << loom_last_error();
      expect_tight(gpu.params(), cpu.params(), v + " world of one, step " + std::to_string(t));
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
  cudaStreamDestroy(stream);
}

TEST(OnebitCuda, WorldOfOneOnebitAdamMatchesCpu) { world_of_one("onebit_adam"); }
TEST(OnebitCuda, WorldOfOneZeroOneAdamMatchesCpu) { world_of_one("zero_one_adam"); }
TEST(OnebitCuda, WorldOfOneOnebitLambMatchesCpu) { world_of_one("onebit_lamb"); }

// p thread ranks on one GPU, each with its own session (one thread_comm instance used by a CPU
// and a CUDA instance of the variant, both with the parameter lines `extra`) and its own stream.
void thread_ranks(const std::string& v, int p, const std::string& extra = "") {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  const std::string dir = loom_test::thread_comm_dir();
  if (dir.empty()) GTEST_SKIP() << "the thread_comm test plugin is not found";
  const std::string world = fresh_world();
  std::vector<std::vector<float>> gpu_out(static_cast<std::size_t>(p));
  std::vector<std::vector<float>> cpu_out(static_cast<std::size_t>(p));
  on_threads(p, [&](int rank) {
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    {
      Session s(thread_comm("c", world, rank, p) + optimizer("cpu", v, "c") + extra +
                    optimizer("gpu", v, "c") + extra,
                dir);
      ASSERT_NE(s.s, nullptr) << s.error;
      Model cpu(false, stream);
      Model gpu(true, stream);
      const bool nf = v == "onebit_adam" && extra.empty();  // shard_state refuses non_freeze
      for (int t = 1; t <= kSteps; ++t) {
        ASSERT_EQ(cpu.step(s.opt("cpu"), rank, t, nf), LOOM_OK) << loom_last_error();
        ASSERT_EQ(gpu.step(s.opt("gpu"), rank, t, nf), LOOM_OK) << loom_last_error();
      }
      gpu_out[static_cast<std::size_t>(rank)] = gpu.params();
      cpu_out[static_cast<std::size_t>(rank)] = cpu.params();
    }
    cudaStreamDestroy(stream);
  });
  if (::testing::Test::HasFatalFailure()) return;
  for (int r = 1; r < p; ++r) {
    const auto ur = static_cast<std::size_t>(r);
    if (v == "zero_one_adam") {
      // A sync reverts p by the accumulated u (p -= u, rounded on each rank) before adding
      // the average: ranks agree to rounding, not bit for bit (on the CPU as well).
      expect_tight(gpu_out[ur], gpu_out[0], v + ": CUDA rank " + std::to_string(r) + " vs 0");
      expect_tight(cpu_out[ur], cpu_out[0], v + ": CPU rank " + std::to_string(r) + " vs 0");
    } else {
      EXPECT_EQ(gpu_out[ur], gpu_out[0]) << v << ": CUDA rank " << r;
      EXPECT_EQ(cpu_out[ur], cpu_out[0]) << v << ": CPU rank " << r;
    }
  }
  expect_close(gpu_out[0], cpu_out[0], v + " on " + std::to_string(p) + " thread ranks");
}

TEST(OnebitCuda, ThreadRanksOnebitAdam) {
  for (int p : {2, 4}) thread_ranks("onebit_adam", p);
}
TEST(OnebitCuda, ThreadRanksZeroOneAdam) {
  for (int p : {2, 4}) thread_ranks("zero_one_adam", p);
}
TEST(OnebitCuda, ThreadRanksOnebitLamb) {
  for (int p : {2, 4}) thread_ranks("onebit_lamb", p);
}
// The warmup's allreduce with bf16 on the wire, cast and widened on the device.
TEST(OnebitCuda, ThreadRanksBf16Warmup) {
  for (const auto& v : kVariants) thread_ranks(v, 2, "warmup_wire = \"bf16\"\n");
  thread_ranks("onebit_adam", 2, "warmup_wire = \"bf16\"\nshard_state = true\n");
}
// ZeRO-1 on the device: slices of m and v, the compressed reduce-scatter and the parameter
// allgather on device buffers (thread_comm has no reduce_scatter: the warmup averages the
// whole buffer and keeps the slice).
TEST(OnebitCuda, ThreadRanksShardedOnebitAdam) {
  for (int p : {2, 4}) thread_ranks("onebit_adam", p, "shard_state = true\n");
  // The parameter change shared through the codec (the add_update kernel).
  thread_ranks("onebit_adam", 2, "shard_state = true\nshard_gather = \"compressed\"\n");
}

// bucket_mb on the device: step() runs the compressed allreduce's segments one after another
// on the stream (announcements are a host-memory feature); the CPU instance exchanges the same
// buckets through its bucketed step. Each variant through its phases.
TEST(OnebitCuda, ThreadRanksInBuckets) {
  for (const auto& v : kVariants) thread_ranks(v, 2, "bucket_mb = 0.0004\n");
}
// 1-bit LAMB's sharded state is host memory only: a CUDA step is refused by name, nothing
// changed.
TEST(OnebitCuda, ShardedOnebitLambIsRefusedOnTheDevice) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  const std::string dir = loom_test::thread_comm_dir();
  if (dir.empty()) GTEST_SKIP() << "the thread_comm test plugin is not found";
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  {
    Session s(thread_comm("c", fresh_world(), 0, 1) + optimizer("gpu", "onebit_lamb", "c") +
                  "shard_state = true\n",
              dir);
    ASSERT_NE(s.s, nullptr) << s.error;
    Model gpu(true, stream);
    const std::vector<float> before = gpu.params();
    EXPECT_EQ(gpu.step(s.opt("gpu"), 0, 1, false), LOOM_ERR_UNIMPLEMENTED);
    EXPECT_NE(std::string(loom_last_error()).find("host memory"), std::string::npos)
        << loom_last_error();
    EXPECT_EQ(gpu.params(), before);
  }
  cudaStreamDestroy(stream);
}

std::vector<char> export_blob(loom_instance* opt) {
  size_t size = 0;
  EXPECT_EQ(loom_instance_export_state(opt, nullptr, 0, &size), LOOM_OK) << loom_last_error();
  std::vector<char> blob(size);
  EXPECT_EQ(loom_instance_export_state(opt, blob.data(), size, &size), LOOM_OK)
      << loom_last_error();
  return blob;
}

// On 2 thread ranks: "a" runs on CUDA throughout; "b" (CUDA) and "e" (CPU) run to step k, in
// the compression stage; b's checkpoint resumes on the CPU ("c") and on CUDA ("g"), e's on
// CUDA ("f"), each imported before its first step.
void checkpoints(const std::string& v) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  const std::string dir = loom_test::thread_comm_dir();
  if (dir.empty()) GTEST_SKIP() << "the thread_comm test plugin is not found";
  constexpr int kRanks = 2;
  constexpr int kAt = 8;
  const std::string world = fresh_world();
  on_threads(kRanks, [&](int rank) {
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    {
      std::string toml = thread_comm("net", world, rank, kRanks);
      for (const char* name : {"a", "b", "c", "e", "f", "g"}) toml += optimizer(name, v, "net");
      Session s(toml, dir);
      ASSERT_NE(s.s, nullptr) << s.error;
      const bool nf = v == "onebit_adam";
      Model a(true, stream), b(true, stream), e(false, stream);
      Model c(false, stream), f(true, stream), g(true, stream);
      for (int t = 1; t <= kAt; ++t) {
        ASSERT_EQ(a.step(s.opt("a"), rank, t, nf), LOOM_OK) << loom_last_error();
        ASSERT_EQ(b.step(s.opt("b"), rank, t, nf), LOOM_OK) << loom_last_error();
        ASSERT_EQ(e.step(s.opt("e"), rank, t, nf), LOOM_OK) << loom_last_error();
      }
      const std::vector<char> from_cuda = export_blob(s.opt("b"));
      const std::vector<char> from_cpu = export_blob(s.opt("e"));
      ASSERT_EQ(loom_instance_import_state(s.opt("c"), from_cuda.data(), from_cuda.size()), LOOM_OK)
          << loom_last_error();
      ASSERT_EQ(loom_instance_import_state(s.opt("g"), from_cuda.data(), from_cuda.size()), LOOM_OK)
          << loom_last_error();
      ASSERT_EQ(loom_instance_import_state(s.opt("f"), from_cpu.data(), from_cpu.size()), LOOM_OK)
          << loom_last_error();
      c.set_params(b.params());
      g.set_params(b.params());
      f.set_params(e.params());
      for (int t = kAt + 1; t <= kSteps; ++t) {
        ASSERT_EQ(a.step(s.opt("a"), rank, t, nf), LOOM_OK) << loom_last_error();
        ASSERT_EQ(c.step(s.opt("c"), rank, t, nf), LOOM_OK) << loom_last_error();
        ASSERT_EQ(g.step(s.opt("g"), rank, t, nf), LOOM_OK) << loom_last_error();
        ASSERT_EQ(f.step(s.opt("f"), rank, t, nf), LOOM_OK) << loom_last_error();
      }
      const std::vector<float> want = a.params();
      EXPECT_EQ(g.params(), want) << v << ": CUDA-to-CUDA resume, rank " << rank;
      expect_close(c.params(), want,
                   v + ": CUDA checkpoint resumed on the CPU, rank " + std::to_string(rank));
      expect_close(f.params(), want,
                   v + ": CPU checkpoint resumed on CUDA, rank " + std::to_string(rank));
      // The checkpoint made on CUDA is the one a CPU instance would make: same size.
      EXPECT_EQ(from_cuda.size(), from_cpu.size());
    }
    cudaStreamDestroy(stream);
  });
}

TEST(OnebitCuda, CheckpointOnebitAdamMovesBetweenDevices) { checkpoints("onebit_adam"); }
TEST(OnebitCuda, CheckpointZeroOneAdamMovesBetweenDevices) { checkpoints("zero_one_adam"); }
TEST(OnebitCuda, CheckpointOnebitLambMovesBetweenDevices) { checkpoints("onebit_lamb"); }

}  // namespace
