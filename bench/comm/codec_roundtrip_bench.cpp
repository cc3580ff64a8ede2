// loom-bench-codec: the compressed round trip of a world of one, through the codec plugins'
// ABI, on device memory (--device cuda, the default) or host memory (--device cpu), beside the
// copy bandwidth measured in the same run. No MPI: it runs without mpirun.
//
//   loom bench codec [--device cuda|cpu] [--sizes 1M,16M,64M,256M] [--iters 20]
//                    [--codecs onebit,ef8]
//
// The round trip is the work bench/peers/gpu_peers.py times as DeepSpeed's path
// (ds_onebit_roundtrip_ms_256M), for a world of one:
//   worker: encode(x, worker error) -> wire1
//   server: decode(wire1) -> s; encode(s, server error) -> wire2
//   final:  decode(wire2) -> out
//
// One JSON object per line:
//   {"bench":"copy","device","elements","bytes","seconds","copy_gbps"}
//       cudaMemcpy device to device (or a threaded memcpy on the CPU) of the same n fp32:
//       bytes = 8 n (read + write), the best of two measurements, before and after the codecs
//   {"bench":"codec_roundtrip","op":"roundtrip"|"encode"|"decode","codec","device","elements",
//    "iters","seconds","input_gbps","traffic_bytes","gbps","copy_gbps","ratio_to_copy"[,"check"]}
//       seconds: mean per call over `iters` calls after two warm-up calls (CUDA events on one
//       stream, the way gpu_peers.py times its peers); input_gbps: 4 n / seconds (the peers'
//       ds_onebit_roundtrip_input_GBps); gbps: traffic_bytes / seconds; ratio_to_copy:
//       gbps / copy_gbps. traffic_bytes is what the kernels must move (see Traffic below).
//   {"bench":"codec_roundtrip","codec","device","skipped":"..."}  a codec without a path there
//
// Exit status: 0 done, 1 an error, 2 bad arguments, 77 skipped: --device cuda without a CUDA
// device, or a build without CUDA (one "skipped" line on stdout says which).
#include <loom/embed.h>
#include <loom/kinds/codec.h>
#include <loom/sdk/parallel.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <loom_cli_support.hpp>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_support.hpp"

#if LOOM_BENCH_CUDA
#include <cuda_runtime.h>
#endif

namespace {

constexpr int kSkipped = 77;

using loom::bench::Clock;

void print(const nlohmann::json& j) { loom::bench::emit(j); }

// Bytes the kernels must move per call on n (padded) fp32 elements, the figure behind
// "% of copy bandwidth" (the copy moves 8 bytes per element: read 4, write 4).
//   onebit encode, two passes: the norm reads x and e (8 n); sign + pack + error update reads
//     x and e and writes e (12 n) and n / 8 bytes of bits: 20 n + n / 8.
//   onebit decode: reads n / 8 bytes of bits, writes n fp32: 4 n + n / 8.
//   ef8 encode: 20 n plus n int8 = 21 n; decode: n + 4 n = 5 n.
// A round trip is two encodes and two decodes: onebit 48.5 n bytes, ef8 52 n. Chunk headers
// (4 bytes per chunk) are left out.
struct Traffic {
  double encode;
  double decode;
  [[nodiscard]] double roundtrip() const { return 2.0 * (encode + decode); }
};
Traffic traffic_of(const std::string& codec, double n) {
  if (codec == "onebit") return {20.0 * n + n / 8.0, 4.0 * n + n / 8.0};
  return {21.0 * n, 5.0 * n};
}

// Where the buffers live and how calls are timed.
struct Backend {
  DLDevice device{kDLCPU, 0};
  void* stream = nullptr;
  std::function<void*(std::size_t)> alloc;
  std::function<void(void*)> free;
  std::function<void(void*, const void*, std::size_t)> to_device;  // host -> buffer
  std::function<void(void*, const void*, std::size_t)> to_host;    // buffer -> host
  std::function<void(void*, const void*, std::size_t)> copy;       // buffer -> buffer, async
  // Mean seconds per call of fn over `iters` calls, after two warm-up calls.
  std::function<double(int, const std::function<void()>&)> time;
};

struct Buffer {
  Buffer(const Backend& b, std::size_t bytes) : backend(&b), ptr(b.alloc(bytes)) {}
  ~Buffer() { backend->free(ptr); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr);
  }
  const Backend* backend;
  void* ptr;
};

