// zeroquant through the host on CUDA tensors against the same calls on CPU tensors:
// quantize and dequantize bit for bit, the W8A8 / W4A8 matmul bit for bit (the int32
// accumulation is exact on both, and the CPU and CUDA epilogues apply the scales and the bias
// in the same order), through cuBLASLt where the shape allows and the simple kernel where it
// does not; the weight-only matmul within float rounding; a non-finite weight named. Skips
// without a CUDA device (the CUDA emulation provides one).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <loom/embed.h>
#include <loom/kinds/quantizer.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

constexpr const char* kKind = LOOM_KIND_QUANTIZER;
constexpr DLDataType kF32{kDLFloat, 32, 1};
constexpr DLDataType kU8{kDLUInt, 8, 1};

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

// A DLTensor over a caller's buffer.
struct View {
  DLTensor t{};
  int64_t shape[2] = {0, 0};
  View(const void* data, std::vector<int64_t> dims, DLDataType dtype, bool cuda = false) {
    for (std::size_t i = 0; i < dims.size(); ++i) shape[i] = dims[i];
    t.data = const_cast<void*>(data);
    t.device = cuda ? DLDevice{kDLCUDA, 0} : DLDevice{kDLCPU, 0};
    t.ndim = static_cast<int32_t>(dims.size());
    t.dtype = dtype;
    t.shape = shape;
  }
  View(const View&) = delete;
  View& operator=(const View&) = delete;
  DLTensor* get() { return &t; }
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

struct Laid {
  int64_t shape[2];
  loom_quant_format f{};
  loom_quantizer_layout_args a{};
};

int32_t lay_out(Quantizer& q, int32_t role, int64_t rows, int64_t k, int64_t matmul_rows, Laid& l) {
  l.shape[0] = rows;
  l.shape[1] = k;
  l.f = loom_quant_format{};
  l.f.struct_size = LOOM_QUANT_FORMAT_SIZE;
  l.a = loom_quantizer_layout_args{};
  l.a.struct_size = LOOM_QUANTIZER_LAYOUT_ARGS_SIZE;
  l.a.role = role;
  l.a.ndim = 2;
  l.a.shape = l.shape;
  l.a.dtype = kF32;
  l.a.matmul_rows = matmul_rows;
  l.a.format = &l.f;
  return q.take(q.t->layout(q.obj, &l.a));
}

std::vector<float> sample(std::size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(n);
  for (auto& v : x) v = nd(rng);
  return x;
}

// A buffer on the host or on the device (cudaMalloc gives 256-byte alignment).
template <class T>
struct Buf {
  bool cuda;
  std::vector<T> host;
  T* dev = nullptr;
  Buf(std::size_t n, bool on_cuda, T fill = T{}) : cuda(on_cuda), host(n, fill) {
    if (cuda) {
      EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&dev), (n == 0 ? 1 : n) * sizeof(T)),
                cudaSuccess);
      if (n > 0) {
        EXPECT_EQ(cudaMemcpy(dev, host.data(), n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
      }
    }
  }
  Buf(const std::vector<T>& v, bool on_cuda) : Buf(v.size(), on_cuda) {
    host = v;
    if (cuda && !v.empty()) {
      EXPECT_EQ(cudaMemcpy(dev, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice),
                cudaSuccess);
    }
  }
  ~Buf() {
    if (dev != nullptr) cudaFree(dev);
  }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  T* data() { return cuda ? dev : host.data(); }
  std::vector<T> read() {
    if (cuda) {
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      if (!host.empty()) {
        EXPECT_EQ(cudaMemcpy(host.data(), dev, host.size() * sizeof(T), cudaMemcpyDeviceToHost),
                  cudaSuccess);
      }
    }
    return host;
  }
  int64_t size() const { return static_cast<int64_t>(host.size()); }
};

struct Result {
  int32_t rc = 0;
  std::string error;
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  std::vector<uint8_t> zeros;
  std::vector<float> decoded;
  std::vector<float> y;
};

