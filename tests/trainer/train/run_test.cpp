// Whole runs of loom-train on a generated corpus (tiny model, a few seconds each):
//  - 2 data-parallel ranks match 1 rank with the same global batch (plain adam);
//  - a run interrupted after a step past its last checkpoint and resumed matches an
//    uninterrupted one bit for bit (1-bit Adam, through its warmup and compression stages);
//  - a bad manifest, a missing dataset and corrupt or truncated checkpoints give clear errors.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "corpus.hpp"

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

class TrainerRun : public ::testing::Test {
 protected:
  static fs::path dir_;

  static void SetUpTestSuite() {
    // For the loom-train processes this starts: quiet logs, OpenMPI as root with more ranks
    // than cores, a bounded bootstrap, and line-by-line progress (docs/comm.md).
    ::setenv("LOOM_LOG_LEVEL", "", 1);
    ::setenv("UCX_LOG_LEVEL", "error", 1);
    ::setenv("OMPI_MCA_rmaps_base_oversubscribe", "1", 1);
    ::setenv("LOOM_BOOTSTRAP_TIMEOUT", "30", 1);
    ::setenv("LOOM_PROGRESS", "lines", 1);
    dir_ = fs::temp_directory_path() / ("loom-trainer-run-" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::ofstream(dir_ / "corpus.txt") << loom::trainer::test_corpus::generated_corpus(120000);
    const Result r =
        sh(std::string(LOOM_DATA_EXE) + " prepare --input " + (dir_ / "corpus.txt").string() +
           " --output " + (dir_ / "data.bin").string() + " --heldout-fraction 0.1");
    ASSERT_EQ(r.code, 0) << r.out;
    std::ofstream(dir_ / "adam.toml") << "[comm.world]\nplugin = \"ucx\"\n"
                                         "[optimizer.main]\nplugin = \"adam\"\n";
    std::ofstream(dir_ / "onebit.toml")
        << "[comm.world]\nplugin = \"ucx\"\n[codec.onebit]\nplugin = \"onebit\"\n"
           "[optimizer.main]\nplugin = \"onebit_adam\"\ncomm = \"world\"\ncodec = \"onebit\"\n"
           "freeze_step = 8\n";
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
  // Writes a trainer config named `name` and returns its path.
  static std::string config(const std::string& name, const std::string& manifest,
                            const std::string& extra = "", int log_interval = 1, int steps = 24,
                            int seq_len = 32) {
    const fs::path p = dir_ / (name + ".toml");
    std::ofstream(p) << "[manifest]\npath = \"" << manifest << "\"\n"
                     << "[model]\ncontext = 32\nlayers = 2\nheads = 2\ndim = 32\n"
                     << "[data]\ndataset = \"data.bin\"\n"
                     << "[train]\nsteps = " << steps << "\nbatch_size = 4\nseq_len = " << seq_len
                     << "\nlr = 3e-3\n"
                     << "min_lr = 3e-4\nwarmup_steps = 4\neval_interval = 6\neval_batches = 2\n"
                     << "checkpoint_interval = 5\nlog_interval = " << log_interval
                     << "\nthreads = 1\n"
                     << "plot = \"none\"\nrun_dir = \"runs/" << name << "\"\n"
                     << extra;
    return p.string();
  }
  static Result train(int ranks, const std::string& cfg, const std::string& args = "") {
    std::string cmd = std::string(LOOM_TRAIN_EXE) + " " + cfg + " " + args;
    if (ranks > 1) {
      cmd = std::string(LOOM_MPIRUN) + " --oversubscribe --allow-run-as-root -np " +
            std::to_string(ranks) + " " + cmd;
    }
    return sh(cmd);
  }
  static std::vector<nlohmann::json> metrics(const std::string& run, const std::string& type) {
    std::ifstream f(dir_ / "runs" / run / "metrics.jsonl");
    std::vector<nlohmann::json> v;
    std::string line;
    while (std::getline(f, line)) {
      auto j = nlohmann::json::parse(line);
      if (j["type"] == type) v.push_back(j);
    }
    return v;
  }
};
fs::path TrainerRun::dir_;

TEST_F(TrainerRun, TwoRanksMatchOneRankWithTheSameGlobalBatch) {
  if (std::string(LOOM_MPIRUN).empty()) GTEST_SKIP() << "mpirun not found";
  const auto one = train(1, config("dp1", "adam.toml"), "--fresh");
  ASSERT_EQ(one.code, 0) << one.out;
  const auto two = train(2, config("dp2", "adam.toml"), "--fresh");
  ASSERT_EQ(two.code, 0) << two.out;
  const auto a = metrics("dp1", "train"), b = metrics("dp2", "train");
  ASSERT_EQ(a.size(), 24u);
  ASSERT_EQ(b.size(), 24u);
  for (size_t i = 0; i < a.size(); ++i) {
    const double la = a[i]["loss"], lb = b[i]["loss"];
    // Step 1 differs only by the order of the gradient sum; later steps by Adam amplifying it.
    EXPECT_NEAR(la, lb, i == 0 ? 1e-5 : 2e-3) << "step " << i + 1;
  }
  EXPECT_NEAR(double(a[0]["grad_norm"]), double(b[0]["grad_norm"]), 1e-4);
  const auto ea = metrics("dp1", "eval"), eb = metrics("dp2", "eval");
  ASSERT_EQ(ea.size(), 4u);
  ASSERT_EQ(eb.size(), 4u);
  for (size_t i = 0; i < ea.size(); ++i) {
    EXPECT_NEAR(double(ea[i]["eval_loss"]), double(eb[i]["eval_loss"]), 2e-3);
  }
  // It learns: eval loss falls from the uniform guess (ln 256 = 5.55).
  EXPECT_LT(double(ea.back()["eval_loss"]), 4.5);
  EXPECT_LT(double(ea.back()["eval_loss"]), double(ea.front()["eval_loss"]));
  // One rank sends nothing; two ranks send what the fp32 ring allreduce sends.
  EXPECT_EQ(a.back()["comm_bytes_sent"], 0);
  EXPECT_GT(b.back()["comm_bytes_sent"], 0);
  EXPECT_EQ(b.back()["comm_bytes_sent"], b.back()["uncompressed_bytes"]);
  EXPECT_EQ(b.back()["comm_rounds"], 24);
  EXPECT_NE(two.out.find("final eval loss:"), std::string::npos) << two.out;
  EXPECT_NE(two.out.find("uncompressed Adam would have sent"), std::string::npos) << two.out;
}

TEST_F(TrainerRun, InterruptedAndResumedMatchesUninterrupted) {
  if (std::string(LOOM_MPIRUN).empty()) GTEST_SKIP() << "mpirun not found";
  const auto full = train(2, config("full", "onebit.toml", "", 3), "--fresh");
  ASSERT_EQ(full.code, 0) << full.out;
  // Killed after step 13: the last checkpoint is step 10; steps 11-13 are done again. Metrics
  // every 3 steps, so a line that averages steps 10-12 must come out the same after resume.
  const auto part = train(2, config("part", "onebit.toml", "", 3), "--fresh --stop-after 13");
  ASSERT_EQ(part.code, 0) << part.out;
  const auto again = train(2, config("part", "onebit.toml", "", 3));
  EXPECT_NE(again.code, 0) << "a run dir with checkpoints needs --resume or --fresh";
  EXPECT_NE(again.out.find("pass --resume"), std::string::npos) << again.out;
  const auto rest = train(2, config("part", "onebit.toml", "", 3), "--resume");
  ASSERT_EQ(rest.code, 0) << rest.out;
  EXPECT_NE(rest.out.find("resumed from"), std::string::npos) << rest.out;
  for (const char* type : {"train", "eval"}) {
    const auto a = metrics("full", type), b = metrics("part", type);
    ASSERT_EQ(a.size(), b.size()) << type;
    for (size_t i = 0; i < a.size(); ++i) {
      for (const char* k : {"step", "loss", "eval_loss", "grad_norm", "lr", "comm_bytes_sent",
                            "comm_rounds", "uncompressed_bytes", "owns_communication"}) {
        if (a[i].contains(k)) {
          EXPECT_EQ(a[i][k], b[i][k]) << type << " " << k << " #" << i;
        }
      }
    }
  }
  // The compression stage ran (1-bit Adam sends less than the fp32 allreduce would).
  const auto last = metrics("full", "train").back();
  EXPECT_LT(double(last["comm_bytes_sent"]), double(last["uncompressed_bytes"]));
  // Final weights are bit-identical on both ranks' files.
  for (const char* f : {"model.rank0.safetensors", "model.rank1.safetensors"}) {
    EXPECT_EQ(slurp(dir_ / "runs/full/checkpoints/step_00000024" / f),
              slurp(dir_ / "runs/part/checkpoints/step_00000024" / f))
        << f;
  }
}

// Rows [from, to) of the position embedding (32 features) in a safetensors file, as bytes.
std::string wpe_rows(const fs::path& file, size_t from, size_t to) {
  const std::string b = slurp(file);
  if (b.size() < 8) return "";
  uint64_t n = 0;
  std::memcpy(&n, b.data(), 8);
  const auto header = nlohmann::json::parse(b.substr(8, n));
  const auto offset = header["wpe"]["data_offsets"][0].get<size_t>();
  const size_t row = 32 * sizeof(float);
  return b.substr(8 + n + offset + from * row, (to - from) * row);
}

// seq_len 16 of context 32: wpe rows 16..31 never get a gradient. 1-bit compression cannot
// send a 0, so past the freeze they would drift (their frozen variance is 0, so even a
// small error-feedback value moves them far); the trainer masks their momentum by default.
TEST_F(TrainerRun, UnusedPositionRowsStayPutUnderOnebitAdamOnlyWhenMasked) {
  if (std::string(LOOM_MPIRUN).empty()) GTEST_SKIP() << "mpirun not found";
  // 4 steps, all in warmup (freeze_step 8): exact averaging leaves the unused rows as
  // initialised.
  const auto init = train(2, config("pos_init", "onebit.toml", "", 1, 4, 16), "--fresh");
  ASSERT_EQ(init.code, 0) << init.out;
  const auto masked = train(2, config("pos_masked", "onebit.toml", "", 1, 24, 16), "--fresh");
  ASSERT_EQ(masked.code, 0) << masked.out;
  EXPECT_NE(masked.out.find("position rows 16..31 are never used"), std::string::npos)
      << masked.out;
  const auto drift =
      train(2, config("pos_drift", "onebit.toml", "mask_unused_positions = false\n", 1, 24, 16),
            "--fresh");
  ASSERT_EQ(drift.code, 0) << drift.out;
  EXPECT_EQ(drift.out.find("are never used"), std::string::npos) << drift.out;

  const fs::path runs = dir_ / "runs";
  const std::string start =
      wpe_rows(runs / "pos_init/checkpoints/step_00000004/model.rank0.safetensors", 16, 32);
  ASSERT_EQ(start.size(), 16u * 32u * 4u);
  for (const char* rank : {"rank0", "rank1"}) {
    const std::string file =
        std::string("checkpoints/step_00000024/model.") + rank + ".safetensors";
    EXPECT_EQ(wpe_rows(runs / "pos_masked" / file, 16, 32), start) << rank;
    EXPECT_NE(wpe_rows(runs / "pos_drift" / file, 16, 32), start) << rank;
    // The used rows trained in both runs.
    EXPECT_NE(wpe_rows(runs / "pos_masked" / file, 0, 16),
              wpe_rows(runs / "pos_init/checkpoints/step_00000004/model.rank0.safetensors", 0, 16));
  }
}

TEST_F(TrainerRun, CorruptOrTruncatedCheckpointsGiveClearErrors) {
  const std::string cfg = config("ck", "adam.toml", "");
  ASSERT_EQ(train(1, cfg, "--fresh --steps 5").code, 0);
  const fs::path ck = dir_ / "runs/ck/checkpoints/step_00000005";
  ASSERT_TRUE(fs::exists(ck / "optimizer.rank0.bin"));
  const std::string opt = slurp(ck / "optimizer.rank0.bin");
  const std::string model = slurp(ck / "model.rank0.safetensors");

  std::string c = opt;
  c[c.size() / 2] ^= 0x01;
  std::ofstream(ck / "optimizer.rank0.bin", std::ios::binary) << c;
  auto r = train(1, cfg, "--resume --steps 8");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("optimizer.rank0.bin: corrupted checkpoint file"), std::string::npos)
      << r.out;
  std::ofstream(ck / "optimizer.rank0.bin", std::ios::binary) << opt;

  std::ofstream(ck / "model.rank0.safetensors", std::ios::binary)
      << model.substr(0, model.size() - 100);
  r = train(1, cfg, "--resume --steps 8");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("model.rank0.safetensors: truncated"), std::string::npos) << r.out;
  std::ofstream(ck / "model.rank0.safetensors", std::ios::binary) << model;