Backend cpu_backend() {
  Backend b;
  b.alloc = [](std::size_t bytes) {
    void* p = std::aligned_alloc(64, (std::max<std::size_t>(bytes, 1) + 63) / 64 * 64);
    if (p == nullptr) throw std::runtime_error("out of host memory");
    // First touch by the pool's threads, so the pages sit where the codecs' threads run.
    loom::sdk::parallel_for_on(
        loom_parallel_for, bytes, std::size_t{1} << 20,
        [p](std::size_t s, std::size_t e) { std::memset(static_cast<char*>(p) + s, 0, e - s); });
    return p;
  };
  b.free = [](void* p) { std::free(p); };
  b.to_device = [](void* d, const void* s, std::size_t n) { std::memcpy(d, s, n); };
  b.to_host = b.to_device;
  b.copy = [](void* d, const void* s, std::size_t n) {
    loom::sdk::parallel_for_on(
        loom_parallel_for, n, std::size_t{1} << 20, [&](std::size_t lo, std::size_t hi) {
          std::memcpy(static_cast<char*>(d) + lo, static_cast<const char*>(s) + lo, hi - lo);
        });
  };
  b.time = [](int iters, const std::function<void()>& fn) {
    fn();
    fn();
    const auto t0 = Clock::now();
    for (int i = 0; i < iters; ++i) fn();
    return std::chrono::duration<double>(Clock::now() - t0).count() / iters;
  };
  return b;
}

#if LOOM_BENCH_CUDA
void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

Backend cuda_backend(cudaStream_t stream) {
  Backend b;
  b.device = {kDLCUDA, 0};
  b.stream = stream;
  b.alloc = [](std::size_t bytes) {
    void* p = nullptr;
    cuda_ok(cudaMalloc(&p, std::max<std::size_t>(bytes, 1)), "cudaMalloc");
    cuda_ok(cudaMemset(p, 0, bytes), "cudaMemset");
    return p;
  };
  b.free = [](void* p) { cudaFree(p); };
  b.to_device = [](void* d, const void* s, std::size_t n) {
    cuda_ok(cudaMemcpy(d, s, n, cudaMemcpyHostToDevice), "cudaMemcpy to device");
  };
  b.to_host = [stream](void* d, const void* s, std::size_t n) {
    cuda_ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    cuda_ok(cudaMemcpy(d, s, n, cudaMemcpyDeviceToHost), "cudaMemcpy to host");
  };
  b.copy = [stream](void* d, const void* s, std::size_t n) {
    cuda_ok(cudaMemcpyAsync(d, s, n, cudaMemcpyDeviceToDevice, stream), "cudaMemcpyAsync");
  };
  b.time = [stream](int iters, const std::function<void()>& fn) {
    fn();
    fn();
    cudaEvent_t a = nullptr;
    cudaEvent_t z = nullptr;
    cuda_ok(cudaEventCreate(&a), "cudaEventCreate");
    cuda_ok(cudaEventCreate(&z), "cudaEventCreate");
    cuda_ok(cudaEventRecord(a, stream), "cudaEventRecord");
    for (int i = 0; i < iters; ++i) fn();
    cuda_ok(cudaEventRecord(z, stream), "cudaEventRecord");
    cuda_ok(cudaEventSynchronize(z), "cudaEventSynchronize");
    float ms = 0.0f;
    cuda_ok(cudaEventElapsedTime(&ms, a, z), "cudaEventElapsedTime");
    cudaEventDestroy(a);
    cudaEventDestroy(z);
    return static_cast<double>(ms) / 1e3 / iters;
  };
  return b;
}
#endif

