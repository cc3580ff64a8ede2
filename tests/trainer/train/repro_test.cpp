// Bit-reproducible runs (issue 23, docs/soak.md): the same config, fresh, run many
// times on one machine and one build must write the same bytes every time, at 1 thread and at
// 2 threads per rank (and the same bytes at both), on 1 rank and on 2 ranks under mpirun.
//
// Why many runs: an operator saw 8 of 98 identical fresh 300-step runs (1 layer, dim 32) end
// with other weights on a trainer linked to OpenBLAS's serial build, which races when several
// pool threads call sgemm at once (fixed: every GEMM goes through loom/sdk/blas.hpp and the
// trainer links the pthread build). A race shows only in a process whose pool has 2 or more
// threads, so the 1-thread runs here check plain determinism and the 1-vs-2-thread identity,
// and the 2-thread runs carry the search. Taking the operator's rate, q = 8/98 per process
// running 300 steps with threads, the suite runs 300-step processes with 2 threads:
//   1 rank:  16 runs                      -> misses such a race with P = (1 - q)^16 = 26%
//   2 ranks: 20 runs, 2 processes each     -> (1 - q)^40 = 3.3%
//   both tests together                    -> (1 - q)^56 = 0.85%
// (The estimate assumes a 2-thread process hits the race as often per step as the operator's
// runs did; a machine with more cores, and so more pool threads, races more often.)
//
// Compared, for every run against the first 1-thread run of the same rank count:
//  - every checkpoint file (`latest` and every file of each kept step_N/ folder, every
//    rank's), byte for byte; in trainer.rank{R}.bin only the 8 bytes of `elapsed_s` (training
//    wall time, carried across resumes) and the frame's checksum over them may differ, and
//    that checksum is verified against the file's own payload instead;
//  - every metrics.jsonl line, all fields but the wall-clock ones (`tokens_per_s`,
//    `elapsed_s`);
//  - summary.json without its wall-clock fields (`elapsed_s`, `sampler_s`, `train_step_s`,
//    `sampler_share_of_step`).
//
// Threads are set with the config's `threads` key: loom-train passes the config's count (or,
// at 0, the hardware threads / ranks) to the pool itself, so LOOM_NUM_THREADS does not reach
// it (docs/trainer.md, "Config file").
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "run_env.hpp"

namespace fs = std::filesystem;

namespace {

constexpr int kSteps = 300;
// Fields that hold wall-clock time or the process's memory (metrics lines and summary.json).
const char* const kTimingKeys[] = {"tokens_per_s",          "elapsed_s",     "sampler_s",
                                   "train_step_s",          "comm_wait_s",   "comm_wait_share",
                                   "sampler_share_of_step", "peak_rss_bytes"};

// trainer.rank{R}.bin: the LOOMCKPT frame (magic 8, version u32, kind u32 = 2, payload bytes
// u64, FNV-1a 64 of the payload u64), then the payload "LTS5": magic u32, step i64, seed u64,
// world i32, tokens, bytes sent, bytes received, rounds, uncompressed bytes (u64 each), then
// elapsed_s (f64), the only field that is not a function of the config.
constexpr size_t kFrameHeader = 32;
constexpr size_t kChecksumAt = 24;
constexpr size_t kElapsedAt = kFrameHeader + 4 + 8 + 8 + 4 + 5 * 8;
constexpr size_t kTrainerStateBytes = 120;  // the LTS5 payload
constexpr uint32_t kTrainerStateMagic = 0x4c545335;

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

uint64_t fnv1a64(const char* p, size_t n) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; ++i) {
    h ^= static_cast<unsigned char>(p[i]);
    h *= 0x100000001b3ull;
  }
  return h;
}

template <class T>
T read_at(const std::string& b, size_t at) {
  T v;
  std::memcpy(&v, b.data() + at, sizeof(T));
  return v;
}

