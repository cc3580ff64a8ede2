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
  if (shard_) {
    sharded_step(groups, lr, t);
    return;
  }
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
  const float inv_bc1 = static_cast<float>(1.0 / bc(beta1_, t));
  const float inv_bc2 = static_cast<float>(1.0 / std::sqrt(bc(beta2_, t)));
  Segments segs = segments(groups, Groups::kAll, false, [](const StepGroup& g, Segment& s) {
    s.wd = static_cast<float>(g.weight_decay);
  });
  std::vector<double> sums(2 * segs.size(), 0.0);
  be().lamb_warmup_moments(segs, flat_.data(), m_.data(), v_.data(), b1, b2, inv_bc1, inv_bc2, eps,
                           sums.data());
  const std::vector<double> coeff = trust_ratios(sums);
  std::size_t k = 0;
  for (const auto& g : groups) {
    for (std::size_t i = 0; i < g.tensors.size(); ++i, ++k) {
      segs[k].step = static_cast<float>(lr * g.lr_scale * coeff[k]);
    }
  }
  be().lamb_warmup_apply(segs, m_.data(), v_.data(), b1, b2, inv_bc1, inv_bc2, eps);
  if (t == freeze_step_) assign_copy(aux_, v_);  // v_fresh starts from the frozen variance
}

std::vector<double> OnebitLamb::trust_ratios(const std::vector<double>& sums) {
  std::vector<double> coeff(lamb_.size(), 1.0);
  for (std::size_t j = 0; j < coeff.size(); ++j) {
    const double sp = sums[2 * j];
    const double su = sums[2 * j + 1];
    if (sp > 0.0 && su > 0.0) {
      coeff[j] = std::clamp(std::sqrt(sp) / std::sqrt(su), min_coeff_, max_coeff_);
    }
    TensorState& s = lamb_[j];
    if (coeff[j] != 1.0) {
      s.lamb_coeff_freeze = coeff_beta_ * s.lamb_coeff_freeze + (1.0 - coeff_beta_) * coeff[j];
    }
  }
  return coeff;
}

// Equalise the tensors' momentum magnitudes under the one 1-bit scale.
std::vector<double> OnebitLamb::momentum_scales(const std::vector<StepGroup>& groups) {
  std::vector<double> squares(offsets_.size() - 1, 0.0);
  be().sum_squares(segments(groups), m_.data(), squares.data());
  return scales_of(squares);
}

