// 1-bit Adam (onebit_adam): Adam warmup with uncompressed gradient averaging, then the
// variance frozen and the momentum averaged with the 1-bit compressed allreduce. The shared
// part (layout, buffers, collectives, state format) is in onebit.hpp.
#include <algorithm>

#include "onebit.hpp"

namespace loom::optim::onebit {

loom::sdk::Schema OnebitAdam::schema() {
  loom::sdk::Schema s = common_schema();
  s.add(freeze_step_param());
  s.add(loom::sdk::Float(
            "bucket_mb", 0.0,
            "> 0: exchange the gradients (warmup) or the momentum (compression) in buckets of "
            "this many MiB of the flat layout, each started as soon as its gradients are final, "
            "so that a caller announcing them (grads_ready; the trainer's [gradients] overlap) "
            "overlaps the exchange with its backward. Each bucket has its own scales, so other "
            "bits than one bucket; the same bits with or without the overlap. 0: one exchange "
            "of everything (DeepSpeed's numerics). Not with shard_state or hierarchical.")
            .range(0, 1048576));
  return s;
}

OnebitAdam::OnebitAdam(loom::sdk::Context& ctx) : Onebit(ctx, Variant::kOnebitAdam) {
  freeze_step_ = static_cast<uint64_t>(ctx.get_int("freeze_step"));
  const double mb = ctx.get_float("bucket_mb");
  if (mb > 0 && (shard_ || hierarchical_)) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT,
                std::string("onebit_adam: bucket_mb > 0 cannot be combined with ") +
                    (shard_ ? "shard_state = true" : "hierarchical = true") +
                    " (their exchanges are one piece)");
  }
  // At least one element a bucket; the compressed allreduce rounds it to the codec's unit.
  bucket_elements_ = mb > 0 ? std::max<uint64_t>(1, static_cast<uint64_t>(mb * 262144.0)) : 0;
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

}  // namespace loom::optim::onebit
