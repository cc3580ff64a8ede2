// loom-train (run as `loom train CONFIG.toml [--resume] [--fresh] [--steps N] [--run-dir DIR]`):
// the reference trainer's loop. Data parallel over the ranks mpirun starts, through the Loom
// manifest's comm instance; optimizer from the manifest; warmup + cosine/linear decay;
// global-norm clipping; eval at intervals; exact checkpoints; metrics JSONL; a plot at the end.
// docs/trainer.md describes the files and the numbers it prints.
#include <loom/embed.h>
#include <loom/kinds/curriculum.h>
#include <loom/kinds/moe.h>
#include <loom/kinds/router.h>
#include <loom/kinds/sampler.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iostream>
#include <limits>
#include <loom_cli_support.hpp>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "batch.hpp"
#include "checkpoint.hpp"
#include "config.hpp"
#include "crash_report.hpp"
#include "dataset.hpp"
#include "model.hpp"
#include "moe_layer.hpp"
#include "quantization.hpp"
#include "trainer_state.hpp"

namespace fs = std::filesystem;
using namespace loom::trainer;

namespace {

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
// a job of more than one rank with loom_abort_job, so no rank waits on a failed peer.
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

// ---------------------------------------------------------------- curriculum

// The config's [curriculum] instances, called through libloom's checked tables: a sampler
// that names each step's samples, and a sequence-length schedule that gives each step's
// length. Problems name the config key (FILE:LINE:COL) and the instance.
struct Curriculum {
  loom_instance* sampler = nullptr;
  void* sampler_obj = nullptr;
  const loom_sampler_v1* sampler_vt = nullptr;
  loom_instance* seqlen = nullptr;
  void* seqlen_obj = nullptr;
  const loom_curriculum_v1* seqlen_vt = nullptr;
  SeqLenCut cut = SeqLenCut::kTruncate;
  std::string sampler_who, seqlen_who;  // "FILE:LINE:COL: [curriculum] sampler 'NAME'"
  std::vector<int64_t> ids;             // this rank's sample ids of the step
  int64_t ids_shape[1] = {0};
  DLTensor ids_t{};

  // ids_t points into ids and ids_shape: not copied or moved.
  Curriculum() = default;
  Curriculum(const Curriculum&) = delete;
  Curriculum& operator=(const Curriculum&) = delete;

  // The status a call through a table returned: "" for success, else its message.
  static std::string failure(loom_instance* inst, loom_status* st) {
    char msg[1024] = {0};
    if (loom_instance_take_status(inst, st, msg, sizeof(msg)) == LOOM_OK) return {};
    return msg[0] != '\0' ? std::string(msg) : std::string(loom_last_error());
  }

  // Finds the instances, checks their kind and role, and plans them: the sampler for
  // `samples` sample ids (the dataset's fixed windows of seq_len + 1), batch_size per step
  // over `world` ranks. Appends each problem to `problems`.
  // A curriculum_sampler's index must have been written for this dataset (its payload
  // checksum, `dataset_checksum`) and this seq_len.
  void open(loom_session* session, const TrainConfig& c, uint64_t samples,
            uint64_t dataset_checksum, int world, std::vector<std::string>& problems) {
    if (!c.seqlen.empty()) open_seqlen(session, c, problems);
    if (!c.sampler.empty()) open_sampler(session, c, samples, dataset_checksum, world, problems);
  }

  // The warnings of the schedule: one whose length at a very late step (2^40, the largest
  // `steps`) is below seq_len never trains at the full length. The schedule's state is put
  // back after the probe (`at` need not be pure). Empty when it reaches seq_len.
  std::vector<std::string> warnings(const TrainConfig& c) {
    std::vector<std::string> out;
    if (seqlen == nullptr) return out;
    size_t n = 0;
    if (loom_instance_export_state(seqlen, nullptr, 0, &n) != LOOM_OK) return out;
    std::vector<uint8_t> state(n);
    if (loom_instance_export_state(seqlen, state.data(), state.size(), &n) != LOOM_OK) return out;
    state.resize(n);
    loom_curriculum_at_args a{};
    a.struct_size = LOOM_CURRICULUM_AT_ARGS_SIZE;
    a.step = int64_t{1} << 40;
    const std::string e = failure(seqlen, seqlen_vt->at(seqlen_obj, &a));
    if (loom_instance_import_state(seqlen, state.data(), state.size()) != LOOM_OK) {
      throw TrainError(seqlen_who +
                       ": the schedule refused its own state back: " + loom_last_error());
    }
    if (e.empty() && a.seq_len >= 1 && a.seq_len < c.seq_len) {
      out.push_back(seqlen_who + ": warning: the schedule's longest length is " +
                    std::to_string(a.seq_len) + " (at step 2^40), below [train] seq_len " +
                    std::to_string(c.seq_len) +
                    ": the run never trains at the full length (raise its max_difficulty to " +
                    std::to_string(c.seq_len) + ")");
    }
    return out;
  }

  void open_seqlen(loom_session* session, const TrainConfig& c,
                   std::vector<std::string>& problems) {
    seqlen_who = c.seqlen_at + ": [curriculum] seqlen '" + c.seqlen + "'";
    loom_instance* inst = nullptr;
    if (loom_find_instance(session, "curriculum", c.seqlen.c_str(), &inst) != LOOM_OK) {
      problems.push_back(seqlen_who + ": " + loom_last_error());
      return;
    }
    void* obj = nullptr;
    const void* table = nullptr;
    if (loom_instance_table(inst, LOOM_KIND_CURRICULUM, LOOM_CURRICULUM_V1_MIN_SIZE, &obj,
                            &table) != LOOM_OK) {
      problems.push_back(seqlen_who + ": " + loom_last_error());
      return;
    }
    const auto* vt = static_cast<const loom_curriculum_v1*>(table);
    loom_curriculum_plan_args plan{};
    plan.struct_size = LOOM_CURRICULUM_PLAN_ARGS_SIZE;
    plan.vocab_size = static_cast<uint32_t>(std::max(0, c.model.vocab_size));
    const std::string plugin = loom_instance_plugin(inst);
    if (vt->plan == nullptr) {
      problems.push_back(seqlen_who + ": plugin '" + plugin + "' has no plan");
      return;
    }
    if (const std::string e = failure(inst, vt->plan(obj, &plan)); !e.empty()) {
      problems.push_back(seqlen_who + ": plan: " + e);
      return;
    }
    if ((plan.roles & LOOM_CURRICULUM_SCHEDULE) == 0 || vt->at == nullptr) {
      problems.push_back(
          seqlen_who + ": plugin '" + plugin +
          "' is a difficulty metric, not a schedule (its plan gives no schedule role); name a "
          "sequence-length schedule such as seqlen_warmup");
      return;
    }
    if (plan.seq_len_mode != LOOM_SEQ_LEN_TRUNCATE && plan.seq_len_mode != LOOM_SEQ_LEN_RESHAPE) {
      problems.push_back(seqlen_who + ": plugin '" + plugin +
                         "' schedules a difficulty, not a sequence length (its seq_len_mode is " +
                         (plan.seq_len_mode == LOOM_SEQ_LEN_NONE
                              ? std::string("NONE")
                              : std::to_string(plan.seq_len_mode)) +
                         "); name a sequence-length schedule such as seqlen_warmup");
      return;
    }
    seqlen = inst;
    seqlen_obj = obj;
    seqlen_vt = vt;
    cut = plan.seq_len_mode == LOOM_SEQ_LEN_RESHAPE ? SeqLenCut::kReshape : SeqLenCut::kTruncate;
  }

  void open_sampler(loom_session* session, const TrainConfig& c, uint64_t samples,
                    uint64_t dataset_checksum, int world, std::vector<std::string>& problems) {
    sampler_who = c.sampler_at + ": [curriculum] sampler '" + c.sampler + "'";
    loom_instance* inst = nullptr;
    if (loom_find_instance(session, "sampler", c.sampler.c_str(), &inst) != LOOM_OK) {
      problems.push_back(sampler_who + ": " + loom_last_error());
      return;
    }
    void* obj = nullptr;
    const void* table = nullptr;
    if (loom_instance_table(inst, LOOM_KIND_SAMPLER, LOOM_SAMPLER_V1_MIN_SIZE, &obj, &table) !=
        LOOM_OK) {
      problems.push_back(sampler_who + ": " + loom_last_error());
      return;
    }
    const auto* vt = static_cast<const loom_sampler_v1*>(table);
    if (vt->plan == nullptr || vt->next == nullptr) {
      problems.push_back(sampler_who + ": plugin '" + loom_instance_plugin(inst) +
                         "' lacks plan or next");
      return;
    }
    // The index's dataset and sample length, before the plan (which compares only N).
    if (const std::string e = sampler_index_problem(c, dataset_checksum); !e.empty()) {
      problems.push_back(sampler_who + ": " + e);
      return;
    }
    loom_sampler_plan_args plan{};
    plan.struct_size = LOOM_SAMPLER_PLAN_ARGS_SIZE;
    plan.dataset_size = samples;
    plan.global_batch = c.batch_size;
    plan.world_size = world;
    if (const std::string e = failure(inst, vt->plan(obj, &plan)); !e.empty()) {
      problems.push_back(sampler_who + ": plan for the " + std::to_string(samples) +
                         " samples of " + c.dataset + " at seq_len " + std::to_string(c.seq_len) +
                         ", " + std::to_string(c.batch_size) + " per step over " +
                         std::to_string(world) + " rank(s): " + e +
                         " (the index must come from loom data analyze on this dataset with "
                         "this seq_len)");
      return;
    }
    const int64_t local = world > 0 ? c.batch_size / world : c.batch_size;
    if (plan.capacity < local) {
      problems.push_back(sampler_who + ": plan gives a capacity of " +
                         std::to_string(plan.capacity) + " ids, fewer than the " +
                         std::to_string(local) + " of a rank's batch");
      return;
    }
    sampler = inst;
    sampler_obj = obj;
    sampler_vt = vt;
    ids.assign(static_cast<size_t>(plan.capacity), 0);
    ids_shape[0] = plan.capacity;
    ids_t = DLTensor{};
    ids_t.data = ids.data();
    ids_t.device = {kDLCPU, 0};
    ids_t.ndim = 1;
    ids_t.dtype = {kDLInt, 64, 1};
    ids_t.shape = ids_shape;
  }

  // This rank's sample ids of `step` (ids[0, count)) and the sampler's difficulty.
  double next(int64_t step, uint64_t seed, int rank, int world, int64_t expect) {
    loom_sampler_next_args a{};
    a.struct_size = LOOM_SAMPLER_NEXT_ARGS_SIZE;
    a.seed = seed;
    a.step = step;
    a.rank = rank;
    a.world_size = world;
    a.indices = &ids_t;
    if (const std::string e = failure(sampler, sampler_vt->next(sampler_obj, &a)); !e.empty()) {
      throw TrainError(sampler_who + ": next (step " + std::to_string(step) + "): " + e);
    }
    if (a.count != expect) {
      throw TrainError(sampler_who + ": next (step " + std::to_string(step) + ") gave " +
                       std::to_string(a.count) + " sample ids for rank " + std::to_string(rank) +
                       ", not its share of " + std::to_string(expect));
    }
    return a.difficulty;
  }

  // The schedule's seq_len of `step` (before the trainer's rounding).
  int64_t at(int64_t step) {
    loom_curriculum_at_args a{};
    a.struct_size = LOOM_CURRICULUM_AT_ARGS_SIZE;
    a.step = step;
    if (const std::string e = failure(seqlen, seqlen_vt->at(seqlen_obj, &a)); !e.empty()) {
      throw TrainError(seqlen_who + ": at (step " + std::to_string(step) + "): " + e);
    }
    if (a.seq_len < 1) {
      throw TrainError(seqlen_who + ": at (step " + std::to_string(step) + ") gave seq_len " +
                       std::to_string(a.seq_len) + " (a sequence-length schedule gives >= 1)");
    }
    return a.seq_len;
  }
};

// ---------------------------------------------------------------- routing

// 256-byte aligned scratch that grows on demand (a router's saved and workspace buffers).
class AlignedBytes {
 public:
  void* get(uint64_t n) {
    if (n == 0) return nullptr;
    if (n > size_) {
      const uint64_t r = (n + 255) / 256 * 256;
      void* q = std::aligned_alloc(256, r);
      if (q == nullptr) throw TrainError("out of memory for " + std::to_string(r) + " bytes");
      p_.reset(q);
      size_ = r;
    }
    return p_.get();
  }

