// xtc through the host: the format layout reports, quantize against the kernels' scalar
// reference bit for bit, round trips, the packed matmul against dequantize-then-matmul, the
// parameters (`loom describe`, `loom check`) and bad input as clear statuses (NaN weights,
// bad mode, threshold <= 0, activations, dtypes, the invalid ternary code).
#include <gtest/gtest.h>
#include <loom/embed.h>
#include <loom/kinds/quantizer.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <loom/quantizers/binary.hpp>
#include "ternary.hpp"

namespace {

using loom::quant::GroupedShape;

struct Session {
  loom_session* s = nullptr;
  std::string error;
  explicit Session(const std::string& toml) {
    loom_open_options o{};
    o.struct_size = LOOM_OPEN_OPTIONS_SIZE;
    o.log_level = -1;
    if (loom_open_string(toml.c_str(), "test.toml", &o, &s) != 0) error = loom_last_error();
  }
  ~Session() { loom_close(s); }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
};

struct View {
  DLTensor t{};
  int64_t shape[2] = {0, 0};
  View(void* data, std::vector<int64_t> dims, DLDataType dtype) {
    for (std::size_t i = 0; i < dims.size(); ++i) shape[i] = dims[i];
    t.data = data;
    t.device = DLDevice{kDLCPU, 0};
    t.ndim = static_cast<int32_t>(dims.size());
    t.dtype = dtype;
    t.shape = shape;
  }
  View(const View&) = delete;
  View& operator=(const View&) = delete;
};

constexpr DLDataType kF32{kDLFloat, 32, 1};
constexpr DLDataType kU8{kDLUInt, 8, 1};

// The instance "q" of a session and its table; calls keep the last error's text.
struct Quant {
  loom_instance* inst = nullptr;
  void* obj = nullptr;
  const loom_quantizer_v1* t = nullptr;
  std::string error;

  explicit Quant(Session& s) {
    EXPECT_EQ(loom_find_instance(s.s, LOOM_KIND_QUANTIZER, "q", &inst), 0) << loom_last_error();
    const void* table = nullptr;
    EXPECT_EQ(
        loom_instance_table(inst, LOOM_KIND_QUANTIZER, LOOM_QUANTIZER_V1_MIN_SIZE, &obj, &table), 0)
        << loom_last_error();
    t = static_cast<const loom_quantizer_v1*>(table);
  }
  int32_t take(loom_status* st) {
    if (st == nullptr) return 0;
    char msg[2048] = {};
    const int32_t code = loom_instance_take_status(inst, st, msg, sizeof msg);
    error = msg;
    return code;
  }
};

// A weight W [n, k] and everything its calls take.
struct Weight {
  int64_t shape[2];
  loom_quant_format format{};
  loom_quantizer_layout_args layout{};
  std::vector<float> w;
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  void* workspace = nullptr;

  Weight(int64_t n, int64_t k, uint32_t seed) : shape{n, k} {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d(0.0f, 0.05f);
    w.resize(static_cast<std::size_t>(n * k));
    for (auto& v : w) v = d(rng);
    for (std::size_t i = 0; i < w.size(); i += 9) w[i] = 0.0f;
  }
  ~Weight() { std::free(workspace); }
  Weight(const Weight&) = delete;
  Weight& operator=(const Weight&) = delete;

  int32_t lay_out(Quant& q, int32_t role = LOOM_QUANTIZER_WEIGHT, DLDataType dt = kF32) {
    format = loom_quant_format{};
    format.struct_size = LOOM_QUANT_FORMAT_SIZE;
    layout = loom_quantizer_layout_args{};
    layout.struct_size = LOOM_QUANTIZER_LAYOUT_ARGS_SIZE;
    layout.role = role;
    layout.ndim = 2;
    layout.shape = shape;
    layout.dtype = dt;
    layout.matmul_rows = 4;
    layout.format = &format;
    const int32_t rc = q.take(q.t->layout(q.obj, &layout));
    if (rc != 0) return rc;
    codes.assign(layout.packed_bytes, 0);
    scales.assign(static_cast<std::size_t>(layout.scale_count), 0.0f);
    std::free(workspace);
    const uint64_t ws = std::max(layout.workspace_bytes, layout.matmul_workspace_bytes);
    workspace = std::aligned_alloc(256, (ws + 255) / 256 * 256 + 256);
    return 0;
  }

