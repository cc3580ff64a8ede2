// The 1-bit family: onebit_adam, zero_one_adam and onebit_lamb (research notes onebit.md
// §2-§4), one source built three times (LOOM_ONEBIT_VARIANT selects the plugin). They do
// their own data-parallel communication over the `comm` and `codec` instances the manifest
// names, so the trainer always passes local gradients (owns_communication = 1):
//   warmup:      the gradients are averaged with one uncompressed fp32 allreduce;
//   compression: the momentum (or, for 0/1 Adam, the gradient / the accumulated local
//                update) is averaged with loom::sdk::CompressedAllreduce.
// All tensors of all groups are fused into one flat buffer: one collective per step for the
// whole model. Host (CPU) tensors only.
//
// Param-group extras (ABI 1.1, onebit.md §2.1): a tensor's exp_avg_mask multiplies what the
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
#include "common/parallel_for.hpp"

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

template <class Fn>
void for_range(std::size_t n, Fn&& fn) {
  loom::plugins::parallel_for(n, 1 << 15, [&](std::size_t b, std::size_t e) {
    for (std::size_t i = b; i < e; ++i) fn(i);
  });
}

DLTensor flat_tensor(float* data, int64_t* shape) {
  DLTensor t{};
  t.data = data;
  t.device = {kDLCPU, 0};
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
        FloatList("betas", {0.9, 0.999}, "Decay rates of the first and second moments.")
            .length(2)
            .range(0, 0.9999999),
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
    if (comm_.call(&loom_comm_v1::supports_device, DLDevice{kDLCPU, 0}) == 0) {
      throw Error(LOOM_ERR_UNIMPLEMENTED,
                  "comm '" + comm_.name() + "' does not support host memory");
    }
  }

  void comm_info(loom_optimizer_comm_info& out) {
    out.owns_communication = 1;
    out.bytes_sent = bytes_sent_;
    out.bytes_received = bytes_received_;
    out.rounds = rounds_;
    out.uncompressed_bytes_sent = uncompressed_bytes_;
  }

  void step(const loom_optimizer_step_args& args) {
    auto groups = loom::optim::collect(args, weight_decay_, /*allow_cuda=*/false);
    if constexpr (kVariant != Variant::kOnebitAdam) {
      for (std::size_t g = 0; g < groups.size(); ++g) {
        if (groups[g].non_freeze()) {
          throw Error(LOOM_ERR_INVALID_ARGUMENT,
                      "group " + std::to_string(g) + " sets LOOM_OPTIMIZER_GROUP_NON_FREEZE: " +
                          "non_freeze is supported by onebit_adam only, not " + plugin_name());
        }
      }
    }
    layout(groups);  // validates against the state before anything changes
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
  // counters, then the compressed allreduce's error buffers.
  void export_state(loom::sdk::StateWriter& out) {
    out.write_header(kMagic, kVersion);
    out.write_pod<uint64_t>(steps_);
    out.write_pod<uint64_t>(total_);
    out.write_vector(offsets_);
    out.write_vector(m_);
    out.write_vector(v_);
    out.write_vector(aux_);
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
      car_->reset();
    }
    steps_ = steps;
    total_ = total;
    offsets_ = std::move(offsets);
    m_ = std::move(m);
    v_ = std::move(v);
    aux_ = std::move(aux);
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
    if (!m_.empty() || steps_ > 0) {
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
      m_.assign(total_, 0.0f);
      v_.assign(total_, 0.0f);
      if constexpr (kVariant != Variant::kOnebitAdam) aux_.assign(total_, 0.0f);
      if constexpr (kVariant == Variant::kOnebitLamb) lamb_.assign(offsets_.size() - 1, {});
    }
    if (!laid_out_) {
      // The compressed allreduce covers the tensors outside non_freeze groups (none when
      // every group is non_freeze).
      std::unique_ptr<loom::sdk::CompressedAllreduce> car;
      if (packed > 0) {
        car = std::make_unique<loom::sdk::CompressedAllreduce>(ctx_, comm_, codec_,
                                                               static_cast<int64_t>(packed));
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
    flat_.resize(total_);
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

  // flat_ = local gradients * inv_scale, in the flat layout.
  void gather_grads(const std::vector<StepGroup>& groups, float inv_scale) {
    std::size_t k = 0;
    for (const auto& g : groups) {
      for (const auto& t : g.tensors) {
        float* dst = flat_.data() + offsets_[k++];
        loom::plugins::parallel_for(t.ref.n, 1 << 15, [&](std::size_t b, std::size_t e) {
          loom::optim::load_grad_cpu(static_cast<const std::byte*>(t.ref.g) +
                                         b * (t.ref.gtype == loom::optim::DType::kF32 ? 4 : 2),
                                     t.ref.gtype, e - b, inv_scale, dst + b);
        });
      }
    }
  }

  void allreduce_avg(std::vector<float>& buf) {
    if (world_ == 1) return;
    int64_t shape[1] = {static_cast<int64_t>(buf.size())};
    DLTensor t = flat_tensor(buf.data(), shape);
    loom_allreduce_args a{LOOM_ALLREDUCE_ARGS_SIZE, LOOM_REDUCE_AVG, nullptr, &t, nullptr};
    counted([&] { comm_.call(&loom_comm_v1::allreduce, &a); });
  }

  // The compressed average of `buf` (flat layout) over the tensors outside non_freeze groups;
  // the non_freeze tensors' entries are left as they are.
  void compressed(std::vector<float>& buf) {
    if (world_ == 1 || compressed_numel_ == 0) return;  // as DeepSpeed: nothing to average
    if (!any_non_freeze()) {
      int64_t shape[1] = {static_cast<int64_t>(buf.size())};
      DLTensor t = flat_tensor(buf.data(), shape);
      counted([&] { car_->run(t); });
      return;
    }
    subset_.resize(compressed_numel_);
    copy_subset(buf, subset_, /*non_freeze=*/false, /*gather=*/true);
    int64_t shape[1] = {static_cast<int64_t>(subset_.size())};
    DLTensor t = flat_tensor(subset_.data(), shape);
    counted([&] { car_->run(t); });
    copy_subset(buf, subset_, /*non_freeze=*/false, /*gather=*/false);
  }

  // Packs (gather) or unpacks the flat-layout entries of the tensors whose non_freeze flag is
  // `non_freeze` into / from the dense `packed`, in layout order.
  void copy_subset(std::vector<float>& flat, std::vector<float>& packed, bool non_freeze,
                   bool gather) const {
    std::size_t at = 0;
    for (std::size_t k = 0; k + 1 < offsets_.size(); ++k) {
      if ((non_freeze_[k] != 0) != non_freeze) continue;
      const std::size_t n = offsets_[k + 1] - offsets_[k];
      float* f = flat.data() + offsets_[k];
      if (gather) {
        std::copy(f, f + n, packed.data() + at);
      } else {
        std::copy(packed.data() + at, packed.data() + at + n, f);
      }
      at += n;
    }
  }

  // buf (flat layout) *= each tensor's exp_avg_mask, for tensors that have one and are not in
  // a non_freeze group (those are averaged exactly and need no mask).
  void apply_masks(const std::vector<StepGroup>& groups, std::vector<float>& buf) const {
    std::size_t k = 0;
    for (const auto& g : groups) {
      for (const auto& t : g.tensors) {
        float* x = buf.data() + offsets_[k++];
        if (t.mask == nullptr || g.non_freeze()) continue;
        const float* mask = t.mask;
        for_range(t.ref.n, [&](std::size_t i) { x[i] *= mask[i]; });
      }
    }
  }

  // 1 - beta^t; 1 without bias correction, and for t = 0 (a variance frozen before any
  // update, e.g. freeze_step = 0, has nothing to correct).
  double bc(double beta, uint64_t t) const {
    return bias_correction_ && t > 0 ? 1.0 - std::pow(beta, static_cast<double>(t)) : 1.0;
  }

  // Which groups a pass covers.
  enum class Groups { kAll, kCompressed, kNonFreeze };
  static bool selected(const StepGroup& g, Groups which) {
    return which == Groups::kAll || g.non_freeze() == (which == Groups::kNonFreeze);
  }

  // p = p * (1 - lr * wd) - lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps) over each tensor,
  // with the moments in the flat layout (no moment update).
  void apply_adam(std::vector<StepGroup>& groups, double lr_base, double bc1, double bc2,
                  Groups which = Groups::kAll) {
    std::size_t k = 0;
    const float eps = static_cast<float>(eps_);
    const float inv_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
    for (auto& g : groups) {
      if (!selected(g, which)) {
        k += g.tensors.size();
        continue;
      }
      const double lr = lr_base * g.lr_scale;
      const float decay = static_cast<float>(1.0 - lr * g.weight_decay);
      const float step = static_cast<float>(lr / bc1);
      for (auto& t : g.tensors) {
        const std::size_t off = offsets_[k++];
        float* p = t.ref.p;
        const float* m = m_.data() + off;
        const float* v = v_.data() + off;
        for_range(t.ref.n, [&](std::size_t i) {
          p[i] = p[i] * decay - step * (m[i] / (std::sqrt(v[i]) * inv_bc2 + eps));
        });
        if (t.ref.low != nullptr) loom::optim::copy_out_cpu(p, t.ref.low, t.ref.ltype, t.ref.n);
      }
    }
  }

  // Warmup: the averaged gradient through the fused Adam kernel (identical to `adam`).
  void adam_full(std::vector<StepGroup>& groups, double lr_base, double bc1, double bc2,
                 Groups which = Groups::kAll) {
    std::size_t k = 0;
    for (auto& g : groups) {
      if (!selected(g, which)) {
        k += g.tensors.size();
        continue;
      }
      const double lr = lr_base * g.lr_scale;
      loom::optim::AdamHyper h;
      h.beta1 = static_cast<float>(beta1_);
      h.beta2 = static_cast<float>(beta2_);
      h.eps = static_cast<float>(eps_);
      h.inv_scale = 1.0f;
      h.decay = static_cast<float>(1.0 - lr * g.weight_decay);
      h.step_size = static_cast<float>(lr / bc1);
      h.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
      for (auto& t : g.tensors) {
        const std::size_t off = offsets_[k++];
        loom::optim::TensorRef r = t.ref;
        r.g = flat_.data() + off;
        r.gtype = loom::optim::DType::kF32;
        r.m = m_.data() + off;
        r.v = v_.data() + off;
        loom::optim::adam_cpu(r, h);
      }
    }
  }

  void momentum_flat(const std::vector<float>& g) {
    loom::optim::momentum_cpu(m_.data(), g.data(), loom::optim::DType::kF32, total_,
                              static_cast<float>(beta1_), 1.0f);
  }

  // ---------------------------------------------------------------- 1-bit Adam
  void onebit_adam_step(std::vector<StepGroup>& groups, double lr, float inv_scale, uint64_t t) {
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
      apply_masks(groups, m_);
      apply_adam(groups, lr, bc(beta1_, t), bc(beta2_, freeze_step_));
      return;
    }
    // non_freeze groups: as in warmup (their gradients averaged with one uncompressed
    // allreduce, both moments updated, bias corrections at step t).
    subset_.resize(total_ - compressed_numel_);
    copy_subset(flat_, subset_, /*non_freeze=*/true, /*gather=*/true);
    allreduce_avg(subset_);
    copy_subset(flat_, subset_, /*non_freeze=*/true, /*gather=*/false);
    adam_full(groups, lr, bc(beta1_, t), bc(beta2_, t), Groups::kNonFreeze);
    for (std::size_t k = 0; k + 1 < offsets_.size(); ++k) {
      if (non_freeze_[k] != 0) continue;
      const std::size_t off = offsets_[k];
      loom::optim::momentum_cpu(m_.data() + off, flat_.data() + off, loom::optim::DType::kF32,
                                offsets_[k + 1] - off, static_cast<float>(beta1_), 1.0f);
    }
    compressed(m_);
    apply_masks(groups, m_);
    apply_adam(groups, lr, bc(beta1_, t), bc(beta2_, freeze_step_), Groups::kCompressed);
  }

  // ---------------------------------------------------------------- 0/1 Adam
  void zero_one_step(std::vector<StepGroup>& groups, double lr, float inv_scale, uint64_t t) {
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
        apply_adam(groups, lr, bc(beta1_, t), bc(beta2_, var_updates_));
      }
      if (t >= var_freeze_step_) {
        // The variance is frozen from here on; the error buffers now compensate another
        // quantity (the accumulated update), so they restart from zero.
        frozen_ = true;
        if (car_) car_->reset();
      }
      return;
    }
    // Phase B: local steps, accumulating the update in aux_ (u), synced every H steps.
    momentum_flat(flat_);
    const double bc1 = bc(beta1_, t);
    const float eps = static_cast<float>(eps_);
    const float inv_bc2 = static_cast<float>(1.0 / std::sqrt(bc(beta2_, var_updates_)));
    std::size_t k = 0;
    double lr_last = lr;
    for (auto& g : groups) {
      const double glr = lr * g.lr_scale;
      lr_last = glr;
      const float lrf = static_cast<float>(glr);
      const float wd = static_cast<float>(g.weight_decay);
      const float inv_bc1 = static_cast<float>(1.0 / bc1);
      for (auto& tt : g.tensors) {
        const std::size_t off = offsets_[k++];
        float* p = tt.ref.p;
        const float* m = m_.data() + off;
        const float* v = v_.data() + off;
        float* u = aux_.data() + off;
        for_range(tt.ref.n, [&](std::size_t i) {
          const float d = m[i] * inv_bc1 / (std::sqrt(v[i]) * inv_bc2 + eps) + wd * p[i];
          p[i] -= lrf * d;
          u[i] -= lrf * d;
        });
      }
    }
    (void)lr_last;
    lrs_ += lr;
    const bool sync = t % local_interval_ == 0;
    if (sync) {
      if (!(lrs_ > 0.0)) {
        // All steps of the window had lr 0: nothing moved, nothing to average.
        std::fill(aux_.begin(), aux_.end(), 0.0f);
      } else {
        // Revert to the synced point, un-precondition u to momentum scale, average it.
        k = 0;
        for (auto& g : groups) {
          for (auto& tt : g.tensors) {
            const std::size_t off = offsets_[k++];
            float* p = tt.ref.p;
            const float* v = v_.data() + off;
            float* u = aux_.data() + off;
            for_range(tt.ref.n, [&](std::size_t i) {
              p[i] -= u[i];
              u[i] *= std::sqrt(v[i]) * inv_bc2 + eps;
            });
          }
        }
        compressed(aux_);
        apply_masks(groups, aux_);
        const float scale = static_cast<float>(-bc1 / lrs_);
        k = 0;
        for (auto& g : groups) {
          for (auto& tt : g.tensors) {
            const std::size_t off = offsets_[k++];
            float* p = tt.ref.p;
            float* m = m_.data() + off;
            const float* v = v_.data() + off;
            float* u = aux_.data() + off;
            for_range(tt.ref.n, [&](std::size_t i) {
              m[i] = u[i] * scale;
              p[i] += u[i] / (std::sqrt(v[i]) * inv_bc2 + eps);
              u[i] = 0.0f;
            });
          }
        }
      }
      lrs_ = 0.0;
    }
    for (auto& g : groups) {
      for (auto& tt : g.tensors) {
        if (tt.ref.low != nullptr) {
          loom::optim::copy_out_cpu(tt.ref.p, tt.ref.low, tt.ref.ltype, tt.ref.n);
        }
      }
    }
    if (++local_counter_ % local_step_scaler_ == 0) {
      local_interval_ = std::min(local_step_clipper_, local_interval_ * 2);
    }
  }

  // ---------------------------------------------------------------- 1-bit LAMB
  void onebit_lamb_step(std::vector<StepGroup>& groups, double lr, float inv_scale, uint64_t t) {
    gather_grads(groups, inv_scale);
    const float eps = static_cast<float>(eps_);
    const float b1 = static_cast<float>(beta1_);
    const float b2 = static_cast<float>(beta2_);
    if (t <= freeze_step_) {
      allreduce_avg(flat_);
      const double bc1 = bc(beta1_, t);
      const double bc2 = bc(beta2_, t);
      std::size_t k = 0;
      for (auto& g : groups) {
        loom::optim::LambHyper h;
        h.beta1 = b1;
        h.beta2 = b2;
        h.eps = eps;
        h.inv_scale = 1.0f;
        h.wd = static_cast<float>(g.weight_decay);
        h.inv_bc1 = static_cast<float>(1.0 / bc1);
        h.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
        for (auto& tt : g.tensors) {
          const std::size_t idx = k++;
          const std::size_t off = offsets_[idx];
          loom::optim::TensorRef r = tt.ref;
          r.g = flat_.data() + off;
          r.gtype = loom::optim::DType::kF32;
          r.m = m_.data() + off;
          r.v = v_.data() + off;
          double sp = 0.0;
          double su = 0.0;
          loom::optim::lamb_moments_cpu(r, h, &sp, &su);
          double coeff = 1.0;
          if (sp > 0.0 && su > 0.0) {
            coeff = std::clamp(std::sqrt(sp) / std::sqrt(su), min_coeff_, max_coeff_);
          }
          TensorState& s = lamb_[idx];
          if (coeff != 1.0)
            s.lamb_coeff_freeze = coeff_beta_ * s.lamb_coeff_freeze + (1.0 - coeff_beta_) * coeff;
          loom::optim::lamb_apply_cpu(r, h, static_cast<float>(lr * g.lr_scale * coeff));
        }
      }
      if (t == freeze_step_) aux_ = v_;  // v_fresh starts from the frozen variance
      return;
    }
    if (aux_.empty() || t == 1) aux_ = v_;  // freeze_step 0: no warmup at all
    const double bc1 = bc(beta1_, t);
    const float inv_bc1 = static_cast<float>(1.0 / bc1);
    const float inv_bc2 = static_cast<float>(1.0 / std::sqrt(bc(beta2_, freeze_step_)));
    // v_fresh continues v's average past the freeze, so its bias correction is at step t.
    const float inv_bc2_fresh = static_cast<float>(1.0 / std::sqrt(bc(beta2_, t)));
    const std::size_t count = offsets_.size() - 1;
    if (!scaling_set_) {
      // Equalise the tensors' momentum magnitudes under the one 1-bit scale.
      std::vector<double> rms(count, 0.0);
      double sum = 0.0;
      std::size_t nonzero = 0;
      for (std::size_t j = 0; j < count; ++j) {
        const std::size_t n = offsets_[j + 1] - offsets_[j];
        double s = 0.0;
        for (std::size_t i = 0; i < n; ++i)
          s += static_cast<double>(m_[offsets_[j] + i]) * m_[offsets_[j] + i];
        rms[j] = n > 0 ? std::sqrt(s / static_cast<double>(n)) : 0.0;
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
    // m_prev in flat_ (the gradient is folded into m first).
    std::vector<float> m_prev = m_;
    for (std::size_t j = 0; j < count; ++j) {
      const std::size_t off = offsets_[j];
      const std::size_t n = offsets_[j + 1] - off;
      const float sc = static_cast<float>(lamb_[j].scaling_coeff);
      float* m = m_.data() + off;
      const float* g = flat_.data() + off;
      for_range(n, [&](std::size_t i) { m[i] = (b1 * m[i] + (1.0f - b1) * g[i]) * sc; });
    }
    compressed(m_);
    std::size_t k = 0;
    for (auto& g : groups) {
      const float wd = static_cast<float>(g.weight_decay);
      for (auto& tt : g.tensors) {
        const std::size_t j = k++;
        const std::size_t off = offsets_[j];
        const std::size_t n = tt.ref.n;
        TensorState& s = lamb_[j];
        const float inv_sc = static_cast<float>(1.0 / s.scaling_coeff);
        float* m = m_.data() + off;
        const float* mp = m_prev.data() + off;
        const float* v = v_.data() + off;
        float* vf = aux_.data() + off;
        const float* p = tt.ref.p;
        const float* mask = tt.mask;
        double pre2 = 0.0;
        double u2 = 0.0;
        float factor = 0.0f;
        for (std::size_t i = 0; i < n; ++i) {
          m[i] *= inv_sc;
          if (mask != nullptr) m[i] *= mask[i];
          const float gh = (m[i] - b1 * mp[i]) / (1.0f - b1);
          vf[i] = b2 * vf[i] + (1.0f - b2) * gh * gh;
          const float denom = std::sqrt(v[i]) * inv_bc2 + eps;
          const float pre = m[i] * inv_bc1 / denom;
          const float u = pre + wd * p[i];
          pre2 += static_cast<double>(pre) * pre;
          u2 += static_cast<double>(u) * u;
          factor = std::max(factor, denom / (std::sqrt(vf[i]) * inv_bc2_fresh + eps));
        }
        double f = factor;
        if (wd > 0.0f && u2 > 0.0) {
          const double r = std::min(1.0, std::sqrt(pre2) / std::sqrt(u2));
          f = f * r + (1.0 - r);
        }
        f = std::clamp(f, factor_min_, factor_max_);
        f = std::clamp(f, s.last_factor * (1.0 - factor_threshold_),
                       s.last_factor * (1.0 + factor_threshold_));
        s.last_factor = f;
        const float step = static_cast<float>(lr * g.lr_scale * s.lamb_coeff_freeze * f);
        float* pw = tt.ref.p;
        for_range(n, [&](std::size_t i) {
          const float u = m[i] * inv_bc1 / (std::sqrt(v[i]) * inv_bc2 + eps) + wd * pw[i];
          pw[i] -= step * u;
        });
        if (tt.ref.low != nullptr) loom::optim::copy_out_cpu(pw, tt.ref.low, tt.ref.ltype, n);
      }
    }
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

  // State (all exported).
  uint64_t steps_ = 0;
  uint64_t total_ = 0;
  std::vector<uint64_t> offsets_;
  std::vector<float> m_;
  std::vector<float> v_;
  std::vector<float> aux_;  // 0/1 Adam: the local-step accumulator u; 1-bit LAMB: v_fresh
  bool frozen_ = false;     // 0/1 Adam: past var_freeze_step
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

  std::vector<float> flat_;    // scratch: the step's gradients in the flat layout
  std::vector<float> subset_;  // scratch: the compressed or non_freeze tensors, packed
};

}  // namespace

LOOM_PLUGIN(plugin_name(), "1.0.0", plugin_description(), loom::sdk::factory<Onebit>());
