// The 1-bit family: onebit_adam, zero_one_adam and onebit_lamb (as the 1-bit Adam, 0/1
// Adam and 1-bit LAMB papers and DeepSpeed's implementations define them; docs/optimizers.md),
// one source built three times (LOOM_ONEBIT_VARIANT selects the plugin). They do
// their own data-parallel communication over the `comm` and `codec` instances the manifest
// names, so the trainer always passes local gradients (owns_communication = 1):
//   warmup:      the gradients are averaged with one uncompressed fp32 allreduce;
//   compression: the momentum (or, for 0/1 Adam, the gradient / the accumulated local
//                update) is averaged with loom::sdk::CompressedAllreduce.
// All tensors of all groups are fused into one flat buffer: one collective per step for the
// whole model.
//
// Devices (docs/optimizers.md): the tensors of a step are all on the CPU or all on one CUDA
// device, fixed by the first step. On CUDA the flat state (m, v, aux and the scratch buffers)
// lives in that device's memory and every loop runs as a kernel ordered on the step's stream
// (onebit_backend.hpp: one algorithm below, CPU and CUDA primitives); the warmup allreduce
// and the compressed allreduce run on the device buffers with that stream, so the comm and
// the codec must support the device. The state blob is the same on both (device buffers are
// copied to and from the host), so a checkpoint moves between CPU and CUDA.
//
// Param-group extras (ABI 1.1; DeepSpeed has both): a tensor's exp_avg_mask multiplies what the
// compressed allreduce returned (1-bit Adam's momentum, 0/1 Adam's gradient and synced update,
// 1-bit LAMB's unscaled momentum), per tensor; a LOOM_OPTIMIZER_GROUP_NON_FREEZE group of
// onebit_adam keeps the warmup's uncompressed averaging and moment updates after the freeze
// (its tensors are left out of the compressed allreduce). The other two refuse non_freeze.
//
// Where DeepSpeed has a bug (docs/optimizers.md lists them) this code does the correct
// thing: bias_correction is applied when set; error buffers, 0/1 Adam's local-step
// accumulator, the stage flags and every schedule counter are checkpointed, so a resumed
// run is bit-identical; gradients are scaled the same way before and after the freeze.
#include <loom/sdk.hpp>
#include <loom/sdk/compressed_allreduce.hpp>

#include <algorithm>
#include <cmath>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common.hpp"
#include "onebit_backend.hpp"

#ifndef LOOM_ONEBIT_VARIANT
#error "define LOOM_ONEBIT_VARIANT (0: onebit_adam, 1: zero_one_adam, 2: onebit_lamb)"
#endif