// Quantize W, dequantize it, and y = x W^T + bias, on one device.
Result run(Quantizer& q, bool cuda, const std::vector<float>& w, int64_t n, int64_t k,
           const std::vector<float>& x, int64_t m, const std::vector<float>& bias) {
  Result r;
  Laid l;
  r.rc = lay_out(q, LOOM_QUANTIZER_WEIGHT, n, k, m, l);
  if (r.rc != 0) {
    r.error = q.error;
    return r;
  }
  Buf<float> bw(w, cuda), bx(x, cuda), bb(bias, cuda), bd(w.size(), cuda),
      by(static_cast<std::size_t>(m * n), cuda);
  Buf<uint8_t> bp(l.a.packed_bytes, cuda, 0xEE),
      bz(static_cast<std::size_t>(l.a.zero_point_count), cuda);
  Buf<float> bs(static_cast<std::size_t>(l.a.scale_count), cuda);
  Buf<unsigned char> ws(l.a.matmul_workspace_bytes + 256, cuda);
  View vw(bw.data(), {n, k}, kF32, cuda), vd(bd.data(), {n, k}, kF32, cuda);
  View vp(bp.data(), {bp.size()}, kU8, cuda), vs(bs.data(), {bs.size()}, kF32, cuda),
      vz(bz.data(), {bz.size()}, kU8, cuda);
  loom_quantizer_quantize_args a{};
  a.struct_size = LOOM_QUANTIZER_QUANTIZE_ARGS_SIZE;
  a.role = LOOM_QUANTIZER_WEIGHT;
  a.format = &l.f;
  a.x = vw.get();
  a.packed = vp.get();
  a.scales = vs.get();
  a.zero_points = bz.size() == 0 ? nullptr : vz.get();
  r.rc = q.take(q.t->quantize(q.obj, &a));
  if (r.rc != 0) {
    r.error = q.error;
    return r;
  }
  a.x = vd.get();
  r.rc = q.take(q.t->dequantize(q.obj, &a));
  if (r.rc != 0) {
    r.error = q.error;
    return r;
  }
  View vx(bx.data(), {m, k}, kF32, cuda), vb(bb.data(), {n}, kF32, cuda),
      vy(by.data(), {m, n}, kF32, cuda);
  loom_quantizer_matmul_args mm{};
  mm.struct_size = LOOM_QUANTIZER_MATMUL_ARGS_SIZE;
  mm.format = &l.f;
  mm.x = vx.get();
  mm.packed = vp.get();
  mm.scales = vs.get();
  mm.zero_points = a.zero_points;
  mm.bias = vb.get();
  mm.y = vy.get();
  // 256-byte aligned (the emulated cudaMalloc does not promise it).
  unsigned char* base =
      reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(ws.data()) + 255) / 256 * 256);
  mm.workspace = l.a.matmul_workspace_bytes == 0 ? nullptr : base;
  mm.workspace_bytes = l.a.matmul_workspace_bytes;
  r.rc = q.take(q.t->matmul(q.obj, &mm));
  r.error = q.error;
  r.codes = bp.read();
  r.scales = bs.read();
  r.zeros = bz.read();
  r.decoded = bd.read();
  r.y = by.read();
  return r;
}

const char* kManifest = R"(
[quantizer.w8]
plugin = "zeroquant"

[quantizer.w4g]
plugin = "zeroquant"
bits = 4
symmetric = false
group_size = 16
range = "deepspeed"

[quantizer.w4only]
plugin = "zeroquant"
bits = 4
group_size = 32
activation_bits = 0
)";

class ZeroQuantCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_F(ZeroQuantCuda, CudaCallsMatchTheCpuCalls) {
  Session s(kManifest);
  struct Shape {
    int64_t n, k, m;
  };
  // 8 x 64: cuBLASLt's int8 layout; 7 x 48: N not a multiple of 4, the simple kernel.
  for (const Shape sh : {Shape{8, 64, 3}, Shape{7, 48, 2}}) {
    for (const char* name : {"w8", "w4g", "w4only"}) {
      SCOPED_TRACE(std::string(name) + " n " + std::to_string(sh.n) + " k " + std::to_string(sh.k));
      Quantizer q(s, name);
      const auto w = sample(static_cast<std::size_t>(sh.n * sh.k), 5);
      const auto x = sample(static_cast<std::size_t>(sh.m * sh.k), 6);
      const auto bias = sample(static_cast<std::size_t>(sh.n), 7);
      const Result cpu = run(q, false, w, sh.n, sh.k, x, sh.m, bias);
      ASSERT_EQ(cpu.rc, 0) << cpu.error;
      const Result gpu = run(q, true, w, sh.n, sh.k, x, sh.m, bias);
      ASSERT_EQ(gpu.rc, 0) << gpu.error;
      EXPECT_EQ(gpu.codes, cpu.codes);
      EXPECT_EQ(
          0, std::memcmp(gpu.scales.data(), cpu.scales.data(), cpu.scales.size() * sizeof(float)));
      EXPECT_EQ(gpu.zeros, cpu.zeros);
      EXPECT_EQ(0, std::memcmp(gpu.decoded.data(), cpu.decoded.data(),
                               cpu.decoded.size() * sizeof(float)));
      if (std::string(name) == "w4only") {
        for (std::size_t i = 0; i < cpu.y.size(); ++i) {
          EXPECT_NEAR(gpu.y[i], cpu.y[i], 1e-4 * (1.0 + std::fabs(cpu.y[i]))) << i;
        }
      } else {
        EXPECT_EQ(0, std::memcmp(gpu.y.data(), cpu.y.data(), cpu.y.size() * sizeof(float)));
      }
    }
  }
}

// With first_bad (ABI 1.7) the check's outcome is written on the device, in stream order,
// and the call returns OK: -1, or the first non-finite element, as the CPU writes it.
TEST_F(ZeroQuantCuda, FirstBadIsWrittenOnTheDevice) {
  Session s(kManifest);
  Quantizer q(s, "w8");
  const int64_t n = 4, k = 8;
  Laid l;
  ASSERT_EQ(lay_out(q, LOOM_QUANTIZER_WEIGHT, n, k, 0, l), 0) << q.error;
  for (int64_t at : {int64_t{-1}, int64_t{2 * 8 + 3}, int64_t{0}}) {
    SCOPED_TRACE(at);
    auto w = sample(n * k, 1);
    if (at >= 0) w[static_cast<std::size_t>(at)] = NAN;
    if (at >= 0) w[static_cast<std::size_t>(n * k - 1)] = INFINITY;  // a later one does not win
    Buf<float> bw(w, true), bs(static_cast<std::size_t>(l.a.scale_count), true);
    Buf<uint8_t> bp(l.a.packed_bytes, true, 0xEE);
    Buf<int64_t> bb(std::vector<int64_t>{77}, true);
    View vw(bw.data(), {n, k}, kF32, true), vp(bp.data(), {bp.size()}, kU8, true),
        vs(bs.data(), {bs.size()}, kF32, true), vb(bb.data(), {1}, DLDataType{kDLInt, 64, 1}, true);
    loom_quantizer_quantize_args a{};
    a.struct_size = LOOM_QUANTIZER_QUANTIZE_ARGS_SIZE;
    a.role = LOOM_QUANTIZER_WEIGHT;
    a.format = &l.f;
    a.x = vw.get();
    a.packed = vp.get();
    a.scales = vs.get();
    a.first_bad = vb.get();
    ASSERT_EQ(q.take(q.t->quantize(q.obj, &a)), 0) << q.error;
    EXPECT_EQ(bb.read()[0], at);
    // a host first_bad for device x is refused by name
    int64_t host = 0;
    View vh(&host, {1}, DLDataType{kDLInt, 64, 1});
    a.first_bad = vh.get();
    EXPECT_EQ(q.take(q.t->quantize(q.obj, &a)), LOOM_ERR_INVALID_ARGUMENT);
    EXPECT_NE(q.error.find("first_bad"), std::string::npos) << q.error;
  }
}

TEST_F(ZeroQuantCuda, NonFiniteWeightIsNamed) {
  Session s(kManifest);
  Quantizer q(s, "w8");
  auto w = sample(4 * 8, 1);
  w[2 * 8 + 3] = INFINITY;
  const Result r = run(q, true, w, 4, 8, sample(8, 2), 1, sample(4, 3));
  EXPECT_EQ(r.rc, LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(r.error.find("weight x[2, 3] is inf"), std::string::npos) << r.error;
}

}  // namespace