  int32_t code(Quant& q, bool quantize, float* x = nullptr, DLTensor* first_bad = nullptr) {
    View xv(x != nullptr ? x : w.data(), {shape[0], shape[1]}, kF32);
    View cv(codes.data(), {static_cast<int64_t>(codes.size())}, kU8);
    View sv(scales.data(), {static_cast<int64_t>(scales.size())}, kF32);
    loom_quantizer_quantize_args a{};
    a.struct_size = LOOM_QUANTIZER_QUANTIZE_ARGS_SIZE;
    a.first_bad = first_bad;
    a.role = LOOM_QUANTIZER_WEIGHT;
    a.format = &format;
    a.x = &xv.t;
    a.packed = &cv.t;
    a.scales = &sv.t;
    a.workspace = workspace;
    a.workspace_bytes = layout.workspace_bytes;
    return q.take(quantize ? q.t->quantize(q.obj, &a) : q.t->dequantize(q.obj, &a));
  }

  int32_t matmul(Quant& q, std::vector<float>& x, int64_t m, std::vector<float>& y,
                 std::vector<float>* bias) {
    View xv(x.data(), {m, shape[1]}, kF32);
    View cv(codes.data(), {static_cast<int64_t>(codes.size())}, kU8);
    View sv(scales.data(), {static_cast<int64_t>(scales.size())}, kF32);
    View yv(y.data(), {m, shape[0]}, kF32);
    View bv(bias != nullptr ? bias->data() : nullptr, {shape[0]}, kF32);
    loom_quantizer_matmul_args a{};
    a.struct_size = LOOM_QUANTIZER_MATMUL_ARGS_SIZE;
    a.format = &format;
    a.x = &xv.t;
    a.packed = &cv.t;
    a.scales = &sv.t;
    a.bias = bias != nullptr ? &bv.t : nullptr;
    a.y = &yv.t;
    a.workspace = workspace;
    a.workspace_bytes = layout.matmul_workspace_bytes;
    return q.take(q.t->matmul(q.obj, &a));
  }
};

std::string manifest(const std::string& params) {
  return "[quantizer.q]\nplugin = \"xtc\"\n" + params + "\n";
}

TEST(XtcPlugin, LayoutReportsThePackedFormat) {
  struct Case {
    std::string params;
    int32_t scheme;
    uint32_t bits;
    int64_t n, k, group, scale_count;
  };
  const Case cases[] = {
      {"", LOOM_QUANT_TERNARY, 2, 5, 37, 37, 5},
      {"mode = \"binary\"", LOOM_QUANT_BINARY, 1, 5, 37, 37, 5},
      {"mode = \"ternary\"\ngroup_size = 16", LOOM_QUANT_TERNARY, 2, 5, 37, 16, 15},
      {"mode = \"binary\"\ngroup_size = 8", LOOM_QUANT_BINARY, 1, 3, 64, 8, 24},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.params);
    Session s(manifest(c.params));
    ASSERT_TRUE(s.error.empty()) << s.error;
    Quant q(s);
    Weight w(c.n, c.k, 1);
    ASSERT_EQ(w.lay_out(q), 0) << q.error;
    EXPECT_EQ(w.format.scheme, c.scheme);
    EXPECT_EQ(w.format.bits, c.bits);
    EXPECT_EQ(w.format.flags, LOOM_QUANT_SYMMETRIC);
    EXPECT_EQ(w.format.packing, LOOM_QUANT_PACK_LSB_FIRST);
    EXPECT_EQ(w.format.axis, 1);
    EXPECT_EQ(w.format.group_size, c.group);
    EXPECT_EQ(w.format.scale_dtype.code, kDLFloat);
    EXPECT_EQ(w.format.scale_dtype.bits, 32);
    EXPECT_EQ(w.layout.packed_bytes, static_cast<uint64_t>((c.n * c.k * c.bits + 7) / 8));
    EXPECT_EQ(w.layout.scale_count, c.scale_count);
    EXPECT_EQ(w.layout.zero_point_count, 0);
    EXPECT_EQ(w.layout.flags, LOOM_QUANTIZER_HAS_MATMUL);  // weight-only: no INT8 activations
  }
}

