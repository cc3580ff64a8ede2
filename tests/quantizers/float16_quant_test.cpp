// bfloat16 and float16 through the quantizer kind (zeroquant and xtc, through the host): a
// 16-bit x quantizes to exactly the codes, scales and zero points of its float32 widening; a
// 16-bit dequantize and matmul give the float32 call's values rounded to nearest even, checked
// against a plain reference rounding (the nearest of all 65536 patterns); a non-finite 16-bit
// element is named; the staging workspace is sized by layout and required. Built twice: on
// the CPU (loom_float16_quant_tests) and, with LOOM_TEST_CUDA, on CUDA tensors against the CPU
// (loom_float16_quant_cuda_tests, which skips without a device; the CUDA emulation has one).
#include <gtest/gtest.h>
#include <loom/embed.h>
#include <loom/kinds/quantizer.h>

#include "../common/float16_reference.hpp"

#if LOOM_TEST_CUDA
#include <cuda_runtime_api.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

// Under ASan, LeakSanitizer's stop-the-world tracer crashes at this program's exit (signal 11,
// reading the main thread's TLS) once it has loaded zeroquant (oneDNN and its OpenMP threads)
// and xtc together; the tests pass first. ASan and UBSan stay on; leak checking is off here.
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define LOOM_FLOAT16_TEST_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(LOOM_FLOAT16_TEST_ASAN)
extern "C" const char* __asan_default_options() { return "detect_leaks=0"; }
#endif

namespace {

using loom_test::is_bf16;
using loom_test::to16;
using loom_test::to32;

constexpr const char* kKind = LOOM_KIND_QUANTIZER;
constexpr DLDataType kF32{kDLFloat, 32, 1};
constexpr DLDataType kBF16{kDLBfloat, 16, 1};
constexpr DLDataType kF16{kDLFloat, 16, 1};
constexpr DLDataType kU8{kDLUInt, 8, 1};

// ---- The host side of a call.
struct Session {
  loom_session* s = nullptr;
  explicit Session(const std::string& toml) {
    loom_open_options o{};
    o.struct_size = LOOM_OPEN_OPTIONS_SIZE;
    o.log_level = -1;
    if (loom_open_string(toml.c_str(), "test.toml", &o, &s) != 0) {
      ADD_FAILURE() << "open: " << loom_last_error();
    }
  }
  ~Session() { loom_close(s); }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
};

struct Quantizer {
  loom_instance* inst = nullptr;
  void* obj = nullptr;
  const loom_quantizer_v1* t = nullptr;
  std::string error;
  Quantizer(Session& s, const char* name) {
    if (loom_find_instance(s.s, kKind, name, &inst) != 0) {
      ADD_FAILURE() << "find " << name << ": " << loom_last_error();
      return;
    }
    const void* table = nullptr;
    if (loom_instance_table(inst, kKind, LOOM_QUANTIZER_V1_MIN_SIZE, &obj, &table) != 0) {
      ADD_FAILURE() << "table " << name << ": " << loom_last_error();
    }
    t = static_cast<const loom_quantizer_v1*>(table);
  }
  int32_t take(loom_status* st) {
    std::array<char, 2048> msg{};
    const int32_t rc = loom_instance_take_status(inst, st, msg.data(), msg.size());
    error = msg.data();
    return rc;
  }
};

// Bytes on the host or on the device, each with 256 spare bytes to align the start (workspaces
// must be 256-byte aligned).
struct Mem {
  bool cuda = false;
  std::vector<unsigned char> host;
  void* dev = nullptr;
  std::size_t bytes = 0;
  Mem(std::size_t n, bool on_cuda) : cuda(on_cuda), host(n + 256, 0xEE), bytes(n) {
#if LOOM_TEST_CUDA
    if (cuda) {
      EXPECT_EQ(cudaMalloc(&dev, n + 256), cudaSuccess);
      EXPECT_EQ(cudaMemset(dev, 0xEE, n + 256), cudaSuccess);
    }
#endif
  }
  template <class T>
  Mem(const std::vector<T>& v, bool on_cuda) : Mem(v.size() * sizeof(T), on_cuda) {
    put(v.data());
  }
  ~Mem() {
#if LOOM_TEST_CUDA
    if (dev != nullptr) cudaFree(dev);
#endif
  }
  Mem(const Mem&) = delete;
  Mem& operator=(const Mem&) = delete;
  // 256-byte aligned, as workspaces must be
  void* data() {
    const auto base = reinterpret_cast<uintptr_t>(cuda ? dev : static_cast<void*>(host.data()));
    return reinterpret_cast<void*>((base + 255) / 256 * 256);
  }
  void put(const void* src) {
#if LOOM_TEST_CUDA
    if (cuda) {
      EXPECT_EQ(cudaMemcpy(data(), src, bytes, cudaMemcpyHostToDevice), cudaSuccess);
      return;
    }
#endif
    if (bytes > 0) std::memcpy(data(), src, bytes);
  }
  template <class T>
  std::vector<T> get() {
    std::vector<T> out(bytes / sizeof(T));
#if LOOM_TEST_CUDA
    if (cuda) {
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(out.data(), data(), bytes, cudaMemcpyDeviceToHost), cudaSuccess);
      return out;
    }
#endif
    if (bytes > 0) std::memcpy(out.data(), data(), bytes);
    return out;
  }
};

