// loom-bench-moe [--tokens 2048] [--model-dim 512] [--experts 16] [--k 2]
//                [--capacity-factor 1.25] [--hidden 0] [--layer-experts 16] [--reps 5]
//                [--layer 1] [--device cpu|cuda|all]
//
// The MoE core (plugins/moe/core, the code the `moe` plugin runs) on the host:
//  1. routing: gate (fixed-order fp32 logits, softmax, top-k, capacity, combine weights, aux
//     loss) + index dispatch (counting sort by expert, gather of the kept rows) + weighted
//     combine (the experts left out: the rows are combined as dispatched, as the peer
//     bench/peers/moe_peers.py does with DeepSpeed's one-hot einsum formulation), against a
//     memory roof measured in the same run with the same traffic: the bytes routing reads
//     and writes (x read by the gate, probs written, each kept row read and written by the
//     dispatch, read again by the combine, y written) moved by a copy of half as many bytes
//     (it reads and writes each), the best of memcpy and the router core's streaming copy
//     (loom::routers::stream_copy_bytes), on libloom's pool (every core) and on the calling
//     thread, sampled every repetition;
//  2. the whole layer, forward + backward (top-1 over --layer-experts experts of hidden width
//     H, dropless, so every token runs through exactly one expert MLP), against a dense MLP of
//     the same width H over the same tokens (the core's expert GEMMs with one expert): the
//     same FLOPs per token but the gate, dispatch and combine, so their ratio is the MoE
//     layer's overhead.
// Repetitions interleave everything; every figure is the best of R. One JSON object per line
// on stdout:
//  {"kind":"roof", "device", "threads", "bytes", "seconds", "gb_per_s"}
//  {"kind":"routing", "device", "tokens", "model_dim", "experts", "k", "capacity", "kept",
//   "seconds", "gate_seconds", "dispatch_seconds", "combine_seconds", "bytes", "gb_per_s",
//   "roof_gb_per_s", "ratio_to_roof", "move_bytes", "move_ratio_to_roof" (dispatch +
//   combine alone against the same roof: the gate computes E dot products per token, so the
//   whole is bound by arithmetic as much as by memory)}
//  {"kind":"layer", "device", "tokens", "model_dim", "hidden", "experts", "k", "moe_seconds",
//   "dense_seconds", "overhead", "phase_seconds" (host only: of the fastest repetition, forward
//   and backward together, {"gate", "dispatch", "exchange", "experts", "combine"}, each as
//   loom/moe/layer.hpp's PhaseTimes counts it)}
//  {"kind":"skip", "device":"cuda", "reason"} without a CUDA device or a CUDA build
// On --device cuda the same on the GPU: routing as the device layer runs it (probabilities on
// the device, the O(S k) bookkeeping of top-k, capacity and slots on the host by the host's
// functions, gather and combine on the device), each part ended by a stream synchronisation;
// the roof is cudaMemcpyAsync device to device of the same bytes, timed with events; the
// layer is the core's CUDA layer (cuBLAS) against one expert over every token.
// bytes counts reads plus writes, so gb_per_s compares with a copy's bandwidth as STREAM
// reports it. A summary goes to stderr.
#include <loom/embed.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <loom/sdk/parallel.hpp>
#include <loom_cli_support.hpp>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include <loom/moe/dispatch.hpp>
#include <loom/moe/exchange.hpp>
#include <loom/moe/experts.hpp>
#include <loom/moe/gating.hpp>
#include <loom/moe/layer.hpp>

#include "bench_support.hpp"

#if LOOM_HAVE_CUDA
#include <cuda_runtime.h>

#include <loom/moe/moe_cuda.hpp>
#endif

