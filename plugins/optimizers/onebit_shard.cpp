// onebit_adam with shard_state = true (onebit.hpp, "Sharded state"): each rank keeps m and v
// for its slice of the flat layout only; and the collectives onebit_lamb's sharded step shares
// (onebit_lamb.cpp).
//
// A step, on rank r of n with slice [lo, lo + c):
//   1. flat_ = the local gradients (padded with zeros to n * c elements);
//   2. slice_ = the ranks' average of flat_[lo, lo + c): an fp32 reduce-scatter in the warmup,
//      the compressed allreduce's worker half after freeze_step (each rank's whole gradient
//      encoded with its error feedback, only the server's average of the slice kept);
//   3. Adam on the slice's parameters (both moments in the warmup; the momentum only, v frozen,
//      after), exp_avg_mask applied to the momentum as in the unsharded path;
//   4. slice_ = the slice's updated parameters, allgathered into flat_ and copied into the
//      other slices' parameters (and their low-precision copies); or, after freeze_step with
//      shard_gather = "compressed", the change of the slice's parameters, encoded with the
//      server error, allgathered and added by every rank to its tensors (its own slice too:
//      every rank adds the same bits to the same values, so the replicas stay identical, and
//      what the encoding left out goes into the next step's change).
// Per rank it keeps 2c floats of moments where the unsharded optimizer keeps 2nc, beside the
// compressed allreduce's worker error (nc: every rank encodes its whole gradient). The
// allgather of fp32 parameters costs what the second half of an fp32 allreduce does; the
// compressed one what the second half of the compressed allreduce does, but with 1 bit the
// change of an Adam step (sign and one scale per slice) can diverge: docs/optimizers.md has
// the figures and the advice (an 8-bit codec). Host or CUDA
// memory: every loop is a backend primitive and every collective runs on the step's stream.
#include "onebit.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace loom::optim::onebit {

namespace {

DLTensor flat_view(float* data, DLDevice device, int64_t* shape) {
  return loom::sdk::flat_view(data, device, DLDataType{kDLFloat, 32, 1}, shape);
}

}  // namespace

uint64_t Onebit::shard_numel(uint64_t total) const {
  if (total == 0) return 0;
  loom_codec_layout layout{};
  layout.struct_size = LOOM_CODEC_LAYOUT_SIZE;
  layout.elements = total;
  layout.world_size = world_;
  codec_.call(&loom_codec_v1::layout, &layout);
  if (layout.padded_elements < total ||
      layout.padded_elements % static_cast<uint64_t>(world_) != 0) {
    throw Error(LOOM_ERR_INTERNAL, "codec '" + codec_.name() + "' returned an invalid layout (" +
                                       std::to_string(layout.padded_elements) + " padded for " +
                                       std::to_string(total) + " elements)");
  }
  return layout.padded_elements / static_cast<uint64_t>(world_);
}

Segments Onebit::pieces(const std::vector<StepGroup>& groups, uint64_t lo, uint64_t hi,
                        uint64_t base, bool masks, std::vector<std::size_t>* group_of,
                        std::vector<std::size_t>* tensor_of) const {
  Segments all = segments(groups, Groups::kAll, masks);
  for (Segment& s : all) {
    s.g = s.p;  // the parameters, for copies
    s.gtype = DType::kF32;
  }
  std::vector<std::size_t> kept;
  Segments out = clip(all, lo, hi > lo ? hi - lo : 0, &kept);
  for (Segment& s : out) s.offset -= base;
  if (tensor_of != nullptr) *tensor_of = kept;
  if (group_of != nullptr) {
    std::vector<std::size_t> group(all.size());
    std::size_t k = 0;
    for (std::size_t gi = 0; gi < groups.size(); ++gi) {
      for (std::size_t i = 0; i < groups[gi].tensors.size(); ++i) group[k++] = gi;
    }
    group_of->clear();
    for (const std::size_t j : kept) group_of->push_back(group[j]);
  }
  return out;
}

std::vector<double> Onebit::gather_parts(const std::vector<double>& part) {
  if (world_ == 1) return part;
  std::vector<double> all(part.size() * static_cast<std::size_t>(world_));
  int64_t send_shape[1] = {static_cast<int64_t>(part.size())};
  int64_t recv_shape[1] = {static_cast<int64_t>(all.size())};
  constexpr DLDataType kF64{kDLFloat, 64, 1};
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-const-cast): the send buffer is only read
  DLTensor send{const_cast<double*>(part.data()), {kDLCPU, 0}, 1, kF64, send_shape, nullptr, 0};
  DLTensor recv{all.data(), {kDLCPU, 0}, 1, kF64, recv_shape, nullptr, 0};
  loom_allgather_args a{LOOM_ALLGATHER_ARGS_SIZE, 0, &send, &recv, stream_};
  // Not counted as traffic: a few doubles per tensor, like the finite check's flag.
  comm_.call(&loom_comm_v1::allgather, &a);
  return all;
}

