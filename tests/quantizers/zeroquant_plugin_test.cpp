// zeroquant through the host (the path `loom quantize` and the trainer take): layout for both
// roles, quantize / dequantize against the core's reference bit for bit, the W8A8 and
// weight-only matmuls against the core called directly and against dequantize-then-matmul,
// errors as statuses that name the element, parameter or tensor, `loom describe` docs for
// every parameter and `loom check` reporting bad parameters at their key.
#include <gtest/gtest.h>
#include <loom/embed.h>
#include <loom/kinds/quantizer.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "int8_gemm.hpp"
#include "int_kernels.hpp"
#include "quant_core.hpp"

namespace {

namespace lq = loom::quant;
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
  View(const void* data, std::vector<int64_t> dims, DLDataType dtype) {
    for (std::size_t i = 0; i < dims.size(); ++i) shape[i] = dims[i];
    t.data = const_cast<void*>(data);
    t.device = DLDevice{kDLCPU, 0};
    t.ndim = static_cast<int32_t>(dims.size());
    t.dtype = dtype;
    t.shape = shape;
  }
  View(const View&) = delete;
  View& operator=(const View&) = delete;
  DLTensor* get() { return &t; }
};

// 256-byte aligned scratch.
struct Workspace {
  std::vector<unsigned char> buf;
  void* p = nullptr;
  explicit Workspace(uint64_t bytes) : buf(bytes + 256) {
    p = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(buf.data()) + 255) / 256 * 256);
  }
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

struct Packed {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  std::vector<uint8_t> zeros;
};

int32_t quantize(Quantizer& q, int32_t role, const Laid& l, const std::vector<float>& x, Packed& p,
                 bool dequant = false, std::vector<float>* out = nullptr,
                 DLTensor* first_bad = nullptr,
                 uint32_t struct_size = LOOM_QUANTIZER_QUANTIZE_ARGS_SIZE) {
  if (!dequant) {
    p.codes.assign(l.a.packed_bytes, 0xEE);
    p.scales.assign(static_cast<std::size_t>(l.a.scale_count), -1.0f);
    p.zeros.assign(static_cast<std::size_t>(l.a.zero_point_count), 0xEE);
  }
  View vx(dequant ? static_cast<const void*>(out->data()) : x.data(), {l.shape[0], l.shape[1]},
          kF32);
  View vp(p.codes.data(), {static_cast<int64_t>(p.codes.size())}, kU8);
  View vs(p.scales.data(), {static_cast<int64_t>(p.scales.size())}, kF32);
  View vz(p.zeros.data(), {static_cast<int64_t>(p.zeros.size())}, kU8);
  loom_quantizer_quantize_args a{};
  a.struct_size = struct_size;
  a.first_bad = first_bad;
  a.role = role;
  a.format = &l.f;
  a.x = vx.get();
  a.packed = vp.get();
  a.scales = vs.get();
  a.zero_points = p.zeros.empty() ? nullptr : vz.get();
  return q.take(dequant ? q.t->dequantize(q.obj, &a) : q.t->quantize(q.obj, &a));
}

std::vector<float> sample(std::size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(n);
  for (auto& v : x) v = nd(rng);
  return x;
}

const char* kManifest = R"(
[quantizer.w8]
plugin = "zeroquant"

[quantizer.w4]
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

[quantizer.odd]
plugin = "zeroquant"
bits = 4
group_size = 24
)";

