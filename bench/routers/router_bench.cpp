// loom-bench-router [--batch B] [--seq-lens 2048,32768] [--channels 512,1024] [--keep F]
//                   [--dtypes fp32,bf16] [--reps R] [--device cpu|cuda|all] [--layer-max-seq L]
//                   [--plugin-path DIRS]
//
// The token routers' row moves (loom::routers::gather and scatter of plugins/routers/core, the
// code every router's gather/scatter runs) at trainer-like and long shapes, against a memory
// roof measured in the same run with the same traffic: a contiguous copy of the moved bytes
// (gather reads kept rows of full and writes kept; scatter the reverse; the roof copies the
// same number of bytes between the same two buffers), the best of plain memcpy and a
// non-temporal 16-byte-store copy (the stores gather and scatter use for large moves), in both
// directions, on every core of the process (fresh threads, and libloom's pool that the moves
// run on) and on the calling thread alone (which wins for small moves, as the pool then runs
// them inline), sampled twice per repetition. Also random_ltd's select through the host (the
// trainer's path) and, at shapes up to --layer-max-seq, the routing's share of a routed
// layer: select + gather(x) + scatter(y) + gather(dy) + scatter(dx) against the trainer's
// Block forward + backward on the kept tokens (fp32, NH = C / 64). Repetitions interleave
// all of them; every figure is the best of R. One JSON object per line on stdout:
//  {"kind":"roof", "device", "threads", "dtype", "batch", "seq_len", "kept", "channels",
//   "bytes", "seconds", "gb_per_s"}
//  {"kind":"move", "op" (gather|scatter), same shape keys, "bytes", "seconds", "gb_per_s",
//   "roof_gb_per_s", "ratio_to_roof", "pool_threads"}
//  {"kind":"select", "router":"random_ltd", shape keys, "seconds", "positions_per_s"}
//  {"kind":"layer", shape keys, "block_seconds", "routing_seconds", "routing_share",
//   "select_seconds", "gather_seconds", "scatter_seconds"}
//  {"kind":"skip", "device":"cuda", "reason"} without a CUDA device (or a CUDA build)
// bytes is what one move reads (= what it writes); gb_per_s counts reads plus writes, so it
// compares with a copy's bandwidth as STREAM reports it. A side-by-side table goes to stderr.
#include <loom/embed.h>
#include <loom/kinds/router.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <loom/sdk/parallel.hpp>
#include <loom/sdk/router.hpp>
#include <loom_cli_support.hpp>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <loom/routers/router_core.hpp>

#include "bench_support.hpp"

#if defined(__x86_64__) || defined(__SSE2__)
#define LOOM_BENCH_STREAM 1
#else
#define LOOM_BENCH_STREAM 0
#endif
#if LOOM_ROUTER_BENCH_LAYER
#include "gpt.hpp"
#endif
#if LOOM_BENCH_CUDA
#include <cuda_runtime.h>
#endif

namespace {

using loom::bench::BenchError;
using loom::bench::Clock;
using loom::bench::Json;
using loom::bench::since;

unsigned process_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    return static_cast<unsigned>(std::max(1, CPU_COUNT(&set)));
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

// ------------------------------------------------------------------ the roof
#if LOOM_BENCH_STREAM
// The roof's streaming copy is the core's own (the same stores the moves use).
void stream_copy(char* dst, const char* src, std::size_t bytes) {
  loom::routers::stream_copy_bytes(dst, src, bytes);
}
#endif

// Copies `bytes` from src to dst on `threads` threads, each its contiguous share (64-byte
// aligned cuts), with memcpy or the streaming copy. Each thread times itself from a shared
// start; the time is the first start to the last end, so thread start-up is not part of it.
double copy_seconds(char* dst, const char* src, std::size_t bytes, unsigned threads,
                    bool streaming) {
  if (threads == 1) {  // on the calling thread, as the pool runs a small move
    const auto t0 = Clock::now();
#if LOOM_BENCH_STREAM
    if (streaming && (reinterpret_cast<uintptr_t>(dst) & 15u) == 0) {
      stream_copy(dst, src, bytes);
    } else {
      std::memcpy(dst, src, bytes);
    }
#else
    std::memcpy(dst, src, bytes);
#endif
    return since(t0);
  }
  std::barrier start(static_cast<std::ptrdiff_t>(threads));
  std::vector<Clock::time_point> begin(threads), end(threads);
  std::vector<std::thread> pool;
  const std::size_t lines = bytes / 64;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      const std::size_t lo = lines * t / threads * 64;
      const std::size_t hi = t + 1 == threads ? bytes : lines * (t + 1) / threads * 64;
      start.arrive_and_wait();
      begin[t] = Clock::now();
#if LOOM_BENCH_STREAM
      if (streaming && (reinterpret_cast<uintptr_t>(dst + lo) & 15u) == 0) {
        stream_copy(dst + lo, src + lo, hi - lo);
      } else {
        std::memcpy(dst + lo, src + lo, hi - lo);
      }
#else
      (void)streaming;
      std::memcpy(dst + lo, src + lo, hi - lo);
#endif
      end[t] = Clock::now();
    });
  }
  for (auto& p : pool) p.join();
  return std::chrono::duration<double>(*std::max_element(end.begin(), end.end()) -
                                       *std::min_element(begin.begin(), begin.end()))
      .count();
}

