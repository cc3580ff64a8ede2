// Whole runs of loom-train with a [curriculum]: batches from a sampler instance, each step cut
// to a sequence-length schedule's length, the learning rate and the stop by tokens, and
// resume mid-schedule. The instances are the test plugin trainer_probe
// (tests/trainer/train/probe), whose schedule and sampler are plain formulas the test
// recomputes; tiny model, a few seconds each.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numbers>
#include <sstream>
#include <string>
#include <vector>

#include "dataset.hpp"
#include "run_env.hpp"

namespace fs = std::filesystem;

namespace {

struct Result {
  int code = -1;
  std::string out;  // stdout and stderr
};

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// The probe schedule's length at `step`, as the trainer cuts it (a multiple of 8, at least
// 8, the full seq_len once reached).
int probe_len(int64_t step, int64_t lo, int64_t hi, int64_t total, int seq_len) {
  const int64_t s = lo + (hi - lo) * std::min(step, total) / total;
  if (s >= seq_len) return seq_len;
  return static_cast<int>(std::max<int64_t>(8, s - s % 8));
}

class CurriculumRun : public ::testing::Test {
 protected:
  static fs::path dir_;

  static void SetUpTestSuite() {
    loom::trainer::test_run::set_environment();
    dir_ = fs::temp_directory_path() / ("loom-trainer-curriculum-" + std::to_string(::getpid()));
    ASSERT_EQ(loom::trainer::test_run::prepare_dataset(dir_, LOOM_DATA_EXE, 60000), 0)
        << slurp(dir_ / "prepare.log");
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  static Result sh(const std::string& cmd) {
    const fs::path log = dir_ / ("log-" + std::to_string(::getpid()) + ".txt");
    const int st = std::system((cmd + " > " + log.string() + " 2>&1").c_str());
    Result r;
    r.code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    r.out = slurp(log);
    return r;
  }
  // A manifest with adam (and ucx when `comm`), a probe schedule [curriculum.slw] and a probe
  // sampler [sampler.probe].
  static std::string manifest(const std::string& name, const std::string& mode, bool comm,
                              const std::string& sampler_extra = "") {
    const fs::path p = dir_ / (name + ".toml");
    std::ofstream(p) << (comm ? "[comm.world]\nplugin = \"ucx\"\n" : "")
                     << "[optimizer.main]\nplugin = \"adam\"\n"
                     << "[curriculum.slw]\nplugin = \"trainer_probe\"\nmode = \"" << mode
                     << "\"\nmin_len = 3\nmax_len = 40\ntotal_steps = 9\n"
                     << "[sampler.probe]\nplugin = \"trainer_probe\"\n"
                     << sampler_extra;
    return p.filename().string();
  }
  // A trainer config: context and seq_len 32, batch 4, 16 steps, metrics every step.
  static std::string config(const std::string& name, const std::string& man,
                            const std::string& curriculum, const std::string& train_extra = "",
                            bool comm = false) {
    const fs::path p = dir_ / (name + ".toml");
    std::ofstream(p) << "[manifest]\npath = \"" << man << "\"\n"
                     << (comm ? "" : "comm = \"\"\n")
                     << "[model]\ncontext = 32\nlayers = 1\nheads = 2\ndim = 16\n"
                     << "[data]\ndataset = \"data.bin\"\n"
                     << "[curriculum]\n"
                     << curriculum << "[train]\nsteps = 16\nbatch_size = 4\nseq_len = 32\n"
                     << "lr = 3e-3\nmin_lr = 3e-4\nwarmup_steps = 3\ndecay = \"linear\"\n"
                     << "eval_interval = 8\neval_batches = 1\ncheckpoint_interval = 5\n"
                     << "log_interval = 1\nthreads = 1\nplot = \"none\"\nrun_dir = \"runs/" << name
                     << "\"\n"
                     << train_extra;
    return p.string();
  }
  static Result train(int ranks, const std::string& cfg, const std::string& args = "") {
    std::string cmd = std::string(LOOM_TRAIN_EXE) + " " + cfg + " --plugin-path " +
                      LOOM_TEST_PLUGIN_DIR + " " + args;
    if (ranks > 1) {
      cmd = std::string(LOOM_MPIRUN) + " --oversubscribe --allow-run-as-root -np " +
            std::to_string(ranks) + " " + cmd;
    }
    return sh(cmd);
  }
  static std::vector<nlohmann::json> metrics(const std::string& run, const std::string& type) {
    std::ifstream f(dir_ / "runs" / run / "metrics.jsonl");
    std::vector<nlohmann::json> v;
    for (std::string line; std::getline(f, line);) {
      auto j = nlohmann::json::parse(line);
      if (j["type"] == type) v.push_back(j);
    }
    return v;
  }
};
fs::path CurriculumRun::dir_;

// Truncate: step s trains 4 rows of L(s); the recorded seq_len rises as scheduled (3 -> 8,
// ..., 40 -> capped at 32), tokens add up rows * L, and the difficulty is the sampler's.
TEST_F(CurriculumRun, SeqLenWarmupTruncateRecordsTheScheduledLengths) {
  const auto m = manifest("m_trunc", "truncate", false);
  const auto r = train(1, config("trunc", m, "sampler = \"probe\"\nseqlen = \"slw\"\n"), "--fresh");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("sequence length from 'slw' (trainer_probe, truncate)"), std::string::npos)
      << r.out;
  const auto t = metrics("trunc", "train");
  ASSERT_EQ(t.size(), 16u);
  uint64_t tokens = 0;
  int prev = 0;
  for (size_t i = 0; i < t.size(); ++i) {
    const int64_t step = static_cast<int64_t>(i) + 1;
    const int L = probe_len(step, 3, 40, 9, 32);
    EXPECT_EQ(t[i]["step"], step);
    EXPECT_EQ(t[i]["seq_len"], L) << "step " << step;
    EXPECT_GE(L, prev);
    prev = L;
    tokens += 4u * L;
    EXPECT_EQ(t[i]["tokens"], tokens) << "step " << step;
    EXPECT_EQ(t[i]["difficulty"], 100.0 + static_cast<double>(step)) << "step " << step;
    EXPECT_TRUE(std::isfinite(double(t[i]["loss"])));
  }
  EXPECT_EQ(t[0]["seq_len"], 8);
  EXPECT_EQ(t[3]["seq_len"], 16);  // 3 + 37 * 4 / 9 = 19 -> 16
  EXPECT_EQ(t.back()["seq_len"], 32);
  // Eval runs at the full length whatever the step's: its loss is finite and recorded.
  const auto e = metrics("trunc", "eval");
  ASSERT_EQ(e.size(), 2u);
  EXPECT_TRUE(std::isfinite(double(e[0]["eval_loss"])));
}

// Reshape: each sequence of 32 becomes floor(32 / L) rows of L, so the tokens per step are
// 4 * floor(32 / L) * L (all 128 when L divides 32; 96 at L = 24).
TEST_F(CurriculumRun, SeqLenWarmupReshapeKeepsTheTokensPerStep) {
  const auto m = manifest("m_reshape", "reshape", false);
  const auto r = train(1, config("reshape", m, "seqlen = \"slw\"\n"), "--fresh");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto t = metrics("reshape", "train");
  ASSERT_EQ(t.size(), 16u);
  uint64_t tokens = 0;
  bool saw_24 = false;
  for (size_t i = 0; i < t.size(); ++i) {
    const int64_t step = static_cast<int64_t>(i) + 1;
    const int L = probe_len(step, 3, 40, 9, 32);
    EXPECT_EQ(t[i]["seq_len"], L);
    tokens += 4u * (32 / L) * L;
    saw_24 = saw_24 || L == 24;
    EXPECT_EQ(t[i]["tokens"], tokens) << "step " << step;
    EXPECT_FALSE(t[i].contains("difficulty")) << "no sampler: no difficulty";
  }
  EXPECT_TRUE(saw_24) << "the schedule passes a length that does not divide 32";
}

// The bundled seqlen_warmup plugin (fixed_linear, 8 -> 32 over 10 steps, difficulty_step 8):
// the recorded lengths are DeepSpeed's formula floor(s / T * (max - min) + min), rounded down
// to a multiple of 8 and clamped to [min, max], and stay at 32 from step 10; tokens follow.
TEST_F(CurriculumRun, BundledSeqlenWarmupRecordsItsSchedule) {
  std::ofstream(dir_ / "m_slw.toml")
      << "[optimizer.main]\nplugin = \"adam\"\n[curriculum.slw]\nplugin = \"seqlen_warmup\"\n"
         "mode = \"truncate\"\nschedule_type = \"fixed_linear\"\nmin_difficulty = 8\n"
         "max_difficulty = 32\ntotal_curriculum_step = 10\ndifficulty_step = 8\n";
  const auto r = train(1, config("slw", "m_slw.toml", "seqlen = \"slw\"\n"), "--fresh");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("sequence length from 'slw' (seqlen_warmup, truncate)"), std::string::npos)
      << r.out;
  const auto t = metrics("slw", "train");
  ASSERT_EQ(t.size(), 16u);
  const std::vector<int> want{8, 8, 8, 16, 16, 16, 24, 24, 24, 32, 32, 32, 32, 32, 32, 32};
  uint64_t tokens = 0;
  for (size_t i = 0; i < t.size(); ++i) {
    EXPECT_EQ(t[i]["seq_len"], want[i]) << "step " << i + 1;
    tokens += 4u * want[i];
    EXPECT_EQ(t[i]["tokens"], tokens) << "step " << i + 1;
  }
  // --check creates and plans it: a sound config checks out.
  const auto c = sh(std::string(LOOM_TRAIN_EXE) + " --check " + (dir_ / "slw.toml").string());
  EXPECT_EQ(c.code, 0) << c.out;
  // A plain difficulty schedule is refused as `seqlen`, at its key.
  std::ofstream(dir_ / "m_fl.toml")
      << "[optimizer.main]\nplugin = \"adam\"\n[curriculum.slw]\nplugin = \"fixed_linear\"\n"
         "min_difficulty = 8\nmax_difficulty = 32\ntotal_curriculum_step = 10\n";
  const auto bad = sh(std::string(LOOM_TRAIN_EXE) + " --check " +
                      config("fl", "m_fl.toml", "seqlen = \"slw\"\n"));
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_NE(bad.out.find((dir_ / "fl.toml").string() +
                         ":12:10: [curriculum] seqlen 'slw': plugin 'fixed_linear' schedules a "
                         "difficulty, not a sequence length (its seq_len_mode is NONE)"),
            std::string::npos)
      << bad.out;
}

