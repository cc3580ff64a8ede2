#include "validate_steps.hpp"

#include <cmath>
#include <cstdint>
#include <loom_cli_support.hpp>
#include <string>
#include <vector>

namespace loom_validate {
namespace {

using Status = StepResult::Status;

StepResult ok(std::string note) { return {Status::kOk, std::move(note)}; }
StepResult failed(std::string why) { return {Status::kFailed, std::move(why)}; }

// A 1-D CPU tensor over `data`, with its shape and stride kept in `dims`.
struct Tensor1d {
  int64_t dims[2];
  DLTensor t;
  Tensor1d(void* data, int64_t n, DLDataTypeCode code, uint8_t bits)
      : dims{n, 1}, t{data, {kDLCPU, 0}, 1, {static_cast<uint8_t>(code), bits, 1},
                      dims, dims + 1,    0} {}
  Tensor1d(const Tensor1d&) = delete;
  Tensor1d& operator=(const Tensor1d&) = delete;
};

// The table of `section`'s kind, or the failure to get it.
template <typename Table>
const Table* table_of(loom_instance* instance, const char* section, uint32_t min_size,
                      void** object, std::string* why) {
  const void* table = nullptr;
  if (loom_instance_table(instance, section, min_size, object, &table) != LOOM_OK) {
    *why = loom_last_error();
    return nullptr;
  }
  return static_cast<const Table*>(table);
}

// Takes a status a call through the table returned: "" for OK, else its message.
std::string take(loom_instance* instance, loom_status* status) {
  if (loom_instance_take_status(instance, status, nullptr, 0) == LOOM_OK) return {};
  return loom_last_error();
}

StepResult optimizer_step(loom_instance* instance) {
  constexpr int64_t kN = 16;
  std::vector<float> p0(kN), p1(kN), g0(kN), g1(kN);
  for (int64_t i = 0; i < kN; ++i) {
    p0[i] = 0.5f + 0.01f * static_cast<float>(i);
    p1[i] = -0.25f + 0.02f * static_cast<float>(i);
    g0[i] = 0.1f - 0.01f * static_cast<float>(i);
    g1[i] = 0.05f;
  }
  float* params[] = {p0.data(), p1.data()};
  const float* grads[] = {g0.data(), g1.data()};
  const int64_t numels[] = {kN, kN};
  if (loom_optimizer_step_f32(instance, params, grads, numels, 2, 1e-3) != LOOM_OK) {
    return failed(loom_last_error());
  }
  for (const auto* p : {&p0, &p1}) {
    for (const float v : *p) {
      if (!std::isfinite(v)) return failed("the step wrote a non-finite parameter");
    }
  }
  return ok("one loom_optimizer_step_f32 on 2 fp32 tensors of 16 elements, lr 0.001");
}

StepResult curriculum_step(loom_instance* instance) {
  void* object = nullptr;
  std::string why;
  const auto* t = table_of<loom_curriculum_v1>(instance, "curriculum", LOOM_CURRICULUM_V1_MIN_SIZE,
                                               &object, &why);
  if (t == nullptr) return failed(why);
  loom_curriculum_plan_args plan{};
  plan.struct_size = LOOM_CURRICULUM_PLAN_ARGS_SIZE;
  plan.vocab_size = 256;
  if (why = take(instance, t->plan(object, &plan)); !why.empty()) return failed(why);
  if ((plan.roles & LOOM_CURRICULUM_SCHEDULE) != 0 && t->at != nullptr) {
    loom_curriculum_at_args at{};
    at.struct_size = LOOM_CURRICULUM_AT_ARGS_SIZE;
    at.step = 1;
    if (why = take(instance, t->at(object, &at)); !why.empty()) return failed(why);
    if (!std::isfinite(at.difficulty)) return failed("at(step 1) gave a non-finite difficulty");
    return ok("plan, then at(step 1): difficulty " + loom_cli::number(at.difficulty) +
              ", seq_len " + std::to_string(at.seq_len));
  }
  if ((plan.roles & LOOM_CURRICULUM_METRIC) == 0 || t->score == nullptr) {
    return {Status::kSkipped, "plan gives neither a schedule nor a metric to call"};
  }
  if (plan.stats_count > (uint64_t{1} << 24)) {
    return {Status::kSkipped, "the metric needs " + std::to_string(plan.stats_count) +
                                  " statistics counters, too many for a generic check"};
  }
  // Two samples of token ids below the vocabulary size: [1, 2, 3] and [4, 5].
  std::vector<int32_t> tokens{1, 2, 3, 4, 5};
  std::vector<int64_t> offsets{0, 3, 5};
  std::vector<int64_t> stats(plan.stats_count, 0);
  std::vector<double> scores(2, 0.0);
  Tensor1d tok(tokens.data(), 5, kDLInt, 32), off(offsets.data(), 3, kDLInt, 64);
  Tensor1d st(stats.data(), static_cast<int64_t>(stats.size()), kDLInt, 64);
  Tensor1d sc(scores.data(), 2, kDLFloat, 64);
  const loom_curriculum_samples samples{LOOM_CURRICULUM_SAMPLES_SIZE, 0, &tok.t, &off.t};
  if (plan.stats_count > 0) {
    if (t->count == nullptr) return failed("plan asks for statistics but count is NULL");
    const loom_curriculum_count_args count{
        LOOM_CURRICULUM_COUNT_ARGS_SIZE, 0, samples, 256, 0, &st.t, nullptr};
    if (why = take(instance, t->count(object, &count)); !why.empty()) return failed(why);
  }
  const loom_curriculum_score_args score{
      LOOM_CURRICULUM_SCORE_ARGS_SIZE,        0,     samples, 256, 0,
      plan.stats_count > 0 ? &st.t : nullptr, &sc.t, nullptr};
  if (why = take(instance, t->score(object, &score)); !why.empty()) return failed(why);
  return ok("plan, then " + std::string(plan.stats_count > 0 ? "count and " : "") +
            "score of 2 samples: " + loom_cli::number(scores[0]) + ", " +
            loom_cli::number(scores[1]));
}

StepResult sampler_step(loom_instance* instance) {
  void* object = nullptr;
  std::string why;
  const auto* t =
      table_of<loom_sampler_v1>(instance, "sampler", LOOM_SAMPLER_V1_MIN_SIZE, &object, &why);
  if (t == nullptr) return failed(why);
  constexpr uint64_t kDataset = 64;
  loom_sampler_plan_args plan{};
  plan.struct_size = LOOM_SAMPLER_PLAN_ARGS_SIZE;
  plan.dataset_size = kDataset;
  plan.global_batch = 4;
  plan.world_size = 1;
  if (why = take(instance, t->plan(object, &plan)); !why.empty()) return failed(why);
  if (plan.capacity < 1 || plan.capacity > (int64_t{1} << 24)) {
    return failed("plan gave a capacity of " + std::to_string(plan.capacity) +
                  " for a global batch of 4");
  }
  std::vector<int64_t> ids(static_cast<size_t>(plan.capacity), -1);
  Tensor1d idx(ids.data(), plan.capacity, kDLInt, 64);
  loom_sampler_next_args next{};
  next.struct_size = LOOM_SAMPLER_NEXT_ARGS_SIZE;
  next.seed = 1;
  next.step = 1;
  next.rank = 0;
  next.world_size = 1;
  next.indices = &idx.t;
  if (why = take(instance, t->next(object, &next)); !why.empty()) return failed(why);
  if (next.count < 1 || next.count > plan.capacity) {
    return failed("next(step 1) wrote " + std::to_string(next.count) + " ids, capacity " +
                  std::to_string(plan.capacity));
  }
  for (int64_t i = 0; i < next.count; ++i) {
    if (ids[static_cast<size_t>(i)] < 0 ||
        static_cast<uint64_t>(ids[static_cast<size_t>(i)]) >= kDataset) {
      return failed("next(step 1) wrote the sample id " + std::to_string(ids[i]) +
                    ", outside a dataset of 64");
    }
  }
  return ok("plan (64 samples, global batch 4, 1 rank), then next(step 1): " +
            std::to_string(next.count) + " sample ids");
}

StepResult comm_step(loom_instance* instance) {
  void* object = nullptr;
  std::string why;
  const auto* t = table_of<loom_comm_v1>(instance, "comm", LOOM_COMM_V1_MIN_SIZE, &object, &why);
  if (t == nullptr) return failed(why);
  const int32_t size = t->size(object);
  if (size < 1) return failed("size() is " + std::to_string(size));
  std::vector<float> v{1, 2, 3, 4};
  Tensor1d buf(v.data(), 4, kDLFloat, 32);
  const loom_allreduce_args args{LOOM_ALLREDUCE_ARGS_SIZE, LOOM_REDUCE_SUM, nullptr, &buf.t,
                                 nullptr};
  if (why = take(instance, t->allreduce(object, &args)); !why.empty()) return failed(why);
  for (size_t i = 0; i < v.size(); ++i) {
    if (v[i] != static_cast<float>(i + 1) * static_cast<float>(size)) {
      return failed("an in-place sum allreduce of [1, 2, 3, 4] over " + std::to_string(size) +
                    (size == 1 ? " rank gave " : " ranks gave ") + loom_cli::number(v[i]) +
                    " at index " + std::to_string(i));
    }
  }
  return ok("an in-place sum allreduce of 4 fp32 values over " + std::to_string(size) +
            (size == 1 ? " rank" : " ranks"));
}

}  // namespace

StepResult generic_step(const std::string& section, loom_instance* instance) {
  if (section == "optimizer") return optimizer_step(instance);
  if (section == "curriculum") return curriculum_step(instance);
  if (section == "sampler") return sampler_step(instance);
  if (section == "comm") return comm_step(instance);
  // codec, router, moe, quantizer: their calls need buffers laid out by a plan for a model
  // or a transport; made-up inputs would test the inputs, not the plugin.
  return {Status::kSkipped,
          "not driven generically: a call of this kind needs inputs shaped by a model or a "
          "transport (its own tests drive it)"};
}

}  // namespace loom_validate