 private:
  struct Free {
    void operator()(void* q) const { std::free(q); }
  };
  std::unique_ptr<void, Free> p_;
  uint64_t size_ = 0;
};

// A CPU DLTensor over the model's buffers, with its own shape.
struct Tensor {
  int64_t shape[3] = {0, 0, 0};
  DLTensor t{};
  Tensor(const void* data, std::initializer_list<int64_t> dims, DLDataType dtype) {
    int i = 0;
    for (const int64_t d : dims) shape[i++] = d;
    t.data = const_cast<void*>(data);
    t.device = {kDLCPU, 0};
    t.ndim = i;
    t.dtype = dtype;
    t.shape = shape;
  }
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  DLTensor* get() { return &t; }
};

constexpr DLDataType kF32{kDLFloat, 32, 1};
constexpr DLDataType kI32{kDLInt, 32, 1};

// The [routing] router instance as the model's router hook (router_hook.hpp): every call
// through libloom's checked table, on fp32 host tensors over the model's buffers. The plan of
// each (batch, seq_len, layer, training) is asked once per step; each layer keeps its own
// saved buffer (select -> backward), the workspace is shared. A layer holds a router weight
// when the router is learned and routes it at the run's seq_len (step 1, training).
class PluginRouter final : public RouterHook {
 public:
  PluginRouter(loom_instance* inst, std::string who, uint64_t seed, int seq_len, int channels)
      : inst_(inst), who_(std::move(who)), seed_(seed), seq_len_(seq_len), channels_(channels) {
    void* obj = nullptr;
    const void* table = nullptr;
    if (loom_instance_table(inst, LOOM_KIND_ROUTER, LOOM_ROUTER_V1_MIN_SIZE, &obj, &table) !=
        LOOM_OK) {
      throw ConfigError(who_ + ": " + loom_last_error());
    }
    obj_ = obj;
    vt_ = static_cast<const loom_router_v1*>(table);
    if (vt_->plan == nullptr || vt_->select == nullptr || vt_->gather == nullptr ||
        vt_->scatter == nullptr || vt_->advance == nullptr) {
      throw ConfigError(who_ + ": plugin '" + loom_instance_plugin(inst) +
                        "' lacks plan, select, gather, scatter or advance");
    }
  }

  // The step the next forwards belong to (plans are asked again for a new step), and this
  // rank's offset in the step's global batch.
  void set_step(int64_t step, int64_t first_sample) {
    if (step != step_) plans_.clear();
    step_ = step;
    first_sample_ = first_sample;
  }

  bool has_weight(int layer, int num_layers) override {
    const loom_router_plan_args p = ask_plan(layer, num_layers, 1, seq_len_, 1, 1);
    if ((p.flags & LOOM_ROUTER_LEARNED) != 0 && vt_->backward == nullptr) {
      throw ConfigError(who_ + ": plugin '" + loom_instance_plugin(inst_) +
                        "' says it is learned but has no backward");
    }
    const bool w = (p.flags & LOOM_ROUTER_LEARNED) != 0 && (p.flags & LOOM_ROUTER_ROUTED) != 0;
    if (static_cast<size_t>(layer) >= weights_.size()) {
      weights_.resize(static_cast<size_t>(layer) + 1, -1);
    }
    weights_[static_cast<size_t>(layer)] = w ? 1 : 0;
    return w;
  }

  RoutePlan plan(int layer, int num_layers, int batch, int seq, bool training) override {
    if (static_cast<size_t>(layer) >= current_.size()) {
      current_.resize(static_cast<size_t>(num_layers));
      saved_.resize(static_cast<size_t>(num_layers));
      weights_.resize(std::max(weights_.size(), static_cast<size_t>(num_layers)), -1);
    }
    const Key key{batch, seq, layer, training};
    auto it =
        std::find_if(plans_.begin(), plans_.end(), [&](const auto& e) { return e.first == key; });
    if (it == plans_.end()) {
      plans_.emplace_back(key, ask_plan(layer, num_layers, batch, seq, step_, training));
      it = plans_.end() - 1;
    }
    const loom_router_plan_args& p = it->second;
    current_[static_cast<size_t>(layer)] = p;
    int8_t& w = weights_[static_cast<size_t>(layer)];
    if (w < 0) w = has_weight(layer, num_layers) ? 1 : 0;
    if ((p.flags & LOOM_ROUTER_LEARNED) != 0 && (p.flags & LOOM_ROUTER_ROUTED) != 0 && w == 0) {
      // A learned router needs the layer's weight to select; the weights were fixed at the
      // start, from the plan of step 1 at the run's seq_len.
      throw TrainError(who_ + ": plan (step " + std::to_string(std::max<int64_t>(1, step_)) +
                       ", layer " + std::to_string(layer) + ", seq_len " + std::to_string(seq) +
                       (training ? "" : ", evaluation") +
                       ") routes a layer that holds no router weight: the trainer gives a "
                       "learned router's layer its weight h." +
                       std::to_string(layer) +
                       ".router.w only when the plan of step 1 at the run's seq_len " +
                       std::to_string(seq_len_) +
                       " (training) routes it, and that plan kept every position of this "
                       "layer (a learned router must route the same layers at every step and "
                       "length)");
    }
    RoutePlan r;
    r.kept = static_cast<int>(p.kept);
    r.routed = (p.flags & LOOM_ROUTER_ROUTED) != 0;
    r.gated = (p.flags & LOOM_ROUTER_LEARNED) != 0 && w == 1;
    return r;
  }

  void select(int layer, int num_layers, int batch, int seq, int channels, bool training,
              const float* x, const float* weight, int32_t* indices, float* gates) override {
    const loom_router_plan_args& p = current_[static_cast<size_t>(layer)];
    Tensor xt(x, {batch, seq, channels}, kF32);
    Tensor wt(weight, {channels}, kF32);
    Tensor it(indices, {batch, p.kept}, kI32);
    Tensor gt(gates, {batch, p.kept}, kF32);
    loom_router_select_args a{};
    a.struct_size = LOOM_ROUTER_SELECT_ARGS_SIZE;
    a.seed = seed_;
    a.step = step_;
    a.batch = batch;
    a.seq_len = seq;
    a.channels = channels;
    a.first_sample = first_sample_;
    a.layer = layer;
    a.num_layers = num_layers;
    a.training = training ? 1u : 0u;
    a.x = xt.get();
    a.weight = weight != nullptr ? wt.get() : nullptr;
    a.indices = it.get();
    a.gates = gates != nullptr ? gt.get() : nullptr;
    a.saved = saved_[static_cast<size_t>(layer)].get(p.saved_bytes);
    a.saved_bytes = p.saved_bytes;
    a.workspace = workspace_.get(p.workspace_bytes);
    a.workspace_bytes = p.workspace_bytes;
    check(vt_->select(obj_, &a), "select", layer, step_);
  }

  void gather(int layer, const float* full, float* kept, const int32_t* indices, int batch, int seq,
              int kept_count, int channels) override {
    move(vt_->gather, "gather", layer, full, kept, indices, batch, seq, kept_count, channels);
  }
  void scatter(int layer, float* full, const float* kept, const int32_t* indices, int batch,
               int seq, int kept_count, int channels) override {
    move(vt_->scatter, "scatter", layer, full, kept, indices, batch, seq, kept_count, channels);
  }

  void backward(int layer, int, int batch, int seq, int channels, const float* x,
                const float* weight, const int32_t* indices, const float* dgates, float* dx,
                float* dweight) override {
    const loom_router_plan_args& p = current_[static_cast<size_t>(layer)];
    Tensor xt(x, {batch, seq, channels}, kF32);
    Tensor wt(weight, {channels}, kF32);
    Tensor it(indices, {batch, p.kept}, kI32);
    Tensor dgt(dgates, {batch, p.kept}, kF32);
    Tensor dxt(dx, {batch, seq, channels}, kF32);
    Tensor dwt(dweight, {channels}, kF32);
    loom_router_backward_args a{};
    a.struct_size = LOOM_ROUTER_BACKWARD_ARGS_SIZE;
    a.batch = batch;
    a.seq_len = seq;
    a.channels = channels;
    a.x = xt.get();
    a.weight = wt.get();
    a.indices = it.get();
    a.dgates = dgt.get();
    a.dx = dxt.get();
    a.dweight = dwt.get();
    a.saved = saved_[static_cast<size_t>(layer)].get(p.saved_bytes);
    a.saved_bytes = p.saved_bytes;
    a.workspace = workspace_.get(p.workspace_bytes);
    a.workspace_bytes = p.workspace_bytes;
    check(vt_->backward(obj_, &a), "backward", layer, step_);
  }

  // The step's accounting after its optimizer step: batch = the step's sequences over all
  // ranks. Returns the router's out arguments.
  loom_router_advance_args advance(int64_t step, int64_t batch, int64_t seq_len, int num_layers) {
    loom_router_advance_args a{};
    a.struct_size = LOOM_ROUTER_ADVANCE_ARGS_SIZE;
    a.step = step;
    a.batch = batch;
    a.seq_len = seq_len;
    a.num_layers = num_layers;
    char msg[1024] = {0};
    if (loom_instance_take_status(inst_, vt_->advance(obj_, &a), msg, sizeof(msg)) != LOOM_OK) {
      throw TrainError(who_ + ": advance (step " + std::to_string(step) +
                       "): " + (msg[0] != '\0' ? std::string(msg) : loom_last_error()));
    }
    return a;
  }

 private:
  using Key = std::tuple<int, int, int, bool>;

  loom_router_plan_args ask_plan(int layer, int num_layers, int batch, int seq, int64_t step,
                                 bool training) {
    loom_router_plan_args p{};
    p.struct_size = LOOM_ROUTER_PLAN_ARGS_SIZE;
    p.batch = batch;
    p.seq_len = seq;
    p.channels = channels_;
    p.step = std::max<int64_t>(1, step);
    p.layer = layer;
    p.num_layers = num_layers;
    p.training = training ? 1u : 0u;
    p.dtype = kF32;
    check(vt_->plan(obj_, &p), "plan", layer, p.step);
    if (p.kept < 1 || p.kept > seq) {
      throw TrainError(who_ + ": plan (step " + std::to_string(p.step) + ", layer " +
                       std::to_string(layer) + ") kept " + std::to_string(p.kept) + " of " +
                       std::to_string(seq) + " positions (1 .. seq_len)");
    }
    return p;
  }

  using MoveFn = loom_status* (*)(void*, const loom_router_move_args*);
  void move(MoveFn fn, const char* what, int layer, const float* full, const float* kept,
            const int32_t* indices, int batch, int seq, int kept_count, int channels) {
    Tensor ft(full, {batch, seq, channels}, kF32);
    Tensor kt(kept, {batch, kept_count, channels}, kF32);
    Tensor it(indices, {batch, kept_count}, kI32);
    loom_router_move_args a{};
    a.struct_size = LOOM_ROUTER_MOVE_ARGS_SIZE;
    a.full = ft.get();
    a.kept = kt.get();
    a.indices = it.get();
    check(fn(obj_, &a), what, layer, step_);
  }

  void check(loom_status* st, const char* what, int layer, int64_t step) {
    if (st == nullptr) return;
    char msg[1024] = {0};
    if (loom_instance_take_status(inst_, st, msg, sizeof(msg)) == LOOM_OK) return;
    throw TrainError(who_ + ": " + what + " (step " + std::to_string(step) +
                     (layer >= 0 ? ", layer " + std::to_string(layer) : std::string()) +
                     "): " + (msg[0] != '\0' ? std::string(msg) : loom_last_error()));
  }

  loom_instance* inst_;
  void* obj_ = nullptr;
  const loom_router_v1* vt_ = nullptr;
  std::string who_;
  uint64_t seed_;
  int seq_len_, channels_;
  int64_t step_ = 0, first_sample_ = 0;
  std::vector<std::pair<Key, loom_router_plan_args>> plans_;  // this step's
  std::vector<loom_router_plan_args> current_;                // per layer: the last plan
  std::vector<AlignedBytes> saved_;
  std::vector<int8_t> weights_;  // per layer: -1 not asked yet, 0/1
  AlignedBytes workspace_;
};

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
  bool eval_only = false;
  std::string weights;  // --weights (with --eval-only)
  std::string plugin_path;
};

// One training run. setup() reads the config and the dataset, opens the Loom session, builds
// the model and the optimizer's groups, and resumes or starts over; then every step is
// train_step() (forward, backward, gradient sync, clipping, optimizer step), log_step() at
// log intervals, eval_step() at eval intervals and save_checkpoint() at checkpoint
// intervals; finish() reports the final eval and writes the summary and the plot.
class Trainer {
 public:
  explicit Trainer(const Args& args) : args_(args) {}

  int run() {
    if (!args_.eval_only && !load_config(args_.config).checkpoint.empty()) {
      const TrainConfig c = load_config(args_.config);
      throw ConfigError(c.checkpoint_at +
                        ": [quantization] checkpoint: a quantized file is evaluated, not trained: "
                        "run loom train with --eval-only");
    }
    setup();
    if (args_.eval_only) return eval_only();
    if (quant_ && c_.lkd_steps > 0 && st_.step == 0) distill_layers();
    for (int64_t step = st_.step + 1; step <= c_.steps && !tokens_done(); ++step) {
      const auto step_start = clk::now();
      const StepResult r = train_step(step);
      train_step_s_ += std::chrono::duration<double>(clk::now() - step_start).count();
      last_step_ = step;
      // The last step: `steps`, or the one that reaches train_tokens.
      const bool last = step == c_.steps || tokens_done();
      if (step % c_.log_interval == 0 || last || step == 1) log_step(step, r);
      if ((c_.eval_interval > 0 && step % c_.eval_interval == 0) || last) eval_step(step);
      st_.elapsed_s =
          elapsed_before_ + std::chrono::duration<double>(clk::now() - t_start_).count();
      if ((c_.checkpoint_interval > 0 && step % c_.checkpoint_interval == 0) || last) {
        save_checkpoint(step);
      }
      if (c_.stop_after > 0 && step == c_.stop_after && !last) {
        if (root_) {
          std::cout << "\nloom train: stopped after step " << c_.stop_after << " (stop_after)\n";
        }
        return 0;
      }
    }
    finish();
    return 0;
  }