// Valid settings that are likely mistakes get one warning line each, from --check and at the
// start of a run: a schedule that never reaches seq_len (max_difficulty 24 < 32), and
// train_tokens with the decay by steps.
TEST_F(CurriculumRun, WarnsOfAShortScheduleAndOfTrainTokensWithLrBySteps) {
  std::ofstream(dir_ / "m_short.toml")
      << "[optimizer.main]\nplugin = \"adam\"\n[curriculum.slw]\nplugin = \"seqlen_warmup\"\n"
         "mode = \"truncate\"\nschedule_type = \"fixed_linear\"\nmin_difficulty = 8\n"
         "max_difficulty = 24\ntotal_curriculum_step = 10\ndifficulty_step = 8\n";
  const auto cfg = config("short", "m_short.toml", "seqlen = \"slw\"\n", "train_tokens = 500\n");
  const std::string slw_warning =
      cfg +
      ":12:10: [curriculum] seqlen 'slw': warning: the schedule's longest length is 24 (at "
      "step 2^40), below [train] seq_len 32: the run never trains at the full length";
  const std::string tokens_warning = cfg +
                                     ":28:16: [train] train_tokens: warning: 500 tokens end "
                                     "the run, but with lr_unit = \"steps\"";
  const auto c = sh(std::string(LOOM_TRAIN_EXE) + " --check " + cfg);
  EXPECT_EQ(c.code, 0) << c.out;
  EXPECT_NE(c.out.find(slw_warning), std::string::npos) << c.out;
  EXPECT_NE(c.out.find(tokens_warning), std::string::npos) << c.out;
  const auto r = train(1, cfg, "--fresh");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("loom train: " + slw_warning), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("loom train: " + tokens_warning), std::string::npos) << r.out;
  // The probe left the schedule as it was: step 1 still trains at 8 tokens.
  const auto t = metrics("short", "train");
  ASSERT_FALSE(t.empty());
  EXPECT_EQ(t[0]["seq_len"], 8);
  // A schedule that reaches seq_len, with the decay by tokens: no warning.
  {
    std::string m = slurp(dir_ / "m_short.toml");
    m.replace(m.find("max_difficulty = 24"), 19, "max_difficulty = 32");
    std::ofstream(dir_ / "m_full.toml") << m;
  }
  const auto good = sh(std::string(LOOM_TRAIN_EXE) + " --check " +
                       config("slw_ok", "m_full.toml", "seqlen = \"slw\"\n",
                              "train_tokens = 500\nlr_unit = \"tokens\"\n"));
  EXPECT_EQ(good.code, 0) << good.out;
  EXPECT_EQ(good.out.find("warning"), std::string::npos) << good.out;
}

