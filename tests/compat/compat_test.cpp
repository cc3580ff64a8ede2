// Plugins built from older ABI minors' headers, through today's host. The fixtures
// (tests/compat/plugins, plain C11) are compiled against verbatim snapshots of the ABI 1.0 to
// 1.4 headers, so the host meets their struct sizes: 1.0 optimizer tensors of 32
// bytes and groups of 40, a 1.0 codec table without decode_sum, 1.2 factories and parameter
// specs, and so on. Every struct a fixture hands
// the host ends where an inaccessible page begins, so a read past its era's size faults.
// These tests depend only on how the host treats old plugins, not on today's minor.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "compat_support.hpp"
#include "loom_test.hpp"

namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::StartsWith;

using compat_test::Tensor1d;

const std::string kPluginDir = LOOM_COMPAT_PLUGIN_DIR;

// A session whose plugin path is the fixtures' folder.
class Session : public compat_test::Session {
 public:
  Session() : compat_test::Session(kPluginDir) {}
};

struct Era {
  const char* abi;    // "1.0"
  const char* sgd;    // the optimizer fixture built from that era's headers
  const char* codec;  // the codec fixture
  int minor;
};
// gtest prints the parameter in test names and failures.
void PrintTo(const Era& e, std::ostream* os) { *os << "ABI " << e.abi; }

const Era kEras[] = {
    {"1.0", "compat10_sgd", "compat10_codec", 0}, {"1.1", "compat11_sgd", "compat11_codec", 1},
    {"1.2", "compat12_sgd", "compat12_codec", 2}, {"1.3", "compat13_sgd", "compat13_codec", 3},
    {"1.4", "compat14_sgd", "compat14_codec", 4}, {"1.5", "compat15_sgd", "compat15_codec", 5},
    {"1.6", "compat16_sgd", "compat16_codec", 6}};

// ------------------------------------------------------------------ references

// The fixture codec, computed here: chunks of 4 + n bytes (fp32 scale, int8 values).
struct RefCodec {
  float levels = 127.0F;

  // Encodes `in` (+ `err` when given, which then receives the new residual) as chunks.
  [[nodiscard]] std::vector<unsigned char> encode(const std::vector<float>& in, float* err,
                                                  size_t chunks) const {
    const size_t per = in.size() / chunks;
    std::vector<unsigned char> out(chunks * (4 + per));
    for (size_t k = 0; k < chunks; ++k) {
      std::vector<float> x(per);
      float amax = 0.0F;
      for (size_t i = 0; i < per; ++i) {
        x[i] = in[k * per + i] + (err != nullptr ? err[k * per + i] : 0.0F);
        amax = std::max(amax, std::fabs(x[i]));
      }
      const float scale = amax / levels;
      unsigned char* chunk = out.data() + k * (4 + per);
      std::memcpy(chunk, &scale, 4);
      for (size_t i = 0; i < per; ++i) {
        long q = scale > 0.0F ? std::lrint(x[i] / scale) : 0;
        q = std::clamp<long>(q, -static_cast<long>(levels), static_cast<long>(levels));
        const auto q8 = static_cast<int8_t>(q);
        std::memcpy(chunk + 4 + i, &q8, 1);
        if (err != nullptr) err[k * per + i] = x[i] - static_cast<float>(q8) * scale;
      }
    }
    return out;
  }
  // Element i of a chunk, decoded and multiplied by alpha.
  static float decoded(const unsigned char* chunk, size_t i, float alpha) {
    float scale = 0;
    int8_t q = 0;
    std::memcpy(&scale, chunk, 4);
    std::memcpy(&q, chunk + 4 + i, 1);
    return alpha * (static_cast<float>(q) * scale);
  }
  [[nodiscard]] std::vector<float> roundtrip(const std::vector<float>& in) const {
    const auto enc = encode(in, nullptr, 1);
    std::vector<float> out(in.size());
    for (size_t i = 0; i < in.size(); ++i) out[i] = decoded(enc.data(), i, 1.0F);
    return out;
  }
};

// SGD with momentum exactly as the fixture documents it (double, rounded where stored).
struct RefSgd {
  double momentum = 0.9;
  double weight_decay = 0.0;
  bool nesterov = false;
  const RefCodec* codec = nullptr;
  std::vector<std::vector<float>> m;  // one buffer per tensor, in (group, tensor) order

  struct Tensor {
    std::vector<float>* p;
    const std::vector<float>* g;
    const std::vector<float>* mask;  // honoured only when `masks` is set in step()
  };
  struct Group {
    std::vector<Tensor> tensors;
    double lr_scale = 1.0;
    double weight_decay = std::numeric_limits<double>::quiet_NaN();
  };

