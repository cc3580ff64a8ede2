// Faults in a multi-rank run end every process within the comm's timeout plus a grace, under
// mpirun and under the env launcher (a shell loop with torchrun's variables): a stopped rank
// (SIGSTOP), a killed one (SIGKILL), a full disk, a run folder the ranks do not share. And the
// run folder is never lost silently: a failed metrics write is an error that leaves the file
// whole, the overwrite guard sees any checkpoint or metrics, and a resume without
// checkpoints/latest continues from the newest complete checkpoint.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "free_port.hpp"
#include "run_env.hpp"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

// The comm's timeout in these runs, and what the whole job may take beyond it to end.
constexpr int kTimeoutS = 5;
constexpr int kGraceS = 25;
constexpr int kSlowTimeoutS = 90;

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string item;
  std::istringstream in(s);
  while (std::getline(in, item, sep)) out.push_back(item);
  return out;
}

// The loom-train processes whose command line names `config`, with their rank (from the
// launcher's variables in their environment; -1 when none).
struct Rank {
  pid_t pid;
  int rank;
};
std::vector<Rank> ranks_of(const std::string& config) {
  std::vector<Rank> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/proc", ec)) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const auto argv = split(slurp(e.path() / "cmdline"), '\0');
    if (argv.size() < 2 || argv[0].find("loom-train") == std::string::npos || argv[1] != config) {
      continue;
    }
    // A zombie has left already: only its parent has not reaped it yet.
    const std::string stat = slurp(e.path() / "stat");
    const auto close = stat.rfind(')');
    if (close != std::string::npos && close + 2 < stat.size() && stat[close + 2] == 'Z') continue;
    int rank = -1;
    for (const auto& v : split(slurp(e.path() / "environ"), '\0')) {
      if (v.rfind("OMPI_COMM_WORLD_RANK=", 0) == 0) rank = std::atoi(v.c_str() + 21);
      if (v.rfind("RANK=", 0) == 0) rank = std::atoi(v.c_str() + 5);
    }
    out.push_back({static_cast<pid_t>(std::stoi(name)), rank});
  }
  return out;
}