// The shipped example configs check out against the code as it is: examples/train_slw.toml
// and examples/data_efficiency/*.toml, copied verbatim into a layout where their relative
// paths resolve (build/data/fortunes.bin is this suite's dataset), the curriculum ones from
// that folder after analyze.toml's index is written into build/data/fortunes-index (the
// samplers' index path is relative to the working folder). No warnings either.
TEST_F(CurriculumRun, ShippedExampleConfigsCheckOut) {
  const fs::path src = LOOM_SOURCE_DIR;
  const fs::path root = dir_ / "examples-layout";
  fs::create_directories(root / "examples/data_efficiency");
  fs::create_directories(root / "build/data/fortunes-index");
  fs::copy_file(dir_ / "data.bin", root / "build/data/fortunes.bin",
                fs::copy_options::overwrite_existing);
  for (const char* f : {"train_slw.toml", "slw.toml"}) {
    fs::copy_file(src / "examples" / f, root / "examples" / f,
                  fs::copy_options::overwrite_existing);
  }
  std::vector<std::string> configs{"examples/train_slw.toml"};
  for (const auto& e : fs::directory_iterator(src / "examples/data_efficiency")) {
    if (e.path().extension() != ".toml") continue;
    fs::copy_file(e.path(), root / "examples/data_efficiency" / e.path().filename(),
                  fs::copy_options::overwrite_existing);
    const std::string name = e.path().filename().string();
    if (name.rfind("stability_", 0) == 0 || name.rfind("curriculum_", 0) == 0) {
      configs.push_back("examples/data_efficiency/" + name);
    }
  }
  ASSERT_EQ(configs.size(), 7u) << "train_slw, stability_{baseline,slw}, curriculum_{baseline,"
                                   "slw,voc,voc_slw}";
  const std::string in_root = "cd " + root.string() + " && ";
  const auto a = sh(in_root + LOOM_DATA_EXE +
                    " analyze examples/data_efficiency/analyze.toml --dataset "
                    "build/data/fortunes.bin --seq-len 128 --output build/data/fortunes-index "
                    "--threads 1");
  ASSERT_EQ(a.code, 0) << a.out;
  for (const auto& cfg : configs) {
    SCOPED_TRACE(cfg);
    const auto r = sh(in_root + LOOM_TRAIN_EXE + " --check " + cfg);
    EXPECT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find(cfg + ": ok (trainer config"), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("warning"), std::string::npos) << r.out;
  }
}

