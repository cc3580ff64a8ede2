// [curriculum] in the loop (curriculum_feature.hpp).
#include "curriculum_feature.hpp"

#include <chrono>
#include <span>

#include "checkpoint.hpp"

namespace loom::trainer {

CurriculumFeature::CurriculumFeature(loom_session* session, const TrainConfig& c, const Dataset& ds,
                                     int rank, int world, int local_batch)
    : c_(c), ds_(ds), rank_(rank), world_(world), local_batch_(local_batch) {
  samples_ = sample_count(ds_.train().size(), c_.seq_len);
  std::vector<std::string> problems;
  cur_.open(session, c_, samples_, ds_.header().payload_checksum, world_, problems);
  if (!problems.empty()) throw ConfigError(problems);
}

bool CurriculumFeature::draw_batch(int64_t step, std::vector<int32_t>& x, std::vector<int32_t>& y,
                                   StepResult& r) {
  if (cur_.sampler == nullptr) return false;
  const auto sampler_start = std::chrono::steady_clock::now();
  r.difficulty = cur_.next(step, c_.seed, rank_, world_, local_batch_);
  sampler_s_ +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - sampler_start).count();
  fill_samples(ds_.train(), c_.seq_len,
               std::span<const int64_t>(cur_.ids.data(), static_cast<size_t>(local_batch_)), x, y);
  return true;
}

// Sequence-length warmup: the step's length L, and the batch cut to it.
void CurriculumFeature::shape_batch(int64_t step, Batch& b, StepResult& r) {
  if (cur_.seqlen == nullptr) return;
  r.seq_len = step_seq_len(cur_.at(step), c_.seq_len);
  if (r.seq_len < c_.seq_len) {
    b.rows = cut_batch(cur_.cut, b.x, b.y, b.rows, c_.seq_len, r.seq_len, cx_, cy_);
    b.x = cx_.data();
    b.y = cy_.data();
  }
  b.seq_len = r.seq_len;
}

void CurriculumFeature::banner(BannerPart part, std::ostream& out) const {
  if (part == BannerPart::kData && cur_.sampler != nullptr) {
    out << "loom train: batches from sampler '" << c_.sampler << "' ("
        << loom_instance_plugin(cur_.sampler) << ") over the " << samples_ << " samples of "
        << c_.seq_len + 1 << " tokens" << std::endl;
  }
  if (part == BannerPart::kSchedule && cur_.seqlen != nullptr) {
    out << "loom train: sequence length from '" << c_.seqlen << "' ("
        << loom_instance_plugin(cur_.seqlen) << ", "
        << (cur_.cut == SeqLenCut::kReshape ? "reshape" : "truncate") << "), a multiple of 8 up to "
        << c_.seq_len << std::endl;
  }
}

// The sampler's difficulty (null when it is not a curriculum: NaN).
void CurriculumFeature::log_metrics(const StepResult& r, double, nlohmann::json& j) {
  if (cur_.sampler != nullptr) {
    j["difficulty"] = std::isfinite(r.difficulty) ? nlohmann::json(r.difficulty) : nullptr;
  }
}

// The sampler's cost beside the steps it fed, timed in this process (rank 0; since the start
// or the resume): what the sampler adds to a step.
void CurriculumFeature::summary(nlohmann::json& s, double train_step_s) const {
  if (cur_.sampler != nullptr && train_step_s > 0) {
    s["sampler_s"] = sampler_s_;
    s["train_step_s"] = train_step_s;
    s["sampler_share_of_step"] = sampler_s_ / train_step_s;
  }
}

std::vector<std::pair<loom_instance*, std::string>> CurriculumFeature::files() const {
  std::vector<std::pair<loom_instance*, std::string>> out;
  if (cur_.sampler != nullptr) out.emplace_back(cur_.sampler, "sampler");
  if (cur_.seqlen != nullptr) out.emplace_back(cur_.seqlen, "seqlen");
  return out;
}

// The sampler's position and the seqlen schedule's state, so a resume continues mid-epoch and
// mid-schedule.
void CurriculumFeature::save_state(const std::filesystem::path& dir, const std::string& rs) {
  for (const auto& [inst, file] : files()) {
    save_blob((dir / (file + "." + rs + ".bin")).string(), BlobKind::kCurriculum,
              export_instance_state(inst, file));
  }
}

void CurriculumFeature::load_state(const std::filesystem::path& dir, const std::string& rs) {
  for (const auto& [inst, file] : files()) {
    const std::string f = (dir / (file + "." + rs + ".bin")).string();
    if (!std::filesystem::exists(f)) {
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
}

void CurriculumFeature::refuse_foreign_state(const std::filesystem::path& dir,
                                             const std::string& rs) {
  for (const char* file : {"sampler", "seqlen"}) {
    const bool used =
        std::string(file) == "sampler" ? cur_.sampler != nullptr : cur_.seqlen != nullptr;
    if (!used && std::filesystem::exists(dir / (std::string(file) + "." + rs + ".bin"))) {
      throw CheckpointError(dir.string() + ": was written with a [curriculum] " + file +
                            ", which this config lacks; resume with the config it was "
                            "written with");
    }
  }
}

}  // namespace loom::trainer
