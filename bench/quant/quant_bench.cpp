// loom-bench-quant [--quant-shape N,K] [--group-size G] [--gemm-sizes 2048]
//                  [--trainer-shapes] [--decode-shape N,K] [--decode-batches 1,4,16]
//                  [--reps R] [--only quant,gemm,decode] [--dtype fp32|bf16]
//                  [--device cpu|cuda|all]
//                  [--cuda-gemm-sizes 8192] [--torch-peer SCRIPT [--python PATH]]
//                  [--plugin-path DIRS]
//
// The quantizers through the host, as a program that loads them sees them (loom_open_string,
// the loom.quantizer/1 table), each against its reference measured back to back in the same
// run; every figure is the best of R repetitions, ours and the reference interleaved:
//   quant:  group quantization of a float32 (or --dtype bf16) weight W [N, K] (zeroquant INT8
//           and INT4, xtc ternary, groups of G along K) against a memory roof of the same traffic:
//           the weight read once and the packed codes plus scales written once, on libloom's pool
//           (each 64 KiB block of W read, and its share of the output written with the router
//           core's non-temporal stores, loom::routers::stream_copy_bytes).
//   gemm:   zeroquant's W8A8 and W4A8 matmuls (x quantized per token, INT8 x INT8 -> INT32,
//           fused epilogue; per-row weight scales) against OpenBLAS sgemm of the same shape, at
//           M = N = K = S for each --gemm-sizes S and at the trainer's linear layers
//           (M = 8 * 128 tokens, (N, K) = (384, 128), (128, 128), (512, 128), (128, 512)).
//   decode: weight-only matmuls at batch M (the decode case): zeroquant INT4 (groups of G,
//           float x) and xtc ternary and binary, against OpenBLAS sgemv (M = 1) or sgemm.
//   cuda:   (--device cuda) zeroquant's W8A8 matmul on the GPU (cuBLASLt int8) against
//           cuBLAS bf16 (bf16 inputs and output, fp32 accumulation) at M = N = K = S for
//           each --cuda-gemm-sizes S, timed with CUDA events on one stream.
// With --torch-peer SCRIPT (bench/peers/quant_peers.py) the torch peer runs first on the same
// shapes, its lines are echoed with kind "torch_peer_quant" / "torch_peer_matmul", and each
// row gains "vs_torch": our GB/s over torch's group quantizer's, or torch's fp32 matmul time
// over ours.
// The CPU's ISA is printed first: the SIMD target Highway dispatches the xtc kernels to, and
// what oneDNN (zeroquant's INT8 GEMM) says it uses. A plugin that is not installed gives a
// "skip" line for its rows. One JSON object per line on stdout:
//  {"kind":"isa", "highway", "onednn", "threads", "openblas_threads"}
//  {"kind":"quant", "quantizer", "bits", "rows", "cols", "group_size", "bytes_read",
//   "bytes_written", "seconds", "gb_per_s", "roof_gb_per_s", "ratio_to_roof",
//   "cpu_seconds", "roof_cpu_seconds", "ratio_to_roof_cpu"}  (cpu: the process's CPU time
//   over the call, the least of R: on a busy machine it shows the work without preemption)
//  {"kind":"gemm"|"decode", ("device":"cuda"), "quantizer", "m", "n", "k", "seconds", "gflops",
//  "peer",
//   "peer_seconds", "peer_gflops", "speedup"}
//  {"kind":"skip", "what", "reason"}
// gb_per_s counts reads plus writes. gflops counts 2 M N K. A table goes to stderr.
#include <cblas.h>
#include <loom/embed.h>
#include <loom/kinds/quantizer.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <loom_cli_support.hpp>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include <loom/quantizers/binary.hpp>
#include <loom/routers/router_core.hpp>

#include "bench_support.hpp"

#if LOOM_QUANT_BENCH_DNNL
#include <oneapi/dnnl/dnnl.h>
#endif
#if LOOM_QUANT_BENCH_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>
#endif

extern "C" int openblas_get_num_threads(void);

