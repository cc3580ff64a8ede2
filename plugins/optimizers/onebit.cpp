// The 1-bit family's shared part (onebit.hpp): parameters, device and layout checks, the
// flat buffers, the collectives and the state format. The algorithms are in onebit_adam.cpp,
// zero_one_adam.cpp and onebit_lamb.cpp.
#include "onebit.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace loom::optim::onebit {

using loom::sdk::Error;

namespace {

DLTensor flat_tensor(float* data, int64_t* shape, DLDevice device) {
  return loom::sdk::flat_view(data, device, DLDataType{kDLFloat, 32, 1}, shape);
}

// How the compressed allreduce moves and orders device memory on `device`: the kernels
// library's helpers (the same CUDA runtime as the kernels).
loom::sdk::DeviceOps device_ops(int device) {
  namespace kc = loom::optim::cuda;
  loom::sdk::DeviceOps ops;
  ops.copy = [](void* dst, const void* src, std::size_t bytes, void* stream) {
    Buffer::check_cuda(kc::onebit::copy_device(dst, src, bytes, stream));
  };
  ops.zero = [](void* dst, std::size_t bytes, void* stream) {
    Buffer::check_cuda(kc::memset_zero(dst, bytes, stream));
  };
  ops.to_host = [](void* dst, const void* src, std::size_t bytes, void* stream) {
    Buffer::check_cuda(kc::copy_to_host(dst, src, bytes, stream));
  };
  ops.from_host = [](void* dst, const void* src, std::size_t bytes, void* stream) {
    Buffer::check_cuda(kc::copy_to_device(dst, src, bytes, stream));
  };
  ops.record_event = [device](void** event, void* stream) {
    Buffer::check_cuda(kc::event_record(event, stream, device));
  };
  ops.wait_event = [device](void* event, void* stream) {
    Buffer::check_cuda(kc::event_wait(event, stream, device));
  };
  ops.destroy_event = [](void* event) { kc::event_destroy(event); };
  return ops;
}

// What import_state read, before it replaces anything.
struct Imported {
  uint64_t steps;
  uint64_t total;
  const std::vector<uint64_t>& offsets;
  std::size_t m, v, aux;  // element counts
  uint64_t var_interval;
  uint64_t local_interval;
  const std::vector<TensorState>& lamb;
  std::size_t car;  // bytes of the compressed allreduce's state
};

// The instance it goes into.
struct Into {
  Variant variant;
  bool laid_out;  // has stepped: its tensors are fixed
  const std::vector<uint64_t>* offsets;
  uint64_t total;
  bool compresses;   // has a compressed allreduce
  uint64_t moments;  // the elements m and v must have: total, or the slice (shard_state)
};

// Refuses (DATA_LOSS, naming the field with the expected and the found) a state whose
// buffers and counters do not fit what the steps do with them.
void check_imported(const Imported& in, const Into& into) {
  const auto& [steps, total, offsets, m, v, aux, var_interval, local_interval, lamb, car] = in;
  const Variant variant = into.variant;
  const auto refuse = [&](const std::string& what) {
    throw Error(LOOM_ERR_DATA_LOSS, std::string(plugin_name(variant)) + " state: " + what);
  };
  const auto n = [](uint64_t x) { return std::to_string(x); };
  if (steps > kMaxSteps) refuse("steps is " + n(steps) + ", above the limit 2^62");
  // offsets: the flat layout, [offsets[k], offsets[k+1]) per tensor; none before a step.
  const std::size_t tensors = offsets.empty() ? 0 : offsets.size() - 1;
  if (offsets.empty()) {
    if (total != 0) refuse("total is " + n(total) + " elements, but offsets lists no tensors");
    if (steps != 0) refuse("steps is " + n(steps) + ", but offsets lists no tensors");
  } else {
    if (offsets.front() != 0) refuse("offsets[0] is " + n(offsets.front()) + ", expected 0");
    for (std::size_t k = 1; k < offsets.size(); ++k) {
      if (offsets[k] < offsets[k - 1]) {
        refuse("offsets[" + n(k) + "] is " + n(offsets[k]) + ", below offsets[" + n(k - 1) + "] " +
               n(offsets[k - 1]));
      }
    }
    if (offsets.back() != total) {
      refuse("offsets ends at " + n(offsets.back()) + ", expected total " + n(total));
    }
  }
  // A laid-out instance keeps its tensors (the compressed allreduce and the non_freeze flags
  // were made for them): the state must have the same, else the next step would lay out
  // others and index them with those.
  if (into.laid_out && offsets != *into.offsets) {
    // Not corrupt, another model's: the code the step would give.
    throw Error(LOOM_ERR_INVALID_ARGUMENT,
                std::string(plugin_name(variant)) + " state: offsets lists " + n(tensors) +
                    " tensors of " + n(total) + " elements, but this instance has stepped with " +
                    n(into.offsets->size() - 1) + " tensors of " + n(into.total) +
                    " elements (the first step fixes them)");
  }
  // The steps index m, v and aux over the whole flat layout (onebit_backend.hpp).
  const auto sized = [&](const char* field, std::size_t found, uint64_t expected, const char* why) {
    if (found != expected) {
      refuse(std::string(field) + " has " + n(found) + " elements, expected " + n(expected) + " " +
             why);
    }
  };
  const char* moments_why = into.moments == total ? "(total)" : "(this rank's slice)";
  sized("m", m, into.moments, moments_why);
  sized("v", v, into.moments, moments_why);
  if (variant == Variant::kOnebitAdam) {
    sized("aux", aux, 0, "(onebit_adam keeps none)");
  } else {
    sized("aux", aux, into.moments, moments_why);
  }
  const std::size_t records = variant == Variant::kOnebitLamb ? tensors : 0;
  if (lamb.size() != records) {
    refuse("per-tensor scalars: " + n(lamb.size()) + " records, expected " + n(records) +
           (variant == Variant::kOnebitLamb ? " (one per tensor)" : " (onebit_lamb's only)"));
  }
  for (std::size_t j = 0; j < lamb.size(); ++j) {
    // Clamped between factor_min and factor_max (>= 0) every step; a negative one would make
    // the next clamp's bounds cross.
    if (lamb[j].last_factor < 0.0) {
      refuse("per-tensor scalars: tensor " + n(j) + "'s last_factor is " +
             std::to_string(lamb[j].last_factor) + ", expected >= 0");
    }
  }
  // 0/1 Adam's intervals divide the step number: never 0, and doubling must not wrap to 0.
  // var_interval starts at 1 and doubles only at a step t it divides, so with t <= 2^62 it
  // never passes 2^63; local_interval is at most local_step_clipper (an int64).
  if (var_interval == 0 || (var_interval & (var_interval - 1)) != 0) {
    refuse("var_interval is " + n(var_interval) + ", expected a power of two");
  }
  if (local_interval == 0 || local_interval > static_cast<uint64_t>(INT64_MAX)) {
    refuse("local_interval is " + n(local_interval) + ", expected 1 .. 2^63 - 1");
  }
  if (car != 0 && total == 0) {
    refuse("the compressed allreduce's state has " + n(car) +
           " bytes, expected none: there are no elements to compress");
  }
  if (car != 0 && into.laid_out && !into.compresses) {
    refuse("the compressed allreduce's state has " + n(car) +
           " bytes, expected none: this instance compresses no tensors");
  }
}

}  // namespace