 private:
  using clk = std::chrono::steady_clock;

  // Runs `work` here, then learns every rank's outcome (one allgather): when any rank failed,
  // every rank throws AgreedError with that rank's message, so a local failure (a full disk,
  // an unreadable file) ends every rank at once rather than leaving the others to wait out
  // the comm's timeout in the next collective.
  template <class Work>
  void on_every_rank(Work&& work) {
    std::string error;
    try {
      work();
    } catch (const ConfigError& e) {
      for (const auto& line : e.errors()) error += (error.empty() ? "" : "\n") + line;
    } catch (const std::exception& e) {
      error = *e.what() != '\0' ? e.what() : "failed";
    }
    const auto all = comm_.gather_text(error);
    for (size_t r = 0; r < all.size(); ++r) {
      if (all[r].empty()) continue;
      throw AgreedError(static_cast<int>(r) == rank_ || all.size() == 1
                            ? all[r]
                            : "rank " + std::to_string(r) + ": " + all[r]);
    }
  }

  bool tokens_done() const {
    return (c_.train_tokens > 0 && st_.tokens_seen >= static_cast<uint64_t>(c_.train_tokens)) ||
           (c_.train_layer_tokens > 0 &&
            st_.layer_tokens >= static_cast<uint64_t>(c_.train_layer_tokens));
  }

  // What one step measured, for its log line.
  struct StepResult {
    float loss = 0;
    double gnorm = 0;
    double lr = 0;
    bool owns = false;          // the optimizer did the gradient communication itself
    bool skipped = false;       // the optimizer skipped the step: a gradient was NaN or Inf
    int seq_len = 0;            // the step's sequence length (seq_len, or the schedule's, cut)
    double difficulty = NAN;    // the sampler's difficulty of the step's batch
    uint64_t layer_tokens = 0;  // the step's, all ranks
    std::vector<int> kept;      // positions per sequence each layer processed
    double aux = 0;             // [moe] aux_loss_coef x the sum of the MoE layers' aux losses
    std::optional<DistillationTerms> kd;  // [quantization] kd: the loss's terms
  };

  // ---- setup

  void setup() {
    loom::trainer::apply_simd_cap("loom train");
    configure();
    ds_.emplace(c_.dataset);
    fit_to_dataset(c_, *ds_);
    open_loom();
    open_curriculum();
    // 0: the pool's own default (LOOM_NUM_THREADS, else the cores over this machine's ranks).
    set_num_threads(c_.threads);
    model_.emplace(c_.model, c_.seed);
    open_router();
    open_moe();
    open_quantization();
    numel_ = model_->num_parameters();
    build_groups();
    if (args_.eval_only) {
      eval_weights();
      return;
    }
    resume_or_start();
    open_metrics();
    choose_progress();
    print_banner();
    t_start_ = clk::now();
    t_log_ = t_start_;
    elapsed_before_ = st_.elapsed_s;
    log_from_step_ = st_.step;
    log_tokens_ = st_.tokens_seen;
    start_tokens_ = st_.tokens_seen;
    start_layer_tokens_ = st_.layer_tokens;
    last_step_ = st_.step;
  }

  // The config, with the command line's overrides.
  void configure() {
    c_ = load_config(args_.config);
    if (args_.steps > 0) c_.steps = args_.steps;
    if (args_.stop_after >= 0) c_.stop_after = args_.stop_after;
    if (!args_.run_dir.empty()) {
      c_.run_dir = fs::absolute(args_.run_dir).lexically_normal().string();
      if (c_.plot == (fs::path(load_config(args_.config).run_dir) / "loss.png").string()) {
        c_.plot = (fs::path(c_.run_dir) / "loss.png").string();
      }
    }
    if (args_.no_plot) c_.plot.clear();
    // --weights: the fp32 weights [quantization] quantizes, or (without a quantizer) a file
    // evaluated as it is, quantized by loom quantize or plain.
    if (!args_.weights.empty()) {
      if (!args_.eval_only) throw ConfigError("--weights is for --eval-only");
      const std::string w = fs::absolute(args_.weights).lexically_normal().string();
      if (!c_.quantizer.empty()) {
        c_.weights = w;
        c_.weights_at = "--weights";
      } else {
        c_.checkpoint = w;
        c_.checkpoint_at = "--weights";
      }
    }
    // The plot is drawn at the end: a folder that is not there should fail now, not then.
    const fs::path plot_dir = fs::path(c_.plot).parent_path();
    std::error_code plot_ec;
    if (!c_.plot.empty() && plot_dir != fs::path(c_.run_dir) &&
        !fs::is_directory(plot_dir, plot_ec)) {
      throw ConfigError(c_.config_path + ": [train] plot: the folder " + plot_dir.string() +
                        " does not exist (create it first, or use plot = \"auto\")");
    }
  }

  // Loom: the manifest's instances, and this rank's place in the comm's world.
  void open_loom() {
    loom_open_options opts{};
    opts.struct_size = LOOM_OPEN_OPTIONS_SIZE;
    opts.log_level = -1;
    opts.plugin_path = args_.plugin_path.empty() ? nullptr : args_.plugin_path.c_str();
    loom_session* session = nullptr;
    if (loom_open_file(c_.manifest.c_str(), &opts, &session) != LOOM_OK) {
      throw TrainError("loom manifest: " + with_run_values(loom_last_error(), c_));
    }
    loom::trainer::install_crash_report("loom train");  // again: UCX and MPI installed theirs
    session_.reset(session);
    check_loom(loom_find_instance(session, "optimizer", c_.optimizer.c_str(), &opt_),
               c_.manifest + ": optimizer '" + c_.optimizer + "'");
    if (!c_.comm.empty()) {
      loom_instance* ci = nullptr;
      check_loom(loom_find_instance(session, "comm", c_.comm.c_str(), &ci),
                 c_.manifest + ": comm '" + c_.comm + "'");
      comm_.obj = loom_instance_object(ci);
      comm_.vt = static_cast<const loom_comm_v1*>(loom_instance_vtable(ci));
      comm_.rank = comm_.vt->rank(comm_.obj);
      comm_.size = comm_.vt->size(comm_.obj);
    }
    rank_ = comm_.rank;
    world_ = comm_.size;
    root_ = rank_ == 0;
    g_job_ranks = world_;
    if (c_.batch_size % world_ != 0) {
      throw ConfigError(c_.config_path + ": [train] batch_size " + std::to_string(c_.batch_size) +
                        " is not divisible by the " + std::to_string(world_) + " ranks");
    }
    local_batch_ = c_.batch_size / world_;
  }

  // The [curriculum] instances: found, checked and planned (the sampler over the dataset's
  // fixed samples, before a resume imports its position).
  void open_curriculum() {
    samples_ = sample_count(ds_->train().size(), c_.seq_len);
    std::vector<std::string> problems;
    cur_.open(session_.get(), c_, samples_, ds_->header().payload_checksum, world_, problems);
    if (!problems.empty()) throw ConfigError(problems);
    // Valid but likely unintended settings: one line each on stderr, rank 0.
    std::vector<std::string> warnings = config_warnings(c_);
    for (auto& w : cur_.warnings(c_)) warnings.push_back(std::move(w));
    if (root_) {
      for (const auto& w : warnings) std::cerr << "loom train: " << w << "\n";
    }
  }

  // The [routing] router: found, checked for kind, installed as the model's router hook
  // (which adds the learned router weights to the parameters).
  void open_router() {
    if (c_.router.empty()) return;
    router_who_ = c_.router_at + ": [routing] router '" + c_.router + "'";
    if (loom_find_instance(session_.get(), "router", c_.router.c_str(), &router_inst_) != LOOM_OK) {
      throw ConfigError(router_who_ + ": " + loom_last_error());
    }
    auto hook = std::make_unique<PluginRouter>(router_inst_, router_who_, c_.seed, c_.seq_len,
                                               c_.model.dim);
    router_ = hook.get();
    model_->set_router(std::move(hook));
    for (const auto& p : model_->parameters()) {
      if (p.name.size() > 9 && p.name.compare(p.name.size() - 9, 9, ".router.w") == 0) {
        router_weights_ += (router_weights_.empty() ? "" : ", ") + p.name;
      }
    }
  }

  // The [moe] layers: each listed block's MLP becomes a MoeLayer over the instance (which
  // plans it and makes its weights, parameters of the model from then on).
  void open_moe() {
    if (c_.moe.empty()) return;
    moe_who_ = c_.moe_at + ": [moe] instance '" + c_.moe + "'";
    if (loom_find_instance(session_.get(), "moe", c_.moe.c_str(), &moe_inst_) != LOOM_OK) {
      throw ConfigError(moe_who_ + ": " + loom_last_error());
    }
    for (size_t i = 0; i < c_.moe_layers.size(); ++i) {
      MoeLayerOptions o;
      o.who = moe_who_;
      o.layer = c_.moe_layers[i];
      o.num_layers = c_.model.layers;
      o.dim = c_.model.dim;
      o.hidden = c_.moe_hidden > 0 ? c_.moe_hidden : 4 * c_.model.dim;
      o.experts = c_.moe_experts[i];
      o.tokens = static_cast<int64_t>(local_batch_) * c_.seq_len;
      o.seed = c_.seed;
      o.aux_loss_coef = c_.moe_aux_loss_coef;
      auto layer = std::make_unique<MoeLayer>(moe_inst_, o);
      if (i == 0) moe_ep_ = layer->plan().ep_size;
      if (layer->plan().ep_size != moe_ep_) {
        throw ConfigError(moe_who_ + ": layer " + std::to_string(o.layer) + " planned ep_size " +
                          std::to_string(layer->plan().ep_size) + ", another " +
                          std::to_string(moe_ep_));
      }
      for (const auto& n : layer->expert_parameter_names()) expert_names_.push_back(n);
      moe_.push_back(layer.get());
      model_->replace_mlp(o.layer, std::move(layer));
    }
    if (moe_ep_ > 1 && comm_info().owns_communication != 0) {
      throw ConfigError(moe_who_ + ": ep_size " + std::to_string(moe_ep_) +
                        " shards the experts over the ranks, but the optimizer '" +
                        loom_instance_plugin(opt_) +
                        "' averages every gradient over all ranks itself, which would mix "
                        "different experts; use an optimizer the trainer averages for (adam, "
                        "lamb), or ep_size = 1");
    }
    if (moe_ep_ > 1) {
      const std::string comm = moe_instance_comm(c_);
      if (comm != c_.comm) {
        throw ConfigError(moe_who_ + ": ep_size " + std::to_string(moe_ep_) +
                          " exchanges tokens over its comm " +
                          (comm.empty() ? std::string("(none)") : "'" + comm + "'") +
                          ", but the trainer's ranks are [manifest] comm '" + c_.comm +
                          "': give the instance comm = \"" + c_.comm + "\"");
      }
    }
    if (moe_ep_ > 1 && world_ % moe_ep_ != 0) {
      throw ConfigError(moe_who_ + ": ep_size " + std::to_string(moe_ep_) +
                        " does not divide the " + std::to_string(world_) + " ranks");
    }
  }

  bool is_expert_param(const std::string& name) const {
    return std::find(expert_names_.begin(), expert_names_.end(), name) != expert_names_.end();
  }

  // [quantization]: the quantizer instance, the tensors it takes, the fp32 weights the model
  // starts from and the teacher.
  void open_quantization() {
    if (c_.quantizer.empty()) return;
    quant_who_ = c_.quantizer_at + ": [quantization] quantizer '" + c_.quantizer + "'";
    loom_instance* qi = nullptr;
    if (loom_find_instance(session_.get(), "quantizer", c_.quantizer.c_str(), &qi) != LOOM_OK) {
      throw ConfigError(quant_who_ + ": " + loom_last_error());
    }
    quant_ = plugin_quantizer(qi, quant_who_);
    quant_plugin_ = loom_instance_plugin(qi);
    quant_names_ = quantized_tensor_names(c_);
    if (!c_.weights.empty()) {
      try {
        load_safetensors(c_.weights, model_->parameters());
      } catch (const std::exception& e) {
        throw ConfigError(c_.weights_at + ": [quantization] weights: " + e.what());
      }
    }
    if (!c_.teacher.empty()) {
      teacher_.emplace(c_.model, c_.seed);
      try {
        load_safetensors(c_.teacher, teacher_->parameters());
      } catch (const std::exception& e) {
        throw ConfigError((c_.teacher_at.empty() ? c_.weights_at : c_.teacher_at) +
                          ": [quantization] teacher: " + e.what());
      }
    }
    // Every tensor packs (the quantizer refuses a shape it cannot take, naming it) before
    // anything runs.
    QuantizedEval probe(*model_, *quant_, quant_names_);
  }

