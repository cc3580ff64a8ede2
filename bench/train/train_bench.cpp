// loom-bench-train [--configs example,wide,deep] [--batch B] [--iters N] [--threads T]
//
// Tokens/s of the reference trainer's Model::forward_backward (batch B of full-context
// sequences) and its model FLOPs utilisation (MFU) against the sgemm peak measured in the same
// run. For each config, N rounds interleave: cblas_sgemm at a square 1024^3, every GEMM one
// training step of the config runs (its "model shapes": forward and both backward products of
// each linear layer and of the tied head, at N = B*seq rows, back to back), each both with
// OpenBLAS's own threads ("openblas_threads") and split over the model's pool the way the
// model calls it ("model_split"), and one training step. Every figure is the best of the N
// rounds, so a busy machine disturbs the peak and the step alike. One JSON object per line:
//  {"kind":"sgemm", "config", "shape", "mode", "threads", "gflops"}
//  {"kind":"sgemm_model_shapes", "config", "rows", "mode", "threads", "gflops"}
//  {"kind":"train", "config", ..., "tokens_per_s", "flops_per_token", "model_gflops",
//   "peak_gflops", "mfu", "mfu_vs_square"}: model FLOPs/token (Model::flops_per_token:
//   6 * matmul parameters incl. the tied head + 6 * layers * seq * dim for causal attention)
//   times tokens/s, divided by the best model-shape sgemm rate (mfu) and by the best 1024^3
//   rate (mfu_vs_square).
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <loom_cli_support.hpp>
#include <map>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "bench_support.hpp"
#include "layers.hpp"
#include "model.hpp"

namespace {

using loom::bench::Clock;
using loom::bench::since;
namespace lt = loom::trainer;

const std::map<std::string, lt::ModelConfig>& configs() {
  static const std::map<std::string, lt::ModelConfig> m = {
      // The trainer's example model (examples/train_*.toml): 4 layers, dim 128, context 128.
      {"example", {256, 128, 4, 4, 128}},
      {"wide", {256, 128, 4, 4, 256}},
      {"deep", {256, 256, 6, 6, 384}},
  };
  return m;
}

struct Gemm {
  bool ta, tb;
  int m, n, k;
};

// The GEMMs of one training step (see layers.hpp: forward out = in w^T; backward
// din = dout w, dw = dout^T in), for N rows.
std::vector<Gemm> step_gemms(const lt::ModelConfig& c, int N) {
  std::vector<Gemm> g;
  auto linear = [&](int ic, int oc) {
    g.push_back({false, true, N, oc, ic});   // forward
    g.push_back({false, false, N, ic, oc});  // dinp
    g.push_back({true, false, oc, ic, N});   // dw
  };
  for (int l = 0; l < c.layers; ++l) {
    linear(c.dim, 3 * c.dim);
    linear(c.dim, c.dim);
    linear(c.dim, 4 * c.dim);
    linear(4 * c.dim, c.dim);
  }
  linear(c.dim, c.vocab_size);
  return g;
}

double gemm_flops(const std::vector<Gemm>& gs) {
  double f = 0;
  for (const auto& g : gs) f += 2.0 * g.m * g.n * g.k;
  return f;
}

// A GEMM list with its buffers; pass() runs it once and returns the seconds.
class GemmSet {
 public:
  explicit GemmSet(std::vector<Gemm> gs) : gs_(std::move(gs)) {
    size_t a_max = 0, b_max = 0, c_max = 0;
    for (const auto& g : gs_) {
      a_max = std::max(a_max, static_cast<size_t>(g.m) * g.k);
      b_max = std::max(b_max, static_cast<size_t>(g.k) * g.n);
      c_max = std::max(c_max, static_cast<size_t>(g.m) * g.n);
    }
    a_.assign(a_max, 0.5f);
    b_.assign(b_max, 0.25f);
    c_.assign(c_max, 0.0f);
  }
  double flops() const { return gemm_flops(gs_); }
  double pass(bool model_split) {
    const auto t0 = Clock::now();
    for (const auto& g : gs_) {
      const int lda = g.ta ? g.m : g.k;
      const int ldb = g.tb ? g.k : g.n;
      if (model_split) {
        lt::layers::par_gemm<float>(g.ta, g.tb, g.m, g.n, g.k, 1.0f, a_.data(), lda, b_.data(), ldb,
                                    0.0f, c_.data(), g.n);
      } else {
        lt::layers::gemm(g.ta, g.tb, g.m, g.n, g.k, 1.0f, a_.data(), lda, b_.data(), ldb, 0.0f,
                         c_.data(), g.n);
      }
    }
    return since(t0);
  }

 private:
  std::vector<Gemm> gs_;
  std::vector<float> a_, b_, c_;
};

// Best (shortest) of several timings: on a shared machine the best run is the one least
// disturbed by other processes, for the GEMM peak and the model step alike.
struct Best {
  double s = 1e30;
  void add(double t) { s = std::min(s, t); }
};

}  // namespace