namespace {

using loom::bench::BenchError;
using loom::bench::Clock;
using loom::bench::Json;
using loom::bench::since;

// 256-byte aligned buffer (the quantizer workspace alignment), every page written.
struct Buffer {
  std::unique_ptr<char, void (*)(void*)> p{nullptr, std::free};
  std::size_t bytes = 0;
  explicit Buffer(std::size_t n = 0) : bytes(n) {
    const std::size_t rounded = std::max<std::size_t>(256, (n + 255) / 256 * 256);
    p.reset(static_cast<char*>(std::aligned_alloc(256, rounded)));
    if (!p) throw BenchError("out of memory allocating " + std::to_string(n) + " bytes");
    std::memset(p.get(), 0, rounded);
  }
  char* get() const { return p.get(); }
  template <class T>
  T* as() const {
    return reinterpret_cast<T*>(p.get());
  }
};

// Uniform values of standard deviation `scale` (xorshift: the data only needs to look like
// weights, and std::normal_distribution would take longer than the benchmark).
std::vector<float> random_floats(std::size_t n, uint32_t seed, float scale) {
  uint64_t st = 0x9E3779B97F4A7C15ull * (seed + 1);
  std::vector<float> v(n);
  const float half_width = scale * 1.7320508f;  // uniform [-a, a] has sd a / sqrt(3)
  for (auto& x : v) {
    st ^= st << 13;
    st ^= st >> 7;
    st ^= st << 17;
    const auto u = static_cast<float>(st >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    x = (2.0f * u - 1.0f) * half_width;
  }
  return v;
}

// A DLTensor over caller memory (contiguous, host).
struct View {
  std::vector<int64_t> shape;
  DLTensor t{};
  View(void* data, std::vector<int64_t> s, DLDataType dt, DLDevice dev = DLDevice{kDLCPU, 0})
      : shape(std::move(s)) {
    t.data = data;
    t.device = dev;
    t.ndim = static_cast<int32_t>(shape.size());
    t.dtype = dt;
    t.shape = shape.data();
  }
  View(const View&) = delete;
  View& operator=(const View&) = delete;
};

constexpr DLDataType kF32{kDLFloat, 32, 1};
constexpr DLDataType kU8{kDLUInt, 8, 1};

// ------------------------------------------------------------------ the roof
// Reads `read` bytes of src and writes `written` bytes to dst on libloom's pool, in 64 KiB
// blocks of src: each block streams its share of the output from its first bytes (the router
// core's non-temporal copy) and reads the rest.
double roof_seconds(const char* src, std::size_t read, char* dst, std::size_t written) {
  constexpr std::size_t kBlock = std::size_t{64} << 10;
  struct Job {
    const char* src;
    std::size_t read;
    char* dst;
    std::size_t written;
    std::atomic<uint64_t> sink{0};
  } job{src, read, dst, written};
  const auto t0 = Clock::now();
  const int32_t rc =
      loom_parallel_for((read + kBlock - 1) / kBlock, 1,
                        [](void* ctx, std::size_t begin, std::size_t end) {
                          auto& j = *static_cast<Job*>(ctx);
                          uint64_t acc = 0;
                          for (std::size_t b = begin; b < end; ++b) {
                            const std::size_t lo = b * kBlock, hi = std::min(j.read, lo + kBlock);
                            // this block's share of the output, cut on 64-byte lines
                            const auto share = [&](std::size_t at) {
                              return static_cast<std::size_t>(static_cast<double>(at) *
                                                              static_cast<double>(j.written) /
                                                              static_cast<double>(j.read)) /
                                     64 * 64;
                            };
                            const std::size_t w_lo = share(lo);
                            const std::size_t w_hi = hi == j.read ? j.written : share(hi);
                            const std::size_t w = w_hi - w_lo;
                            if (!loom::routers::stream_copy_bytes(j.dst + w_lo, j.src + lo, w)) {
                              std::memcpy(j.dst + w_lo, j.src + lo, w);
                            }
                            const auto* p = reinterpret_cast<const uint64_t*>(j.src + lo + w);
                            const std::size_t words = (hi - lo - w) / 8;
                            for (std::size_t i = 0; i < words; ++i) acc += p[i];
                          }
                          j.sink.fetch_add(acc, std::memory_order_relaxed);
                        },
                        &job);
  if (rc != 0) throw BenchError(std::string("loom_parallel_for: ") + loom_last_error());
  return since(t0);
}

// ------------------------------------------------------------------ quantizers (host)
struct Session {
  std::unique_ptr<loom_session, void (*)(loom_session*)> s{nullptr, loom_close};
};

struct Quantizer {
  std::string name;
  loom_instance* inst = nullptr;
  void* obj = nullptr;
  const loom_quantizer_v1* t = nullptr;

  void check(loom_status* st, const char* what) const {
    if (st == nullptr) return;
    char msg[1024] = {};
    loom_instance_take_status(inst, st, msg, sizeof msg);
    throw BenchError(name + " " + what + ": " + msg);
  }
};

// One instance per TOML section; a plugin that fails to open leaves a "skip" line.
struct Opened {
  Session session;
  bool ok = false;
  Quantizer q;
};

std::unique_ptr<Opened> open_quantizer(const std::string& name, const std::string& body,
                                       const std::string& plugin_path) {
  auto o = std::make_unique<Opened>();
  const std::string toml = "[quantizer." + name + "]\n" + body;
  loom_open_options opts{};
  opts.struct_size = LOOM_OPEN_OPTIONS_SIZE;
  opts.log_level = -1;
  opts.plugin_path = plugin_path.empty() ? nullptr : plugin_path.c_str();
  loom_session* s = nullptr;
  if (loom_open_string(toml.c_str(), "<bench quant>", &opts, &s) != 0) {
    Json j{{"kind", "skip"}, {"what", name}, {"reason", loom_last_error()}};
    loom::bench::emit(j);
    return o;
  }
  o->session.s.reset(s);
  o->q.name = name;
  if (loom_find_instance(s, LOOM_KIND_QUANTIZER, name.c_str(), &o->q.inst) != 0) {
    throw BenchError(name + ": " + loom_last_error());
  }
  const void* table = nullptr;
  if (loom_instance_table(o->q.inst, LOOM_KIND_QUANTIZER, LOOM_QUANTIZER_V1_MIN_SIZE, &o->q.obj,
                          &table) != 0) {
    throw BenchError(name + " table: " + loom_last_error());
  }
  o->q.t = static_cast<const loom_quantizer_v1*>(table);
  o->ok = true;
  return o;
}

// A quantized weight W [N, K] and what its calls need.
struct Packed {
  int64_t shape[2] = {0, 0};
  loom_quant_format format{};
  loom_quantizer_layout_args layout{};
  Buffer codes, scales, zeros, workspace, matmul_workspace;
};

void lay_out(const Quantizer& q, int64_t n, int64_t k, int64_t matmul_rows, Packed& p,
             DLDataType dtype = kF32) {
  p.shape[0] = n;
  p.shape[1] = k;
  p.format = loom_quant_format{};
  p.format.struct_size = LOOM_QUANT_FORMAT_SIZE;
  p.layout = loom_quantizer_layout_args{};
  p.layout.struct_size = LOOM_QUANTIZER_LAYOUT_ARGS_SIZE;
  p.layout.role = LOOM_QUANTIZER_WEIGHT;
  p.layout.ndim = 2;
  p.layout.shape = p.shape;
  p.layout.dtype = dtype;
  p.layout.matmul_rows = matmul_rows;
  p.layout.format = &p.format;
  q.check(q.t->layout(q.obj, &p.layout), "layout");
  p.codes = Buffer(p.layout.packed_bytes);
  p.scales = Buffer(static_cast<std::size_t>(p.layout.scale_count) * 4);
  p.zeros = Buffer(static_cast<std::size_t>(p.layout.zero_point_count));
  p.workspace = Buffer(p.layout.workspace_bytes);
  p.matmul_workspace = Buffer(p.layout.matmul_workspace_bytes);
}

// Bytes of the scale tensor (its dtype's width).
std::size_t scale_bytes(const Packed& p) {
  return static_cast<std::size_t>(p.layout.scale_count) * (p.format.scale_dtype.bits / 8);
}

double quantize_seconds(const Quantizer& q, const void* w, Packed& p) {
  View x(const_cast<void*>(w), {p.shape[0], p.shape[1]}, p.layout.dtype);
  View codes(p.codes.get(), {static_cast<int64_t>(p.layout.packed_bytes)}, kU8);
  View scales(p.scales.get(), {p.layout.scale_count}, p.format.scale_dtype);
  View zeros(p.zeros.get(), {p.layout.zero_point_count}, p.format.zero_point_dtype);
  loom_quantizer_quantize_args a{};
  a.struct_size = LOOM_QUANTIZER_QUANTIZE_ARGS_SIZE;
  a.role = LOOM_QUANTIZER_WEIGHT;
  a.format = &p.format;
  a.x = &x.t;
  a.packed = &codes.t;
  a.scales = &scales.t;
  a.zero_points = p.layout.zero_point_count > 0 ? &zeros.t : nullptr;
  a.workspace = p.layout.workspace_bytes > 0 ? p.workspace.get() : nullptr;
  a.workspace_bytes = p.layout.workspace_bytes;
  const auto t0 = Clock::now();
  q.check(q.t->quantize(q.obj, &a), "quantize");
  return since(t0);
}

double matmul_seconds(const Quantizer& q, const float* x, int64_t m, Packed& p, float* y) {
  View xv(const_cast<float*>(x), {m, p.shape[1]}, kF32);
  View codes(p.codes.get(), {static_cast<int64_t>(p.layout.packed_bytes)}, kU8);
  View scales(p.scales.get(), {p.layout.scale_count}, p.format.scale_dtype);
  View zeros(p.zeros.get(), {p.layout.zero_point_count}, p.format.zero_point_dtype);
  View yv(y, {m, p.shape[0]}, kF32);
  loom_quantizer_matmul_args a{};
  a.struct_size = LOOM_QUANTIZER_MATMUL_ARGS_SIZE;
  a.format = &p.format;
  a.x = &xv.t;
  a.packed = &codes.t;
  a.scales = &scales.t;
  a.zero_points = p.layout.zero_point_count > 0 ? &zeros.t : nullptr;
  a.y = &yv.t;
  a.workspace = p.layout.matmul_workspace_bytes > 0 ? p.matmul_workspace.get() : nullptr;
  a.workspace_bytes = p.layout.matmul_workspace_bytes;
  const auto t0 = Clock::now();
  q.check(q.t->matmul(q.obj, &a), "matmul");
  return since(t0);
}

// fp32 y = x . W^T with OpenBLAS: sgemv for one row, sgemm otherwise.
double blas_seconds(const float* x, int64_t m, const float* w, int64_t n, int64_t k, float* y) {
  const auto t0 = Clock::now();
  if (m == 1) {
    cblas_sgemv(CblasRowMajor, CblasNoTrans, static_cast<int>(n), static_cast<int>(k), 1.0f, w,
                static_cast<int>(k), x, 1, 0.0f, y, 1);
  } else {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m), static_cast<int>(n),
                static_cast<int>(k), 1.0f, x, static_cast<int>(k), w, static_cast<int>(k), 0.0f, y,
                static_cast<int>(n));
  }
  return since(t0);
}