  std::ofstream(dir_ / "runs/ck/checkpoints/latest") << "step_00000099\n";
  r = train(1, cfg, "--resume --steps 8");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("not a checkpoint directory"), std::string::npos) << r.out;
  std::ofstream(dir_ / "runs/ck/checkpoints/latest") << "step_00000005\n";

  r = train(1, cfg, "--resume --steps 8");  // repaired: resumes and finishes
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("resumed from"), std::string::npos) << r.out;
}

TEST_F(TrainerRun, PlotIntoAMissingFolderFailsBeforeTraining) {
  const std::string cfg = config("plotdir", "adam.toml");
  std::string text = slurp(cfg);
  const auto at = text.find("plot = \"none\"");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, 13, "plot = \"nodir/loss.svg\"");
  std::ofstream(cfg) << text;
  const auto r = train(1, cfg, "--fresh");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("[train] plot: the folder " + (dir_ / "nodir").string() + " does not exist"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("step 1/"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(dir_ / "nodir"));
}

TEST_F(TrainerRun, BadManifestAndMissingDatasetGiveClearErrors) {
  std::ofstream(dir_ / "broken.toml") << "[optimizer.main]\nplugin = \"adam\"\nbetaz = 1\n";
  auto r = train(1, config("bad", "broken.toml"), "--fresh");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("broken.toml:3:"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("betaz"), std::string::npos) << r.out;

  r = train(1, config("nodata", "adam.toml"), "--fresh --steps 2");
  EXPECT_EQ(r.code, 0) << r.out;  // control: the same config with the dataset present
  fs::rename(dir_ / "data.bin", dir_ / "data.moved");
  r = train(1, config("nodata", "adam.toml"), "--fresh");
  fs::rename(dir_ / "data.moved", dir_ / "data.bin");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("data.bin: cannot open the dataset"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("loom data prepare"), std::string::npos) << r.out;

  r = train(1, config("missing", "nope.toml"), "--fresh");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("nope.toml"), std::string::npos) << r.out;
}

