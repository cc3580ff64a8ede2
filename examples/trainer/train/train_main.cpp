// loom-train (run as `loom train CONFIG.toml [--resume] [--fresh] [--steps N] [--run-dir DIR]`):
// the reference trainer's loop. Data parallel over the ranks mpirun starts, through the Loom
// manifest's comm instance; optimizer from the manifest; warmup + cosine/linear decay;
// global-norm clipping; eval at intervals; exact checkpoints; metrics JSONL; a plot at the end.
// docs/trainer.md describes the files and the numbers it prints.
#include <loom/embed.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <loom_cli_support.hpp>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint.hpp"
#include "config.hpp"
#include "crash_report.hpp"
#include "dataset.hpp"
#include "model.hpp"

namespace fs = std::filesystem;
using namespace loom::trainer;

namespace {

class TrainError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

void check_loom(int32_t rc, const std::string& what) {
  if (rc != LOOM_OK) throw TrainError(what + ": " + loom_last_error());
}

// ---------------------------------------------------------------- communication

// The manifest's comm instance (or a world of one when the config names none).
struct Comm {
  void* obj = nullptr;
  const loom_comm_v1* vt = nullptr;
  int rank = 0;
  int size = 1;
  // Gradient-sync traffic the trainer itself did (the optimizer reports its own).
  uint64_t grad_bytes_sent = 0, grad_bytes_received = 0, grad_rounds = 0;

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
};

// ---------------------------------------------------------------- data

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Sample g of the run (global index: step-1 times batch_size plus its place in the global
// batch) starts at a position drawn by a counter-based generator: the data position and RNG
// state of a run are its step and seed, so resume is exact whatever the rank count.
uint64_t sample_offset(uint64_t seed, uint64_t g, uint64_t range) {
  return splitmix64(splitmix64(seed) ^ (g * 0xd1b54a32d192ed03ull)) % range;
}

void fill_batch(const Dataset& ds, const TrainConfig& c, int64_t step, int first, int count,
                std::vector<int32_t>& x, std::vector<int32_t>& y) {
  const auto train = ds.train();
  const uint64_t range = train.size() - static_cast<uint64_t>(c.seq_len);
  x.resize(static_cast<size_t>(count) * c.seq_len);
  y.resize(x.size());
  for (int i = 0; i < count; ++i) {
    const uint64_t g = static_cast<uint64_t>(step - 1) * c.batch_size + first + i;
    const uint64_t off = sample_offset(c.seed, g, range);
    for (int j = 0; j < c.seq_len; ++j) {
      x[static_cast<size_t>(i) * c.seq_len + j] = train[off + j];
      y[static_cast<size_t>(i) * c.seq_len + j] = train[off + j + 1];
    }
  }
}

// ---------------------------------------------------------------- helpers

std::string human_bytes(double b) {
  const char* u[] = {"B", "KB", "MB", "GB", "TB"};
  int i = 0;
  while (b >= 1000 && i < 4) b /= 1000, ++i;
  char s[32];
  std::snprintf(s, sizeof(s), i == 0 ? "%.0f %s" : "%.2f %s", b, u[i]);
  return s;
}

std::string human_time(double s) {
  char b[32];
  if (s < 60)
    std::snprintf(b, sizeof(b), "%.0fs", s);
  else if (s < 3600)
    std::snprintf(b, sizeof(b), "%dm%02ds", int(s) / 60, int(s) % 60);
  else
    std::snprintf(b, sizeof(b), "%dh%02dm", int(s) / 3600, (int(s) / 60) % 60);
  return b;
}

std::string step_dir_name(int64_t step) {
  char b[32];
  std::snprintf(b, sizeof(b), "step_%08lld", static_cast<long long>(step));
  return b;
}

std::string read_text(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

template <class T>
void put(std::vector<uint8_t>& b, const T& v) {
  const auto* p = reinterpret_cast<const uint8_t*>(&v);
  b.insert(b.end(), p, p + sizeof(T));
}
template <class T>
T take(const std::vector<uint8_t>& b, size_t& off, const std::string& file) {
  if (off + sizeof(T) > b.size()) throw CheckpointError(file + ": truncated trainer state");
  T v;
  std::memcpy(&v, b.data() + off, sizeof(T));
  off += sizeof(T);
  return v;
}

// What a checkpoint holds besides the weights and the optimizer state (rank-local).
struct TrainerState {
  int64_t step = 0;
  uint64_t seed = 0;
  int32_t world = 1;
  uint64_t tokens_seen = 0;
  uint64_t grad_bytes_sent = 0, grad_bytes_received = 0, grad_rounds = 0;
  uint64_t uncompressed_bytes = 0;
  double elapsed_s = 0;
  // This rank's train-loss sum over the steps since the last metrics line, so the first line
  // after a resume averages the same steps as without the interruption.
  double loss_acc = 0;
  int64_t acc_steps = 0;
};
constexpr uint32_t kTrainerStateMagic = 0x4c545332;  // "LTS2"; "LTS1" lacked the loss sums

std::vector<uint8_t> encode(const TrainerState& s) {
  std::vector<uint8_t> b;
  put(b, kTrainerStateMagic);
  put(b, s.step);
  put(b, s.seed);
  put(b, s.world);
  put(b, s.tokens_seen);
  put(b, s.grad_bytes_sent);
  put(b, s.grad_bytes_received);
  put(b, s.grad_rounds);
  put(b, s.uncompressed_bytes);
  put(b, s.elapsed_s);
  put(b, s.loss_acc);
  put(b, s.acc_steps);
  return b;
}
TrainerState decode(const std::vector<uint8_t>& b, const std::string& file) {
  size_t o = 0;
  if (take<uint32_t>(b, o, file) != kTrainerStateMagic) {
    throw CheckpointError(file + ": not a trainer state of this version of loom-train");
  }
  TrainerState s;
  s.step = take<int64_t>(b, o, file);
  s.seed = take<uint64_t>(b, o, file);
  s.world = take<int32_t>(b, o, file);
  s.tokens_seen = take<uint64_t>(b, o, file);
  s.grad_bytes_sent = take<uint64_t>(b, o, file);
  s.grad_bytes_received = take<uint64_t>(b, o, file);
  s.grad_rounds = take<uint64_t>(b, o, file);
  s.uncompressed_bytes = take<uint64_t>(b, o, file);
  s.elapsed_s = take<double>(b, o, file);
  s.loss_acc = take<double>(b, o, file);
  s.acc_steps = take<int64_t>(b, o, file);
  if (o != b.size()) throw CheckpointError(file + ": trailing bytes in the trainer state");
  return s;
}

// Checks the config against its dataset (and takes the vocabulary size from it when the config
// leaves it 0). Throws ConfigError or DataError.
void fit_to_dataset(TrainConfig& c, const Dataset& ds) {
  if (c.model.vocab_size == 0) c.model.vocab_size = static_cast<int>(ds.vocab_size());
  if (static_cast<uint32_t>(c.model.vocab_size) < ds.vocab_size()) {
    throw ConfigError(c.config_path + ": [model] vocab_size " + std::to_string(c.model.vocab_size) +
                      " is smaller than the dataset's " + std::to_string(ds.vocab_size()));
  }
  if (ds.train().size() < static_cast<size_t>(c.seq_len) + 2) {
    throw DataError(c.dataset + ": the train split has " + std::to_string(ds.train().size()) +
                    " tokens, fewer than one sequence of seq_len + 1");
  }
  if (ds.heldout().size() < static_cast<size_t>(c.seq_len) + 1) {
    throw DataError(c.dataset + ": the heldout split has " + std::to_string(ds.heldout().size()) +
                    " tokens, fewer than one sequence of seq_len + 1 (prepare it again with a "
                    "larger --heldout-fraction)");
  }
}

// ---------------------------------------------------------------- the run

struct Args {
  std::string config;
  bool resume = false;
  bool fresh = false;
  int64_t steps = 0;
  int64_t stop_after = -1;
  std::string run_dir;
  bool no_plot = false;
  bool check = false;
  std::string plugin_path;
};

int run(const Args& args) {
  loom::trainer::apply_simd_cap("loom train");
  TrainConfig c = load_config(args.config);
  if (args.steps > 0) c.steps = args.steps;
  if (args.stop_after >= 0) c.stop_after = args.stop_after;
  if (!args.run_dir.empty()) {
    c.run_dir = fs::absolute(args.run_dir).lexically_normal().string();
    if (c.plot == (fs::path(load_config(args.config).run_dir) / "loss.png").string()) {
      c.plot = (fs::path(c.run_dir) / "loss.png").string();
    }
  }
  if (args.no_plot) c.plot.clear();
  // The plot is drawn at the end: a folder that is not there should fail now, not then.
  const fs::path plot_dir = fs::path(c.plot).parent_path();
  std::error_code plot_ec;
  if (!c.plot.empty() && plot_dir != fs::path(c.run_dir) && !fs::is_directory(plot_dir, plot_ec)) {
    throw ConfigError(c.config_path + ": [train] plot: the folder " + plot_dir.string() +
                      " does not exist (create it first, or use plot = \"auto\")");
  }

  Dataset ds(c.dataset);
  fit_to_dataset(c, ds);

  // Loom: the manifest's instances.
  loom_open_options opts{};
  opts.struct_size = LOOM_OPEN_OPTIONS_SIZE;
  opts.log_level = -1;
  opts.plugin_path = args.plugin_path.empty() ? nullptr : args.plugin_path.c_str();
  loom_session* session = nullptr;
  check_loom(loom_open_file(c.manifest.c_str(), &opts, &session), "loom manifest");
  loom::trainer::install_crash_report("loom train");  // again: UCX and MPI installed theirs
  std::unique_ptr<loom_session, void (*)(loom_session*)> session_guard(session, loom_close);
  loom_instance* opt = nullptr;
  check_loom(loom_find_instance(session, "optimizer", c.optimizer.c_str(), &opt),
             c.manifest + ": optimizer '" + c.optimizer + "'");
  Comm comm;
  if (!c.comm.empty()) {
    loom_instance* ci = nullptr;
    check_loom(loom_find_instance(session, "comm", c.comm.c_str(), &ci),
               c.manifest + ": comm '" + c.comm + "'");
    comm.obj = loom_instance_object(ci);
    comm.vt = static_cast<const loom_comm_v1*>(loom_instance_vtable(ci));
    comm.rank = comm.vt->rank(comm.obj);
    comm.size = comm.vt->size(comm.obj);
  }
  const int rank = comm.rank, world = comm.size;
  const bool root = rank == 0;
  if (c.batch_size % world != 0) {
    throw ConfigError(c.config_path + ": [train] batch_size " + std::to_string(c.batch_size) +
                      " is not divisible by the " + std::to_string(world) + " ranks");
  }
  const int local_batch = c.batch_size / world;

  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  set_num_threads(c.threads > 0 ? c.threads : static_cast<int>(std::max(1u, hw / world)));
  Model model(c.model, c.seed);
  auto& params = model.parameters();
  const size_t numel = model.num_parameters();

  // Optimizer groups: matrices decay (the manifest's weight_decay), vectors do not.
  std::vector<std::vector<int64_t>> shapes;
  std::vector<DLTensor> pt(params.size()), gt(params.size());
  std::vector<loom_optimizer_tensor> decay, no_decay;
  // The momentum mask of the position embedding: rows < seq_len are 1, the rest (never
  // used, so their gradient is always 0) are 0. See TrainConfig::mask_unused_positions.
  std::vector<float> wpe_mask;
  DLTensor wpe_mask_t{};
  for (size_t i = 0; i < params.size(); ++i) {
    auto& p = params[i];
    pt[i] = DLTensor{};
    pt[i].data = p.value;
    pt[i].device = {kDLCPU, 0};
    pt[i].ndim = static_cast<int32_t>(p.shape.size());
    pt[i].dtype = {kDLFloat, 32, 1};
    pt[i].shape = p.shape.data();
    gt[i] = pt[i];
    gt[i].data = p.grad;
    const DLTensor* mask = nullptr;
    if (p.name == "wpe" && c.mask_unused_positions && c.seq_len < c.model.context) {
      const auto row = static_cast<size_t>(p.shape[1]);
      wpe_mask.assign(p.numel, 0.0f);
      std::fill(wpe_mask.begin(), wpe_mask.begin() + static_cast<ptrdiff_t>(row * c.seq_len), 1.0f);
      wpe_mask_t = pt[i];
      wpe_mask_t.data = wpe_mask.data();
      mask = &wpe_mask_t;
    }
    (p.shape.size() >= 2 ? decay : no_decay)
        .push_back({LOOM_OPTIMIZER_TENSOR_SIZE, 0, &pt[i], &gt[i], nullptr, mask});
  }
  std::vector<loom_optimizer_group> groups;
  if (!decay.empty())
    groups.push_back({LOOM_OPTIMIZER_GROUP_SIZE, 0, decay.data(), decay.size(), 1.0, NAN});
  if (!no_decay.empty())
    groups.push_back({LOOM_OPTIMIZER_GROUP_SIZE, 0, no_decay.data(), no_decay.size(), 1.0, 0.0});
  bool contiguous = true;
  for (size_t i = 1; i < params.size(); ++i) {
    contiguous &= params[i].grad == params[i - 1].grad + params[i - 1].numel;
  }
  std::vector<float> flat(contiguous ? 0 : numel);

  // Run directory and resume.
  const fs::path run_dir = c.run_dir, ckpt_root = run_dir / "checkpoints";
  const fs::path metrics_path = run_dir / "metrics.jsonl";
  std::error_code ec;
  fs::create_directories(ckpt_root, ec);
  if (ec) throw TrainError(ckpt_root.string() + ": cannot create: " + ec.message());
  TrainerState st;
  st.seed = c.seed;
  st.world = world;
  const fs::path latest_file = ckpt_root / "latest";
  const bool has_ckpt = fs::exists(latest_file);
  if (has_ckpt && !args.resume && !args.fresh) {
    std::string name = read_text(latest_file);
    while (!name.empty() && std::isspace(static_cast<unsigned char>(name.back()))) name.pop_back();
    throw TrainError(run_dir.string() + " already holds checkpoints (latest: " + name +
                     "); pass --resume to continue or --fresh to start over");
  }
  comm.barrier();  // every rank has looked before anyone deletes
  if (args.fresh || !has_ckpt) {
    if (root) {
      fs::remove_all(ckpt_root, ec);
      fs::create_directories(ckpt_root, ec);
      fs::remove(metrics_path, ec);
    }
  } else {
    std::string name = read_text(latest_file);
    while (!name.empty() && std::isspace(static_cast<unsigned char>(name.back()))) name.pop_back();
    const fs::path dir = ckpt_root / name;
    if (name.rfind("step_", 0) != 0 || !fs::is_directory(dir)) {
      throw CheckpointError(latest_file.string() + ": names '" + name +
                            "', which is not a checkpoint directory");
    }
    const std::string rs = "rank" + std::to_string(rank);
    const std::string tfile = (dir / ("trainer." + rs + ".bin")).string();
    st = decode(load_blob(tfile, BlobKind::kTrainer), tfile);
    if (st.world != world) {
      throw CheckpointError(dir.string() + ": written by " + std::to_string(st.world) +
                            " ranks; resume with the same number of ranks (now " +
                            std::to_string(world) + ")");
    }
    if (st.seed != c.seed) throw CheckpointError(tfile + ": written with another seed");
    load_safetensors((dir / ("model." + rs + ".safetensors")).string(), params);
    const std::string ofile = (dir / ("optimizer." + rs + ".bin")).string();
    const auto blob = load_blob(ofile, BlobKind::kOptimizer);
    if (loom_instance_import_state(opt, blob.data(), blob.size()) != LOOM_OK) {
      throw CheckpointError(ofile + ": the optimizer refused its state: " + loom_last_error());
    }
    comm.grad_bytes_sent = st.grad_bytes_sent;
    comm.grad_bytes_received = st.grad_bytes_received;
    comm.grad_rounds = st.grad_rounds;
    // Metrics past the checkpoint are recomputed: drop them.
    if (root && fs::exists(metrics_path)) {
      std::ifstream in(metrics_path);
      std::string line, kept;
      while (std::getline(in, line)) {
        auto j = nlohmann::json::parse(line, nullptr, false);
        if (!j.is_discarded() && j.value("step", int64_t{0}) <= st.step) kept += line + "\n";
      }
      write_file_atomic(metrics_path.string(), kept.data(), kept.size());
    }
    if (root)
      std::cerr << "loom train: resumed from " << dir.string() << " (step " << st.step << ")\n";
  }
  comm.barrier();

  std::ofstream metrics;
  if (root) {
    metrics.open(metrics_path, std::ios::app);
    if (!metrics) throw TrainError(metrics_path.string() + ": cannot open for writing");
  }
  auto comm_info = [&] {
    loom_optimizer_comm_info ci{};
    ci.struct_size = LOOM_OPTIMIZER_COMM_INFO_SIZE;
    check_loom(loom_optimizer_get_comm_info(opt, &ci), "optimizer comm_info");
    return ci;
  };

  double loss_acc = st.loss_acc;  // see TrainerState
  int64_t acc_steps = st.acc_steps;
  auto save_checkpoint = [&](int64_t step) {
    const fs::path tmp = ckpt_root / (step_dir_name(step) + ".tmp");
    const fs::path dir = ckpt_root / step_dir_name(step);
    if (root) {
      fs::remove_all(tmp, ec);
      fs::create_directories(tmp, ec);
      if (ec) throw CheckpointError(tmp.string() + ": cannot create: " + ec.message());
    }
    comm.barrier();
    const std::string rs = "rank" + std::to_string(rank);
    save_safetensors((tmp / ("model." + rs + ".safetensors")).string(), params,
                     {{"step", std::to_string(step)}});
    size_t n = 0;
    check_loom(loom_instance_export_state(opt, nullptr, 0, &n), "optimizer export_state");
    std::vector<uint8_t> blob(n);
    check_loom(loom_instance_export_state(opt, blob.data(), blob.size(), &n),
               "optimizer export_state");
    blob.resize(n);
    save_blob((tmp / ("optimizer." + rs + ".bin")).string(), BlobKind::kOptimizer, blob);
    TrainerState s = st;
    s.step = step;
    s.grad_bytes_sent = comm.grad_bytes_sent;
    s.grad_bytes_received = comm.grad_bytes_received;
    s.grad_rounds = comm.grad_rounds;
    s.loss_acc = loss_acc;
    s.acc_steps = acc_steps;
    save_blob((tmp / ("trainer." + rs + ".bin")).string(), BlobKind::kTrainer, encode(s));
    comm.barrier();
    if (root) {
      fs::remove_all(dir, ec);
      fs::rename(tmp, dir, ec);
      if (ec) throw CheckpointError(dir.string() + ": cannot rename into place: " + ec.message());
      const std::string name = step_dir_name(step) + "\n";
      write_file_atomic(latest_file.string(), name.data(), name.size());
      // Keep the last two checkpoints.
      std::vector<fs::path> old;
      for (const auto& e : fs::directory_iterator(ckpt_root, ec)) {
        const auto f = e.path().filename().string();
        if (e.is_directory() && f.rfind("step_", 0) == 0 && f.find(".tmp") == std::string::npos &&
            f < step_dir_name(step))
          old.push_back(e.path());
      }
      std::sort(old.begin(), old.end());
      for (size_t i = 0; i + 1 < old.size(); ++i) fs::remove_all(old[i], ec);
    }
    comm.barrier();
  };

  // Eval: the first eval_batches * batch_size windows of seq_len + 1 heldout tokens (fewer
  // when the split is small); window w goes to rank w % world.
  std::vector<int32_t> x, y;
  auto evaluate = [&]() {
    const auto h = ds.heldout();
    const size_t windows = std::min<size_t>(static_cast<size_t>(c.eval_batches) * c.batch_size,
                                            (h.size() - 1) / c.seq_len);
    std::vector<size_t> mine;
    for (size_t w = rank; w < windows; w += world) mine.push_back(w);
    double sum = 0;
    for (size_t b = 0; b < mine.size(); b += local_batch) {
      const int n = static_cast<int>(std::min<size_t>(local_batch, mine.size() - b));
      x.resize(static_cast<size_t>(n) * c.seq_len);
      y.resize(x.size());
      for (int i = 0; i < n; ++i) {
        const size_t off = mine[b + i] * c.seq_len;
        for (int j = 0; j < c.seq_len; ++j) {
          x[static_cast<size_t>(i) * c.seq_len + j] = h[off + j];
          y[static_cast<size_t>(i) * c.seq_len + j] = h[off + j + 1];
        }
      }
      sum += static_cast<double>(model.forward_loss(x.data(), y.data(), n, c.seq_len)) * n;
    }
    const auto tot = comm.sum({sum, static_cast<double>(mine.size())});
    return tot[0] / std::max(1.0, tot[1]);
  };

  // A progress line on a terminal, log lines elsewhere. OpenMPI gives its ranks a pty for
  // stdout whatever mpirun's own output is, so under a launcher it is log lines unless
  // LOOM_PROGRESS=tty asks for the progress line (LOOM_PROGRESS=lines forces log lines).
  const char* progress = std::getenv("LOOM_PROGRESS");
  const bool launched =
      std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_RANK") || std::getenv("PMIX_RANK");
  bool tty = root && ::isatty(STDOUT_FILENO) && !launched;
  if (progress && std::string(progress) == "tty") tty = root;
  if (progress && std::string(progress) == "lines") tty = false;
  const double per_step_uncompressed =
      world > 1 ? 2.0 * (world - 1) / world * 4.0 * static_cast<double>(numel) : 0.0;
  if (root) {
    std::cout << "loom train: " << numel << " parameters, " << world << " rank(s), optimizer '"
              << loom_instance_plugin(opt) << "', " << c.steps << " steps of " << c.batch_size
              << " x " << c.seq_len << " tokens; run dir " << run_dir.string() << std::endl;
    std::cout << "loom train: CPU " << loom::trainer::cpu_description() << std::endl;
    if (!wpe_mask.empty()) {
      std::cout << "loom train: position rows " << c.seq_len << ".." << c.model.context - 1
                << " are never used (seq_len < context); their momentum is masked" << std::endl;
    }
  }

  using clk = std::chrono::steady_clock;
  auto t_start = clk::now(), t_log = t_start;
  const double elapsed_before = st.elapsed_s;
  int64_t log_from_step = st.step;
  double last_eval = NAN;
  bool stopped = false;
  for (int64_t step = st.step + 1; step <= c.steps; ++step) {
    fill_batch(ds, c, step, rank * local_batch, local_batch, x, y);
    model.zero_grad();
    const float loss = model.forward_backward(x.data(), y.data(), local_batch, c.seq_len);
    if (!std::isfinite(loss)) {
      throw TrainError("step " + std::to_string(step) + ": the loss is " + std::to_string(loss) +
                       " (diverged; lower lr or clip_grad_norm)");
    }
    const bool owns = comm_info().owns_communication != 0;
    if (!owns && world > 1) {
      if (contiguous) {
        comm.average(params[0].grad, numel, true);
      } else {
        size_t o = 0;
        for (auto& p : params) std::memcpy(flat.data() + o, p.grad, 4 * p.numel), o += p.numel;
        comm.average(flat.data(), numel, true);
        o = 0;
        for (auto& p : params) std::memcpy(p.grad, flat.data() + o, 4 * p.numel), o += p.numel;
      }
    }
    // Global-norm clipping: of the averaged gradient when the trainer averages, of the local
    // gradient when the optimizer owns communication (each rank its own coefficient).
    double sq = 0;
    for (auto& p : params)
      for (size_t i = 0; i < p.numel; ++i) sq += static_cast<double>(p.grad[i]) * p.grad[i];
    const double gnorm = std::sqrt(sq);
    if (c.clip_grad_norm > 0 && gnorm > c.clip_grad_norm) {
      const float s = static_cast<float>(c.clip_grad_norm / (gnorm + 1e-6));
      for (auto& p : params)
        for (size_t i = 0; i < p.numel; ++i) p.grad[i] *= s;
    }
    const double lr = lr_at(c, step);
    loom_optimizer_step_args sa{
        LOOM_OPTIMIZER_STEP_ARGS_SIZE, 0, groups.data(), groups.size(), lr, 1.0, step, nullptr};
    check_loom(loom_optimizer_step(opt, &sa), "optimizer step " + std::to_string(step));
    st.tokens_seen += static_cast<uint64_t>(c.batch_size) * c.seq_len;
    st.uncompressed_bytes += static_cast<uint64_t>(per_step_uncompressed);
    loss_acc += loss;
    ++acc_steps;

    const bool last = step == c.steps;
    const bool do_log = step % c.log_interval == 0 || last || step == 1;
    if (do_log) {
      const auto tot = comm.sum({loss_acc, static_cast<double>(acc_steps)});
      const double mean_loss = tot[0] / tot[1];
      const auto now = clk::now();
      const double dt = std::chrono::duration<double>(now - t_log).count();
      const double tps =
          static_cast<double>(step - log_from_step) * c.batch_size * c.seq_len / std::max(dt, 1e-9);
      const auto ci = comm_info();
      const uint64_t sent = comm.grad_bytes_sent + ci.bytes_sent;
      const uint64_t rounds = comm.grad_rounds + ci.rounds;
      const double elapsed = elapsed_before + std::chrono::duration<double>(now - t_start).count();
      if (root) {
        nlohmann::json j = {{"type", "train"},
                            {"step", step},
                            {"loss", mean_loss},
                            {"lr", lr},
                            {"grad_norm", gnorm},
                            {"tokens_per_s", tps},
                            {"tokens", st.tokens_seen},
                            {"comm_bytes_sent", sent},
                            {"comm_bytes_received", comm.grad_bytes_received + ci.bytes_received},
                            {"comm_rounds", rounds},
                            {"uncompressed_bytes", st.uncompressed_bytes},
                            {"owns_communication", owns},
                            {"elapsed_s", elapsed}};
        metrics << j.dump() << "\n" << std::flush;
        const double eta = (elapsed - elapsed_before) / static_cast<double>(step - st.step) *
                           static_cast<double>(c.steps - step);
        char line[256];
        std::snprintf(line, sizeof(line),
                      "step %lld/%lld  loss %.4f  lr %.2e  %.0f tok/s  sent %s  ETA %s",
                      static_cast<long long>(step), static_cast<long long>(c.steps), mean_loss, lr,
                      tps, human_bytes(static_cast<double>(sent)).c_str(), human_time(eta).c_str());
        if (tty)
          std::cout << "\r" << line << "\033[K" << std::flush;
        else
          std::cout << line << std::endl;
      }
      loss_acc = 0;
      acc_steps = 0;
      log_from_step = step;
      t_log = clk::now();
    }
    if ((c.eval_interval > 0 && step % c.eval_interval == 0) || last) {
      last_eval = evaluate();
      if (root) {
        nlohmann::json j = {{"type", "eval"},
                            {"step", step},
                            {"eval_loss", last_eval},
                            {"eval_ppl", std::exp(last_eval)}};
        metrics << j.dump() << "\n" << std::flush;
        if (tty) std::cout << "\n";
        std::printf("eval step %lld: loss %.4f, perplexity %.2f\n", static_cast<long long>(step),
                    last_eval, std::exp(last_eval));
        std::fflush(stdout);
      }
    }
    st.elapsed_s = elapsed_before + std::chrono::duration<double>(clk::now() - t_start).count();
    if ((c.checkpoint_interval > 0 && step % c.checkpoint_interval == 0) || last) {
      save_checkpoint(step);
    }
    if (c.stop_after > 0 && step == c.stop_after && !last) {
      stopped = true;
      break;
    }
  }
  if (stopped) {
    if (root) std::cout << "\nloom train: stopped after step " << c.stop_after << " (stop_after)\n";
    return 0;
  }
  if (std::isnan(last_eval)) last_eval = evaluate();  // resumed at the end: report again

  const auto ci = comm_info();
  const uint64_t sent = comm.grad_bytes_sent + ci.bytes_sent;
  const uint64_t rounds = comm.grad_rounds + ci.rounds;
  if (root) {
    nlohmann::json summary = {{"final_eval_loss", last_eval},
                              {"final_eval_ppl", std::exp(last_eval)},
                              {"steps", c.steps},
                              {"ranks", world},
                              {"optimizer", loom_instance_plugin(opt)},
                              {"parameters", numel},
                              {"comm_bytes_sent", sent},
                              {"comm_rounds", rounds},
                              {"uncompressed_bytes", st.uncompressed_bytes},
                              {"elapsed_s", st.elapsed_s}};
    const std::string s = summary.dump(2) + "\n";
    write_file_atomic((run_dir / "summary.json").string(), s.data(), s.size());
    if (tty) std::cout << "\n";
    std::printf("final eval loss: %.4f (perplexity %.2f)\n", last_eval, std::exp(last_eval));
    if (world > 1) {
      std::printf(
          "bytes sent by rank 0 for gradient sync: %s in %llu rounds; uncompressed Adam "
          "would have sent %s (%.2fx)\n",
          human_bytes(static_cast<double>(sent)).c_str(), static_cast<unsigned long long>(rounds),
          human_bytes(static_cast<double>(st.uncompressed_bytes)).c_str(),
          sent > 0 ? static_cast<double>(st.uncompressed_bytes) / static_cast<double>(sent) : 0.0);
    } else {
      std::printf("bytes sent: 0 (one rank; nothing to average)\n");
    }
    std::printf("metrics: %s\n", metrics_path.string().c_str());
    std::fflush(stdout);
    if (!c.plot.empty()) {
      const fs::path self = fs::canonical("/proc/self/exe", ec);
      const fs::path plotter = self.parent_path() / "loom-plot";
      const std::string cmd =
          "'" + plotter.string() + "' '" + run_dir.string() + "' -o '" + c.plot + "'";
      if (std::system(cmd.c_str()) == 0) {
        std::printf("plot: %s\n", c.plot.c_str());
      } else {
        std::printf("plot: not written (loom-plot failed; see above)\n");
      }
    }
  }
  comm.barrier();
  return 0;
}

// --check (what `loom check CONFIG` runs): every problem of the config, of the manifest it
// names (as `loom check MANIFEST` reports them) and of the dataset, without training. 0 or 2.
int check(const Args& args) {
  TrainConfig c;
  std::vector<std::string> problems;
  try {
    c = read_config(args.config, problems);
  } catch (const ConfigError& e) {
    for (const auto& line : e.errors()) std::cerr << line << "\n";
    return 2;
  }
  for (const auto& line : problems) std::cerr << line << "\n";
  bool ok = problems.empty();
  if (c.manifest.empty()) return 2;  // [manifest] path missing: said above
  loom_open_options opts{};
  opts.struct_size = LOOM_OPEN_OPTIONS_SIZE;
  opts.validate_only = 1;
  opts.log_level = LOOM_LOG_WARN;
  opts.plugin_path = args.plugin_path.empty() ? nullptr : args.plugin_path.c_str();
  loom_session* session = nullptr;
  if (loom_open_file(c.manifest.c_str(), &opts, &session) != LOOM_OK) {
    std::cerr << loom_last_error() << "\n";
    ok = false;
  } else {
    loom_close(session);
    for (const auto& problem : manifest_name_problems(c)) {
      std::cerr << problem << "\n";
      ok = false;
    }
  }
  if (problems.empty()) {  // the dataset checks need a sound config
    try {
      Dataset ds(c.dataset);
      fit_to_dataset(c, ds);
    } catch (const std::exception& e) {
      std::cerr << e.what() << "\n";
      ok = false;
    }
  }
  if (!ok) return 2;
  std::cout << args.config << ": ok (trainer config; manifest " << c.manifest << ", dataset "
            << c.dataset << ")\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  loom::trainer::install_crash_report("loom train");
  CLI::App app{"Train a model with the reference trainer (docs/trainer.md)"};
  loom_cli::configure(app, "loom train");
  Args a;
  app.add_option("CONFIG", a.config, "Trainer config (TOML) naming a Loom manifest")
      ->required()
      ->type_name("FILE");
  auto* resume =
      app.add_flag("--resume", a.resume, "Continue from the run directory's last checkpoint");
  app.add_flag("--fresh", a.fresh, "Start over, deleting the run directory's checkpoints")
      ->excludes(resume);
  app.add_option("--steps", a.steps, "Override [train] steps (0: the config's)")
      ->check(loom_cli::integer_in(0, int64_t{1} << 40))
      ->type_name("N");
  app.add_option("--stop-after", a.stop_after, "Exit after this step (for tests; -1: never)")
      ->check(loom_cli::integer_in(-1, int64_t{1} << 40))
      ->type_name("STEP");
  app.add_option("--run-dir", a.run_dir, "Override [train] run_dir")->type_name("DIR");
  app.add_flag("--no-plot", a.no_plot, "Do not draw the plot at the end");
  app.add_flag("--check", a.check,
               "Validate the config, its manifest and dataset, and exit (what loom check does)");
  app.add_option("--plugin-path", a.plugin_path,
                 "Extra plugin folders (':'-separated), searched after the manifest's")
      ->type_name("DIRS");
  if (const int rc = loom_cli::parse(app, argc, argv, true); rc >= 0) return rc;
  if (a.check) return check(a);
  try {
    return run(a);
  } catch (const ConfigError& e) {
    std::cout << std::flush;
    for (const auto& line : e.errors()) std::cerr << "loom train: error: " << line << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cout << std::flush;
    std::cerr << "loom train: error: " << e.what() << std::endl;
    return 2;
  }
}
