// Whole runs of loom-train on a generated corpus (tiny model, a few seconds each):
//  - 2 data-parallel ranks match 1 rank with the same global batch (plain adam);
//  - a run interrupted after a step past its last checkpoint and resumed matches an
//    uninterrupted one bit for bit (1-bit Adam, through its warmup and compression stages);
//  - a bad manifest, a missing dataset and corrupt or truncated checkpoints give clear errors;
//  - 2 and 4 ranks started by a plain loop with torchrun's variables (RANK, WORLD_SIZE,
//    LOCAL_RANK, MASTER_ADDR, MASTER_PORT), and 2 under torchrun itself when it is
//    installed, match the same runs under mpirun bit for bit.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
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

#include "free_port.hpp"
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

// The metrics of one type from a run directory's metrics.jsonl.
std::vector<nlohmann::json> run_metrics(const fs::path& run, const std::string& type) {
  std::ifstream f(run / "metrics.jsonl");
  std::vector<nlohmann::json> v;
  std::string line;
  while (std::getline(f, line)) {
    auto j = nlohmann::json::parse(line);
    if (j["type"] == type) v.push_back(j);
  }
  return v;
}

class TrainerRun : public ::testing::Test {
 protected:
  static fs::path dir_;

  static void SetUpTestSuite() {
    loom::trainer::test_run::set_environment();
    dir_ = fs::temp_directory_path() / ("loom-trainer-run-" + std::to_string(::getpid()));
    ASSERT_EQ(loom::trainer::test_run::prepare_dataset(dir_, LOOM_DATA_EXE), 0)
        << slurp(dir_ / "prepare.log");
    std::ofstream(dir_ / "adam.toml") << "[comm.world]\nplugin = \"ucx\"\n"
                                         "[optimizer.main]\nplugin = \"adam\"\n";
    std::ofstream(dir_ / "onebit.toml")
        << "[comm.world]\nplugin = \"ucx\"\n[codec.onebit]\nplugin = \"onebit\"\n"
           "[optimizer.main]\nplugin = \"onebit_adam\"\ncomm = \"world\"\ncodec = \"onebit\"\n"
           "freeze_step = 8\n";
    std::ofstream(dir_ / "onebit_shard.toml")
        << "[comm.world]\nplugin = \"ucx\"\n[codec.onebit]\nplugin = \"onebit\"\n"
           "[optimizer.main]\nplugin = \"onebit_adam\"\ncomm = \"world\"\ncodec = \"onebit\"\n"
           "freeze_step = 8\nshard_state = true\n";
    std::ofstream(dir_ / "onebit3.toml")
        << "[comm.world]\nplugin = \"ucx\"\n[codec.onebit]\nplugin = \"onebit\"\n"
           "[optimizer.main]\nplugin = \"onebit_adam\"\ncomm = \"world\"\ncodec = \"onebit\"\n"
           "freeze_step = 3\n";
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
  // `ranks` copies of loom-train started by a shell loop, as torchrun starts them: each with
  // RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set.
  static Result train_env(int ranks, const std::string& cfg, const std::string& args, int port) {
    const std::string n = std::to_string(ranks);
    return sh("(pids=; for r in $(seq 0 " + std::to_string(ranks - 1) +
              "); do RANK=$r LOCAL_RANK=$r WORLD_SIZE=" + n + " LOCAL_WORLD_SIZE=" + n +
              " MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) + " " + LOOM_TRAIN_EXE +
              " " + cfg + " " + args +
              " & pids=\"$pids $!\"; done; rc=0; for p in $pids; do wait $p || rc=$?; done; "
              "exit $rc)");
  }
  static std::vector<nlohmann::json> metrics(const std::string& run, const std::string& type) {
    return run_metrics(dir_ / "runs" / run, type);
  }
  // Runs `manifest` on 2 ranks for 24 steps as `full_run`, and as `part_run` stopped after
  // step 13 and resumed; the metrics and the final weights must match.
  static void interrupted_and_resumed(const std::string& manifest, const std::string& full_run,
                                      const std::string& part_run);
};
fs::path TrainerRun::dir_;

using loom_test_common::free_port;

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
  interrupted_and_resumed("onebit.toml", "full", "part");
}