int run(int argc, char** argv) {
  loom::trainer::layers::cap_simd_from_env();  // LOOM_SIMD_MAX: another CPU's code path
  CLI::App app{
      "Tokens/s and MFU of the reference trainer's model against the sgemm peak measured in\n"
      "the same run, one JSON object per line"};
  loom_cli::configure(app, "loom bench train");
  std::vector<std::string> names = {"example", "wide", "deep"};
  int batch = 8;
  int iters = 10;
  int threads = 0;
  app.add_option("--configs", names, "Model configs: example, wide, deep")
      ->delimiter(',')
      ->type_name("NAME,...")
      ->default_str("example,wide,deep");
  app.add_option("--batch", batch, "Sequences per step")
      ->check(loom_cli::integer_in(1, 4096))
      ->type_name("B");
  app.add_option("--iters", iters, "Rounds; each figure is the best of them")
      ->check(loom_cli::integer_in(1, 1000000))
      ->type_name("N");
  app.add_option("--threads", threads, "Model threads (0: LOOM_NUM_THREADS or all cores)")
      ->check(loom_cli::integer_in(0, 4096))
      ->type_name("T");
  if (const int rc = loom_cli::parse(app, argc, argv, false); rc >= 0) return rc;
  for (const auto& n : names) {
    if (configs().count(n) == 0) {
      return loom_cli::usage_error("loom bench train",
                                   "--configs: unknown config '" + n + "' (example, wide, deep)");
    }
  }
  lt::set_num_threads(threads);  // 0: LOOM_NUM_THREADS or all cores
  const int nt = lt::num_threads();

  // Rounds interleave the sgemm peak measurements with the training steps, so both see the
  // same machine conditions; each figure is the best of the rounds.
  GemmSet square({{false, false, 1024, 1024, 1024}});

  for (const auto& name : names) {
    const lt::ModelConfig cfg = configs().at(name);
    const int seq = cfg.context;
    const int N = batch * seq;
    GemmSet shapes(step_gemms(cfg, N));
    Best sq_ob, sq_split;
    auto time_square = [&] {
      openblas_set_num_threads(nt);
      sq_ob.add(square.pass(false));
      openblas_set_num_threads(1);
      sq_split.add(square.pass(true));
    };
    time_square();  // warm-up
    lt::Model model(cfg, 1234);
    std::vector<int32_t> tok(static_cast<size_t>(N)), tgt(static_cast<size_t>(N));
    uint64_t s = 88172645463325252ull;
    for (size_t i = 0; i < tok.size(); ++i) {
      s ^= s << 13;
      s ^= s >> 7;
      s ^= s << 17;
      tok[i] = static_cast<int32_t>(s % static_cast<uint64_t>(cfg.vocab_size));
      tgt[i] = static_cast<int32_t>((s >> 20) % static_cast<uint64_t>(cfg.vocab_size));
    }
    Best sh_ob, sh_split, step;
    double total = 0;
    float loss = 0;
    model.zero_grad();
    model.forward_backward(tok.data(), tgt.data(), batch, seq);  // warm-up
    shapes.pass(true);
    for (int it = 0; it < iters; ++it) {
      time_square();
      openblas_set_num_threads(nt);
      sh_ob.add(shapes.pass(false));
      openblas_set_num_threads(1);
      sh_split.add(shapes.pass(true));
      model.zero_grad();
      const auto t0 = Clock::now();
      loss = model.forward_backward(tok.data(), tgt.data(), batch, seq);
      const double t = since(t0);
      step.add(t);
      total += t;
    }
    auto gf = [](double flops, const Best& b) { return flops / b.s / 1e9; };
    const double square_peak = std::max(gf(square.flops(), sq_ob), gf(square.flops(), sq_split));
    const double peak = std::max(gf(shapes.flops(), sh_ob), gf(shapes.flops(), sh_split));
    for (const auto& [mode, b] :
         {std::pair{"openblas_threads", &sq_ob}, {"model_split", &sq_split}})
      loom::bench::emit(nlohmann::json{{"bench", "train"},
                                       {"kind", "sgemm"},
                                       {"config", name},
                                       {"shape", "1024x1024x1024"},
                                       {"mode", mode},
                                       {"threads", nt},
                                       {"gflops", gf(square.flops(), *b)}});
    for (const auto& [mode, b] :
         {std::pair{"openblas_threads", &sh_ob}, {"model_split", &sh_split}})
      loom::bench::emit(nlohmann::json{{"bench", "train"},
                                       {"kind", "sgemm_model_shapes"},
                                       {"config", name},
                                       {"rows", N},
                                       {"mode", mode},
                                       {"threads", nt},
                                       {"gflops", gf(shapes.flops(), *b)}});
    const double best = step.s;
    const double fpt = model.flops_per_token(seq);
    const double tps = N / best;
    const double gflops = fpt * tps / 1e9;
    loom::bench::emit(nlohmann::json{{"bench", "train"},
                                     {"kind", "train"},
                                     {"config", name},
                                     {"simd", loom::trainer::layers::kernel_target()},
                                     {"layers", cfg.layers},
                                     {"dim", cfg.dim},
                                     {"heads", cfg.heads},
                                     {"context", cfg.context},
                                     {"vocab", cfg.vocab_size},
                                     {"params", model.num_parameters()},
                                     {"batch", batch},
                                     {"seq", seq},
                                     {"threads", nt},
                                     {"iters", iters},
                                     {"loss", loss},
                                     {"step_s_best", best},
                                     {"step_s_mean", total / iters},
                                     {"tokens_per_s", tps},
                                     {"flops_per_token", fpt},
                                     {"model_gflops", gflops},
                                     {"peak_gflops", peak},
                                     {"mfu", gflops / peak},
                                     {"mfu_vs_square", gflops / square_peak}});
    std::fflush(stdout);
  }
  return 0;
}

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "loom-bench-train: %s\n", e.what());
    return 1;
  }
}
