// curriculum_sampler (loom.sampler/1): the plugin around SamplerCore (sampler_core.hpp). It
// opens the index files `loom data analyze` wrote for one metric, asks its `schedule` (a
// loom.curriculum instance) for each step's difficulty, and hands each rank its share of the
// global batch. docs/data.md, "The curriculum sampler", has the rules.
#include <loom/sdk.hpp>
#include <loom/sdk/kinds/sampler.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <loom/data/metric_index.hpp>
#include <loom/data/sampler_core.hpp>

namespace {

using loom::data::sampler::Clustering;
using loom::data::sampler::DifficultyType;
using loom::data::sampler::SamplerCore;
using loom::sdk::Context;
using loom::sdk::Error;

Clustering clustering_of(const Context& params) {
  return params.get_string("clustering_type") == "single_cluster" ? Clustering::kSingleCluster
                                                                  : Clustering::kScheduleBased;
}

class CurriculumSampler : public loom::sdk::Sampler {
 public:
  static loom::sdk::Schema schema() {
    using namespace loom::sdk;
    return {
        Ref("schedule", LOOM_KIND_CURRICULUM,
            "The loom.curriculum schedule whose `at` gives each step's difficulty (required "
            "unless clustering_type is single_cluster)."),
        String("index", "",
               "The folder `loom data analyze` wrote the metric's index files to; a relative "
               "path is relative to the working directory (required unless clustering_type "
               "is single_cluster)."),
        String("metric", "",
               "The metric's instance name the index files were written for (required unless "
               "clustering_type is single_cluster)."),
        String("difficulty_type", "value",
               "value: a sample is admitted once its metric value is <= the difficulty; "
               "percentile: the difficulty d in [0, 100] admits the easiest floor(N d / 100) "
               "samples.")
            .choices({"value", "percentile"}),
        String("clustering_type", "schedule_based",
               "schedule_based: the curriculum; single_cluster: every sample from the start, "
               "an epoch-shuffled sampler (schedule, index and metric are then not used).")
            .choices({"schedule_based", "single_cluster"}),
    };
  }

  static void validate_params(Context& params) {
    if (clustering_of(params) == Clustering::kSingleCluster) return;
    const char* why = " is required when clustering_type is schedule_based";
    if (params.get_string("index").empty()) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT, std::string("index") + why, "index");
    }
    if (params.get_string("metric").empty()) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT, std::string("metric") + why, "metric");
    }
    const loom_value* schedule = params.has("schedule") ? &params.value("schedule") : nullptr;
    if (schedule == nullptr || schedule->string_value == nullptr ||
        schedule->string_value[0] == '\0') {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  std::string("schedule") + why + " (name a [curriculum.NAME] schedule)",
                  "schedule");
    }
  }

  explicit CurriculumSampler(Context& ctx)
      : ctx_(ctx),
        clustering_(clustering_of(ctx)),
        type_(ctx.get_string("difficulty_type") == "percentile" ? DifficultyType::kPercentile
                                                                : DifficultyType::kValue),
        index_dir_(ctx.get_string("index")),
        metric_(ctx.get_string("metric")),
        core_(make_core()) {}

  void plan(loom_sampler_plan_args& a) {
    core_.plan(a.dataset_size, a.global_batch, a.world_size);
    a.capacity = core_.capacity();
  }

  void next(loom_sampler_next_args& a) {
    // core_.next refuses a call before plan (capacity is 0 then).
    const DLTensor& out = *a.indices;
    const int64_t capacity = core_.capacity();
    if (out.shape[0] < capacity) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT, "indices has " + std::to_string(out.shape[0]) +
                                                 " elements, fewer than plan's " + "capacity " +
                                                 std::to_string(capacity));
    }
    if (out.data == nullptr) throw Error(LOOM_ERR_INVALID_ARGUMENT, "indices has no data");
    const SamplerCore::Share share =
        core_.next(a.step, a.seed, a.rank, a.world_size, [this](int64_t step) {
          loom_curriculum_at_args at{};
          at.struct_size = LOOM_CURRICULUM_AT_ARGS_SIZE;
          at.step = step;
          schedule_.call(&loom_curriculum_v1::at, &at);
          return at.difficulty;
        });
    auto* dst = reinterpret_cast<int64_t*>(static_cast<char*>(out.data) + out.byte_offset);
    if (!share.ids.empty()) std::memcpy(dst, share.ids.data(), share.ids.size_bytes());
    a.count = static_cast<int64_t>(share.ids.size());
    a.difficulty = share.difficulty;
    a.epoch = share.epoch;
    a.consumed = share.consumed;
  }

  // The position, a few bytes per cluster (docs/data.md); no random generator.
  void export_state(loom::sdk::StateWriter& out) {
    const std::vector<std::byte> blob = core_.export_state();
    out.write_bytes(blob);
  }
  void import_state(std::span<const std::byte> blob) {
    core_.import_state(blob);
    ctx_.debug("restored the sampler at step " + std::to_string(core_.last_step()));
  }

 private:
  SamplerCore make_core() {
    if (clustering_ == Clustering::kSingleCluster) {
      return SamplerCore({}, type_, clustering_, "single_cluster");
    }
    schedule_ = ctx_.find_ref<loom_curriculum_v1>("schedule");
    if (!schedule_) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  "parameter 'schedule' names no curriculum instance (clustering_type "
                  "schedule_based needs one)");
    }
    if (!schedule_.provides(&loom_curriculum_v1::at)) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT, "parameter 'schedule': curriculum '" +
                                                 schedule_.name() +
                                                 "' is not a schedule (it has no `at`)");
    }
    try {
      index_.emplace(loom::data::MetricIndex::open(index_dir_, metric_));
    } catch (const loom::data::IndexError& e) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT, std::string("parameter 'index': ") + e.what());
    }
    // open() refuses files of another metric, so the index is this metric's.
    return SamplerCore(index_->sorted(), type_, clustering_,
                       "index '" + index_dir_ + "' (metric '" + metric_ + "')");
  }

  Context ctx_;
  Clustering clustering_;
  DifficultyType type_;
  std::string index_dir_;
  std::string metric_;
  loom::sdk::InstanceRef<loom_curriculum_v1> schedule_;
  std::optional<loom::data::MetricIndex> index_;  // before core_, which borrows its list
  SamplerCore core_;
};

}  // namespace

LOOM_PLUGIN("curriculum_sampler", "1.0.0",
            "Curriculum sampler: batches of the samples a schedule's difficulty admits, "
            "exactly resumable, sharded over data-parallel ranks without communication",
            loom::sdk::factory<CurriculumSampler>());
