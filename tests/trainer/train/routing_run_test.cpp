// Whole runs of loom-train with a [routing] router: the test plugin trainer_router
// (tests/trainer/train/probe/trainer_router.cpp: routed layers keep min(keep, seq_len)
// hashed positions in training) records kept per layer, the layer tokens and their sum, the
// learning rate by layer tokens and the stop at train_layer_tokens; a run with sequence-length
// warmup on 2 ranks stopped and resumed matches the uninterrupted one bit for bit; with the
// bundled topk_router (learned) the router weight trains, is checkpointed and resumes
// exactly; the bundled random_ltd follows its schedule and resumes exactly; bad names and
// missing states are refused. Tiny model, a few seconds each.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
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

class RoutingRun : public ::testing::Test {
 protected:
  static fs::path dir_;

  static void SetUpTestSuite() {
    loom::trainer::test_run::set_environment();
    dir_ = fs::temp_directory_path() / ("loom-trainer-routing-" + std::to_string(::getpid()));
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
  // adam (and ucx when `comm`), [router.drop] trainer_router keeping 8 in layer 1,
  // [router.mod] topk_router (capacity 0.25, layer 1), [router.ltd] random_ltd (8 -> 32 by
  // multiples of 8 over 8 steps, the default layers: the middle one), [router.far] (layer 7:
  // refuses a 3-layer model), a probe schedule [curriculum.slw] and sampler [sampler.probe],
  // [router.late] trainer_late_router (learned, routes layer 1 only from step 2).
  static std::string manifest(const std::string& name, bool comm) {
    const fs::path p = dir_ / (name + ".toml");
    std::ofstream(p) << (comm ? "[comm.world]\nplugin = \"ucx\"\n" : "")
                     << "[optimizer.main]\nplugin = \"adam\"\n"
                     << "[router.drop]\nplugin = \"trainer_router\"\nkeep = 8\n"
                     << "[router.mod]\nplugin = \"topk_router\"\ncapacity = 0.25\nlayers = [1]\n"
                     << "[router.ltd]\nplugin = \"random_ltd\"\nmin_value = 8\nmax_value = 32\n"
                     << "require_steps = 8\nseq_per_step = 8\n"
                     << "[router.far]\nplugin = \"random_ltd\"\nmin_value = 8\nmax_value = 32\n"
                     << "require_steps = 8\nlayers = [7]\n"
                     << "[curriculum.slw]\nplugin = \"trainer_probe\"\nmode = \"truncate\"\n"
                     << "min_len = 3\nmax_len = 40\ntotal_steps = 9\n"
                     << "[sampler.probe]\nplugin = \"trainer_probe\"\n"
                     << "[router.late]\nplugin = \"trainer_late_router\"\nfrom_step = 2\n";
    return p.filename().string();
  }
  // 3 layers, context and seq_len 32, batch 4, 16 steps, metrics every step. The [routing]
  // table is on line 9 (router on line 10); an empty `routing` leaves it out.
  static std::string config(const std::string& name, const std::string& man,
                            const std::string& routing, const std::string& train_extra = "",
                            bool comm = false, const std::string& curriculum = "") {
    const fs::path p = dir_ / (name + ".toml");
    std::ofstream(p) << "[manifest]\npath = \"" << man << "\"\n"
                     << "comm = \"" << (comm ? "world" : "") << "\"\n"
                     << "[model]\ncontext = 32\nlayers = 3\nheads = 2\ndim = 16\n"
                     << (routing.empty() ? "" : "[routing]\n" + routing)
                     << "[data]\ndataset = \"data.bin\"\n"
                     << (curriculum.empty() ? "" : "[curriculum]\n" + curriculum)
                     << "[train]\nsteps = 16\nbatch_size = 4\nseq_len = 32\n"
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
  static void expect_same_runs(const std::string& a_run, const std::string& b_run,
                               const std::vector<std::string>& files) {
    for (const char* type : {"train", "eval"}) {
      const auto a = metrics(a_run, type), b = metrics(b_run, type);
      ASSERT_EQ(a.size(), b.size()) << type;
      for (size_t i = 0; i < a.size(); ++i) {
        for (const char* k : {"step", "loss", "eval_loss", "grad_norm", "lr", "tokens", "seq_len",
                              "kept", "layer_tokens", "consumed_layer_tokens"}) {
          if (a[i].contains(k)) {
            EXPECT_EQ(a[i][k], b[i][k]) << type << " " << k << " #" << i;
          }
        }
      }
    }
    for (const auto& f : files) {
      EXPECT_TRUE(fs::exists(dir_ / "runs" / a_run / "checkpoints/step_00000016" / f)) << f;
      EXPECT_EQ(slurp(dir_ / "runs" / a_run / "checkpoints/step_00000016" / f),
                slurp(dir_ / "runs" / b_run / "checkpoints/step_00000016" / f))
          << f;
    }
  }
};
fs::path RoutingRun::dir_;

// Layer 1 keeps 8 of 32 positions: kept [32, 8, 32], 4 x 72 layer tokens a step; the rate
// decays by layer tokens over 3 x 16 x 4 x 32 of them (the baseline's), linearly.
TEST_F(RoutingRun, RecordsKeptAndLayerTokensAndDecaysByThem) {
  const auto m = manifest("m_one", false);
  const auto r =
      train(1, config("one", m, "router = \"drop\"\n", "lr_unit = \"layer_tokens\"\n"), "--fresh");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("token routing by 'drop' (trainer_router)"), std::string::npos) << r.out;
  const auto t = metrics("one", "train");
  ASSERT_EQ(t.size(), 16u);
  const double lr = 3e-3, min_lr = 3e-4, end = 3.0 * 16 * 4 * 32, warm = 3.0 * 288;
  for (size_t i = 0; i < t.size(); ++i) {
    const int64_t step = static_cast<int64_t>(i) + 1;
    EXPECT_EQ(t[i]["kept"], nlohmann::json::array({32, 8, 32})) << "step " << step;
    EXPECT_EQ(t[i]["layer_tokens"], 288) << "step " << step;
    EXPECT_EQ(t[i]["consumed_layer_tokens"], 288 * step) << "step " << step;
    EXPECT_EQ(t[i]["tokens"], 128 * step);
    const double want =
        step <= 3 ? lr * static_cast<double>(step) / 3.0
                  : min_lr + (lr - min_lr) *
                                 (1.0 - (288.0 * static_cast<double>(step) - warm) / (end - warm));
    EXPECT_NEAR(double(t[i]["lr"]), want, 1e-15) << "step " << step;
    EXPECT_TRUE(std::isfinite(double(t[i]["loss"])));
  }
  const auto s = nlohmann::json::parse(slurp(dir_ / "runs/one/summary.json"));
  EXPECT_EQ(s["layer_tokens"], 288 * 16);
  EXPECT_TRUE(fs::exists(dir_ / "runs/one/checkpoints/step_00000016/router.rank0.bin"));
  // train_layer_tokens ends the run after the first step that reaches it.
  const auto r2 =
      train(1, config("stop", m, "router = \"drop\"\n", "train_layer_tokens = 1441\n"), "--fresh");
  ASSERT_EQ(r2.code, 0) << r2.out;
  EXPECT_NE(r2.out.find("loom train: stops at 1441 layer tokens (or step 16)"), std::string::npos)
      << r2.out;
  const auto t2 = metrics("stop", "train");
  ASSERT_FALSE(t2.empty());
  EXPECT_EQ(t2.back()["step"], 6);
  EXPECT_EQ(nlohmann::json::parse(slurp(dir_ / "runs/stop/summary.json"))["layer_tokens"], 1728);
}

// The same global batch on 1 rank and on 2: each row draws its positions as sample
// first_sample + b, so rank 1's rows (samples 2 and 3) keep the positions they keep on one
// rank, and step 1's loss and gradient norm (before any update) agree. A rank that passed
// first_sample = 0 would route its rows as samples 0 and 1 and change both.
TEST_F(RoutingRun, TwoRanksRouteTheirRowsAsOneRankDoes) {
  if (std::string(LOOM_MPIRUN).empty()) GTEST_SKIP() << "mpirun not found";
  const auto m = manifest("m_split", true);
  const auto one = train(1, config("split1", m, "router = \"drop\"\n"), "--fresh");
  ASSERT_EQ(one.code, 0) << one.out;
  const auto two = train(2, config("split2", m, "router = \"drop\"\n", "", true), "--fresh");
  ASSERT_EQ(two.code, 0) << two.out;
  const auto a = metrics("split1", "train");
  const auto b = metrics("split2", "train");
  ASSERT_FALSE(a.empty());
  ASSERT_FALSE(b.empty());
  ASSERT_EQ(a.front()["step"], 1);
  ASSERT_EQ(b.front()["step"], 1);
  EXPECT_EQ(a.front()["kept"], nlohmann::json::array({32, 8, 32}));
  EXPECT_EQ(b.front()["kept"], a.front()["kept"]);
  const double la = a.front()["loss"], lb = b.front()["loss"];
  EXPECT_NEAR(la, lb, 1e-5);
  const double ga = a.front()["grad_norm"], gb = b.front()["grad_norm"];
  EXPECT_NEAR(ga, gb, 1e-5 * std::max(1.0, std::fabs(ga)));
}

// 2 ranks (each its half of the batch: the rows draw as samples first_sample + b), batches
// from a sampler and the sequence-length warmup (the router sees the cut length: kept =
// min(8, L)), stopped after step 13 and resumed: every metric and every checkpoint file of
// step 16 bit for bit.
TEST_F(RoutingRun, InterruptedAndResumedMatchesUninterruptedBitForBit) {
  if (std::string(LOOM_MPIRUN).empty()) GTEST_SKIP() << "mpirun not found";
  const auto m = manifest("m_two", true);
  const std::string cur = "sampler = \"probe\"\nseqlen = \"slw\"\n";
  const std::string extra = "lr_unit = \"layer_tokens\"\n";
  const auto full = train(2, config("full", m, "router = \"drop\"\n", extra, true, cur), "--fresh");
  ASSERT_EQ(full.code, 0) << full.out;
  const auto part = train(2, config("part", m, "router = \"drop\"\n", extra, true, cur),
                          "--fresh --stop-after 13");
  ASSERT_EQ(part.code, 0) << part.out;
  EXPECT_TRUE(fs::exists(dir_ / "runs/part/checkpoints/step_00000010/router.rank1.bin"));
  const auto rest =
      train(2, config("part", m, "router = \"drop\"\n", extra, true, cur), "--resume");
  ASSERT_EQ(rest.code, 0) << rest.out;
  EXPECT_NE(rest.out.find("resumed from"), std::string::npos) << rest.out;
  const auto t = metrics("full", "train");
  ASSERT_EQ(t.size(), 16u);
  uint64_t consumed = 0;
  for (const auto& line : t) {
    const int L = line["seq_len"];
    const int k = std::min(8, L);
    EXPECT_EQ(line["kept"], nlohmann::json::array({L, k, L})) << line.dump();
    EXPECT_EQ(line["layer_tokens"], 4 * (2 * L + k)) << line.dump();
    consumed += 4u * static_cast<uint64_t>(2 * L + k);
    EXPECT_EQ(line["consumed_layer_tokens"], consumed) << line.dump();
  }
  EXPECT_EQ(t.front()["seq_len"], 8);
  EXPECT_EQ(t.back()["seq_len"], 32);
  expect_same_runs(
      "full", "part",
      {"model.rank0.safetensors", "model.rank1.safetensors", "optimizer.rank0.bin",
       "optimizer.rank1.bin", "router.rank0.bin", "router.rank1.bin", "seqlen.rank0.bin",
       "seqlen.rank1.bin", "sampler.rank0.bin", "sampler.rank1.bin"});
}

// The bundled learned router: h.1.router.w is a parameter (in the checkpoint, moved by the
// optimizer from its initial 0), kept is round(0.25 x 32) = 8 in layer 1, and a resume
// matches the uninterrupted run bit for bit.
TEST_F(RoutingRun, LearnedRouterWeightTrainsAndResumesExactly) {
  const auto m = manifest("m_mod", false);
  const auto full = train(1, config("mfull", m, "router = \"mod\"\n"), "--fresh");
  ASSERT_EQ(full.code, 0) << full.out;
  EXPECT_NE(full.out.find("learned weights h.1.router.w"), std::string::npos) << full.out;
  const auto t = metrics("mfull", "train");
  ASSERT_EQ(t.size(), 16u);
  for (const auto& line : t) EXPECT_EQ(line["kept"], nlohmann::json::array({32, 8, 32}));
  // The weight in the safetensors header, and its bytes not all zero.
  const std::string st =
      slurp(dir_ / "runs/mfull/checkpoints/step_00000016/model.rank0.safetensors");
  ASSERT_GT(st.size(), 8u);
  uint64_t n = 0;
  std::memcpy(&n, st.data(), 8);
  const auto header = nlohmann::json::parse(st.substr(8, n));
  ASSERT_TRUE(header.contains("h.1.router.w")) << header.dump();
  EXPECT_FALSE(header.contains("h.0.router.w"));
  EXPECT_EQ(header["h.1.router.w"]["shape"], nlohmann::json::array({16}));
  const uint64_t lo = header["h.1.router.w"]["data_offsets"][0];
  bool nonzero = false;
  for (size_t i = 0; i < 16; ++i) {
    float v;
    std::memcpy(&v, st.data() + 8 + n + lo + 4 * i, 4);
    nonzero = nonzero || v != 0.0f;
  }
  EXPECT_TRUE(nonzero) << "the router weight never moved";
  const auto part = train(1, config("mpart", m, "router = \"mod\"\n"), "--fresh --stop-after 12");
  ASSERT_EQ(part.code, 0) << part.out;
  const auto rest = train(1, config("mpart", m, "router = \"mod\"\n"), "--resume");
  ASSERT_EQ(rest.code, 0) << rest.out;
  expect_same_runs("mfull", "mpart",
                   {"model.rank0.safetensors", "optimizer.rank0.bin", "router.rank0.bin"});
}

// The bundled random_ltd: layer 1 keeps r(t) = floor(t / 8 * 24 + 8) rounded down to a
// multiple of 8 (t = step - 1), the full 32 from t = 8 on; the other layers everything; a
// resume after step 11 matches the uninterrupted run bit for bit.
TEST_F(RoutingRun, RandomLtdFollowsItsScheduleAndResumesExactly) {
  const auto m = manifest("m_ltd", false);
  const auto full =
      train(1, config("lfull", m, "router = \"ltd\"\n", "lr_unit = \"layer_tokens\"\n"), "--fresh");
  ASSERT_EQ(full.code, 0) << full.out;
  const auto t = metrics("lfull", "train");
  ASSERT_EQ(t.size(), 16u);
  for (size_t i = 0; i < t.size(); ++i) {
    const int64_t step = static_cast<int64_t>(i) + 1, u = step - 1;
    int64_t r = u >= 8 ? 32 : (u * 24) / 8 + 8;
    r -= r % 8;
    EXPECT_EQ(t[i]["kept"], nlohmann::json::array({32, r, 32})) << "step " << step;
    EXPECT_EQ(t[i]["layer_tokens"], 4 * (64 + r)) << "step " << step;
  }
  const auto part =
      train(1, config("lpart", m, "router = \"ltd\"\n", "lr_unit = \"layer_tokens\"\n"),
            "--fresh --stop-after 11");
  ASSERT_EQ(part.code, 0) << part.out;
  const auto rest = train(
      1, config("lpart", m, "router = \"ltd\"\n", "lr_unit = \"layer_tokens\"\n"), "--resume");
  ASSERT_EQ(rest.code, 0) << rest.out;
  expect_same_runs("lfull", "lpart",
                   {"model.rank0.safetensors", "optimizer.rank0.bin", "router.rank0.bin"});
}

TEST_F(RoutingRun, BadNamesAndMissingStatesAreRefused) {
  const auto m = manifest("m_bad", false);
  const std::string path = (dir_ / "bad.toml").string();
  auto r = train(1, config("bad", m, "router = \"dorp\"\n"), "--fresh");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find(path + ":10:10: [routing] router 'dorp'"), std::string::npos) << r.out;
  r = sh(std::string(LOOM_TRAIN_EXE) + " --check " + config("bad", m, "router = \"main\"\n") +
         " --plugin-path " + LOOM_TEST_PLUGIN_DIR);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find(path + ":10:10: [routing] router 'main': "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[optimizer.main] is not a router"), std::string::npos) << r.out;
  // A router whose plan refuses the model (layer 7 of 3): at its key, by --check and by a run.
  const std::string far = config("bad", m, "router = \"far\"\n");
  r = sh(std::string(LOOM_TRAIN_EXE) + " --check " + far + " --plugin-path " +
         LOOM_TEST_PLUGIN_DIR);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find(path + ":10:10: [routing] router 'far': plan (step 1, layer 0): "),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("layers[0] = 7"), std::string::npos) << r.out;
  r = train(1, far, "--fresh");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find(path + ":10:10: [routing] router 'far': plan (step 1, layer 0): "),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("step 1/"), std::string::npos) << r.out;
  // A sound router checks out.
  r = sh(std::string(LOOM_TRAIN_EXE) + " --check " + config("good", m, "router = \"mod\"\n") +
         " --plugin-path " + LOOM_TEST_PLUGIN_DIR);
  EXPECT_EQ(r.code, 0) << r.out;
  // A routed run's checkpoint resumed without [routing], and one without the router's state.
  r = train(1, config("st", m, "router = \"drop\"\n"), "--fresh --stop-after 5");
  ASSERT_EQ(r.code, 0) << r.out;
  r = train(1, config("st", m, ""), "--resume");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("was written with a [routing] router, which this config lacks"),
            std::string::npos)
      << r.out;
  fs::remove(dir_ / "runs/st/checkpoints/step_00000005/router.rank0.bin");
  r = train(1, config("st", m, "router = \"drop\"\n"), "--resume");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("has no router.rank0.bin"), std::string::npos) << r.out;
}

