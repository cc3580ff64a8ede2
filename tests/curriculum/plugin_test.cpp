// The curriculum plugins through the host (the path the analyzer, the sampler and the trainer
// take): the schedules' at() against schedule.hpp, the metrics on the host's thread pool
// against the same kernels run inline (bit for bit), errors as statuses, `loom describe`'s
// schema (descriptions, bounds, required keys) and `loom check` reporting bad parameters at
// their key.
#include <gtest/gtest.h>
#include <loom/embed.h>
#include <loom/kinds/curriculum.h>
#include <sys/wait.h>
#include <nlohmann/json.hpp>

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "kernels.hpp"
#include "samples.hpp"
#include "schedule.hpp"

namespace {

namespace cl = loom::data::curriculum;
using namespace curriculum_test;

constexpr const char* kKind = LOOM_KIND_CURRICULUM;

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

// One instance's table and object.
struct Curriculum {
  loom_instance* inst = nullptr;
  void* obj = nullptr;
  const loom_curriculum_v1* t = nullptr;
  Curriculum(Session& s, const char* name) {
    if (loom_find_instance(s.s, kKind, name, &inst) != 0) {
      ADD_FAILURE() << "find " << name << ": " << loom_last_error();
      return;
    }
    const void* table = nullptr;
    if (loom_instance_table(inst, kKind, LOOM_CURRICULUM_V1_MIN_SIZE, &obj, &table) != 0) {
      ADD_FAILURE() << "table " << name << ": " << loom_last_error();
    }
    t = static_cast<const loom_curriculum_v1*>(table);
  }
  // 0, or the error's code with its text in `error`.
  int32_t take(loom_status* st) {
    std::array<char, 1024> msg{};
    const int32_t rc = loom_instance_take_status(inst, st, msg.data(), msg.size());
    error = msg.data();
    return rc;
  }
  loom_curriculum_plan_args plan(uint32_t vocab) {
    loom_curriculum_plan_args a{};
    a.struct_size = LOOM_CURRICULUM_PLAN_ARGS_SIZE;
    a.vocab_size = vocab;
    EXPECT_EQ(take(t->plan(obj, &a)), 0) << error;
    return a;
  }
  loom_curriculum_at_args at(int64_t step) {
    loom_curriculum_at_args a{};
    a.struct_size = LOOM_CURRICULUM_AT_ARGS_SIZE;
    a.step = step;
    EXPECT_EQ(take(t->at(obj, &a)), 0) << error;
    return a;
  }
  std::string error;
};

const char* kSchedules = R"(
[curriculum.lin]
plugin = "fixed_linear"
min_difficulty = 2
max_difficulty = 10
total_curriculum_step = 8
difficulty_step = 2

[curriculum.root]
plugin = "fixed_root"
min_difficulty = 1
max_difficulty = 100
total_curriculum_step = 110000
root_degree = 2

[curriculum.stages]
plugin = "fixed_discrete"
difficulty = [1, 2, 3, 4, 5]
max_step = [2, 4, 6, 8]

[curriculum.slw]
plugin = "seqlen_warmup"
min_difficulty = 80
max_difficulty = 2048
total_curriculum_step = 110000

[curriculum.slw_root]
plugin = "seqlen_warmup"
mode = "reshape"
schedule_type = "fixed_root"
root_degree = 2
min_difficulty = 1
max_difficulty = 1024
total_curriculum_step = 5000
difficulty_step = 8

[curriculum.slw_min1]
plugin = "seqlen_warmup"
min_difficulty = 1
max_difficulty = 1024
total_curriculum_step = 5000
)";

