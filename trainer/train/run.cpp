// The helpers run.hpp declares.
#include "run.hpp"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace loom::trainer {

int g_job_ranks = 0;

int launcher_ranks() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "WORLD_SIZE"}) {
    const char* s = std::getenv(v);
    if (s != nullptr && std::atoi(s) > 1) return std::atoi(s);
  }
  return 1;
}

void check_loom(int32_t rc, const std::string& what) {
  if (rc != LOOM_OK) throw TrainError(what + ": " + loom_last_error());
}

loom_optimizer_comm_info optimizer_comm_info(loom_instance* opt) {
  loom_optimizer_comm_info ci{};
  ci.struct_size = LOOM_OPTIMIZER_COMM_INFO_SIZE;
  check_loom(loom_optimizer_get_comm_info(opt, &ci), "optimizer comm_info");
  return ci;
}

std::vector<uint8_t> export_instance_state(loom_instance* inst, const std::string& what) {
  size_t m = 0;
  check_loom(loom_instance_export_state(inst, nullptr, 0, &m), what + " export_state");
  std::vector<uint8_t> state(m);
  check_loom(loom_instance_export_state(inst, state.data(), state.size(), &m),
             what + " export_state");
  state.resize(m);
  return state;
}

namespace {

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

}  // namespace

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

}  // namespace loom::trainer