// The bundled pieces end to end: `loom data analyze` scores the dataset's samples of 32
// tokens with vocabulary_rarity, and curriculum_sampler (percentile, fixed_linear 20 -> 100
// over 10 steps) draws the batches. The recorded difficulty is the schedule's; a run
// stopped after step 13 and resumed on 2 ranks matches an uninterrupted one bit for bit; an
// index analyzed at another seq_len is refused at the sampler key before any step.
TEST_F(CurriculumRun, BundledCurriculumSamplerOverAnalyzedIndex) {
  if (std::string(LOOM_MPIRUN).empty()) GTEST_SKIP() << "mpirun not found";
  std::ofstream(dir_ / "analyze.toml") << "[curriculum.rarity]\nplugin = \"vocabulary_rarity\"\n";
  fs::create_directories(dir_ / "idx32");
  fs::create_directories(dir_ / "idx16");
  for (const char* l : {"32", "16"}) {
    const auto a = sh(std::string(LOOM_DATA_EXE) + " analyze " + (dir_ / "analyze.toml").string() +
                      " --dataset " + (dir_ / "data.bin").string() + " --seq-len " + l +
                      " --output " + (dir_ / ("idx" + std::string(l))).string() + " --threads 1");
    ASSERT_EQ(a.code, 0) << a.out;
  }
  auto man =
      [&](const std::string& name, const std::string& idx) {
        std::ofstream(dir_ / name)
            << "[comm.world]\nplugin = \"ucx\"\n[optimizer.main]\nplugin = \"adam\"\n"
               "[curriculum.sched]\nplugin = \"fixed_linear\"\nmin_difficulty = 20\n"
               "max_difficulty = 100\ntotal_curriculum_step = 10\ndifficulty_step = 1\n"
               "[sampler.cs]\nplugin = \"curriculum_sampler\"\nschedule = \"sched\"\nindex = \""
            << (dir_ / idx).string()
            << "\"\nmetric = \"rarity\"\ndifficulty_type = \"percentile\"\n";
      };
  man("m_cs.toml", "idx32");
  man("m_cs16.toml", "idx16");
  const std::string cur = "sampler = \"cs\"\n";
  const auto full = train(2, config("csfull", "m_cs.toml", cur, "", true), "--fresh");
  ASSERT_EQ(full.code, 0) << full.out;
  EXPECT_NE(full.out.find("batches from sampler 'cs' (curriculum_sampler)"), std::string::npos)
      << full.out;
  const auto t = metrics("csfull", "train");
  ASSERT_EQ(t.size(), 16u);
  for (size_t i = 0; i < t.size(); ++i) {
    // fixed_linear, step s: floor(s / 10 * 80 + 20), 100 from step 10.
    const int64_t s = static_cast<int64_t>(i) + 1;
    const double d = s >= 10 ? 100.0 : std::floor(static_cast<double>(s) / 10.0 * 80.0 + 20.0);
    EXPECT_EQ(t[i]["difficulty"], d) << "step " << s;
    EXPECT_EQ(t[i]["seq_len"], 32);
    EXPECT_EQ(t[i]["tokens"], 4 * 32 * s);
  }
  const auto part =
      train(2, config("cspart", "m_cs.toml", cur, "", true), "--fresh --stop-after 13");
  ASSERT_EQ(part.code, 0) << part.out;
  const auto rest = train(2, config("cspart", "m_cs.toml", cur, "", true), "--resume");
  ASSERT_EQ(rest.code, 0) << rest.out;
  for (const char* type : {"train", "eval"}) {
    const auto a = metrics("csfull", type), b = metrics("cspart", type);
    ASSERT_EQ(a.size(), b.size()) << type;
    for (size_t i = 0; i < a.size(); ++i) {
      for (const char* k :
           {"step", "loss", "eval_loss", "grad_norm", "lr", "tokens", "difficulty"}) {
        if (a[i].contains(k)) {
          EXPECT_EQ(a[i][k], b[i][k]) << type << " " << k << " #" << i;
        }
      }
    }
  }
  for (const char* f : {"model.rank0.safetensors", "model.rank1.safetensors", "sampler.rank0.bin",
                        "sampler.rank1.bin"}) {
    EXPECT_EQ(slurp(dir_ / "runs/csfull/checkpoints/step_00000016" / f),
              slurp(dir_ / "runs/cspart/checkpoints/step_00000016" / f))
        << f;
  }
  // The index of seq_len 16 was written for samples of 16 tokens, not this run's 32.
  const auto cfg16 = config("cs16", "m_cs16.toml", cur, "", true);
  const auto c = sh(std::string(LOOM_TRAIN_EXE) + " --check " + cfg16);
  EXPECT_EQ(c.code, 2) << c.out;
  EXPECT_NE(c.out.find((dir_ / "cs16.toml").string() +
                       ":11:11: [curriculum] sampler 'cs': the index " + (dir_ / "idx16").string() +
                       " (metric rarity) was written for samples of 16 tokens, not [train] "
                       "seq_len 32"),
            std::string::npos)
      << c.out;
  const auto r = train(1, config("cs16", "m_cs16.toml", cur, "", true), "--fresh");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("[curriculum] sampler 'cs': the index"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("step 1/"), std::string::npos) << r.out;
  // Another dataset with the same number of tokens (one token changed): the same N, so the
  // sampler's plan would accept it; the index's dataset checksum does not match.
  {
    const loom::trainer::Dataset ds((dir_ / "data.bin").string());
    std::vector<uint16_t> train(ds.train().begin(), ds.train().end());
    const std::vector<uint16_t> held(ds.heldout().begin(), ds.heldout().end());
    train[100] = static_cast<uint16_t>(train[100] == 'a' ? 'b' : 'a');
    loom::trainer::write_dataset((dir_ / "other.bin").string(), ds.vocab_size(), train, held);
  }
  const std::string other = config("csother", "m_cs.toml", cur, "", true);
  {
    std::string text = slurp(other);
    const std::string from = "dataset = \"data.bin\"", to = "dataset = \"other.bin\"";
    text.replace(text.find(from), from.size(), to);
    std::ofstream(other) << text;
  }
  const auto o = sh(std::string(LOOM_TRAIN_EXE) + " --check " + other);
  EXPECT_EQ(o.code, 2) << o.out;
  EXPECT_NE(o.out.find((dir_ / "csother.toml").string() + ":11:11: [curriculum] sampler 'cs': " +
                       "the index " + (dir_ / "idx32").string() +
                       " (metric rarity) was written for another dataset: its dataset checksum "
                       "is "),
            std::string::npos)
      << o.out;
  EXPECT_NE(o.out.find((dir_ / "other.bin").string() + "'s is "), std::string::npos) << o.out;
  const auto ro = train(1, other, "--fresh");
  EXPECT_EQ(ro.code, 2) << ro.out;
  EXPECT_NE(ro.out.find("was written for another dataset"), std::string::npos) << ro.out;
  EXPECT_EQ(ro.out.find("step 1/"), std::string::npos) << ro.out;
}