// onebit_adam with shard_state: each rank's checkpoint holds its slice of the moments, and a
// resumed run continues bit for bit.
TEST_F(TrainerRun, ShardedOnebitAdamResumesAndKeepsASliceOfTheState) {
  if (std::string(LOOM_MPIRUN).empty()) GTEST_SKIP() << "mpirun not found";
  interrupted_and_resumed("onebit_shard.toml", "shard_full", "shard_part");
  const auto s = nlohmann::json::parse(slurp(dir_ / "runs/shard_full/summary.json"));
  // Unsharded, a rank keeps m, v and the worker error for every parameter (12 bytes each)
  // beside the server error; sharded on 2 ranks, half of m and v: about 8 + 2.
  const double params = double(s["parameters"]);
  EXPECT_LT(double(s["optimizer_state_bytes"]), 12.0 * params) << s.dump();
  EXPECT_GT(double(s["optimizer_state_bytes"]), 8.0 * params) << s.dump();
}

void TrainerRun::interrupted_and_resumed(const std::string& manifest, const std::string& full_run,
                                         const std::string& part_run) {
  const auto full = train(2, config(full_run, manifest, "", 3), "--fresh");
  ASSERT_EQ(full.code, 0) << full.out;
  // Killed after step 13: the last checkpoint is step 10; steps 11-13 are done again. Metrics
  // every 3 steps, so a line that averages steps 10-12 must come out the same after resume.
  const auto part = train(2, config(part_run, manifest, "", 3), "--fresh --stop-after 13");
  ASSERT_EQ(part.code, 0) << part.out;
  const auto again = train(2, config(part_run, manifest, "", 3));
  EXPECT_NE(again.code, 0) << "a run dir with checkpoints needs --resume or --fresh";
  EXPECT_NE(again.out.find("pass --resume"), std::string::npos) << again.out;
  const auto rest = train(2, config(part_run, manifest, "", 3), "--resume");
  ASSERT_EQ(rest.code, 0) << rest.out;
  EXPECT_NE(rest.out.find("resumed from"), std::string::npos) << rest.out;
  for (const char* type : {"train", "eval"}) {
    const auto a = metrics(full_run, type), b = metrics(part_run, type);
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
  const auto last = metrics(full_run, "train").back();
  EXPECT_LT(double(last["comm_bytes_sent"]), double(last["uncompressed_bytes"]));
  // Final weights are bit-identical on both ranks' files.
  for (const char* f : {"model.rank0.safetensors", "model.rank1.safetensors"}) {
    EXPECT_EQ(slurp(dir_ / "runs" / full_run / "checkpoints/step_00000024" / f),
              slurp(dir_ / "runs" / part_run / "checkpoints/step_00000024" / f))
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

// A NaN in rank 1's gradient at step 5 (LOOM_TRAIN_NONFINITE_GRAD): the optimizer skips the
// step on both ranks (adam: the trainer's average carries the NaN to rank 0; onebit_adam past
// its freeze: the ranks agree on the flag), the trainer says so, counts it in the metrics and
// the summary, and the run finishes with finite weights.
TEST_F(TrainerRun, NonfiniteGradientIsSkippedLoggedAndCounted) {
  if (std::string(LOOM_MPIRUN).empty()) GTEST_SKIP() << "mpirun not found";
  for (const char* manifest : {"adam.toml", "onebit3.toml"}) {
    SCOPED_TRACE(manifest);
    const std::string name = std::string("nonfinite-") + (manifest[0] == 'a' ? "adam" : "onebit");
    ::setenv("LOOM_TRAIN_NONFINITE_GRAD", "5:1", 1);
    const auto r = train(2, config(name, manifest, "", 1, 10), "--fresh");
    ::unsetenv("LOOM_TRAIN_NONFINITE_GRAD");
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("step 5: skipped by the optimizer (a gradient is NaN or Inf); 1 skipped"),
              std::string::npos)
        << r.out;
    EXPECT_NE(r.out.find("steps skipped for a NaN or Inf gradient: 1"), std::string::npos) << r.out;
    const auto m = metrics(name, "train");
    ASSERT_EQ(m.size(), 10u);
    for (size_t i = 0; i < m.size(); ++i) {
      EXPECT_EQ(m[i]["skipped_steps"], i + 1 < 5 ? 0 : 1) << "step " << i + 1;
      EXPECT_TRUE(std::isfinite(double(m[i]["loss"]))) << "step " << i + 1;
    }
    const auto summary = nlohmann::json::parse(slurp(dir_ / "runs" / name / "summary.json"));
    EXPECT_EQ(summary["skipped_steps"], 1);
    EXPECT_TRUE(std::isfinite(double(summary["final_eval_loss"])));
  }
  ::setenv("LOOM_TRAIN_NONFINITE_GRAD", "5:x", 1);
  const auto bad = train(1, config("nonfinite-bad", "adam.toml", "", 1, 2), "--fresh");
  ::unsetenv("LOOM_TRAIN_NONFINITE_GRAD");
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.out.find("LOOM_TRAIN_NONFINITE_GRAD='5:x': expected STEP or STEP:RANK"),
            std::string::npos)
      << bad.out;
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
  // libloom's reader names the tensor that runs past the end of the short data area.
  EXPECT_NE(r.out.find("model.rank0.safetensors: header says tensor "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" but the data area is "), std::string::npos) << r.out;
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

namespace {

// Two runs of the same config (1-bit Adam, freeze_step 3, 8 steps, checkpoints at 5 and 8)
// on n ranks: every metric but the timings, the summary, the final line and every rank's
// checkpointed weights and optimizer state are identical.
void expect_same_run(const fs::path& runs, const std::string& a, const std::string& b, int n,
                     const std::string& out_a, const std::string& out_b) {
  for (const char* type : {"train", "eval"}) {
    const auto ma = run_metrics(runs / a, type), mb = run_metrics(runs / b, type);
    ASSERT_EQ(ma.size(), std::string(type) == "train" ? 8u : 2u) << type;
    ASSERT_EQ(ma.size(), mb.size()) << type;
    for (size_t i = 0; i < ma.size(); ++i) {
      for (const char* k :
           {"step", "loss", "eval_loss", "grad_norm", "lr", "tokens", "comm_bytes_sent",
            "comm_bytes_received", "comm_rounds", "uncompressed_bytes", "owns_communication"}) {
        if (ma[i].contains(k)) {
          EXPECT_EQ(ma[i][k], mb[i][k]) << type << " " << k << " #" << i;
        }
      }
    }
  }
  // The compression stage ran, so the transport carried real traffic.
  const auto last = run_metrics(runs / b, "train").back();
  EXPECT_GT(double(last["comm_bytes_sent"]), 0);
  EXPECT_LT(double(last["comm_bytes_sent"]), double(last["uncompressed_bytes"]));
  auto sa = nlohmann::json::parse(slurp(runs / a / "summary.json"));
  auto sb = nlohmann::json::parse(slurp(runs / b / "summary.json"));
  // Rank 0's memory: the optimizer's state is part of the result, its peak resident set not.
  EXPECT_GT(uint64_t(sb["optimizer_state_bytes"]), 0u);
  EXPECT_GT(uint64_t(sb["peak_rss_bytes"]), uint64_t(sb["optimizer_state_bytes"]));
  for (const char* k : {"elapsed_s", "comm_wait_s", "comm_wait_share", "peak_rss_bytes"}) {
    sa.erase(k);
    sb.erase(k);
  }
  EXPECT_EQ(sa, sb);
  EXPECT_EQ(sb["ranks"], n);
  const auto final_line = [](const std::string& out) {
    const auto at = out.find("final eval loss:");
    return at == std::string::npos ? std::string() : out.substr(at, out.find('\n', at) - at);
  };
  EXPECT_FALSE(final_line(out_a).empty()) << out_a;
  EXPECT_EQ(final_line(out_a), final_line(out_b)) << out_b;
  for (const char* step : {"step_00000005", "step_00000008"}) {
    for (int r = 0; r < n; ++r) {
      for (const std::string f : {"model.rank", "optimizer.rank"}) {
        const std::string name =
            f + std::to_string(r) + (f == "model.rank" ? ".safetensors" : ".bin");
        const fs::path pa = runs / a / "checkpoints" / step / name;
        const fs::path pb = runs / b / "checkpoints" / step / name;
        ASSERT_TRUE(fs::exists(pa)) << pa;
        ASSERT_TRUE(fs::exists(pb)) << pb;
        EXPECT_EQ(slurp(pa), slurp(pb)) << step << "/" << name;
      }
    }
  }
}

TEST_F(TrainerRun, EnvLaunchedRanksMatchMpirunBitForBit) {
  if (std::string(LOOM_MPIRUN).empty()) GTEST_SKIP() << "mpirun not found";
  for (const int n : {2, 4}) {
    SCOPED_TRACE(std::to_string(n) + " ranks");
    const std::string mpi = "mpi" + std::to_string(n), env = "env" + std::to_string(n);
    const auto a = train(n, config(mpi, "onebit3.toml", "", 1, 8), "--fresh");
    ASSERT_EQ(a.code, 0) << a.out;
    const int port = free_port();
    ASSERT_GT(port, 0);
    const auto b = train_env(n, config(env, "onebit3.toml", "", 1, 8), "--fresh", port);
    ASSERT_EQ(b.code, 0) << b.out;
    EXPECT_NE(b.out.find(std::to_string(n) + " rank(s)"), std::string::npos) << b.out;
    expect_same_run(dir_ / "runs", mpi, env, n, a.out, b.out);
  }
}

// The same under torchrun itself (when installed): its agent serves its store on
// MASTER_PORT, so Loom's rank 0 listens on the next port.
TEST_F(TrainerRun, TorchrunLaunchedRanksMatchMpirunBitForBit) {
  if (std::string(LOOM_MPIRUN).empty()) GTEST_SKIP() << "mpirun not found";
  if (std::string(LOOM_TORCHRUN).empty()) GTEST_SKIP() << "torchrun not found";
  const auto a = train(2, config("mpi_t2", "onebit3.toml", "", 1, 8), "--fresh");
  ASSERT_EQ(a.code, 0) << a.out;
  const int port = free_port();
  ASSERT_GT(port, 0);
  // --redirects/--tee 1 (stdout to per-rank logs, copied to the console) rather than the
  // defaults, which Debian's torch 1.13 cannot parse under Python 3.11.
  const auto b =
      sh(std::string(LOOM_TORCHRUN) + " --nproc_per_node 2 --master_port " + std::to_string(port) +
         " --redirects 1 --tee 1 --log_dir " +
         (dir_ / ("torchrun-logs-" + std::to_string(port))).string() + " --no_python " +
         LOOM_TRAIN_EXE + " " + config("torchrun_t2", "onebit3.toml", "", 1, 8) + " --fresh");
  ASSERT_EQ(b.code, 0) << b.out;
  EXPECT_NE(b.out.find("2 rank(s)"), std::string::npos) << b.out;
  expect_same_run(dir_ / "runs", "mpi_t2", "torchrun_t2", 2, a.out, b.out);
}

// A rank that is missing under the same launch: the others stop with a clear error within
// LOOM_BOOTSTRAP_TIMEOUT instead of training alone.
TEST_F(TrainerRun, EnvLaunchWithAMissingRankFailsClearly) {
  const int port = free_port();
  ASSERT_GT(port, 0);
  const std::string cfg = config("env_missing", "adam.toml", "", 1, 4);
  const auto r =
      sh("LOOM_BOOTSTRAP_TIMEOUT=3 RANK=0 LOCAL_RANK=0 WORLD_SIZE=2 "
         "MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
         std::to_string(port) + " " + LOOM_TRAIN_EXE + " " + cfg + " --fresh");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("rank 1 of WORLD_SIZE=2 never connected"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find(" parameters, "), std::string::npos) << "it trained alone: " << r.out;
}

}  // namespace