namespace {

using loom::optim::StepGroup;
using loom::sdk::Context;
using loom::sdk::Error;

enum class Variant { kOnebitAdam = 0, kZeroOneAdam = 1, kOnebitLamb = 2 };
constexpr auto kVariant = static_cast<Variant>(LOOM_ONEBIT_VARIANT);

constexpr const char* plugin_name() {
  switch (kVariant) {
    case Variant::kOnebitAdam:
      return "onebit_adam";
    case Variant::kZeroOneAdam:
      return "zero_one_adam";
    case Variant::kOnebitLamb:
      return "onebit_lamb";
  }
  return "";
}

constexpr const char* plugin_description() {
  switch (kVariant) {
    case Variant::kOnebitAdam:
      return "1-bit Adam: Adam warmup, then frozen variance and 1-bit compressed momentum "
             "averaging over a loom.comm transport and a loom.codec codec";
    case Variant::kZeroOneAdam:
      return "0/1 Adam: adaptive variance freezing, 1-bit gradient averaging, then local steps "
             "synced by 1-bit compressed averaging";
    case Variant::kOnebitLamb:
      return "1-bit LAMB: LAMB warmup, then frozen variance and trust ratio, fused 1-bit "
             "compressed momentum averaging";
  }
  return "";
}

using loom::optim::Buffer;
using loom::optim::onebit::Segment;
using loom::optim::onebit::Segments;

DLTensor flat_tensor(float* data, int64_t* shape, DLDevice device) {
  DLTensor t{};
  t.data = data;
  t.device = device;
  t.ndim = 1;
  t.dtype = {kDLFloat, 32, 1};
  t.shape = shape;
  return t;
}

struct TensorState {  // onebit_lamb's per-tensor scalars
  double lamb_coeff_freeze = 0.0;
  double last_factor = 1.0;
  double scaling_coeff = 1.0;
};

class Onebit : public loom::sdk::Optimizer {
 public:
  static loom::sdk::Schema schema() {
    using namespace loom::sdk;
    Schema s = {
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
    };
    if constexpr (kVariant == Variant::kZeroOneAdam) {
      s.add(
          Int("var_freeze_step", 100000, "Last step at which the variance may be updated.").min(0));
      s.add(Int("var_update_scaler", 16,
                "Variance updates per interval before the interval doubles (kappa).")
                .min(1));
      s.add(Int("local_step_scaler", 32678,
                "Steps after the freeze between doublings of the local-step interval.")
                .min(1));
      s.add(Int("local_step_clipper", 16, "Largest local-step interval (H_max).").min(1));
    } else {
      s.add(Int("freeze_step", 100000,
                "Warmup steps with uncompressed communication before compression.")
                .min(0));
    }
    if constexpr (kVariant == Variant::kOnebitLamb) {
      s.add(Float("max_coeff", 10.0, "Upper clamp of the warmup trust ratio.").min(0));
      s.add(Float("min_coeff", 0.01, "Lower clamp of the warmup trust ratio.").min(0));
      s.add(Float("coeff_beta", 0.9, "EMA factor of the trust ratio frozen at the freeze.")
                .range(0, 0.9999999));
      s.add(Float("factor_max", 4.0, "Upper clamp of the compression-stage factor.").min(0));
      s.add(Float("factor_min", 0.5, "Lower clamp of the compression-stage factor.").min(0));
      s.add(Float("factor_threshold", 0.1,
                  "Largest relative change of the factor from one step to the next.")
                .min(0));
    }
    return s;
  }

  explicit Onebit(Context& ctx)
      : ctx_(ctx),
        comm_(ctx.get_ref<loom_comm_v1>("comm")),
        codec_(ctx.get_ref<loom_codec_v1>("codec")),
        beta1_(ctx.get_float_list("betas")[0]),
        beta2_(ctx.get_float_list("betas")[1]),
        eps_(ctx.get_float("eps")),
        weight_decay_(ctx.get_float("weight_decay")),
        bias_correction_(ctx.get_bool("bias_correction")) {
    if constexpr (kVariant == Variant::kZeroOneAdam) {
      var_freeze_step_ = static_cast<uint64_t>(ctx.get_int("var_freeze_step"));
      var_update_scaler_ = static_cast<uint64_t>(ctx.get_int("var_update_scaler"));
      local_step_scaler_ = static_cast<uint64_t>(ctx.get_int("local_step_scaler"));
      local_step_clipper_ = static_cast<uint64_t>(ctx.get_int("local_step_clipper"));
    } else {
      freeze_step_ = static_cast<uint64_t>(ctx.get_int("freeze_step"));
    }
    if constexpr (kVariant == Variant::kOnebitLamb) {
      max_coeff_ = ctx.get_float("max_coeff");
      min_coeff_ = ctx.get_float("min_coeff");
      coeff_beta_ = ctx.get_float("coeff_beta");
      factor_max_ = ctx.get_float("factor_max");
      factor_min_ = ctx.get_float("factor_min");
      factor_threshold_ = ctx.get_float("factor_threshold");
      if (min_coeff_ > max_coeff_ || factor_min_ > factor_max_) {
        throw Error(LOOM_ERR_INVALID_ARGUMENT, "min_coeff/factor_min above their max");
      }
    }
    world_ = comm_.call(&loom_comm_v1::size);
    if (world_ <= 0) throw Error(LOOM_ERR_UNAVAILABLE, "comm '" + comm_.name() + "' has no ranks");
    // Which memory the comm and codec must support is known at the first step (a CUDA-only
    // transport such as nccl is fine for CUDA tensors): checked there.
  }

