// [curriculum]: the sampler that names each step's samples, and the sequence-length schedule
// (sequence-length warmup) that gives each step's length (docs/data.md).
#pragma once

#include <loom/embed.h>
#include <loom/kinds/curriculum.h>
#include <loom/kinds/sampler.h>

#include <algorithm>
#include <string>
#include <vector>

#include "batch.hpp"
#include "config.hpp"
#include "dataset.hpp"
#include "feature.hpp"
#include "run.hpp"

namespace loom::trainer {

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
    if (const std::string e = sampler_index_problem(session, c, dataset_checksum); !e.empty()) {
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

// The feature: the sampler draws the batch, the schedule cuts it; both instances' states go
// into the checkpoints (sampler.RANK.bin, seqlen.RANK.bin). Without either it does nothing.
class CurriculumFeature final : public Feature {
 public:
  // Finds, checks and plans the instances (the sampler over the dataset's fixed samples,
  // before a resume imports its position). Throws ConfigError with every problem.
  CurriculumFeature(loom_session* session, const TrainConfig& c, const Dataset& ds, int rank,
                    int world, int local_batch);

  // The schedule's warnings (Curriculum::warnings).
  std::vector<std::string> warnings() { return cur_.warnings(c_); }

  bool draw_batch(int64_t step, std::vector<int32_t>& x, std::vector<int32_t>& y,
                  StepResult& r) override;
  void shape_batch(int64_t step, Batch& b, StepResult& r) override;
  void banner(BannerPart part, std::ostream& out) const override;
  void log_metrics(const StepResult& r, double mean_aux, nlohmann::json& j) override;
  void summary(nlohmann::json& s, double train_step_s) const override;
  void save_state(const std::filesystem::path& dir, const std::string& rs) override;
  void load_state(const std::filesystem::path& dir, const std::string& rs) override;
  void refuse_foreign_state(const std::filesystem::path& dir, const std::string& rs) override;

 private:
  // The instances whose state a checkpoint holds, with their file stems.
  std::vector<std::pair<loom_instance*, std::string>> files() const;

  const TrainConfig& c_;
  const Dataset& ds_;
  int rank_, world_, local_batch_;
  uint64_t samples_ = 0;  // the dataset's fixed samples at seq_len (what the sampler draws)
  Curriculum cur_;
  std::vector<int32_t> cx_, cy_;  // the batch cut to a shorter step's length
  double sampler_s_ = 0;          // time in the sampler's next, this process
};

}  // namespace loom::trainer