loom::sdk::Schema Onebit::common_schema() {
  using namespace loom::sdk;
  return {
      Ref("comm", LOOM_KIND_COMM, "The transport the optimizer averages over (loom.comm/1).")
          .required(),
      Ref("codec", LOOM_KIND_CODEC, "The compression codec of the compressed allreduce.")
          .required(),
      loom::optim::betas_param(),
      Float("eps", 1e-8, "Added to sqrt(v) in the denominator.").range(0, 1),
      Float("weight_decay", 0.0, "Decoupled weight decay (added to the update, as DeepSpeed).")
          .min(0),
      Bool("bias_correction", true,
           "Divide the moments by (1 - beta^t). DeepSpeed accepts and ignores it; here it "
           "is applied (false gives DeepSpeed's arithmetic)."),
      loom::optim::skip_nonfinite_param(),
      Bool("hierarchical", false,
           "Compress only between hosts: average inside each host in fp32, run the compressed "
           "allreduce between hosts on each rank's block, share the blocks inside the host "
           "(host memory; every host with the same number of ranks; a host is a hostname and "
           "network namespace)."),
      String("warmup_wire", "fp32",
             "What the uncompressed allreduces put on the wire (the warmup steps; 0/1 Adam's "
             "variance steps): bf16 halves their bytes and rounds the averaged gradient to "
             "bf16, as the trainer's [gradients] wire = \"bf16\" does.")
          .choices({"fp32", "bf16"}),
      Bool("shard_state", false,
           "ZeRO-1: each rank keeps the moments of 1/N of the parameters; the gradients are "
           "reduce-scattered (compressed after the freeze), each rank updates its slice and "
           "shares it (onebit_adam, and onebit_lamb on host memory; not zero_one_adam; not "
           "with hierarchical or non_freeze groups)."),
      String("shard_gather", "fp32",
             "With shard_state, how a rank shares its slice after the freeze: \"fp32\" "
             "allgathers the parameters themselves (exact, 4 bytes a parameter on the wire); "
             "\"compressed\" allgathers the change of its parameters through the codec with "
             "error feedback, every rank adding the same bits (use it with an 8-bit codec such "
             "as ef8: with 1 bit it can diverge). The warmup is always fp32.")
          .choices({"fp32", "compressed"}),
  };
}

loom::sdk::Int Onebit::freeze_step_param() {
  return loom::sdk::Int("freeze_step", 100000,
                        "Warmup steps with uncompressed communication before compression.")
      .min(0);
}