  void comm_info(loom_optimizer_comm_info& out) {
    out.owns_communication = 1;
    out.bytes_sent = bytes_sent_;
    out.bytes_received = bytes_received_;
    out.rounds = rounds_;
    out.uncompressed_bytes_sent = uncompressed_bytes_;
  }

  void step(const loom_optimizer_step_args& args) {
    auto groups = loom::optim::collect(args, weight_decay_, /*allow_cuda=*/true);
    if constexpr (kVariant != Variant::kOnebitAdam) {
      for (std::size_t g = 0; g < groups.size(); ++g) {
        if (groups[g].non_freeze()) {
          throw Error(LOOM_ERR_INVALID_ARGUMENT,
                      "group " + std::to_string(g) + " sets LOOM_OPTIMIZER_GROUP_NON_FREEZE: " +
                          "non_freeze is supported by onebit_adam only, not " + plugin_name());
        }
      }
    }
    const DLDevice device = step_device(groups);
    check_device(device);  // before anything changes
    device_ = device;
    stream_ = args.stream;
#if LOOM_OPTIM_HAVE_CUDA
    cuda_.set_stream(args.stream);
#endif
    layout(groups);  // validates against the state before anything changes
    device_set_ = true;
    const uint64_t t = steps_ + 1;
    const float inv_scale = static_cast<float>(1.0 / args.grad_scale);
    // A plain fp32 ring allreduce of the gradients would send this much per step.
    uncompressed_bytes_ +=
        static_cast<uint64_t>(2.0 * (world_ - 1) / world_ * static_cast<double>(total_) * 4.0);
    if constexpr (kVariant == Variant::kOnebitAdam) {
      onebit_adam_step(groups, args.lr, inv_scale, t);
    } else if constexpr (kVariant == Variant::kZeroOneAdam) {
      zero_one_step(groups, args.lr, inv_scale, t);
    } else {
      onebit_lamb_step(groups, args.lr, inv_scale, t);
    }
    steps_ = t;
  }

  // Format v1: header, variant, counters, flat buffers, per-tensor scalars, traffic
  // counters, then the compressed allreduce's error buffers. The same on every device:
  // device buffers are copied to the host (on the last step's stream, synchronized first, so
  // the compressed allreduce's error buffers are final too).
  void export_state(loom::sdk::StateWriter& out) {
    out.write_header(kMagic, kVersion);
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
    if (car_) {
      loom_state_writer w{LOOM_STATE_WRITER_SIZE, 0, &car, &append};
      loom::sdk::StateWriter cw(&w);
      car_->export_state(cw);
    } else {
      car = pending_car_;
    }
    out.write_vector(car);
  }

  // The buffers are kept on the host until the next step moves them to its device, so a
  // blob imports the same way before the first step, on a CPU instance or a CUDA one.
  void import_state(std::span<const std::byte> blob) {
    loom::sdk::StateReader in(blob);
    in.read_header(kMagic, kVersion);
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
    in.expect_end();
    const bool sized = m.size() == total && (v.size() == total || v.empty()) &&
                       (offsets.empty() || offsets.back() == total) && var_interval > 0 &&
                       local_interval > 0;
    if (!sized) throw Error(LOOM_ERR_DATA_LOSS, "inconsistent " + std::string(kMagic) + " state");
    if (car_ && !car.empty()) {
      // Validate the error buffers' sizes against the live allreduce before committing.
      loom::sdk::StateReader cr(car);
      car_->import_state(cr);
    } else if (car_) {
      reset_car();
    }
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
    if (!car_) pending_car_ = std::move(car);
  }