// ------------------------------------------------------------------ tensors
struct Dtype {
  std::string name;
  DLDataType dl;
  std::size_t bytes;
};

Dtype dtype_of(const std::string& s) {
  if (s == "fp32") return {s, DLDataType{kDLFloat, 32, 1}, 4};
  if (s == "bf16") return {s, DLDataType{kDLBfloat, 16, 1}, 2};
  if (s == "fp16") return {s, DLDataType{kDLFloat, 16, 1}, 2};
  throw BenchError("--dtypes: '" + s + "' is not one of fp32, bf16, fp16");
}

// A DLTensor over caller memory (contiguous).
struct View {
  std::vector<int64_t> shape;
  DLTensor t{};
  View(void* data, std::vector<int64_t> s, DLDataType dt, DLDevice dev) : shape(std::move(s)) {
    t.data = data;
    t.device = dev;
    t.ndim = static_cast<int32_t>(shape.size());
    t.dtype = dt;
    t.shape = shape.data();
    t.strides = nullptr;
    t.byte_offset = 0;
  }
  View(const View&) = delete;
  View& operator=(const View&) = delete;
};

// 64-byte aligned host buffer, every page written (so the first timed pass does not fault).
struct HostBuffer {
  std::unique_ptr<char, void (*)(void*)> p{nullptr, std::free};
  std::size_t bytes = 0;
  explicit HostBuffer(std::size_t n) : bytes(n) {
    const std::size_t rounded = (n + 63) / 64 * 64;
    p.reset(static_cast<char*>(std::aligned_alloc(64, std::max<std::size_t>(64, rounded))));
    if (!p) throw BenchError("out of memory allocating " + std::to_string(n) + " bytes");
    std::memset(p.get(), 1, n);
  }
  char* get() const { return p.get(); }
};

// ------------------------------------------------------------------ the router (select)
struct RouterInstance {
  std::unique_ptr<loom_session, void (*)(loom_session*)> session{nullptr, loom_close};
  loom_instance* inst = nullptr;
  void* obj = nullptr;
  const loom_router_v1* t = nullptr;

  void check(loom_status* st, const char* what) const {
    if (st == nullptr) return;
    char msg[1024] = {};
    loom_instance_take_status(inst, st, msg, sizeof msg);
    throw BenchError(std::string("random_ltd ") + what + ": " + msg);
  }
};

// random_ltd keeping `kept` of every sequence from step 1 on (min_value = max_value = kept,
// routed layer 1 of 3), opened through the host as the trainer opens it.
RouterInstance open_ltd(int64_t kept, const std::string& plugin_path) {
  RouterInstance r;
  const std::string toml =
      "[router.ltd]\nplugin = \"random_ltd\"\nmin_value = " + std::to_string(kept) +
      "\nmax_value = " + std::to_string(kept) +
      "\nschedule_type = \"fixed_linear\"\nrequire_steps = 1\n"
      "seq_per_step = 1\nlayers = [1]\n";
  loom_open_options o{};
  o.struct_size = LOOM_OPEN_OPTIONS_SIZE;
  o.log_level = -1;
  o.plugin_path = plugin_path.empty() ? nullptr : plugin_path.c_str();
  loom_session* s = nullptr;
  if (loom_open_string(toml.c_str(), "<bench router>", &o, &s) != 0) {
    throw BenchError(std::string("opening random_ltd: ") + loom_last_error());
  }
  r.session.reset(s);
  if (loom_find_instance(s, LOOM_KIND_ROUTER, "ltd", &r.inst) != 0) {
    throw BenchError(std::string("random_ltd: ") + loom_last_error());
  }
  const void* table = nullptr;
  if (loom_instance_table(r.inst, LOOM_KIND_ROUTER, LOOM_ROUTER_V1_MIN_SIZE, &r.obj, &table) != 0) {
    throw BenchError(std::string("random_ltd table: ") + loom_last_error());
  }
  r.t = static_cast<const loom_router_v1*>(table);
  return r;
}