Onebit::Onebit(loom::sdk::Context& ctx, Variant variant)
    : ctx_(ctx),
      comm_(ctx.get_ref<loom_comm_v1>("comm")),
      codec_(ctx.get_ref<loom_codec_v1>("codec")),
      beta1_(ctx.get_float_list("betas")[0]),
      beta2_(ctx.get_float_list("betas")[1]),
      eps_(ctx.get_float("eps")),
      weight_decay_(ctx.get_float("weight_decay")),
      bias_correction_(ctx.get_bool("bias_correction")),
      skip_nonfinite_(ctx.get_bool("skip_nonfinite")),
      hierarchical_(ctx.get_bool("hierarchical")),
      warmup_bf16_(ctx.get_string("warmup_wire") == "bf16"),
      shard_(ctx.get_bool("shard_state")),
      gather_fp32_(ctx.get_string("shard_gather") == "fp32"),
      variant_(variant) {
  world_ = comm_.call(&loom_comm_v1::size);
  rank_ = comm_.call(&loom_comm_v1::rank);
  if (world_ <= 0) throw Error(LOOM_ERR_UNAVAILABLE, "comm '" + comm_.name() + "' has no ranks");
  if (shard_ && variant == Variant::kZeroOneAdam) {
    throw Error(LOOM_ERR_UNIMPLEMENTED,
                std::string(name()) +
                    ": shard_state = true is onebit_adam's and onebit_lamb's only (0/1 Adam's "
                    "local steps update every parameter from the whole moments on each rank, "
                    "with no communication to share a slice's update)");
  }
  if (shard_ && variant == Variant::kOnebitLamb && !gather_fp32_) {
    throw Error(LOOM_ERR_UNIMPLEMENTED,
                std::string(name()) +
                    ": with shard_state = true onebit_lamb shares its slice's parameters in "
                    "fp32; shard_gather = \"compressed\" is onebit_adam's only");
  }
  if (!shard_ && !gather_fp32_) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT,
                std::string(name()) +
                    ": shard_gather = \"compressed\" needs shard_state = true (it says how a "
                    "rank shares its slice)");
  }
  if (shard_ && hierarchical_) {
    throw Error(
        LOOM_ERR_INVALID_ARGUMENT,
        std::string(name()) + ": shard_state = true cannot be combined with hierarchical = true");
  }
  const double mb = ctx.get_float("bucket_mb");
  if (mb > 0 && (shard_ || hierarchical_)) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT,
                std::string(name()) + ": bucket_mb > 0 cannot be combined with " +
                    (shard_ ? "shard_state = true" : "hierarchical = true") +
                    " (their exchanges are one piece)");
  }
  // At least one element a bucket; the compressed allreduce rounds it to the codec's unit.
  bucket_elements_ = mb > 0 ? std::max<uint64_t>(1, static_cast<uint64_t>(mb * 262144.0)) : 0;
  // Which memory the comm and codec must support is known at the first step (a CUDA-only
  // transport such as nccl is fine for CUDA tensors): checked there.
}

void Onebit::comm_info(loom_optimizer_comm_info& out) {
  out.owns_communication = 1;
  out.bytes_sent = bytes_sent_;
  out.bytes_received = bytes_received_;
  out.rounds = rounds_;
  out.uncompressed_bytes_sent = uncompressed_bytes_;
  out.skipped_steps = skipped_;
  out.comm_wait_ns = comm_wait_ns_;
}

void Onebit::step(const loom_optimizer_step_args& args) {
  auto groups = loom::optim::collect(args, weight_decay_, /*allow_cuda=*/true);
  if (variant_ != Variant::kOnebitAdam || shard_) {
    for (std::size_t g = 0; g < groups.size(); ++g) {
      if (groups[g].non_freeze()) {
        throw Error(LOOM_ERR_INVALID_ARGUMENT,
                    "group " + std::to_string(g) + " sets LOOM_OPTIMIZER_GROUP_NON_FREEZE: " +
                        (shard_ ? std::string("not supported with shard_state = true")
                                : "non_freeze is supported by onebit_adam only, not " +
                                      std::string(name())));
      }
    }
  }
  const DLDevice device = step_device(groups);
  check_device(device);  // before anything changes
  device_ = device;
  stream_ = args.stream;
  // The state kept on the device since the last step: this step's stream waits for that
  // step's work when it brings another stream, and the step's work is marked at its end
  // (also when it fails part-way), for the next one.
  if (on_cuda()) {
    cuda_.begin(stream_, device_.device_id);
    try {
      if (car_) car_->use_stream(stream_);
      ordered_step(groups, args);
    } catch (...) {
      try {
        cuda_.end();
      } catch (...) {  // the step's own error is the one reported
      }
      throw;
    }
    cuda_.end();
    return;
  }
  ordered_step(groups, args);
}

