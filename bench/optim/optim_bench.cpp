// loom-bench-optim [--sizes 1M,16M,64M] [--iters N] [--optimizers adam,lamb]
//
// For each size: the copy bandwidth of this machine (a threaded copy of the same number
// of bytes Adam moves), then each optimizer plugin through the host's C API, then the
// peer: a plain -O3 C++ scalar loop of the same Adam update. One JSON object per line:
//   {"optimizer", "device", "params", "seconds" (per step: best of N on the CPU, the mean of
//    N back-to-back steps on CUDA, as gpu_peers.py times torch), "gbps",
//    "copy_gbps", "ratio_to_copy", "roof_gbps", "ratio_to_roof"}
// roof_gbps: a trivial loop with Adam's access pattern (read p, g, m, v; write p, m, v in
// place) on the same threads, counted at 28 bytes per parameter.
// Adam and the scalar loop count 28 bytes per parameter (read p, g, m, v; write p, m, v),
// LAMB 40 (a second pass reads p, m, v and writes p).
#include <loom/embed.h>
#include <loom/kinds/optimizer.h>
#include <loom/sdk/parallel.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <loom_cli_support.hpp>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench_support.hpp"

#if LOOM_BENCH_CUDA
#include <cuda_runtime.h>
#endif

namespace {

using loom::bench::Clock;
using loom::bench::since;

// The peer: Adam (AdamW, bias correction) as anyone would write it, one thread.
__attribute__((noinline)) void scalar_adam(float* p, const float* g, float* m, float* v, size_t n,
                                           float lr, float b1, float b2, float eps, float wd,
                                           int t) {
  const float bc1 = 1.0f - std::pow(b1, static_cast<float>(t));
  const float bc2 = 1.0f - std::pow(b2, static_cast<float>(t));
  const float step = lr / bc1;
  const float bc2s = std::sqrt(bc2);
  for (size_t i = 0; i < n; ++i) {
    p[i] *= 1.0f - lr * wd;
    m[i] = b1 * m[i] + (1.0f - b1) * g[i];
    v[i] = b2 * v[i] + (1.0f - b2) * g[i] * g[i];
    p[i] -= step * m[i] / (std::sqrt(v[i]) / bc2s + eps);
  }
}

double g_roof_gbps = 0.0;

void emit(const char* optimizer, const char* device, size_t n, double sec, double bytes,
          double copy_gbps, const char* note = nullptr) {
  nlohmann::json j;
  j["optimizer"] = optimizer;
  j["device"] = device;
  j["params"] = n;
  j["seconds"] = sec;
  j["gbps"] = bytes / sec / 1e9;
  j["copy_gbps"] = copy_gbps;
  j["ratio_to_copy"] = copy_gbps > 0 ? bytes / sec / 1e9 / copy_gbps : 0.0;
  j["roof_gbps"] = g_roof_gbps;
  j["ratio_to_roof"] = g_roof_gbps > 0 ? bytes / sec / 1e9 / g_roof_gbps : 0.0;
  j["threads"] = loom_thread_count();  // the pool the plugins and the loops above share
  if (note != nullptr) j["note"] = note;
  loom::bench::emit(j);
}

// Opens a fresh instance of `plugin` (state is keyed by tensor position and shape).
loom_session* open_optimizer(const std::string& plugin, loom_instance** inst) {
  loom_session* s = nullptr;
  const std::string toml = "[optimizer.o]\nplugin = \"" + plugin + "\"\nweight_decay = 0.01\n";
  loom_open_options opts{};
  opts.struct_size = LOOM_OPEN_OPTIONS_SIZE;
  opts.log_level = -1;
  if (loom_open_string(toml.c_str(), "bench", &opts, &s) != 0 ||
      loom_find_instance(s, "loom.optimizer/1", "o", inst) != 0) {
    std::fprintf(stderr, "loom-bench-optim: %s\n", loom_last_error());
    std::exit(1);
  }
  return s;
}

#if LOOM_BENCH_CUDA
#define LOOM_CUDA_OK(call)                                                               \
  do {                                                                                   \
    const cudaError_t e_ = (call);                                                       \
    if (e_ != cudaSuccess) {                                                             \
      std::fprintf(stderr, "loom-bench-optim: %s: %s\n", #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

// The same measurements on CUDA device 0: copy = cudaMemcpy device to device of 14 bytes per
// parameter (read + write = 28), steps timed with events on one stream.
int run_cuda(const std::vector<size_t>& sizes, const std::vector<std::string>& optimizers,
             int iters) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("{\"skipped\": \"no CUDA device\"}\n");
    return 77;  // the ctest/automake convention for "skipped"; scripts/gpu-check.sh reads it
  }
  cudaStream_t stream = nullptr;
  LOOM_CUDA_OK(cudaStreamCreate(&stream));
  cudaEvent_t a = nullptr;
  cudaEvent_t b = nullptr;
  LOOM_CUDA_OK(cudaEventCreate(&a));
  LOOM_CUDA_OK(cudaEventCreate(&b));
  // Mean over `iters` back-to-back runs between two events, after one warm-up run (which
  // allocates optimizer state): the way gpu_peers.py times torch, so the ratio is fair.
  auto timed = [&](auto&& fn) {
    fn(0);
    LOOM_CUDA_OK(cudaEventRecord(a, stream));
    for (int it = 1; it <= iters; ++it) fn(it);
    LOOM_CUDA_OK(cudaEventRecord(b, stream));
    LOOM_CUDA_OK(cudaEventSynchronize(b));
    float ms = 0.0f;
    LOOM_CUDA_OK(cudaEventElapsedTime(&ms, a, b));
    return static_cast<double>(ms) / 1e3 / iters;
  };
  for (const size_t n : sizes) {
    float* p = nullptr;
    float* g = nullptr;
    LOOM_CUDA_OK(cudaMalloc(&p, n * 4));
    LOOM_CUDA_OK(cudaMalloc(&g, n * 4));
    LOOM_CUDA_OK(cudaMemset(p, 0, n * 4));
    LOOM_CUDA_OK(cudaMemset(g, 0, n * 4));
    double copy_gbps = 0.0;
    {
      void* src = nullptr;
      void* dst = nullptr;
      LOOM_CUDA_OK(cudaMalloc(&src, n * 14));
      LOOM_CUDA_OK(cudaMalloc(&dst, n * 14));
      const double sec = timed([&](int) {
        LOOM_CUDA_OK(cudaMemcpyAsync(dst, src, n * 14, cudaMemcpyDeviceToDevice, stream));
      });
      copy_gbps = 28.0 * static_cast<double>(n) / sec / 1e9;
      LOOM_CUDA_OK(cudaFree(src));
      LOOM_CUDA_OK(cudaFree(dst));
    }
    g_roof_gbps = 0.0;
    int64_t shape[1] = {static_cast<int64_t>(n)};
    DLTensor tp{};
    tp.data = p;
    tp.device = {kDLCUDA, 0};
    tp.ndim = 1;
    tp.dtype = {kDLFloat, 32, 1};
    tp.shape = shape;
    DLTensor tg = tp;
    tg.data = g;
    loom_optimizer_tensor t{LOOM_OPTIMIZER_TENSOR_SIZE, 0, &tp, &tg, nullptr};
    loom_optimizer_group grp{LOOM_OPTIMIZER_GROUP_SIZE, 0, &t, 1, 1.0, NAN};
    for (const auto& o : optimizers) {
      loom_instance* inst = nullptr;
      loom_session* s = open_optimizer(o, &inst);
      const double sec = timed([&](int it) {
        loom_optimizer_step_args args{
            LOOM_OPTIMIZER_STEP_ARGS_SIZE, 0, &grp, 1, 1e-3, 1.0, it + 1, stream};
        if (loom_optimizer_step(inst, &args) != 0) {
          std::fprintf(stderr, "loom-bench-optim: %s\n", loom_last_error());
          std::exit(1);
        }
      });
      emit(o.c_str(), "cuda", n, sec, (o == "lamb" ? 40.0 : 28.0) * static_cast<double>(n),
           copy_gbps);
      loom_close(s);
    }
    LOOM_CUDA_OK(cudaFree(p));
    LOOM_CUDA_OK(cudaFree(g));
  }
  return 0;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "Optimizer step throughput: the optimizer plugins beside the copy bandwidth and a plain\n"
      "scalar Adam loop, one JSON object per line"};
  loom_cli::configure(app, "loom bench optim");
  std::vector<std::string> size_text{"1M", "16M", "64M"};
  std::vector<std::string> optimizers = {"adam", "lamb"};
  int iters = 10;
  std::string device = "cpu";
  app.add_option("--device", device, "Where the tensors live")
      ->check(CLI::IsMember({"cpu", "cuda"}).description(""))
      ->type_name("cpu|cuda");
  auto* sizes_opt =
      app.add_option("--sizes", size_text, "Parameter counts (K, M, G: 1024 multiples)")
          ->delimiter(',')
          ->check(loom_cli::size_validator())
          ->type_name("SIZE,...")
          ->default_str("1M,16M,64M; cuda: 1M,16M,64M,256M");
  app.add_option("--iters", iters, "Timed steps per size")
      ->check(loom_cli::integer_in(1, 1000000))
      ->type_name("N");
  app.add_option("--optimizers", optimizers, "Optimizer plugins to time")
      ->delimiter(',')
      ->type_name("NAME,...")
      ->default_str("adam,lamb");
  if (const int rc = loom_cli::parse(app, argc, argv, false); rc >= 0) return rc;
  const bool sizes_given = sizes_opt->count() > 0;
  std::vector<size_t> sizes;
  for (const auto& t : size_text) sizes.push_back(*loom_cli::parse_size(t));

  if (device == "cuda") {
#if LOOM_BENCH_CUDA
    if (!sizes_given) sizes = {1u << 20, 16u << 20, 64u << 20, 256u << 20};
    return run_cuda(sizes, optimizers, iters);
#else
    (void)sizes_given;
    std::fprintf(stderr, "loom-bench-optim: built without CUDA\n");
    return 1;
#endif
  }

  for (const size_t n : sizes) {
    std::vector<float> p(n, 0.5f), g(n, 0.01f), m(n, 0.0f), v(n, 0.0f);
    for (size_t i = 0; i < n; ++i) g[i] = static_cast<float>((i % 17) - 8) * 1e-3f;

    // Copy bandwidth: the same thread pool copies 14 bytes per parameter one way, so the
    // bytes moved (read + write) equal Adam's 28.
    double copy_gbps = 0.0;
    {
      const size_t words = n * 14 / 4;
      std::vector<float> src(words, 1.0f), dst(words, 0.0f);
      double best = 1e30;
      for (int it = 0; it < iters; ++it) {
        const auto t0 = Clock::now();
        loom::sdk::parallel_for_on(loom_parallel_for, words, 1 << 16, [&](size_t b, size_t e) {
          std::memcpy(dst.data() + b, src.data() + b, (e - b) * 4);
        });
        best = std::min(best, since(t0));
      }
      copy_gbps = 2.0 * static_cast<double>(words) * 4.0 / best / 1e9;
    }

    // Roof: Adam's exact access pattern (read p, g, m, v; write p, m, v in place) with
    // trivial arithmetic, on the same threads: the bandwidth a perfect Adam would reach.
    {
      double best = 1e30;
      for (int it = 0; it < iters; ++it) {
        const auto t0 = Clock::now();
        loom::sdk::parallel_for_on(loom_parallel_for, n, 1 << 15, [&](size_t b, size_t e) {
          float* __restrict pp = p.data();
          float* __restrict mm = m.data();
          float* __restrict vv = v.data();
          const float* __restrict gg = g.data();
          for (size_t i = b; i < e; ++i) {
            pp[i] += 1e-9f * gg[i];
            mm[i] += 1e-9f * gg[i];
            vv[i] += 1e-9f * gg[i];
          }
        });
        best = std::min(best, since(t0));
      }
      g_roof_gbps = 28.0 * static_cast<double>(n) / best / 1e9;
    }
    std::fill(m.begin(), m.end(), 0.0f);
    std::fill(v.begin(), v.end(), 0.0f);

    int64_t shape[1] = {static_cast<int64_t>(n)};
    DLTensor tp{}, tg{};
    tp.data = p.data();
    tp.device = {kDLCPU, 0};
    tp.ndim = 1;
    tp.dtype = {kDLFloat, 32, 1};
    tp.shape = shape;
    tg = tp;
    tg.data = g.data();
    loom_optimizer_tensor t{LOOM_OPTIMIZER_TENSOR_SIZE, 0, &tp, &tg, nullptr};
    loom_optimizer_group grp{LOOM_OPTIMIZER_GROUP_SIZE, 0, &t, 1, 1.0, NAN};
    for (size_t k = 0; k < optimizers.size(); ++k) {
      loom_instance* inst = nullptr;
      loom_session* s = open_optimizer(optimizers[k], &inst);
      double best = 1e30;
      for (int it = 0; it <= iters; ++it) {
        loom_optimizer_step_args a{
            LOOM_OPTIMIZER_STEP_ARGS_SIZE, 0, &grp, 1, 1e-3, 1.0, it + 1, nullptr};
        const auto t0 = Clock::now();
        if (loom_optimizer_step(inst, &a) != 0) {
          std::fprintf(stderr, "loom-bench-optim: %s\n", loom_last_error());
          return 1;
        }
        const double sec = since(t0);
        if (it > 0) best = std::min(best, sec);  // the first step allocates the state
      }
      const double bytes = (optimizers[k] == "lamb" ? 40.0 : 28.0) * static_cast<double>(n);
      emit(optimizers[k].c_str(), "cpu", n, best, bytes, copy_gbps);
      loom_close(s);
    }
    {
      double best = 1e30;
      for (int it = 0; it < iters; ++it) {
        const auto t0 = Clock::now();
        scalar_adam(p.data(), g.data(), m.data(), v.data(), n, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f,
                    it + 1);
        best = std::min(best, since(t0));
      }
      emit("scalar_loop_adam", "cpu", n, best, 28.0 * static_cast<double>(n), copy_gbps,
           "peer: plain -O3 C++ loop, one thread");
    }
  }
  return 0;
}