// lr_unit = "tokens" with train_tokens: past the warmup (3 steps) the linear decay follows
// r = (tokens - warmup_tokens) / (train_tokens - warmup_tokens); the run ends at the step
// that reaches train_tokens, before `steps`.
TEST_F(CurriculumRun, TokenBasedLrFollowsTheFormulaAndTrainTokensStopsTheRun) {
  const auto m = manifest("m_lr", "truncate", false);
  const uint64_t budget = 1000;
  const auto r =
      train(1,
            config("lr", m, "seqlen = \"slw\"\n",
                   "lr_unit = \"tokens\"\ntrain_tokens = " + std::to_string(budget) + "\n"),
            "--fresh");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto t = metrics("lr", "train");
  // Tokens per step: 4 * L(step); the run stops at the first step reaching 1000 (step 12).
  uint64_t tokens = 0, warmup_tokens = 0;
  size_t steps = 0;
  while (tokens < budget) {
    ++steps;
    tokens += 4u * probe_len(static_cast<int64_t>(steps), 3, 40, 9, 32);
    if (steps == 3) warmup_tokens = tokens;
  }
  ASSERT_EQ(steps, 12u);
  ASSERT_EQ(t.size(), steps) << r.out;
  EXPECT_EQ(t.back()["tokens"], tokens);
  for (size_t i = 0; i < t.size(); ++i) {
    const int64_t step = static_cast<int64_t>(i) + 1;
    const double lr = t[i]["lr"];
    if (step <= 3) {
      EXPECT_DOUBLE_EQ(lr, 3e-3 * static_cast<double>(step) / 3.0) << "step " << step;
    } else {
      const double tk = t[i]["tokens"];
      const double p = std::clamp(
          (tk - double(warmup_tokens)) / (double(budget) - double(warmup_tokens)), 0.0, 1.0);
      EXPECT_NEAR(lr, 3e-4 + (3e-3 - 3e-4) * (1.0 - p), 1e-15) << "step " << step;
    }
  }
  const auto summary = nlohmann::json::parse(slurp(dir_ / "runs/lr/summary.json"));
  EXPECT_EQ(summary["steps"], steps);
  EXPECT_EQ(summary["tokens"], tokens);
  EXPECT_TRUE(fs::exists(dir_ / "runs/lr/checkpoints/step_00000012"))
      << "the last step checkpoints";
  // Not what the step schedule would give: the decay followed the tokens.
  const double by_steps = 3e-4 + (3e-3 - 3e-4) * (1.0 - (6.0 - 3.0) / (16.0 - 3.0));
  EXPECT_GT(std::abs(double(t[5]["lr"]) - by_steps), 1e-5);
}