void Onebit::ordered_step(const std::vector<StepGroup>& groups,
                          const loom_optimizer_step_args& args) {
  if (steps_ >= kMaxSteps) {
    throw Error(LOOM_ERR_OUT_OF_RANGE, std::string(name()) + " has taken " +
                                           std::to_string(steps_) +
                                           " steps, the most its schedules' counters allow");
  }
  layout(groups);  // validates against the state before anything changes
  device_set_ = true;
  if (bucketed() || pending_) {
    bucketed_step(groups, args);
    return;
  }
  const uint64_t t = steps_ + 1;
  gather_grads(groups, static_cast<float>(1.0 / args.grad_scale));  // flat_ is scratch
  // The 1-bit optimizers see local gradients: a NaN on one rank must skip the step on all.
  if (skip_nonfinite_ && !finite_on_every_rank()) {
    ++skipped_;
    ctx_.debug("step " + std::to_string(args.step) + " skipped: a gradient is not finite");
    loom::optim::report_found_inf(args, true);
    return;
  }
  // A plain fp32 ring allreduce of the gradients would send this much per step.
  uncompressed_bytes_ +=
      static_cast<uint64_t>(2.0 * (world_ - 1) / world_ * static_cast<double>(total_) * 4.0);
  algorithm_step(groups, args.lr, t);
  steps_ = t;
  loom::optim::report_found_inf(args, false);
}

bool Onebit::finite_on_every_rank() {
  finite_.reset(device_, stream_);
  finite_.check({{flat_.data(), loom::optim::DType::kF32, static_cast<std::size_t>(total_)}}, 1.0f,
                stream_);
  return agreed_finite();
}

bool Onebit::agreed_finite() {
  if (world_ > 1) {
    // One fp32 (0 or 1) on the state's device; not counted in the traffic counters, which
    // measure the gradient averaging (and are state: a skipped step leaves them as they were).
    int64_t shape[1] = {1};
    DLTensor t = flat_tensor(finite_.buffer().data(), shape, device_);
    loom_allreduce_args a{LOOM_ALLREDUCE_ARGS_SIZE, LOOM_REDUCE_MAX, nullptr, &t, stream_};
    comm_.call(&loom_comm_v1::allreduce, &a);
  }
  return !finite_.raised(stream_);
}

void Onebit::export_state(loom::sdk::StateWriter& out) {
  if (pending_) {
    throw Error(LOOM_ERR_FAILED_PRECONDITION,
                std::string(name()) + ": step " + std::to_string(steps_ + 1) +
                    " is in progress (grads_ready was called): export after its step()");
  }
  out.write_header(name(), shard_ ? 2 : 1);
  out.write_pod<uint64_t>(steps_);
  out.write_pod<uint64_t>(total_);
  out.write_vector(offsets_);
  out.write_vector(m_.to_host(stream_));
  out.write_vector(v_.to_host(stream_));
  out.write_vector(aux_.to_host(stream_));
  out.write_pod<uint8_t>(frozen_ ? 1 : 0);
  out.write_pod<uint64_t>(var_interval_);
  out.write_pod<uint64_t>(var_counter_);
  out.write_pod<uint64_t>(var_updates_);
  out.write_pod<uint64_t>(local_interval_);
  out.write_pod<uint64_t>(local_counter_);
  out.write_pod<double>(lrs_);
  out.write_pod<uint64_t>(lamb_.size());
  for (const auto& s : lamb_) out.write_pod(s);
  out.write_pod<uint8_t>(scaling_set_ ? 1 : 0);
  out.write_pod<uint64_t>(bytes_sent_);
  out.write_pod<uint64_t>(bytes_received_);
  out.write_pod<uint64_t>(rounds_);
  out.write_pod<uint64_t>(uncompressed_bytes_);
  std::vector<std::byte> car;
  if (car_ || hier_) {
    loom_state_writer w{LOOM_STATE_WRITER_SIZE, 0, &car, &append};
    loom::sdk::StateWriter cw(&w);
    if (hier_) {
      hier_->export_state(cw);
    } else {
      car_->export_state(cw);
    }
  } else {
    car = pending_car_;
  }
  out.write_vector(car);
  if (shard_) {
    // Whose slice the moments are: a resume needs the same rank of the same world size.
    out.write_pod<int32_t>(rank_);
    out.write_pod<int32_t>(world_);
  }
}

