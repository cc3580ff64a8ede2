// The 1-bit family in buckets (bucket_mb > 0), and their overlap with the backward
// (grads_ready).
//
// The flat layout is cut into the compressed allreduce's segments (bucket_mb each, the codec's
// unit rounded); a bucket is started once every gradient it covers is final (a caller that
// lays its tensors out in the order its backward finishes them gets buckets that complete one
// after another during the backward). What a bucket starts is the variant's (bucket_exchange):
//   kAverage:    its gradients (fp32, or rounded to bf16) averaged by a non-blocking allreduce
//                (the warmups, 0/1 Adam's variance steps);
//   kCompressed: the variant's elementwise part of the step on the bucket (bucket_prepare:
//                1-bit Adam's momentum, 1-bit LAMB's scaled momentum; nothing for 0/1 Adam's
//                1-bit gradient),
//                what a skipped step restores kept, then its segment of the compressed
//                allreduce encoded and sent (the errors kept the same way);
//   kNone:       nothing early (0/1 Adam after its variance freeze: its local steps send
//                nothing, and a sync step's update carries the step's lr, which only step()
//                has; step() runs the whole algorithm, its exchange in the same segments).
// step() marks the tensors never announced, starts what is left, waits, and only then agrees
// on the finite check (each rank checked its own gradients as it loaded them): a skipped step
// puts the buffers and the error buffers back, so the state is byte for byte what it was, as
// unbucketed. The parameters change only once the step is taken (bucket_finish). Nothing
// here depends on when a bucket started, so grads_ready() during the backward gives the bits
// step() alone gives. Host memory only (on CUDA, step() does it all, the same bits).
#include <loom/sdk/comm.hpp>

#include <chrono>
#include <string>

#include "onebit.hpp"

namespace loom::optim::onebit {

Onebit::~Onebit() = default;

namespace {

uint64_t nanoseconds_since(std::chrono::steady_clock::time_point t0) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
          .count());
}

}  // namespace

bool Onebit::bucketed() const {
  return bucket_elements_ > 0 && !shard_ && !hier_ && car_ && world_ > 1 && !on_cuda() &&
         !any_non_freeze();
}

loom::sdk::Float Onebit::bucket_mb_param() {
  return loom::sdk::Float(
             "bucket_mb", 0.0,
             "> 0: exchange in buckets of this many MiB of the flat layout, each started as soon "
             "as its gradients are final, so that a caller announcing them (grads_ready; the "
             "trainer's [gradients] overlap) overlaps the exchange with its backward. Each "
             "bucket has its own scales, so other bits than one bucket; the same bits with or "
             "without the overlap. 0: one exchange of everything (DeepSpeed's numerics). Not "
             "with shard_state or hierarchical.")
      .range(0, 1048576);
}

Segments Onebit::clip(const Segments& all, std::size_t lo, std::size_t n,
                      std::vector<std::size_t>* kept) {
  const auto size_of = [](loom::optim::DType t) -> std::size_t {
    return t == loom::optim::DType::kF32 ? 4 : 2;
  };
  Segments out;
  if (kept != nullptr) kept->clear();
  for (std::size_t j = 0; j < all.size(); ++j) {
    Segment s = all[j];
    const std::size_t b = std::max(s.offset, lo);
    const std::size_t e = std::min(s.offset + s.n, lo + n);
    if (b >= e) continue;
    const std::size_t skip = b - s.offset;
    if (s.p != nullptr) s.p += skip;
    if (s.mask != nullptr) s.mask += skip;
    if (s.low != nullptr) s.low = static_cast<std::byte*>(s.low) + skip * size_of(s.ltype);
    if (s.g != nullptr) s.g = static_cast<const std::byte*>(s.g) + skip * size_of(s.gtype);
    s.offset = b;
    s.n = e - b;
    out.push_back(s);
    if (kept != nullptr) kept->push_back(j);
  }
  return out;
}