// A launcher command (mpirun, or a shell loop) run in its own process group.
class Job {
 public:
  Job(const std::string& cmd, const fs::path& log) : log_(log) {
    pid_ = ::fork();
    if (pid_ == 0) {
      ::setpgid(0, 0);
      const std::string line = cmd + " > '" + log.string() + "' 2>&1";
      ::execl("/bin/sh", "sh", "-c", line.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    ::setpgid(pid_, pid_);
  }
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;
  ~Job() {
    if (pid_ > 0 && status_ < 0) {
      ::kill(-pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  // Waits up to `limit` for the launcher to exit; its exit status, or -1 when it has not.
  int wait_for(Clock::duration limit) {
    const auto end = Clock::now() + limit;
    while (status_ < 0) {
      int st = 0;
      if (::waitpid(pid_, &st, WNOHANG) == pid_) {
        status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        break;
      }
      if (Clock::now() > end) return -1;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return status_;
  }
  [[nodiscard]] std::string output() const { return slurp(log_); }

 private:
  fs::path log_;
  pid_t pid_ = -1;
  int status_ = -1;
};

class TrainerFault : public ::testing::Test {
 protected:
  static fs::path dir_;
  static bool can_mount_;

  static void SetUpTestSuite() {
    loom::trainer::test_run::set_environment("20");
    dir_ = fs::temp_directory_path() / ("loom-trainer-fault-" + std::to_string(::getpid()));
    ASSERT_EQ(loom::trainer::test_run::prepare_dataset(dir_, LOOM_DATA_EXE), 0)
        << slurp(dir_ / "prepare.log");
    std::ofstream(dir_ / "adam.toml") << "[comm.world]\nplugin = \"ucx\"\ntimeout_s = " << kTimeoutS
                                      << "\n[optimizer.main]\nplugin = \"adam\"\n";
    // A comm timeout no agreed failure may come near, so its tests can tell one from a wait.
    std::ofstream(dir_ / "adam_slow.toml")
        << "[comm.world]\nplugin = \"ucx\"\ntimeout_s = " << kSlowTimeoutS
        << "\n[optimizer.main]\nplugin = \"adam\"\n";
    // Private tmpfs mounts (a full disk, folders the ranks do not share) need a mount
    // namespace; without the right to make one, those tests skip.
    fs::create_directories(dir_ / "probe");
    can_mount_ = std::system(("unshare -m sh -c 'mount -t tmpfs -o size=64k tmpfs " +
                              (dir_ / "probe").string() + "' > /dev/null 2>&1")
                                 .c_str()) == 0;
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  void TearDown() override {
    // Whatever a failed test left running.
    for (const auto& r : ranks_of(config_)) ::kill(r.pid, SIGKILL);
  }

  // A long run (it ends by a fault) named `name`; the config's path.
  std::string config(const std::string& name, const std::string& run_dir, int steps = 100000,
                     int checkpoint_interval = 5, const std::string& manifest = "adam.toml") {
    const fs::path p = dir_ / (name + ".toml");
    std::ofstream(p) << "[manifest]\npath = \"" << manifest << "\"\n"
                     << "[model]\ncontext = 32\nlayers = 2\nheads = 2\ndim = 32\n"
                     << "[data]\ndataset = \"data.bin\"\n"
                     << "[train]\nsteps = " << steps << "\nbatch_size = 4\nseq_len = 32\n"
                     << "lr = 3e-3\nwarmup_steps = 4\neval_interval = 0\n"
                     << "checkpoint_interval = " << checkpoint_interval
                     << "\nlog_interval = 1\nthreads = 1\nplot = \"none\"\nrun_dir = \"" << run_dir
                     << "\"\n";
    config_ = p.string();
    return config_;
  }
  static std::string train() { return std::string(LOOM_TRAIN_EXE); }
  std::string mpirun(int ranks, const std::string& args = "") const {
    return std::string(LOOM_MPIRUN) + " --oversubscribe --allow-run-as-root -np " +
           std::to_string(ranks) + " " + train() + " " + config_ + " " + args;
  }
  // The env launcher: a shell loop starting each rank with torchrun's variables; `wrap`
  // goes before each rank's command.
  std::string env_loop(int ranks, const std::string& args = "", const std::string& wrap = "") {
    const int port = loom_test_common::free_port();
    std::string cmd = "pids=; for r in $(seq 0 " + std::to_string(ranks - 1) + "); do " + wrap +
                      " env RANK=$r LOCAL_RANK=$r WORLD_SIZE=" + std::to_string(ranks) +
                      " LOCAL_WORLD_SIZE=" + std::to_string(ranks) +
                      " MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) + " " + train() +
                      " " + config_ + " " + args +
                      " & pids=\"$pids $!\"; done; rc=0; for p in $pids; do wait $p || rc=$?; "
                      "done; exit $rc";
    return "sh -c '" + quote(cmd) + "'";
  }
  static std::string quote(const std::string& s) {
    std::string out;
    for (const char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return out;
  }
  // Waits until the run has written `lines` metrics lines (every rank is training).
  static bool wait_for_progress(const fs::path& metrics, size_t lines, Job& job) {
    const auto end = Clock::now() + std::chrono::seconds(60);
    while (Clock::now() < end) {
      const auto text = slurp(metrics);
      if (static_cast<size_t>(std::count(text.begin(), text.end(), '\n')) >= lines) return true;
      if (job.wait_for(std::chrono::milliseconds(100)) >= 0) return false;
    }
    return false;
  }
  // Signals rank 1 once training is under way; then every process must be gone within the
  // comm's timeout plus the grace.
  void expect_job_ends_after(int sig, const std::string& launcher, const std::string& run) {
    Job job(launcher, dir_ / (run + ".log"));
    ASSERT_TRUE(wait_for_progress(dir_ / "runs" / run / "metrics.jsonl", 3, job)) << job.output();
    pid_t victim = -1;
    for (const auto& r : ranks_of(config_)) {
      if (r.rank == 1) victim = r.pid;
    }
    ASSERT_GT(victim, 0) << "rank 1 not found";
    const auto t0 = Clock::now();
    ASSERT_EQ(::kill(victim, sig), 0);
    const int rc = job.wait_for(std::chrono::seconds(kTimeoutS + kGraceS));
    const double took = std::chrono::duration<double>(Clock::now() - t0).count();
    EXPECT_GE(rc, 0) << "the launcher still runs " << took << " s after the fault\n"
                     << job.output();
    EXPECT_NE(rc, 0) << job.output();
    EXPECT_TRUE(ranks_of(config_).empty()) << "a rank outlived the job";
    if (sig == SIGSTOP) {
      EXPECT_NE(job.output().find("waited " + std::to_string(kTimeoutS) + " s for rank 1"),
                std::string::npos)
          << job.output();
    }
    std::cout << "job ended " << took << " s after signal " << sig << "\n";
  }

  std::string config_;
};
fs::path TrainerFault::dir_;
bool TrainerFault::can_mount_ = false;

TEST_F(TrainerFault, StoppedRankUnderMpirunEndsTheJob) {
  if (std::string(LOOM_MPIRUN).empty()) GTEST_SKIP() << "mpirun not found";
  config("mpi_stop", "runs/mpi_stop");
  expect_job_ends_after(SIGSTOP, mpirun(2, "--fresh"), "mpi_stop");
}

TEST_F(TrainerFault, KilledRankUnderMpirunEndsTheJob) {
  if (std::string(LOOM_MPIRUN).empty()) GTEST_SKIP() << "mpirun not found";
  config("mpi_kill", "runs/mpi_kill");
  expect_job_ends_after(SIGKILL, mpirun(2, "--fresh"), "mpi_kill");
}

TEST_F(TrainerFault, StoppedRankUnderTheEnvLauncherEndsTheJob) {
  config("env_stop", "runs/env_stop");
  expect_job_ends_after(SIGSTOP, env_loop(2, "--fresh"), "env_stop");
}

TEST_F(TrainerFault, KilledRankUnderTheEnvLauncherEndsTheJob) {
  config("env_kill", "runs/env_kill");
  expect_job_ends_after(SIGKILL, env_loop(2, "--fresh"), "env_kill");
}

// The second checkpoint does not fit: every rank stops at once with the same error (they
// agree on it), not after the comm's timeout (90 s here, so a slow machine cannot blur the two).
TEST_F(TrainerFault, FullDiskOnTwoRanksEndsEveryRankAtOnce) {
  if (!can_mount_) GTEST_SKIP() << "no private tmpfs mounts here (unshare -m)";
  const fs::path full = dir_ / "full";
  for (const bool mpi : {true, false}) {
    if (mpi && std::string(LOOM_MPIRUN).empty()) continue;
    const std::string run = mpi ? "full_mpi" : "full_env";
    fs::create_directories(full / run);
    config(run, (full / run).string(), 100000, 5, "adam_slow.toml");
    const std::string launch = mpi ? mpirun(2, "--fresh") : env_loop(2, "--fresh");
    Job job("unshare -m sh -c 'mount -t tmpfs -o size=1200k tmpfs " + (full / run).string() +
                " && " + quote(launch) + "'",
            dir_ / (run + ".log"));
    const auto t0 = Clock::now();
    const int rc = job.wait_for(std::chrono::seconds(kSlowTimeoutS + kGraceS));
    const double took = std::chrono::duration<double>(Clock::now() - t0).count();
    const std::string out = job.output();
    EXPECT_NE(rc, 0) << out;
    EXPECT_LT(took, kSlowTimeoutS / 2) << "ranks waited for the failed one\n" << out;
    std::cout << run << ": ended " << took << " s after the start\n";
    EXPECT_NE(out.find("No space left on device"), std::string::npos) << out;
    // Both ranks report it (the other one prefixed with the failed rank).
    const std::string what = "write failed: No space left on device";
    const size_t first = out.find(what);
    EXPECT_NE(first, std::string::npos) << out;
    EXPECT_NE(out.find(what, first + 1), std::string::npos) << "one rank did not report it\n"
                                                            << out;
    EXPECT_TRUE(ranks_of(config_).empty());
  }
}

// Ranks that each see their own folder at the run's path (node-local disks): refused at the
// start, on every rank, with what checkpoints need.
TEST_F(TrainerFault, RanksWithoutASharedRunFolderAreToldWhatCheckpointsNeed) {
  if (!can_mount_) GTEST_SKIP() << "no private tmpfs mounts here (unshare -m)";
  const fs::path local = dir_ / "node_local";
  fs::create_directories(local);
  config("node_local", local.string());
  // Each rank in its own mount namespace with its own tmpfs at the same path.
  Job job(env_loop(2, "--fresh",
                   "unshare -m sh -c \"mount -t tmpfs tmpfs " + local.string() +
                       " && exec \\\"\\$@\\\"\" _"),
          dir_ / "node_local.log");
  const int rc = job.wait_for(std::chrono::seconds(60));
  const std::string out = job.output();
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("checkpoints need a run folder that every rank shares"), std::string::npos)
      << out;
  EXPECT_NE(out.find("cannot see " + (local / "checkpoints" / ".shared").string()),
            std::string::npos)
      << out;
}

// The run folder fills while metrics are written: the run stops with an error naming the file
// (no line is lost silently) and every line left in the file is whole JSON.
TEST_F(TrainerFault, AFailedMetricsWriteIsAnErrorAndTheFileStaysWhole) {
  if (!can_mount_) GTEST_SKIP() << "no private tmpfs mounts here (unshare -m)";
  const fs::path run = dir_ / "metrics_full";
  fs::create_directories(run);
  config("metrics_full", run.string(), 100000, 0);
  Job job("unshare -m sh -c 'mount -t tmpfs -o size=48k tmpfs " + run.string() + " && " + train() +
              " " + config_ + " --fresh; rc=$?; cp " + (run / "metrics.jsonl").string() + " " +
              (dir_ / "metrics_full.jsonl").string() + "; exit $rc'",
          dir_ / "metrics_full.log");
  const int rc = job.wait_for(std::chrono::seconds(120));
  const std::string out = job.output();
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("metrics.jsonl: cannot write a line: No space left on device"),
            std::string::npos)
      << out;
  std::ifstream f(dir_ / "metrics_full.jsonl");
  size_t lines = 0;
  for (std::string line; std::getline(f, line); ++lines) {
    EXPECT_FALSE(nlohmann::json::parse(line, nullptr, false).is_discarded())
        << "line " << lines + 1 << " is torn: " << line;
  }
  EXPECT_GT(lines, 10u);
}

// Starting without --resume or --fresh over a run that has checkpoints without `latest`, or
// only metrics, is refused; --resume without `latest` continues from the newest complete
// checkpoint, ending byte-identical to an uninterrupted run.
TEST_F(TrainerFault, TheOverwriteGuardSeesEveryCheckpointAndMetrics) {
  const auto run = [&](const std::string& args) {
    Job job(train() + " " + config_ + " " + args, dir_ / "guard.log");
    const int rc = job.wait_for(std::chrono::seconds(120));
    return std::make_pair(rc, job.output());
  };
  config("whole", "runs/whole", 14);
  ASSERT_EQ(run("--fresh").first, 0);
  config("guard", "runs/guard", 14);
  ASSERT_EQ(run("--fresh --stop-after 10").first, 0);
  const fs::path ck = dir_ / "runs" / "guard" / "checkpoints";
  fs::remove(ck / "latest");
  auto [rc, out] = run("");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("already holds checkpoints (step_00000005 to step_00000010) and metrics"),
            std::string::npos)
      << out;
  std::tie(rc, out) = run("--resume");
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("latest is missing; resuming from the newest complete checkpoint, "
                     "step_00000010"),
            std::string::npos)
      << out;
  // (trainer.rank0.bin holds the wall-clock time.)
  for (const char* file : {"model.rank0.safetensors", "optimizer.rank0.bin"}) {
    EXPECT_TRUE(slurp(ck / "step_00000014" / file) ==
                slurp(dir_ / "runs" / "whole" / "checkpoints" / "step_00000014" / file))
        << file << " differs from the uninterrupted run's";
  }
  // Metrics alone (a run stopped before its first checkpoint) are guarded too.
  fs::remove_all(ck);
  std::tie(rc, out) = run("");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("already holds metrics (metrics.jsonl)"), std::string::npos) << out;
  std::tie(rc, out) = run("--resume");
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("to resume from; starting at step 1"), std::string::npos) << out;
}

}  // namespace