TEST(ZeroQuantPlugin, LayoutOfTheDefaultsAndOfGroups) {
  Session s(kManifest);
  Quantizer w8(s, "w8");
  Laid l;
  ASSERT_EQ(lay_out(w8, LOOM_QUANTIZER_WEIGHT, 6, 40, 3, l), 0) << w8.error;
  EXPECT_EQ(l.f.scheme, LOOM_QUANT_INT);
  EXPECT_EQ(l.f.bits, 8u);
  EXPECT_EQ(l.f.flags, LOOM_QUANT_SYMMETRIC);
  EXPECT_EQ(l.f.packing, LOOM_QUANT_PACK_LSB_FIRST);
  EXPECT_EQ(l.f.axis, 1);
  EXPECT_EQ(l.f.group_size, 40);
  EXPECT_EQ(l.a.packed_bytes, 240u);
  EXPECT_EQ(l.a.scale_count, 6);
  EXPECT_EQ(l.a.zero_point_count, 0);
  EXPECT_EQ(l.a.flags, LOOM_QUANTIZER_HAS_MATMUL | LOOM_QUANTIZER_INT8_ACTIVATIONS);
  EXPECT_GT(l.a.matmul_workspace_bytes, 0u);
  Quantizer w4(s, "w4");
  ASSERT_EQ(lay_out(w4, LOOM_QUANTIZER_WEIGHT, 6, 48, 0, l), 0) << w4.error;
  EXPECT_EQ(l.f.bits, 4u);
  EXPECT_EQ(l.f.flags, 0u);
  EXPECT_EQ(l.f.group_size, 16);
  EXPECT_EQ(l.a.packed_bytes, 144u);
  EXPECT_EQ(l.a.scale_count, 18);  // 6 rows x 48 / 16
  EXPECT_EQ(l.a.zero_point_count, 18);
  EXPECT_EQ(l.f.zero_point_dtype.code, kDLUInt);
  Quantizer only(s, "w4only");
  ASSERT_EQ(lay_out(only, LOOM_QUANTIZER_WEIGHT, 6, 64, 2, l), 0) << only.error;
  EXPECT_EQ(l.a.flags, LOOM_QUANTIZER_HAS_MATMUL);
  ASSERT_EQ(lay_out(only, LOOM_QUANTIZER_ACTIVATION, 5, 64, 0, l), 0) << only.error;
  EXPECT_EQ(l.f.bits, 8u);
  EXPECT_EQ(l.f.group_size, 64);
  EXPECT_EQ(l.a.scale_count, 5);
  EXPECT_EQ(l.a.flags, 0u);
}