// A codec instance of an open session; calls throw with the plugin's message.
struct Codec {
  std::string name;
  void* obj = nullptr;
  const loom_codec_v1* vt = nullptr;

  void check(loom_status* st, const char* what) const {
    if (st == nullptr) return;
    const std::string msg = name + " " + what + ": " + (st->message != nullptr ? st->message : "");
    st->destroy(st);
    throw std::runtime_error(msg);
  }
};

// Input values: a fixed pseudo-random pattern of mixed signs and magnitudes (the codecs'
// speed does not depend on the values), written block by block.
void fill_input(const Backend& b, float* x, std::size_t n) {
  const std::size_t block = std::min<std::size_t>(n, std::size_t{1} << 20);
  std::vector<float> host(block);
  uint64_t s = 0x9e3779b97f4a7c15ULL;
  for (auto& v : host) {
    s = s * 6364136223846793005ULL + 1442695040888963407ULL;
    v = static_cast<float>(static_cast<int32_t>(s >> 32)) * (1.0f / 2147483648.0f);
  }
  for (std::size_t i = 0; i < n; i += block) {
    b.to_device(x + i, host.data(), std::min(block, n - i) * sizeof(float));
  }
}

double measure_copy(const Backend& b, const Buffer& src, const Buffer& dst, std::size_t n,
                    int iters) {
  const double s = b.time(iters, [&] { b.copy(dst.ptr, src.ptr, n * sizeof(float)); });
  return 8.0 * static_cast<double>(n) / s / 1e9;
}

nlohmann::json line(const Codec& c, const Backend& b, const char* op, std::size_t elements,
                    std::size_t padded, int iters, double seconds, double traffic,
                    double copy_gbps) {
  const double gbps = traffic / seconds / 1e9;
  return {{"bench", "codec_roundtrip"},
          {"op", op},
          {"codec", c.name},
          {"device", b.device.device_type == kDLCUDA ? "cuda" : "cpu"},
          {"elements", elements},
          {"padded_elements", padded},
          {"iters", iters},
          {"seconds", seconds},
          {"input_gbps", 4.0 * static_cast<double>(elements) / seconds / 1e9},
          {"traffic_bytes", traffic},
          {"gbps", gbps},
          {"copy_gbps", copy_gbps},
          {"ratio_to_copy", copy_gbps > 0 ? gbps / copy_gbps : 0.0}};
}