struct Shape {
  int64_t B, S, K, C;
  Dtype dt;
  std::size_t moved() const { return static_cast<std::size_t>(B * K * C) * dt.bytes; }
  std::size_t full_bytes() const { return static_cast<std::size_t>(B * S * C) * dt.bytes; }
};

Json shape_json(const char* kind, const char* device, const Shape& s) {
  Json j;
  j["kind"] = kind;
  j["device"] = device;
  j["dtype"] = s.dt.name;
  j["batch"] = s.B;
  j["seq_len"] = s.S;
  j["kept"] = s.K;
  j["channels"] = s.C;
  return j;
}

struct Row {  // one line of the stderr table
  std::string device, dtype;
  int64_t B, S, K, C;
  double roof, gather, scatter, select, share;
};

void print_table(const std::vector<Row>& rows) {
  std::fprintf(stderr, "\n%-5s %-5s %3s %6s %6s %5s | %8s %8s %6s %8s %6s | %9s %7s\n", "dev",
               "dtype", "B", "S", "K", "C", "roof", "gather", "ratio", "scatter", "ratio",
               "select_ms", "share");
  for (const Row& r : rows) {
    char share[32] = "-";
    if (r.share >= 0) std::snprintf(share, sizeof share, "%.3f", r.share);
    std::fprintf(
        stderr, "%-5s %-5s %3lld %6lld %6lld %5lld | %8.1f %8.1f %6.2f %8.1f %6.2f | %9.3f %7s\n",
        r.device.c_str(), r.dtype.c_str(), static_cast<long long>(r.B), static_cast<long long>(r.S),
        static_cast<long long>(r.K), static_cast<long long>(r.C), r.roof, r.gather,
        r.gather / r.roof, r.scatter, r.scatter / r.roof, r.select * 1e3, share);
  }
  std::fprintf(stderr, "(GB/s of reads + writes; ratio = the move's bandwidth / the roof's)\n");
}

#if LOOM_ROUTER_BENCH_LAYER
// The trainer's Block at [B, K, C] (fp32, NH = C / 64, the dense MLP), forward + backward.
class LayerBench {
 public:
  LayerBench(int C, int B, int K) : B_(B), K_(K) {
    namespace tr = loom::trainer;
    auto param = [&](const char* name, std::vector<int64_t> shape, float scale) {
      std::size_t n = 1;
      for (int64_t d : shape) n *= static_cast<std::size_t>(d);
      store_.emplace_back(n);
      grads_.emplace_back(n, 0.0f);
      std::mt19937 rng(static_cast<uint32_t>(store_.size()));
      std::normal_distribution<float> nd(0.0f, 1.0f);
      for (float& v : store_.back()) v = scale == 1.0f ? 1.0f : scale * nd(rng);
      return tr::ParamRef<float>{name, std::move(shape), store_.back().data(), grads_.back().data(),
                                 n};
    };
    store_.reserve(16);
    grads_.reserve(16);
    const int64_t c = C;
    tr::BlockParams<float> p{param("ln1_w", {c}, 1.0f),         param("ln1_b", {c}, 0.0f),
                             param("qkv_w", {3 * c, c}, 0.02f), param("qkv_b", {3 * c}, 0.0f),
                             param("proj_w", {c, c}, 0.02f),    param("proj_b", {c}, 0.0f),
                             param("ln2_w", {c}, 1.0f),         param("ln2_b", {c}, 0.0f)};
    auto mlp = std::make_unique<tr::DenseMlp<float>>(
        C, param("fc_w", {4 * c, c}, 0.02f), param("fc_b", {4 * c}, 0.0f),
        param("mproj_w", {c, 4 * c}, 0.02f), param("mproj_b", {c}, 0.0f));
    block_ =
        std::make_unique<tr::Block<float>>(C, std::max(1, C / 64), std::move(p), std::move(mlp));
    const std::size_t n =
        static_cast<std::size_t>(B) * static_cast<std::size_t>(K) * static_cast<std::size_t>(C);
    x_.assign(n, 0.0f);
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (float& v : x_) v = nd(rng);
    y_.assign(n, 0.0f);
    dy_.assign(n, 0.01f);
    dx_.assign(n, 0.0f);
  }
  double seconds() {
    const auto t0 = Clock::now();
    block_->forward(x_.data(), y_.data(), B_, K_);
    block_->backward(dy_.data(), dx_.data(), B_, K_, scratch_);
    return since(t0);
  }

