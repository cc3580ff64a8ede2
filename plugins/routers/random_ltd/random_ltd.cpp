// random_ltd (kind loom.router/1): random layerwise token dropping. Each routed layer of a
// training step processes a uniformly random, sorted subset of every sequence's positions,
// whose size follows DeepSpeed's fixed_linear schedule (schedule.hpp); the subset is a pure
// function of (seed, step, layer, sample) (select_key.hpp), the same on every rank, thread
// count, batch split and device. docs/routing.md describes it for users.
#include <loom/sdk.hpp>
#include <loom/sdk/kinds/router.hpp>

#include <cstdint>
#include <span>
#include <string>

#include <loom/routers/router_core.hpp>
#include "schedule.hpp"
#include "select.hpp"

namespace {

namespace lr = loom::routers;
namespace ltd = loom::routers::ltd;
using loom::sdk::Context;

ltd::Schedule read_schedule(const Context& p) {
  ltd::Schedule s;
  s.min_value = p.get_int("min_value");
  s.max_value = p.get_int("max_value");
  s.require_steps = p.get_int("require_steps");
  s.seq_per_step = p.get_int("seq_per_step");
  return s;
}

class RandomLtd : public loom::sdk::Router {
 public:
  static loom::sdk::Schema schema() {
    using loom::sdk::Int;
    using loom::sdk::String;
    return {
        Int("min_value", 1,
            "Positions each routed layer keeps per sequence at the first step (DeepSpeed's "
            "min_value); the schedule never keeps fewer.")
            .required()
            .int_range(1, INT32_MAX),
        Int("max_value", 1,
            "Positions kept from step require_steps + 1 on: the full training sequence length "
            "(DeepSpeed's max_value). A sequence no longer than the scheduled count is not "
            "routed.")
            .required()
            .int_range(1, INT32_MAX),
        String("schedule_type", ltd::kFixedLinear,
               "How the kept count grows from min_value to max_value; only fixed_linear "
               "(linearly over require_steps steps).")
            .choices({ltd::kFixedLinear}),
        Int("require_steps", 1,
            "R: steps the schedule takes from min_value to max_value; from step R + 1 on "
            "(DeepSpeed counts steps from 0) every routed layer keeps max_value.")
            .required()
            .int_min(1),
        Int("seq_per_step", 16,
            "q: the kept count is rounded down to a multiple of q (then kept >= min_value); "
            "16 keeps the kept lengths Tensor Core friendly.")
            .int_min(1),
        lr::RoutedLayers::param(),
    };
  }

  static void validate_params(Context& params) {
    ltd::validate(read_schedule(params), params.get_string("schedule_type"));
    lr::RoutedLayers::validate(params);
  }

  explicit RandomLtd(Context& ctx)
      : schedule_(read_schedule(ctx)), layers_(lr::RoutedLayers::from(ctx)) {
    ltd::validate(schedule_, ctx.get_string("schedule_type"));
  }

  void plan(loom_router_plan_args& a) {
    a.kept = kept(a.step, a.layer, a.num_layers, a.seq_len, a.training != 0);
    a.saved_bytes = 0;
    a.workspace_bytes = ltd::workspace_bytes(a.batch, a.seq_len, a.kept);
  }

  void select(const loom_router_select_args& a) {
    ltd::SelectJob job;
    job.seed = a.seed;
    job.step = a.step;
    job.layer = a.layer;
    job.first_sample = a.first_sample;
    job.batch = a.batch;
    job.seq_len = a.seq_len;
    job.kept = kept(a.step, a.layer, a.num_layers, a.seq_len, a.training != 0);
    if (a.first_sample < 0) {
      throw loom::sdk::Error(LOOM_ERR_INVALID_ARGUMENT,
                             "router select: first_sample is " + std::to_string(a.first_sample) +
                                 "; it must be >= 0 (the batch's offset in the global batch)");
    }
    if (a.first_sample > INT64_MAX - (a.batch - 1)) {
      throw loom::sdk::Error(LOOM_ERR_INVALID_ARGUMENT,
                             "router select: first_sample " + std::to_string(a.first_sample) +
                                 " + batch " + std::to_string(a.batch) +
                                 " overflows int64 (the sample ids first_sample .. first_sample "
                                 "+ batch - 1 must fit)");
    }
    // The SDK checked indices against the plan: int32 [batch, kept], contiguous.
    const DLTensor& idx = *a.indices;
    auto* out = reinterpret_cast<int32_t*>(static_cast<char*>(idx.data) + idx.byte_offset);
    if (loom::sdk::is_cpu(idx.device)) {
      ltd::select_cpu(job, out, static_cast<uint64_t*>(a.workspace));
      return;
    }
    if (loom::sdk::is_cuda(idx.device)) {
      ltd::cuda::select(job, out, a.workspace, idx.device.device_id, a.stream);
      return;
    }
    throw loom::sdk::Error(LOOM_ERR_INVALID_ARGUMENT,
                           "router select: indices is on " + loom::sdk::device_string(idx.device) +
                               "; random_ltd selects into host or CUDA memory");
  }

  void gather(const loom::sdk::RouterMove& m) { lr::gather(m); }
  void scatter(const loom::sdk::RouterMove& m) { lr::scatter(m); }

  void advance(loom_router_advance_args& a) {
    const int64_t tokens = lr::LayerTokenCounter::layer_tokens(
        a.batch, a.num_layers,
        [&](int32_t l) { return kept(a.step, l, a.num_layers, a.seq_len, true); });
    counter_.advance(a, tokens);
  }

  void export_state(loom::sdk::StateWriter& out) { counter_.export_state(out); }
  void import_state(std::span<const std::byte> blob) { counter_.import_state(blob); }

 private:
  int64_t kept(int64_t step, int32_t layer, int32_t num_layers, int64_t seq_len,
               bool training) const {
    const bool routed = layers_.routed(layer, num_layers);
    return ltd::kept_at(schedule_, step, seq_len, routed, training);
  }

  ltd::Schedule schedule_;
  lr::RoutedLayers layers_;
  lr::LayerTokenCounter counter_;
};

}  // namespace

LOOM_PLUGIN("random_ltd", "1.0.0",
            "Token router: random layerwise token dropping (DeepSpeed's random-LTD schedule)",
            loom::sdk::factory<RandomLtd>());