void Onebit::import_state(std::span<const std::byte> blob) {
  loom::sdk::StateReader in(blob);
  const uint32_t version = in.read_header(name(), kVersion);
  const auto steps = in.read_pod<uint64_t>();
  const auto total = in.read_pod<uint64_t>();
  auto offsets = in.read_vector<uint64_t>();
  auto m = in.read_vector<float>();
  auto v = in.read_vector<float>();
  auto aux = in.read_vector<float>();
  const bool frozen = in.read_pod<uint8_t>() != 0;
  const auto var_interval = in.read_pod<uint64_t>();
  const auto var_counter = in.read_pod<uint64_t>();
  const auto var_updates = in.read_pod<uint64_t>();
  const auto local_interval = in.read_pod<uint64_t>();
  const auto local_counter = in.read_pod<uint64_t>();
  const auto lrs = in.read_pod<double>();
  const auto nl = in.read_pod<uint64_t>();
  if (nl > in.remaining()) throw Error(LOOM_ERR_DATA_LOSS, "corrupt tensor count");
  std::vector<TensorState> lamb(static_cast<std::size_t>(nl));
  for (auto& s : lamb) s = in.read_pod<TensorState>();
  const bool scaling_set = in.read_pod<uint8_t>() != 0;
  const auto bs = in.read_pod<uint64_t>();
  const auto br = in.read_pod<uint64_t>();
  const auto rounds = in.read_pod<uint64_t>();
  const auto ub = in.read_pod<uint64_t>();
  auto car = in.read_vector<std::byte>();
  const bool sharded = version >= 2;
  const int32_t slice_rank = sharded ? in.read_pod<int32_t>() : 0;
  const int32_t slice_world = sharded ? in.read_pod<int32_t>() : 0;
  in.expect_end();
  if (sharded != shard_) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT,
                std::string(name()) +
                    " state: written with shard_state = " + (sharded ? "true" : "false") +
                    ", this instance has shard_state = " + (shard_ ? "true" : "false") +
                    " (resume with the setting it was written with)");
  }
  if (sharded && (slice_rank != rank_ || slice_world != world_)) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT,
                std::string(name()) + " state: holds rank " + std::to_string(slice_rank) + " of " +
                    std::to_string(slice_world) +
                    "'s slice of the moments, but this instance is rank " + std::to_string(rank_) +
                    " of " + std::to_string(world_) +
                    " (a sharded state resumes on the same rank of the same number of ranks)");
  }
  // A slice is total / world elements plus the codec's padding: a total far beyond what m
  // holds is corrupt (and would overflow the codec's layout).
  if (shard_ && total / static_cast<uint64_t>(world_) > m.size()) {
    throw Error(LOOM_ERR_DATA_LOSS,
                std::string(name()) + " state: m has " + std::to_string(m.size()) +
                    " elements, too few for a slice of " + std::to_string(total) + " over " +
                    std::to_string(world_) + " ranks");
  }
  check_imported({steps, total, offsets, m.size(), v.size(), aux.size(), var_interval,
                  local_interval, lamb, car.size()},
                 {variant_, laid_out_, &offsets_, total_, car_ != nullptr || hier_ != nullptr,
                  shard_ ? shard_numel(total) : total});
  if ((car_ || hier_) && !car.empty()) {
    // Validate the error buffers' sizes against the live allreduce before committing.
    loom::sdk::StateReader cr(car);
    import_exchange_state(cr);
  } else if (car_ || hier_) {
    reset_car();
  }
  // car_ exists after a step, so on CUDA the backend has begun on the last step's stream:
  // the copies and zeroing above are marked like a step's work.
  if (car_ && on_cuda()) cuda_.end();
  steps_ = steps;
  total_ = total;
  offsets_ = std::move(offsets);
  m_ = Buffer::from_host(std::move(m));
  v_ = Buffer::from_host(std::move(v));
  aux_ = Buffer::from_host(std::move(aux));
  frozen_ = frozen;
  var_interval_ = var_interval;
  var_counter_ = var_counter;
  var_updates_ = var_updates;
  local_interval_ = local_interval;
  local_counter_ = local_counter;
  lrs_ = lrs;
  lamb_ = std::move(lamb);
  scaling_set_ = scaling_set;
  bytes_sent_ = bs;
  bytes_received_ = br;
  rounds_ = rounds;
  uncompressed_bytes_ = ub;
  if (!car_ && !hier_) pending_car_ = std::move(car);
}

loom_status* Onebit::append(void* ctx, const void* data, size_t bytes) {
  auto* v = static_cast<std::vector<std::byte>*>(ctx);
  const auto* b = static_cast<const std::byte*>(data);
  v->insert(v->end(), b, b + bytes);
  return nullptr;
}

DLDevice Onebit::step_device(const std::vector<StepGroup>& groups) const {
  const loom::optim::StepTensor* first = nullptr;
  std::size_t fg = 0;
  std::size_t ft = 0;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    for (std::size_t t = 0; t < groups[g].tensors.size(); ++t) {
      const auto& tensor = groups[g].tensors[t];
      if (first == nullptr) {
        first = &tensor;
        fg = g;
        ft = t;
        continue;
      }
      if (!same_device(tensor.device, first->device)) {
        throw Error(LOOM_ERR_INVALID_ARGUMENT,
                    "a step mixes devices: param " + std::to_string(fg) + "." + std::to_string(ft) +
                        " is on " + loom::sdk::device_string(first->device) + ", param " +
                        std::to_string(g) + "." + std::to_string(t) + " on " +
                        loom::sdk::device_string(tensor.device));
      }
    }
  }
  if (first == nullptr) return device_set_ ? device_ : DLDevice{kDLCPU, 0};
  return first->device.device_type == kDLCPU ? DLDevice{kDLCPU, 0} : first->device;
}

