// 0/1 Adam (zero_one_adam): adaptive variance freezing with 1-bit gradient averaging between
// the variance steps, then local steps synced by 1-bit compressed averaging of the
// accumulated update. The shared part (layout, buffers, collectives, state format) is in
// onebit.hpp.
#include "onebit.hpp"

#include <algorithm>
#include <cmath>

namespace loom::optim::onebit {

loom::sdk::Schema ZeroOneAdam::schema() {
  using loom::sdk::Int;
  loom::sdk::Schema s = common_schema();
  s.add(Int("var_freeze_step", 100000, "Last step at which the variance may be updated.").min(0));
  s.add(Int("var_update_scaler", 16,
            "Variance updates per interval before the interval doubles (kappa).")
            .min(1));
  s.add(Int("local_step_scaler", 32678,
            "Steps after the freeze between doublings of the local-step interval.")
            .min(1));
  s.add(Int("local_step_clipper", 16, "Largest local-step interval (H_max).").min(1));
  s.add(bucket_mb_param());
  return s;
}

ZeroOneAdam::ZeroOneAdam(loom::sdk::Context& ctx) : Onebit(ctx, Variant::kZeroOneAdam) {
  var_freeze_step_ = static_cast<uint64_t>(ctx.get_int("var_freeze_step"));
  var_update_scaler_ = static_cast<uint64_t>(ctx.get_int("var_update_scaler"));
  local_step_scaler_ = static_cast<uint64_t>(ctx.get_int("local_step_scaler"));
  local_step_clipper_ = static_cast<uint64_t>(ctx.get_int("local_step_clipper"));
}

void ZeroOneAdam::algorithm_step(const std::vector<StepGroup>& groups, double lr, uint64_t t) {
  if (!frozen_) {
    if (t % var_interval_ == 0) {
      allreduce_avg(flat_);  // variance step: full-precision average, both moments
      variance_step(groups, lr, t);
    } else {
      compressed(flat_);  // 1-bit gradient average
      gradient_step(groups, lr, t);
    }
    end_of_warmup(t);
    return;
  }
  // Phase B: local steps, accumulating the update in aux_ (u), synced every H steps. The
  // low-precision copies are written once, at the end.
  momentum_flat(flat_);
  const double bc1 = bc(beta1_, t);
  const float eps = static_cast<float>(eps_);
  const float inv_bc1 = static_cast<float>(1.0 / bc1);
  const float inv_bc2 = static_cast<float>(1.0 / std::sqrt(bc(beta2_, var_updates_)));
  const Segments all = segments(groups, Groups::kAll, false, [&](const StepGroup& g, Segment& s) {
    s.lr = static_cast<float>(lr * g.lr_scale);
    s.wd = static_cast<float>(g.weight_decay);
  });
  const Segments local = without_low(all);
  be().zero_one_local(local, m_.data(), v_.data(), aux_.data(), inv_bc1, inv_bc2, eps);
  lrs_ += lr;
  const bool sync = t % local_interval_ == 0;
  if (sync) {
    if (!(lrs_ > 0.0)) {
      // All steps of the window had lr 0: nothing moved, nothing to average.
      be().zero(aux_.data(), aux_.size());
    } else {
      // Revert to the synced point, un-precondition u to momentum scale, average it, then
      // (masks applied) take the averaged step and restart u.
      be().zero_one_sync_pre(local, v_.data(), aux_.data(), inv_bc2, eps);
      compressed(aux_);
      const float scale = static_cast<float>(-bc1 / lrs_);
      be().zero_one_sync_post(without_low(segments(groups, Groups::kAll, /*masks=*/true)),
                              m_.data(), v_.data(), aux_.data(), scale, inv_bc2, eps);
    }
    lrs_ = 0.0;
  }
  be().copy_out(all);
  if (++local_counter_ % local_step_scaler_ == 0) {
    local_interval_ = std::min(local_step_clipper_, local_interval_ * 2);
  }
}

void ZeroOneAdam::variance_step(const std::vector<StepGroup>& groups, double lr, uint64_t t) {
  ++var_updates_;
  adam_full(groups, lr, bc(beta1_, t), bc(beta2_, var_updates_));
  if (++var_counter_ == var_update_scaler_) {
    var_counter_ = 0;
    var_interval_ *= 2;
  }
}

void ZeroOneAdam::gradient_step(const std::vector<StepGroup>& groups, double lr, uint64_t t) {
  apply_masks(groups, flat_);
  momentum_flat(flat_);
  apply_adam(groups, lr, bc(beta1_, t), bc(beta2_, var_updates_), Groups::kAll,
             /*masks=*/false);
}

void ZeroOneAdam::end_of_warmup(uint64_t t) {
  if (t >= var_freeze_step_) {
    // The variance is frozen from here on; the error buffers now compensate another
    // quantity (the accumulated update), so they restart from zero.
    frozen_ = true;
    reset_car();
  }
}

// Buckets: a variance step averages the gradients; a step before the freeze sends its 1-bit
// gradient as its buckets complete. After the freeze the local steps send nothing, and a sync
// step's exchange (the window's update, this step's lr-scaled part included) starts in
// step(), which alone has the lr (docs/abi.md): its segments still pipeline there.
Onebit::Exchange ZeroOneAdam::bucket_exchange(uint64_t t) const {
  if (frozen_) return Exchange::kNone;
  return t % var_interval_ == 0 ? Exchange::kAverage : Exchange::kCompressed;
}

// The gradient is scratch: nothing to keep, nothing to prepare.
void ZeroOneAdam::bucket_prepare(const std::vector<StepGroup>& /*groups*/, std::size_t lo,
                                 std::size_t n, bool zeros) {
  if (zeros) be().zero(flat_.data() + lo, n);
}

void ZeroOneAdam::bucket_finish(const std::vector<StepGroup>& groups, Exchange e, double lr,
                                uint64_t t) {
  if (e == Exchange::kAverage) {
    variance_step(groups, lr, t);
  } else {
    gradient_step(groups, lr, t);
  }
  end_of_warmup(t);
}

}  // namespace loom::optim::onebit