// 2 ranks, sampler + reshape schedule, stopped after step 13 (last checkpoint: 10) and
// resumed: every metric line and both ranks' final weights bit-identical to an uninterrupted
// run; the checkpoint holds the sampler's and the schedule's state.
TEST_F(CurriculumRun, InterruptedAndResumedMatchesUninterruptedBitForBit) {
  if (std::string(LOOM_MPIRUN).empty()) GTEST_SKIP() << "mpirun not found";
  const auto m = manifest("m_resume", "reshape", true);
  const std::string cur = "sampler = \"probe\"\nseqlen = \"slw\"\n";
  const auto full = train(2, config("cfull", m, cur, "", true), "--fresh");
  ASSERT_EQ(full.code, 0) << full.out;
  const auto part = train(2, config("cpart", m, cur, "", true), "--fresh --stop-after 13");
  ASSERT_EQ(part.code, 0) << part.out;
  for (const char* f :
       {"sampler.rank0.bin", "sampler.rank1.bin", "seqlen.rank0.bin", "seqlen.rank1.bin"}) {
    EXPECT_TRUE(fs::exists(dir_ / "runs/cpart/checkpoints/step_00000010" / f)) << f;
  }
  const auto rest = train(2, config("cpart", m, cur, "", true), "--resume");
  ASSERT_EQ(rest.code, 0) << rest.out;
  EXPECT_NE(rest.out.find("resumed from"), std::string::npos) << rest.out;
  for (const char* type : {"train", "eval"}) {
    const auto a = metrics("cfull", type), b = metrics("cpart", type);
    ASSERT_EQ(a.size(), b.size()) << type;
    for (size_t i = 0; i < a.size(); ++i) {
      for (const char* k : {"step", "loss", "eval_loss", "grad_norm", "lr", "tokens", "seq_len",
                            "difficulty", "comm_bytes_sent"}) {
        if (a[i].contains(k)) {
          EXPECT_EQ(a[i][k], b[i][k]) << type << " " << k << " #" << i;
        }
      }
    }
  }
  for (const char* f : {"model.rank0.safetensors", "model.rank1.safetensors", "optimizer.rank0.bin",
                        "sampler.rank1.bin", "seqlen.rank0.bin"}) {
    EXPECT_EQ(slurp(dir_ / "runs/cfull/checkpoints/step_00000016" / f),
              slurp(dir_ / "runs/cpart/checkpoints/step_00000016" / f))
        << f;
  }
}