  void step(const std::vector<Group>& groups, double lr, double grad_scale, bool masks) {
    size_t k = 0;
    for (const auto& g : groups) {
      const double wd = std::isnan(g.weight_decay) ? weight_decay : g.weight_decay;
      for (const auto& t : g.tensors) {
        if (m.size() <= k) m.emplace_back(t.p->size(), 0.0F);
        std::vector<float> s(t.p->size());
        for (size_t i = 0; i < s.size(); ++i) {
          s[i] = static_cast<float>(static_cast<double>((*t.g)[i]) / grad_scale);
        }
        if (codec != nullptr) s = codec->roundtrip(s);
        auto& mk = m[k++];
        for (size_t i = 0; i < s.size(); ++i) {
          float& p = (*t.p)[i];
          const double d = static_cast<double>(s[i]) + wd * static_cast<double>(p);
          mk[i] = static_cast<float>(momentum * static_cast<double>(mk[i]) + d);
          if (masks && t.mask != nullptr) mk[i] *= (*t.mask)[i];
          const double upd =
              nesterov ? d + momentum * static_cast<double>(mk[i]) : static_cast<double>(mk[i]);
          p = static_cast<float>(static_cast<double>(p) - lr * g.lr_scale * upd);
        }
      }
    }
  }
};

// ------------------------------------------------------------------ host helpers

// One step through loom_optimizer_step with today's structs (sizes of this host's minor).
// flags go to every group (today's field; an older optimizer cannot see it).
int32_t host_step(loom_instance* opt, const std::vector<RefSgd::Group>& groups, double lr,
                  double grad_scale, int64_t step, uint32_t flags = 0) {
  std::vector<std::unique_ptr<Tensor1d>> views;
  std::vector<std::vector<loom_optimizer_tensor>> tensors(groups.size());
  std::vector<loom_optimizer_group> gs(groups.size());
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    for (const auto& t : groups[gi].tensors) {
      loom_optimizer_tensor ot{};
      ot.struct_size = LOOM_OPTIMIZER_TENSOR_SIZE;
      ot.param = &views.emplace_back(std::make_unique<Tensor1d>(*t.p))->t;
      ot.grad = &views
                     .emplace_back(std::make_unique<Tensor1d>(
                         const_cast<std::vector<float>&>(*t.g)))  // NOLINT
                     ->t;
      if (t.mask != nullptr) {
        ot.exp_avg_mask =
            &views
                 .emplace_back(std::make_unique<Tensor1d>(const_cast<std::vector<float>&>(*t.mask)))
                 ->t;
      }
      tensors[gi].push_back(ot);
    }
    gs[gi].struct_size = LOOM_OPTIMIZER_GROUP_SIZE;
    gs[gi].tensors = tensors[gi].data();
    gs[gi].tensor_count = tensors[gi].size();
    gs[gi].lr_scale = groups[gi].lr_scale;
    gs[gi].weight_decay = groups[gi].weight_decay;
    gs[gi].flags = flags;
  }
  loom_optimizer_step_args args{};
  args.struct_size = LOOM_OPTIMIZER_STEP_ARGS_SIZE;
  args.groups = gs.data();
  args.group_count = gs.size();
  args.lr = lr;
  args.grad_scale = grad_scale;
  args.step = step;
  return loom_optimizer_step(opt, &args);
}

std::vector<unsigned char> export_state(loom_instance* inst) {
  size_t size = 0;
  EXPECT_EQ(loom_instance_export_state(inst, nullptr, 0, &size), LOOM_OK) << loom_last_error();
  std::vector<unsigned char> blob(size);
  size_t written = 0;
  EXPECT_EQ(loom_instance_export_state(inst, blob.data(), blob.size(), &written), LOOM_OK)
      << loom_last_error();
  EXPECT_EQ(written, size);
  return blob;
}

// Whether the byte just past [p, p + size) is in an inaccessible mapping of this process.
bool followed_by_guard_page(const void* p, size_t size) {
  const auto end = reinterpret_cast<uintptr_t>(p) + size;  // NOLINT
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    uintptr_t lo = 0;
    uintptr_t hi = 0;
    char perms[8] = {};
    if (std::sscanf(line.c_str(), "%lx-%lx %7s", &lo, &hi, perms) != 3) continue;
    if (end >= lo && end < hi) return std::strncmp(perms, "---", 3) == 0;
  }
  return false;
}