 private:
  int B_, K_;
  std::vector<std::vector<float>> store_, grads_;
  std::unique_ptr<loom::trainer::Block<float>> block_;
  loom::trainer::BlockScratch<float> scratch_;
  std::vector<float> x_, y_, dy_, dx_;
};
#endif

// ------------------------------------------------------------------ host run
void run_cpu(const std::vector<Shape>& shapes, int64_t reps, int64_t layer_max_seq,
             const std::string& plugin_path, std::vector<Row>& table) {
  const unsigned cores = process_cores();
  const DLDevice cpu{kDLCPU, 0};
  for (const Shape& s : shapes) {
    HostBuffer full(s.full_bytes()), kept(s.moved());
    std::vector<int32_t> idx(static_cast<std::size_t>(s.B * s.K));
    RouterInstance r = open_ltd(s.K, plugin_path);
    loom_router_plan_args plan{};
    plan.struct_size = LOOM_ROUTER_PLAN_ARGS_SIZE;
    plan.batch = s.B;
    plan.seq_len = s.S;
    plan.channels = s.C;
    plan.step = 1;
    plan.layer = 1;
    plan.num_layers = 3;
    plan.training = 1;
    plan.dtype = s.dt.dl;
    r.check(r.t->plan(r.obj, &plan), "plan");
    if (plan.kept != s.K) {
      throw BenchError("random_ltd planned " + std::to_string(plan.kept) + " kept, expected " +
                       std::to_string(s.K));
    }
    HostBuffer ws(std::max<uint64_t>(plan.workspace_bytes, 1) + 256);
    void* aligned = ws.get() + (256 - reinterpret_cast<uintptr_t>(ws.get()) % 256) % 256;
    View fv(full.get(), {s.B, s.S, s.C}, s.dt.dl, cpu);
    View kv(kept.get(), {s.B, s.K, s.C}, s.dt.dl, cpu);
    View iv(idx.data(), {s.B, s.K}, DLDataType{kDLInt, 32, 1}, cpu);
    loom_router_select_args sa{};
    sa.struct_size = LOOM_ROUTER_SELECT_ARGS_SIZE;
    sa.seed = 1234;
    sa.step = 1;
    sa.batch = s.B;
    sa.seq_len = s.S;
    sa.channels = s.C;
    sa.layer = 1;
    sa.num_layers = 3;
    sa.training = 1;
    sa.indices = &iv.t;
    sa.workspace = plan.workspace_bytes > 0 ? aligned : nullptr;
    sa.workspace_bytes = plan.workspace_bytes;
    loom_router_move_args ma{};
    ma.struct_size = LOOM_ROUTER_MOVE_ARGS_SIZE;
    ma.full = &fv.t;
    ma.kept = &kv.t;
    ma.indices = &iv.t;
    r.check(r.t->select(r.obj, &sa), "select");
    const loom::sdk::RouterMove m = loom::sdk::router_move(ma);  // the SDK's checks, once
#if LOOM_ROUTER_BENCH_LAYER
    std::unique_ptr<LayerBench> layer;
    if (s.S <= layer_max_seq && s.dt.name == "fp32") {
      layer = std::make_unique<LayerBench>(static_cast<int>(s.C), static_cast<int>(s.B),
                                           static_cast<int>(s.K));
    }
#else
    (void)layer_max_seq;
#endif
    double roof = 1e30, gather = 1e30, scatter = 1e30, select = 1e30, block = 1e30;
    for (int64_t rep = 0; rep < reps; ++rep) {
      for (int sample = 0; sample < 2; ++sample) {  // more samples: it must stay the bound
        for (const bool streaming : {false, true}) {
          for (const unsigned threads : {1u, cores}) {
            roof =
                std::min(roof, copy_seconds(kept.get(), full.get(), s.moved(), threads, streaming));
            roof =
                std::min(roof, copy_seconds(full.get(), kept.get(), s.moved(), threads, streaming));
          }
          roof = std::min(
              roof, loom::bench::copy_seconds(kept.get(), full.get(), s.moved(), true, streaming));
          roof = std::min(
              roof, loom::bench::copy_seconds(full.get(), kept.get(), s.moved(), true, streaming));
        }
      }
      auto t0 = Clock::now();
      r.check(r.t->select(r.obj, &sa), "select");
      select = std::min(select, since(t0));
      t0 = Clock::now();
      loom::sdk::router_move(ma);  // what the plugin's table checks before the copy
      loom::routers::gather(m);
      gather = std::min(gather, since(t0));
      t0 = Clock::now();
      loom::sdk::router_move(ma);
      loom::routers::scatter(m);
      scatter = std::min(scatter, since(t0));
#if LOOM_ROUTER_BENCH_LAYER
      if (layer) block = std::min(block, layer->seconds());
#endif
    }
    const double bytes = static_cast<double>(s.moved());
    const double roof_gbs = 2.0 * bytes / roof / 1e9;
    Json jr = shape_json("roof", "cpu", s);
    jr["threads"] = cores;
    jr["bytes"] = bytes;
    jr["seconds"] = roof;
    jr["gb_per_s"] = roof_gbs;
    loom::bench::emit(jr);
    for (const auto& [op, sec] : {std::pair{"gather", gather}, std::pair{"scatter", scatter}}) {
      Json j = shape_json("move", "cpu", s);
      j["op"] = op;
      j["pool_threads"] = loom_thread_count();
      j["bytes"] = bytes;
      j["seconds"] = sec;
      j["gb_per_s"] = 2.0 * bytes / sec / 1e9;
      j["roof_gb_per_s"] = roof_gbs;
      j["ratio_to_roof"] = (2.0 * bytes / sec / 1e9) / roof_gbs;
      loom::bench::emit(j);
    }
    Json js = shape_json("select", "cpu", s);
    js["router"] = "random_ltd";
    js["seconds"] = select;
    js["positions_per_s"] = static_cast<double>(s.B * s.S) / select;
    loom::bench::emit(js);
    double share = -1.0;
    if (block < 1e29) {
      // Per routed layer and step: select, gather(x) and scatter(y) in forward, gather(dy)
      // and scatter(dx) in backward.
      const double routing = select + 2.0 * gather + 2.0 * scatter;
      share = routing / (routing + block);
      Json jl = shape_json("layer", "cpu", s);
      jl["heads"] = std::max<int64_t>(1, s.C / 64);
      jl["block_seconds"] = block;
      jl["routing_seconds"] = routing;
      jl["routing_share"] = share;
      jl["select_seconds"] = select;
      jl["gather_seconds"] = gather;
      jl["scatter_seconds"] = scatter;
      loom::bench::emit(jl);
    }
    std::fflush(stdout);
    table.push_back({"cpu", s.dt.name, s.B, s.S, s.K, s.C, roof_gbs, 2.0 * bytes / gather / 1e9,
                     2.0 * bytes / scatter / 1e9, select, share});
  }
}