// Best of reps of each of the functions, run in turn (interleaved).
// CPU seconds of the whole process (every thread) so far.
double process_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

// Best of reps of each of the functions, run in turn (interleaved): wall seconds, and in
// *cpu (when given) the least CPU time of the process over one call, which a busy machine's
// preemption does not inflate (memory stalls still count).
std::vector<double> best_of(int64_t reps, const std::vector<std::function<double()>>& fns,
                            std::vector<double>* cpu = nullptr) {
  std::vector<double> best(fns.size(), INFINITY);
  if (cpu != nullptr) cpu->assign(fns.size(), INFINITY);
  for (const auto& f : fns) (void)f();  // warm up
  for (int64_t r = 0; r < reps; ++r) {
    for (std::size_t i = 0; i < fns.size(); ++i) {
      const double c0 = process_cpu_seconds();
      best[i] = std::min(best[i], fns[i]());
      if (cpu != nullptr) (*cpu)[i] = std::min((*cpu)[i], process_cpu_seconds() - c0);
    }
  }
  return best;
}

std::string onednn_isa() {
#if LOOM_QUANT_BENCH_DNNL
  switch (dnnl_get_effective_cpu_isa()) {
    case dnnl_cpu_isa_sse41:
      return "sse41";
    case dnnl_cpu_isa_avx:
      return "avx";
    case dnnl_cpu_isa_avx2:
      return "avx2";
    case dnnl_cpu_isa_avx2_vnni:
      return "avx2_vnni";
    case dnnl_cpu_isa_avx512_core:
      return "avx512_core";
    case dnnl_cpu_isa_avx512_core_vnni:
      return "avx512_core_vnni";
    case dnnl_cpu_isa_avx512_core_bf16:
      return "avx512_core_bf16";
    case dnnl_cpu_isa_avx512_core_amx:
      return "avx512_core_amx";
    default:
      return "other (" + std::to_string(static_cast<int>(dnnl_get_effective_cpu_isa())) + ")";
  }
#else
  return "not linked (libdnnl-dev missing at build time)";
#endif
}