// A resume that cannot restore the curriculum's position is refused, never silently
// restarted: a checkpoint without the sampler's state, a config that lost its curriculum.
TEST_F(CurriculumRun, ResumeWithoutTheCurriculumStateIsRefused) {
  const auto m = manifest("m_state", "truncate", false);
  const std::string cur = "sampler = \"probe\"\nseqlen = \"slw\"\n";
  ASSERT_EQ(train(1, config("state", m, cur), "--fresh --stop-after 6").code, 0);
  const fs::path ck = dir_ / "runs/state/checkpoints/step_00000005";
  fs::rename(ck / "sampler.rank0.bin", dir_ / "sampler.saved");
  auto r = train(1, config("state", m, cur), "--resume");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find(ck.string() + ": has no sampler.rank0.bin"), std::string::npos) << r.out;
  fs::rename(dir_ / "sampler.saved", ck / "sampler.rank0.bin");
  r = train(1, config("state", m, "seqlen = \"slw\"\n"), "--resume");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("was written with a [curriculum] sampler, which this config lacks"),
            std::string::npos)
      << r.out;
  // A damaged state: the plugin's refusal, naming the file.
  {
    std::ofstream f(ck / "seqlen.rank0.bin", std::ios::binary | std::ios::trunc);
    f << "LOOMCKPT";
  }
  r = train(1, config("state", m, cur), "--resume");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find(ck.string() + "/seqlen.rank0.bin"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("step 7"), std::string::npos) << "it must not train";
}