 private:
  static constexpr const char* kMagic = plugin_name();
  static constexpr uint32_t kVersion = 1;

  static loom_status* append(void* ctx, const void* data, size_t bytes) {
    auto* v = static_cast<std::vector<std::byte>*>(ctx);
    const auto* b = static_cast<const std::byte*>(data);
    v->insert(v->end(), b, b + bytes);
    return nullptr;
  }

  static bool same_device(DLDevice a, DLDevice b) {
    return a.device_type == b.device_type &&
           (a.device_type == kDLCPU || a.device_id == b.device_id);
  }
  bool on_cuda() const { return device_.device_type == kDLCUDA; }

  // The device of the step's tensors (collect() already refused CPU mixed with CUDA and
  // devices other than those two); a step without tensors keeps the state's device.
  DLDevice step_device(const std::vector<StepGroup>& groups) const {
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
                      "a step mixes devices: param " + std::to_string(fg) + "." +
                          std::to_string(ft) + " is on " + loom::sdk::device_string(first->device) +
                          ", param " + std::to_string(g) + "." + std::to_string(t) + " on " +
                          loom::sdk::device_string(tensor.device));
        }
      }
    }
    if (first == nullptr) return device_set_ ? device_ : DLDevice{kDLCPU, 0};
    return first->device.device_type == kDLCPU ? DLDevice{kDLCPU, 0} : first->device;
  }

  // The state's device is fixed by the first step; the comm and the codec must support it.
  void check_device(DLDevice device) {
    if (device_set_ && !same_device(device, device_)) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  std::string(plugin_name()) + " keeps its state on " +
                      loom::sdk::device_string(device_) +
                      " (fixed by its first step), but this step's tensors are on " +
                      loom::sdk::device_string(device));
    }
    const bool cuda = device.device_type == kDLCUDA;
    const std::string where = loom::sdk::device_string(device);
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

  loom::optim::onebit::Backend& be() {
#if LOOM_OPTIM_HAVE_CUDA
    if (on_cuda()) return cuda_;
#endif
    return cpu_;
  }

  // `b` holds n elements on the state's device (contents undefined when it had to change).
  void ensure(Buffer& b, std::size_t n) {
    if (b.size() == n && same_device(b.device(), device_)) return;
    b = Buffer::zeros(n, device_, stream_);
  }
  // dst = a copy of src (both on the state's device).
  void assign_copy(Buffer& dst, const Buffer& src) {
    ensure(dst, src.size());
    be().copy(dst.data(), src.data(), src.size());
  }

#if LOOM_OPTIM_HAVE_CUDA
  // How the compressed allreduce moves device memory: the kernels library's helpers (the
  // same CUDA runtime as the kernels).
  static loom::sdk::DeviceOps device_ops() {
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
    return ops;
  }
