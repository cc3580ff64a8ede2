// 1-bit Adam (onebit_adam): Adam warmup with uncompressed gradient averaging, then the
// variance frozen and the momentum averaged with the 1-bit compressed allreduce. The shared
// part (layout, buffers, collectives, state format) is in onebit.hpp.
#include "onebit.hpp"

namespace loom::optim::onebit {

loom::sdk::Schema OnebitAdam::schema() {
  loom::sdk::Schema s = common_schema();
  s.add(freeze_step_param());
  s.add(bucket_mb_param());
  return s;
}

OnebitAdam::OnebitAdam(loom::sdk::Context& ctx) : Onebit(ctx, Variant::kOnebitAdam) {
  freeze_step_ = static_cast<uint64_t>(ctx.get_int("freeze_step"));
}

void OnebitAdam::algorithm_step(const std::vector<StepGroup>& groups, double lr, uint64_t t) {
  if (shard_) {
    sharded_adam(groups, lr, t, freeze_step_);
    return;
  }
  if (t <= freeze_step_) {
    allreduce_avg(flat_);
    adam_full(groups, lr, bc(beta1_, t), bc(beta2_, t));
    return;
  }
  // Compression: local momentum, averaged with the compressed allreduce, times the masks;
  // v stays frozen (and so does its bias correction, at freeze_step).
  if (!any_non_freeze()) {
    momentum_flat(flat_);
    compressed(m_);
    apply_adam(groups, lr, bc(beta1_, t), bc(beta2_, freeze_step_), Groups::kAll,
               /*masks=*/true);
    return;
  }
  // non_freeze groups: as in warmup (their gradients averaged with one uncompressed
  // allreduce, both moments updated, bias corrections at step t).
  ensure(subset_, total_ - compressed_numel_);
  copy_subset(flat_, subset_, /*non_freeze=*/true, /*gather=*/true);
  allreduce_avg(subset_);
  copy_subset(flat_, subset_, /*non_freeze=*/true, /*gather=*/false);
  adam_full(groups, lr, bc(beta1_, t), bc(beta2_, t), Groups::kNonFreeze);
  be().momentum_subset(segments(groups, Groups::kCompressed), m_.data(), flat_.data(),
                       loom::optim::decay_of(beta1_));
  compressed(m_);
  apply_adam(groups, lr, bc(beta1_, t), bc(beta2_, freeze_step_), Groups::kCompressed,
             /*masks=*/true);
}

// Buckets: the warmup averages the gradients; after the freeze each bucket updates its
// momentum and sends it; the step itself waits for every bucket.
Onebit::Exchange OnebitAdam::bucket_exchange(uint64_t t) const {
  return t <= freeze_step_ ? Exchange::kAverage : Exchange::kCompressed;
}

void OnebitAdam::bucket_begin(const std::vector<StepGroup>& /*groups*/) { ensure(m_keep_, total_); }

void OnebitAdam::bucket_prepare(const std::vector<StepGroup>& /*groups*/, std::size_t lo,
                                std::size_t n, bool zeros) {
  be().copy(m_keep_.data() + lo, m_.data() + lo, n);
  if (zeros) {
    be().zero(m_.data() + lo, n);
  } else {
    be().momentum(m_.data() + lo, flat_.data() + lo, n, loom::optim::decay_of(beta1_));
  }
}

void OnebitAdam::bucket_restore(std::size_t lo, std::size_t n) {
  be().copy(m_.data() + lo, m_keep_.data() + lo, n);
}

void OnebitAdam::bucket_finish(const std::vector<StepGroup>& groups, Exchange e, double lr,
                               uint64_t t) {
  if (e == Exchange::kAverage) {
    adam_full(groups, lr, bc(beta1_, t), bc(beta2_, t));
  } else {
    apply_adam(groups, lr, bc(beta1_, t), bc(beta2_, freeze_step_), Groups::kAll,
               /*masks=*/true);
  }
}

}  // namespace loom::optim::onebit