// Bad [curriculum] instances: `loom train --check` (what `loom check CONFIG` runs) and a
// training run report each at its key in the config, FILE:LINE:COL.
TEST_F(CurriculumRun, BadInstancesAreReportedAtTheirKey) {
  const auto m = manifest("m_bad", "none", false, "expect_samples = 7\n");
  std::ofstream(dir_ / "m_metric.toml")
      << "[optimizer.main]\nplugin = \"adam\"\n[curriculum.slw]\nplugin = \"trainer_probe\"\n"
         "mode = \"metric\"\n";
  const std::string cfg_path = (dir_ / "bad.toml").string();
  // [curriculum] is on line 11 of the config: sampler on 12, seqlen on 13.
  const auto cfg = config("bad", m, "sampler = \"probe\"\nseqlen = \"slw\"\n");
  auto r = sh(std::string(LOOM_TRAIN_EXE) + " --check " + cfg + " --plugin-path " +
              LOOM_TEST_PLUGIN_DIR);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find(cfg_path + ":13:10: [curriculum] seqlen 'slw': plugin 'trainer_probe' "
                                  "schedules a difficulty, not a sequence length (its "
                                  "seq_len_mode is NONE)"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find(cfg_path + ":12:11: [curriculum] sampler 'probe': plan for the "),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("the index has 7 samples"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("loom data analyze on this dataset with this seq_len"), std::string::npos)
      << r.out;
  // The same at the start of training, before any step.
  r = train(1, cfg, "--fresh");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find(cfg_path + ":13:10: [curriculum] seqlen 'slw'"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("step 1/"), std::string::npos) << r.out;
  // A metric where a schedule belongs; a sampler name that is a curriculum instance.
  const auto cfg2 = config("bad", "m_metric.toml", "sampler = \"slw\"\nseqlen = \"slw\"\n");
  r = sh(std::string(LOOM_TRAIN_EXE) + " --check " + cfg2 + " --plugin-path " +
         LOOM_TEST_PLUGIN_DIR);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find(cfg_path + ":12:11: [curriculum] sampler 'slw': "), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("has no [sampler.slw]"), std::string::npos) << r.out;
  // Both reported at once: the name check does not hide the role check.
  EXPECT_NE(r.out.find(cfg_path + ":13:10: [curriculum] seqlen 'slw': plugin 'trainer_probe' is "
                                  "a difficulty metric, not a schedule"),
            std::string::npos)
      << r.out;
  // A sound curriculum checks out.
  const auto good = config("good", manifest("m_good", "truncate", false),
                           "sampler = \"probe\"\nseqlen = \"slw\"\n");
  r = sh(std::string(LOOM_TRAIN_EXE) + " --check " + good + " --plugin-path " +
         LOOM_TEST_PLUGIN_DIR);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find(": ok (trainer config"), std::string::npos) << r.out;
}

}  // namespace