  // --eval-only without [quantization] weights: the run directory's latest checkpoint.
  void eval_weights() {
    run_dir_ = c_.run_dir;
    metrics_path_ = run_dir_ / "metrics.jsonl";
    if (!c_.weights.empty() || !c_.checkpoint.empty()) return;
    const fs::path latest = run_dir_ / "checkpoints" / "latest";
    if (!fs::exists(latest)) {
      throw TrainError("--eval-only: no weights to evaluate: " + c_.config_path +
                       " has no [quantization] weights and " + run_dir_.string() +
                       " holds no checkpoint");
    }
    std::string name = read_text(latest);
    while (!name.empty() && std::isspace(static_cast<unsigned char>(name.back()))) name.pop_back();
    load_safetensors(
        (run_dir_ / "checkpoints" / name / ("model.rank" + std::to_string(rank_) + ".safetensors"))
            .string(),
        model_->parameters());
  }

  // A batch for the layer-by-layer distillation: the same rows on every rank (the blocks'
  // weights stay identical across ranks).
  void lkd_batch(int64_t i, std::vector<int32_t>& tokens, int& b, int& t) {
    std::vector<int32_t> targets;
    fill_batch(*ds_, c_, i + 1, 0, local_batch_, tokens, targets);
    b = local_batch_;
    t = c_.seq_len;
  }

  // ZeroQuant's layer-by-layer distillation before training (or before --eval-only).
  void distill_layers() {
    const auto t0 = clk::now();
    const auto res = layerwise_distill(
        *model_, *teacher_, *quant_, quant_names_, c_.lkd_steps, c_.lkd_lr,
        [this](int64_t i, std::vector<int32_t>& tok, int& b, int& t) { lkd_batch(i, tok, b, t); });
    const double secs = std::chrono::duration<double>(clk::now() - t0).count();
    if (!root_) return;
    for (const auto& r : res) {
      std::printf("lkd layer %d: block MSE %.6g -> %.6g (%lld steps)\n", r.layer, r.mse_before,
                  r.mse_after, static_cast<long long>(c_.lkd_steps));
      nlohmann::json j = {{"type", "lkd"},
                          {"step", 0},
                          {"layer", r.layer},
                          {"mse_before", r.mse_before},
                          {"mse_after", r.mse_after},
                          {"lkd_steps", c_.lkd_steps}};
      lkd_log_.push_back(j);
      if (metrics_.is_open()) metrics_.append(j.dump());
    }
    std::printf("lkd: %d blocks in %.1f s\n", c_.model.layers, secs);
    std::fflush(stdout);
  }

  // --eval-only: the weights evaluated in fp32 and, with [quantization], through the
  // quantizer's matmuls (after LKD when lkd_steps is set); eval.json in the run directory.
  int eval_only() {
    nlohmann::json out = {{"config", c_.config_path}};
    if (!c_.weights.empty()) out["weights"] = c_.weights;
    if (!c_.checkpoint.empty()) return eval_checkpoint(out);
    const double fp32 = evaluate(false);
    out["fp32_eval_loss"] = fp32;
    out["fp32_eval_ppl"] = std::exp(fp32);
    if (root_) std::printf("fp32 eval loss: %.4f (perplexity %.2f)\n", fp32, std::exp(fp32));
    if (quant_) {
      if (c_.lkd_steps > 0) {
        distill_layers();
        // The distilled fp32 weights, for loom quantize.
        if (root_) {
          std::error_code ec;
          fs::create_directories(run_dir_, ec);
          save_safetensors((run_dir_ / "lkd.safetensors").string(), model_->parameters());
          out["lkd_weights"] = (run_dir_ / "lkd.safetensors").string();
          std::printf("lkd weights: %s\n", (run_dir_ / "lkd.safetensors").string().c_str());
        }
      }
      const double q = evaluate(true);
      out["eval_loss"] = q;
      out["eval_ppl"] = std::exp(q);
      out["quantizer"] = c_.quantizer;
      out["plugin"] = quant_plugin_;
      out["quantized_tensors"] = quant_names_;
      out["packed_bytes"] = quant_packed_bytes_;
      out["float_bytes"] = quant_float_bytes_;
      out["quantized_matmuls"] = quant_calls_;
      if (!lkd_log_.empty()) out["lkd"] = lkd_log_;
      if (root_) {
        std::printf("quantized eval loss (%s, %s): %.4f (perplexity %.2f, %+.2f%% vs fp32)\n",
                    c_.quantizer.c_str(), quant_plugin_.c_str(), q, std::exp(q),
                    100.0 * (std::exp(q) / std::exp(fp32) - 1.0));
        std::printf("quantized tensors: %zu, %s packed (%s as float32)\n", quant_names_.size(),
                    human_bytes(static_cast<double>(quant_packed_bytes_)).c_str(),
                    human_bytes(static_cast<double>(quant_float_bytes_)).c_str());
      }
    }
    if (root_) {
      std::error_code ec;
      fs::create_directories(run_dir_, ec);
      const std::string text = out.dump(2) + "\n";
      write_file_atomic((run_dir_ / "eval.json").string(), text.data(), text.size());
      std::printf("eval: %s\n", (run_dir_ / "eval.json").string().c_str());
    }
    comm_.barrier();
    return 0;
  }

  // --eval-only with [quantization] checkpoint: a `loom quantize` file, its quantized
  // tensors through the quantizer instances it names (the manifest's), the rest float; and
  // beside it the same weights decoded, through the float matmuls.
  int eval_checkpoint(nlohmann::json& out) {
    std::vector<std::pair<std::string, std::unique_ptr<WeightQuantizer>>> qs;
    QuantizedCheckpoint ck =
        load_quantized_checkpoint(c_.checkpoint, *model_, session_.get(), qs,
                                  c_.checkpoint_at + ": [quantization] checkpoint");
    out["checkpoint"] = c_.checkpoint;
    out["file_bytes"] = ck.file_bytes;
    out["quantized_tensors"] = ck.names;
    out["quantizers"] = ck.instances;
    const double deq = evaluate(false);
    out["dequantized_eval_loss"] = deq;
    out["dequantized_eval_ppl"] = std::exp(deq);
    double q = 0;
    {
      QuantizedEval qe(*model_, std::move(ck.entries));
      q = evaluate(false);
      out["packed_bytes"] = qe.packed_bytes();
      out["float_bytes"] = qe.float_bytes();
      out["quantized_matmuls"] = qe.matmul_calls();
    }
    out["eval_loss"] = q;
    out["eval_ppl"] = std::exp(q);
    if (root_) {
      std::printf("dequantized weights, float matmuls: eval loss %.4f (perplexity %.2f)\n", deq,
                  std::exp(deq));
      std::printf("quantized matmuls: eval loss %.4f (perplexity %.2f)\n", q, std::exp(q));
      std::printf("%s: %s, %zu quantized tensors\n", c_.checkpoint.c_str(),
                  human_bytes(static_cast<double>(ck.file_bytes)).c_str(), ck.names.size());
      std::error_code ec;
      fs::create_directories(run_dir_, ec);
      const std::string text = out.dump(2) + "\n";
      write_file_atomic((run_dir_ / "eval.json").string(), text.data(), text.size());
      std::printf("eval: %s\n", (run_dir_ / "eval.json").string().c_str());
    }
    comm_.barrier();
    return 0;
  }

  // Optimizer groups: matrices decay (the manifest's weight_decay), vectors do not.
  void build_groups() {
    auto& params = model_->parameters();
    pt_.resize(params.size());
    gt_.resize(params.size());
    // The momentum mask of the position embedding: rows < seq_len are 1, the rest (never
    // used, so their gradient is always 0) are 0. See TrainConfig::mask_unused_positions.
    for (size_t i = 0; i < params.size(); ++i) {
      auto& p = params[i];
      pt_[i] = DLTensor{};
      pt_[i].data = p.value;
      pt_[i].device = {kDLCPU, 0};
      pt_[i].ndim = static_cast<int32_t>(p.shape.size());
      pt_[i].dtype = {kDLFloat, 32, 1};
      pt_[i].shape = p.shape.data();
      gt_[i] = pt_[i];
      gt_[i].data = p.grad;
      const DLTensor* mask = nullptr;
      if (p.name == "wpe" && c_.mask_unused_positions && c_.seq_len < c_.model.context) {
        const auto row = static_cast<size_t>(p.shape[1]);
        wpe_mask_.assign(p.numel, 0.0f);
        std::fill(wpe_mask_.begin(), wpe_mask_.begin() + static_cast<ptrdiff_t>(row * c_.seq_len),
                  1.0f);
        wpe_mask_t_ = pt_[i];
        wpe_mask_t_.data = wpe_mask_.data();
        mask = &wpe_mask_t_;
      }
      const bool expert_bias =
          p.name.size() > 11 && (p.name.compare(p.name.size() - 11, 11, ".experts.b1") == 0 ||
                                 p.name.compare(p.name.size() - 11, 11, ".experts.b2") == 0);
      expert_.push_back(is_expert_param(p.name));
      (p.shape.size() >= 2 && !expert_bias ? decay_ : no_decay_)
          .push_back({LOOM_OPTIMIZER_TENSOR_SIZE, 0, &pt_[i], &gt_[i], nullptr, mask});
    }
    if (!decay_.empty())
      groups_.push_back({LOOM_OPTIMIZER_GROUP_SIZE, 0, decay_.data(), decay_.size(), 1.0, NAN});
    if (!no_decay_.empty()) {
      groups_.push_back(
          {LOOM_OPTIMIZER_GROUP_SIZE, 0, no_decay_.data(), no_decay_.size(), 1.0, 0.0});
    }
    contiguous_ = true;
    for (size_t i = 1; i < params.size(); ++i) {
      contiguous_ &= params[i].grad == params[i - 1].grad + params[i - 1].numel;
    }
    flat_.assign(contiguous_ ? 0 : numel_, 0.0f);
  }

  // Run directory and resume: refuses to start over a run's checkpoints or metrics unless
  // --resume or --fresh.
  void resume_or_start() {
    run_dir_ = c_.run_dir;
    ckpt_root_ = run_dir_ / "checkpoints";
    metrics_path_ = run_dir_ / "metrics.jsonl";
    latest_file_ = ckpt_root_ / "latest";
    st_.seed = c_.seed;
    st_.world = world_;
    on_every_rank([&] {
      std::error_code ec;
      fs::create_directories(ckpt_root_, ec);
      if (ec) throw TrainError(ckpt_root_.string() + ": cannot create: " + ec.message());
    });
    check_shared_run_dir();
    std::string from;  // the checkpoint folder to resume from ("": start at step 1)
    on_every_rank([&] {
      const std::string held = run_contents(ckpt_root_, metrics_path_);
      if (!held.empty() && !args_.resume && !args_.fresh) {
        throw TrainError(run_dir_.string() + " already holds " + held +
                         "; pass --resume to continue or --fresh to start over");
      }
      if (args_.fresh) return;
      bool newest = false;
      from = checkpoint_to_resume(ckpt_root_, &newest);
      if (newest && root_) {
        std::cerr << "loom train: " << latest_file_.string()
                  << " is missing; resuming from the newest complete checkpoint, " << from << "\n";
      }
    });
    if (from.empty()) {
      on_every_rank([&] {
        if (!root_) return;
        std::error_code ec;
        fs::remove_all(ckpt_root_, ec);
        fs::create_directories(ckpt_root_, ec);
        if (ec) throw TrainError(ckpt_root_.string() + ": cannot create: " + ec.message());
        fs::remove(metrics_path_, ec);
        sync_folder(run_dir_.string());
      });
      if (root_ && args_.resume) {
        std::cerr << "loom train: no checkpoint in " << ckpt_root_.string()
                  << " to resume from; starting at step 1\n";
      }
    } else {
      on_every_rank([&] { load_checkpoint(from); });
    }
    loss_acc_ = st_.loss_acc;  // see TrainerState
    acc_steps_ = st_.acc_steps;
  }

  // Every rank reads the checkpoints of its own rank from the run folder, which rank 0
  // manages: a folder that is not shared (node-local disks) would fail later, with a
  // confusing error, or mix runs. Rank 0 writes a token file the others must read back.
  void check_shared_run_dir() {
    if (world_ == 1) return;
    const fs::path probe = ckpt_root_ / ".shared";
    uint64_t token = 0;
    if (root_) {
      token = (static_cast<uint64_t>(std::random_device{}()) << 20 ^
               static_cast<uint64_t>(clk::now().time_since_epoch().count())) &
              ((uint64_t{1} << 52) - 1);  // exact in a double
    }
    on_every_rank([&] {
      if (!root_) return;
      const std::string text = std::to_string(token);
      write_file_atomic(probe.string(), text.data(), text.size());
    });
    token = static_cast<uint64_t>(comm_.sum({static_cast<double>(token)})[0]);
    on_every_rank([&] {
      std::error_code ec;
      if (!fs::exists(probe, ec) || read_text(probe) != std::to_string(token)) {
        throw TrainError(
            "cannot see " + probe.string() +
            ", which rank 0 has just written: checkpoints need a run folder that every rank "
            "shares (a shared file system, mounted at the same path on every host)");
      }
    });
  }