namespace {

using loom::bench::BenchError;
using loom::bench::Clock;
using loom::bench::copy_seconds;  // the roof: libloom's pool or this thread, 64 KiB blocks
using loom::bench::Json;
using loom::bench::since;

// 64-byte aligned host floats, every page written.
struct Floats {
  std::unique_ptr<float, void (*)(void*)> p{nullptr, std::free};
  std::size_t n = 0;
  explicit Floats(std::size_t count, float value = 0.0f) : n(count) {
    const std::size_t bytes = std::max<std::size_t>(64, (count * sizeof(float) + 63) / 64 * 64);
    p.reset(static_cast<float*>(std::aligned_alloc(64, bytes)));
    if (!p) throw BenchError("out of memory allocating " + std::to_string(bytes) + " bytes");
    std::fill(p.get(), p.get() + count, value);
  }
  float* get() const { return p.get(); }
};

// Uniform values of standard deviation `scale` from a 64-bit LCG (cheap enough for the GPU
// shape's expert weights, hundreds of millions of values).
void randomize(Floats& f, float scale, uint32_t seed) {
  uint64_t state = 0x9e3779b97f4a7c15ull * (seed + 1u);
  const float half_width = scale * 1.7320508f;  // sqrt(3): unit variance
  for (std::size_t i = 0; i < f.n; ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const auto u = static_cast<float>(state >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    f.get()[i] = half_width * (2.0f * u - 1.0f);
  }
}

struct Options {
  int64_t tokens = 2048, model_dim = 512, hidden = 0, reps = 5;
  int experts = 16, k = 2, layer_experts = 16;
  double capacity_factor = 1.25;
  bool layer = true;
};

// ------------------------------------------------------------------ routing
struct Routing {
  const Options& o;
  loom::moe::GateConfig cfg;
  Floats x, gate_w, probs, weights, rows, y;
  std::vector<int32_t> choice, route;
  std::vector<int64_t> load, counts, slot;
  int64_t kept = 0, capacity = 0;
  double gate_s = 0, dispatch_s = 0, combine_s = 0;

  explicit Routing(const Options& opt)
      : o(opt),
        x(static_cast<std::size_t>(opt.tokens * opt.model_dim)),
        gate_w(static_cast<std::size_t>(opt.experts * opt.model_dim)),
        probs(static_cast<std::size_t>(opt.tokens * opt.experts)),
        weights(static_cast<std::size_t>(opt.tokens * opt.k)),
        rows(static_cast<std::size_t>(opt.tokens * opt.k * opt.model_dim)),
        y(static_cast<std::size_t>(opt.tokens * opt.model_dim)),
        choice(static_cast<std::size_t>(opt.tokens * opt.k)),
        route(static_cast<std::size_t>(opt.tokens * opt.k)),
        load(static_cast<std::size_t>(opt.experts)),
        counts(static_cast<std::size_t>(opt.experts)),
        slot(static_cast<std::size_t>(opt.tokens * opt.k)) {
    cfg.num_experts = o.experts;
    cfg.k = o.k;
    cfg.training = true;
    cfg.drop_tokens = true;
    cfg.capacity_factor = o.capacity_factor;
    cfg.eval_capacity_factor = o.capacity_factor;
    cfg.min_capacity = 4;
    cfg.seed = 1;
    cfg.step = 1;
    randomize(x, 1.0f, 1);
    randomize(gate_w, 1.0f / std::sqrt(static_cast<float>(o.model_dim)), 2);
  }

  // One gate + dispatch + combine, each part timed.
  double run() {
    const auto t0 = Clock::now();
    loom::moe::RouteOut<float> ro;
    ro.probs = probs.get();
    ro.choice = choice.data();
    ro.route = route.data();
    ro.weights = weights.get();
    ro.load = load.data();
    loom::moe::route_tokens(cfg, x.get(), o.tokens, o.model_dim, gate_w.get(), nullptr, ro);
    const auto t1 = Clock::now();
    kept =
        loom::moe::build_slots(route.data(), o.tokens, o.k, o.experts, counts.data(), slot.data());
    loom::moe::gather_rows<float>(x.get(), o.tokens, o.model_dim, o.k, slot.data(), nullptr,
                                  rows.get());
    const auto t2 = Clock::now();
    loom::moe::combine_rows<float>(rows.get(), o.tokens, o.model_dim, o.k, slot.data(),
                                   weights.get(), y.get(), false);
    const auto t3 = Clock::now();
    capacity = ro.capacity;
    gate_s = std::chrono::duration<double>(t1 - t0).count();
    dispatch_s = std::chrono::duration<double>(t2 - t1).count();
    combine_s = std::chrono::duration<double>(t3 - t2).count();
    return std::chrono::duration<double>(t3 - t0).count();
  }
  // Reads + writes of one run (the fp32 rows and tokens; the int32/int64 index arrays, which
  // are S * k entries each, are left out).
  double bytes() const {
    const auto f = static_cast<double>(sizeof(float));
    const auto S = static_cast<double>(o.tokens), M = static_cast<double>(o.model_dim);
    const auto E = static_cast<double>(o.experts), K = static_cast<double>(kept);
    return f * (S * M + S * E + 3.0 * K * M + S * M);
  }
  // The dispatch's and the combine's share: each kept row read and written, read again, y
  // written (the gate's read of x and its probabilities left out).
  double move_bytes() const {
    const auto f = static_cast<double>(sizeof(float));
    const auto S = static_cast<double>(o.tokens), M = static_cast<double>(o.model_dim);
    return f * (3.0 * static_cast<double>(kept) * M + S * M);
  }
};

// ------------------------------------------------------------------ layer vs dense
struct Layer {
  const Options& o;
  int64_t H;
  loom::moe::LayerConfig cfg;
  Floats x, dy, y, dx, gate_w, w1, b1, w2, b2, g_gate, g1, gb1, g2, gb2;
  Floats saved_mem, work_mem;
  // the dense MLP's buffers (one expert over all tokens)
  Floats pre, h, dh, out;
  loom::moe::Exchange ex{nullptr, nullptr, 1};

  explicit Layer(const Options& opt)
      : o(opt),
        H(opt.hidden > 0 ? opt.hidden : 4 * opt.model_dim),
        x(n(opt.tokens * opt.model_dim)),
        dy(n(opt.tokens * opt.model_dim), 0.01f),
        y(n(opt.tokens * opt.model_dim)),
        dx(n(opt.tokens * opt.model_dim)),
        gate_w(n(opt.layer_experts * opt.model_dim)),
        w1(n(opt.layer_experts * H * opt.model_dim)),
        b1(n(opt.layer_experts * H)),
        w2(n(opt.layer_experts * opt.model_dim * H)),
        b2(n(opt.layer_experts * opt.model_dim)),
        g_gate(n(opt.layer_experts * opt.model_dim)),
        g1(n(opt.layer_experts * H * opt.model_dim)),
        gb1(n(opt.layer_experts * H)),
        g2(n(opt.layer_experts * opt.model_dim * H)),
        gb2(n(opt.layer_experts * opt.model_dim)),
        saved_mem(0),
        work_mem(0),
        pre(n(opt.tokens * H)),
        h(n(opt.tokens * H)),
        dh(n(opt.tokens * H)),
        out(n(opt.tokens * opt.model_dim)) {
    cfg.gate.num_experts = o.layer_experts;
    cfg.gate.k = 1;
    cfg.gate.training = true;
    cfg.gate.drop_tokens = false;
    cfg.gate.seed = 1;
    cfg.gate.step = 1;
    cfg.activation = loom::moe::Activation::Gelu;
    cfg.model_dim = o.model_dim;
    cfg.hidden_dim = H;
    cfg.max_tokens = o.tokens;
    cfg.local_experts = o.layer_experts;
    saved_mem = Floats(loom::moe::saved_bytes(cfg, 4) / sizeof(float) + 64);
    work_mem = Floats(loom::moe::workspace_bytes(cfg, 4) / sizeof(float) + 64);
    randomize(x, 1.0f, 3);
    randomize(gate_w, 1.0f / std::sqrt(static_cast<float>(o.model_dim)), 4);
    randomize(w1, 1.0f / std::sqrt(static_cast<float>(o.model_dim)), 5);
    randomize(w2, 1.0f / std::sqrt(static_cast<float>(H)), 6);
  }
  static std::size_t n(int64_t v) { return static_cast<std::size_t>(v); }
  static void* aligned(const Floats& f) {
    const auto a = reinterpret_cast<uintptr_t>(f.get());
    return reinterpret_cast<void*>((a + 255) / 256 * 256);
  }

  double moe() {
    loom::moe::LayerWeights<float> w;
    w.gate_w = gate_w.get();
    w.experts = {w1.get(), b1.get(), w2.get(), b2.get()};
    loom::moe::ForwardCall<float> fc;
    fc.tokens = o.tokens;
    fc.x = x.get();
    fc.w = w;
    fc.y = y.get();
    fc.saved = aligned(saved_mem);
    fc.saved_bytes = loom::moe::saved_bytes(cfg, 4);
    fc.workspace = aligned(work_mem);
    fc.workspace_bytes = loom::moe::workspace_bytes(cfg, 4);
    loom::moe::BackwardCall<float> bc;
    bc.tokens = o.tokens;
    bc.x = x.get();
    bc.w = w;
    bc.dy = dy.get();
    bc.dx = dx.get();
    bc.g.gate_w = g_gate.get();
    bc.g.experts = {g1.get(), gb1.get(), g2.get(), gb2.get()};
    bc.aux_loss_coef = 0.01;
    bc.saved = fc.saved;
    bc.saved_bytes = fc.saved_bytes;
    bc.workspace = fc.workspace;
    bc.workspace_bytes = fc.workspace_bytes;
    loom::moe::LayerStats stats;
    loom::moe::PhaseTimes times;
    fc.times = &times;
    bc.times = &times;
    const auto t0 = Clock::now();
    loom::moe::layer_forward(cfg, ex, fc, stats);
    loom::moe::layer_backward(cfg, ex, bc);
    const double s = since(t0);
    last_phases = times;
    return s;
  }
  loom::moe::PhaseTimes last_phases;  // of the latest moe(), forward and backward together
  // One expert's MLP (the first's weights) over every token: the dense layer.
  double dense() {
    const int64_t S = o.tokens;
    const loom::moe::ExpertWeights<float> w{w1.get(), b1.get(), w2.get(), b2.get()};
    const loom::moe::ExpertGrads<float> g{g1.get(), gb1.get(), g2.get(), gb2.get()};
    const auto t0 = Clock::now();
    loom::moe::experts_forward<float>(cfg.activation, 1, &S, o.model_dim, H, x.get(), w, pre.get(),
                                      h.get(), out.get());
    loom::moe::experts_backward<float>(cfg.activation, 1, &S, o.model_dim, H, x.get(), pre.get(),
                                       dy.get(), w, g, h.get(), dh.get(), dx.get());
    return since(t0);
  }
};

double ms(uint64_t ns) { return static_cast<double>(ns) * 1e-6; }

// The layer's phase times (loom/moe/layer.hpp PhaseTimes), forward and backward together.
Json phase_json(const loom::moe::PhaseTimes& t) {
  return {{"gate", static_cast<double>(t.gate_ns) * 1e-9},
          {"dispatch", static_cast<double>(t.dispatch_ns) * 1e-9},
          {"exchange", static_cast<double>(t.exchange_ns) * 1e-9},
          {"experts", static_cast<double>(t.experts_ns) * 1e-9},
          {"combine", static_cast<double>(t.combine_ns) * 1e-9}};
}

void run_cpu(const Options& o) {
  Routing r(o);
  std::unique_ptr<Layer> layer = o.layer ? std::make_unique<Layer>(o) : nullptr;
  r.run();  // warm: first touch, the pool's threads
  const std::size_t copy_bytes = static_cast<std::size_t>(r.bytes() / 2.0);
  Floats src(copy_bytes / sizeof(float) + 16, 1.0f), dst(copy_bytes / sizeof(float) + 16, 0.0f);
  auto* s = reinterpret_cast<char*>(src.get());
  auto* d = reinterpret_cast<char*>(dst.get());
  double best = 1e30, gate = 1e30, disp = 1e30, comb = 1e30, roof = 1e30, moe = 1e30, dense = 1e30;
  loom::moe::PhaseTimes phases;  // of the fastest layer repetition
  if (layer) {
    layer->moe();
    layer->dense();
  }
  for (int64_t rep = 0; rep < o.reps; ++rep) {
    for (bool pool : {true, false}) {
      for (bool streaming : {true, false}) {
        roof = std::min(roof, copy_seconds(d, s, copy_bytes, pool, streaming));
      }
    }
    best = std::min(best, r.run());
    gate = std::min(gate, r.gate_s);
    disp = std::min(disp, r.dispatch_s);
    comb = std::min(comb, r.combine_s);
    if (layer) {
      const double m = layer->moe();
      if (m < moe) {
        moe = m;
        phases = layer->last_phases;
      }
      dense = std::min(dense, layer->dense());
    }
  }
  const double bytes = r.bytes();
  const double roof_gbs = 2.0 * static_cast<double>(copy_bytes) / roof / 1e9;
  Json jr{{"kind", "roof"},
          {"device", "cpu"},
          {"threads", loom_thread_count()},
          {"bytes", 2.0 * static_cast<double>(copy_bytes)},
          {"seconds", roof},
          {"gb_per_s", roof_gbs}};
  loom::bench::emit(jr);
  Json j{{"kind", "routing"},
         {"device", "cpu"},
         {"tokens", o.tokens},
         {"model_dim", o.model_dim},
         {"experts", o.experts},
         {"k", o.k},
         {"capacity", r.capacity},
         {"kept", r.kept},
         {"seconds", best},
         {"gate_seconds", gate},
         {"dispatch_seconds", disp},
         {"combine_seconds", comb},
         {"bytes", bytes},
         {"gb_per_s", bytes / best / 1e9},
         {"roof_gb_per_s", roof_gbs},
         {"ratio_to_roof", bytes / best / 1e9 / roof_gbs},
         {"move_bytes", r.move_bytes()},
         {"move_ratio_to_roof", r.move_bytes() / (disp + comb) / 1e9 / roof_gbs}};
  loom::bench::emit(j);
  std::fprintf(stderr,
               "routing S=%lld M=%lld E=%d k=%d C=%lld: %.3f ms (gate %.3f, dispatch %.3f, "
               "combine %.3f); %.1f GB/s, roof %.1f GB/s, ratio %.2f (dispatch + combine "
               "alone %.2f)\n",
               static_cast<long long>(o.tokens), static_cast<long long>(o.model_dim), o.experts,
               o.k, static_cast<long long>(r.capacity), best * 1e3, gate * 1e3, disp * 1e3,
               comb * 1e3, bytes / best / 1e9, roof_gbs, bytes / best / 1e9 / roof_gbs,
               r.move_bytes() / (disp + comb) / 1e9 / roof_gbs);
  if (layer) {
    Json jl{{"kind", "layer"},
            {"device", "cpu"},
            {"tokens", o.tokens},
            {"model_dim", o.model_dim},
            {"hidden", layer->H},
            {"experts", o.layer_experts},
            {"k", 1},
            {"moe_seconds", moe},
            {"dense_seconds", dense},
            {"overhead", moe / dense - 1.0},
            {"phase_seconds", phase_json(phases)}};
    loom::bench::emit(jl);
    std::fprintf(stderr,
                 "layer fwd+bwd S=%lld M=%lld H=%lld, top-1 of %d experts: %.1f ms, dense MLP "
                 "%.1f ms, overhead %.1f%%\n  phases (ms): gate %.2f, dispatch %.2f, exchange "
                 "%.2f, experts %.2f, combine %.2f\n",
                 static_cast<long long>(o.tokens), static_cast<long long>(o.model_dim),
                 static_cast<long long>(layer->H), o.layer_experts, moe * 1e3, dense * 1e3,
                 (moe / dense - 1.0) * 100.0, ms(phases.gate_ns), ms(phases.dispatch_ns),
                 ms(phases.exchange_ns), ms(phases.experts_ns), ms(phases.combine_ns));
  }
  std::fflush(stdout);
}

// ------------------------------------------------------------------ CUDA run
#if LOOM_HAVE_CUDA
#define LOOM_CUDA_OK(call)                                                  \
  do {                                                                      \
    const cudaError_t e_ = (call);                                          \
    if (e_ != cudaSuccess) {                                                \
      throw BenchError(std::string(#call) + ": " + cudaGetErrorString(e_)); \
    }                                                                       \
  } while (0)

// Device memory, freed on scope exit.
struct DevMem {
  void* p = nullptr;
  explicit DevMem(std::size_t bytes) {
    LOOM_CUDA_OK(cudaMalloc(&p, std::max<std::size_t>(bytes, 256)));
    LOOM_CUDA_OK(cudaMemset(p, 0, std::max<std::size_t>(bytes, 256)));
  }
  ~DevMem() { cudaFree(p); }
  DevMem(DevMem&& o) noexcept : p(o.p) { o.p = nullptr; }
  DevMem(const DevMem&) = delete;
  DevMem& operator=(const DevMem&) = delete;
  DevMem& operator=(DevMem&&) = delete;
  float* f() const { return static_cast<float*>(p); }
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

DevMem upload(const Floats& h) {
  DevMem d(h.n * sizeof(float));
  LOOM_CUDA_OK(cudaMemcpy(d.p, h.get(), h.n * sizeof(float), cudaMemcpyHostToDevice));
  return d;
}

void run_cuda(const Options& o) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();
    std::printf("{\"kind\":\"skip\",\"device\":\"cuda\",\"reason\":\"no CUDA device\"}\n");
    std::fflush(stdout);
    return;
  }
  LOOM_CUDA_OK(cudaSetDevice(0));
  cudaStream_t stream = nullptr;
  LOOM_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto sync = [&] { LOOM_CUDA_OK(cudaStreamSynchronize(stream)); };
  loom::moe::cuda::Blas blas;
  const loom::moe::cuda::Device dev{0, stream, &blas};
  const int64_t S = o.tokens, M = o.model_dim;
  const int E = o.experts, k = o.k;
  // Routing as the device layer runs it: the probabilities, the top-k, capacity, weights and
  // slots on the device (route_on_device waits for them and brings back the O(E) counts), the
  // rows gathered and combined on the device.
  Routing host(o);
  const DevMem x = upload(host.x), gate_w = upload(host.gate_w);
  DevMem probs(static_cast<std::size_t>(S * E) * 4), rows(static_cast<std::size_t>(S * k * M) * 4),
      y(static_cast<std::size_t>(S * M) * 4), weights(static_cast<std::size_t>(S * k) * 4),
      slot(static_cast<std::size_t>(S * k) * 8), choice(static_cast<std::size_t>(S * k) * 4),
      route(static_cast<std::size_t>(S * k) * 4),
      scratch(static_cast<std::size_t>(loom::moe::cuda::route_scratch_words(E, k, S)) * 8);
  loom::moe::cuda::RouteSummary summary;
  int64_t kept = 0, capacity = 0;
  double gate_s = 0, dispatch_s = 0, combine_s = 0;
  auto routing = [&] {
    const auto t0 = Clock::now();
    loom::moe::cuda::gate_probs(host.cfg, x.f(), S, M, gate_w.f(), probs.f(), stream);
    capacity = loom::moe::expert_capacity(host.cfg, S);
    loom::moe::cuda::route_on_device(
        host.cfg, probs.f(), S, nullptr, capacity,
        {choice.as<int32_t>(), route.as<int32_t>(), weights.f(), slot.as<int64_t>()},
        scratch.as<int64_t>(), summary, stream);
    kept = summary.send_rows;
    const auto t1 = Clock::now();
    loom::moe::cuda::gather_rows(x.f(), S, M, k, slot.as<int64_t>(), nullptr, rows.f(), stream);
    sync();
    const auto t2 = Clock::now();
    loom::moe::cuda::combine_rows(rows.f(), S, M, k, slot.as<int64_t>(), weights.f(), y.f(), false,
                                  stream);
    sync();
    const auto t3 = Clock::now();
    gate_s = std::chrono::duration<double>(t1 - t0).count();
    dispatch_s = std::chrono::duration<double>(t2 - t1).count();
    combine_s = std::chrono::duration<double>(t3 - t2).count();
    return std::chrono::duration<double>(t3 - t0).count();
  };
  routing();  // warm
  host.kept = kept;
  const double bytes = host.bytes();
  const auto copy_bytes = static_cast<std::size_t>(bytes / 2.0);
  DevMem a(copy_bytes), b(copy_bytes);
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  LOOM_CUDA_OK(cudaEventCreate(&e0));
  LOOM_CUDA_OK(cudaEventCreate(&e1));
  auto roof_once = [&] {
    LOOM_CUDA_OK(cudaEventRecord(e0, stream));
    LOOM_CUDA_OK(cudaMemcpyAsync(b.p, a.p, copy_bytes, cudaMemcpyDeviceToDevice, stream));
    LOOM_CUDA_OK(cudaEventRecord(e1, stream));
    LOOM_CUDA_OK(cudaEventSynchronize(e1));
    float ms = 0;
    LOOM_CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
    return static_cast<double>(ms) / 1e3;
  };
  roof_once();
  // The layer: top-1 of layer_experts, dropless, against one expert over every token.
  std::unique_ptr<Layer> hl = o.layer ? std::make_unique<Layer>(o) : nullptr;
  std::vector<std::unique_ptr<DevMem>> keep;
  auto dev_of = [&](const Floats& f) {
    keep.push_back(std::make_unique<DevMem>(f.n * sizeof(float)));
    LOOM_CUDA_OK(cudaMemcpy(keep.back()->p, f.get(), f.n * sizeof(float), cudaMemcpyHostToDevice));
    return keep.back()->f();
  };
  double moe = 1e30, dense = 1e30;
  std::function<double()> moe_once, dense_once;
  if (hl) {
    Layer& L = *hl;
    loom::moe::LayerWeights<float> w;
    w.gate_w = dev_of(L.gate_w);
    w.experts = {dev_of(L.w1), dev_of(L.b1), dev_of(L.w2), dev_of(L.b2)};
    float* dx_ = dev_of(L.dx);
    float* dy_ = dev_of(L.dy);
    float* x_ = dev_of(L.x);
    float* y_ = dev_of(L.y);
    loom::moe::LayerGrads<float> g;
    g.gate_w = dev_of(L.g_gate);
    g.experts = {dev_of(L.g1), dev_of(L.gb1), dev_of(L.g2), dev_of(L.gb2)};
    const uint64_t sb = loom::moe::saved_bytes(L.cfg, 4), wb = loom::moe::workspace_bytes(L.cfg, 4);
    keep.push_back(std::make_unique<DevMem>(sb));
    void* saved = keep.back()->p;
    keep.push_back(std::make_unique<DevMem>(wb));
    void* work = keep.back()->p;
    float* pre = dev_of(L.pre);
    float* hh = dev_of(L.h);
    float* dh = dev_of(L.dh);
    float* out = dev_of(L.out);
    moe_once = [&L, &dev, w, g, x_, y_, dy_, dx_, saved, work, sb, wb, sync] {
      loom::moe::ForwardCall<float> fc;
      fc.tokens = L.o.tokens;
      fc.x = x_;
      fc.w = w;
      fc.y = y_;
      fc.saved = saved;
      fc.saved_bytes = sb;
      fc.workspace = work;
      fc.workspace_bytes = wb;
      loom::moe::BackwardCall<float> bc;
      bc.tokens = L.o.tokens;
      bc.x = x_;
      bc.w = w;
      bc.dy = dy_;
      bc.dx = dx_;
      bc.g = g;
      bc.aux_loss_coef = 0.01;
      bc.saved = saved;
      bc.saved_bytes = sb;
      bc.workspace = work;
      bc.workspace_bytes = wb;
      loom::moe::LayerStats stats;
      const auto t0 = Clock::now();
      loom::moe::cuda::layer_forward(L.cfg, L.ex, fc, stats, dev);
      loom::moe::cuda::layer_backward(L.cfg, L.ex, bc, dev);
      sync();
      return since(t0);
    };
    dense_once = [&L, &dev, w, g, x_, dy_, dx_, pre, hh, dh, out, sync] {
      const int64_t n = L.o.tokens;
      const loom::moe::ExpertWeights<float> w1 = w.experts;
      const loom::moe::ExpertGrads<float> g1 = g.experts;
      const auto t0 = Clock::now();
      loom::moe::cuda::experts_forward(L.cfg.activation, 1, &n, L.o.model_dim, L.H, x_, w1, pre, hh,
                                       out, dev);
      loom::moe::cuda::experts_backward(L.cfg.activation, 1, &n, L.o.model_dim, L.H, x_, pre, dy_,
                                        w1, g1, hh, dh, dx_, dev);
      sync();
      return since(t0);
    };
    moe_once();
    dense_once();
  }
  double best = 1e30, gate = 1e30, disp = 1e30, comb = 1e30, roof = 1e30;
  for (int64_t rep = 0; rep < o.reps; ++rep) {
    roof = std::min(roof, roof_once());
    best = std::min(best, routing());
    gate = std::min(gate, gate_s);
    disp = std::min(disp, dispatch_s);
    comb = std::min(comb, combine_s);
    if (hl) {
      moe = std::min(moe, moe_once());
      dense = std::min(dense, dense_once());
    }
  }
  const double roof_gbs = 2.0 * static_cast<double>(copy_bytes) / roof / 1e9;
  const double move_bytes = host.move_bytes();
  Json jr{{"kind", "roof"},
          {"device", "cuda"},
          {"copy", "cudaMemcpyAsync device to device"},
          {"bytes", 2.0 * static_cast<double>(copy_bytes)},
          {"seconds", roof},
          {"gb_per_s", roof_gbs}};
  loom::bench::emit(jr);
  Json j{{"kind", "routing"},
         {"device", "cuda"},
         {"tokens", S},
         {"model_dim", M},
         {"experts", E},
         {"k", k},
         {"capacity", capacity},
         {"kept", kept},
         {"seconds", best},
         {"gate_seconds", gate},
         {"dispatch_seconds", disp},
         {"combine_seconds", comb},
         {"bytes", bytes},
         {"gb_per_s", bytes / best / 1e9},
         {"roof_gb_per_s", roof_gbs},
         {"ratio_to_roof", bytes / best / 1e9 / roof_gbs},
         {"move_bytes", move_bytes},
         {"move_ratio_to_roof", move_bytes / (disp + comb) / 1e9 / roof_gbs}};
  loom::bench::emit(j);
  std::fprintf(stderr,
               "cuda routing S=%lld M=%lld E=%d k=%d C=%lld: %.3f ms (gate + host bookkeeping "
               "%.3f, dispatch %.3f, combine %.3f); roof %.1f GB/s, ratio %.2f (dispatch + "
               "combine alone %.2f)\n",
               static_cast<long long>(S), static_cast<long long>(M), E, k,
               static_cast<long long>(capacity), best * 1e3, gate * 1e3, disp * 1e3, comb * 1e3,
               roof_gbs, bytes / best / 1e9 / roof_gbs,
               move_bytes / (disp + comb) / 1e9 / roof_gbs);
  if (hl) {
    Json jl{{"kind", "layer"},
            {"device", "cuda"},
            {"tokens", S},
            {"model_dim", M},
            {"hidden", hl->H},
            {"experts", o.layer_experts},
            {"k", 1},
            {"moe_seconds", moe},
            {"dense_seconds", dense},
            {"overhead", moe / dense - 1.0}};
    loom::bench::emit(jl);
    std::fprintf(stderr, "cuda layer fwd+bwd: MoE %.3f ms, dense %.3f ms, overhead %.1f%%\n",
                 moe * 1e3, dense * 1e3, (moe / dense - 1.0) * 100.0);
  }
  std::fflush(stdout);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  keep.clear();
  cudaStreamDestroy(stream);
}
#endif

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "The MoE core's gate + dispatch + combine against a memory roof measured in the same run, "
      "and the whole MoE layer against a dense MLP with the same FLOPs per token"};
  loom_cli::configure(app, "loom bench moe");
  Options o;
  std::string device = "cpu";
  bool no_layer = false;
  app.add_option("--tokens", o.tokens, "Tokens per call (S)")
      ->check(loom_cli::integer_in(1, 1 << 24))
      ->type_name("S");
  app.add_option("--model-dim", o.model_dim, "Features per token (M)")
      ->check(loom_cli::integer_in(1, 1 << 16))
      ->type_name("M");
  app.add_option("--experts", o.experts, "Experts of the routing benchmark (E)")
      ->check(loom_cli::integer_in(1, 4096))
      ->type_name("E");
  app.add_option("--k", o.k, "Experts per token of the routing benchmark")
      ->check(loom_cli::integer_in(1, 64))
      ->type_name("K");
  app.add_option("--capacity-factor", o.capacity_factor, "Capacity factor of the routing")
      ->check(loom_cli::number_in(1e-6, 1e6, false))
      ->type_name("F");
  app.add_option("--hidden", o.hidden, "Hidden width H of the layer benchmark (0: 4 M)")
      ->check(loom_cli::integer_in(0, 1 << 20))
      ->type_name("H");
  app.add_option("--layer-experts", o.layer_experts, "Experts of the layer benchmark (top-1)")
      ->check(loom_cli::integer_in(1, 4096))
      ->type_name("E");
  app.add_flag("--no-layer", no_layer, "Leave out the layer against dense benchmark");
  app.add_option("--reps", o.reps, "Repetitions; the best is reported")
      ->check(loom_cli::integer_in(1, 1000))
      ->type_name("R");
  app.add_option("--device", device, "cpu, cuda or all")
      ->check(CLI::IsMember({"cpu", "cuda", "all"}))
      ->type_name("D");
  if (const int rc = loom_cli::parse(app, argc, argv, false); rc >= 0) return rc;
  o.layer = !no_layer;
  if (o.k > o.experts) {
    std::fprintf(stderr, "loom bench moe: --k %d is more than --experts %d\n", o.k, o.experts);
    return 2;
  }
  try {
    const loom::bench::LibloomPool pool("loom bench moe");
    if (device == "cpu" || device == "all") run_cpu(o);
    if (device == "cuda" || device == "all") {
#if LOOM_HAVE_CUDA
      run_cuda(o);
#else
      std::printf(
          "{\"kind\":\"skip\",\"device\":\"cuda\",\"reason\":\"built without the MoE core's "
          "CUDA path (LOOM_CUDA off, or no cuBLAS)\"}\n");
#endif
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "loom bench moe: error: %s\n", e.what());
    return 2;
  }
  return 0;
}