TEST(ZeroQuantPlugin, GroupSizeNotDividingKIsRefusedForTheInt8Gemm) {
  Session s(kManifest);
  Quantizer odd(s, "odd");
  Laid l;
  EXPECT_EQ(lay_out(odd, LOOM_QUANTIZER_WEIGHT, 4, 48, 0, l), 0) << odd.error;
  EXPECT_EQ(lay_out(odd, LOOM_QUANTIZER_WEIGHT, 4, 40, 0, l), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(odd.error.find("group_size 24 does not divide K = 40"), std::string::npos) << odd.error;
  // Weight-only takes a shorter last group.
  Quantizer only(s, "w4only");
  EXPECT_EQ(lay_out(only, LOOM_QUANTIZER_WEIGHT, 4, 40, 0, l), 0) << only.error;
  EXPECT_EQ(l.a.scale_count, 8);
}

TEST(ZeroQuantPlugin, AKGroupBeyondTheInt32AccumulatorIsRefused) {
  // 127 * 128 * 132104 fits int32; one more column does not.
  Session s(kManifest);
  Quantizer w8(s, "w8");
  Laid l;
  EXPECT_EQ(lay_out(w8, LOOM_QUANTIZER_WEIGHT, 1, 132104, 0, l), 0) << w8.error;
  EXPECT_EQ(lay_out(w8, LOOM_QUANTIZER_WEIGHT, 1, 132105, 0, l), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(w8.error.find("group_size 0 (one group of K = 132105) is over 132104"),
            std::string::npos)
      << w8.error;
  EXPECT_NE(w8.error.find("int32 accumulator"), std::string::npos) << w8.error;
  // Weight-only matmul has no int32 accumulator.
  Quantizer only(s, "w4only");
  EXPECT_EQ(lay_out(only, LOOM_QUANTIZER_WEIGHT, 1, 132105, 0, l), 0) << only.error;
}

TEST(ZeroQuantPlugin, QuantizeAndDequantizeAreTheReferences) {
  Session s(kManifest);
  const int64_t n = 5, k = 48;
  const auto x = sample(n * k, 7);
  struct Want {
    const char* name;
    lq::IntScheme q;
    int64_t group;
  };
  for (const Want& w : {Want{"w8", {8, true, lq::Range::kExact}, 0},
                        Want{"w4", {4, false, lq::Range::kDeepSpeed}, 16},
                        Want{"w4only", {4, true, lq::Range::kExact}, 32}}) {
    SCOPED_TRACE(w.name);
    Quantizer qz(s, w.name);
    Laid l;
    ASSERT_EQ(lay_out(qz, LOOM_QUANTIZER_WEIGHT, n, k, 0, l), 0) << qz.error;
    Packed p;
    ASSERT_EQ(quantize(qz, LOOM_QUANTIZER_WEIGHT, l, x, p), 0) << qz.error;
    const lq::Groups gs = lq::Groups::of(n, k, w.group);
    std::vector<uint8_t> codes(l.a.packed_bytes);
    std::vector<float> scales(gs.count());
    std::vector<uint8_t> zeros(gs.count());
    lq::reference_quantize(x.data(), gs, w.q, LOOM_QUANT_PACK_LSB_FIRST, codes.data(),
                           scales.data(), zeros.data());
    EXPECT_EQ(p.codes, codes);
    EXPECT_EQ(p.scales, scales);
    if (!w.q.symmetric) {
      EXPECT_EQ(p.zeros, zeros);
    }
    std::vector<float> back(x.size(), NAN), want(x.size());
    ASSERT_EQ(quantize(qz, LOOM_QUANTIZER_WEIGHT, l, x, p, true, &back), 0) << qz.error;
    lq::reference_dequantize(codes.data(), scales.data(), zeros.data(), gs, w.q,
                             LOOM_QUANT_PACK_LSB_FIRST, want.data());
    EXPECT_EQ(back, want);
  }
  // The activation role: token-wise INT8.
  Quantizer qz(s, "w4");
  Laid l;
  ASSERT_EQ(lay_out(qz, LOOM_QUANTIZER_ACTIVATION, n, k, 0, l), 0) << qz.error;
  Packed p;
  ASSERT_EQ(quantize(qz, LOOM_QUANTIZER_ACTIVATION, l, x, p), 0) << qz.error;
  std::vector<int8_t> q8(x.size());
  std::vector<float> s8(n);
  lq::reference_quantize_rows_int8(x.data(), n, k, q8.data(), s8.data());
  EXPECT_EQ(0, std::memcmp(p.codes.data(), q8.data(), q8.size()));
  EXPECT_EQ(p.scales, s8);
}

int32_t matmul(Quantizer& q, const Laid& l, const Packed& p, const std::vector<float>& x, int64_t m,
               const std::vector<float>* bias, std::vector<float>& y) {
  const int64_t n = l.shape[0], k = l.shape[1];
  y.assign(static_cast<std::size_t>(m * n), NAN);
  View vx(x.data(), {m, k}, kF32);
  View vp(p.codes.data(), {static_cast<int64_t>(p.codes.size())}, kU8);
  View vs(p.scales.data(), {static_cast<int64_t>(p.scales.size())}, kF32);
  View vz(p.zeros.data(), {static_cast<int64_t>(p.zeros.size())}, kU8);
  View vb(bias != nullptr ? bias->data() : nullptr, {n}, kF32);
  View vy(y.data(), {m, n}, kF32);
  Workspace ws(l.a.matmul_workspace_bytes);
  loom_quantizer_matmul_args a{};
  a.struct_size = LOOM_QUANTIZER_MATMUL_ARGS_SIZE;
  a.format = &l.f;
  a.x = vx.get();
  a.packed = vp.get();
  a.scales = vs.get();
  a.zero_points = p.zeros.empty() ? nullptr : vz.get();
  a.bias = bias != nullptr ? vb.get() : nullptr;
  a.y = vy.get();
  a.workspace = ws.p;
  a.workspace_bytes = l.a.matmul_workspace_bytes;
  return q.take(q.t->matmul(q.obj, &a));
}

TEST(ZeroQuantPlugin, MatmulsAgreeWithTheCoreAndWithDequantizeThenMatmul) {
  Session s(kManifest);
  const int64_t n = 7, k = 64, m = 3;
  const auto wf = sample(n * k, 1);
  const auto x = sample(m * k, 2);
  const auto bias = sample(n, 3);
  for (const char* name : {"w8", "w4", "w4only"}) {
    SCOPED_TRACE(name);
    if (std::string(name) != "w4only" && !lq::have_int8_gemm()) continue;
    Quantizer qz(s, name);
    Laid l;
    ASSERT_EQ(lay_out(qz, LOOM_QUANTIZER_WEIGHT, n, k, m, l), 0) << qz.error;
    Packed p;
    ASSERT_EQ(quantize(qz, LOOM_QUANTIZER_WEIGHT, l, wf, p), 0) << qz.error;
    std::vector<float> y;
    ASSERT_EQ(matmul(qz, l, p, x, m, &bias, y), 0) << qz.error;
    std::vector<float> wd(wf.size());
    ASSERT_EQ(quantize(qz, LOOM_QUANTIZER_WEIGHT, l, wf, p, true, &wd), 0) << qz.error;
    const bool int8 = (l.a.flags & LOOM_QUANTIZER_INT8_ACTIVATIONS) != 0;
    for (int64_t i = 0; i < m; ++i) {
      float amax = 0;
      for (int64_t c = 0; c < k; ++c) amax = std::max(amax, std::fabs(x[i * k + c]));
      for (int64_t j = 0; j < n; ++j) {
        double want = bias[j], wabs = 0, mag = std::fabs(bias[j]);
        for (int64_t c = 0; c < k; ++c) {
          want += static_cast<double>(x[i * k + c]) * wd[j * k + c];
          wabs += std::fabs(wd[j * k + c]);
          mag += std::fabs(x[i * k + c] * wd[j * k + c]);
        }
        // Weight-only: float rounding only. W8A8 / W4A8: plus x's rounding to INT8, at most
        // half a step (max|x_i| / 254) per element.
        const double tol = int8 ? 0.5 * amax / 127 * wabs * 1.001 + 1e-5 : 1e-5 * mag + 1e-6;
        EXPECT_NEAR(y[i * n + j], want, tol) << "y[" << i << ", " << j << "]";
      }
    }
  }
}

TEST(ZeroQuantPlugin, BadInputGetsClearErrors) {
  Session s(kManifest);
  Quantizer qz(s, "w8");
  const int64_t n = 3, k = 8;
  Laid l;
  ASSERT_EQ(lay_out(qz, LOOM_QUANTIZER_WEIGHT, n, k, 2, l), 0) << qz.error;
  auto x = sample(n * k, 4);
  x[1 * k + 2] = NAN;
  Packed p;
  EXPECT_EQ(quantize(qz, LOOM_QUANTIZER_WEIGHT, l, x, p), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(qz.error.find("weight x[1, 2] is nan"), std::string::npos) << qz.error;
  x[1 * k + 2] = -INFINITY;
  EXPECT_EQ(quantize(qz, LOOM_QUANTIZER_WEIGHT, l, x, p), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(qz.error.find("x[1, 2] is -inf"), std::string::npos) << qz.error;
  x[1 * k + 2] = 0.5f;
  // A format that is not the layout's.
  Laid wrong = l;
  wrong.a.format = &wrong.f;
  wrong.f.shape = wrong.shape;
  wrong.f.bits = 4;
  EXPECT_EQ(quantize(qz, LOOM_QUANTIZER_WEIGHT, wrong, x, p), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(qz.error.find("bits"), std::string::npos) << qz.error;
  // A float64 layout.
  Laid l64;
  l64.shape[0] = n;
  l64.shape[1] = k;
  l64.f.struct_size = LOOM_QUANT_FORMAT_SIZE;
  l64.a.struct_size = LOOM_QUANTIZER_LAYOUT_ARGS_SIZE;
  l64.a.role = LOOM_QUANTIZER_WEIGHT;
  l64.a.ndim = 2;
  l64.a.shape = l64.shape;
  l64.a.dtype = DLDataType{kDLFloat, 64, 1};
  l64.a.format = &l64.f;
  EXPECT_NE(qz.take(qz.t->layout(qz.obj, &l64.a)), 0);
  EXPECT_NE(qz.error.find("float"), std::string::npos) << qz.error;
  // An 8-bit float is none of the three float dtypes (float16_quant_test covers bf16, f16).
  l64.a.dtype = DLDataType{kDLFloat, 8, 1};
  EXPECT_EQ(qz.take(qz.t->layout(qz.obj, &l64.a)), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(qz.error.find("bfloat16"), std::string::npos) << qz.error;
  // A NaN activation in the W8A8 matmul.
  if (lq::have_int8_gemm()) {
    ASSERT_EQ(quantize(qz, LOOM_QUANTIZER_WEIGHT, l, x, p), 0) << qz.error;
    auto xa = sample(2 * k, 5);
    xa[k + 6] = NAN;
    std::vector<float> y;
    EXPECT_EQ(matmul(qz, l, p, xa, 2, nullptr, y), LOOM_ERR_INVALID_ARGUMENT);
    EXPECT_NE(qz.error.find("x[1, 6] is nan"), std::string::npos) << qz.error;
  }
}

// first_bad (ABI 1.7): quantize reports x's first non-finite element, or numel + g for a group
// whose range overflows float32, there and returns OK; without it (or from a 1.6 caller) the
// same x is an error, as before. A first_bad of another dtype or size is refused by name.
TEST(ZeroQuantPlugin, FirstBadReportsInsteadOfFailing) {
  Session s(kManifest);
  Quantizer qz(s, "w8");
  const int64_t n = 3, k = 8;
  Laid l;
  ASSERT_EQ(lay_out(qz, LOOM_QUANTIZER_WEIGHT, n, k, 0, l), 0) << qz.error;
  auto x = sample(n * k, 4);
  int64_t bad = 77;
  View vb(&bad, {1}, DLDataType{kDLInt, 64, 1});
  Packed p;
  ASSERT_EQ(quantize(qz, LOOM_QUANTIZER_WEIGHT, l, x, p, false, nullptr, vb.get()), 0) << qz.error;
  EXPECT_EQ(bad, -1);
  Packed plain;
  ASSERT_EQ(quantize(qz, LOOM_QUANTIZER_WEIGHT, l, x, plain), 0) << qz.error;
  EXPECT_EQ(p.codes, plain.codes);  // the same codes either way
  x[2 * k + 5] = NAN;
  x[2 * k + 7] = INFINITY;
  ASSERT_EQ(quantize(qz, LOOM_QUANTIZER_WEIGHT, l, x, p, false, nullptr, vb.get()), 0) << qz.error;
  EXPECT_EQ(bad, 2 * k + 5);
  // a 1.6 caller's args end before first_bad: the error as before, first_bad never read
  bad = 77;
  EXPECT_EQ(quantize(qz, LOOM_QUANTIZER_WEIGHT, l, x, p, false, nullptr, vb.get(),
                     LOOM_QUANTIZER_QUANTIZE_ARGS_SIZE_1_5),
            LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(qz.error.find("weight x[2, 5] is nan"), std::string::npos) << qz.error;
  EXPECT_EQ(bad, 77);
  // asymmetric: finite, but group 1 of row 1 spans more than float32 holds
  Quantizer asym(s, "w4");
  Laid la;
  ASSERT_EQ(lay_out(asym, LOOM_QUANTIZER_WEIGHT, n, 32, 0, la), 0) << asym.error;
  std::vector<float> xa(static_cast<std::size_t>(n * 32), 0.5f);
  xa[32 + 16] = -3e38f;  // row 1, group 1 (groups of 16)
  xa[32 + 17] = 3e38f;
  ASSERT_EQ(quantize(asym, LOOM_QUANTIZER_WEIGHT, la, xa, p, false, nullptr, vb.get()), 0)
      << asym.error;
  EXPECT_EQ(bad, n * 32 + 1 * 2 + 1);
  EXPECT_EQ(quantize(asym, LOOM_QUANTIZER_WEIGHT, la, xa, p), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(asym.error.find("group 1 of row 1"), std::string::npos) << asym.error;
  // a first_bad that is not int64 [1]
  int32_t small = 0;
  View v32(&small, {1}, DLDataType{kDLInt, 32, 1});
  EXPECT_EQ(quantize(qz, LOOM_QUANTIZER_WEIGHT, l, x, p, false, nullptr, v32.get()),
            LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(qz.error.find("first_bad"), std::string::npos) << qz.error;
  int64_t two[2] = {0, 0};
  View v2(two, {2}, DLDataType{kDLInt, 64, 1});
  EXPECT_EQ(quantize(qz, LOOM_QUANTIZER_WEIGHT, l, x, p, false, nullptr, v2.get()),
            LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(qz.error.find("first_bad"), std::string::npos) << qz.error;
}

// ---- describe and check

struct CliRun {
  int exit_code = -1;
  std::string out, err;
};

CliRun loom_cli(const std::string& args) {
  const auto err_file = std::filesystem::temp_directory_path() /
                        ("zeroquant_cli_" + std::to_string(::getpid()) + ".err");
  const std::string cmd =
      std::string("'") + LOOM_CLI_PATH + "' " + args + " 2>'" + err_file.string() + "'";
  CliRun r;
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (pipe == nullptr) return r;
  std::array<char, 4096> buf{};
  size_t got = 0;
  while ((got = std::fread(buf.data(), 1, buf.size(), pipe)) > 0) r.out.append(buf.data(), got);
  const int status = ::pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream in(err_file);
  std::ostringstream os;
  os << in.rdbuf();
  r.err = os.str();
  std::filesystem::remove(err_file);
  return r;
}

TEST(ZeroQuantPlugin, DescribeDocumentsEveryParameter) {
  char* json = nullptr;
  ASSERT_EQ(loom_describe_plugins("zeroquant", nullptr, &json), 0) << loom_last_error();
  const auto doc = nlohmann::json::parse(json);
  loom_free_string(json);
  ASSERT_EQ(doc["plugins"].size(), 1u);
  const auto& kind = doc["plugins"][0]["kinds"][0];
  EXPECT_EQ(kind["kind"], kKind);
  std::vector<std::string> names;
  for (const auto& p : kind["params"]) {
    names.push_back(p["name"]);
    EXPECT_GE(p["doc"].get<std::string>().size(), 80u) << p["name"];
  }
  EXPECT_EQ(names, (std::vector<std::string>{"bits", "symmetric", "group_size", "range",
                                             "activation_bits"}));
  const CliRun r = loom_cli("describe zeroquant");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("group_size"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("deepspeed"), std::string::npos) << r.out;
}

void expect_check(const std::string& toml, const std::string& key, const std::string& text) {
  const auto file = std::filesystem::temp_directory_path() /
                    ("zeroquant_check_" + std::to_string(::getpid()) + ".toml");
  {
    std::ofstream out(file);
    out << toml;
  }
  const CliRun r = loom_cli("check '" + file.string() + "'");
  std::filesystem::remove(file);
  if (key.empty()) {
    EXPECT_EQ(r.exit_code, 0) << toml << r.err;
    return;
  }
  EXPECT_EQ(r.exit_code, 2) << toml << r.err;
  EXPECT_NE(r.err.find("'" + key + "'"), std::string::npos) << toml << r.err;
  EXPECT_NE(r.err.find("quantizer.x"), std::string::npos) << toml << r.err;
  EXPECT_NE(r.err.find(text), std::string::npos) << toml << r.err;
}

TEST(ZeroQuantPlugin, CheckReportsBadParametersAtTheKey) {
  expect_check(kManifest, "", "");
  const std::string x = "[quantizer.x]\nplugin = \"zeroquant\"\n";
  expect_check(x + "bits = 9\n", "bits", "");
  expect_check(x + "bits = 1\n", "bits", "");
  expect_check(x + "group_size = -1\n", "group_size", "");
  expect_check(x + "range = \"minmax\"\n", "range", "deepspeed");
  expect_check(x + "activation_bits = 4\n", "activation_bits", "weight-only");
  expect_check(x + "symmetric = false\n", "symmetric", "do not fit");
  expect_check(x + "symmetric = false\nactivation_bits = 0\n", "", "");
}

}  // namespace