// A trainer state file with its checksum and elapsed_s zeroed, after checking the frame and
// the checksum; on a layout this test does not know, an error message.
bool mask_trainer_state(std::string& b, std::string& error) {
  if (b.size() != kFrameHeader + kTrainerStateBytes || b.compare(0, 8, "LOOMCKPT") != 0 ||
      read_at<uint32_t>(b, 12) != 2 || read_at<uint64_t>(b, 16) != kTrainerStateBytes ||
      read_at<uint32_t>(b, kFrameHeader) != kTrainerStateMagic) {
    error = "not the trainer state layout this test knows (LOOMCKPT kind 2, LTS5, " +
            std::to_string(kFrameHeader + kTrainerStateBytes) + " bytes; " +
            std::to_string(b.size()) + " here): update kElapsedAt in repro_test.cpp";
    return false;
  }
  if (fnv1a64(b.data() + kFrameHeader, kTrainerStateBytes) != read_at<uint64_t>(b, kChecksumAt)) {
    error = "payload checksum mismatch";
    return false;
  }
  std::memset(b.data() + kChecksumAt, 0, 8);
  std::memset(b.data() + kElapsedAt, 0, 8);
  return true;
}

// What a run leaves that must not depend on anything but the config, the build and the
// machine.
struct Snapshot {
  std::map<std::string, std::string> files;  // path under checkpoints/ -> bytes
  std::vector<std::string> metrics;          // metrics.jsonl lines without timing fields
  std::string summary;                       // summary.json without timing fields
  std::vector<std::string> errors;           // files this test could not read as expected
};

nlohmann::json without_timing(nlohmann::json j) {
  for (const char* k : kTimingKeys) j.erase(k);
  return j;
}

// `latest` and every file of every complete checkpoint folder (step_N/): not what else the
// trainer may keep in checkpoints/ (the ranks' `.shared` probe holds a random token).
Snapshot snapshot(const fs::path& run) {
  Snapshot s;
  const fs::path ck = run / "checkpoints";
  std::vector<fs::path> files;
  if (fs::is_regular_file(ck / "latest")) files.push_back(ck / "latest");
  for (const auto& d : fs::directory_iterator(ck)) {
    const std::string name = d.path().filename().string();
    if (!d.is_directory() || !name.starts_with("step_") ||
        name.find_first_not_of("0123456789", 5) != std::string::npos) {
      continue;
    }
    for (const auto& e : fs::recursive_directory_iterator(d.path())) {
      if (e.is_regular_file()) files.push_back(e.path());
    }
  }
  for (const fs::path& p : files) {
    const std::string rel = p.lexically_relative(ck).generic_string();
    std::string bytes = slurp(p);
    const std::string name = p.filename().string();
    if (name.starts_with("trainer.rank") && name.ends_with(".bin")) {
      std::string error;
      if (!mask_trainer_state(bytes, error)) s.errors.push_back(rel + ": " + error);
    }
    s.files.emplace(rel, std::move(bytes));
  }
  std::ifstream f(run / "metrics.jsonl");
  for (std::string line; std::getline(f, line);) {
    s.metrics.push_back(without_timing(nlohmann::json::parse(line)).dump());
  }
  s.summary = without_timing(nlohmann::json::parse(slurp(run / "summary.json"))).dump();
  return s;
}

// The first difference between two snapshots, or "" when they are the same.
std::string first_difference(const Snapshot& ref, const Snapshot& run) {
  if (!run.errors.empty()) return run.errors.front();
  for (const auto& [name, bytes] : ref.files) {
    const auto it = run.files.find(name);
    if (it == run.files.end()) return name + ": missing";
    const std::string& other = it->second;
    if (other == bytes) continue;
    size_t at = 0;
    while (at < bytes.size() && at < other.size() && bytes[at] == other[at]) ++at;
    return name + ": differs from byte " + std::to_string(at) + " (" +
           std::to_string(bytes.size()) + " and " + std::to_string(other.size()) + " bytes)";
  }
  for (const auto& [name, bytes] : run.files) {
    if (!ref.files.contains(name)) return name + ": not in the reference run";
  }
  if (ref.metrics.size() != run.metrics.size()) {
    return "metrics.jsonl: " + std::to_string(run.metrics.size()) + " lines, the reference has " +
           std::to_string(ref.metrics.size());
  }
  for (size_t i = 0; i < ref.metrics.size(); ++i) {
    if (ref.metrics[i] != run.metrics[i]) {
      return "metrics.jsonl line " + std::to_string(i + 1) + ": " + run.metrics[i] +
             "\n  reference: " + ref.metrics[i];
    }
  }
  if (ref.summary != run.summary) {
    return "summary.json: " + run.summary + "\n  reference: " + ref.summary;
  }
  return "";
}