struct View {
  DLTensor t{};
  int64_t shape[2] = {0, 0};
  View(Mem& m, std::vector<int64_t> dims, DLDataType dtype) {
    for (std::size_t i = 0; i < dims.size(); ++i) shape[i] = dims[i];
    t.data = m.data();
    t.device = m.cuda ? DLDevice{kDLCUDA, 0} : DLDevice{kDLCPU, 0};
    t.ndim = static_cast<int32_t>(dims.size());
    t.dtype = dtype;
    t.shape = shape;
  }
  View(const View&) = delete;
  View& operator=(const View&) = delete;
  DLTensor* get() { return &t; }
};

std::size_t elem(DLDataType t) { return t.bits / 8u; }

// Everything one weight does on one device in one dtype: quantize, dequantize, matmul.
struct Outcome {
  int32_t rc = 0;
  std::string error;
  uint64_t workspace_bytes = 0, matmul_workspace_bytes = 0;
  std::vector<uint8_t> codes, zeros;
  std::vector<float> scales;
  std::vector<unsigned char> decoded, y;  // in the call's dtype
};

// w [n, k], x [m, k], bias [n] as raw values of `dtype` (float32 or 16-bit patterns).
Outcome run(Quantizer& q, DLDataType dtype, bool cuda, const void* w, const void* x,
            const void* bias, int64_t n, int64_t k, int64_t m, bool matmul) {
  Outcome o;
  int64_t shape[2] = {n, k};
  loom_quant_format f{};
  f.struct_size = LOOM_QUANT_FORMAT_SIZE;
  loom_quantizer_layout_args l{};
  l.struct_size = LOOM_QUANTIZER_LAYOUT_ARGS_SIZE;
  l.role = LOOM_QUANTIZER_WEIGHT;
  l.ndim = 2;
  l.shape = shape;
  l.dtype = dtype;
  l.matmul_rows = m;
  l.format = &f;
  if ((o.rc = q.take(q.t->layout(q.obj, &l))) != 0) {
    o.error = q.error;
    return o;
  }
  o.workspace_bytes = l.workspace_bytes;
  o.matmul_workspace_bytes = l.matmul_workspace_bytes;
  const std::size_t e = elem(dtype);
  Mem bw(static_cast<std::size_t>(n * k) * e, cuda), bd(static_cast<std::size_t>(n * k) * e, cuda);
  bw.put(w);
  Mem bp(l.packed_bytes, cuda), bs(static_cast<std::size_t>(l.scale_count) * 4, cuda),
      bz(static_cast<std::size_t>(l.zero_point_count), cuda), ws(l.workspace_bytes, cuda);
  View vw(bw, {n, k}, dtype), vd(bd, {n, k}, dtype),
      vp(bp, {static_cast<int64_t>(l.packed_bytes)}, kU8), vs(bs, {l.scale_count}, kF32),
      vz(bz, {l.zero_point_count}, kU8);
  loom_quantizer_quantize_args a{};
  a.struct_size = LOOM_QUANTIZER_QUANTIZE_ARGS_SIZE;
  a.role = LOOM_QUANTIZER_WEIGHT;
  a.format = &f;
  a.x = vw.get();
  a.packed = vp.get();
  a.scales = vs.get();
  a.zero_points = l.zero_point_count == 0 ? nullptr : vz.get();
  a.workspace = l.workspace_bytes == 0 ? nullptr : ws.data();
  a.workspace_bytes = l.workspace_bytes;
  if ((o.rc = q.take(q.t->quantize(q.obj, &a))) != 0) {
    o.error = q.error;
    return o;
  }
  o.codes = bp.get<uint8_t>();
  o.scales = bs.get<float>();
  o.zeros = bz.get<uint8_t>();
  a.x = vd.get();
  if ((o.rc = q.take(q.t->dequantize(q.obj, &a))) != 0) {
    o.error = q.error;
    return o;
  }
  o.decoded = bd.get<unsigned char>();
  if (!matmul) return o;
  Mem bx(static_cast<std::size_t>(m * k) * e, cuda), bb(static_cast<std::size_t>(n) * e, cuda),
      by(static_cast<std::size_t>(m * n) * e, cuda), mws(l.matmul_workspace_bytes, cuda);
  bx.put(x);
  bb.put(bias);
  View vx(bx, {m, k}, dtype), vb(bb, {n}, dtype), vy(by, {m, n}, dtype);
  loom_quantizer_matmul_args ma{};
  ma.struct_size = LOOM_QUANTIZER_MATMUL_ARGS_SIZE;
  ma.format = &f;
  ma.x = vx.get();
  ma.packed = vp.get();
  ma.scales = vs.get();
  ma.zero_points = a.zero_points;
  ma.bias = vb.get();
  ma.y = vy.get();
  ma.workspace = l.matmul_workspace_bytes == 0 ? nullptr : mws.data();
  ma.workspace_bytes = l.matmul_workspace_bytes;
  if ((o.rc = q.take(q.t->matmul(q.obj, &ma))) != 0) {
    o.error = q.error;
    return o;
  }
  o.y = by.get<unsigned char>();
  return o;
}