TEST(CurriculumPlugins, SchedulesMatchTheFormulas) {
  Session s(kSchedules);
  cl::RootSchedule lin{2, 10, 8, 2, 1};
  cl::RootSchedule root{1, 100, 110000, 1, 2};
  cl::DiscreteSchedule stages{{1, 2, 3, 4, 5}, {2, 4, 6, 8}};
  cl::RootSchedule slw{80, 2048, 110000, 8, 1};
  cl::RootSchedule slw_root{1, 1024, 5000, 8, 2};
  Curriculum c_lin(s, "lin"), c_root(s, "root"), c_stages(s, "stages"), c_slw(s, "slw"),
      c_slw_root(s, "slw_root");
  ASSERT_NE(c_slw_root.t, nullptr);
  for (Curriculum* c : {&c_lin, &c_root, &c_stages, &c_slw, &c_slw_root}) {
    EXPECT_EQ(c->t->score, nullptr);
    EXPECT_EQ(c->t->count, nullptr);
    EXPECT_NE(c->t->at, nullptr);
    const auto p = c->plan(100);
    EXPECT_EQ(p.roles, LOOM_CURRICULUM_SCHEDULE);
    EXPECT_EQ(p.stats_count, 0u);
  }
  EXPECT_EQ(c_lin.plan(1).seq_len_mode, LOOM_SEQ_LEN_NONE);
  EXPECT_EQ(c_slw.plan(1).seq_len_mode, LOOM_SEQ_LEN_TRUNCATE);
  EXPECT_EQ(c_slw_root.plan(1).seq_len_mode, LOOM_SEQ_LEN_RESHAPE);
  for (int64_t step :
       {1, 2, 3, 7, 8, 9, 10, 100, 999, 1000, 4999, 5000, 27500, 55000, 110000, 1000000}) {
    EXPECT_EQ(c_lin.at(step).difficulty, cl::difficulty_at(lin, step)) << step;
    EXPECT_EQ(c_lin.at(step).seq_len, 0);
    EXPECT_EQ(c_root.at(step).difficulty, cl::difficulty_at(root, step)) << step;
    EXPECT_EQ(c_stages.at(step).difficulty, cl::difficulty_at(stages, step)) << step;
    const auto a = c_slw.at(step);
    EXPECT_EQ(a.seq_len, cl::seq_len_at(slw, step)) << step;
    EXPECT_EQ(a.difficulty, static_cast<double>(a.seq_len));
    const auto b = c_slw_root.at(step);
    EXPECT_EQ(b.seq_len, cl::seq_len_at(slw_root, step)) << step;
    EXPECT_GE(b.seq_len, 1);
  }
  EXPECT_EQ(c_slw.at(1000).seq_len, 96);
  EXPECT_EQ(c_slw_root.at(1).seq_len, 8);  // floor(sqrt(1 / 5000) * 1023 + 1) = 15 -> 8
  Curriculum c_slw_min1(s, "slw_min1");
  ASSERT_NE(c_slw_min1.t, nullptr);
  EXPECT_EQ(c_slw_min1.at(1).seq_len, 1);  // min 1, q 8: 1 -> 0 in DeepSpeed; clamped to 1
  EXPECT_EQ(c_slw_min1.at(1).difficulty, 1.0);
  EXPECT_EQ(c_slw_min1.at(40).seq_len, 8);  // floor(40 / 5000 * 1023 + 1) = 9 -> 8
  // Step 0 is refused.
  loom_curriculum_at_args a{};
  a.struct_size = LOOM_CURRICULUM_AT_ARGS_SIZE;
  a.step = 0;
  EXPECT_EQ(c_lin.take(c_lin.t->at(c_lin.obj, &a)), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(c_lin.error.find("step"), std::string::npos) << c_lin.error;
}

TEST(CurriculumPlugins, MetricsOnThePoolMatchInline) {
  Session s(
      "[curriculum.len]\nplugin = \"seqlen\"\npad_token = 0\n"
      "[curriculum.voc]\nplugin = \"vocabulary_rarity\"\n");
  Curriculum len(s, "len"), voc(s, "voc");
  ASSERT_NE(voc.t, nullptr);
  constexpr uint32_t kVocab = 5000;
  EXPECT_EQ(len.plan(kVocab).roles, LOOM_CURRICULUM_METRIC);
  EXPECT_EQ(len.plan(kVocab).stats_count, 0u);
  EXPECT_EQ(len.t->count, nullptr);
  EXPECT_EQ(voc.plan(kVocab).roles, LOOM_CURRICULUM_METRIC);
  EXPECT_EQ(voc.plan(kVocab).stats_count, kVocab);
  EXPECT_NE(voc.t->count, nullptr);
  EXPECT_EQ(voc.t->at, nullptr);
  // Enough samples that the pool splits them.
  HostBatch h = random_batch(7, 20000, 64, kVocab);
  std::vector<unsigned char> bytes = pack(h.tokens, kU16);
  Tensor tok(bytes.data(), static_cast<int64_t>(h.tokens.size()), kU16);
  Tensor off(h.offsets.data(), static_cast<int64_t>(h.offsets.size()), kI64);
  const int64_t n = static_cast<int64_t>(h.offsets.size()) - 1;
  cl::SampleData d;
  d.tokens = bytes.data();
  d.type = cl::TokenType::kU16;
  d.token_count = static_cast<int64_t>(h.tokens.size());
  d.offsets = h.offsets.data();
  d.samples = n;
  d.vocab_size = kVocab;

  std::vector<double> scores(n), inline_scores(n);
  Tensor out(scores.data(), n, kF64);
  auto sa = score_args(tok, off, kVocab, nullptr, out);
  ASSERT_EQ(len.take(len.t->score(len.obj, &sa)), 0) << len.error;
  ASSERT_EQ(cl::seqlen_cpu(d, 0, inline_scores.data()).kind, cl::Problem::kNone);
  EXPECT_EQ(scores, inline_scores);

  std::vector<int64_t> stats(kVocab, 0), inline_stats(kVocab, 0);
  Tensor st(stats.data(), kVocab, kI64);
  auto ca = count_args(tok, off, kVocab, st);
  ASSERT_EQ(voc.take(voc.t->count(voc.obj, &ca)), 0) << voc.error;
  ASSERT_EQ(cl::count_cpu(d, inline_stats.data()).kind, cl::Problem::kNone);
  EXPECT_EQ(stats, inline_stats);
  auto ra = score_args(tok, off, kVocab, st.get(), out);
  ASSERT_EQ(voc.take(voc.t->score(voc.obj, &ra)), 0) << voc.error;
  const auto table = cl::rarity_table(stats.data(), kVocab);
  ASSERT_EQ(cl::rarity_cpu(d, table, inline_scores.data()).kind, cl::Problem::kNone);
  EXPECT_EQ(std::memcmp(scores.data(), inline_scores.data(), n * sizeof(double)), 0);

  // A bad token comes back as a status naming it.
  h.tokens[12345] = kVocab;
  bytes = pack(h.tokens, kU16);
  tok.t.data = bytes.data();
  EXPECT_EQ(voc.take(voc.t->score(voc.obj, &ra)), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(voc.error.find("samples.tokens[12345] is 5000"), std::string::npos) << voc.error;
  // pad_token must be below the vocabulary.
  loom_curriculum_plan_args p{};
  p.struct_size = LOOM_CURRICULUM_PLAN_ARGS_SIZE;
  p.vocab_size = 100;
  Session s2("[curriculum.len]\nplugin = \"seqlen\"\npad_token = 100\n");
  Curriculum big(s2, "len");
  ASSERT_NE(big.t, nullptr);
  EXPECT_EQ(big.take(big.t->plan(big.obj, &p)), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(big.error.find("pad_token 100 is not below the dataset's vocab_size 100"),
            std::string::npos)
      << big.error;
}

// ---- describe and check

struct CliRun {
  int exit_code = -1;
  std::string out, err;
};

CliRun loom_cli(const std::string& args) {
  const auto err_file = std::filesystem::temp_directory_path() /
                        ("curriculum_cli_" + std::to_string(::getpid()) + ".err");
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

TEST(CurriculumPlugins, DescribeHasEveryParameterWithBounds) {
  const std::map<std::string, std::vector<std::string>> plugins = {
      {"seqlen", {"pad_token"}},
      {"vocabulary_rarity", {}},
      {"fixed_linear",
       {"min_difficulty", "max_difficulty", "total_curriculum_step", "difficulty_step"}},
      {"fixed_root",
       {"min_difficulty", "max_difficulty", "total_curriculum_step", "difficulty_step",
        "root_degree"}},
      {"fixed_discrete", {"difficulty", "max_step"}},
      {"seqlen_warmup",
       {"mode", "schedule_type", "min_difficulty", "max_difficulty", "total_curriculum_step",
        "difficulty_step", "root_degree"}},
  };
  for (const auto& [name, params] : plugins) {
    SCOPED_TRACE(name);
    char* json = nullptr;
    ASSERT_EQ(loom_describe_plugins(name.c_str(), nullptr, &json), 0) << loom_last_error();
    const auto doc = nlohmann::json::parse(json);
    loom_free_string(json);
    ASSERT_EQ(doc["plugins"].size(), 1u);
    const auto& kind = doc["plugins"][0]["kinds"][0];
    EXPECT_EQ(kind["kind"], kKind);
    std::vector<std::string> names;
    for (const auto& p : kind["params"]) {
      names.push_back(p["name"]);
      EXPECT_GE(p["doc"].get<std::string>().size(), 20u) << p["name"];
      if (p["name"] == "total_curriculum_step" || p["name"] == "difficulty_step") {
        EXPECT_EQ(p["min"], 1) << p["name"];
      }
      if (p["name"] == "root_degree") {
        EXPECT_EQ(p["min"], 0.0);
        EXPECT_EQ(p["min_exclusive"], true);
        EXPECT_EQ(p["required"], name == "fixed_root");
      }
      if (p["name"] == "max_step") {
        EXPECT_EQ(p["min"], 1);
      }
      if (p["name"] == "mode") {
        EXPECT_EQ(p["choices"].size(), 2u);
      }
    }
    EXPECT_EQ(names, params);
    EXPECT_EQ(kind["has_validate"], !params.empty() && name != "seqlen");
  }
  const CliRun r = loom_cli("describe seqlen_warmup");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("difficulty_step (an integer), default 8, range [1, "), std::string::npos)
      << r.out;
}

// `loom check` on a manifest: exit 0, or exit 2 with an error at `key` saying `text`.
void expect_check(const std::string& toml, const std::string& key, const std::string& text) {
  const auto file = std::filesystem::temp_directory_path() /
                    ("curriculum_check_" + std::to_string(::getpid()) + ".toml");
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
  // "parameter 'KEY' of curriculum.x: ..." or "curriculum.x is missing required parameter 'KEY'"
  EXPECT_NE(r.err.find("'" + key + "'"), std::string::npos) << toml << r.err;
  EXPECT_NE(r.err.find("curriculum.x"), std::string::npos) << toml << r.err;
  EXPECT_NE(r.err.find(text), std::string::npos) << toml << r.err;
}

TEST(CurriculumPlugins, CheckReportsBadParametersAtTheKey) {
  expect_check(kSchedules, "", "");
  const std::string lin = "[curriculum.x]\nplugin = \"fixed_linear\"\n";
  expect_check(lin + "min_difficulty = 10\nmax_difficulty = 2\ntotal_curriculum_step = 5\n",
               "min_difficulty", "above max_difficulty");
  expect_check(lin + "min_difficulty = 1\nmax_difficulty = 2\ntotal_curriculum_step = 0\n",
               "total_curriculum_step", "");
  expect_check(lin +
                   "min_difficulty = 1\nmax_difficulty = 2\ntotal_curriculum_step = 5\n"
                   "difficulty_step = 0\n",
               "difficulty_step", "");
  expect_check(lin + "max_difficulty = 2\ntotal_curriculum_step = 5\n", "min_difficulty", "");
  const std::string root =
      "[curriculum.x]\nplugin = \"fixed_root\"\nmin_difficulty = 1\n"
      "max_difficulty = 2\ntotal_curriculum_step = 5\n";
  expect_check(root, "root_degree", "");
  expect_check(root + "root_degree = 0\n", "root_degree", "");
  expect_check(root + "root_degree = 3\n", "", "");
  const std::string disc = "[curriculum.x]\nplugin = \"fixed_discrete\"\n";
  expect_check(disc + "difficulty = [1, 2, 3]\nmax_step = [2, 4, 6]\n", "difficulty",
               "needs one more than max_step");
  expect_check(disc + "difficulty = [1, 2, 3, 4]\nmax_step = [2, 6, 4]\n", "max_step",
               "strictly increasing");
  expect_check(disc + "difficulty = [1, 2]\nmax_step = [0]\n", "max_step", "");
  const std::string slw =
      "[curriculum.x]\nplugin = \"seqlen_warmup\"\n"
      "max_difficulty = 1024\ntotal_curriculum_step = 100\n";
  expect_check(slw + "min_difficulty = 2048\n", "min_difficulty", "above max_difficulty");
  expect_check(slw + "min_difficulty = 0\n", "min_difficulty", "");
  expect_check(slw + "min_difficulty = 8\nmode = \"pack\"\n", "mode", "");
  expect_check(slw + "min_difficulty = 8\nroot_degree = 2\n", "root_degree",
               "only read when schedule_type is \"fixed_root\"");
  expect_check(slw + "min_difficulty = 8\n", "", "");
  expect_check("[curriculum.x]\nplugin = \"seqlen\"\npad_token = -2\n", "pad_token", "");
}

}  // namespace