void Onebit::reduce_scatter_grads(bool compressed_run) {
  const std::size_t c = slice_.size();
  if (world_ == 1) {  // as the unsharded path: nothing to average, nothing compressed
    be().copy(slice_.data(), flat_.data(), c);
    return;
  }
  int64_t send_shape[1] = {static_cast<int64_t>(padded_)};
  int64_t recv_shape[1] = {static_cast<int64_t>(c)};
  DLTensor send = flat_view(flat_.data(), device_, send_shape);
  DLTensor recv = flat_view(slice_.data(), device_, recv_shape);
  if (compressed_run) {
    counted([&] { car_->reduce_scatter(send, recv, stream_); }, /*compressed_run=*/true);
    return;
  }
  if (on_cuda() && !comm_.provides(&loom_comm_v1::reduce_scatter)) {
    // A transport without reduce_scatter (built before ABI 1.6): the SDK's fallback works on
    // host memory only, so average the whole buffer on the device and keep the slice.
    allreduce_avg(flat_);
    be().copy(slice_.data(), flat_.data() + shard_lo_, c);
    return;
  }
  if (warmup_bf16_) {
    // bf16 on the wire: the padded buffer rounded once, reduce-scattered, the slice widened.
    to_bf16(flat_, padded_, wire_);
    ensure(wire_slice_, (c + 1) / 2);
    constexpr DLDataType kBf16{kDLBfloat, 16, 1};
    DLTensor send16{wire_.data(), device_, 1, kBf16, send_shape, nullptr, 0};
    DLTensor recv16{wire_slice_.data(), device_, 1, kBf16, recv_shape, nullptr, 0};
    const loom_reduce_scatter_args a{LOOM_REDUCE_SCATTER_ARGS_SIZE, LOOM_REDUCE_AVG, &send16,
                                     &recv16, stream_};
    counted([&] { loom::sdk::comm_reduce_scatter(comm_, a); }, /*compressed_run=*/false);
    from_bf16(wire_slice_, c, slice_);
    return;
  }
  const loom_reduce_scatter_args a{LOOM_REDUCE_SCATTER_ARGS_SIZE, LOOM_REDUCE_AVG, &send, &recv,
                                   stream_};
  counted([&] { loom::sdk::comm_reduce_scatter(comm_, a); }, /*compressed_run=*/false);
}

void Onebit::allgather_params(const std::vector<StepGroup>& groups) {
  const std::size_t c = slice_.size();
  const uint64_t hi = std::min<uint64_t>(shard_lo_ + c, total_);
  // The slice's parameters, zeros past the last tensor (they become flat_'s zero padding).
  const std::size_t filled = hi > shard_lo_ ? hi - shard_lo_ : 0;
  be().zero(slice_.data() + filled, c - filled);
  be().load_grad(pieces(groups, shard_lo_, hi, shard_lo_, /*masks=*/false), slice_.data(), 1.0f);
  if (world_ == 1) return;
  int64_t send_shape[1] = {static_cast<int64_t>(c)};
  int64_t recv_shape[1] = {static_cast<int64_t>(padded_)};
  DLTensor send = flat_view(slice_.data(), device_, send_shape);
  DLTensor recv = flat_view(flat_.data(), device_, recv_shape);
  loom_allgather_args a{LOOM_ALLGATHER_ARGS_SIZE, 0, &send, &recv, stream_};
  counted([&] { comm_.call(&loom_comm_v1::allgather, &a); }, /*compressed_run=*/false);
  // Every other slice into the tensors; this rank's own parameters are already updated.
  Segments others = pieces(groups, 0, shard_lo_, 0, /*masks=*/false);
  const Segments after = pieces(groups, hi, total_, 0, /*masks=*/false);
  others.insert(others.end(), after.begin(), after.end());
  for (const Segment& s : others) be().copy(s.p, flat_.data() + s.offset, s.n);
  be().copy_out(others);
}