void Onebit::grads_ready(const loom_optimizer_ready_args& args) {
  auto groups = loom::optim::collect(*args.step, weight_decay_, /*allow_cuda=*/true);
  const DLDevice device = step_device(groups);
  if (loom::sdk::is_cuda(device)) return;  // step() does it all on the stream
  try {
    if (!pending_) {
      if (bucket_elements_ == 0 || steps_ >= kMaxSteps) return;  // step() reports the limit
      check_device(device);
      device_ = device;
      stream_ = args.step->stream;
      layout(groups);
      device_set_ = true;
      if (!bucketed()) return;
      begin_pending(groups, *args.step);
    } else if (pending_->step != args.step->step) {
      throw Error(LOOM_ERR_FAILED_PRECONDITION,
                  "grads_ready for step " + std::to_string(args.step->step) + " while step " +
                      std::to_string(pending_->step) + " is in progress (call step() first)");
    }
    const std::size_t tensors = offsets_.size() - 1;
    if (args.first > tensors || args.count > tensors - args.first) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT, "grads_ready: tensors [" + std::to_string(args.first) +
                                                 ", " + std::to_string(args.first) + " + " +
                                                 std::to_string(args.count) + ") past the step's " +
                                                 std::to_string(tensors));
    }
    for (std::size_t k = args.first; k < args.first + args.count; ++k) {
      if (pending_->ready[k] != 0) {
        throw Error(LOOM_ERR_FAILED_PRECONDITION,
                    "grads_ready: tensor " + std::to_string(k) + " was announced already in step " +
                        std::to_string(pending_->step) +
                        " (its gradient may have left; a second backward before step() cannot "
                        "be announced)");
      }
    }
    mark_ready(groups, args.first, args.count);
    start_buckets(groups);
  } catch (...) {
    drop_pending();  // step() begins anew
    throw;
  }
}

void Onebit::bucketed_step(const std::vector<StepGroup>& groups,
                           const loom_optimizer_step_args& args) {
  try {
    if (!pending_) {
      begin_pending(groups, args);
    } else if (pending_->step != args.step ||
               pending_->inv_scale != static_cast<float>(1.0 / args.grad_scale)) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  "step " + std::to_string(args.step) + " (grad_scale " +
                      std::to_string(args.grad_scale) +
                      ") is not the step grads_ready began: " + std::to_string(pending_->step));
    }
    mark_ready(groups, 0, offsets_.size() - 1);
    start_buckets(groups);
    finish_pending(groups, args);
  } catch (...) {
    drop_pending();
    throw;
  }
  pending_.reset();
}

// After an error part-way: the state as it was before the step (what the buckets started
// changed, and their error buffers), the exchanges waited for.
void Onebit::drop_pending() noexcept {
  if (!pending_) return;
  try {
    Pending& p = *pending_;
    if (p.exchange == Exchange::kCompressed) {
      car_->cancel();
      for (std::size_t k = 0; k < p.begun.size(); ++k) {
        if (p.begun[k] == 0) continue;
        bucket_restore(static_cast<std::size_t>(car_->segment_offset(k)),
                       static_cast<std::size_t>(car_->segment_elements(k)));
      }
    }
  } catch (...) {  // the error that got us here is the one reported
  }
  pending_.reset();
}