  // Restores the checkpoint in folder `name`: trainer state, model, optimizer state.
  void load_checkpoint(const std::string& name) {
    const fs::path dir = ckpt_root_ / name;
    const int64_t folder_step = checkpoint_step(name);
    if (folder_step < 0 || !fs::is_directory(dir)) {
      throw CheckpointError(latest_file_.string() + ": names '" + name +
                            "', which is not a checkpoint directory");
    }
    const std::string rs = "rank" + std::to_string(rank_);
    const std::string tfile = (dir / ("trainer." + rs + ".bin")).string();
    st_ = decode_trainer_state(load_blob(tfile, BlobKind::kTrainer), tfile);
    if (st_.world != world_) {
      throw CheckpointError(dir.string() + ": written by " + std::to_string(st_.world) +
                            " ranks; resume with the same number of ranks (now " +
                            std::to_string(world_) + ")");
    }
    if (st_.seed != c_.seed) throw CheckpointError(tfile + ": written with another seed");
    // Before LTS5 there was no routing: every layer processed every token.
    if (!st_.has_layer_tokens) {
      st_.layer_tokens = st_.tokens_seen * static_cast<uint64_t>(c_.model.layers);
      st_.warmup_layer_tokens = st_.warmup_tokens * static_cast<uint64_t>(c_.model.layers);
      st_.has_layer_tokens = true;
    }
    TrainerStateLimits limits;
    limits.folder_step = folder_step;
    limits.max_step_tokens = static_cast<uint64_t>(c_.batch_size) * c_.seq_len;
    limits.layers = static_cast<uint64_t>(std::max(1, c_.model.layers));
    check_trainer_state(st_, limits, tfile);
    // The [moe] state first: a config without the layers would otherwise meet their weights.
    const std::string mfile = (dir / ("moe." + rs + ".bin")).string();
    if (!moe_.empty()) {
      if (!fs::exists(mfile)) {
        throw CheckpointError(dir.string() + ": has no moe." + rs +
                              ".bin: it was written by a run without [moe]; resume with the "
                              "config it was written with");
      }
      decode_moe(load_blob(mfile, BlobKind::kMoe), mfile);
    } else if (fs::exists(mfile)) {
      throw CheckpointError(dir.string() +
                            ": was written with [moe] layers, which this config lacks; resume "
                            "with the config it was written with");
    }
    load_safetensors((dir / ("model." + rs + ".safetensors")).string(), model_->parameters());
    const std::string ofile = (dir / ("optimizer." + rs + ".bin")).string();
    const auto blob = load_blob(ofile, BlobKind::kOptimizer);
    if (loom_instance_import_state(opt_, blob.data(), blob.size()) != LOOM_OK) {
      throw CheckpointError(ofile + ": the optimizer refused its state: " + loom_last_error());
    }
    for (const auto& [inst, file] : curriculum_files()) {
      const std::string f = (dir / (file + "." + rs + ".bin")).string();
      if (!fs::exists(f)) {
        throw CheckpointError(dir.string() + ": has no " + file + "." + rs +
                              ".bin: it was written by a run without [curriculum] " + file +
                              "; resume with the config it was written with");
      }
      const auto state = load_blob(f, BlobKind::kCurriculum);
      if (loom_instance_import_state(inst, state.data(), state.size()) != LOOM_OK) {
        throw CheckpointError(f + ": the " + file + " '" + loom_instance_name(inst) +
                              "' refused its state: " + loom_last_error());
      }
    }
    const std::string rfile = (dir / ("router." + rs + ".bin")).string();
    if (router_inst_ != nullptr) {
      if (!fs::exists(rfile)) {
        throw CheckpointError(dir.string() + ": has no router." + rs +
                              ".bin: it was written by a run without [routing]; resume with the "
                              "config it was written with");
      }
      const auto state = load_blob(rfile, BlobKind::kRouter);
      if (loom_instance_import_state(router_inst_, state.data(), state.size()) != LOOM_OK) {
        throw CheckpointError(rfile + ": the router '" + c_.router +
                              "' refused its state: " + loom_last_error());
      }
    } else if (fs::exists(rfile)) {
      throw CheckpointError(dir.string() +
                            ": was written with a [routing] router, which this config lacks; "
                            "resume with the config it was written with");
    }
    for (const char* file : {"sampler", "seqlen"}) {
      const bool used =
          std::string(file) == "sampler" ? cur_.sampler != nullptr : cur_.seqlen != nullptr;
      if (!used && fs::exists(dir / (std::string(file) + "." + rs + ".bin"))) {
        throw CheckpointError(dir.string() + ": was written with a [curriculum] " + file +
                              ", which this config lacks; resume with the config it was "
                              "written with");
      }
    }
    comm_.grad_bytes_sent = st_.grad_bytes_sent;
    comm_.grad_bytes_received = st_.grad_bytes_received;
    comm_.grad_rounds = st_.grad_rounds;
    // Metrics past the checkpoint are recomputed: drop them.
    if (root_ && fs::exists(metrics_path_)) {
      std::ifstream in(metrics_path_);
      std::string line, kept;
      while (std::getline(in, line)) {
        auto j = nlohmann::json::parse(line, nullptr, false);
        if (!j.is_discarded() && j.value("step", int64_t{0}) <= st_.step) kept += line + "\n";
      }
      write_file_atomic(metrics_path_.string(), kept.data(), kept.size());
    }
    if (root_)
      std::cerr << "loom train: resumed from " << dir.string() << " (step " << st_.step << ")\n";
  }

  void open_metrics() {
    if (root_) {
      metrics_.open(metrics_path_.string());
    }
  }

  // A progress line on a terminal, log lines elsewhere. OpenMPI gives its ranks a pty for
  // stdout whatever mpirun's own output is, so under a launcher it is log lines unless
  // LOOM_PROGRESS=tty asks for the progress line (LOOM_PROGRESS=lines forces log lines).
  void choose_progress() {
    const char* progress = std::getenv("LOOM_PROGRESS");
    const bool launched =
        std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_RANK") || std::getenv("PMIX_RANK");
    tty_ = root_ && ::isatty(STDOUT_FILENO) && !launched;
    if (progress && std::string(progress) == "tty") tty_ = root_;
    if (progress && std::string(progress) == "lines") tty_ = false;
    per_step_uncompressed_ =
        world_ > 1 ? 2.0 * (world_ - 1) / world_ * 4.0 * static_cast<double>(numel_) : 0.0;
    choose_nonfinite_injection();
  }

  // LOOM_TRAIN_NONFINITE_GRAD=STEP[:RANK] (a test aid): at global step STEP, rank RANK (the
  // last rank when omitted) puts a NaN into its first gradient element right after the
  // backward pass, so the optimizer's skipped-step path can be exercised end to end.
  void choose_nonfinite_injection() {
    const char* v = std::getenv("LOOM_TRAIN_NONFINITE_GRAD");
    if (v == nullptr || *v == '\0') return;
    const std::string text = v;
    char* end = nullptr;
    const long long step = std::strtoll(text.c_str(), &end, 10);
    bool ok = end != text.c_str();
    long long rank = world_ - 1;
    if (ok && *end == ':') {
      const char* r = end + 1;
      rank = std::strtoll(r, &end, 10);
      ok = end != r;
    }
    ok = ok && *end == '\0';
    if (!ok || step < 1 || rank < 0 || rank >= world_) {
      throw TrainError("LOOM_TRAIN_NONFINITE_GRAD='" + text +
                       "': expected STEP or STEP:RANK with STEP >= 1 and RANK in 0.." +
                       std::to_string(world_ - 1));
    }
    inject_step_ = step;
    inject_rank_ = static_cast<int>(rank);
  }

  void print_banner() const {
    if (!root_) return;
    std::cout << "loom train: " << numel_ << " parameters, " << world_ << " rank(s), optimizer '"
              << loom_instance_plugin(opt_) << "', " << c_.steps << " steps of " << c_.batch_size
              << " x " << c_.seq_len << " tokens; run dir " << run_dir_.string() << std::endl;
    std::cout << "loom train: CPU " << loom::trainer::cpu_description() << std::endl;
    if (cur_.sampler != nullptr) {
      std::cout << "loom train: batches from sampler '" << c_.sampler << "' ("
                << loom_instance_plugin(cur_.sampler) << ") over the " << samples_ << " samples of "
                << c_.seq_len + 1 << " tokens" << std::endl;
    }
    if (router_ != nullptr) {
      std::cout << "loom train: token routing by '" << c_.router << "' ("
                << loom_instance_plugin(router_inst_) << ")"
                << (router_weights_.empty() ? std::string()
                                            : "; learned weights " + router_weights_)
                << std::endl;
    }
    if (!moe_.empty()) {
      std::cout << "loom train: MoE layers by '" << c_.moe << "' ("
                << loom_instance_plugin(moe_inst_) << "):";
      for (size_t i = 0; i < moe_.size(); ++i) {
        const loom_moe_plan_args& p = moe_[i]->plan();
        std::cout << (i ? ", " : " ") << c_.moe_layers[i] << " (" << p.experts << " experts, top-"
                  << p.top_k << (moe_[i]->residual() ? ", residual" : "") << ")";
      }
      std::cout << "; expert hidden " << (c_.moe_hidden > 0 ? c_.moe_hidden : 4 * c_.model.dim)
                << ", aux_loss_coef " << c_.moe_aux_loss_coef
                << (moe_ep_ > 1 ? ", ep_size " + std::to_string(moe_ep_) : std::string())
                << std::endl;
    }
    if (cur_.seqlen != nullptr) {
      std::cout << "loom train: sequence length from '" << c_.seqlen << "' ("
                << loom_instance_plugin(cur_.seqlen) << ", "
                << (cur_.cut == SeqLenCut::kReshape ? "reshape" : "truncate")
                << "), a multiple of 8 up to " << c_.seq_len << std::endl;
    }
    if (c_.train_tokens > 0) {
      std::cout << "loom train: stops at " << c_.train_tokens << " tokens (or step " << c_.steps
                << ")" << std::endl;
    }
    if (c_.train_layer_tokens > 0) {
      std::cout << "loom train: stops at " << c_.train_layer_tokens << " layer tokens (or step "
                << c_.steps << ")" << std::endl;
    }
    if (!wpe_mask_.empty()) {
      std::cout << "loom train: position rows " << c_.seq_len << ".." << c_.model.context - 1
                << " are never used (seq_len < context); their momentum is masked" << std::endl;
    }
  }

  // ---- one step

  loom_optimizer_comm_info comm_info() {
    loom_optimizer_comm_info ci{};
    ci.struct_size = LOOM_OPTIMIZER_COMM_INFO_SIZE;
    check_loom(loom_optimizer_get_comm_info(opt_, &ci), "optimizer comm_info");
    return ci;
  }