std::vector<double> OnebitLamb::scales_of(const std::vector<double>& squares) const {
  const std::size_t count = squares.size();
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

void OnebitLamb::set_scales() {
  if (scaling_set_) return;
  for (std::size_t j = 0; j < scales_.size(); ++j) lamb_[j].scaling_coeff = scales_[j];
  scaling_set_ = true;
}

// After the exchange: m holds the averaged scaled momentum, prev_ the momentum before it.
void OnebitLamb::compression_update(const std::vector<StepGroup>& groups, double lr, uint64_t t) {
  set_scales();
  if (aux_.size() == 0 || t == 1) assign_copy(aux_, v_);  // freeze_step 0: no warmup at all
  Segments segs = segments(groups, Groups::kAll, /*masks=*/true);
  std::size_t k = 0;
  for (const auto& g : groups) {
    for (std::size_t i = 0; i < g.tensors.size(); ++i, ++k) {
      segs[k].scale = static_cast<float>(1.0 / lamb_[k].scaling_coeff);
      segs[k].wd = static_cast<float>(g.weight_decay);
    }
  }
  std::vector<LambPostStats> stats(segs.size());
  be().lamb_post(segs, m_.data(), prev_.data(), v_.data(), aux_.data(),
                 loom::optim::decay_of(beta1_), loom::optim::decay_of(beta2_), inv_bc1(t),
                 inv_bc2_frozen(), inv_bc2_fresh(t), static_cast<float>(eps_), stats.data());
  const std::vector<double> f = factors(groups, stats);
  k = 0;
  for (const auto& g : groups) {
    for (std::size_t i = 0; i < g.tensors.size(); ++i, ++k) {
      segs[k].step = static_cast<float>(lr * g.lr_scale * lamb_[k].lamb_coeff_freeze * f[k]);
    }
  }
  be().lamb_apply(segs, m_.data(), v_.data(), inv_bc1(t), inv_bc2_frozen(),
                  static_cast<float>(eps_));
}

float OnebitLamb::inv_bc1(uint64_t t) const { return static_cast<float>(1.0 / bc(beta1_, t)); }
float OnebitLamb::inv_bc2_frozen() const {
  return static_cast<float>(1.0 / std::sqrt(bc(beta2_, freeze_step_)));
}
// v_fresh continues v's average past the freeze, so its bias correction is at step t.
float OnebitLamb::inv_bc2_fresh(uint64_t t) const {
  return static_cast<float>(1.0 / std::sqrt(bc(beta2_, t)));
}

std::vector<double> OnebitLamb::factors(const std::vector<StepGroup>& groups,
                                        const std::vector<LambPostStats>& stats) {
  std::vector<double> out(stats.size(), 1.0);
  std::size_t j = 0;
  for (const auto& g : groups) {
    const float wd = static_cast<float>(g.weight_decay);
    for (std::size_t i = 0; i < g.tensors.size(); ++i, ++j) {
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
      out[j] = f;
    }
  }
  return out;
}

// shard_state (host memory): as onebit_adam's sharded step (onebit_shard.cpp), with LAMB's
// per-tensor norms summed over the ranks' pieces. Rank r keeps m, v and v_fresh of its slice;
// a step reduce-scatters the gradients (fp32 in the warmup; after the freeze, each tensor's
// gradient times its scale, through the compressed allreduce's worker half, then unscaled:
// the unsharded optimizer compresses the scaled momentum, which no rank holds whole here),
// updates the slice's moments, gathers each rank's per-tensor partial sums (and the factor's
// maximum) so that every rank takes the same trust ratios, steps the slice's parameters and
// allgathers them in fp32.
void OnebitLamb::sharded_step(const std::vector<StepGroup>& groups, double lr, uint64_t t) {
  if (total_ == 0) return;
  const std::size_t c = slice_.size();
  const uint64_t hi = std::min<uint64_t>(shard_lo_ + c, total_);
  const std::size_t count = offsets_.size() - 1;
  const float eps = static_cast<float>(eps_);
  const loom::optim::Decay b1 = loom::optim::decay_of(beta1_);
  const loom::optim::Decay b2 = loom::optim::decay_of(beta2_);
  be().zero(flat_.data() + total_, padded_ - total_);  // the padding averages zeros
  std::vector<std::size_t> group_of;
  std::vector<std::size_t> tensor_of;
  Segments segs =
      pieces(groups, shard_lo_, hi, shard_lo_, /*masks=*/t > freeze_step_, &group_of, &tensor_of);
  for (std::size_t j = 0; j < segs.size(); ++j) {
    segs[j].wd = static_cast<float>(groups[group_of[j]].weight_decay);
  }
  // Each tensor's sums over this rank's pieces, stride values each, then over the ranks.
  const auto over_ranks = [&](const std::vector<double>& per_piece, std::size_t stride,
                              bool last_is_max) {
    std::vector<double> part(count * stride, 0.0);
    for (std::size_t j = 0; j < segs.size(); ++j) {
      for (std::size_t e = 0; e < stride; ++e) {
        double& into = part[tensor_of[j] * stride + e];
        const double x = per_piece[j * stride + e];
        into = last_is_max && e + 1 == stride ? std::max(into, x) : into + x;
      }
    }
    const std::vector<double> all = gather_parts(part);
    std::vector<double> total(part.size(), 0.0);
    for (std::size_t r = 0; r < all.size() / part.size(); ++r) {
      for (std::size_t i = 0; i < part.size(); ++i) {
        const double x = all[r * part.size() + i];
        total[i] = last_is_max && i % stride + 1 == stride ? std::max(total[i], x) : total[i] + x;
      }
    }
    return total;
  };
  if (t <= freeze_step_) {
    reduce_scatter_grads(/*compressed_run=*/false);
    const float ibc1 = inv_bc1(t);
    const float ibc2 = inv_bc2_fresh(t);  // the warmup's v is live: its correction at step t
    std::vector<double> sums(2 * segs.size(), 0.0);
    be().lamb_warmup_moments(segs, slice_.data(), m_.data(), v_.data(), b1, b2, ibc1, ibc2, eps,
                             sums.data());
    const std::vector<double> coeff = trust_ratios(over_ranks(sums, 2, false));
    for (std::size_t j = 0; j < segs.size(); ++j) {
      segs[j].step = static_cast<float>(lr * groups[group_of[j]].lr_scale * coeff[tensor_of[j]]);
    }
    be().lamb_warmup_apply(segs, m_.data(), v_.data(), b1, b2, ibc1, ibc2, eps);
    if (t == freeze_step_) assign_copy(aux_, v_);
    allgather_params(groups);
    return;
  }
  if (aux_.size() == 0 || t == 1) assign_copy(aux_, v_);
  if (!scaling_set_) {
    std::vector<double> squares(segs.size(), 0.0);
    be().sum_squares(segs, m_.data(), squares.data());
    scales_ = scales_of(over_ranks(squares, 1, false));
    set_scales();
  }
  // The gradient scaled per tensor (scale * (0 * g + 1 * g)), compressed, unscaled.
  Segments scaled = segments(groups);
  for (std::size_t j = 0; j < scaled.size(); ++j) {
    scaled[j].scale = static_cast<float>(lamb_[j].scaling_coeff);
  }
  be().lamb_momentum(scaled, flat_.data(), flat_.data(), nullptr, loom::optim::Decay{0.0f, 1.0f});
  reduce_scatter_grads(/*compressed_run=*/true);
  Segments unscale = segs;
  for (std::size_t j = 0; j < unscale.size(); ++j) {
    unscale[j].scale = static_cast<float>(1.0 / lamb_[tensor_of[j]].scaling_coeff);
  }
  be().lamb_momentum(unscale, slice_.data(), slice_.data(), nullptr,
                     loom::optim::Decay{0.0f, 1.0f});
  // m_prev = m, m = the momentum with the averaged gradient; then lamb_post as unsharded
  // (its scale 1: the momentum is not scaled here).
  ensure(prev_, c);
  for (Segment& s : segs) s.scale = 1.0f;
  be().lamb_momentum(segs, m_.data(), slice_.data(), prev_.data(), b1);
  std::vector<LambPostStats> piece_stats(segs.size());
  be().lamb_post(segs, m_.data(), prev_.data(), v_.data(), aux_.data(), b1, b2, inv_bc1(t),
                 inv_bc2_frozen(), inv_bc2_fresh(t), eps, piece_stats.data());
  std::vector<double> flat_stats(3 * segs.size());
  for (std::size_t j = 0; j < segs.size(); ++j) {
    flat_stats[3 * j] = piece_stats[j].pre2;
    flat_stats[3 * j + 1] = piece_stats[j].u2;
    flat_stats[3 * j + 2] = piece_stats[j].factor;
  }
  const std::vector<double> summed = over_ranks(flat_stats, 3, true);
  std::vector<LambPostStats> stats(count);
  for (std::size_t j = 0; j < count; ++j) {
    stats[j] = {summed[3 * j], summed[3 * j + 1], static_cast<float>(summed[3 * j + 2])};
  }
  const std::vector<double> f = factors(groups, stats);
  for (std::size_t j = 0; j < segs.size(); ++j) {
    const std::size_t k = tensor_of[j];
    segs[j].step =
        static_cast<float>(lr * groups[group_of[j]].lr_scale * lamb_[k].lamb_coeff_freeze * f[k]);
  }
  be().lamb_apply(segs, m_.data(), v_.data(), inv_bc1(t), inv_bc2_frozen(), eps);
  allgather_params(groups);
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