struct Options {
  int64_t quant_n = 4096, quant_k = 4096, group = 128, reps = 5;
  std::vector<int64_t> gemm_sizes = {2048};
  bool trainer_shapes = true;
  int64_t decode_n = 4096, decode_k = 4096;
  std::vector<int64_t> decode_batches = {1, 4, 16};
  std::vector<std::string> only = {"quant", "gemm", "decode"};
  std::string device = "cpu";
  std::string dtype = "fp32";  // of the quantized weight (quant)
  std::string peer;            // bench/peers/quant_peers.py, run first (--torch-peer)
  std::string python = "/usr/bin/python3";
  std::vector<int64_t> cuda_gemm_sizes = {8192};
  std::string plugin_path;
  bool wants(const char* what) const {
    return std::find(only.begin(), only.end(), what) != only.end();
  }
};

void emit(const Json& j) {
  loom::bench::emit(j);
  std::fflush(stdout);
}

// ------------------------------------------------------------------ the torch peer
// quant_peers.py's JSON lines: group quantization by scheme, fp32 matmuls by (m, n, k).
struct TorchPeer {
  std::map<std::string, double> quant_gbps;                          // int8, int4, ternary
  std::map<std::tuple<int64_t, int64_t, int64_t>, double> matmul_s;  // seconds
};

std::string join(const std::vector<int64_t>& v) {
  std::string out;
  for (int64_t x : v) out += (out.empty() ? "" : ",") + std::to_string(x);
  return out;
}

TorchPeer run_torch_peer(const Options& o) {
  TorchPeer t;
  const std::string cmd = "'" + o.python + "' '" + o.peer + "' --quant-shape " +
                          std::to_string(o.quant_n) + "," + std::to_string(o.quant_k) +
                          " --group-size " + std::to_string(o.group) + " --gemm-sizes " +
                          join(o.gemm_sizes) + " --decode-shape " + std::to_string(o.decode_n) +
                          "," + std::to_string(o.decode_k) + " --decode-batches " +
                          join(o.decode_batches) + " --reps " + std::to_string(o.reps);
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (pipe == nullptr) throw BenchError("--torch-peer: cannot run " + cmd);
  char line[4096];
  while (std::fgets(line, sizeof line, pipe) != nullptr) {
    Json j = Json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object()) continue;
    j["kind"] = "torch_" + j.value("kind", std::string("?"));
    emit(j);
    if (j["kind"] == "torch_peer_quant") {
      t.quant_gbps[j.value("scheme", std::string())] = j.value("gb_per_s", 0.0);
    } else if (j["kind"] == "torch_peer_matmul") {
      t.matmul_s[{j.value("m", int64_t{0}), j.value("n", int64_t{0}), j.value("k", int64_t{0})}] =
          j.value("seconds", 0.0);
    }
  }
  const int status = ::pclose(pipe);
  if (status != 0) {
    emit(Json{{"kind", "skip"},
              {"what", "torch peer"},
              {"reason", cmd + " exited with status " + std::to_string(status)}});
  }
  return t;
}

TorchPeer g_peer;  // filled by --torch-peer before our rows

