// random_ltd through the host (the trainer's path): plan (kept, flags, workspace), select on
// the host's thread pool against the library called directly, gather/scatter, advance's
// layer tokens and its step rules, the exported state round trip, errors as statuses,
// `loom describe` docs for every parameter and `loom check` reporting bad parameters.
#include <gtest/gtest.h>
#include <loom/embed.h>
#include <loom/kinds/router.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <array>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "schedule.hpp"
#include "select.hpp"
#include "tensors.hpp"

namespace {

namespace ltd = loom::routers::ltd;
using namespace routers_test;

constexpr const char* kKind = LOOM_KIND_ROUTER;

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

struct Router {
  loom_instance* inst = nullptr;
  void* obj = nullptr;
  const loom_router_v1* t = nullptr;
  std::string error;
  Router(Session& s, const char* name) {
    if (loom_find_instance(s.s, kKind, name, &inst) != 0) {
      ADD_FAILURE() << "find " << name << ": " << loom_last_error();
      return;
    }
    const void* table = nullptr;
    if (loom_instance_table(inst, kKind, LOOM_ROUTER_V1_MIN_SIZE, &obj, &table) != 0) {
      ADD_FAILURE() << "table " << name << ": " << loom_last_error();
    }
    t = static_cast<const loom_router_v1*>(table);
  }
  int32_t take(loom_status* st) {
    std::array<char, 1024> msg{};
    const int32_t rc = loom_instance_take_status(inst, st, msg.data(), msg.size());
    error = msg.data();
    return rc;
  }
  int32_t plan(loom_router_plan_args& a) { return take(t->plan(obj, &a)); }
  int32_t advance(loom_router_advance_args& a) { return take(t->advance(obj, &a)); }
};

loom_router_plan_args plan_args(int64_t batch, int64_t seq_len, int64_t step, int32_t layer,
                                int32_t num_layers, uint32_t training = 1) {
  loom_router_plan_args a{};
  a.struct_size = LOOM_ROUTER_PLAN_ARGS_SIZE;
  a.batch = batch;
  a.seq_len = seq_len;
  a.channels = 16;
  a.step = step;
  a.layer = layer;
  a.num_layers = num_layers;
  a.training = training;
  a.dtype = kF32;
  return a;
}

loom_router_advance_args advance_args(int64_t step, int64_t batch, int64_t seq_len,
                                      int32_t num_layers) {
  loom_router_advance_args a{};
  a.struct_size = LOOM_ROUTER_ADVANCE_ARGS_SIZE;
  a.step = step;
  a.batch = batch;
  a.seq_len = seq_len;
  a.num_layers = num_layers;
  return a;
}

const char* kManifest = R"(
[router.ltd]
plugin = "random_ltd"
min_value = 128
max_value = 2048
require_steps = 200000

[router.few]
plugin = "random_ltd"
min_value = 8
max_value = 64
require_steps = 10
layers = [0, 2, 5]

[router.outside]
plugin = "random_ltd"
min_value = 8
max_value = 64
require_steps = 10
layers = [1, 7]
)";

TEST(RouterLtdPlugin, PlanKeepsTheScheduledCountOnRoutedLayers) {
  Session s(kManifest);
  Router r(s, "ltd");
  ASSERT_NE(r.t, nullptr);
  auto p = plan_args(4, 2048, 1, 1, 6);
  ASSERT_EQ(r.plan(p), 0) << r.error;
  EXPECT_EQ(p.kept, 128);
  EXPECT_EQ(p.flags, LOOM_ROUTER_ROUTED);
  EXPECT_EQ(p.workspace_bytes, 4u * 2048u * 8u);
  EXPECT_EQ(p.saved_bytes, 0u);
  for (const int32_t layer : {0, 5}) {  // first and last layers: the default leaves them whole
    p = plan_args(4, 2048, 1, layer, 6);
    ASSERT_EQ(r.plan(p), 0) << r.error;
    EXPECT_EQ(p.kept, 2048);
    EXPECT_EQ(p.flags, 0u);
    EXPECT_EQ(p.workspace_bytes, 0u);
  }
  p = plan_args(4, 2048, 1, 2, 6, 0);  // evaluation
  ASSERT_EQ(r.plan(p), 0) << r.error;
  EXPECT_EQ(p.kept, 2048);
  EXPECT_EQ(p.flags, 0u);
  p = plan_args(4, 100, 1, 2, 6);  // shorter than the scheduled count: not routed
  ASSERT_EQ(r.plan(p), 0) << r.error;
  EXPECT_EQ(p.kept, 100);
  EXPECT_EQ(p.flags, 0u);
  p = plan_args(4, 2048, 100001, 3, 6);
  ASSERT_EQ(r.plan(p), 0) << r.error;
  EXPECT_EQ(p.kept, 1088);

  Router few(s, "few");
  for (int32_t layer = 0; layer < 6; ++layer) {
    p = plan_args(1, 64, 1, layer, 6);
    ASSERT_EQ(few.plan(p), 0) << few.error;
    const bool routed = layer == 0 || layer == 2 || layer == 5;
    EXPECT_EQ(p.kept, routed ? 8 : 64) << layer;  // min 8, q 16: Loom keeps min_value
  }
}