void Onebit::check_device(DLDevice device) {
  if (device_set_ && !same_device(device, device_)) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT,
                std::string(name()) + " keeps its state on " + loom::sdk::device_string(device_) +
                    " (fixed by its first step), but this step's tensors are on " +
                    loom::sdk::device_string(device));
  }
  const bool cuda = loom::sdk::is_cuda(device);
  const std::string where = loom::sdk::device_string(device);
  if (cuda && shard_ && variant_ == Variant::kOnebitLamb) {
    throw Error(LOOM_ERR_UNIMPLEMENTED,
                std::string(name()) + ": shard_state = true runs on host memory for onebit_lamb; " +
                    "this step's tensors are on " + where + " (leave shard_state off there)");
  }
  if (cuda && hierarchical_) {
    throw Error(LOOM_ERR_UNIMPLEMENTED,
                std::string(name()) +
                    ": hierarchical = true runs on host memory; this step's "
                    "tensors are on " +
                    where + " (leave hierarchical off there)");
  }
  if (comm_.call(&loom_comm_v1::supports_device, device) == 0) {
    throw Error(LOOM_ERR_UNIMPLEMENTED,
                "comm '" + comm_.name() + "' cannot use " + where + " memory; " +
                    (cuda ? "CUDA tensors need a transport that supports the device, e.g. "
                            "nccl (or thread_comm in tests)"
                          : "host tensors need a transport that supports host memory, e.g. "
                            "ucx"));
  }
  if (codec_.call(&loom_codec_v1::supports_device, device) == 0) {
    throw Error(LOOM_ERR_UNIMPLEMENTED,
                "codec '" + codec_.name() + "' cannot use " + where + " memory" +
                    (cuda ? " (a codec built without CUDA, or no usable device); onebit "
                            "supports CUDA when built with it"
                          : ""));
  }
}

Backend& Onebit::be() {
  if (on_cuda()) return cuda_;
  return cpu_;
}

void Onebit::ensure(Buffer& b, std::size_t n) {
  if (b.size() == n && same_device(b.device(), device_)) return;
  b = Buffer::zeros(n, device_, stream_);
}

void Onebit::assign_copy(Buffer& dst, const Buffer& src) {
  ensure(dst, src.size());
  be().copy(dst.data(), src.data(), src.size());
}

void Onebit::import_exchange_state(loom::sdk::StateReader& in) {
  if (hier_) {
    hier_->import_state(in);
  } else {
    car_->import_state(in);
  }
}

void Onebit::reset_car() {
  if (hier_) {
    if (loom::sdk::CompressedAllreduce* between = hier_->between_hosts()) between->reset();
    return;
  }
  if (!car_) return;
  if (!on_cuda()) {
    car_->reset();
    return;
  }
  for (const DLTensor e : {car_->worker_error(), car_->server_error()}) {
    be().zero(static_cast<float*>(e.data), static_cast<std::size_t>(e.shape[0]));
  }
}