  StepResult train_step(int64_t step) {
    auto& params = model_->parameters();
    StepResult r;
    if (cur_.sampler != nullptr) {
      const auto sampler_start = clk::now();
      r.difficulty = cur_.next(step, c_.seed, rank_, world_, local_batch_);
      sampler_s_ += std::chrono::duration<double>(clk::now() - sampler_start).count();
      fill_samples(ds_->train(), c_.seq_len,
                   std::span<const int64_t>(cur_.ids.data(), static_cast<size_t>(local_batch_)), x_,
                   y_);
    } else {
      fill_batch(*ds_, c_, step, rank_ * local_batch_, local_batch_, x_, y_);
    }
    // Sequence-length warmup: the step's length L, and the batch cut to it.
    r.seq_len = cur_.seqlen != nullptr ? step_seq_len(cur_.at(step), c_.seq_len) : c_.seq_len;
    int rows = local_batch_;
    const int32_t* bx = x_.data();
    const int32_t* by = y_.data();
    if (r.seq_len < c_.seq_len) {
      rows =
          cut_batch(cur_.cut, x_.data(), y_.data(), local_batch_, c_.seq_len, r.seq_len, cx_, cy_);
      bx = cx_.data();
      by = cy_.data();
    }
    // Every rank has the same rows; the step's tokens over all ranks.
    const uint64_t step_tokens = static_cast<uint64_t>(rows) * world_ * r.seq_len;
    // The router sees the step and this rank's first row in the step's global batch.
    if (router_ != nullptr) router_->set_step(step, static_cast<int64_t>(rank_) * rows);
    for (MoeLayer* m : moe_) m->set_step(step, static_cast<int64_t>(rank_) * rows * r.seq_len);
    model_->zero_grad();
    if (quant_ && (c_.qat || c_.kd)) {
      // Quantization-aware: the forward and backward see dequantize(quantize(W)), the
      // gradient lands on the float weights (straight-through). kd without qat: the same
      // distillation in float (a QAT run's control).
      Distillation d;
      if (c_.kd) {
        tlogits_.resize(static_cast<size_t>(rows) * r.seq_len * c_.model.vocab_size);
        teacher_->forward_logits(bx, rows, r.seq_len, tlogits_.data());
        d.teacher_logits = tlogits_.data();
        d.logit_weight = c_.kd_weight;
        for (int l = 0; l < c_.model.layers; ++l)
          d.teacher_hidden.push_back(teacher_->layer_output(l));
        d.hidden_weight = c_.hidden_weight;
        model_->set_distillation(&d);
      }
      {
        std::optional<FakeQuantScope> fq;
        if (c_.qat) fq.emplace(*model_, *quant_, quant_names_);
        r.loss = model_->forward_backward(bx, by, rows, r.seq_len);
      }
      model_->set_distillation(nullptr);
      if (c_.kd) r.kd = model_->distillation_terms();
    } else {
      r.loss = model_->forward_backward(bx, by, rows, r.seq_len);
    }
    r.kept = model_->kept();
    for (const MoeLayer* m : moe_) r.aux += c_.moe_aux_loss_coef * m->aux_loss();
    r.layer_tokens = static_cast<uint64_t>(model_->layer_tokens()) * world_;
    if (step == inject_step_ && rank_ == inject_rank_ && !params.empty() && params[0].numel > 0) {
      params[0].grad[0] = std::numeric_limits<float>::quiet_NaN();
    }
    if (!std::isfinite(r.loss)) {
      throw TrainError("step " + std::to_string(step) + ": the loss is " + std::to_string(r.loss) +
                       " (diverged; lower lr or clip_grad_norm)");
    }
    r.owns = comm_info().owns_communication != 0;
    if (!r.owns && world_ > 1 && moe_ep_ > 1) {
      // Expert parallelism: the experts' gradients by the instance (over the
      // expert-data-parallel group), the rest by the world average. Without it every rank
      // holds every expert and the world average is theirs too (the instance's
      // reduce_gradients averages over its own comm, which it then need not have).
      size_t o = 0;
      for (size_t i = 0; i < params.size(); ++i) {
        if (expert_[i]) continue;
        std::memcpy(flat_.data() + o, params[i].grad, 4 * params[i].numel);
        o += params[i].numel;
      }
      comm_.average(flat_.data(), o, true);
      o = 0;
      for (size_t i = 0; i < params.size(); ++i) {
        if (expert_[i]) continue;
        std::memcpy(params[i].grad, flat_.data() + o, 4 * params[i].numel);
        o += params[i].numel;
      }
      for (MoeLayer* m : moe_) m->reduce_gradients();
    } else if (!r.owns && world_ > 1) {
      if (contiguous_) {
        comm_.average(params[0].grad, numel_, true);
      } else {
        size_t o = 0;
        for (auto& p : params) std::memcpy(flat_.data() + o, p.grad, 4 * p.numel), o += p.numel;
        comm_.average(flat_.data(), numel_, true);
        o = 0;
        for (auto& p : params) std::memcpy(p.grad, flat_.data() + o, 4 * p.numel), o += p.numel;
      }
    }
    // Global-norm clipping: of the averaged gradient when the trainer averages, of the local
    // gradient when the optimizer owns communication (each rank its own coefficient).
    // With expert parallelism each rank holds only its experts: their squares are summed over
    // the world (each expert set held by world / ep_size ranks), so every rank clips by the
    // same norm.
    double sq = 0, sq_expert = 0;
    for (size_t j = 0; j < params.size(); ++j) {
      const auto& p = params[j];
      double s = 0;
      for (size_t i = 0; i < p.numel; ++i) s += static_cast<double>(p.grad[i]) * p.grad[i];
      (!expert_.empty() && expert_[j] ? sq_expert : sq) += s;
    }
    if (moe_ep_ > 1) {
      sq_expert = comm_.sum({sq_expert})[0] / static_cast<double>(world_ / moe_ep_);
    }
    sq += sq_expert;
    r.gnorm = std::sqrt(sq);
    if (c_.clip_grad_norm > 0 && r.gnorm > c_.clip_grad_norm) {
      const float s = static_cast<float>(c_.clip_grad_norm / (r.gnorm + 1e-6));
      for (auto& p : params)
        for (size_t i = 0; i < p.numel; ++i) p.grad[i] *= s;
    }
    r.lr = c_.lr_unit == "tokens"
               ? lr_at_tokens(c_, step, st_.tokens_seen + step_tokens, st_.warmup_tokens)
           : c_.lr_unit == "layer_tokens"
               ? lr_at_layer_tokens(c_, step, st_.layer_tokens + r.layer_tokens,
                                    st_.warmup_layer_tokens)
               : lr_at(c_, step);
    // found_inf: the optimizer checks the gradients and skips a step with a NaN or an Inf
    // (every rank skips the same one); parameters and its state stay as they were.
    int32_t found_inf = 0;
    loom_optimizer_step_args sa{
        LOOM_OPTIMIZER_STEP_ARGS_SIZE, 0, groups_.data(), groups_.size(), r.lr, 1.0, step, nullptr};
    sa.found_inf = &found_inf;
    check_loom(loom_optimizer_step(opt_, &sa), "optimizer step " + std::to_string(step));
    if (found_inf != 0) {
      r.skipped = true;
      ++st_.skipped_steps;
      if (root_) {
        if (tty_) std::cout << "\n";
        std::printf(
            "step %lld: skipped by the optimizer (a gradient is NaN or Inf); %llu skipped "
            "so far\n",
            static_cast<long long>(step), static_cast<unsigned long long>(st_.skipped_steps));
        std::fflush(stdout);
      }
    }
    st_.tokens_seen += step_tokens;
    // The router's accounting of the step (every rank; the same numbers on each), which
    // must agree with what the model ran.
    if (router_ != nullptr) {
      const loom_router_advance_args a =
          router_->advance(step, static_cast<int64_t>(rows) * world_, r.seq_len, c_.model.layers);
      if (a.layer_tokens < 0 || static_cast<uint64_t>(a.layer_tokens) != r.layer_tokens ||
          a.consumed_layer_tokens != st_.layer_tokens + r.layer_tokens) {
        throw TrainError(router_who_ + ": advance (step " + std::to_string(step) + ") counted " +
                         std::to_string(a.layer_tokens) + " layer tokens (" +
                         std::to_string(a.consumed_layer_tokens) +
                         " consumed), but the model ran " + std::to_string(r.layer_tokens) + " (" +
                         std::to_string(st_.layer_tokens + r.layer_tokens) + ")");
      }
    }
    st_.layer_tokens += r.layer_tokens;
    if (step == c_.warmup_steps) {
      st_.warmup_tokens = st_.tokens_seen;
      st_.warmup_layer_tokens = st_.layer_tokens;
    }
    st_.uncompressed_bytes += static_cast<uint64_t>(per_step_uncompressed_);
    loss_acc_ += r.loss;
    aux_acc_ += r.aux;
    ++acc_steps_;
    return r;
  }

  // ---- logging

  // The mean loss since the last log line (over the ranks), a metrics record and a line.
  void log_step(int64_t step, const StepResult& r) {
    const auto tot = comm_.sum({loss_acc_, static_cast<double>(acc_steps_), aux_acc_});
    const double mean_loss = tot[0] / tot[1];
    const double mean_aux = tot[2] / tot[1];
    // The MoE layers of this step: aux loss (mean over the ranks), load per expert and dropped
    // choices (summed over the ranks).
    nlohmann::json moe_json = nlohmann::json::array();
    if (!moe_.empty()) {
      std::vector<double> v;
      for (const MoeLayer* m : moe_) {
        v.push_back(m->aux_loss());
        v.push_back(static_cast<double>(m->dropped()));
        for (const int64_t l : m->load()) v.push_back(static_cast<double>(l));
      }
      v = comm_.sum(v);
      size_t o = 0;
      for (size_t i = 0; i < moe_.size(); ++i) {
        nlohmann::json e = {{"layer", c_.moe_layers[i]},
                            {"experts", moe_[i]->experts()},
                            {"aux_loss", v[o] / world_},
                            {"dropped", static_cast<int64_t>(v[o + 1])}};
        std::vector<int64_t> load;
        for (int k = 0; k < moe_[i]->experts(); ++k)
          load.push_back(static_cast<int64_t>(v[o + 2 + static_cast<size_t>(k)]));
        e["load"] = load;
        o += 2 + static_cast<size_t>(moe_[i]->experts());
        moe_json.push_back(std::move(e));
      }
    }
    const auto now = clk::now();
    const double dt = std::chrono::duration<double>(now - t_log_).count();
    const double tps = static_cast<double>(st_.tokens_seen - log_tokens_) / std::max(dt, 1e-9);
    const auto ci = comm_info();
    const uint64_t sent = comm_.grad_bytes_sent + ci.bytes_sent;
    const uint64_t rounds = comm_.grad_rounds + ci.rounds;
    const double elapsed = elapsed_before_ + std::chrono::duration<double>(now - t_start_).count();
    if (root_) {
      nlohmann::json j = {{"type", "train"},
                          {"step", step},
                          {"loss", mean_loss},
                          {"lr", r.lr},
                          {"grad_norm", r.gnorm},
                          {"tokens_per_s", tps},
                          {"tokens", st_.tokens_seen},
                          {"comm_bytes_sent", sent},
                          {"comm_bytes_received", comm_.grad_bytes_received + ci.bytes_received},
                          {"comm_rounds", rounds},
                          {"uncompressed_bytes", st_.uncompressed_bytes},
                          {"owns_communication", r.owns},
                          {"skipped_steps", st_.skipped_steps},
                          {"elapsed_s", elapsed},
                          {"seq_len", r.seq_len},
                          {"layer_tokens", r.layer_tokens},
                          {"consumed_layer_tokens", st_.layer_tokens}};
      if (router_ != nullptr) j["kept"] = r.kept;
      if (!moe_.empty()) {
        j["aux_loss"] = mean_aux;
        j["moe"] = moe_json;
      }
      if (r.kd) {
        j["kd_ce"] = r.kd->ce;
        j["kd_soft_ce"] = r.kd->soft_ce;
        j["kd_hidden_mse"] = r.kd->hidden_mse;
      }
      // The sampler's difficulty (null when it is not a curriculum: NaN).
      if (cur_.sampler != nullptr) {
        j["difficulty"] = std::isfinite(r.difficulty) ? nlohmann::json(r.difficulty) : nullptr;
      }
      metrics_.append(j.dump());
      double eta = (elapsed - elapsed_before_) / static_cast<double>(step - st_.step) *
                   static_cast<double>(c_.steps - step);
      if (c_.train_tokens > 0 && st_.tokens_seen > start_tokens_) {  // the budget may end first
        const double left = static_cast<double>(c_.train_tokens) -
                            static_cast<double>(std::min<uint64_t>(
                                st_.tokens_seen, static_cast<uint64_t>(c_.train_tokens)));
        eta = std::min(eta, (elapsed - elapsed_before_) * left /
                                static_cast<double>(st_.tokens_seen - start_tokens_));
      }
      if (c_.train_layer_tokens > 0 && st_.layer_tokens > start_layer_tokens_) {  // likewise
        const double left = static_cast<double>(c_.train_layer_tokens) -
                            static_cast<double>(std::min<uint64_t>(
                                st_.layer_tokens, static_cast<uint64_t>(c_.train_layer_tokens)));
        eta = std::min(eta, (elapsed - elapsed_before_) * left /
                                static_cast<double>(st_.layer_tokens - start_layer_tokens_));
      }
      char line[256];
      std::snprintf(line, sizeof(line),
                    "step %lld/%lld  loss %.4f  lr %.2e  %.0f tok/s  sent %s  ETA %s",
                    static_cast<long long>(step), static_cast<long long>(c_.steps), mean_loss, r.lr,
                    tps, human_bytes(static_cast<double>(sent)).c_str(), human_time(eta).c_str());
      if (tty_)
        std::cout << "\r" << line << "\033[K" << std::flush;
      else
        std::cout << line << std::endl;
    }
    loss_acc_ = 0;
    aux_acc_ = 0;
    acc_steps_ = 0;
    log_from_step_ = step;
    log_tokens_ = st_.tokens_seen;
    t_log_ = clk::now();
  }

