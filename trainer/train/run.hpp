// What loom-train's parts share: its errors, the comm the ranks talk over, the command line,
// and the small helpers of the run (the default batch draw, sizes and times for humans).
#pragma once

#include <loom/embed.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include "config.hpp"
#include "dataset.hpp"

namespace loom::trainer {

namespace fs = std::filesystem;

class TrainError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A failure every rank learned of together (Trainer::on_every_rank, or a config error, the
// same on each): each rank exits normally, nobody being left to wait for a peer.
class AgreedError : public TrainError {
 public:
  using TrainError::TrainError;
};

// The ranks of this job (the comm's, else the launcher's): a failure that is not agreed ends

// The ranks of this job (the comm's, else the launcher's): a failure that is not agreed ends
// a job of more than one rank with loom_abort_job, so no rank waits on a failed peer.
extern int g_job_ranks;
int launcher_ranks();

void check_loom(int32_t rc, const std::string& what);

// The optimizer's communication figures (loom_optimizer_get_comm_info).
loom_optimizer_comm_info optimizer_comm_info(loom_instance* opt);

// The state of `inst` a checkpoint holds (loom_instance_export_state: size, then the bytes);
// errors name `what`.
std::vector<uint8_t> export_instance_state(loom_instance* inst, const std::string& what);

// ---------------------------------------------------------------- communication

// The manifest's comm instance (or a world of one when the config names none).
struct Comm {
  loom_instance* instance = nullptr;
  void* obj = nullptr;
  const loom_comm_v1* vt = nullptr;
  int rank = 0;
  int size = 1;
  // Gradient-sync traffic the trainer itself did (the optimizer reports its own).
  uint64_t grad_bytes_sent = 0, grad_bytes_received = 0, grad_rounds = 0;
  double grad_wait_s = 0;  // time blocked in the gradient average (this process)

  static void check(loom_status* st, const char* what) {
    if (st == nullptr) return;
    std::string m = std::string(what) + ": " + (st->message ? st->message : "failed");
    if (st->destroy) st->destroy(st);
    throw TrainError(m);
  }
  loom_comm_stats stats() const {
    loom_comm_stats s{};
    s.struct_size = LOOM_COMM_STATS_SIZE;
    if (vt && vt->stats) check(vt->stats(obj, &s), "comm stats");
    return s;
  }
  static DLTensor tensor(void* data, int64_t* shape, uint8_t code, uint8_t bits) {
    DLTensor t{};
    t.data = data;
    t.device = {kDLCPU, 0};
    t.ndim = 1;
    t.dtype = {code, bits, 1};
    t.shape = shape;
    return t;
  }
  // In-place average of fp32 data over the ranks.
  void average(float* data, size_t n, bool count_as_grad) {
    if (size == 1) return;
    const auto t0 = std::chrono::steady_clock::now();
    const loom_comm_stats before = stats();
    int64_t shape[1] = {static_cast<int64_t>(n)};
    DLTensor t = tensor(data, shape, kDLFloat, 32);
    loom_allreduce_args a{LOOM_ALLREDUCE_ARGS_SIZE, LOOM_REDUCE_AVG, nullptr, &t, nullptr};
    check(vt->allreduce(obj, &a), "gradient allreduce");
    if (count_as_grad) {
      const loom_comm_stats after = stats();
      grad_bytes_sent += after.bytes_sent - before.bytes_sent;
      grad_bytes_received += after.bytes_received - before.bytes_received;
      grad_rounds += after.rounds - before.rounds;
      grad_wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
  }
  // Exact, rank-order sums of doubles (allgather, summed here in rank order).
  std::vector<double> sum(const std::vector<double>& x) {
    if (size == 1) return x;
    std::vector<double> all(x.size() * size);
    int64_t s1[1] = {static_cast<int64_t>(x.size())}, s2[1] = {static_cast<int64_t>(all.size())};
    DLTensor send = tensor(const_cast<double*>(x.data()), s1, kDLFloat, 64);
    DLTensor recv = tensor(all.data(), s2, kDLFloat, 64);
    loom_allgather_args a{LOOM_ALLGATHER_ARGS_SIZE, 0, &send, &recv, nullptr};
    check(vt->allgather(obj, &a), "allgather");
    std::vector<double> out(x.size(), 0.0);
    for (int r = 0; r < size; ++r)
      for (size_t i = 0; i < x.size(); ++i) out[i] += all[r * x.size() + i];
    return out;
  }
  void barrier() {
    if (size > 1) check(vt->barrier(obj, nullptr), "barrier");
  }
  // Every rank's `text` (cut to 2 KiB), in rank order.
  std::vector<std::string> gather_text(const std::string& text) {
    if (size == 1) return {text};
    constexpr size_t kMax = 2048;
    std::vector<char> mine(kMax, '\0'), all(kMax * static_cast<size_t>(size));
    std::memcpy(mine.data(), text.data(), std::min(text.size(), kMax - 1));
    int64_t s1[1] = {static_cast<int64_t>(kMax)}, s2[1] = {static_cast<int64_t>(all.size())};
    DLTensor send = tensor(mine.data(), s1, kDLUInt, 8);
    DLTensor recv = tensor(all.data(), s2, kDLUInt, 8);
    loom_allgather_args a{LOOM_ALLGATHER_ARGS_SIZE, 0, &send, &recv, nullptr};
    check(vt->allgather(obj, &a), "allgather");
    std::vector<std::string> out;
    for (int r = 0; r < size; ++r) {
      const char* p = all.data() + static_cast<size_t>(r) * kMax;
      out.emplace_back(p, strnlen(p, kMax));
    }
    return out;
  }
};

// The command line of loom train (train_main.cpp).
struct Args {
  std::string config;
  bool resume = false;
  bool fresh = false;
  int64_t steps = 0;
  int64_t stop_after = -1;
  std::string run_dir;
  bool no_plot = false;
  bool check = false;
  bool eval_only = false;
  std::string weights;  // --weights (with --eval-only)
  std::string plugin_path;
};

// The default batch of `step`: this rank's `count` rows from global row `first`, each at a
// position drawn from (seed, global sample index), so resume is exact whatever the ranks.
void fill_batch(const Dataset& ds, const TrainConfig& c, int64_t step, int first, int count,
                std::vector<int32_t>& x, std::vector<int32_t>& y);

std::string human_bytes(double b);
std::string human_time(double s);
std::string step_dir_name(int64_t step);
std::string read_text(const fs::path& p);

// Checks the config against its dataset (and takes the vocabulary size from it when the config
// leaves it 0). Throws ConfigError or DataError.
void fit_to_dataset(TrainConfig& c, const Dataset& ds);

}  // namespace loom::trainer