// A learned router whose step-1 plan keeps every position of layer 1 (so the layer has no
// router weight) but routes it from step 2: the run stops there with the cause, not an SDK
// error about a NULL weight.
TEST_F(RoutingRun, LearnedRouterRoutingAWeightlessLayerLaterIsNamed) {
  const auto m = manifest("m_late", false);
  const auto r = train(1, config("late", m, "router = \"late\"\n"), "--fresh");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("plan (step 2, layer 1, seq_len 32) routes a layer that holds no router "
                       "weight"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("h.1.router.w"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("select (step"), std::string::npos) << r.out;
  const auto t = metrics("late", "train");
  ASSERT_EQ(t.size(), 1u);
  EXPECT_EQ(t[0]["step"], 1);
}

// A checkpoint of a run before the layer tokens were recorded (trainer state LTS4, written
// here from an LTS5 one: the last two fields dropped): resumed with lr_unit = "layer_tokens",
// its layer tokens are layers x tokens (no run routed then), so the run continues as the
// uninterrupted one.
TEST_F(RoutingRun, ResumeFromAnOlderTrainerStateCountsLayerTokens) {
  const auto m = manifest("m_old", false);
  const std::string extra = "lr_unit = \"layer_tokens\"\n";
  ASSERT_EQ(train(1, config("ofull", m, "", extra), "--fresh").code, 0);
  ASSERT_EQ(train(1, config("opart", m, "", extra), "--fresh --stop-after 7").code, 0);
  const fs::path f = dir_ / "runs/opart/checkpoints/step_00000005/trainer.rank0.bin";
  std::string b = slurp(f);
  ASSERT_GT(b.size(), 32u + 4u + 16u);
  uint32_t magic = 0;
  std::memcpy(&magic, b.data() + 32, 4);
  ASSERT_EQ(magic, 0x4c545335u);  // "LTS5"
  b.resize(b.size() - 16);
  magic = 0x4c545334u;
  std::memcpy(b.data() + 32, &magic, 4);
  const uint64_t n = b.size() - 32, sum = loom::trainer::fnv1a64(b.data() + 32, n);
  std::memcpy(b.data() + 16, &n, 8);
  std::memcpy(b.data() + 24, &sum, 8);
  std::ofstream(f, std::ios::binary | std::ios::trunc) << b;
  std::ofstream(dir_ / "runs/opart/checkpoints/latest") << "step_00000005\n";
  const auto rest = train(1, config("opart", m, "", extra), "--resume");
  ASSERT_EQ(rest.code, 0) << rest.out;
  const auto t = metrics("opart", "train");
  ASSERT_EQ(t.size(), 16u);
  EXPECT_EQ(t[5]["consumed_layer_tokens"], 3 * 128 * 6);
  expect_same_runs("ofull", "opart", {"model.rank0.safetensors", "optimizer.rank0.bin"});
}

}  // namespace
