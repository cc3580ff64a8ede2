// adam and lamb on CUDA tensors against the same plugins on CPU tensors: the results agree
// within fp32 rounding. Skips when there is no CUDA device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <loom/embed.h>
#include <loom/kinds/optimizer.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

namespace {

bool have_device() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return false;
  return n > 0;
}

loom_instance* open(const std::string& plugin, loom_session** s) {
  loom_open_options o{};
  o.struct_size = LOOM_OPEN_OPTIONS_SIZE;
  o.log_level = -1;
  const std::string toml = "[optimizer.opt]\nplugin = \"" + plugin + "\"\nweight_decay = 0.01\n";
  EXPECT_EQ(loom_open_string(toml.c_str(), "cuda.toml", &o, s), 0) << loom_last_error();
  loom_instance* opt = nullptr;
  EXPECT_EQ(loom_find_instance(*s, "loom.optimizer/1", "opt", &opt), 0) << loom_last_error();
  return opt;
}

// Runs 30 steps of `plugin` on the CPU and on the GPU with the same inputs: fp32
// tensors of several sizes (one multi-tensor launch), then moves the GPU state to the CPU.
void compare(const std::string& plugin) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  loom_session* sc = nullptr;
  loom_session* sg = nullptr;
  loom_instance* cpu = open(plugin, &sc);
  loom_instance* gpu = open(plugin, &sg);
  ASSERT_NE(cpu, nullptr);
  ASSERT_NE(gpu, nullptr);
  const std::vector<int64_t> sizes = {1, 1000, 100003, 4096 * 5 + 17};
  std::mt19937 rng(3);
  std::normal_distribution<float> d;
  std::vector<std::vector<float>> hp(sizes.size()), hg(sizes.size());
  std::vector<float*> dp(sizes.size()), dg(sizes.size());
  std::vector<int64_t> shapes = sizes;
  for (size_t i = 0; i < sizes.size(); ++i) {
    hp[i].resize(sizes[i]);
    hg[i].resize(sizes[i]);
    for (auto& x : hp[i]) x = d(rng);
    ASSERT_EQ(cudaMalloc(&dp[i], sizes[i] * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&dg[i], sizes[i] * 4), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(dp[i], hp[i].data(), sizes[i] * 4, cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<DLTensor> cp(sizes.size()), cg(sizes.size()), gp(sizes.size()), gg(sizes.size());
  std::vector<loom_optimizer_tensor> ct(sizes.size()), gt(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    auto mk = [&](void* data, DLDevice dev) {
      DLTensor t{};
      t.data = data;
      t.device = dev;
      t.ndim = 1;
      t.dtype = {kDLFloat, 32, 1};
      t.shape = &shapes[i];
      return t;
    };
    cp[i] = mk(hp[i].data(), {kDLCPU, 0});
    cg[i] = mk(hg[i].data(), {kDLCPU, 0});
    gp[i] = mk(dp[i], {kDLCUDA, 0});
    gg[i] = mk(dg[i], {kDLCUDA, 0});
    ct[i] = {LOOM_OPTIMIZER_TENSOR_SIZE, 0, &cp[i], &cg[i], nullptr};
    gt[i] = {LOOM_OPTIMIZER_TENSOR_SIZE, 0, &gp[i], &gg[i], nullptr};
  }
  loom_optimizer_group cgroup{LOOM_OPTIMIZER_GROUP_SIZE, 0, ct.data(), ct.size(), 1.0, NAN};
  loom_optimizer_group ggroup{LOOM_OPTIMIZER_GROUP_SIZE, 0, gt.data(), gt.size(), 1.0, NAN};
  for (int t = 1; t <= 30; ++t) {
    for (size_t i = 0; i < sizes.size(); ++i) {
      for (auto& x : hg[i]) x = d(rng);
      ASSERT_EQ(cudaMemcpy(dg[i], hg[i].data(), sizes[i] * 4, cudaMemcpyHostToDevice), cudaSuccess);
    }
    loom_optimizer_step_args a{LOOM_OPTIMIZER_STEP_ARGS_SIZE, 0, &cgroup, 1, 1e-2, 1.0, t, nullptr};
    ASSERT_EQ(loom_optimizer_step(cpu, &a), 0) << loom_last_error();
    a.groups = &ggroup;
    ASSERT_EQ(loom_optimizer_step(gpu, &a), 0) << loom_last_error();
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (size_t i = 0; i < sizes.size(); ++i) {
    std::vector<float> back(sizes[i]);
    ASSERT_EQ(cudaMemcpy(back.data(), dp[i], sizes[i] * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    for (int64_t k = 0; k < sizes[i]; ++k) {
      ASSERT_NEAR(back[k], hp[i][k], 1e-5 * (1 + std::fabs(hp[i][k])))
          << "tensor " << i << " element " << k;
    }
    cudaFree(dp[i]);
    cudaFree(dg[i]);
  }
  // State exported from the GPU instance imports into a CPU one.
  size_t size = 0;
  ASSERT_EQ(loom_instance_export_state(gpu, nullptr, 0, &size), 0) << loom_last_error();
  std::vector<char> blob(size);
  ASSERT_EQ(loom_instance_export_state(gpu, blob.data(), size, &size), 0);
  ASSERT_EQ(loom_instance_import_state(cpu, blob.data(), size), 0) << loom_last_error();
  loom_close(sc);
  loom_close(sg);
}

TEST(Cuda, AdamMatchesCpu) { compare("adam"); }
TEST(Cuda, LambMatchesCpu) { compare("lamb"); }

}  // namespace