// The tiny model of the portability check: dim 32, 1 layer, seq 32, 2 steps.
std::string tiny_config(const std::string& cfg) {
  std::string text = slurp(cfg);
  const std::string from = "layers = 2";
  text.replace(text.find(from), from.size(), "layers = 1");
  std::ofstream(cfg) << text;
  return cfg;
}

// QEMU's `max` CPU has AVX2 and no AVX-512: a stray AVX-512 instruction anywhere on the
// trainer's path (model kernels, optimizer, comm, codec) dies with SIGILL here, whatever
// CPU the suite runs on.
TEST_F(TrainerRun, RunsUnderQemuOnACpuWithoutAvx512) {
  ASSERT_FALSE(std::string(LOOM_QEMU).empty())
      << "qemu-x86_64 not found: install qemu-user (scripts/install-deps.sh does)";
  const std::string cfg = tiny_config(config("qemu", "onebit.toml", "", 1, 2, 32));
  const auto r =
      sh(std::string(LOOM_QEMU) + " -cpu max " + LOOM_TRAIN_EXE + " " + cfg + " --fresh");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("(no avx512f"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("SIMD kernels: AVX2"), std::string::npos) << r.out;
  EXPECT_EQ(metrics("qemu", "train").size(), 2u);
}

// A fatal signal after the session is open (UCX's and OpenMPI's handlers are installed by
// then) is reported by loom-train itself: the signal and the CPU, on one line.
TEST_F(TrainerRun, FatalSignalIsReportedWithTheCpuNotAsAUcxCrash) {
  const std::string cfg = config("crash", "adam.toml", "", 1, 1000000);
  const fs::path log = dir_ / "crash.log";
  const auto r = sh("(" + std::string(LOOM_TRAIN_EXE) + " " + cfg + " --fresh > " + log.string() +
                    " 2>&1 & pid=$!; for i in $(seq 300); do grep -q '^step' " + log.string() +
                    " && break; sleep 0.1; done; kill -ILL $pid; wait $pid; echo exit=$?)");
  const std::string out = slurp(log);
  EXPECT_NE(r.out.find("exit=132"), std::string::npos) << r.out << out;  // 128 + SIGILL
  const auto at = out.find("loom train: fatal SIGILL (illegal instruction); CPU: x86-64");
  ASSERT_NE(at, std::string::npos) << out;
  EXPECT_NE(out.find("SIMD kernels: ", at), std::string::npos) << out;
  EXPECT_EQ(out.find("Caught signal"), std::string::npos) << out;  // UCX's handler stayed out
}

// LOOM_SIMD_MAX runs another CPU's code path (every Highway kernel, plugins included) and
// is named in the CPU line; an unknown value is an error, not ignored.
TEST_F(TrainerRun, SimdCapSelectsTheTargetAndRejectsUnknownValues) {
  const std::string cfg = tiny_config(config("simdcap", "adam.toml", "", 1, 2, 32));
  auto r = sh("LOOM_SIMD_MAX=baseline " + std::string(LOOM_TRAIN_EXE) + " " + cfg + " --fresh");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("SIMD kernels: EMU128 (LOOM_SIMD_MAX=baseline)"), std::string::npos)
      << r.out;
  r = sh("LOOM_SIMD_MAX=avx9 " + std::string(LOOM_TRAIN_EXE) + " " + cfg + " --fresh");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("LOOM_SIMD_MAX='avx9' is not one of avx512, avx2"), std::string::npos)
      << r.out;
}

}  // namespace