void run_quant(const Options& o, std::vector<std::string>& table) {
  const int64_t n = o.quant_n, k = o.quant_k;
  const auto w = random_floats(static_cast<std::size_t>(n * k), 1, 0.05f);
  // --dtype bf16: W stored in bfloat16 (the float32 values rounded), half the bytes to read.
  const bool bf16 = o.dtype == "bf16";
  std::vector<uint16_t> w16(bf16 ? w.size() : 0);
  for (std::size_t i = 0; i < w16.size(); ++i) {
    uint32_t u = 0;
    std::memcpy(&u, &w[i], 4);
    w16[i] = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  const void* wp = bf16 ? static_cast<const void*>(w16.data()) : w.data();
  const DLDataType dtype = bf16 ? DLDataType{kDLBfloat, 16, 1} : kF32;
  const std::string g = std::to_string(o.group);
  struct Spec {
    const char* name;
    std::string body;
    const char* scheme;  // the torch peer's
  };
  const Spec specs[] = {
      {"zeroquant_int8", "plugin = \"zeroquant\"\nbits = 8\ngroup_size = " + g + "\n", "int8"},
      {"zeroquant_int4", "plugin = \"zeroquant\"\nbits = 4\ngroup_size = " + g + "\n", "int4"},
      {"xtc_ternary", "plugin = \"xtc\"\nmode = \"ternary\"\ngroup_size = " + g + "\n", "ternary"},
  };
  for (const Spec& spec : specs) {
    auto opened = open_quantizer(spec.name, spec.body, o.plugin_path);
    if (!opened->ok) continue;
    const Quantizer& q = opened->q;
    Packed p;
    lay_out(q, n, k, 0, p, dtype);
    const std::size_t read = static_cast<std::size_t>(n * k) * (bf16 ? 2 : 4);
    const std::size_t written = p.layout.packed_bytes + scale_bytes(p) +
                                static_cast<std::size_t>(p.layout.zero_point_count);
    Buffer roof_dst(written);
    std::vector<double> cpu;
    const auto best = best_of(
        o.reps,
        {[&] { return quantize_seconds(q, wp, p); },
         [&] { return roof_seconds(static_cast<const char*>(wp), read, roof_dst.get(), written); }},
        &cpu);
    const double gbs = static_cast<double>(read + written) / best[0] / 1e9;
    const double roof = static_cast<double>(read + written) / best[1] / 1e9;
    Json row{{"kind", "quant"},
             {"quantizer", spec.name},
             {"bits", p.format.bits},
             {"dtype", bf16 ? "bfloat16" : "float32"},
             {"rows", n},
             {"cols", k},
             {"group_size", o.group},
             {"bytes_read", read},
             {"bytes_written", written},
             {"seconds", best[0]},
             {"gb_per_s", gbs},
             {"roof_gb_per_s", roof},
             {"ratio_to_roof", gbs / roof}};
    row["cpu_seconds"] = cpu[0];
    row["roof_cpu_seconds"] = cpu[1];
    row["ratio_to_roof_cpu"] = cpu[1] / cpu[0];
    const auto peer = g_peer.quant_gbps.find(spec.scheme);
    const double vs_torch =
        peer != g_peer.quant_gbps.end() && peer->second > 0 ? gbs / peer->second : std::nan("");
    if (!std::isnan(vs_torch)) {
      row["torch_gb_per_s"] = peer->second;
      row["vs_torch"] = vs_torch;
    }
    emit(row);
    char line[256];
    std::snprintf(line, sizeof line,
                  "quant  %-16s %s %5lldx%-5lld g%-4lld %8.2f GB/s  roof %8.2f  ratio %5.2f "
                  "(cpu time %5.2f)  torch x%.1f",
                  spec.name, bf16 ? "bf16" : "fp32", static_cast<long long>(n),
                  static_cast<long long>(k), static_cast<long long>(o.group), gbs, roof, gbs / roof,
                  cpu[1] / cpu[0], vs_torch);
    table.emplace_back(line);
  }
}

// One matmul against OpenBLAS at [m, k] x [n, k]^T.
void run_matmul(const char* kind, const Quantizer& q, const char* label, int64_t m, int64_t n,
                int64_t k, int64_t reps, std::vector<std::string>& table) {
  const auto w = random_floats(static_cast<std::size_t>(n * k), 2, 0.05f);
  const auto x = random_floats(static_cast<std::size_t>(m * k), 3, 1.0f);
  std::vector<float> y(static_cast<size_t>(m * n)), y_ref(y.size());
  Packed p;
  lay_out(q, n, k, m, p);
  if ((p.layout.flags & LOOM_QUANTIZER_HAS_MATMUL) == 0) {
    throw BenchError(std::string(label) + " has no matmul for this format");
  }
  (void)quantize_seconds(q, w.data(), p);
  const auto best =
      best_of(reps, {[&] { return matmul_seconds(q, x.data(), m, p, y.data()); },
                     [&] { return blas_seconds(x.data(), m, w.data(), n, k, y_ref.data()); }});
  const double flops =
      2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  const char* peer = m == 1 ? "openblas_sgemv" : "openblas_sgemm";
  Json row{{"kind", kind},
           {"quantizer", label},
           {"m", m},
           {"n", n},
           {"k", k},
           {"seconds", best[0]},
           {"gflops", flops / best[0] / 1e9},
           {"peer", peer},
           {"peer_seconds", best[1]},
           {"peer_gflops", flops / best[1] / 1e9},
           {"speedup", best[1] / best[0]}};
  const auto tp = g_peer.matmul_s.find({m, n, k});
  const double vs_torch =
      tp != g_peer.matmul_s.end() && tp->second > 0 ? tp->second / best[0] : std::nan("");
  if (!std::isnan(vs_torch)) {
    row["torch_seconds"] = tp->second;
    row["vs_torch"] = vs_torch;
  }
  emit(row);
  char line[256];
  std::snprintf(line, sizeof line,
                "%-6s %-16s M%-5lld N%-5lld K%-5lld %8.1f GFLOP/s  %s %8.1f  x%5.2f  torch x%.2f",
                kind, label, static_cast<long long>(m), static_cast<long long>(n),
                static_cast<long long>(k), flops / best[0] / 1e9, peer, flops / best[1] / 1e9,
                best[1] / best[0], vs_torch);
  table.emplace_back(line);
}

void run_gemm(const Options& o, std::vector<std::string>& table) {
  // W8A8 and W4A8 (INT4 codes widened to int8 in the workspace), per-row weight scales.
  const char* specs[][2] = {{"zeroquant_w8a8", "bits = 8"}, {"zeroquant_w4a8", "bits = 4"}};
  for (const auto& spec : specs) {
    auto opened = open_quantizer(spec[0],
                                 std::string("plugin = \"zeroquant\"\n") + spec[1] +
                                     "\ngroup_size = 0\nactivation_bits = 8\n",
                                 o.plugin_path);
    if (!opened->ok) continue;
    for (int64_t s : o.gemm_sizes) run_matmul("gemm", opened->q, spec[0], s, s, s, o.reps, table);
    if (o.trainer_shapes) {
      // examples/train_*.toml: dim 128, MLP 4 * dim, batch 16 sequences of 128 over 2 ranks.
      const int64_t nk[][2] = {{384, 128}, {128, 128}, {512, 128}, {128, 512}};
      for (const auto& s : nk)
        run_matmul("gemm", opened->q, spec[0], 8 * 128, s[0], s[1], o.reps, table);
    }
  }
}

void run_decode(const Options& o, std::vector<std::string>& table) {
  const std::string g = std::to_string(o.group);
  struct Spec {
    const char* name;
    std::string body;
  };
  const Spec specs[] = {
      {"zeroquant_w4",
       "plugin = \"zeroquant\"\nbits = 4\ngroup_size = " + g + "\nactivation_bits = 0\n"},
      {"xtc_ternary", "plugin = \"xtc\"\nmode = \"ternary\"\ngroup_size = " + g + "\n"},
      {"xtc_binary", "plugin = \"xtc\"\nmode = \"binary\"\ngroup_size = " + g + "\n"},
  };
  for (const Spec& spec : specs) {
    auto opened = open_quantizer(spec.name, spec.body, o.plugin_path);
    if (!opened->ok) continue;
    for (int64_t m : o.decode_batches) {
      run_matmul("decode", opened->q, spec.name, m, o.decode_n, o.decode_k, o.reps, table);
    }
  }
}

#if LOOM_QUANT_BENCH_CUDA
// ------------------------------------------------------------------ CUDA
void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw BenchError(std::string(what) + ": " + cudaGetErrorString(e));
}
void cublas_check(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS) {
    throw BenchError(std::string(what) + ": cuBLAS status " + std::to_string(static_cast<int>(st)));
  }
}