// ------------------------------------------------------------------ CUDA run
#if LOOM_BENCH_CUDA
#define LOOM_CUDA_OK(call)                                                  \
  do {                                                                      \
    const cudaError_t e_ = (call);                                          \
    if (e_ != cudaSuccess) {                                                \
      throw BenchError(std::string(#call) + ": " + cudaGetErrorString(e_)); \
    }                                                                       \
  } while (0)

void run_cuda(const std::vector<Shape>& shapes, int64_t reps, const std::string& plugin_path,
              std::vector<Row>& table) {
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
  cudaEvent_t a = nullptr, b = nullptr;
  LOOM_CUDA_OK(cudaEventCreate(&a));
  LOOM_CUDA_OK(cudaEventCreate(&b));
  // Milliseconds of `iters` back-to-back launches of fn on the stream, per launch.
  auto timed = [&](auto&& fn) {
    constexpr int kIters = 10;
    fn();  // warm
    LOOM_CUDA_OK(cudaEventRecord(a, stream));
    for (int i = 0; i < kIters; ++i) fn();
    LOOM_CUDA_OK(cudaEventRecord(b, stream));
    LOOM_CUDA_OK(cudaEventSynchronize(b));
    float ms = 0.0f;
    LOOM_CUDA_OK(cudaEventElapsedTime(&ms, a, b));
    return static_cast<double>(ms) / 1e3 / kIters;
  };
  const DLDevice dev{kDLCUDA, 0};
  for (const Shape& s : shapes) {
    char* full = nullptr;
    char* kept = nullptr;
    int32_t* idx = nullptr;
    void* ws = nullptr;
    LOOM_CUDA_OK(cudaMalloc(&full, s.full_bytes()));
    LOOM_CUDA_OK(cudaMalloc(&kept, s.moved()));
    LOOM_CUDA_OK(cudaMalloc(&idx, static_cast<std::size_t>(s.B * s.K) * sizeof(int32_t)));
    LOOM_CUDA_OK(cudaMemset(full, 1, s.full_bytes()));
    LOOM_CUDA_OK(cudaMemset(kept, 1, s.moved()));
    RouterInstance r = open_ltd(s.K, plugin_path);
    loom_router_plan_args plan{};
    plan.struct_size = LOOM_ROUTER_PLAN_ARGS_SIZE;
    plan.batch = s.B;
    plan.seq_len = s.S;
    plan.channels = s.C;
    plan.step = 1;
    plan.layer = 1;
    plan.num_layers = 3;
    plan.training = 1;
    plan.dtype = s.dt.dl;
    r.check(r.t->plan(r.obj, &plan), "plan");
    if (plan.workspace_bytes > 0) LOOM_CUDA_OK(cudaMalloc(&ws, plan.workspace_bytes));
    View fv(full, {s.B, s.S, s.C}, s.dt.dl, dev);
    View kv(kept, {s.B, s.K, s.C}, s.dt.dl, dev);
    View iv(idx, {s.B, s.K}, DLDataType{kDLInt, 32, 1}, dev);
    loom_router_select_args sa{};
    sa.struct_size = LOOM_ROUTER_SELECT_ARGS_SIZE;
    sa.seed = 1234;
    sa.step = 1;
    sa.batch = s.B;
    sa.seq_len = s.S;
    sa.channels = s.C;
    sa.layer = 1;
    sa.num_layers = 3;
    sa.training = 1;
    sa.indices = &iv.t;
    sa.workspace = ws;
    sa.workspace_bytes = plan.workspace_bytes;
    sa.stream = stream;
    loom_router_move_args ma{};
    ma.struct_size = LOOM_ROUTER_MOVE_ARGS_SIZE;
    ma.full = &fv.t;
    ma.kept = &kv.t;
    ma.indices = &iv.t;
    ma.stream = stream;
    r.check(r.t->select(r.obj, &sa), "select");
    const loom::sdk::RouterMove m = loom::sdk::router_move(ma);
    double roof = 1e30, gather = 1e30, scatter = 1e30, select = 1e30;
    for (int64_t rep = 0; rep < reps; ++rep) {
      roof = std::min(
          roof, timed([&] {
            LOOM_CUDA_OK(cudaMemcpyAsync(kept, full, s.moved(), cudaMemcpyDeviceToDevice, stream));
          }));
      select = std::min(select, timed([&] { r.check(r.t->select(r.obj, &sa), "select"); }));
      gather = std::min(gather, timed([&] { loom::routers::gather(m); }));
      scatter = std::min(scatter, timed([&] { loom::routers::scatter(m); }));
    }
    const double bytes = static_cast<double>(s.moved());
    const double roof_gbs = 2.0 * bytes / roof / 1e9;
    Json jr = shape_json("roof", "cuda", s);
    jr["copy"] = "cudaMemcpyAsync device to device";
    jr["bytes"] = bytes;
    jr["seconds"] = roof;
    jr["gb_per_s"] = roof_gbs;
    loom::bench::emit(jr);
    for (const auto& [op, sec] : {std::pair{"gather", gather}, std::pair{"scatter", scatter}}) {
      Json j = shape_json("move", "cuda", s);
      j["op"] = op;
      j["bytes"] = bytes;
      j["seconds"] = sec;
      j["gb_per_s"] = 2.0 * bytes / sec / 1e9;
      j["roof_gb_per_s"] = roof_gbs;
      j["ratio_to_roof"] = (2.0 * bytes / sec / 1e9) / roof_gbs;
      loom::bench::emit(j);
    }
    Json js = shape_json("select", "cuda", s);
    js["router"] = "random_ltd";
    js["seconds"] = select;
    js["positions_per_s"] = static_cast<double>(s.B * s.S) / select;
    loom::bench::emit(js);
    std::fflush(stdout);
    table.push_back({"cuda", s.dt.name, s.B, s.S, s.K, s.C, roof_gbs, 2.0 * bytes / gather / 1e9,
                     2.0 * bytes / scatter / 1e9, select, -1.0});
    cudaFree(ws);
    cudaFree(idx);
    cudaFree(kept);
    cudaFree(full);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaStreamDestroy(stream);
}
#endif

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "The token routers' gather and scatter against a memory roof (a copy of the same bytes) "
      "measured in the same run, random_ltd's select, and the routing's share of a layer"};
  loom_cli::configure(app, "loom bench router");
  int64_t batch = 8, reps = 5, layer_max_seq = 4096;
  std::vector<int64_t> seq_lens = {2048, 32768}, channels = {512, 1024};
  std::vector<std::string> dtypes = {"fp32", "bf16"};
  double keep = 0.5;
  std::string device = "cpu", plugin_path;
  app.add_option("--batch", batch, "Sequences per call (B)")
      ->check(loom_cli::integer_in(1, 1 << 16))
      ->type_name("B");
  app.add_option("--seq-lens", seq_lens, "Positions per sequence (S), a list")
      ->delimiter(',')
      ->check(loom_cli::integer_in(1, INT32_MAX))
      ->type_name("LIST");
  app.add_option("--channels", channels, "Features per token (C), a list")
      ->delimiter(',')
      ->check(loom_cli::integer_in(1, 1 << 20))
      ->type_name("LIST");
  app.add_option("--keep", keep, "Fraction of each sequence kept")
      ->check(loom_cli::number_in(0.0, 1.0, true))
      ->type_name("F");
  app.add_option("--dtypes", dtypes, "Element types: fp32, bf16, fp16")
      ->delimiter(',')
      ->type_name("LIST");
  app.add_option("--reps", reps, "Repetitions; the best is reported")
      ->check(loom_cli::integer_in(1, 1000))
      ->type_name("R");
  app.add_option("--device", device, "cpu, cuda or all")
      ->check(CLI::IsMember({"cpu", "cuda", "all"}))
      ->type_name("D");
  app.add_option("--layer-max-seq", layer_max_seq,
                 "Time the trainer's Block (fp32) for the routing share up to this S (0: never)")
      ->check(loom_cli::integer_in(0, INT32_MAX))
      ->type_name("L");
  app.add_option("--plugin-path", plugin_path, "Extra plugin folders, ':'-separated")
      ->type_name("DIRS");
  if (const int rc = loom_cli::parse(app, argc, argv, false); rc >= 0) return rc;
  try {
    std::vector<Shape> shapes;
    for (const std::string& d : dtypes) {
      const Dtype dt = dtype_of(d);
      for (int64_t S : seq_lens) {
        for (int64_t C : channels) {
          const auto K = std::clamp<int64_t>(
              static_cast<int64_t>(std::floor(keep * static_cast<double>(S) + 0.5)), 1, S);
          shapes.push_back({batch, S, K, C, dt});
        }
      }
    }
    // loom::routers::gather/scatter split rows over the SDK's registered pool.
    const loom::bench::LibloomPool pool("loom bench router");
    std::vector<Row> table;
    if (device == "cpu" || device == "all")
      run_cpu(shapes, reps, layer_max_seq, plugin_path, table);
    if (device == "cuda" || device == "all") {
#if LOOM_BENCH_CUDA
      run_cuda(shapes, reps, plugin_path, table);
#else
      std::printf(
          "{\"kind\":\"skip\",\"device\":\"cuda\",\"reason\":\"built without CUDA (LOOM_CUDA "
          "off)\"}\n");
#endif
    }
    if (!table.empty()) print_table(table);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "loom bench router: error: %s\n", e.what());
    return 2;
  }
  return 0;
}