void Onebit::begin_pending(const std::vector<StepGroup>& groups,
                           const loom_optimizer_step_args& args) {
  auto p = std::make_unique<Pending>();
  const uint64_t t = steps_ + 1;
  p->step = args.step;
  p->exchange = bucket_exchange(t);
  p->inv_scale = static_cast<float>(1.0 / args.grad_scale);
  const std::size_t tensors = offsets_.size() - 1;
  const std::size_t buckets = car_->segment_count();
  p->ready.assign(tensors, 0);
  p->begun.assign(buckets, 0);
  p->first.resize(buckets);
  p->last.resize(buckets);
  std::size_t j = 0;
  for (std::size_t k = 0; k < buckets; ++k) {
    const auto lo = static_cast<uint64_t>(car_->segment_offset(k));
    const uint64_t hi = lo + static_cast<uint64_t>(car_->segment_elements(k));
    while (j + 1 < tensors && offsets_[j + 1] <= lo) ++j;
    p->first[k] = j;
    std::size_t e = j;
    while (e + 1 < tensors && offsets_[e + 1] < hi) ++e;
    p->last[k] = e;
  }
  finite_.reset(device_, stream_);
  if (p->exchange == Exchange::kAverage) {
    p->shape.assign(buckets, 0);
    p->tensor.resize(buckets);
    p->args.resize(buckets);
    p->request.resize(buckets);
    if (warmup_bf16_) ensure(wire_, (total_ + 1) / 2);
    p->before.struct_size = LOOM_COMM_STATS_SIZE;
    comm_.call(&loom_comm_v1::stats, &p->before);
  } else if (p->exchange == Exchange::kCompressed) {
    bucket_begin(groups);
    int64_t shape[1] = {static_cast<int64_t>(total_)};
    DLTensor x{bucket_buffer().data(), device_, 1, DLDataType{kDLFloat, 32, 1}, shape, nullptr, 0};
    car_->begin(x, x, stream_, /*undoable=*/true);
  }
  pending_ = std::move(p);
}

// Loads the tensors' gradients (once each) into flat_ and checks them on this rank.
void Onebit::mark_ready(const std::vector<StepGroup>& groups, std::size_t first,
                        std::size_t count) {
  Pending& p = *pending_;
  Segments load;
  std::vector<FiniteInput> check;
  std::size_t k = 0;
  for (const auto& g : groups) {
    for (const auto& t : g.tensors) {
      if (k >= first && k < first + count && p.ready[k] == 0) {
        p.ready[k] = 1;
        Segment s;
        s.offset = offsets_[k];
        s.n = t.ref.n;
        s.g = t.ref.g;
        s.gtype = t.ref.gtype;
        load.push_back(s);
        check.push_back({flat_.data() + offsets_[k], loom::optim::DType::kF32, t.ref.n});
      }
      ++k;
    }
  }
  if (load.empty()) return;
  be().load_grad(load, flat_.data(), p.inv_scale);
  if (skip_nonfinite_) finite_.check(check, 1.0f, stream_);
}

// Starts every bucket whose gradients are now all final, scanning from the last one down:
// every rank announces the same tensors in the same order, so every rank starts the buckets in
// the same order (they are collectives), whatever that order is.
void Onebit::start_buckets(const std::vector<StepGroup>& groups) {
  Pending& p = *pending_;
  const std::size_t buckets = p.first.size();
  for (std::size_t i = 0; i < buckets && p.started < buckets; ++i) {
    const std::size_t k = buckets - 1 - i;
    if (p.begun[k] != 0) continue;
    bool complete = true;
    for (std::size_t j = p.first[k]; j <= p.last[k] && complete; ++j) complete = p.ready[j] != 0;
    if (!complete) continue;
    start_bucket(groups, k);
    p.begun[k] = 1;
    ++p.started;
  }
}