struct DeviceBuffer {
  void* p = nullptr;
  explicit DeviceBuffer(std::size_t bytes) {
    cuda_check(cudaMalloc(&p, std::max<std::size_t>(bytes, 256)), "cudaMalloc");
  }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

uint16_t to_bf16(float f) {  // round to nearest even (finite inputs)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Seconds of fn() on `stream`, by CUDA events, best of reps after a warm-up.
double cuda_best(cudaStream_t stream, int64_t reps, const std::function<void()>& fn) {
  cudaEvent_t a, b;
  cuda_check(cudaEventCreate(&a), "cudaEventCreate");
  cuda_check(cudaEventCreate(&b), "cudaEventCreate");
  fn();
  cuda_check(cudaStreamSynchronize(stream), "warm-up");
  double best = INFINITY;
  for (int64_t r = 0; r < reps; ++r) {
    cuda_check(cudaEventRecord(a, stream), "cudaEventRecord");
    fn();
    cuda_check(cudaEventRecord(b, stream), "cudaEventRecord");
    cuda_check(cudaEventSynchronize(b), "cudaEventSynchronize");
    float ms = 0.0f;
    cuda_check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
    best = std::min(best, static_cast<double>(ms) * 1e-3);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return best;
}

// zeroquant's W8A8 matmul on CUDA (cuBLASLt int8) against cuBLAS bf16 (bf16 inputs and
// output, fp32 accumulation) at M = N = K = S, both on one stream.
void run_cuda_gemm(const Options& o, std::vector<std::string>& table) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    emit(Json{{"kind", "skip"}, {"what", "cuda"}, {"reason", "no CUDA device"}});
    return;
  }
  auto opened = open_quantizer("zeroquant_w8a8_cuda",
                               "plugin = \"zeroquant\"\nbits = 8\ngroup_size = 0\n"
                               "activation_bits = 8\n",
                               o.plugin_path);
  if (!opened->ok) return;
  const Quantizer& q = opened->q;
  cudaStream_t stream = nullptr;
  cuda_check(cudaStreamCreate(&stream), "cudaStreamCreate");
  cublasHandle_t handle = nullptr;
  cublas_check(cublasCreate(&handle), "cublasCreate");
  cublas_check(cublasSetStream(handle, stream), "cublasSetStream");
  const DLDevice dev{kDLCUDA, 0};
  for (int64_t sz : o.cuda_gemm_sizes) {
    const int64_t m = sz, n = sz, k = sz;
    const auto w = random_floats(static_cast<std::size_t>(n * k), 2, 0.05f);
    const auto x = random_floats(static_cast<std::size_t>(m * k), 3, 1.0f);
    DeviceBuffer dw(w.size() * 4), dx(x.size() * 4), dy(static_cast<std::size_t>(m * n) * 4);
    cuda_check(cudaMemcpy(dw.p, w.data(), w.size() * 4, cudaMemcpyHostToDevice), "copy W");
    cuda_check(cudaMemcpy(dx.p, x.data(), x.size() * 4, cudaMemcpyHostToDevice), "copy x");
    // The packed weight on the device.
    Packed p;
    lay_out(q, n, k, m, p);
    DeviceBuffer codes(p.layout.packed_bytes), scales(scale_bytes(p)), ws(p.layout.workspace_bytes),
        mws(p.layout.matmul_workspace_bytes);
    {
      View wv(dw.p, {n, k}, kF32, dev);
      View cv(codes.p, {static_cast<int64_t>(p.layout.packed_bytes)}, kU8, dev);
      View sv(scales.p, {p.layout.scale_count}, p.format.scale_dtype, dev);
      loom_quantizer_quantize_args a{};
      a.struct_size = LOOM_QUANTIZER_QUANTIZE_ARGS_SIZE;
      a.role = LOOM_QUANTIZER_WEIGHT;
      a.format = &p.format;
      a.x = &wv.t;
      a.packed = &cv.t;
      a.scales = &sv.t;
      a.workspace = p.layout.workspace_bytes > 0 ? ws.p : nullptr;
      a.workspace_bytes = p.layout.workspace_bytes;
      a.stream = stream;
      q.check(q.t->quantize(q.obj, &a), "quantize (cuda)");
    }
    View xv(dx.p, {m, k}, kF32, dev);
    View cv(codes.p, {static_cast<int64_t>(p.layout.packed_bytes)}, kU8, dev);
    View sv(scales.p, {p.layout.scale_count}, p.format.scale_dtype, dev);
    View yv(dy.p, {m, n}, kF32, dev);
    loom_quantizer_matmul_args a{};
    a.struct_size = LOOM_QUANTIZER_MATMUL_ARGS_SIZE;
    a.format = &p.format;
    a.x = &xv.t;
    a.packed = &cv.t;
    a.scales = &sv.t;
    a.y = &yv.t;
    a.workspace = p.layout.matmul_workspace_bytes > 0 ? mws.p : nullptr;
    a.workspace_bytes = p.layout.matmul_workspace_bytes;
    a.stream = stream;
    const double ours =
        cuda_best(stream, o.reps, [&] { q.check(q.t->matmul(q.obj, &a), "matmul (cuda)"); });
    // cuBLAS bf16: y^T [n, m] = W [n, k] . x^T in column-major terms (row-major y = x W^T).
    std::vector<uint16_t> wb(w.size()), xb(x.size());
    for (std::size_t i = 0; i < w.size(); ++i) wb[i] = to_bf16(w[i]);
    for (std::size_t i = 0; i < x.size(); ++i) xb[i] = to_bf16(x[i]);
    DeviceBuffer dwb(wb.size() * 2), dxb(xb.size() * 2), dyb(static_cast<std::size_t>(m * n) * 2);
    cuda_check(cudaMemcpy(dwb.p, wb.data(), wb.size() * 2, cudaMemcpyHostToDevice), "copy W bf16");
    cuda_check(cudaMemcpy(dxb.p, xb.data(), xb.size() * 2, cudaMemcpyHostToDevice), "copy x bf16");
    const float one = 1.0f, zero = 0.0f;
    const double peer = cuda_best(stream, o.reps, [&] {
      cublas_check(
          cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
                       static_cast<int>(k), &one, dwb.p, CUDA_R_16BF, static_cast<int>(k), dxb.p,
                       CUDA_R_16BF, static_cast<int>(k), &zero, dyb.p, CUDA_R_16BF,
                       static_cast<int>(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
          "cublasGemmEx bf16");
    });
    const double flops =
        2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
    emit(Json{{"kind", "gemm"},
              {"device", "cuda"},
              {"quantizer", "zeroquant_w8a8"},
              {"m", m},
              {"n", n},
              {"k", k},
              {"seconds", ours},
              {"gflops", flops / ours / 1e9},
              {"peer", "cublas_bf16"},
              {"peer_seconds", peer},
              {"peer_gflops", flops / peer / 1e9},
              {"speedup", peer / ours}});
    char line[256];
    std::snprintf(
        line, sizeof line,
        "gemm   %-16s M%-5lld N%-5lld K%-5lld %8.1f TFLOP/s cublas_bf16 %6.1f  x%5.2f (cuda)",
        "zeroquant_w8a8", static_cast<long long>(m), static_cast<long long>(n),
        static_cast<long long>(k), flops / ours / 1e12, flops / peer / 1e12, peer / ours);
    table.emplace_back(line);
  }
  cublasDestroy(handle);
  cudaStreamDestroy(stream);
}
#endif

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "The quantizers against their references in one run: group quantization against a memory "
      "roof of the same bytes, the INT8 GEMM and the weight-only matmuls against OpenBLAS fp32"};
  loom_cli::configure(app, "loom bench quant");
  Options o;
  std::vector<int64_t> quant_shape = {o.quant_n, o.quant_k},
                       decode_shape = {o.decode_n, o.decode_k};
  app.add_option("--quant-shape", quant_shape, "N,K of the quantized weight")
      ->delimiter(',')
      ->expected(2)
      ->check(loom_cli::integer_in(1, 1 << 20))
      ->type_name("N,K");
  app.add_option("--group-size", o.group, "Weights per scale along K (quant and decode)")
      ->check(loom_cli::integer_in(1, 1 << 20))
      ->type_name("G");
  app.add_option("--gemm-sizes", o.gemm_sizes, "Square INT8 GEMMs M = N = K, a list")
      ->delimiter(',')
      ->check(loom_cli::integer_in(1, 1 << 16))
      ->type_name("LIST");
  app.add_option("--trainer-shapes", o.trainer_shapes,
                 "Also the INT8 GEMM at the trainer's linear layers (true/false)")
      ->type_name("BOOL");
  app.add_option("--decode-shape", decode_shape, "N,K of the weight-only matmuls")
      ->delimiter(',')
      ->expected(2)
      ->check(loom_cli::integer_in(1, 1 << 20))
      ->type_name("N,K");
  app.add_option("--decode-batches", o.decode_batches, "Rows M of the weight-only matmuls")
      ->delimiter(',')
      ->check(loom_cli::integer_in(1, 1 << 16))
      ->type_name("LIST");
  app.add_option("--reps", o.reps, "Repetitions; the best is reported")
      ->check(loom_cli::integer_in(1, 1000))
      ->type_name("R");
  app.add_option("--dtype", o.dtype, "The quantized weight's dtype (quant): fp32 or bf16")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--only", o.only, "Parts to run: quant, gemm, decode")
      ->delimiter(',')
      ->check(CLI::IsMember({"quant", "gemm", "decode"}))
      ->type_name("LIST");
  app.add_option("--device", o.device, "cpu, cuda (the INT8 GEMM against cuBLAS bf16) or all")
      ->check(CLI::IsMember({"cpu", "cuda", "all"}))
      ->type_name("D");
  app.add_option("--cuda-gemm-sizes", o.cuda_gemm_sizes, "Square GEMMs on CUDA, a list")
      ->delimiter(',')
      ->check(loom_cli::integer_in(1, 1 << 16))
      ->type_name("LIST");
  app.add_option("--torch-peer", o.peer,
                 "bench/peers/quant_peers.py: run it first on the same shapes and print ours / "
                 "torch beside each row")
      ->type_name("SCRIPT");
  app.add_option("--python", o.python, "The interpreter of --torch-peer (Debian's has torch)")
      ->type_name("PATH");
  app.add_option("--plugin-path", o.plugin_path, "Extra plugin folders, ':'-separated")
      ->type_name("DIRS");
  if (const int rc = loom_cli::parse(app, argc, argv, false); rc >= 0) return rc;
  o.quant_n = quant_shape[0];
  o.quant_k = quant_shape[1];
  o.decode_n = decode_shape[0];
  o.decode_k = decode_shape[1];
  try {
    emit(Json{{"kind", "isa"},
              {"highway", loom::quant::xtc_simd_target()},
              {"onednn", onednn_isa()},
              {"threads", loom_thread_count()},
              {"openblas_threads", openblas_get_num_threads()}});
    std::vector<std::string> table;
    if (!o.peer.empty() && o.device != "cuda") g_peer = run_torch_peer(o);
    const bool cpu = o.device == "cpu" || o.device == "all";
    if (cpu && o.wants("quant")) run_quant(o, table);
    if (cpu && o.wants("gemm")) run_gemm(o, table);
    if (cpu && o.wants("decode")) run_decode(o, table);
    if (o.device == "cuda" || o.device == "all") {
#if LOOM_QUANT_BENCH_CUDA
      run_cuda_gemm(o, table);
#else
      emit(Json{
          {"kind", "skip"}, {"what", "cuda"}, {"reason", "built without CUDA (LOOM_CUDA off)"}});
#endif
    }
    std::fprintf(stderr, "\n");
    for (const auto& line : table) std::fprintf(stderr, "%s\n", line.c_str());
    std::fprintf(stderr,
                 "(quant: GB/s of reads + writes, ratio = ours / the roof's; gemm and decode: "
                 "x = OpenBLAS time / ours)\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "loom bench quant: error: %s\n", e.what());
    return 2;
  }
  return 0;
}