// One size: copy bandwidth, then each codec's round trip, encode and decode.
void bench_size(const Backend& b, const std::vector<Codec>& codecs, std::size_t numel, int iters) {
  std::size_t padded_max = numel;
  std::vector<loom_codec_layout> layouts(codecs.size());
  for (std::size_t k = 0; k < codecs.size(); ++k) {
    loom_codec_layout& l = layouts[k];
    l.struct_size = LOOM_CODEC_LAYOUT_SIZE;
    l.elements = numel;
    l.world_size = 1;
    codecs[k].check(codecs[k].vt->layout(codecs[k].obj, &l), "layout");
    padded_max = std::max<std::size_t>(padded_max, l.padded_elements);
  }
  const std::size_t fbytes = padded_max * sizeof(float);
  Buffer x(b, fbytes), werr(b, fbytes), serr(b, fbytes), srv(b, fbytes), out(b, fbytes);
  fill_input(b, x.as<float>(), padded_max);

  double copy_gbps = measure_copy(b, x, out, numel, iters);
  std::vector<nlohmann::json> lines;
  for (std::size_t k = 0; k < codecs.size(); ++k) {
    const Codec& c = codecs[k];
    const loom_codec_layout& l = layouts[k];
    const std::size_t n = l.padded_elements;
    Buffer wire1(b, l.chunk_bytes), wire2(b, l.chunk_bytes);
    int64_t shape = static_cast<int64_t>(n);
    auto tensor = [&](const Buffer& buf) {
      return DLTensor{buf.ptr, b.device, 1, {kDLFloat, 32, 1}, &shape, nullptr, 0};
    };
    DLTensor tx = tensor(x), twerr = tensor(werr), tserr = tensor(serr), tsrv = tensor(srv),
             tout = tensor(out);
    auto encode = [&](const DLTensor& in, DLTensor& err, const Buffer& wire) {
      loom_codec_encode_args a{};
      a.struct_size = LOOM_CODEC_ENCODE_ARGS_SIZE;
      a.chunk_count = 1;
      a.input = &in;
      a.error = &err;
      a.output = wire.ptr;
      a.stream = b.stream;
      c.check(c.vt->encode(c.obj, &a), "encode");
    };
    auto decode = [&](const Buffer& wire, DLTensor& dst) {
      loom_codec_decode_args a{};
      a.struct_size = LOOM_CODEC_DECODE_ARGS_SIZE;
      a.chunk_count = 1;
      a.input = wire.ptr;
      a.output = &dst;
      a.alpha = 1.0f;  // the server's average over a world of one
      a.accumulate = 0;
      a.stream = b.stream;
      c.check(c.vt->decode(c.obj, &a), "decode");
    };
    const double rt = b.time(iters, [&] {
      encode(tx, twerr, wire1);  // worker
      decode(wire1, tsrv);       // server: the average of the ranks' chunks
      encode(tsrv, tserr, wire2);
      decode(wire2, tout);  // everyone: the result
    });
    nlohmann::json j = line(c, b, "roundtrip", numel, n, iters, rt,
                            traffic_of(c.name, static_cast<double>(n)).roundtrip(), copy_gbps);
    if (c.name == "onebit") {
      // Every output is +-scale of the last encode (the first 4 bytes of wire2).
      const std::size_t k_check = std::min<std::size_t>(n, 4096);
      std::vector<float> head(k_check);
      float scale = 0.0f;
      b.to_host(head.data(), out.ptr, k_check * sizeof(float));
      b.to_host(&scale, wire2.ptr, sizeof scale);
      const bool ok =
          std::isfinite(scale) && scale > 0.0f &&
          std::all_of(head.begin(), head.end(), [scale](float v) { return std::fabs(v) == scale; });
      j["check"] = ok ? "ok" : "outputs are not +-scale";
    }
    lines.push_back(std::move(j));
    const Traffic t = traffic_of(c.name, static_cast<double>(n));
    const double te = b.time(iters, [&] { encode(tx, twerr, wire1); });
    lines.push_back(line(c, b, "encode", numel, n, iters, te, t.encode, copy_gbps));
    const double td = b.time(iters, [&] { decode(wire1, tout); });
    lines.push_back(line(c, b, "decode", numel, n, iters, td, t.decode, copy_gbps));
  }
  // The copy again after the codecs: the best of both is the reference.
  copy_gbps = std::max(copy_gbps, measure_copy(b, x, out, numel, iters));
  print({{"bench", "copy"},
         {"device", b.device.device_type == kDLCUDA ? "cuda" : "cpu"},
         {"elements", numel},
         {"bytes", 8 * numel},
         {"seconds", 8.0 * static_cast<double>(numel) / copy_gbps / 1e9},
         {"copy_gbps", copy_gbps}});
  for (auto& j : lines) {
    j["copy_gbps"] = copy_gbps;
    j["ratio_to_copy"] = j["gbps"].get<double>() / copy_gbps;
    print(j);
  }
}