#endif

  // Zeroes the compressed allreduce's error buffers, ordered on the current stream.
  void reset_car() {
    if (!car_) return;
    if (!on_cuda()) {
      car_->reset();
      return;
    }
    for (const DLTensor e : {car_->worker_error(), car_->server_error()}) {
      be().zero(static_cast<float*>(e.data), static_cast<std::size_t>(e.shape[0]));
    }
  }
  // The flat layout: tensor k of the step occupies [offsets_[k], offsets_[k+1]).
  void layout(const std::vector<StepGroup>& groups) {
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
    if (m_.size() != 0 || steps_ > 0) {
      if (offsets != offsets_) {
        throw Error(LOOM_ERR_INVALID_ARGUMENT,
                    "the step's tensors (" + std::to_string(offsets.size() - 1) + ", " +
                        std::to_string(total) + " elements) differ from the optimizer state's (" +
                        std::to_string(offsets_.empty() ? 0 : offsets_.size() - 1) + ", " +
                        std::to_string(total_) + " elements)");
      }
    } else {
      offsets_ = std::move(offsets);
      total_ = total;
      m_ = Buffer::zeros(total_, device_, stream_);
      v_ = Buffer::zeros(total_, device_, stream_);
      if constexpr (kVariant != Variant::kOnebitAdam)
        aux_ = Buffer::zeros(total_, device_, stream_);
      if constexpr (kVariant == Variant::kOnebitLamb) lamb_.assign(offsets_.size() - 1, {});
    }
    // Imported state arrives on the host: to the step's device (no-op when already there).
    m_.move_to(device_, stream_);
    v_.move_to(device_, stream_);
    aux_.move_to(device_, stream_);
    if (!laid_out_) {
      // The compressed allreduce covers the tensors outside non_freeze groups (none when
      // every group is non_freeze).
      std::unique_ptr<loom::sdk::CompressedAllreduce> car;
      if (packed > 0) {
        // On CUDA: buffers from the host's device_alloc, stream-ordered on this (the first)
        // step's stream, which is also where they are freed when the optimizer is destroyed.
        loom::sdk::CompressedAllreduce::Options options;
        options.device = device_;
        options.stream = stream_;
#if LOOM_OPTIM_HAVE_CUDA
        if (on_cuda()) options.device_ops = device_ops();
#endif
        car = std::make_unique<loom::sdk::CompressedAllreduce>(
            ctx_, comm_, codec_, static_cast<int64_t>(packed), std::move(options));
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
    ensure(flat_, total_);
  }

  bool any_non_freeze() const { return compressed_numel_ != total_; }

  // Counts what `fn` (one collective) did on the transport.
  template <class Fn>
  void counted(Fn&& fn) {
    loom_comm_stats before{};
    before.struct_size = LOOM_COMM_STATS_SIZE;
    comm_.call(&loom_comm_v1::stats, &before);
    fn();
    loom_comm_stats after{};
    after.struct_size = LOOM_COMM_STATS_SIZE;
    comm_.call(&loom_comm_v1::stats, &after);
    bytes_sent_ += after.bytes_sent - before.bytes_sent;
    bytes_received_ += after.bytes_received - before.bytes_received;
    rounds_ += after.rounds - before.rounds;
  }

  // Which groups a pass covers.
  enum class Groups { kAll, kCompressed, kNonFreeze };
  static bool selected(const StepGroup& g, Groups which) {
    return which == Groups::kAll || g.non_freeze() == (which == Groups::kNonFreeze);
  }

  // One Segment per tensor of the selected groups, in layout order (with Groups::kAll,
  // segment j is flat tensor j). `masks`: carry each tensor's exp_avg_mask (never for a
  // non_freeze group's tensors: those are averaged exactly). fn(group, segment) sets the
  // per-group scalars.
  template <class Fn>
  Segments segments(const std::vector<StepGroup>& groups, Groups which, bool masks, Fn&& fn) const {
    Segments out;
    std::size_t k = 0;
    for (const auto& g : groups) {
      if (!selected(g, which)) {
        k += g.tensors.size();
        continue;
      }
      for (const auto& t : g.tensors) {
        Segment s;
        s.offset = offsets_[k++];
        s.n = t.ref.n;
        s.p = t.ref.p;
        s.mask = masks && !g.non_freeze() ? t.mask : nullptr;
        s.low = t.ref.low;
        s.ltype = t.ref.ltype;
        s.g = t.ref.g;
        s.gtype = t.ref.gtype;
        fn(g, s);
        out.push_back(s);
      }
    }
    return out;
  }
  Segments segments(const std::vector<StepGroup>& groups, Groups which = Groups::kAll,
                    bool masks = false) const {
    return segments(groups, which, masks, [](const StepGroup&, Segment&) {});
  }
  static Segments without_low(Segments s) {
    for (Segment& seg : s) seg.low = nullptr;
    return s;
  }

  // flat_ = local gradients * inv_scale, in the flat layout.
  void gather_grads(const std::vector<StepGroup>& groups, float inv_scale) {
    be().load_grad(segments(groups), flat_.data(), inv_scale);
  }

  // The uncompressed average of buf over the ranks (on the state's device and stream).
  void allreduce_avg(Buffer& buf) {
    if (world_ == 1) return;
    int64_t shape[1] = {static_cast<int64_t>(buf.size())};
    DLTensor t = flat_tensor(buf.data(), shape, device_);
    loom_allreduce_args a{LOOM_ALLREDUCE_ARGS_SIZE, LOOM_REDUCE_AVG, nullptr, &t, stream_};
    counted([&] { comm_.call(&loom_comm_v1::allreduce, &a); });
  }

  // The compressed average of `buf` (flat layout) over the tensors outside non_freeze groups;
  // the non_freeze tensors' entries are left as they are.
  void compressed(Buffer& buf) {
    if (world_ == 1 || compressed_numel_ == 0) return;  // as DeepSpeed: nothing to average
    if (!any_non_freeze()) {
      int64_t shape[1] = {static_cast<int64_t>(buf.size())};
      DLTensor t = flat_tensor(buf.data(), shape, device_);
      counted([&] { car_->run(t, stream_); });
      return;
    }
    ensure(subset_, compressed_numel_);
    copy_subset(buf, subset_, /*non_freeze=*/false, /*gather=*/true);
    int64_t shape[1] = {static_cast<int64_t>(subset_.size())};
    DLTensor t = flat_tensor(subset_.data(), shape, device_);
    counted([&] { car_->run(t, stream_); });
    copy_subset(buf, subset_, /*non_freeze=*/false, /*gather=*/false);
  }

  // Packs (gather) or unpacks the flat-layout entries of the tensors whose non_freeze flag is
  // `non_freeze` into / from the dense `packed`, in layout order.
  void copy_subset(Buffer& flat, Buffer& packed, bool non_freeze, bool gather) {
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

  // buf (flat layout) *= each tensor's exp_avg_mask, for tensors that have one and are not in
  // a non_freeze group (those are averaged exactly and need no mask).
  void apply_masks(const std::vector<StepGroup>& groups, Buffer& buf) {
    be().mask_multiply(segments(groups, Groups::kAll, /*masks=*/true), buf.data());
  }

  double bc(double beta, uint64_t t) const {
    return loom::optim::bias_correction(bias_correction_, beta, t);
  }

  // p = p * (1 - lr * wd) - lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps) over each tensor,
  // with the moments in the flat layout (no moment update). `masks`: m *= exp_avg_mask
  // first (written back), as apply_masks(groups, m_) would.
  void apply_adam(const std::vector<StepGroup>& groups, double lr_base, double bc1, double bc2,
                  Groups which, bool masks) {
    const float eps = static_cast<float>(eps_);
    const float inv_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
    const Segments segs = segments(groups, which, masks, [&](const StepGroup& g, Segment& s) {
      const double lr = lr_base * g.lr_scale;
      s.decay = static_cast<float>(1.0 - lr * g.weight_decay);
      s.step = static_cast<float>(lr / bc1);
    });
    be().apply_adam(segs, m_.data(), v_.data(), inv_bc2, eps);
  }

  // Warmup: the averaged gradient through the fused Adam kernel (identical to `adam`).
  void adam_full(const std::vector<StepGroup>& groups, double lr_base, double bc1, double bc2,
                 Groups which = Groups::kAll) {
    std::size_t k = 0;
    for (const auto& g : groups) {
      if (!selected(g, which)) {
        k += g.tensors.size();
        continue;
      }
      const double lr = lr_base * g.lr_scale;
      loom::optim::AdamHyper h;
      h.set_betas(beta1_, beta2_);
      h.eps = static_cast<float>(eps_);
      h.inv_scale = 1.0f;
      h.decay = static_cast<float>(1.0 - lr * g.weight_decay);
      h.step_size = static_cast<float>(lr / bc1);
      h.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
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

  void momentum_flat(const Buffer& g) {
    be().momentum(m_.data(), g.data(), total_, loom::optim::decay_of(beta1_));
  }

  // ---------------------------------------------------------------- 1-bit Adam
  void onebit_adam_step(const std::vector<StepGroup>& groups, double lr, float inv_scale,
                        uint64_t t) {
    gather_grads(groups, inv_scale);
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

  // ---------------------------------------------------------------- 0/1 Adam
  void zero_one_step(const std::vector<StepGroup>& groups, double lr, float inv_scale, uint64_t t) {
    gather_grads(groups, inv_scale);
    if (!frozen_) {
      if (t % var_interval_ == 0) {
        // Variance step: full-precision average, both moments.
        allreduce_avg(flat_);
        ++var_updates_;
        adam_full(groups, lr, bc(beta1_, t), bc(beta2_, var_updates_));
        if (++var_counter_ == var_update_scaler_) {
          var_counter_ = 0;
          var_interval_ *= 2;
        }
      } else {
        compressed(flat_);  // 1-bit gradient average
        apply_masks(groups, flat_);
        momentum_flat(flat_);
        apply_adam(groups, lr, bc(beta1_, t), bc(beta2_, var_updates_), Groups::kAll,
                   /*masks=*/false);
      }
      if (t >= var_freeze_step_) {
        // The variance is frozen from here on; the error buffers now compensate another
        // quantity (the accumulated update), so they restart from zero.
        frozen_ = true;
        reset_car();
      }
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

  // ---------------------------------------------------------------- 1-bit LAMB
  void onebit_lamb_step(const std::vector<StepGroup>& groups, double lr, float inv_scale,
                        uint64_t t) {
    gather_grads(groups, inv_scale);
    const float eps = static_cast<float>(eps_);
    const loom::optim::Decay b1 = loom::optim::decay_of(beta1_);
    const loom::optim::Decay b2 = loom::optim::decay_of(beta2_);
    const std::size_t count = offsets_.size() - 1;
    if (t <= freeze_step_) {
      allreduce_avg(flat_);
      const float inv_bc1 = static_cast<float>(1.0 / bc(beta1_, t));
      const float inv_bc2 = static_cast<float>(1.0 / std::sqrt(bc(beta2_, t)));
      Segments segs = segments(groups, Groups::kAll, false, [](const StepGroup& g, Segment& s) {
        s.wd = static_cast<float>(g.weight_decay);
      });
      std::vector<double> sums(2 * count, 0.0);
      be().lamb_warmup_moments(segs, flat_.data(), m_.data(), v_.data(), b1, b2, inv_bc1, inv_bc2,
                               eps, sums.data());
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
      return;
    }
    if (aux_.size() == 0 || t == 1) assign_copy(aux_, v_);  // freeze_step 0: no warmup at all
    const double bc1 = bc(beta1_, t);
    const float inv_bc1 = static_cast<float>(1.0 / bc1);
    const float inv_bc2 = static_cast<float>(1.0 / std::sqrt(bc(beta2_, freeze_step_)));
    // v_fresh continues v's average past the freeze, so its bias correction is at step t.
    const float inv_bc2_fresh = static_cast<float>(1.0 / std::sqrt(bc(beta2_, t)));
    if (!scaling_set_) {
      // Equalise the tensors' momentum magnitudes under the one 1-bit scale.
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
      for (std::size_t j = 0; j < count; ++j) {
        lamb_[j].scaling_coeff = rms[j] > 0.0 ? united / rms[j] : 1.0;  // guard: zero momentum
      }
      scaling_set_ = true;
    }
    // m_prev = m, then the scaled momentum (the gradient folded in) is averaged.
    ensure(prev_, total_);
    Segments segs = segments(groups, Groups::kAll, /*masks=*/true);
    for (std::size_t j = 0; j < count; ++j) {
      segs[j].scale = static_cast<float>(lamb_[j].scaling_coeff);
    }
    be().lamb_momentum(segs, m_.data(), flat_.data(), prev_.data(), b1);
    compressed(m_);
    std::size_t k = 0;
    for (const auto& g : groups) {
      for (std::size_t i = 0; i < g.tensors.size(); ++i) {
        const std::size_t j = k++;
        segs[j].scale = static_cast<float>(1.0 / lamb_[j].scaling_coeff);
        segs[j].wd = static_cast<float>(g.weight_decay);
      }
    }
    std::vector<loom::optim::onebit::LambPostStats> stats(count);
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

  Context ctx_;
  loom::sdk::InstanceRef<loom_comm_v1> comm_;
  loom::sdk::InstanceRef<loom_codec_v1> codec_;
  double beta1_;
  double beta2_;
  double eps_;
  double weight_decay_;
  bool bias_correction_;
  uint64_t freeze_step_ = 0;
  uint64_t var_freeze_step_ = 0;
  uint64_t var_update_scaler_ = 16;
  uint64_t local_step_scaler_ = 32678;
  uint64_t local_step_clipper_ = 16;
  double max_coeff_ = 10.0;
  double min_coeff_ = 0.01;
  double coeff_beta_ = 0.9;
  double factor_max_ = 4.0;
  double factor_min_ = 0.5;
  double factor_threshold_ = 0.1;
  int32_t world_ = 1;

  // Where the state lives: fixed by the first step (device_set_); stream_ is the last step's.
  bool device_set_ = false;
  DLDevice device_{kDLCPU, 0};
  void* stream_ = nullptr;
  loom::optim::onebit::CpuBackend cpu_;
#if LOOM_OPTIM_HAVE_CUDA
  loom::optim::onebit::CudaBackend cuda_;
#endif

  // State (all exported). The flat buffers are on device_ after a step; an import puts them
  // on the host until the next step moves them.
  uint64_t steps_ = 0;
  uint64_t total_ = 0;
  std::vector<uint64_t> offsets_;
  Buffer m_;
  Buffer v_;
  Buffer aux_;           // 0/1 Adam: the local-step accumulator u; 1-bit LAMB: v_fresh
  bool frozen_ = false;  // 0/1 Adam: past var_freeze_step
  uint64_t var_interval_ = 1;
  uint64_t var_counter_ = 0;
  uint64_t var_updates_ = 0;
  uint64_t local_interval_ = 1;
  uint64_t local_counter_ = 0;
  double lrs_ = 0.0;
  std::vector<TensorState> lamb_;
  bool scaling_set_ = false;
  uint64_t bytes_sent_ = 0;
  uint64_t bytes_received_ = 0;
  uint64_t rounds_ = 0;
  uint64_t uncompressed_bytes_ = 0;
  std::unique_ptr<loom::sdk::CompressedAllreduce> car_;
  std::vector<std::byte> pending_car_;  // imported before the first step built car_

  // Set with car_ (not exported: the groups' flags come with every step): per flat tensor, 1
  // when its group is non_freeze; the element count the compressed allreduce covers.
  bool laid_out_ = false;
  std::vector<uint8_t> non_freeze_;
  uint64_t compressed_numel_ = 0;

  // Scratch on device_ (not exported).
  Buffer flat_;    // the step's gradients in the flat layout
  Buffer subset_;  // the compressed or non_freeze tensors, packed
  Buffer prev_;    // 1-bit LAMB: m before this step's momentum update (m_prev)
};

}  // namespace

LOOM_PLUGIN(plugin_name(), "1.0.0", plugin_description(), loom::sdk::factory<Onebit>());