void Onebit::layout(const std::vector<StepGroup>& groups) {
  std::vector<uint64_t> offsets;
  std::vector<uint8_t> non_freeze;
  uint64_t total = 0;
  uint64_t packed = 0;  // elements the compressed allreduce covers
  for (const auto& g : groups) {
    for (const auto& t : g.tensors) {
      offsets.push_back(total);
      non_freeze.push_back(g.non_freeze() ? 1 : 0);
      total += t.ref.n;
      if (!g.non_freeze()) packed += t.ref.n;
    }
  }
  offsets.push_back(total);
  // The non_freeze groups are part of the layout: the compressed allreduce (and its error
  // buffers) covers the other tensors only.
  if (!non_freeze_.empty() && non_freeze != non_freeze_ && offsets == offsets_) {
    std::size_t k = 0;
    for (std::size_t g = 0; g < groups.size(); ++g) {
      for (std::size_t t = 0; t < groups[g].tensors.size(); ++t, ++k) {
        if (non_freeze[k] != non_freeze_[k]) {
          throw Error(LOOM_ERR_INVALID_ARGUMENT,
                      "group " + std::to_string(g) + (non_freeze[k] != 0 ? " sets" : " clears") +
                          " LOOM_OPTIMIZER_GROUP_NON_FREEZE, unlike on the earlier steps: a "
                          "group's flags must stay the same");
        }
      }
    }
  }
  // Once laid out, the tensors stay (car_ and non_freeze_ were made for them).
  if (laid_out_ || m_.size() != 0 || steps_ > 0) {
    if (offsets != offsets_) {
      // Where they part: the same count and total can still be other shapes or another order.
      std::size_t k = 0;
      while (k + 1 < offsets.size() && k + 1 < offsets_.size() &&
             offsets[k + 1] == offsets_[k + 1]) {
        ++k;
      }
      const auto size_of = [](const std::vector<uint64_t>& o, std::size_t i) {
        return i + 1 < o.size() ? std::to_string(o[i + 1] - o[i]) + " elements" : "none";
      };
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  "the step's tensors (" + std::to_string(offsets.size() - 1) + ", " +
                      std::to_string(total) + " elements) differ from the optimizer state's (" +
                      std::to_string(offsets_.empty() ? 0 : offsets_.size() - 1) + ", " +
                      std::to_string(total_) + " elements): tensor " + std::to_string(k) + " has " +
                      size_of(offsets, k) + " here and " + size_of(offsets_, k) +
                      " in the state (other shapes, or the same tensors in another order)");
    }
  } else {
    offsets_ = std::move(offsets);
    total_ = total;
    const uint64_t moments = shard_ ? shard_numel(total_) : total_;
    m_ = Buffer::zeros(moments, device_, stream_);
    v_ = Buffer::zeros(moments, device_, stream_);
    if (variant_ != Variant::kOnebitAdam) aux_ = Buffer::zeros(moments, device_, stream_);
    if (variant_ == Variant::kOnebitLamb) lamb_.assign(offsets_.size() - 1, {});
  }
  // Imported state arrives on the host: to the step's device (no-op when already there).
  m_.move_to(device_, stream_);
  v_.move_to(device_, stream_);
  aux_.move_to(device_, stream_);
  if (!laid_out_) {
    // The compressed allreduce covers the tensors outside non_freeze groups (none when
    // every group is non_freeze).
    std::unique_ptr<loom::sdk::CompressedAllreduce> car;
    if (packed > 0 && hierarchical_) {
      // Host memory (check_device refuses CUDA with hierarchical); collective, like the flat one.
      hier_ = std::make_unique<loom::sdk::HierarchicalCompressedAllreduce>(
          ctx_, comm_, codec_, static_cast<int64_t>(packed),
          loom::sdk::CompressedAllreduce::Options{});
      if (!pending_car_.empty()) {
        loom::sdk::StateReader cr(pending_car_);
        hier_->import_state(cr);
        pending_car_.clear();
      }
    } else if (packed > 0) {
      // On CUDA: buffers from the host's device_alloc, stream-ordered on this step's stream;
      // a later step on another stream hands it over with use_stream() (an event), and the
      // buffers are freed on the last step's stream when the optimizer is destroyed.
      // shard_state: over the padded length (every tensor is in it: no non_freeze groups),
      // so the flat buffer is its input as it is, without a padded copy.
      if (shard_) {
        padded_ = shard_numel(total_) * static_cast<uint64_t>(world_);
        shard_lo_ = shard_numel(total_) * static_cast<uint64_t>(rank_);
      }
      loom::sdk::CompressedAllreduce::Options options;
      options.device = device_;
      options.stream = stream_;
      options.segment_elements = static_cast<int64_t>(bucket_elements_);  // 0: one segment
      if (on_cuda()) options.device_ops = device_ops(device_.device_id);
      car = std::make_unique<loom::sdk::CompressedAllreduce>(
          ctx_, comm_, codec_, static_cast<int64_t>(shard_ ? padded_ : packed), std::move(options));
      if (!pending_car_.empty()) {
        // Error buffers of a checkpoint made with other non_freeze groups do not fit.
        loom::sdk::StateReader cr(pending_car_);
        car->import_state(cr);
        pending_car_.clear();
      }
    }
    car_ = std::move(car);
    non_freeze_ = std::move(non_freeze);
    compressed_numel_ = packed;
    laid_out_ = true;
  }
  ensure(flat_, shard_ ? padded_ : total_);
  if (shard_) ensure(slice_, m_.size());
}

void Onebit::counted(const std::function<void()>& fn, bool compressed_run) {
  if (compressed_run) {
    // The compressed allreduce counts its own traffic (a hierarchical one on the
    // sub-communicators it split off, whose calls the parent's stats do not see) and only
    // its time in the transport as waiting.
    fn();
    const loom::sdk::CompressedAllreduceTraffic t =
        hier_ ? hier_->last_traffic() : car_->last_traffic();
    bytes_sent_ += t.bytes_sent;
    bytes_received_ += t.bytes_received;
    rounds_ += t.rounds;
    comm_wait_ns_ += t.wait_ns;
    return;
  }
  loom_comm_stats before{};
  before.struct_size = LOOM_COMM_STATS_SIZE;
  comm_.call(&loom_comm_v1::stats, &before);
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  // A plain allreduce is all waiting.
  comm_wait_ns_ += static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
          .count());
  loom_comm_stats after{};
  after.struct_size = LOOM_COMM_STATS_SIZE;
  comm_.call(&loom_comm_v1::stats, &after);
  bytes_sent_ += after.bytes_sent - before.bytes_sent;
  bytes_received_ += after.bytes_received - before.bytes_received;
  rounds_ += after.rounds - before.rounds;
}

void Onebit::gather_grads(const std::vector<StepGroup>& groups, float inv_scale) {
  be().load_grad(segments(groups), flat_.data(), inv_scale);
}

void Onebit::allreduce_avg(Buffer& buf) {
  if (world_ == 1) return;
  int64_t shape[1] = {static_cast<int64_t>(buf.size())};
  if (!warmup_bf16_) {
    DLTensor t = flat_tensor(buf.data(), shape, device_);
    loom_allreduce_args a{LOOM_ALLREDUCE_ARGS_SIZE, LOOM_REDUCE_AVG, nullptr, &t, stream_};
    counted([&] { comm_.call(&loom_comm_v1::allreduce, &a); }, /*compressed_run=*/false);
    return;
  }
  // Rounded once on the way out, averaged in the transport, widened exactly on the way back:
  // every rank ends with the same fp32 values, on either device.
  to_bf16(buf, buf.size(), wire_);
  DLTensor t{wire_.data(), device_, 1, DLDataType{kDLBfloat, 16, 1}, shape, nullptr, 0};
  loom_allreduce_args a{LOOM_ALLREDUCE_ARGS_SIZE, LOOM_REDUCE_AVG, nullptr, &t, stream_};
  counted([&] { comm_.call(&loom_comm_v1::allreduce, &a); }, /*compressed_run=*/false);
  from_bf16(wire_, buf.size(), buf);
}