struct Result {
  int code = -1;
  std::string out;  // stdout and stderr
};

class TrainerRepro : public ::testing::Test {
 protected:
  static fs::path dir_;

  static void SetUpTestSuite() {
    loom::trainer::test_run::set_environment();
    dir_ = fs::temp_directory_path() / ("loom-trainer-repro-" + std::to_string(::getpid()));
    ASSERT_EQ(loom::trainer::test_run::prepare_dataset(dir_, LOOM_DATA_EXE), 0)
        << slurp(dir_ / "prepare.log");
    std::ofstream(dir_ / "adam.toml") << "[comm.world]\nplugin = \"ucx\"\n"
                                         "[optimizer.main]\nplugin = \"adam\"\n";
    // 1-bit Adam on 2 ranks: its warmup (the trainer's fp32 allreduce) for 100 steps, then
    // the compressed allreduce with its codec kernels, which run on the pool as well.
    std::ofstream(dir_ / "onebit.toml")
        << "[comm.world]\nplugin = \"ucx\"\n[codec.onebit]\nplugin = \"onebit\"\n"
           "[optimizer.main]\nplugin = \"onebit_adam\"\ncomm = \"world\"\ncodec = \"onebit\"\n"
           "freeze_step = 100\n";
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  static Result sh(const std::string& cmd) {
    const fs::path log = dir_ / "log.txt";
    const int st = std::system((cmd + " > " + log.string() + " 2>&1").c_str());
    Result r;
    r.code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    r.out = slurp(log);
    return r;
  }

  // The tiny model of the operator's runs (1 layer, dim 32), 300 steps of 4 x 32 tokens:
  // 128 rows, so on 1 rank the row-split GEMMs run as 2 blocks of 64 on 2 threads, and on
  // 2 ranks the head GEMM (64 x 256) and attention's (sequence, head) pairs still split.
  // Metrics every step (each step's loss is compared); evaluations and checkpoints every 100
  // steps (the last two, 200 and 300, are kept and compared).
  // `train`: more [train] keys (e.g. precision).
  static std::string config(const std::string& name, const std::string& manifest, int threads,
                            const std::string& train = "") {
    const fs::path p = dir_ / (name + ".toml");
    std::ofstream(p) << "[manifest]\npath = \"" << manifest << "\"\n"
                     << "[model]\ncontext = 32\nlayers = 1\nheads = 2\ndim = 32\n"
                     << "[data]\ndataset = \"data.bin\"\n"
                     << "[train]\nsteps = " << kSteps << "\nbatch_size = 4\nseq_len = 32\n"
                     << "lr = 3e-3\nmin_lr = 3e-4\nwarmup_steps = 10\n"
                     << "eval_interval = 100\neval_batches = 2\ncheckpoint_interval = 100\n"
                     << "log_interval = 1\nthreads = " << threads << "\n"
                     << "plot = \"none\"\nrun_dir = \"runs/" << name << "\"\n"
                     << train;
    return p.string();
  }

  static Result train(int ranks, const std::string& cfg) {
    std::string cmd = std::string(LOOM_TRAIN_EXE) + " " + cfg + " --fresh";
    if (ranks > 1) {
      cmd = std::string(LOOM_MPIRUN) + " --oversubscribe --allow-run-as-root -np " +
            std::to_string(ranks) + " " + cmd;
    }
    return sh(cmd);
  }

  // `one` fresh runs at 1 thread per rank, then `two` at 2 threads, each compared with the
  // first: all must be identical.
  static void expect_identical_runs(int ranks, const std::string& manifest, int one, int two,
                                    const std::string& train_keys = "") {
    const auto start = std::chrono::steady_clock::now();
    Snapshot ref;
    std::vector<std::string> differing;
    for (int i = 0; i < one + two; ++i) {
      const int threads = i < one ? 1 : 2;
      const std::string name = "r" + std::to_string(ranks) + "_t" + std::to_string(threads);
      const Result r = train(ranks, config(name, manifest, threads, train_keys));
      ASSERT_EQ(r.code, 0) << "run " << i + 1 << " (" << threads << " threads)\n" << r.out;
      const fs::path run = dir_ / "runs" / name;
      Snapshot s = snapshot(run);
      fs::remove_all(run);
      if (i == 0) {
        ASSERT_TRUE(s.errors.empty()) << s.errors.front();
        // What the comparisons cover: every step's line, both kept checkpoints, every rank.
        ASSERT_EQ(s.metrics.size(), static_cast<size_t>(kSteps + kSteps / 100));
        for (const char* step : {"step_00000200", "step_00000300"}) {
          for (int rank = 0; rank < ranks; ++rank) {
            for (const std::string f : {"model", "optimizer", "trainer"}) {
              const std::string file = std::string(step) + "/" + f + ".rank" +
                                       std::to_string(rank) +
                                       (f == "model" ? ".safetensors" : ".bin");
              ASSERT_TRUE(s.files.contains(file)) << file;
            }
          }
        }
        ASSERT_TRUE(s.files.contains("latest"));
        ref = std::move(s);
        continue;
      }
      const std::string d = first_difference(ref, s);
      if (!d.empty()) {
        differing.push_back("run " + std::to_string(i + 1) + " (" + std::to_string(threads) +
                            " threads): " + d);
      }
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::cout << ranks << " rank(s): " << one << " runs at 1 thread and " << two
              << " at 2 threads, " << kSteps << " steps each, in " << seconds << " s\n";
    std::string list;
    for (const auto& d : differing) list += "\n  " + d;
    EXPECT_TRUE(differing.empty()) << differing.size() << " of " << one + two - 1
                                   << " runs differ from run 1 (1 thread):" << list;
  }
};
fs::path TrainerRepro::dir_;

// [gradients]: the buckets started during the backward give the same bits as the same buckets
// started after it, on 2 to 4 ranks under mpirun and on 3 under the env launcher; on 2 ranks
// also the same bits as the one allreduce without [gradients] (a sum of two is the same
// either way round). 2 layers, buckets of 16 KiB: several per block, interleaved with the
// backward.
class TrainerGradientBuckets : public TrainerRepro {
 protected:
  static std::string bucket_config(const std::string& name, const std::string& gradients,
                                   const std::string& manifest = "adam.toml") {
    const fs::path p = dir_ / (name + ".toml");
    std::ofstream(p) << "[manifest]\npath = \"" << manifest << "\"\n"
                     << "[model]\ncontext = 32\nlayers = 2\nheads = 2\ndim = 32\n"
                     << "[data]\ndataset = \"data.bin\"\n"
                     << "[train]\nsteps = 40\nbatch_size = 12\nseq_len = 32\n"
                     << "lr = 3e-3\nmin_lr = 3e-4\nwarmup_steps = 10\n"
                     << "eval_interval = 20\neval_batches = 2\ncheckpoint_interval = 20\n"
                     << "log_interval = 1\nthreads = 1\n"
                     << "plot = \"none\"\nrun_dir = \"runs/" << name << "\"\n"
                     << gradients;
    return p.string();
  }
  // A run's snapshot without the [gradients] summary (which names the overlap setting).
  Snapshot run(int ranks, const std::string& name, const std::string& gradients, bool env,
               const std::string& manifest = "adam.toml") {
    const std::string cfg = bucket_config(name, gradients, manifest);
    std::string cmd = std::string(LOOM_TRAIN_EXE) + " " + cfg + " --fresh";
    if (env) {
      cmd = std::string(LOOM_ENV_LAUNCH) + " " + std::to_string(ranks) + " " + cmd;
    } else if (ranks > 1) {
      cmd = std::string(LOOM_MPIRUN) + " --oversubscribe --allow-run-as-root -np " +
            std::to_string(ranks) + " " + cmd;
    }
    const Result r = sh(cmd);
    EXPECT_EQ(r.code, 0) << r.out;
    Snapshot s = snapshot(dir_ / "runs" / name);
    nlohmann::json j = nlohmann::json::parse(s.summary);
    last_gradients_ = j["gradients"];
    j.erase("gradients");
    s.summary = j.dump();
    fs::remove_all(dir_ / "runs" / name);
    return s;
  }
  void expect_overlap_changes_nothing(int ranks, bool env) {
    const std::string tag = std::to_string(ranks) + (env ? "env" : "mpi");
    const Snapshot after =
        run(ranks, "after" + tag, "[gradients]\nbucket_mb = 0.015625\noverlap = false\n", env);
    ASSERT_TRUE(after.errors.empty()) << after.errors.front();
    ASSERT_FALSE(after.files.empty());
    EXPECT_EQ(last_gradients_["overlap"], false);
    EXPECT_EQ(last_gradients_["started_during_backward"], 0.0);
    const size_t buckets = last_gradients_["buckets"];
    EXPECT_GE(buckets, 4U);
    const Snapshot during = run(ranks, "during" + tag, "[gradients]\nbucket_mb = 0.015625\n", env);
    EXPECT_EQ(last_gradients_["overlap"], true);
    // All but the last bucket (the embeddings', finished at the end) start in the backward.
    EXPECT_GT(double(last_gradients_["started_during_backward"]), 0.5);
    EXPECT_EQ(first_difference(after, during), "");
    if (ranks == 2) {  // the weights and the optimizer's state (the rounds counted differ)
      const Snapshot plain = run(ranks, "plain" + tag, "", env);
      size_t compared = 0;
      for (const auto& [name, bytes] : after.files) {
        if (name.find("/model.") == std::string::npos &&
            name.find("/optimizer.") == std::string::npos) {
          continue;
        }
        ++compared;
        EXPECT_TRUE(plain.files.contains(name) && plain.files.at(name) == bytes) << name;
      }
      EXPECT_EQ(compared, 8U);  // 2 checkpoints x 2 ranks x (model, optimizer)
    }
  }
  nlohmann::json last_gradients_;
};

TEST_F(TrainerGradientBuckets, OverlapGivesTheSameBitsOnTwoRanks) {
  if (std::string(LOOM_MPIRUN).empty()) GTEST_SKIP() << "mpirun not found";
  expect_overlap_changes_nothing(2, false);
}
TEST_F(TrainerGradientBuckets, OverlapGivesTheSameBitsOnThreeRanks) {
  if (std::string(LOOM_MPIRUN).empty()) GTEST_SKIP() << "mpirun not found";
  expect_overlap_changes_nothing(3, false);
}
TEST_F(TrainerGradientBuckets, OverlapGivesTheSameBitsOnFourRanks) {
  if (std::string(LOOM_MPIRUN).empty()) GTEST_SKIP() << "mpirun not found";
  expect_overlap_changes_nothing(4, false);
}
TEST_F(TrainerGradientBuckets, OverlapGivesTheSameBitsUnderTheEnvLauncher) {
  expect_overlap_changes_nothing(3, true);
}

// The 1-bit family in buckets of 8 KiB (several a block), told during the backward which
// gradients are final (grads_ready): the bits of the same buckets exchanged after the backward,
// through every phase in 40 steps (1-bit Adam and 1-bit LAMB: the warmup to step 20, then the
// compression; 0/1 Adam: variance and 1-bit gradient steps to 20, then local steps and syncs).
// Without clipping (the overlap refuses it).
class TrainerOnebitBuckets : public TrainerGradientBuckets {
 protected:
  // `optimizer`: the plugin's lines; `name`: its manifest's name.
  void expect_overlap_changes_nothing(const std::string& name, const std::string& optimizer,
                                      const std::vector<int>& ranks, int env_ranks) {
    const std::string manifest = name + "_buckets.toml";
    std::ofstream(dir_ / manifest) << "[comm.world]\nplugin = \"ucx\"\n[codec.onebit]\n"
                                      "plugin = \"onebit\"\n[optimizer.main]\ncomm = \"world\"\n"
                                      "codec = \"onebit\"\nbucket_mb = 0.0078125\n"
                                   << optimizer;
    std::vector<std::pair<int, bool>> runs;
    for (const int n : ranks) {
      if (!std::string(LOOM_MPIRUN).empty()) runs.emplace_back(n, false);
    }
    runs.emplace_back(env_ranks, true);
    for (const auto& [n, env] : runs) {
      const std::string tag = std::to_string(n) + (env ? "env" : "mpi");
      // clip_grad_norm lands in [train], whose keys the config ends with.
      const Snapshot after = run(
          n, "ob_after" + tag, "clip_grad_norm = 0\n[gradients]\noverlap = false\n", env, manifest);
      ASSERT_TRUE(after.errors.empty()) << after.errors.front();
      ASSERT_FALSE(after.files.empty());
      const Snapshot during = run(
          n, "ob_during" + tag, "clip_grad_norm = 0\n[gradients]\noverlap = true\n", env, manifest);
      EXPECT_EQ(last_gradients_["announced_to_optimizer"], true);
      // Every block's tensors (not the embeddings' and the final LayerNorm's) in the backward.
      EXPECT_GT(double(last_gradients_["announced_during_backward"]), 0.5);
      EXPECT_EQ(first_difference(after, during), "") << n << " ranks";
    }
  }
};
TEST_F(TrainerOnebitBuckets, OnebitAdamOverlapGivesTheSameBits) {
  expect_overlap_changes_nothing("onebit_adam", "plugin = \"onebit_adam\"\nfreeze_step = 20\n", {2},
                                 4);
}
TEST_F(TrainerOnebitBuckets, ZeroOneAdamOverlapGivesTheSameBits) {
  expect_overlap_changes_nothing(
      "zero_one_adam",
      "plugin = \"zero_one_adam\"\nvar_freeze_step = 20\nvar_update_scaler = 2\n"
      "local_step_scaler = 4\nlocal_step_clipper = 4\n",
      {2, 4}, 3);
}
TEST_F(TrainerOnebitBuckets, OnebitLambOverlapGivesTheSameBits) {
  expect_overlap_changes_nothing("onebit_lamb", "plugin = \"onebit_lamb\"\nfreeze_step = 20\n", {3},
                                 2);
}

// bf16 on the wire: half the bytes of fp32, and the same training within a small tolerance.
TEST_F(TrainerGradientBuckets, Bf16OnTheWireHalvesTheBytes) {
  if (std::string(LOOM_MPIRUN).empty()) GTEST_SKIP() << "mpirun not found";
  const Snapshot fp32 = run(2, "fp32", "[gradients]\nbucket_mb = 0.015625\n", false);
  const Snapshot bf16 =
      run(2, "bf16", "[gradients]\nbucket_mb = 0.015625\nwire = \"bf16\"\n", false);
  EXPECT_EQ(last_gradients_["wire"], "bf16");
  const auto a = nlohmann::json::parse(fp32.summary);
  const auto b = nlohmann::json::parse(bf16.summary);
  EXPECT_EQ(2 * uint64_t(b["comm_bytes_sent"]), uint64_t(a["comm_bytes_sent"]));
  const double la = a["final_eval_loss"];
  const double lb = b["final_eval_loss"];
  EXPECT_NE(la, lb) << "bf16 rounding should change the bits";
  EXPECT_NEAR(lb, la, 0.01 * la);
}

TEST_F(TrainerRepro, OneRankRunsAreBitIdenticalAtOneAndTwoThreads) {
  expect_identical_runs(1, "adam.toml", 4, 16);
}

// bf16 mode (bf16 weights and activations, fp32 master weights): the same bytes every run too.
TEST_F(TrainerRepro, Bf16RunsAreBitIdenticalAtOneAndTwoThreads) {
  expect_identical_runs(1, "adam.toml", 2, 4, "precision = \"bf16\"\n");
}

TEST_F(TrainerRepro, TwoRanksRunsAreBitIdenticalAtOneAndTwoThreads) {
  if (std::string(LOOM_MPIRUN).empty()) GTEST_SKIP() << "mpirun not found";
  expect_identical_runs(2, "onebit.toml", 4, 20);
}

}  // namespace