void skipped(const std::string& device, const std::string& why) {
  std::fprintf(stderr, "loom-bench-codec: skipped: %s\n", why.c_str());
  print({{"bench", "codec_roundtrip"}, {"device", device}, {"skipped", why}});
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "Codec round trip of a world of one (encode, decode + encode, decode) per codec, beside\n"
      "the copy bandwidth, one JSON object per line. Exit 77: skipped (no CUDA device)"};
  loom_cli::configure(app, "loom bench codec");
  std::string device = "cuda";
  std::vector<std::string> size_text;
  std::vector<std::string> names = {"onebit", "ef8"};
  int iters = 20;
  app.add_option("--device", device, "Where the tensors live")
      ->check(CLI::IsMember({"cpu", "cuda"}).description(""))
      ->type_name("cuda|cpu");
  app.add_option("--sizes", size_text, "fp32 element counts (K, M, G: 1024 multiples)")
      ->delimiter(',')
      ->check(loom_cli::size_validator())
      ->type_name("SIZE,...")
      ->default_str("cuda: 1M,16M,64M,256M; cpu: 1M,16M");
  app.add_option("--iters", iters, "Timed calls per size")
      ->check(loom_cli::integer_in(1, 1000000))
      ->type_name("N");
  app.add_option("--codecs", names, "Codec plugins to time")
      ->delimiter(',')
      ->type_name("NAME,...")
      ->default_str("onebit,ef8");
  if (const int rc = loom_cli::parse(app, argc, argv, false); rc >= 0) return rc;
  std::vector<std::size_t> sizes;
  for (const auto& t : size_text) sizes.push_back(*loom_cli::parse_size(t));
  if (sizes.empty()) {
    sizes = {std::size_t{1} << 20, std::size_t{16} << 20};
    if (device == "cuda") {
      sizes.push_back(std::size_t{64} << 20);
      sizes.push_back(std::size_t{256} << 20);
    }
  }

  Backend backend = cpu_backend();
#if LOOM_BENCH_CUDA
  cudaStream_t stream = nullptr;
  if (device == "cuda") {
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0) {
      skipped(device, std::string("no CUDA device (cudaGetDeviceCount: ") +
                          (e == cudaSuccess ? "0 devices" : cudaGetErrorString(e)) + ")");
      return kSkipped;
    }
    if (cudaSetDevice(0) != cudaSuccess || cudaStreamCreate(&stream) != cudaSuccess) {
      std::fprintf(stderr, "loom-bench-codec: cannot create a CUDA stream\n");
      return 1;
    }
    backend = cuda_backend(stream);
  }
#else
  if (device == "cuda") {
    skipped(device, "this build of loom-bench-codec has no CUDA (configure with LOOM_CUDA=ON)");
    return kSkipped;
  }
#endif

  std::string toml = "[loom]\nabi = 1\n";
  for (const auto& n : names) toml += "[codec." + n + "]\nplugin = \"" + n + "\"\n";
  loom_open_options opts{};
  opts.struct_size = LOOM_OPEN_OPTIONS_SIZE;
  opts.log_level = -1;
  loom_session* session = nullptr;
  if (loom_open_string(toml.c_str(), "codec_roundtrip_bench.toml", &opts, &session) != LOOM_OK) {
    std::fprintf(stderr, "loom-bench-codec: %s\n", loom_last_error());
    return 1;
  }
  std::vector<Codec> codecs;
  for (const auto& n : names) {
    loom_instance* inst = nullptr;
    if (loom_find_instance(session, "codec", n.c_str(), &inst) != LOOM_OK) {
      std::fprintf(stderr, "loom-bench-codec: %s\n", loom_last_error());
      loom_close(session);
      return 1;
    }
    Codec c{n, loom_instance_object(inst),
            static_cast<const loom_codec_v1*>(loom_instance_vtable(inst))};
    if (c.vt->supports_device(c.obj, backend.device) != 1) {
      print({{"bench", "codec_roundtrip"},
             {"codec", n},
             {"device", device},
             {"skipped", n + " has no " + device + " path"}});
      continue;
    }
    codecs.push_back(std::move(c));
  }
  int rc = 0;
  try {
    for (const std::size_t numel : sizes) bench_size(backend, codecs, numel, iters);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "loom-bench-codec: %s\n", e.what());
    print({{"bench", "codec_roundtrip"}, {"device", device}, {"error", e.what()}});
    rc = 1;
  }
  loom_close(session);
#if LOOM_BENCH_CUDA
  if (stream != nullptr) cudaStreamDestroy(stream);
#endif
  return rc;
}