// Runs the loom command; its exit status and its stdout + stderr.
struct Cli {
  int status = -1;
  std::string out;
};
Cli run_cli(const std::string& args) {
  const std::string cmd = std::string(LOOM_CLI_PATH) + " " + args + " 2>&1";
  Cli r;
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (pipe == nullptr) return r;
  std::array<char, 4096> buf{};
  size_t n = 0;
  while ((n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0) r.out.append(buf.data(), n);
  const int st = ::pclose(pipe);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

nlohmann::json describe(const std::string& name) {
  char* raw = nullptr;
  const int32_t rc = loom_describe_plugins(name.c_str(), kPluginDir.c_str(), &raw);
  EXPECT_EQ(rc, LOOM_OK) << loom_last_error();
  if (raw == nullptr) return {};
  auto doc = nlohmann::json::parse(raw);
  loom_free_string(raw);
  return doc;
}

// ------------------------------------------------------------------ tests

class Compat : public ::testing::TestWithParam<Era> {};

std::string era_name(const ::testing::TestParamInfo<Era>& info) {
  return std::string("abi_1_") + std::to_string(info.param.minor);
}

INSTANTIATE_TEST_SUITE_P(Eras, Compat, ::testing::ValuesIn(kEras), era_name);

TEST_P(Compat, DescribesWithItsOwnMinorAndSchema) {
  const Era& e = GetParam();
  const auto doc = describe(e.sgd);
  ASSERT_EQ(doc["plugins"].size(), 1U) << doc.dump(2);
  const auto& p = doc["plugins"][0];
  EXPECT_EQ(p["name"], e.sgd);
  EXPECT_EQ(p["abi"], e.abi);
  EXPECT_EQ(p["version"], std::string(e.abi) + ".0");
  ASSERT_EQ(p["kinds"].size(), 1U);
  const auto& k = p["kinds"][0];
  EXPECT_EQ(k["kind"], "loom.optimizer/1");
  EXPECT_EQ(k["has_state"], true);
  ASSERT_EQ(k["params"].size(), 4U);
  EXPECT_EQ(k["params"][0]["name"], "momentum");
  EXPECT_EQ(k["params"][0]["default"], 0.9);
  EXPECT_EQ(k["params"][0]["max"], 0.999);
  EXPECT_EQ(k["params"][1]["name"], "weight_decay");
  EXPECT_EQ(k["params"][2]["name"], "update");
  EXPECT_EQ(k["params"][2]["default"], "plain");
  EXPECT_EQ(k["params"][2]["choices"], nlohmann::json({"plain", "nesterov"}));
  EXPECT_EQ(k["params"][3]["name"], "codec");
  EXPECT_EQ(k["params"][3]["ref_kind"], "loom.codec/1");

  const auto cdoc = describe(e.codec);
  ASSERT_EQ(cdoc["plugins"].size(), 1U) << cdoc.dump(2);
  const auto& c = cdoc["plugins"][0];
  EXPECT_EQ(c["abi"], e.abi);
  ASSERT_EQ(c["kinds"].size(), 1U);
  EXPECT_EQ(c["kinds"][0]["kind"], "loom.codec/1");
  EXPECT_EQ(c["kinds"][0]["has_state"], false);  // its factory's export_state is NULL
  ASSERT_EQ(c["kinds"][0]["params"].size(), 1U);
  EXPECT_EQ(c["kinds"][0]["params"][0]["name"], "levels");
  EXPECT_EQ(c["kinds"][0]["params"][0]["default"], 127);
  EXPECT_EQ(c["kinds"][0]["params"][0]["min"], 1);
}

TEST_P(Compat, ManifestIsValidatedAgainstItsSchema) {
  const Era& e = GetParam();
  Session s;
  const std::string head = "[codec.c]\nplugin = \"" + std::string(e.codec) +
                           "\"\n[optimizer.o]\nplugin = \"" + e.sgd + "\"\n";
  EXPECT_EQ(s.open(head + "momentum = 0.5\nupdate = \"nesterov\"\ncodec = \"c\"\n", true), LOOM_OK)
      << s.error();

  EXPECT_EQ(s.open(head + "momentum = 1.5\n", true), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(s.error(), StartsWith(s.at(5, 12)));
  EXPECT_THAT(s.error(), HasSubstr("parameter 'momentum' of optimizer.o = 1.5 is out of range"));

  EXPECT_EQ(s.open(head + "update = \"nesterof\"\n", true), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(s.error(), StartsWith(s.at(5, 10)));
  EXPECT_THAT(s.error(), HasSubstr("nesterov"));

  EXPECT_EQ(s.open(head + "momentun = 0.5\n", true), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(s.error(), StartsWith(s.at(5, 1)));
  EXPECT_THAT(s.error(), HasSubstr("momentun"));
  EXPECT_THAT(s.error(), HasSubstr("did you mean 'momentum'"));

  EXPECT_EQ(s.open(head + "codec = \"o\"\n", true), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(s.error(), StartsWith(s.at(5, 9)));
  EXPECT_THAT(s.error(), HasSubstr("must name a loom.codec/1 instance"));

  EXPECT_EQ(s.open("[codec.c]\nplugin = \"" + std::string(e.codec) + "\"\nlevels = 0\n", true),
            LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(s.error(), StartsWith(s.at(3, 10)));
  EXPECT_THAT(s.error(), HasSubstr("out of range [1, 127]"));
}

// Two groups (the second with its own lr_scale and weight_decay), three tensors, loss
// scaling, both momentum variants, through loom_optimizer_step with today's structs; the
// fixture walks them by struct_size. Results match the reference computed here.
TEST_P(Compat, StepsMatchTheReference) {
  const Era& e = GetParam();
  for (const bool nesterov : {false, true}) {
    SCOPED_TRACE(nesterov ? "nesterov" : "plain");
    Session s;
    ASSERT_EQ(s.open("[optimizer.o]\nplugin = \"" + std::string(e.sgd) +
                     "\"\nmomentum = 0.8\nweight_decay = 0.01\nupdate = \"" +
                     (nesterov ? "nesterov" : "plain") + "\"\n"),
              LOOM_OK)
        << s.error();
    loom_instance* opt = s.find("optimizer", "o");
    ASSERT_NE(opt, nullptr);
    EXPECT_STREQ(loom_instance_plugin(opt), e.sgd);

    std::vector<float> a = {1.0F, -2.0F, 0.5F, 3.0F, -0.25F};
    std::vector<float> b = {0.1F, 0.2F, -0.3F};
    std::vector<float> c = {4.0F, -4.0F, 2.0F, 1.0F};
    std::vector<float> ga(a.size());
    std::vector<float> gb(b.size());
    std::vector<float> gc(c.size());
    auto ra = a;
    auto rb = b;
    auto rc = c;
    RefSgd ref;
    ref.momentum = 0.8;
    ref.weight_decay = 0.01;
    ref.nesterov = nesterov;
    for (int64_t step = 1; step <= 4; ++step) {
      const auto fs = static_cast<float>(step);
      for (size_t i = 0; i < ga.size(); ++i) ga[i] = 0.3F * static_cast<float>(i) - 0.1F * fs;
      for (size_t i = 0; i < gb.size(); ++i) gb[i] = 1.0F - 0.5F * static_cast<float>(i) * fs;
      for (size_t i = 0; i < gc.size(); ++i) gc[i] = 0.05F * (static_cast<float>(i) + fs);
      std::vector<RefSgd::Group> host_groups = {
          {{{&a, &ga, nullptr}, {&b, &gb, nullptr}}, 1.0, std::nan("")},
          {{{&c, &gc, nullptr}}, 0.5, 0.1}};
      ASSERT_EQ(host_step(opt, host_groups, 0.1, 2.0, step), LOOM_OK) << loom_last_error();
      std::vector<RefSgd::Group> ref_groups = {
          {{{&ra, &ga, nullptr}, {&rb, &gb, nullptr}}, 1.0, std::nan("")},
          {{{&rc, &gc, nullptr}}, 0.5, 0.1}};
      ref.step(ref_groups, 0.1, 2.0, false);
      for (size_t i = 0; i < a.size(); ++i)
        EXPECT_FLOAT_EQ(a[i], ra[i]) << "a[" << i << "] step " << step;
      for (size_t i = 0; i < b.size(); ++i)
        EXPECT_FLOAT_EQ(b[i], rb[i]) << "b[" << i << "] step " << step;
      for (size_t i = 0; i < c.size(); ++i)
        EXPECT_FLOAT_EQ(c[i], rc[i]) << "c[" << i << "] step " << step;
    }
    EXPECT_NE(a[0], 1.0F);  // it did move

    // The simple path (one group, loom_optimizer_step_f32) on a fresh instance.
    ASSERT_EQ(s.open("[optimizer.o]\nplugin = \"" + std::string(e.sgd) + "\"\n"), LOOM_OK)
        << s.error();
    opt = s.find("optimizer", "o");
    std::vector<float> p = {1.0F, 2.0F};
    const std::vector<float> g = {0.5F, -1.0F};
    auto rp = p;
    RefSgd ref2;  // defaults: momentum 0.9, no weight decay
    float* params[] = {p.data()};
    const float* grads[] = {g.data()};
    const int64_t numels[] = {2};
    for (int step = 0; step < 2; ++step) {
      ASSERT_EQ(loom_optimizer_step_f32(opt, params, grads, numels, 1, 0.5), LOOM_OK)
          << loom_last_error();
      ref2.step({{{{&rp, &g, nullptr}}}}, 0.5, 1.0, false);
    }
    EXPECT_FLOAT_EQ(p[0], rp[0]);
    EXPECT_FLOAT_EQ(p[1], rp[1]);
  }
}

// The optimizer references the codec (a REF parameter resolved by the host to the codec's
// object and 1.0- or 1.1-sized table); every gradient goes through it.
TEST_P(Compat, OptimizerUsesTheReferencedCodec) {
  const Era& e = GetParam();
  Session s;
  ASSERT_EQ(s.open("[codec.c]\nplugin = \"" + std::string(e.codec) +
                   "\"\nlevels = 7\n[optimizer.o]\nplugin = \"" + e.sgd +
                   "\"\ncodec = \"c\"\nmomentum = 0.5\n"),
            LOOM_OK)
      << s.error();
  loom_instance* opt = s.find("optimizer", "o");
  ASSERT_NE(opt, nullptr);
  std::vector<float> p = {0.0F, 1.0F, -1.0F, 0.5F, 2.0F, 0.0F};
  const std::vector<float> g = {0.7F, -0.33F, 0.01F, 0.49F, -0.7F, 0.2F};
  auto rp = p;
  RefCodec codec;
  codec.levels = 7.0F;
  RefSgd ref;
  ref.momentum = 0.5;
  ref.codec = &codec;
  for (int64_t step = 1; step <= 3; ++step) {
    ASSERT_EQ(host_step(opt, {{{{&p, &g, nullptr}}}}, 0.1, 1.0, step), LOOM_OK)
        << loom_last_error();
    ref.step({{{{&rp, &g, nullptr}}}}, 0.1, 1.0, false);
  }
  for (size_t i = 0; i < p.size(); ++i) EXPECT_FLOAT_EQ(p[i], rp[i]) << i;
  // Quantisation to 7 levels is visible: not the same as without the codec.
  RefSgd plain;
  plain.momentum = 0.5;
  auto pp = std::vector<float>{0.0F, 1.0F, -1.0F, 0.5F, 2.0F, 0.0F};
  for (int step = 0; step < 3; ++step) plain.step({{{{&pp, &g, nullptr}}}}, 0.1, 1.0, false);
  EXPECT_NE(p[2], pp[2]);
}

// export_state (size query, then the copy), import into a fresh instance, and both continue
// identically; damaged blobs are refused and leave the instance as it was.
TEST_P(Compat, StateRoundTripsAndDamagedStateIsRefused) {
  const Era& e = GetParam();
  const std::string toml = "[optimizer.o]\nplugin = \"" + std::string(e.sgd) + "\"\n";
  Session s1;
  ASSERT_EQ(s1.open(toml), LOOM_OK) << s1.error();
  loom_instance* o1 = s1.find("optimizer", "o");
  std::vector<float> p1 = {1.0F, 2.0F, 3.0F};
  std::vector<float> q1 = {-1.0F};
  const std::vector<float> g = {0.25F, -0.5F, 1.0F};
  const std::vector<float> h = {2.0F};
  auto groups = [&](std::vector<float>& p, std::vector<float>& q) {
    return std::vector<RefSgd::Group>{{{{&p, &g, nullptr}, {&q, &h, nullptr}}}};
  };
  for (int64_t step = 1; step <= 2; ++step) {
    ASSERT_EQ(host_step(o1, groups(p1, q1), 0.1, 1.0, step), LOOM_OK) << loom_last_error();
  }
  const auto blob = export_state(o1);
  // "LCSG", version, minor, steps, count, then (numel, values) per tensor.
  ASSERT_EQ(blob.size(), 28U + (8 + 3 * 4) + (8 + 1 * 4));
  EXPECT_EQ(std::memcmp(blob.data(), "LCSG", 4), 0);
  EXPECT_EQ(export_state(o1), blob);  // nothing changed in between: the same bytes

  Session s2;
  ASSERT_EQ(s2.open(toml), LOOM_OK) << s2.error();
  loom_instance* o2 = s2.find("optimizer", "o");
  ASSERT_EQ(loom_instance_import_state(o2, blob.data(), blob.size()), LOOM_OK) << loom_last_error();
  EXPECT_EQ(export_state(o2), blob);
  auto p2 = p1;
  auto q2 = q1;
  ASSERT_EQ(host_step(o1, groups(p1, q1), 0.1, 1.0, 3), LOOM_OK) << loom_last_error();
  ASSERT_EQ(host_step(o2, groups(p2, q2), 0.1, 1.0, 3), LOOM_OK) << loom_last_error();
  EXPECT_EQ(p1, p2);
  EXPECT_EQ(q1, q2);

  // Damaged blobs: the plugin's own status, through the host, naming instance and plugin.
  const auto before = export_state(o2);
  auto truncated = blob;
  truncated.pop_back();
  EXPECT_EQ(loom_instance_import_state(o2, truncated.data(), truncated.size()), LOOM_ERR_DATA_LOSS);
  EXPECT_THAT(loom_last_error(), HasSubstr("optimizer.o"));
  EXPECT_THAT(loom_last_error(), HasSubstr(std::string(e.sgd) + ": import_state:"));
  auto extended = blob;
  extended.push_back(0);
  EXPECT_EQ(loom_instance_import_state(o2, extended.data(), extended.size()), LOOM_ERR_DATA_LOSS);
  auto foreign = blob;
  foreign[0] = 'X';
  EXPECT_EQ(loom_instance_import_state(o2, foreign.data(), foreign.size()),
            LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(loom_last_error(), HasSubstr("not a compat_sgd state"));
  EXPECT_EQ(export_state(o2), before);  // unchanged by the refused imports

  // State of another tensor layout imports, but the next step with these tensors is refused.
  Session s3;
  ASSERT_EQ(s3.open(toml), LOOM_OK) << s3.error();
  loom_instance* o3 = s3.find("optimizer", "o");
  ASSERT_EQ(loom_instance_import_state(o3, blob.data(), blob.size()), LOOM_OK);
  std::vector<float> lone = {1.0F, 2.0F, 3.0F};
  const auto lone_before = lone;
  EXPECT_EQ(host_step(o3, {{{{&lone, &g, nullptr}}}}, 0.1, 1.0, 1), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(loom_last_error(), HasSubstr("but earlier steps (or the imported state) had 2"));
  EXPECT_EQ(lone, lone_before);
}

// The plugin's statuses for bad arguments come back through the host (code, message naming
// the instance), and nothing is changed.
TEST_P(Compat, BadArgumentsAreReportedAndChangeNothing) {
  const Era& e = GetParam();
  Session s;
  ASSERT_EQ(s.open("[optimizer.o]\nplugin = \"" + std::string(e.sgd) + "\"\n"), LOOM_OK)
      << s.error();
  loom_instance* opt = s.find("optimizer", "o");
  std::vector<float> p = {1.0F, 2.0F};
  std::vector<float> q = {5.0F};
  const std::vector<float> g = {1.0F, 1.0F};
  const std::vector<float> short_g = {1.0F};
  EXPECT_EQ(host_step(opt, {{{{&p, &g, nullptr}, {&q, &g, nullptr}}}}, 0.1, 1.0, 1),
            LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(loom_last_error(), HasSubstr("optimizer.o"));
  EXPECT_THAT(loom_last_error(), HasSubstr(std::string(e.sgd) + ": step: group 0 tensor 1"));
  EXPECT_EQ(p, (std::vector<float>{1.0F, 2.0F}));  // the first tensor was not touched either
  EXPECT_EQ(host_step(opt, {{{{&p, &g, nullptr}}}}, 0.1, 0.0, 1), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(loom_last_error(), HasSubstr("grad_scale 0 is not > 0"));
  EXPECT_EQ(host_step(opt, {{{{&q, &short_g, nullptr}}}}, 0.1, 1.0, 1), LOOM_OK)
      << loom_last_error();
}

// What 1.1 added to the optimizer structs, passed by today's host: a 1.1 optimizer applies
// exp_avg_mask and refuses group flags it does not support; a 1.0 optimizer cannot see either
// (its structs end before them) and steps as if they were absent.
TEST_P(Compat, FieldsAfterItsMinorAreInvisibleToIt) {
  const Era& e = GetParam();
  Session s;
  ASSERT_EQ(s.open("[optimizer.o]\nplugin = \"" + std::string(e.sgd) + "\"\nmomentum = 0.5\n"),
            LOOM_OK)
      << s.error();
  loom_instance* opt = s.find("optimizer", "o");
  std::vector<float> p = {1.0F, 1.0F, 1.0F};
  const std::vector<float> g = {1.0F, 2.0F, 3.0F};
  const std::vector<float> mask = {1.0F, 0.0F, 1.0F};
  auto rp = p;
  RefSgd ref;
  ref.momentum = 0.5;
  for (int64_t step = 1; step <= 2; ++step) {
    ASSERT_EQ(host_step(opt, {{{{&p, &g, &mask}}}}, 0.1, 1.0, step), LOOM_OK) << loom_last_error();
    ref.step({{{{&rp, &g, &mask}}}}, 0.1, 1.0, /*masks=*/e.minor >= 1);
  }
  for (size_t i = 0; i < p.size(); ++i) EXPECT_FLOAT_EQ(p[i], rp[i]) << i;
  if (e.minor >= 1) {
    EXPECT_FLOAT_EQ(p[1], 1.0F);  // masked momentum: the element stays where it was
  } else {
    EXPECT_LT(p[1], 1.0F);  // the 1.0 plugin never saw the mask
  }

  const auto kept = p;
  const int32_t rc =
      host_step(opt, {{{{&p, &g, nullptr}}}}, 0.1, 1.0, 3, LOOM_OPTIMIZER_GROUP_NON_FREEZE);
  if (e.minor >= 1) {
    EXPECT_EQ(rc, LOOM_ERR_INVALID_ARGUMENT);
    EXPECT_THAT(loom_last_error(), HasSubstr("group 0 has flags 0x1"));
    EXPECT_EQ(p, kept);
  } else {
    EXPECT_EQ(rc, LOOM_OK) << loom_last_error();
    EXPECT_NE(p, kept);
  }
}

// The codec through loom_instance_table: a 1.0 table (ends at decode) is refused for a caller
// that needs decode_sum, with UNIMPLEMENTED; a 1.1 table serves it. Encode and decode match
// the reference.
TEST_P(Compat, CodecTableIsCheckedAgainstItsSize) {
  const Era& e = GetParam();
  Session s;
  ASSERT_EQ(s.open("[codec.c]\nplugin = \"" + std::string(e.codec) + "\"\nlevels = 100\n"), LOOM_OK)
      << s.error();
  loom_instance* inst = s.find("codec", "c");
  ASSERT_NE(inst, nullptr);
  void* obj = nullptr;
  const void* raw = nullptr;
  ASSERT_EQ(loom_instance_table(inst, "codec", LOOM_CODEC_V1_MIN_SIZE, &obj, &raw), LOOM_OK)
      << loom_last_error();
  const auto* table = static_cast<const loom_codec_v1*>(raw);
  EXPECT_EQ(table->struct_size, e.minor == 0 ? 40U : 48U);
  // The fixture's table ends where an inaccessible page begins (so does everything else it
  // hands the host): a read past its era's size would fault.
  EXPECT_TRUE(followed_by_guard_page(table, table->struct_size));
  EXPECT_EQ(loom_instance_table(inst, "optimizer", LOOM_CODEC_V1_MIN_SIZE, &obj, &raw),
            LOOM_ERR_INVALID_ARGUMENT);
  ASSERT_EQ(loom_instance_table(inst, "codec", LOOM_CODEC_V1_MIN_SIZE, &obj, &raw), LOOM_OK);

  EXPECT_EQ(table->supports_device(obj, DLDevice{kDLCPU, 0}), 1);
  EXPECT_EQ(table->supports_device(obj, DLDevice{kDLCUDA, 0}), 0);
  loom_codec_layout layout{};
  layout.struct_size = LOOM_CODEC_LAYOUT_SIZE;
  layout.elements = 10;
  layout.world_size = 3;
  ASSERT_EQ(loom_instance_take_status(inst, table->layout(obj, &layout), nullptr, 0), LOOM_OK);
  EXPECT_EQ(layout.padded_elements, 12U);
  EXPECT_EQ(layout.chunk_bytes, 8U);

  std::vector<float> in(12);
  for (size_t i = 0; i < in.size(); ++i) in[i] = std::sin(static_cast<float>(i) + 0.5F);
  std::vector<float> err(12, 0.01F);
  auto ref_err = err;
  RefCodec ref;
  ref.levels = 100.0F;
  const auto want = ref.encode(in, ref_err.data(), 3);
  std::vector<unsigned char> enc(3 * layout.chunk_bytes);
  Tensor1d tin(in);
  Tensor1d terr(err);
  loom_codec_encode_args ea{};
  ea.struct_size = LOOM_CODEC_ENCODE_ARGS_SIZE;
  ea.chunk_count = 3;
  ea.input = &tin.t;
  ea.error = &terr.t;
  ea.output = enc.data();
  ASSERT_EQ(loom_instance_take_status(inst, table->encode(obj, &ea), nullptr, 0), LOOM_OK)
      << loom_last_error();
  EXPECT_EQ(enc, want);
  EXPECT_EQ(err, ref_err);

  std::vector<float> out(12, 1.0F);
  Tensor1d tout(out);
  loom_codec_decode_args da{};
  da.struct_size = LOOM_CODEC_DECODE_ARGS_SIZE;
  da.chunk_count = 3;
  da.input = enc.data();
  da.output = &tout.t;
  da.alpha = 0.5F;
  da.accumulate = 1;
  ASSERT_EQ(loom_instance_take_status(inst, table->decode(obj, &da), nullptr, 0), LOOM_OK)
      << loom_last_error();
  for (size_t i = 0; i < out.size(); ++i) {
    EXPECT_EQ(out[i], 1.0F + RefCodec::decoded(want.data() + (i / 4) * 8, i % 4, 0.5F)) << i;
  }

  // A bad call: the plugin's own status, its message kept by the host.
  ea.chunk_count = 5;
  char message[256] = {};
  EXPECT_EQ(loom_instance_take_status(inst, table->encode(obj, &ea), message, sizeof message),
            LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(message, HasSubstr("do not split into 5 chunks"));
  EXPECT_THAT(loom_last_error(), StartsWith("codec.c (plugin '" + std::string(e.codec) + "'"));

  // decode_sum: absent from a 1.0 table, so a caller that needs it is told so.
  const uint32_t with_sum = LOOM_STRUCT_SIZE(loom_codec_v1, decode_sum);
  const int32_t rc = loom_instance_table(inst, "codec", with_sum, &obj, &raw);
  if (e.minor == 0) {
    EXPECT_EQ(rc, LOOM_ERR_UNIMPLEMENTED);
    EXPECT_THAT(loom_last_error(), HasSubstr("codec.c"));
    return;
  }
  ASSERT_EQ(rc, LOOM_OK) << loom_last_error();
  ASSERT_NE(table->decode_sum, nullptr);
  std::vector<float> sum(4, 2.0F);
  Tensor1d tsum(sum);
  da.output = &tsum.t;
  da.alpha = 1.0F;
  da.accumulate = 1;
  ASSERT_EQ(loom_instance_take_status(inst, table->decode_sum(obj, &da), nullptr, 0), LOOM_OK)
      << loom_last_error();
  for (size_t i = 0; i < sum.size(); ++i) {
    float acc = 2.0F + RefCodec::decoded(want.data(), i, 1.0F);
    acc = acc + RefCodec::decoded(want.data() + 8, i, 1.0F);
    acc = acc + RefCodec::decoded(want.data() + 16, i, 1.0F);
    EXPECT_EQ(sum[i], acc) << i;
  }
}

// The loom command: describe (text and JSON) and check, exit statuses as documented.
TEST_P(Compat, LoomDescribeAndCheck) {
  const Era& e = GetParam();
  const std::string path = " --plugin-path " + kPluginDir;
  const auto text = run_cli("describe " + std::string(e.sgd) + path);
  EXPECT_EQ(text.status, 0) << text.out;
  EXPECT_THAT(text.out, StartsWith(std::string(e.sgd) + " " + e.abi + ".0: "));
  EXPECT_THAT(text.out, HasSubstr("ABI:  " + std::string(e.abi) + "\n"));
  EXPECT_THAT(text.out, HasSubstr("loom.optimizer/1 (exports state)"));
  EXPECT_THAT(text.out, HasSubstr("update (a string), default \"plain\", one of plain|nesterov"));

  const auto json = run_cli("describe " + std::string(e.codec) + " --json" + path);
  ASSERT_EQ(json.status, 0) << json.out;
  const auto doc = nlohmann::json::parse(json.out);
  EXPECT_EQ(doc["abi"], e.abi);
  EXPECT_EQ(doc["kinds"][0]["kind"], "loom.codec/1");

  loom_test::TempDir dir;
  const auto good =
      dir.write("good.toml", "[codec.c]\nplugin = \"" + std::string(e.codec) +
                                 "\"\n[optimizer.o]\nplugin = \"" + e.sgd + "\"\ncodec = \"c\"\n");
  const auto ok = run_cli("check " + good.string() + path);
  EXPECT_EQ(ok.status, 0) << ok.out;
  EXPECT_EQ(ok.out, good.string() + ": ok\n");

  const auto bad = dir.write(
      "bad.toml", "[optimizer.o]\nplugin = \"" + std::string(e.sgd) + "\"\nmomentum = -1\n");
  const auto refused = run_cli("check " + bad.string() + path);
  EXPECT_EQ(refused.status, 2) << refused.out;
  EXPECT_THAT(refused.out, StartsWith(bad.string() + ":3:12: "));
  EXPECT_THAT(refused.out, HasSubstr("'momentum'"));
}

// Checkpoints survive a plugin upgrade: state written by the 1.0 build imports into the 1.1
// build and back (the plugin's format did not change with the ABI minor).
TEST(CompatAcrossEras, StateMovesBetweenTheBuilds) {
  Session old_s;
  Session new_s;
  ASSERT_EQ(old_s.open("[optimizer.o]\nplugin = \"compat10_sgd\"\n"), LOOM_OK) << old_s.error();
  ASSERT_EQ(new_s.open("[optimizer.o]\nplugin = \"compat11_sgd\"\n"), LOOM_OK) << new_s.error();
  loom_instance* o10 = old_s.find("optimizer", "o");
  loom_instance* o11 = new_s.find("optimizer", "o");
  std::vector<float> p = {1.0F, -1.0F};
  const std::vector<float> g = {0.5F, 0.25F};
  ASSERT_EQ(host_step(o10, {{{{&p, &g, nullptr}}}}, 0.1, 1.0, 1), LOOM_OK) << loom_last_error();
  const auto blob = export_state(o10);
  ASSERT_EQ(loom_instance_import_state(o11, blob.data(), blob.size()), LOOM_OK)
      << loom_last_error();
  auto p11 = p;
  ASSERT_EQ(host_step(o10, {{{{&p, &g, nullptr}}}}, 0.1, 1.0, 2), LOOM_OK);
  ASSERT_EQ(host_step(o11, {{{{&p11, &g, nullptr}}}}, 0.1, 1.0, 2), LOOM_OK);
  EXPECT_EQ(p, p11);
  // Each blob records the minor that wrote it (byte 8); the rest is the same.
  auto b10 = export_state(o10);
  auto b11 = export_state(o11);
  EXPECT_EQ(b10[8], 0);
  EXPECT_EQ(b11[8], 1);
  b11[8] = 0;
  EXPECT_EQ(b10, b11);
  ASSERT_EQ(loom_instance_import_state(o10, export_state(o11).data(), b11.size()), LOOM_OK)
      << loom_last_error();
}

// Plugins of both eras wired together in one manifest: a 1.0 optimizer over a 1.1 codec and
// a 1.1 optimizer over a 1.0 codec.
TEST(CompatAcrossEras, MixedErasInOneManifest) {
  Session s;
  ASSERT_EQ(s.open("[codec.new]\nplugin = \"compat11_codec\"\n[codec.old]\nplugin = "
                   "\"compat10_codec\"\n[optimizer.a]\nplugin = \"compat10_sgd\"\ncodec = "
                   "\"new\"\n[optimizer.b]\nplugin = \"compat11_sgd\"\ncodec = \"old\"\n"),
            LOOM_OK)
      << s.error();
  std::vector<float> pa = {1.0F, 2.0F, 3.0F};
  auto pb = pa;
  auto rp = pa;
  const std::vector<float> g = {0.3F, -0.6F, 0.9F};
  RefCodec codec;
  RefSgd ref;
  ref.codec = &codec;
  ASSERT_EQ(host_step(s.find("optimizer", "a"), {{{{&pa, &g, nullptr}}}}, 0.1, 1.0, 1), LOOM_OK)
      << loom_last_error();
  ASSERT_EQ(host_step(s.find("optimizer", "b"), {{{{&pb, &g, nullptr}}}}, 0.1, 1.0, 1), LOOM_OK)
      << loom_last_error();
  ref.step({{{{&rp, &g, nullptr}}}}, 0.1, 1.0, false);
  for (size_t i = 0; i < rp.size(); ++i) {
    EXPECT_FLOAT_EQ(pa[i], rp[i]) << i;
    EXPECT_FLOAT_EQ(pb[i], rp[i]) << i;
  }
}

}  // namespace