void Onebit::sharded_adam(const std::vector<StepGroup>& groups, double lr_base, uint64_t t,
                          uint64_t freeze_step) {
  if (total_ == 0) return;
  const std::size_t c = slice_.size();
  const uint64_t hi = std::min<uint64_t>(shard_lo_ + c, total_);
  be().zero(flat_.data() + total_, padded_ - total_);  // the padding averages zeros
  const bool compressing = t > freeze_step;
  reduce_scatter_grads(compressing);
  if (!compressing) {
    // Warmup: the fused Adam kernel on the slice's pieces, with the averaged gradient (one
    // call per group: its learning rate and weight decay).
    std::vector<std::size_t> group_of;
    const Segments segs = pieces(groups, shard_lo_, hi, shard_lo_, /*masks=*/false, &group_of);
    for (std::size_t gi = 0; gi < groups.size(); ++gi) {
      const loom::optim::AdamHyper h =
          adam_hyper(groups[gi], lr_base, bc(beta1_, t), bc(beta2_, t));
      std::vector<loom::optim::TensorRef> refs;
      for (std::size_t j = 0; j < segs.size(); ++j) {
        if (group_of[j] != gi) continue;
        const Segment& s = segs[j];
        loom::optim::TensorRef r;
        r.p = s.p;
        r.g = slice_.data() + s.offset;
        r.gtype = DType::kF32;
        r.m = m_.data() + s.offset;
        r.v = v_.data() + s.offset;
        r.low = s.low;
        r.ltype = s.ltype;
        r.n = s.n;
        refs.push_back(r);
      }
      if (!refs.empty()) be().adam(refs, h);
    }
  } else {
    // Compression: the momentum of the slice from the averaged gradient, v frozen (its bias
    // correction at freeze_step), exp_avg_mask on the momentum.
    be().momentum(m_.data(), slice_.data(), c, loom::optim::decay_of(beta1_));
    const float inv_bc2 = static_cast<float>(1.0 / std::sqrt(bc(beta2_, freeze_step)));
    const double bc1 = bc(beta1_, t);
    std::vector<std::size_t> group_of;
    Segments segs = pieces(groups, shard_lo_, hi, shard_lo_, /*masks=*/true, &group_of);
    for (std::size_t j = 0; j < segs.size(); ++j) {
      const StepGroup& g = groups[group_of[j]];
      const double lr = lr_base * g.lr_scale;
      segs[j].decay = static_cast<float>(1.0 - lr * g.weight_decay);
      segs[j].step = static_cast<float>(lr / bc1);
    }
    if (!gather_fp32_) {
      share_update(groups, std::move(segs), inv_bc2);
      return;
    }
    be().apply_adam(segs, m_.data(), v_.data(), inv_bc2, static_cast<float>(eps_));
  }
  allgather_params(groups);
}

void Onebit::share_update(const std::vector<StepGroup>& groups, Segments segs, float inv_bc2) {
  const std::size_t c = slice_.size();
  const uint64_t hi = std::min<uint64_t>(shard_lo_ + c, total_);
  // The slice's parameters before the step (old_) and after it (slice_, stepped as a copy:
  // this rank's tensors change below, by the shared bits, like every other rank's).
  ensure(old_, c);
  const std::size_t filled = hi > shard_lo_ ? hi - shard_lo_ : 0;
  be().zero(old_.data() + filled, c - filled);
  be().load_grad(pieces(groups, shard_lo_, hi, shard_lo_, /*masks=*/false), old_.data(), 1.0f);
  be().copy(slice_.data(), old_.data(), c);
  for (Segment& s : segs) {
    s.p = slice_.data() + s.offset;
    s.low = nullptr;
  }
  be().apply_adam(segs, m_.data(), v_.data(), inv_bc2, static_cast<float>(eps_));
  // slice_ = 1 * slice_ + (-1) * old_: the change, exactly (one rounding of new - old).
  be().momentum(slice_.data(), old_.data(), c, loom::optim::Decay{1.0f, -1.0f});
  if (world_ == 1) {  // nothing to share: the change as it is
    be().add_update(pieces(groups, 0, total_, 0, /*masks=*/false), slice_.data());
    return;
  }
  // Encoded with this rank's server error (what the encoding leaves out is added to the next
  // step's change), allgathered, decoded: every rank adds the same bits to the same values.
  int64_t send_shape[1] = {static_cast<int64_t>(c)};
  int64_t recv_shape[1] = {static_cast<int64_t>(padded_)};
  DLTensor send = flat_view(slice_.data(), device_, send_shape);
  DLTensor recv = flat_view(flat_.data(), device_, recv_shape);
  counted([&] { car_->allgather(send, recv, stream_); }, /*compressed_run=*/true);
  be().add_update(pieces(groups, 0, total_, 0, /*masks=*/false), flat_.data());
}

}  // namespace loom::optim::onebit