  // Eval: the first eval_batches * batch_size windows of seq_len + 1 heldout tokens (fewer
  // when the split is small); window w goes to rank w % world.
  double evaluate() { return evaluate(quant_ != nullptr); }
  double evaluate(bool quantized) {
    std::optional<QuantizedEval> qe;
    if (quantized) qe.emplace(*model_, *quant_, quant_names_);
    const auto h = ds_->heldout();
    size_t windows = std::min<size_t>(static_cast<size_t>(c_.eval_batches) * c_.batch_size,
                                      (h.size() - 1) / c_.seq_len);
    // Expert parallelism: every rank of a group makes the same forwards (they exchange
    // tokens), so each rank gets the same number of windows.
    if (moe_ep_ > 1 && windows >= static_cast<size_t>(world_)) windows -= windows % world_;
    std::vector<size_t> mine;
    for (size_t w = rank_; w < windows; w += world_) mine.push_back(w);
    double sum = 0;
    // Evaluation forwards pass training = 0 at the last step run (1 before any).
    if (router_ != nullptr) router_->set_step(std::max<int64_t>(1, last_step_), 0);
    for (MoeLayer* m : moe_) m->set_step(std::max<int64_t>(1, last_step_), 0);
    for (size_t b = 0; b < mine.size(); b += local_batch_) {
      const int n = static_cast<int>(std::min<size_t>(local_batch_, mine.size() - b));
      x_.resize(static_cast<size_t>(n) * c_.seq_len);
      y_.resize(x_.size());
      for (int i = 0; i < n; ++i) {
        const size_t off = mine[b + i] * c_.seq_len;
        for (int j = 0; j < c_.seq_len; ++j) {
          x_[static_cast<size_t>(i) * c_.seq_len + j] = h[off + j];
          y_[static_cast<size_t>(i) * c_.seq_len + j] = h[off + j + 1];
        }
      }
      sum += static_cast<double>(model_->forward_loss(x_.data(), y_.data(), n, c_.seq_len)) * n;
    }
    if (qe) {
      quant_packed_bytes_ = qe->packed_bytes();
      quant_float_bytes_ = qe->float_bytes();
      quant_calls_ = qe->matmul_calls();
    }
    const auto tot = comm_.sum({sum, static_cast<double>(mine.size())});
    return tot[0] / std::max(1.0, tot[1]);
  }

  void eval_step(int64_t step) {
    last_eval_ = evaluate();
    if (root_) {
      nlohmann::json j = {{"type", "eval"},
                          {"step", step},
                          {"eval_loss", last_eval_},
                          {"eval_ppl", std::exp(last_eval_)}};
      metrics_.append(j.dump());
      if (tty_) std::cout << "\n";
      std::printf("eval step %lld: loss %.4f, perplexity %.2f\n", static_cast<long long>(step),
                  last_eval_, std::exp(last_eval_));
      std::fflush(stdout);
    }
  }

  // ---- checkpoints

  // step_N.tmp on every rank, renamed into place by rank 0 once all have written; the last
  // two are kept. The optimizer's state is exported once (size query, then the copy from
  // the same serialisation).
  void save_checkpoint(int64_t step) {
    const fs::path tmp = ckpt_root_ / (step_dir_name(step) + ".tmp");
    const fs::path dir = ckpt_root_ / step_dir_name(step);
    on_every_rank([&] {
      if (!root_) return;
      std::error_code ec;
      fs::remove_all(tmp, ec);
      fs::create_directories(tmp, ec);
      if (ec) throw CheckpointError(tmp.string() + ": cannot create: " + ec.message());
    });
    on_every_rank([&] { write_checkpoint_files(tmp, step); });
    // Complete on every rank: rank 0 names it. The folder's entries are synced before the
    // rename and the rename before `latest` names it, so `latest` never names a folder a
    // power loss could empty.
    on_every_rank([&] {
      if (!root_) return;
      std::error_code ec;
      sync_folder(tmp.string());
      fs::remove_all(dir, ec);
      fs::rename(tmp, dir, ec);
      if (ec) throw CheckpointError(dir.string() + ": cannot rename into place: " + ec.message());
      sync_folder(ckpt_root_.string());
      const std::string name = step_dir_name(step) + "\n";
      write_file_atomic(latest_file_.string(), name.data(), name.size());
      // Keep the last two checkpoints.
      std::vector<fs::path> old;
      for (const auto& e : fs::directory_iterator(ckpt_root_, ec)) {
        const auto f = e.path().filename().string();
        if (e.is_directory() && f.rfind("step_", 0) == 0 && f.find(".tmp") == std::string::npos &&
            f < step_dir_name(step))
          old.push_back(e.path());
      }
      std::sort(old.begin(), old.end());
      for (size_t i = 0; i + 1 < old.size(); ++i) fs::remove_all(old[i], ec);
    });
  }

  // This rank's files of the checkpoint of `step`, in the folder `tmp`.
  void write_checkpoint_files(const fs::path& tmp, int64_t step) {
    const std::string rs = "rank" + std::to_string(rank_);
    save_safetensors((tmp / ("model." + rs + ".safetensors")).string(), model_->parameters(),
                     {{"step", std::to_string(step)}});
    size_t n = 0;
    check_loom(loom_instance_export_state(opt_, nullptr, 0, &n), "optimizer export_state");
    std::vector<uint8_t> blob(n);
    check_loom(loom_instance_export_state(opt_, blob.data(), blob.size(), &n),
               "optimizer export_state");
    blob.resize(n);
    save_blob((tmp / ("optimizer." + rs + ".bin")).string(), BlobKind::kOptimizer, blob);
    // The sampler's position and the seqlen schedule's state, so a resume continues
    // mid-epoch and mid-schedule.
    for (const auto& [inst, file] : curriculum_files()) {
      size_t m = 0;
      check_loom(loom_instance_export_state(inst, nullptr, 0, &m), file + " export_state");
      std::vector<uint8_t> state(m);
      check_loom(loom_instance_export_state(inst, state.data(), state.size(), &m),
                 file + " export_state");
      state.resize(m);
      save_blob((tmp / (file + "." + rs + ".bin")).string(), BlobKind::kCurriculum, state);
    }
    if (router_inst_ != nullptr) {
      size_t m = 0;
      check_loom(loom_instance_export_state(router_inst_, nullptr, 0, &m), "router export_state");
      std::vector<uint8_t> state(m);
      check_loom(loom_instance_export_state(router_inst_, state.data(), state.size(), &m),
                 "router export_state");
      state.resize(m);
      save_blob((tmp / ("router." + rs + ".bin")).string(), BlobKind::kRouter, state);
    }
    if (!moe_.empty()) {
      save_blob((tmp / ("moe." + rs + ".bin")).string(), BlobKind::kMoe, encode_moe());
    }
    TrainerState s = st_;
    s.step = step;
    s.grad_bytes_sent = comm_.grad_bytes_sent;
    s.grad_bytes_received = comm_.grad_bytes_received;
    s.grad_rounds = comm_.grad_rounds;
    s.loss_acc = loss_acc_;
    s.acc_steps = acc_steps_;
    save_blob((tmp / ("trainer." + rs + ".bin")).string(), BlobKind::kTrainer,
              encode_trainer_state(s));
  }

  // The [moe] trainer state (trainer_state.hpp has its layout).
  std::vector<uint8_t> encode_moe() {
    MoeState s;
    s.aux_acc = aux_acc_;
    for (size_t i = 0; i < moe_.size(); ++i) {
      s.layers.push_back({c_.moe_layers[i], moe_[i]->experts(), moe_[i]->expert_bias()});
    }
    return encode_moe_state(s);
  }
  // Checks the file's layers against the config's before taking any of it.
  void decode_moe(const std::vector<uint8_t>& b, const std::string& file) {
    const MoeState s = decode_moe_state(b, file);
    if (s.layers.size() != moe_.size()) {
      throw CheckpointError(file + ": holds " + std::to_string(s.layers.size()) +
                            " MoE layers, the config " + std::to_string(moe_.size()) +
                            "; resume with the config it was written with");
    }
    for (size_t i = 0; i < moe_.size(); ++i) {
      const MoeLayerState& l = s.layers[i];
      const std::vector<float>& bias = moe_[i]->expert_bias();
      if (l.layer != c_.moe_layers[i] || l.experts != moe_[i]->experts() ||
          l.bias.size() != bias.size()) {
        throw CheckpointError(
            file + ": MoE layer #" + std::to_string(i) + " is layer " + std::to_string(l.layer) +
            " with " + std::to_string(l.experts) + " experts (" + std::to_string(l.bias.size()) +
            " biases), the config's layer " + std::to_string(c_.moe_layers[i]) + " with " +
            std::to_string(moe_[i]->experts()) + " (" + std::to_string(bias.size()) +
            "); resume with the config it was written with");
      }
    }
    for (size_t i = 0; i < moe_.size(); ++i) moe_[i]->expert_bias() = s.layers[i].bias;
    aux_acc_ = s.aux_acc;
  }

  // The curriculum instances whose state a checkpoint holds, with their file stems.
  std::vector<std::pair<loom_instance*, std::string>> curriculum_files() const {
    std::vector<std::pair<loom_instance*, std::string>> out;
    if (cur_.sampler != nullptr) out.emplace_back(cur_.sampler, "sampler");
    if (cur_.seqlen != nullptr) out.emplace_back(cur_.seqlen, "seqlen");
    return out;
  }

  // ---- the end: final eval, summary.json, the totals and the plot

  void finish() {
    if (std::isnan(last_eval_)) last_eval_ = evaluate();  // resumed at the end: report again
    // [quantization]: the float weights' loss beside the quantized one (every rank).
    const double fp32_eval = quant_ ? evaluate(false) : NAN;
    const auto ci = comm_info();
    const uint64_t sent = comm_.grad_bytes_sent + ci.bytes_sent;
    const uint64_t rounds = comm_.grad_rounds + ci.rounds;
    if (root_) {
      nlohmann::json summary = {{"final_eval_loss", last_eval_},
                                {"final_eval_ppl", std::exp(last_eval_)},
                                {"steps", last_step_},
                                {"tokens", st_.tokens_seen},
                                {"layer_tokens", st_.layer_tokens},
                                {"ranks", world_},
                                {"optimizer", loom_instance_plugin(opt_)},
                                {"parameters", numel_},
                                {"comm_bytes_sent", sent},
                                {"comm_rounds", rounds},
                                {"uncompressed_bytes", st_.uncompressed_bytes},
                                {"skipped_steps", st_.skipped_steps},
                                {"elapsed_s", st_.elapsed_s}};
      if (!moe_.empty()) {
        nlohmann::json layers = nlohmann::json::array();
        for (size_t i = 0; i < moe_.size(); ++i) {
          layers.push_back({{"layer", c_.moe_layers[i]},
                            {"experts", moe_[i]->experts()},
                            {"top_k", moe_[i]->plan().top_k},
                            {"residual", moe_[i]->residual()}});
        }
        summary["moe"] = {
            {"layers", layers}, {"ep_size", moe_ep_}, {"aux_loss_coef", c_.moe_aux_loss_coef}};
      }
      if (quant_) {
        summary["quantizer"] = c_.quantizer;
        summary["quantizer_plugin"] = quant_plugin_;
        summary["quantized_tensors"] = quant_names_;
        summary["qat"] = c_.qat;
        summary["kd"] = c_.kd;
        summary["lkd_steps"] = c_.lkd_steps;
        summary["packed_bytes"] = quant_packed_bytes_;
        summary["float_bytes"] = quant_float_bytes_;
        summary["final_fp32_eval_loss"] = fp32_eval;
      }
      // The sampler's cost beside the steps it fed, timed in this process (rank 0; since
      // the start or the resume): what the sampler adds to a step.
      if (cur_.sampler != nullptr && train_step_s_ > 0) {
        summary["sampler_s"] = sampler_s_;
        summary["train_step_s"] = train_step_s_;
        summary["sampler_share_of_step"] = sampler_s_ / train_step_s_;
      }
      const std::string s = summary.dump(2) + "\n";
      write_file_atomic((run_dir_ / "summary.json").string(), s.data(), s.size());
      if (tty_) std::cout << "\n";
      std::printf("final eval loss: %.4f (perplexity %.2f)\n", last_eval_, std::exp(last_eval_));
      if (st_.skipped_steps > 0) {
        std::printf("steps skipped for a NaN or Inf gradient: %llu\n",
                    static_cast<unsigned long long>(st_.skipped_steps));
      }
      if (world_ > 1) {
        std::printf(
            "bytes sent by rank 0 for gradient sync: %s in %llu rounds; uncompressed Adam "
            "would have sent %s (%.2fx)\n",
            human_bytes(static_cast<double>(sent)).c_str(), static_cast<unsigned long long>(rounds),
            human_bytes(static_cast<double>(st_.uncompressed_bytes)).c_str(),
            sent > 0 ? static_cast<double>(st_.uncompressed_bytes) / static_cast<double>(sent)
                     : 0.0);
      } else {
        std::printf("bytes sent: 0 (one rank; nothing to average)\n");
      }
      std::printf("metrics: %s\n", metrics_path_.string().c_str());
      std::fflush(stdout);
      if (!c_.plot.empty()) {
        std::error_code ec;
        const fs::path self = fs::canonical("/proc/self/exe", ec);
        const fs::path plotter = self.parent_path() / "loom-plot";
        const std::string cmd =
            "'" + plotter.string() + "' '" + run_dir_.string() + "' -o '" + c_.plot + "'";
        if (std::system(cmd.c_str()) == 0) {
          std::printf("plot: %s\n", c_.plot.c_str());
        } else {
          std::printf("plot: not written (loom-plot failed; see above)\n");
        }
      }
    }
    comm_.barrier();
  }