TEST(RouterLtdPlugin, LayersOutsideTheModelNameTheParameter) {
  Session s(kManifest);
  Router r(s, "outside");
  auto p = plan_args(1, 64, 1, 1, 6);
  EXPECT_EQ(r.plan(p), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(r.error.find("layers[1] = 7 is outside the model's 6 layers (0 .. 5)"),
            std::string::npos)
      << r.error;
  p = plan_args(1, 64, 1, 1, 8);
  EXPECT_EQ(r.plan(p), 0) << r.error;
  // The SDK's check of the layer itself.
  p = plan_args(1, 64, 1, 6, 6);
  EXPECT_EQ(r.plan(p), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(r.error.find("layer 6 is outside 0 .. 5"), std::string::npos) << r.error;
}

TEST(RouterLtdPlugin, SelectGatherScatterOnTheHostPool) {
  Session s(kManifest);
  Router r(s, "ltd");
  const int64_t B = 3, S = 2048, C = 16, step = 50001;
  auto p = plan_args(B, S, step, 2, 6);
  ASSERT_EQ(r.plan(p), 0) << r.error;
  const int64_t K = p.kept;
  ASSERT_EQ(K, 608);  // 128 + 480
  std::vector<int32_t> idx(static_cast<std::size_t>(B * K), -1);
  std::vector<unsigned char> ws(p.workspace_bytes + 256);
  void* aligned = ws.data() + (256 - reinterpret_cast<uintptr_t>(ws.data()) % 256) % 256;
  View iv(idx.data(), {B, K}, kI32);
  loom_router_select_args a{};
  a.struct_size = LOOM_ROUTER_SELECT_ARGS_SIZE;
  a.seed = 1234;
  a.step = step;
  a.batch = B;
  a.seq_len = S;
  a.channels = C;
  a.first_sample = 40;
  a.layer = 2;
  a.num_layers = 6;
  a.training = 1;
  a.indices = iv.get();
  a.workspace = aligned;
  a.workspace_bytes = p.workspace_bytes;
  ASSERT_EQ(r.take(r.t->select(r.obj, &a)), 0) << r.error;
  std::vector<int32_t> want(idx.size());
  ltd::select_cpu({1234, step, 2, 40, B, S, K}, want.data());
  EXPECT_EQ(idx, want);
  // No workspace while the plan asks for one: the SDK refuses it.
  a.workspace = nullptr;
  EXPECT_EQ(r.take(r.t->select(r.obj, &a)), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(r.error.find("workspace"), std::string::npos) << r.error;
  // Indices sized for another kept count.
  a.workspace = aligned;
  View small(idx.data(), {B, K - 1}, kI32);
  a.indices = small.get();
  EXPECT_EQ(r.take(r.t->select(r.obj, &a)), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(r.error.find("expected [3, 608]"), std::string::npos) << r.error;

  // gather then scatter through the table.
  std::vector<float> x(static_cast<std::size_t>(B * S * C));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i);
  std::vector<float> xk(static_cast<std::size_t>(B * K * C), -1.0f);
  View xv(x.data(), {B, S, C}, kF32), kv(xk.data(), {B, K, C}, kF32);
  View iv2(idx.data(), {B, K}, kI32);
  const loom_router_move_args m = move_args(xv, kv, iv2);
  ASSERT_EQ(r.take(r.t->gather(r.obj, &m)), 0) << r.error;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t j = 0; j < K; j += 37) {
      const int32_t pos = idx[static_cast<std::size_t>(b * K + j)];
      EXPECT_EQ(xk[static_cast<std::size_t>((b * K + j) * C + 3)],
                x[static_cast<std::size_t>((b * S + pos) * C + 3)]);
    }
  }
  std::vector<float> out(x.size(), 0.0f);
  View ov(out.data(), {B, S, C}, kF32);
  const loom_router_move_args sm = move_args(ov, kv, iv2);
  ASSERT_EQ(r.take(r.t->scatter(r.obj, &sm)), 0) << r.error;
  std::size_t nonzero_rows = 0;
  for (int64_t row = 0; row < B * S; ++row) {
    nonzero_rows += out[static_cast<std::size_t>(row * C + 1)] != 0.0f ? 1 : 0;
  }
  EXPECT_EQ(nonzero_rows, static_cast<std::size_t>(B * K));
  // kept rows above the sequence: refused with the tensors named.
  std::vector<float> big(static_cast<std::size_t>(B * (S + 1) * C));
  View bv(big.data(), {B, S + 1, C}, kF32);
  std::vector<int32_t> bidx(static_cast<std::size_t>(B * (S + 1)), 0);
  View biv(bidx.data(), {B, S + 1}, kI32);
  const loom_router_move_args bm = move_args(xv, bv, biv);
  EXPECT_EQ(r.take(r.t->gather(r.obj, &bm)), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(r.error.find("kept has 2049 positions per sequence but full has only 2048"),
            std::string::npos)
      << r.error;
}

// Two instances (two sessions) choose the same rows for the same arguments, and a batch
// split in two with first_sample gives the whole batch's rows.
TEST(RouterLtdPlugin, InstancesAndSplitsAgree) {
  Session s1(kManifest), s2(kManifest);
  Router r1(s1, "ltd"), r2(s2, "ltd");
  const int64_t S = 1024, step = 30001;
  auto select = [&](Router& r, int64_t first, int64_t batch) {
    auto p = plan_args(batch, S, step, 3, 6);
    EXPECT_EQ(r.plan(p), 0) << r.error;
    std::vector<int32_t> idx(static_cast<std::size_t>(batch * p.kept), -1);
    std::vector<unsigned char> ws(p.workspace_bytes + 256);
    View iv(idx.data(), {batch, p.kept}, kI32);
    loom_router_select_args a{};
    a.struct_size = LOOM_ROUTER_SELECT_ARGS_SIZE;
    a.seed = 5;
    a.step = step;
    a.batch = batch;
    a.seq_len = S;
    a.channels = 16;
    a.first_sample = first;
    a.layer = 3;
    a.num_layers = 6;
    a.training = 1;
    a.indices = iv.get();
    a.workspace = ws.data() + (256 - reinterpret_cast<uintptr_t>(ws.data()) % 256) % 256;
    a.workspace_bytes = p.workspace_bytes;
    EXPECT_EQ(r.take(r.t->select(r.obj, &a)), 0) << r.error;
    return idx;
  };
  const auto whole = select(r1, 0, 6);
  EXPECT_EQ(select(r2, 0, 6), whole);
  auto joined = select(r2, 0, 4);
  const auto rest = select(r1, 4, 2);
  joined.insert(joined.end(), rest.begin(), rest.end());
  EXPECT_EQ(joined, whole);
  EXPECT_EQ(whole.size(), 6u * 416u);  // t = 30000: 128 + 288
}

TEST(RouterLtdPlugin, AdvanceCountsLayerTokensAndResumes) {
  Session s(kManifest);
  Router r(s, "ltd");
  // 6 layers, 4 routed (1 .. 4): 2 * 2048 + 4 * kept per sequence.
  auto a = advance_args(1, 8, 2048, 6);
  ASSERT_EQ(r.advance(a), 0) << r.error;
  EXPECT_EQ(a.layer_tokens, 8 * (2 * 2048 + 4 * 128));
  EXPECT_EQ(a.consumed_layer_tokens, static_cast<uint64_t>(a.layer_tokens));
  uint64_t consumed = a.consumed_layer_tokens;
  // A curriculum-cut step: the actual seq_len counts (512 for the unrouted layers).
  a = advance_args(2, 8, 512, 6);
  ASSERT_EQ(r.advance(a), 0) << r.error;
  EXPECT_EQ(a.layer_tokens, 8 * (2 * 512 + 4 * 128));
  consumed += static_cast<uint64_t>(a.layer_tokens);
  EXPECT_EQ(a.consumed_layer_tokens, consumed);
  // Repeat: the same outs.
  a = advance_args(2, 8, 512, 6);
  ASSERT_EQ(r.advance(a), 0) << r.error;
  EXPECT_EQ(a.consumed_layer_tokens, consumed);
  EXPECT_EQ(a.layer_tokens, 8 * (2 * 512 + 4 * 128));
  // Skip: FAILED_PRECONDITION, nothing changes.
  a = advance_args(4, 8, 2048, 6);
  EXPECT_EQ(r.advance(a), LOOM_ERR_FAILED_PRECONDITION);
  EXPECT_NE(r.error.find("step 4 does not follow the last step accounted (2)"), std::string::npos)
      << r.error;

  // Export, import into a fresh instance, continue: the same counts as the original.
  size_t size = 0;
  ASSERT_EQ(loom_instance_export_state(r.inst, nullptr, 0, &size), 0) << loom_last_error();
  std::vector<unsigned char> blob(size);
  ASSERT_EQ(loom_instance_export_state(r.inst, blob.data(), blob.size(), &size), 0)
      << loom_last_error();
  Session s2(kManifest);
  Router r2(s2, "ltd");
  a = advance_args(3, 8, 2048, 6);
  EXPECT_EQ(r2.advance(a), LOOM_ERR_FAILED_PRECONDITION);  // a fresh one starts at step 1
  ASSERT_EQ(loom_instance_import_state(r2.inst, blob.data(), blob.size()), 0) << loom_last_error();
  auto a1 = advance_args(3, 8, 2048, 6);
  auto a2 = advance_args(3, 8, 2048, 6);
  ASSERT_EQ(r.advance(a1), 0) << r.error;
  ASSERT_EQ(r2.advance(a2), 0) << r2.error;
  EXPECT_EQ(a1.layer_tokens, a2.layer_tokens);
  EXPECT_EQ(a1.consumed_layer_tokens, a2.consumed_layer_tokens);
  EXPECT_EQ(a2.consumed_layer_tokens, consumed + static_cast<uint64_t>(a1.layer_tokens));
  // A damaged blob is refused.
  blob[blob.size() / 2] ^= 0x40;
  EXPECT_NE(loom_instance_import_state(r2.inst, blob.data(), blob.size()), 0);
}

// ---- describe and check

struct CliRun {
  int exit_code = -1;
  std::string out, err;
};

CliRun loom_cli(const std::string& args) {
  const auto err_file = std::filesystem::temp_directory_path() /
                        ("routers_cli_" + std::to_string(::getpid()) + ".err");
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

TEST(RouterLtdPlugin, DescribeDocumentsEveryParameter) {
  char* json = nullptr;
  ASSERT_EQ(loom_describe_plugins("random_ltd", nullptr, &json), 0) << loom_last_error();
  const auto doc = nlohmann::json::parse(json);
  loom_free_string(json);
  ASSERT_EQ(doc["plugins"].size(), 1u);
  const auto& kind = doc["plugins"][0]["kinds"][0];
  EXPECT_EQ(kind["kind"], kKind);
  std::vector<std::string> names;
  for (const auto& p : kind["params"]) {
    names.push_back(p["name"]);
    EXPECT_GE(p["doc"].get<std::string>().size(), 40u) << p["name"];
  }
  EXPECT_EQ(names, (std::vector<std::string>{"min_value", "max_value", "schedule_type",
                                             "require_steps", "seq_per_step", "layers"}));
  EXPECT_EQ(kind["has_validate"], true);
  const CliRun r = loom_cli("describe random_ltd");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("seq_per_step (an integer), default 16"), std::string::npos) << r.out;
}

void expect_check(const std::string& toml, const std::string& key, const std::string& text) {
  const auto file = std::filesystem::temp_directory_path() /
                    ("routers_check_" + std::to_string(::getpid()) + ".toml");
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
  EXPECT_NE(r.err.find("router.x"), std::string::npos) << toml << r.err;
  EXPECT_NE(r.err.find(text), std::string::npos) << toml << r.err;
}

TEST(RouterLtdPlugin, CheckReportsBadParametersAtTheKey) {
  expect_check(kManifest, "", "");
  const std::string x = "[router.x]\nplugin = \"random_ltd\"\n";
  expect_check(x + "min_value = 0\nmax_value = 64\nrequire_steps = 10\n", "min_value", "");
  expect_check(x + "min_value = 65\nmax_value = 64\nrequire_steps = 10\n", "max_value",
               "below min_value");
  expect_check(x + "min_value = 8\nmax_value = 64\nrequire_steps = 0\n", "require_steps", "");
  expect_check(x + "min_value = 8\nmax_value = 64\nrequire_steps = 10\nseq_per_step = 0\n",
               "seq_per_step", "");
  expect_check(x + "min_value = 8\nmax_value = 64\nrequire_steps = 10\nschedule_type = \"x\"\n",
               "schedule_type", "fixed_linear");
  expect_check(x + "min_value = 8\nmax_value = 64\nrequire_steps = 10\nlayers = [3, 2]\n", "layers",
               "strictly increasing");
  expect_check(x + "min_value = 8\nmax_value = 64\nrequire_steps = 10\nlayers = [-1]\n", "layers",
               "");
  expect_check(x + "max_value = 64\nrequire_steps = 10\n", "min_value", "");
}

}  // namespace