void Onebit::start_bucket(const std::vector<StepGroup>& groups, std::size_t k) {
  Pending& p = *pending_;
  const auto lo = static_cast<std::size_t>(car_->segment_offset(k));
  const auto n = static_cast<std::size_t>(car_->segment_elements(k));
  if (p.exchange == Exchange::kNone) return;
  if (p.exchange == Exchange::kCompressed) {
    // A rank that saw a NaN still sends the bucket the others expect (zeros); every rank
    // skips the step once they agree.
    bucket_prepare(groups, lo, n, skip_nonfinite_ && finite_.raised(stream_));
    car_->start(k);
    return;
  }
  p.shape[k] = static_cast<int64_t>(n);
  DLTensor& t = p.tensor[k];
  if (warmup_bf16_) {
    // Rounded as the unbucketed bf16 warmup rounds (the trainer's bf16 wire).
    auto* wire = reinterpret_cast<uint16_t*>(wire_.data()) + lo;  // NOLINT: bf16 in floats
    Segment s;
    s.n = n;
    s.p = flat_.data() + lo;
    s.low = wire;
    s.ltype = loom::optim::DType::kBF16;
    be().copy_out({s});
    t = DLTensor{wire, device_, 1, DLDataType{kDLBfloat, 16, 1}, &p.shape[k], nullptr, 0};
  } else {
    t = DLTensor{flat_.data() + lo, device_, 1, DLDataType{kDLFloat, 32, 1},
                 &p.shape[k],       nullptr, 0};
  }
  p.args[k] = loom_allreduce_args{LOOM_ALLREDUCE_ARGS_SIZE, LOOM_REDUCE_AVG, nullptr, &t, stream_};
  p.request[k] = loom::sdk::comm_start(comm_, LOOM_COLLECTIVE_ALLREDUCE, &p.args[k]);
}

void Onebit::finish_pending(const std::vector<StepGroup>& groups,
                            const loom_optimizer_step_args& args) {
  Pending& p = *pending_;
  const uint64_t t = steps_ + 1;
  uint64_t sent = 0;
  uint64_t received = 0;
  uint64_t rounds = 0;
  if (p.exchange == Exchange::kAverage) {
    const auto t0 = std::chrono::steady_clock::now();
    for (auto& r : p.request) r.wait();
    comm_wait_ns_ += nanoseconds_since(t0);
    if (warmup_bf16_) {
      for (std::size_t k = 0; k < p.request.size(); ++k) {
        Segment s;  // widened exactly
        s.offset = static_cast<std::size_t>(car_->segment_offset(k));
        s.n = static_cast<std::size_t>(car_->segment_elements(k));
        s.g = reinterpret_cast<const uint16_t*>(wire_.data()) + s.offset;  // NOLINT: bf16
        s.gtype = loom::optim::DType::kBF16;
        be().load_grad({s}, flat_.data(), 1.0f);
      }
    }
    loom_comm_stats after{};
    after.struct_size = LOOM_COMM_STATS_SIZE;
    comm_.call(&loom_comm_v1::stats, &after);
    sent = after.bytes_sent - p.before.bytes_sent;
    received = after.bytes_received - p.before.bytes_received;
    rounds = after.rounds - p.before.rounds;
  } else if (p.exchange == Exchange::kCompressed) {
    car_->end();
    const loom::sdk::CompressedAllreduceTraffic tr = car_->last_traffic();
    comm_wait_ns_ += tr.wait_ns;
    sent = tr.bytes_sent;
    received = tr.bytes_received;
    rounds = tr.rounds;
  }
  if (skip_nonfinite_ && !agreed_finite()) {
    if (p.exchange == Exchange::kCompressed) {  // the buffers and the error buffers as they were
      for (std::size_t k = 0; k < p.begun.size(); ++k) {
        bucket_restore(static_cast<std::size_t>(car_->segment_offset(k)),
                       static_cast<std::size_t>(car_->segment_elements(k)));
      }
      car_->undo();
    }
    ++skipped_;
    ctx_.debug("step " + std::to_string(args.step) + " skipped: a gradient is not finite");
    loom::optim::report_found_inf(args, true);
    return;
  }
  bytes_sent_ += sent;
  bytes_received_ += received;
  rounds_ += rounds;
  uncompressed_bytes_ +=
      static_cast<uint64_t>(2.0 * (world_ - 1) / world_ * static_cast<double>(total_) * 4.0);
  if (p.exchange == Exchange::kNone) {
    algorithm_step(groups, args.lr, t);
  } else {
    bucket_finish(groups, p.exchange, args.lr, t);
  }
  steps_ = t;
  loom::optim::report_found_inf(args, false);
}

}  // namespace loom::optim::onebit