  // Declared in the order they are made, so they are destroyed in reverse: the model and
  // the metrics file before the session, the session before the dataset.
  const Args& args_;
  TrainConfig c_;
  std::optional<Dataset> ds_;
  std::unique_ptr<loom_session, void (*)(loom_session*)> session_{nullptr, loom_close};
  loom_instance* opt_ = nullptr;
  Curriculum cur_;
  std::unique_ptr<WeightQuantizer> quant_;  // [quantization] (nullptr: none)
  std::string quant_who_, quant_plugin_;
  std::vector<std::string> quant_names_;
  std::optional<Model> teacher_;  // the fp32 teacher of LKD and KD
  std::vector<float> tlogits_;
  std::vector<nlohmann::json> lkd_log_;
  uint64_t quant_packed_bytes_ = 0, quant_float_bytes_ = 0;
  int64_t quant_calls_ = 0;
  loom_instance* router_inst_ = nullptr;  // [routing] router (nullptr: none)
  PluginRouter* router_ = nullptr;        // its hook, owned by the model
  std::string router_who_;
  std::string router_weights_;         // the learned router weights' names, for the banner
  loom_instance* moe_inst_ = nullptr;  // [moe] instance (nullptr: a dense model)
  std::vector<MoeLayer*> moe_;         // the MoE layers, owned by the model, as [moe] lists them
  std::string moe_who_;
  int moe_ep_ = 1;                         // the instance's ep_size
  std::vector<std::string> expert_names_;  // the expert parameters (reduce_gradients)
  std::vector<bool> expert_;               // per parameter: an expert parameter
  double aux_acc_ = 0;                     // like loss_acc_, of StepResult::aux
  uint64_t samples_ = 0;  // the dataset's fixed samples at seq_len (what the sampler draws)
  Comm comm_;
  int rank_ = 0, world_ = 1;
  bool root_ = true;
  int local_batch_ = 0;
  std::optional<Model> model_;
  size_t numel_ = 0;

  // The optimizer's view of the parameters (pointers into these vectors and into
  // wpe_mask_t_, so Trainer is neither copied nor moved).
  std::vector<DLTensor> pt_, gt_;
  std::vector<loom_optimizer_tensor> decay_, no_decay_;
  std::vector<float> wpe_mask_;
  DLTensor wpe_mask_t_{};
  std::vector<loom_optimizer_group> groups_;
  bool contiguous_ = true;
  std::vector<float> flat_;  // gradient staging when the gradients are not one block

  fs::path run_dir_, ckpt_root_, metrics_path_, latest_file_;
  TrainerState st_;
  AppendFile metrics_;
  double loss_acc_ = 0;  // see TrainerState
  int64_t acc_steps_ = 0;
  std::vector<int32_t> x_, y_;    // the batch (and eval windows)
  std::vector<int32_t> cx_, cy_;  // the batch cut to a shorter step's length
  bool tty_ = false;
  int64_t inject_step_ = 0;  // LOOM_TRAIN_NONFINITE_GRAD (0: none)
  int inject_rank_ = 0;
  double per_step_uncompressed_ = 0;

  clk::time_point t_start_, t_log_;
  double elapsed_before_ = 0;
  double sampler_s_ = 0;     // time in the sampler's next, this process
  double train_step_s_ = 0;  // time in train_step (sampler included), this process
  int64_t log_from_step_ = 0;
  uint64_t log_tokens_ = 0;          // tokens_seen at the last log line
  uint64_t start_tokens_ = 0;        // tokens_seen when this process started training
  uint64_t start_layer_tokens_ = 0;  // layer_tokens then
  int64_t last_step_ = 0;
  double last_eval_ = NAN;

 public:
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;
};

int run(const Args& args) {
  Trainer trainer(args);
  return trainer.run();
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
  bool manifest_ok = true;
  TrainConfig cc = c;  // the curriculum instances the manifest has, for the checks below
  if (loom_open_file(c.manifest.c_str(), &opts, &session) != LOOM_OK) {
    std::cerr << loom_last_error() << "\n";
    ok = manifest_ok = false;
  } else {
    loom_close(session);
    for (const auto& problem : manifest_name_problems(c)) {
      std::cerr << problem << "\n";
      ok = false;
      if (!c.sampler.empty() && problem.rfind(c.sampler_at + ": [curriculum] sampler", 0) == 0) {
        cc.sampler.clear();
      }
      if (!c.seqlen.empty() && problem.rfind(c.seqlen_at + ": [curriculum] seqlen", 0) == 0) {
        cc.seqlen.clear();
      }
      if (!c.router.empty() && problem.rfind(c.router_at + ": [routing] router", 0) == 0) {
        cc.router.clear();
      }
      if (!c.moe.empty() && problem.rfind(c.moe_at + ": [moe] instance", 0) == 0) cc.moe.clear();
      if (!c.quantizer.empty() &&
          problem.rfind(c.quantizer_at + ": [quantization] quantizer", 0) == 0) {
        cc.quantizer.clear();
      }
    }
  }
  // A quantized checkpoint: it opens (every header check of the tensor-file reader).
  if (!c.checkpoint.empty()) {
    loom_tensor_file* f = nullptr;
    if (loom_tensor_file_open(c.checkpoint.c_str(), &f) != LOOM_OK) {
      std::cerr << c.checkpoint_at << ": [quantization] checkpoint: " << loom_last_error() << "\n";
      ok = false;
    }
    loom_tensor_file_close(f);
  }
  std::optional<Dataset> ds;
  if (problems.empty()) {  // the dataset checks need a sound config
    try {
      ds.emplace(c.dataset);
      fit_to_dataset(c, *ds);
    } catch (const std::exception& e) {
      std::cerr << e.what() << "\n";
      ok = false;
      ds.reset();
    }
  }
  // The curriculum's and the router's instances: created (alone: the manifest's [loom],
  // [curriculum.*], [sampler.*] and [router.*]), checked for kind and role, and planned, the
  // sampler over this dataset, the router for every layer at seq_len.
  if (manifest_ok && ds &&
      (!cc.sampler.empty() || !cc.seqlen.empty() || !cc.router.empty() || !cc.quantizer.empty())) {
    loom_open_options co = opts;
    co.validate_only = 0;
    const std::string text = curriculum_manifest(c);
    loom_session* cs = nullptr;
    if (loom_open_string(text.c_str(), c.manifest.c_str(), &co, &cs) != LOOM_OK) {
      std::cerr << with_run_values(loom_last_error(), c) << "\n";
      ok = false;
    } else {
      std::vector<std::string> cp;
      Curriculum cur;
      cc.model = c.model;  // the vocabulary size the dataset gave
      cur.open(cs, cc, sample_count(ds->train().size(), c.seq_len), ds->header().payload_checksum,
               1, cp);
      // The router: its kind, and its plan of every layer at seq_len (step 1, training).
      if (!cc.router.empty()) {
        const std::string who = c.router_at + ": [routing] router '" + c.router + "'";
        loom_instance* ri = nullptr;
        if (loom_find_instance(cs, "router", c.router.c_str(), &ri) != LOOM_OK) {
          cp.push_back(who + ": " + loom_last_error());
        } else {
          try {
            PluginRouter router(ri, who, c.seed, c.seq_len, c.model.dim);
            router.set_step(1, 0);
            for (int l = 0; l < c.model.layers; ++l) {
              (void)router.has_weight(l, c.model.layers);
              (void)router.plan(l, c.model.layers, c.batch_size, c.seq_len, true);
            }
          } catch (const std::exception& e) {
            cp.push_back(e.what());
          }
        }
      }
      // The quantizer: its kind, and every selected tensor's shape packed (it refuses a
      // shape its parameters cannot take, naming the tensor).
      if (!cc.quantizer.empty()) {
        const std::string who = c.quantizer_at + ": [quantization] quantizer '" + c.quantizer + "'";
        loom_instance* qi = nullptr;
        if (loom_find_instance(cs, "quantizer", c.quantizer.c_str(), &qi) != LOOM_OK) {
          cp.push_back(who + ": " + loom_last_error());
        } else {
          try {
            auto q = plugin_quantizer(qi, who);
            const int64_t C = c.model.dim;
            for (const auto& name : quantized_tensor_names(c)) {
              int64_t rows = C, cols = C;
              if (name == "wte") rows = c.model.vocab_size;
              if (name == "wpe") rows = c.model.context;
              if (name.find("attn.qkv.w") != std::string::npos) rows = 3 * C;
              if (name.find("mlp.fc.w") != std::string::npos) rows = 4 * C;
              if (name.find("mlp.proj.w") != std::string::npos) cols = 4 * C;
              std::vector<float> zeros(static_cast<size_t>(rows * cols), 0.0f);
              (void)q->pack(name, zeros.data(), rows, cols);
            }
          } catch (const std::exception& e) {
            cp.push_back(e.what());
          }
        }
      }
      for (const auto& line : cp) std::cerr << line << "\n";
      ok = ok && cp.empty();
      if (cp.empty()) {
        for (const auto& w : cur.warnings(cc)) std::cerr << w << "\n";
      }
      loom_close(cs);
    }
  }
  // The MoE instance (alone: the manifest's [loom] and [moe.*], without its comm) and its
  // plan of every [moe] layer (training and evaluation at the batch's tokens); the experts'
  // split over the expert-parallel group is checked here, the group needing the comm.
  if (manifest_ok && problems.empty() && !cc.moe.empty()) {
    std::vector<std::string> mp;
    int64_t ep_size = 1;
    std::string ep_at;
    const std::string text = moe_check_manifest(c, ep_size, ep_at);
    const std::string who = c.moe_at + ": [moe] instance '" + c.moe + "'";
    loom_open_options mo = opts;
    mo.validate_only = 0;
    loom_session* ms = nullptr;
    if (text.empty()) {
      mp.push_back(who + ": " + c.manifest +
                   " could not be read as tables, one key per line, to plan the MoE layers");
    } else if (loom_open_string(text.c_str(), c.manifest.c_str(), &mo, &ms) != LOOM_OK) {
      mp.push_back(loom_last_error());
    } else {
      loom_instance* mi = nullptr;
      if (loom_find_instance(ms, "moe", c.moe.c_str(), &mi) != LOOM_OK) {
        mp.push_back(who + ": " + loom_last_error());
      } else {
        const int hidden = c.moe_hidden > 0 ? c.moe_hidden : 4 * c.model.dim;
        const int64_t tokens = static_cast<int64_t>(c.batch_size) * c.seq_len;
        for (size_t i = 0; i < c.moe_layers.size(); ++i) {
          try {
            for (const bool training : {true, false}) {
              const loom_moe_plan_args p =
                  MoeLayer::plan_layer(mi, who, c.moe_layers[i], c.model.layers, c.model.dim,
                                       hidden, c.moe_experts[i], tokens, training);
              if (training && ep_size > 1 && p.experts % ep_size != 0) {
                mp.push_back(c.moe_experts_at + ": [moe] experts: layer " +
                             std::to_string(c.moe_layers[i]) + " has " + std::to_string(p.experts) +
                             " experts, which the expert-parallel group of " + ep_at + " ep_size " +
                             std::to_string(ep_size) + " cannot hold evenly (a multiple of " +
                             std::to_string(ep_size) + " is needed)");
              }
            }
          } catch (const std::exception& e) {
            mp.push_back(e.what());
          }
        }
      }
      loom_close(ms);
    }
    for (const auto& line : mp) std::cerr << line << "\n";
    ok = ok && mp.empty();
  }
  if (problems.empty()) {
    for (const auto& w : config_warnings(c)) std::cerr << w << "\n";
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
  app.add_flag("--eval-only", a.eval_only,
               "Evaluate the weights ([quantization] weights, else the run's latest checkpoint) "
               "in fp32 and quantized, write RUN_DIR/eval.json, and exit");
  app.add_option("--weights", a.weights,
                 "With --eval-only: the weights to evaluate (a loom quantize output, or fp32 "
                 "weights the config's [quantization] quantizer quantizes)")
      ->type_name("FILE");
  app.add_flag("--check", a.check,
               "Validate the config, its manifest and dataset, and exit (what loom check does)");
  app.add_option("--plugin-path", a.plugin_path,
                 "Extra plugin folders (':'-separated), searched after the manifest's")
      ->type_name("DIRS");
  if (const int rc = loom_cli::parse(app, argc, argv, true); rc >= 0) return rc;
  try {
    const int rc = a.check ? check(a) : run(a);
    loom::trainer::mark_clean_exit();
    return rc;
  } catch (const ConfigError& e) {  // the same on every rank: each exits by itself
    std::cout << std::flush;
    for (const auto& line : e.errors()) std::cerr << "loom train: error: " << line << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cout << std::flush;
    std::istringstream lines(e.what());
    for (std::string line; std::getline(lines, line);) {
      std::cerr << "loom train: error: " << line << "\n";
    }
    std::cerr << std::flush;
    // A failure this rank alone saw (a peer that died or stopped, a plugin error): end the
    // job, or the other ranks would wait for this one, and MPI's exit handler for them.
    const bool agreed = dynamic_cast<const AgreedError*>(&e) != nullptr;
    if (!agreed && std::max(g_job_ranks, launcher_ranks()) > 1) loom_abort_job(2);
    return 2;
  }
}