TEST(XtcPlugin, QuantizeMatchesTheReferenceAndRoundTrips) {
  for (const char* mode : {"binary", "ternary"}) {
    for (int64_t group : {0, 16}) {
      SCOPED_TRACE(std::string(mode) + " group " + std::to_string(group));
      Session s(manifest(std::string("mode = \"") + mode +
                         "\"\ngroup_size = " + std::to_string(group) + "\nthreshold = 0.6"));
      ASSERT_TRUE(s.error.empty()) << s.error;
      Quant q(s);
      Weight w(33, 70, 2);
      ASSERT_EQ(w.lay_out(q), 0) << q.error;
      ASSERT_EQ(w.code(q, true), 0) << q.error;
      const GroupedShape gs{33, 70, group == 0 ? 70 : group};
      const bool binary = std::string(mode) == "binary";
      std::vector<uint8_t> codes(loom::quant::packed_bytes_of(gs, binary ? 1 : 2));
      std::vector<float> scales(static_cast<std::size_t>(gs.groups()));
      if (binary) {
        ASSERT_EQ(loom::quant::binary_quantize_ref(w.w.data(), gs, codes.data(), scales.data()),
                  -1);
      } else {
        ASSERT_EQ(
            loom::quant::ternary_quantize_ref(w.w.data(), gs, 0.6f, codes.data(), scales.data()),
            -1);
      }
      EXPECT_EQ(w.codes, codes);
      ASSERT_EQ(w.scales.size(), scales.size());
      EXPECT_EQ(std::memcmp(w.scales.data(), scales.data(), scales.size() * 4), 0);
      std::vector<float> back(w.w.size());
      ASSERT_EQ(w.code(q, false, back.data()), 0) << q.error;
      for (std::size_t i = 0; i < back.size(); ++i) {
        const float alpha = scales[(i / 70) * static_cast<std::size_t>(gs.groups_per_row()) +
                                   (i % 70) / static_cast<std::size_t>(gs.group_size)];
        if (binary) {
          ASSERT_EQ(back[i], w.w[i] >= 0.0f ? alpha : -alpha) << i;
        } else {
          ASSERT_TRUE(back[i] == 0.0f || std::fabs(back[i]) == alpha) << i;
          if (back[i] != 0.0f) {
            ASSERT_EQ(back[i] > 0.0f, w.w[i] > 0.0f) << i;
          }
        }
      }
    }
  }
}

TEST(XtcPlugin, MatmulMatchesDequantizeThenMatmul) {
  for (const char* mode : {"binary", "ternary"}) {
    SCOPED_TRACE(mode);
    Session s(manifest(std::string("mode = \"") + mode + "\"\ngroup_size = 32"));
    ASSERT_TRUE(s.error.empty()) << s.error;
    Quant q(s);
    Weight w(24, 100, 3);
    ASSERT_EQ(w.lay_out(q), 0) << q.error;
    ASSERT_EQ(w.code(q, true), 0) << q.error;
    std::vector<float> deq(w.w.size());
    ASSERT_EQ(w.code(q, false, deq.data()), 0) << q.error;
    const int64_t m = 3;
    std::vector<float> x(static_cast<std::size_t>(m * 100)), y(static_cast<std::size_t>(m * 24));
    std::vector<float> bias(24);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37f * static_cast<float>(i));
    for (std::size_t i = 0; i < bias.size(); ++i) bias[i] = 0.1f * static_cast<float>(i);
    ASSERT_EQ(w.matmul(q, x, m, y, &bias), 0) << q.error;
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t n = 0; n < 24; ++n) {
        double ref = bias[static_cast<std::size_t>(n)];
        double mag = 1.0;
        for (int64_t k = 0; k < 100; ++k) {
          const double xv = x[static_cast<std::size_t>(i * 100 + k)];
          const double wv = deq[static_cast<std::size_t>(n * 100 + k)];
          ref += xv * wv;
          mag += std::fabs(xv * wv);
        }
        ASSERT_NEAR(y[static_cast<std::size_t>(i * 24 + n)], ref, 1e-5 * mag) << i << "," << n;
      }
    }
  }
}

