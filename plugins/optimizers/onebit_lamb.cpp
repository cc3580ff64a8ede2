// 1-bit LAMB (onebit_lamb): LAMB warmup with uncompressed gradient averaging (its trust
// ratios averaged into lamb_coeff_freeze), then the variance and trust ratio frozen, the
// scaled momentum averaged with the 1-bit compressed allreduce and the update scaled by a
// clamped factor from a fresh variance. The shared part (layout, buffers, collectives, state
// format) is in onebit.hpp.
#include "onebit.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

namespace loom::optim::onebit {

loom::sdk::Schema OnebitLamb::schema() {
  using loom::sdk::Float;
  loom::sdk::Schema s = common_schema();
  s.add(freeze_step_param());
  s.add(Float("max_coeff", 10.0, "Upper clamp of the warmup trust ratio.").min(0));
  s.add(Float("min_coeff", 0.01, "Lower clamp of the warmup trust ratio.").min(0));
  s.add(Float("coeff_beta", 0.9, "EMA factor of the trust ratio frozen at the freeze.")
            .min(0)
            .less_than(1));
  s.add(Float("factor_max", 4.0, "Upper clamp of the compression-stage factor.").min(0));
  s.add(Float("factor_min", 0.5, "Lower clamp of the compression-stage factor.").min(0));
  s.add(Float("factor_threshold", 0.1,
              "Largest relative change of the factor from one step to the next.")
            .min(0));
  s.add(bucket_mb_param());
  return s;
}

OnebitLamb::OnebitLamb(loom::sdk::Context& ctx) : Onebit(ctx, Variant::kOnebitLamb) {
  freeze_step_ = static_cast<uint64_t>(ctx.get_int("freeze_step"));
  max_coeff_ = ctx.get_float("max_coeff");
  min_coeff_ = ctx.get_float("min_coeff");
  coeff_beta_ = ctx.get_float("coeff_beta");
  factor_max_ = ctx.get_float("factor_max");
  factor_min_ = ctx.get_float("factor_min");
  factor_threshold_ = ctx.get_float("factor_threshold");
}

void OnebitLamb::validate_params(loom::sdk::Context& params) {
  for (const auto& [lo, hi] :
       {std::pair{"min_coeff", "max_coeff"}, std::pair{"factor_min", "factor_max"}}) {
    if (params.get_float(lo) > params.get_float(hi)) {
      throw loom::sdk::Error(LOOM_ERR_INVALID_ARGUMENT,
                             std::string(lo) + " " + std::to_string(params.get_float(lo)) +
                                 " is above " + hi + " " + std::to_string(params.get_float(hi)),
                             lo);
    }
  }
}

void OnebitLamb::algorithm_step(const std::vector<StepGroup>& groups, double lr, uint64_t t) {
  if (t <= freeze_step_) {
    allreduce_avg(flat_);
    warmup_update(groups, lr, t);
    return;
  }
  if (!scaling_set_) scales_ = momentum_scales(groups);
  // m_prev = m, then the scaled momentum (the gradient folded in) is averaged.
  ensure(prev_, total_);
  be().lamb_momentum(momentum_segments(groups), m_.data(), flat_.data(), prev_.data(),
                     loom::optim::decay_of(beta1_));
  compressed(m_);
  compression_update(groups, lr, t);
}

void OnebitLamb::warmup_update(const std::vector<StepGroup>& groups, double lr, uint64_t t) {
  const float eps = static_cast<float>(eps_);
  const loom::optim::Decay b1 = loom::optim::decay_of(beta1_);
  const loom::optim::Decay b2 = loom::optim::decay_of(beta2_);
  const std::size_t count = offsets_.size() - 1;
  const float inv_bc1 = static_cast<float>(1.0 / bc(beta1_, t));
  const float inv_bc2 = static_cast<float>(1.0 / std::sqrt(bc(beta2_, t)));
  Segments segs = segments(groups, Groups::kAll, false, [](const StepGroup& g, Segment& s) {
    s.wd = static_cast<float>(g.weight_decay);
  });
  std::vector<double> sums(2 * count, 0.0);
  be().lamb_warmup_moments(segs, flat_.data(), m_.data(), v_.data(), b1, b2, inv_bc1, inv_bc2, eps,
                           sums.data());
  std::size_t k = 0;
  for (const auto& g : groups) {
    for (std::size_t i = 0; i < g.tensors.size(); ++i) {
      const std::size_t idx = k++;
      const double sp = sums[2 * idx];
      const double su = sums[2 * idx + 1];
      double coeff = 1.0;
      if (sp > 0.0 && su > 0.0) {
        coeff = std::clamp(std::sqrt(sp) / std::sqrt(su), min_coeff_, max_coeff_);
      }
      TensorState& s = lamb_[idx];
      if (coeff != 1.0)
        s.lamb_coeff_freeze = coeff_beta_ * s.lamb_coeff_freeze + (1.0 - coeff_beta_) * coeff;
      segs[idx].step = static_cast<float>(lr * g.lr_scale * coeff);
    }
  }
  be().lamb_warmup_apply(segs, m_.data(), v_.data(), b1, b2, inv_bc1, inv_bc2, eps);
  if (t == freeze_step_) assign_copy(aux_, v_);  // v_fresh starts from the frozen variance
}

// Equalise the tensors' momentum magnitudes under the one 1-bit scale.
std::vector<double> OnebitLamb::momentum_scales(const std::vector<StepGroup>& groups) {
  const std::size_t count = offsets_.size() - 1;
  std::vector<double> squares(count, 0.0);
  be().sum_squares(segments(groups), m_.data(), squares.data());
  std::vector<double> rms(count, 0.0);
  double sum = 0.0;
  std::size_t nonzero = 0;
  for (std::size_t j = 0; j < count; ++j) {
    const std::size_t n = offsets_[j + 1] - offsets_[j];
    rms[j] = n > 0 ? std::sqrt(squares[j] / static_cast<double>(n)) : 0.0;
    if (rms[j] > 0.0) {
      sum += rms[j];
      ++nonzero;
    }
  }
  const double united = nonzero > 0 ? sum / static_cast<double>(nonzero) : 1.0;
  std::vector<double> scales(count, 1.0);
  for (std::size_t j = 0; j < count; ++j) {
    scales[j] = rms[j] > 0.0 ? united / rms[j] : 1.0;  // guard: zero momentum
  }
  return scales;
}

Segments OnebitLamb::momentum_segments(const std::vector<StepGroup>& groups) const {
  Segments segs = segments(groups, Groups::kAll, /*masks=*/true);
  for (std::size_t j = 0; j < segs.size(); ++j) {
    segs[j].scale = static_cast<float>(scaling_set_ ? lamb_[j].scaling_coeff : scales_[j]);
  }
  return segs;
}

// After the exchange: m holds the averaged scaled momentum, prev_ the momentum before it.
void OnebitLamb::compression_update(const std::vector<StepGroup>& groups, double lr, uint64_t t) {
  if (!scaling_set_) {
    for (std::size_t j = 0; j < scales_.size(); ++j) lamb_[j].scaling_coeff = scales_[j];
    scaling_set_ = true;
  }
  if (aux_.size() == 0 || t == 1) assign_copy(aux_, v_);  // freeze_step 0: no warmup at all
  const float eps = static_cast<float>(eps_);
  const loom::optim::Decay b1 = loom::optim::decay_of(beta1_);
  const loom::optim::Decay b2 = loom::optim::decay_of(beta2_);
  const std::size_t count = offsets_.size() - 1;
  const double bc1 = bc(beta1_, t);
  const float inv_bc1 = static_cast<float>(1.0 / bc1);
  const float inv_bc2 = static_cast<float>(1.0 / std::sqrt(bc(beta2_, freeze_step_)));
  // v_fresh continues v's average past the freeze, so its bias correction is at step t.
  const float inv_bc2_fresh = static_cast<float>(1.0 / std::sqrt(bc(beta2_, t)));
  Segments segs = segments(groups, Groups::kAll, /*masks=*/true);
  std::size_t k = 0;
  for (const auto& g : groups) {
    for (std::size_t i = 0; i < g.tensors.size(); ++i) {
      const std::size_t j = k++;
      segs[j].scale = static_cast<float>(1.0 / lamb_[j].scaling_coeff);
      segs[j].wd = static_cast<float>(g.weight_decay);
    }
  }
  std::vector<LambPostStats> stats(count);
  be().lamb_post(segs, m_.data(), prev_.data(), v_.data(), aux_.data(), b1, b2, inv_bc1, inv_bc2,
                 inv_bc2_fresh, eps, stats.data());
  k = 0;
  for (const auto& g : groups) {
    const float wd = static_cast<float>(g.weight_decay);
    for (std::size_t i = 0; i < g.tensors.size(); ++i) {
      const std::size_t j = k++;
      TensorState& s = lamb_[j];
      double f = stats[j].factor;
      if (wd > 0.0f && stats[j].u2 > 0.0) {
        const double r = std::min(1.0, std::sqrt(stats[j].pre2) / std::sqrt(stats[j].u2));
        f = f * r + (1.0 - r);
      }
      f = std::clamp(f, factor_min_, factor_max_);
      f = std::clamp(f, s.last_factor * (1.0 - factor_threshold_),
                     s.last_factor * (1.0 + factor_threshold_));
      s.last_factor = f;
      segs[j].step = static_cast<float>(lr * g.lr_scale * s.lamb_coeff_freeze * f);
    }
  }
  be().lamb_apply(segs, m_.data(), v_.data(), inv_bc1, inv_bc2, eps);
}

// Buckets: the warmup averages the gradients; after it each bucket folds the gradient into
// its scaled momentum (prev_ keeps the momentum before, for lamb_post and for a skipped step)
// and sends it. The per-tensor norms come after the exchange, over whole tensors, so a bucket
// may cut a tensor.
Onebit::Exchange OnebitLamb::bucket_exchange(uint64_t t) const {
  return t <= freeze_step_ ? Exchange::kAverage : Exchange::kCompressed;
}

void OnebitLamb::bucket_begin(const std::vector<StepGroup>& groups) {
  if (!scaling_set_) scales_ = momentum_scales(groups);  // from m before any bucket changes it
  ensure(prev_, total_);
}

void OnebitLamb::bucket_prepare(const std::vector<StepGroup>& groups, std::size_t lo, std::size_t n,
                                bool zeros) {
  if (zeros) {
    be().copy(prev_.data() + lo, m_.data() + lo, n);
    be().zero(m_.data() + lo, n);
    return;
  }
  be().lamb_momentum(clip(momentum_segments(groups), lo, n), m_.data(), flat_.data(), prev_.data(),
                     loom::optim::decay_of(beta1_));
}

void OnebitLamb::bucket_restore(std::size_t lo, std::size_t n) {
  be().copy(m_.data() + lo, prev_.data() + lo, n);
}

void OnebitLamb::bucket_finish(const std::vector<StepGroup>& groups, Exchange e, double lr,
                               uint64_t t) {
  if (e == Exchange::kAverage) {
    warmup_update(groups, lr, t);
  } else {
    compression_update(groups, lr, t);
  }
}

}  // namespace loom::optim::onebit