std::vector<float> sample(std::size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(n);
  for (auto& v : x) v = nd(rng);
  return x;
}

template <class T>
std::vector<T> as(const std::vector<unsigned char>& b) {
  std::vector<T> out(b.size() / sizeof(T));
  if (!b.empty()) std::memcpy(out.data(), b.data(), b.size());
  return out;
}

const char* kManifest = R"(
[quantizer.w8]
plugin = "zeroquant"
activation_bits = 0

[quantizer.w4]
plugin = "zeroquant"
bits = 4
symmetric = false
group_size = 16
range = "deepspeed"
activation_bits = 0

[quantizer.w4only]
plugin = "zeroquant"
bits = 4
group_size = 32
activation_bits = 0

[quantizer.w3]
plugin = "zeroquant"
bits = 3
group_size = 24
activation_bits = 0

[quantizer.w8a8]
plugin = "zeroquant"

[quantizer.w4a8]
plugin = "zeroquant"
bits = 4
group_size = 32

[quantizer.ternary]
plugin = "xtc"
group_size = 16

[quantizer.binary]
plugin = "xtc"
mode = "binary"
)";

constexpr const char* kNames[] = {"w8", "w4", "w4only", "w3", "w8a8", "w4a8", "ternary", "binary"};

bool have_device() {
#if LOOM_TEST_CUDA
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
#else
  return false;
#endif
}

// The device this build tests: CUDA tensors (checked against the CPU) or CPU tensors.
constexpr bool kCuda = LOOM_TEST_CUDA != 0;