void Onebit::to_bf16(const Buffer& src, std::size_t n, Buffer& wire) {
  ensure(wire, (n + 1) / 2);  // n bf16 values
  Segment s;  // the copy-out primitive: round to nearest even, as the trainer's bf16 wire
  s.n = n;
  s.p = const_cast<float*>(src.data());  // NOLINT(cppcoreguidelines-pro-type-const-cast): read
  s.low = wire.data();
  s.ltype = loom::optim::DType::kBF16;
  be().copy_out({s});
}

void Onebit::from_bf16(const Buffer& wire, std::size_t n, Buffer& dst) {
  Segment s;  // the gradient-load primitive: exact
  s.n = n;
  s.g = wire.data();
  s.gtype = loom::optim::DType::kBF16;
  be().load_grad({s}, dst.data(), 1.0f);
}

void Onebit::compressed(Buffer& buf) {
  if (world_ == 1 || compressed_numel_ == 0) return;  // as DeepSpeed: nothing to average
  if (!any_non_freeze()) {
    int64_t shape[1] = {static_cast<int64_t>(buf.size())};
    DLTensor t = flat_tensor(buf.data(), shape, device_);
    counted([&] { hier_ ? hier_->run(t) : car_->run(t, stream_); }, /*compressed_run=*/true);
    return;
  }
  ensure(subset_, compressed_numel_);
  copy_subset(buf, subset_, /*non_freeze=*/false, /*gather=*/true);
  int64_t shape[1] = {static_cast<int64_t>(subset_.size())};
  DLTensor t = flat_tensor(subset_.data(), shape, device_);
  counted([&] { hier_ ? hier_->run(t) : car_->run(t, stream_); }, /*compressed_run=*/true);
  copy_subset(buf, subset_, /*non_freeze=*/false, /*gather=*/false);
}

void Onebit::copy_subset(Buffer& flat, Buffer& packed, bool non_freeze, bool gather) {
  std::size_t at = 0;
  for (std::size_t k = 0; k + 1 < offsets_.size(); ++k) {
    if ((non_freeze_[k] != 0) != non_freeze) continue;
    const std::size_t n = offsets_[k + 1] - offsets_[k];
    float* f = flat.data() + offsets_[k];
    if (gather) {
      be().copy(packed.data() + at, f, n);
    } else {
      be().copy(f, packed.data() + at, n);
    }
    at += n;
  }
}

void Onebit::apply_masks(const std::vector<StepGroup>& groups, Buffer& buf) {
  be().mask_multiply(segments(groups, Groups::kAll, /*masks=*/true), buf.data());
}

void Onebit::apply_adam(const std::vector<StepGroup>& groups, double lr_base, double bc1,
                        double bc2, Groups which, bool masks) {
  const float eps = static_cast<float>(eps_);
  const float inv_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  const Segments segs = segments(groups, which, masks, [&](const StepGroup& g, Segment& s) {
    const double lr = lr_base * g.lr_scale;
    s.decay = static_cast<float>(1.0 - lr * g.weight_decay);
    s.step = static_cast<float>(lr / bc1);
  });
  be().apply_adam(segs, m_.data(), v_.data(), inv_bc2, eps);
}

loom::optim::AdamHyper Onebit::adam_hyper(const StepGroup& g, double lr_base, double bc1,
                                          double bc2) const {
  const double lr = lr_base * g.lr_scale;
  loom::optim::AdamHyper h;
  h.set_betas(beta1_, beta2_);
  h.eps = static_cast<float>(eps_);
  h.inv_scale = 1.0f;
  h.decay = static_cast<float>(1.0 - lr * g.weight_decay);
  h.step_size = static_cast<float>(lr / bc1);
  h.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  return h;
}

void Onebit::adam_full(const std::vector<StepGroup>& groups, double lr_base, double bc1, double bc2,
                       Groups which) {
  std::size_t k = 0;
  for (const auto& g : groups) {
    if (!selected(g, which)) {
      k += g.tensors.size();
      continue;
    }
    const loom::optim::AdamHyper h = adam_hyper(g, lr_base, bc1, bc2);
    std::vector<loom::optim::TensorRef> refs;
    for (const auto& t : g.tensors) {
      const std::size_t off = offsets_[k++];
      loom::optim::TensorRef r = t.ref;
      r.g = flat_.data() + off;
      r.gtype = loom::optim::DType::kF32;
      r.m = m_.data() + off;
      r.v = v_.data() + off;
      refs.push_back(r);
    }
    be().adam(refs, h);
  }
}

void Onebit::momentum_flat(const Buffer& g) {
  be().momentum(m_.data(), g.data(), total_, loom::optim::decay_of(beta1_));
}

}  // namespace loom::optim::onebit