TEST(XtcPlugin, RefusesNonFiniteWeightsNamingTheElement) {
  Session s(manifest(""));
  ASSERT_TRUE(s.error.empty()) << s.error;
  Quant q(s);
  Weight w(6, 10, 4);
  ASSERT_EQ(w.lay_out(q), 0) << q.error;
  w.w[3 * 10 + 7] = std::numeric_limits<float>::quiet_NaN();
  w.w[5 * 10 + 1] = std::numeric_limits<float>::infinity();
  EXPECT_EQ(w.code(q, true), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(q.error.find("x(3, 7) is not finite"), std::string::npos) << q.error;
}

TEST(XtcPlugin, RefusesFiniteWeightsWhoseScaleWouldOverflow) {
  for (const char* mode : {"binary", "ternary"}) {
    SCOPED_TRACE(mode);
    Session s(manifest(std::string("mode = \"") + mode + "\"\ngroup_size = 16"));
    ASSERT_TRUE(s.error.empty()) << s.error;
    Quant q(s);
    Weight w(4, 32, 4);
    ASSERT_EQ(w.lay_out(q), 0) << q.error;
    w.w[2 * 32 + 16] = 3e38f;
    w.w[2 * 32 + 24] = 3e38f;
    EXPECT_EQ(w.code(q, true), LOOM_ERR_INVALID_ARGUMENT);
    EXPECT_NE(q.error.find("group 1 of row 2"), std::string::npos) << q.error;
    EXPECT_NE(q.error.find("overflows float32"), std::string::npos) << q.error;
  }
}

// first_bad (ABI 1.7): the same outcomes written there instead of an error, the element's
// index or numel + the group whose scale overflows; -1 for weights that quantize.
TEST(XtcPlugin, FirstBadReportsInsteadOfFailing) {
  for (const char* mode : {"binary", "ternary"}) {
    SCOPED_TRACE(mode);
    Session s(manifest(std::string("mode = \"") + mode + "\"\ngroup_size = 16"));
    ASSERT_TRUE(s.error.empty()) << s.error;
    Quant q(s);
    Weight w(4, 32, 4);
    ASSERT_EQ(w.lay_out(q), 0) << q.error;
    int64_t bad = 77;
    View bv(&bad, {1}, DLDataType{kDLInt, 64, 1});
    ASSERT_EQ(w.code(q, true, nullptr, &bv.t), 0) << q.error;
    EXPECT_EQ(bad, -1);
    w.w[2 * 32 + 16] = 3e38f;
    w.w[2 * 32 + 24] = 3e38f;
    ASSERT_EQ(w.code(q, true, nullptr, &bv.t), 0) << q.error;
    EXPECT_EQ(bad, 4 * 32 + 2 * 2 + 1);
    w.w[3 * 32 + 9] = std::numeric_limits<float>::quiet_NaN();
    ASSERT_EQ(w.code(q, true, nullptr, &bv.t), 0) << q.error;
    EXPECT_EQ(bad, 3 * 32 + 9);
    EXPECT_EQ(w.code(q, true), LOOM_ERR_INVALID_ARGUMENT);  // without it: the error
  }
}

TEST(XtcPlugin, RefusesTheInvalidTernaryCode) {
  Session s(manifest(""));
  ASSERT_TRUE(s.error.empty()) << s.error;
  Quant q(s);
  Weight w(4, 10, 5);
  ASSERT_EQ(w.lay_out(q), 0) << q.error;
  ASSERT_EQ(w.code(q, true), 0) << q.error;
  w.codes[(2 * 10 + 5) / 4] |= static_cast<uint8_t>(3u << (2 * ((2 * 10 + 5) % 4)));
  std::vector<float> back(w.w.size());
  EXPECT_EQ(w.code(q, false, back.data()), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(q.error.find("invalid ternary code 3 at weight element (2, 5)"), std::string::npos)
      << q.error;
  std::vector<float> x(10, 1.0f), y(4);
  EXPECT_EQ(w.matmul(q, x, 1, y, nullptr), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(q.error.find("(2, 5)"), std::string::npos) << q.error;
}

TEST(XtcPlugin, RefusesActivationsAndOtherDtypes) {
  Session s(manifest(""));
  ASSERT_TRUE(s.error.empty()) << s.error;
  Quant q(s);
  Weight w(4, 8, 6);
  EXPECT_EQ(w.lay_out(q, LOOM_QUANTIZER_ACTIVATION), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(q.error.find("xtc quantizes weights only"), std::string::npos) << q.error;
  EXPECT_EQ(w.lay_out(q, LOOM_QUANTIZER_WEIGHT, DLDataType{kDLFloat, 64, 1}),
            LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(q.error.find("bfloat16"), std::string::npos) << q.error;
  // A format of another group size is refused by name.
  ASSERT_EQ(w.lay_out(q), 0) << q.error;
  w.format.group_size = 4;
  EXPECT_EQ(w.code(q, true), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(q.error.find("group_size"), std::string::npos) << q.error;
}

TEST(XtcPlugin, RefusesBadParameters) {
  struct Case {
    std::string params, text;
  };
  const Case cases[] = {
      {"mode = \"quaternary\"", "mode"},
      {"threshold = 0.0", "threshold"},
      {"threshold = -0.5", "threshold"},
      {"threshold = 1e39", "(0, 1000]"},  // beyond float32: Delta would be inf
      {"threshold = 1000.5", "(0, 1000]"},
      {"group_size = -1", "group_size"},
  };
  for (const Case& c : cases) {
    Session s(manifest(c.params));
    EXPECT_FALSE(s.error.empty()) << c.params;
    EXPECT_NE(s.error.find(c.text), std::string::npos) << c.params << ": " << s.error;
  }
}

// ---- describe and check

struct CliRun {
  int exit_code = -1;
  std::string out, err;
};

CliRun loom_cli(const std::string& args) {
  const auto err_file =
      std::filesystem::temp_directory_path() / ("xtc_cli_" + std::to_string(::getpid()) + ".err");
  const std::string cmd =
      std::string("'") + LOOM_CLI_PATH + "' " + args + " 2>'" + err_file.string() + "'";
  CliRun r;
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (pipe == nullptr) return r;
  std::array<char, 4096> buf{};
  size_t k = 0;
  while ((k = std::fread(buf.data(), 1, buf.size(), pipe)) > 0) r.out.append(buf.data(), k);
  const int status = ::pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream in(err_file);
  std::ostringstream os;
  os << in.rdbuf();
  r.err = os.str();
  std::filesystem::remove(err_file);
  return r;
}

TEST(XtcPlugin, DescribeDocumentsEveryParameter) {
  char* json = nullptr;
  ASSERT_EQ(loom_describe_plugins("xtc", nullptr, &json), 0) << loom_last_error();
  const auto doc = nlohmann::json::parse(json);
  loom_free_string(json);
  ASSERT_EQ(doc["plugins"].size(), 1u);
  const auto& kind = doc["plugins"][0]["kinds"][0];
  EXPECT_EQ(kind["kind"], LOOM_KIND_QUANTIZER);
  std::vector<std::string> names;
  for (const auto& p : kind["params"]) {
    names.push_back(p["name"]);
    EXPECT_GE(p["doc"].get<std::string>().size(), 40u) << p["name"];
  }
  EXPECT_EQ(names, (std::vector<std::string>{"mode", "group_size", "threshold"}));
  const CliRun r = loom_cli("describe xtc");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("threshold"), std::string::npos) << r.out;
  EXPECT_NE(kind["params"][2]["doc"].get<std::string>().find("(0, 1000]"), std::string::npos);
}

TEST(XtcPlugin, CheckReportsBadParametersAtTheKey) {
  const auto file = std::filesystem::temp_directory_path() /
                    ("xtc_check_" + std::to_string(::getpid()) + ".toml");
  {
    std::ofstream out(file);
    out << "[quantizer.x]\nplugin = \"xtc\"\nmode = \"ternary\"\nthreshold = 0.0\n";
  }
  const CliRun r = loom_cli("check '" + file.string() + "'");
  std::filesystem::remove(file);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("'threshold'"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("quantizer.x"), std::string::npos) << r.err;
}

}  // namespace