TEST(Float16Quant, SixteenBitCallsAreTheFloat32CallsRounded) {
  if (kCuda && !have_device()) GTEST_SKIP() << "no CUDA device";
  Session s(kManifest);
  const int64_t n = 6, k = 96, m = 3;
  for (const DLDataType dtype : {kBF16, kF16}) {
    const bool bf = is_bf16(dtype);
    const auto w16 = to16(sample(static_cast<std::size_t>(n * k), 1), bf);
    const auto x16 = to16(sample(static_cast<std::size_t>(m * k), 2), bf);
    const auto b16 = to16(sample(static_cast<std::size_t>(n), 3), bf);
    const auto w32 = to32(w16, bf), x32 = to32(x16, bf), b32 = to32(b16, bf);
    for (const char* name : kNames) {
      SCOPED_TRACE(std::string(name) + (bf ? " bf16" : " f16") + (kCuda ? " cuda" : " cpu"));
      Quantizer q(s, name);
      // The float32 call on the CPU is the reference of every 16-bit call.
      const Outcome ref = run(q, kF32, false, w32.data(), x32.data(), b32.data(), n, k, m, true);
      if (ref.rc == LOOM_ERR_UNIMPLEMENTED) continue;  // a CPU build without oneDNN's INT8 GEMM
      ASSERT_EQ(ref.rc, 0) << ref.error;
      const Outcome got = run(q, dtype, kCuda, w16.data(), x16.data(), b16.data(), n, k, m, true);
      ASSERT_EQ(got.rc, 0) << got.error;
      EXPECT_GE(got.workspace_bytes, ref.workspace_bytes + static_cast<uint64_t>(n * k) * 4);
      EXPECT_GE(got.matmul_workspace_bytes,
                ref.matmul_workspace_bytes + static_cast<uint64_t>(m * k + m * n + n) * 4);
      EXPECT_EQ(got.codes, ref.codes);
      EXPECT_EQ(got.zeros, ref.zeros);
      ASSERT_EQ(got.scales.size(), ref.scales.size());
      EXPECT_EQ(0, std::memcmp(got.scales.data(), ref.scales.data(), 4 * got.scales.size()));
      EXPECT_EQ(as<uint16_t>(got.decoded), to16(as<float>(ref.decoded), bf));
      if (!kCuda) {
        EXPECT_EQ(as<uint16_t>(got.y), to16(as<float>(ref.y), bf));
      } else {
        // The CUDA matmul sums in another order than the CPU's: the same as CUDA's float32
        // call, rounded.
        const Outcome dev32 = run(q, kF32, true, w32.data(), x32.data(), b32.data(), n, k, m, true);
        ASSERT_EQ(dev32.rc, 0) << dev32.error;
        EXPECT_EQ(as<uint16_t>(got.y), to16(as<float>(dev32.y), bf));
      }
    }
  }
}

TEST(Float16Quant, ANonFiniteSixteenBitElementIsNamed) {
  if (kCuda && !have_device()) GTEST_SKIP() << "no CUDA device";
  Session s(kManifest);
  const int64_t n = 4, k = 32;
  for (const DLDataType dtype : {kBF16, kF16}) {
    const bool bf = is_bf16(dtype);
    for (const char* name : {"w8", "ternary"}) {
      SCOPED_TRACE(std::string(name) + (bf ? " bf16" : " f16"));
      Quantizer q(s, name);
      auto w16 = to16(sample(static_cast<std::size_t>(n * k), 4), bf);
      w16[2 * k + 7] = bf ? 0x7fc0 : 0x7e00;  // a quiet NaN
      const Outcome o = run(q, dtype, kCuda, w16.data(), nullptr, nullptr, n, k, 0, false);
      EXPECT_EQ(o.rc, LOOM_ERR_INVALID_ARGUMENT);
      const bool named = o.error.find("[2, 7]") != std::string::npos ||
                         o.error.find("(2, 7)") != std::string::npos;
      EXPECT_TRUE(named) << o.error;
    }
  }
}

TEST(Float16Quant, TheStagingWorkspaceIsRequired) {
  if (kCuda && !have_device()) GTEST_SKIP() << "no CUDA device";
  Session s(kManifest);
  Quantizer q(s, "w8");
  const int64_t n = 4, k = 32;
  int64_t shape[2] = {n, k};
  loom_quant_format f{};
  f.struct_size = LOOM_QUANT_FORMAT_SIZE;
  loom_quantizer_layout_args l{};
  l.struct_size = LOOM_QUANTIZER_LAYOUT_ARGS_SIZE;
  l.role = LOOM_QUANTIZER_WEIGHT;
  l.ndim = 2;
  l.shape = shape;
  l.dtype = kBF16;
  l.format = &f;
  ASSERT_EQ(q.take(q.t->layout(q.obj, &l)), 0) << q.error;
  ASSERT_GE(l.workspace_bytes, static_cast<uint64_t>(n * k) * 4);
  const auto w16 = to16(sample(static_cast<std::size_t>(n * k), 5), true);
  Mem bw(w16, kCuda), bp(l.packed_bytes, kCuda),
      bs(static_cast<std::size_t>(l.scale_count) * 4, kCuda);
  View vw(bw, {n, k}, kBF16), vp(bp, {static_cast<int64_t>(l.packed_bytes)}, kU8),
      vs(bs, {l.scale_count}, kF32);
  loom_quantizer_quantize_args a{};
  a.struct_size = LOOM_QUANTIZER_QUANTIZE_ARGS_SIZE;
  a.role = LOOM_QUANTIZER_WEIGHT;
  a.format = &f;
  a.x = vw.get();
  a.packed = vp.get();
  a.scales = vs.get();
  EXPECT_EQ(q.take(q.t->quantize(q.obj, &a)), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(q.error.find("workspace"), std::string::npos) << q.error;
}

}  // namespace
