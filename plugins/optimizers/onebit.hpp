// The 1-bit family: onebit_adam, zero_one_adam and onebit_lamb (as the 1-bit Adam, 0/1
// Adam and 1-bit LAMB papers and DeepSpeed's implementations define them; docs/optimizers.md).
// They do their own data-parallel communication over the `comm` and `codec` instances the
// manifest names, so the trainer always passes local gradients (owns_communication = 1):
//   warmup:      the gradients are averaged with one uncompressed fp32 allreduce;
//   compression: the momentum (or, for 0/1 Adam, the gradient / the accumulated local
//                update) is averaged with loom::sdk::CompressedAllreduce.
// All tensors of all groups are fused into one flat buffer: one collective per step for the
// whole model.
//
// Sharded state (shard_state = true; onebit_shard.cpp): ZeRO-1 for the optimizer. Rank r of n
// keeps m and v for its slice [r * c, r * c + c) of the flat layout (c = the codec's padded
// length / n); a step reduce-scatters the gradients (fp32 in the warmup, the compressed
// allreduce's worker half after the freeze), updates the slice's parameters and allgathers
// them (fp32), or after the freeze with shard_gather = "compressed" the change of them (the
// compressed allreduce's server half). It compresses the gradient, not the local momentum (no
// rank holds the whole momentum to add it to), with the same error feedback. onebit_lamb
// (host memory, fp32 gather; onebit_lamb.cpp) also keeps v_fresh per slice, compresses each
// tensor's gradient times its scale, and gathers its per-tensor sums from every rank.
//
// Where the code lives:
//   onebit.hpp (this file)  the shared part, class Onebit: parameters every variant has, the
//                           device and layout checks, the flat state and scratch buffers, the
//                           backend, the collectives, the state format;
//   onebit.cpp              its implementation;
//   onebit_shard.cpp        onebit_adam's step with shard_state = true, and the collectives
//                           onebit_lamb's sharded step shares;
//   onebit_adam.cpp, zero_one_adam.cpp, onebit_lamb.cpp
//                           one algorithm each: its schema, its own parameters and its step;
//   onebit_plugin.cpp       the plugin entry; built three times (LOOM_ONEBIT_VARIANT selects
//                           which of the three classes a library registers).
//
// Devices (docs/optimizers.md): the tensors of a step are all on the CPU or all on one CUDA
// device, fixed by the first step. On CUDA the flat state (m, v, aux and the scratch buffers)
// lives in that device's memory and every loop runs as a kernel ordered on the step's stream
// (onebit_backend.hpp: each algorithm written once, CPU and CUDA primitives); the warmup
// allreduce and the compressed allreduce run on the device buffers with that stream, so the
// comm and the codec must support the device. The state blob is the same on both (device
// buffers are copied to and from the host), so a checkpoint moves between CPU and CUDA.
//
// Streams (docs/abi.md): each step may bring another stream. The step's work is marked with
// an event on its stream at its end, and a step on another stream first waits for it (the
// compressed allreduce is handed over the same way, use_stream); export_state copies on the
// last step's stream, and the compressed allreduce's buffers are freed on it at destruction,
// so that stream must stay valid until the optimizer steps on another one or is destroyed.
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
#pragma once

#include <loom/sdk.hpp>
#include <loom/sdk/compressed_allreduce.hpp>
#include <loom/sdk/hierarchical_allreduce.hpp>
#include <loom/sdk/kinds/optimizer.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common.hpp"
#include "finite_check.hpp"
#include "onebit_backend.hpp"

namespace loom::optim::onebit {

// The most steps an instance takes: far past any run, and it keeps 0/1 Adam's doubling
// intervals from wrapping to 0 (see check_imported).
constexpr uint64_t kMaxSteps = uint64_t{1} << 62;

enum class Variant { kOnebitAdam = 0, kZeroOneAdam = 1, kOnebitLamb = 2 };

// The plugin's name; also the magic of its state blob.
constexpr const char* plugin_name(Variant v) {
  switch (v) {
    case Variant::kOnebitAdam:
      return "onebit_adam";
    case Variant::kZeroOneAdam:
      return "zero_one_adam";
    case Variant::kOnebitLamb:
      return "onebit_lamb";
  }
  return "";
}

struct TensorState {  // onebit_lamb's per-tensor scalars
  double lamb_coeff_freeze = 0.0;
  double last_factor = 1.0;
  double scaling_coeff = 1.0;
};

// What the three optimizers share. A variant derives from it, adds its parameters to
// schema() and implements algorithm_step().
class Onebit : public loom::sdk::Optimizer {
 public:
  virtual ~Onebit();
  Onebit(const Onebit&) = delete;
  Onebit& operator=(const Onebit&) = delete;

  void comm_info(loom_optimizer_comm_info& out);
  void step(const loom_optimizer_step_args& args);
  // Overlap with the backward (onebit_overlap.cpp): marks the tensors' gradients final and
  // starts the buckets they complete. Does nothing unless the step is bucketed (bucketed()).
  void grads_ready(const loom_optimizer_ready_args& args);
  // Format v1: header, variant, counters, flat buffers, per-tensor scalars, traffic
  // counters, then the compressed allreduce's error buffers. The same on every device:
  // device buffers are copied to the host (on the last step's stream, synchronized first, so
  // the compressed allreduce's error buffers are final too).
  void export_state(loom::sdk::StateWriter& out);
  // The buffers are kept on the host until the next step moves them to its device, so a
  // blob imports the same way before the first step, on a CPU instance or a CUDA one.
  void import_state(std::span<const std::byte> blob);

 protected:
  Onebit(loom::sdk::Context& ctx, Variant variant);

  // comm, codec, betas, eps, weight_decay, bias_correction (every variant, in this order).
  static loom::sdk::Schema common_schema();
  // The `freeze_step` parameter of onebit_adam and onebit_lamb.
  static loom::sdk::Int freeze_step_param();

  // One step of the algorithm, after the checks, the layout and the finite check (t = the
  // step's number); flat_ holds the step's local gradients divided by grad_scale.
  virtual void algorithm_step(const std::vector<StepGroup>& groups, double lr, uint64_t t) = 0;

  // Which groups a pass covers.
  enum class Groups { kAll, kCompressed, kNonFreeze };
  static bool selected(const StepGroup& g, Groups which) {
    return which == Groups::kAll || g.non_freeze() == (which == Groups::kNonFreeze);
  }

  const char* name() const { return plugin_name(variant_); }
  Backend& be();
  bool on_cuda() const { return loom::sdk::is_cuda(device_); }
  bool any_non_freeze() const { return compressed_numel_ != total_; }
  double bc(double beta, uint64_t t) const {
    return loom::optim::bias_correction(bias_correction_, beta, t);
  }

  // `b` holds n elements on the state's device (contents undefined when it had to change).
  void ensure(Buffer& b, std::size_t n);
  // dst = a copy of src (both on the state's device).
  void assign_copy(Buffer& dst, const Buffer& src);
  // Zeroes the compressed allreduce's error buffers, ordered on the current stream.
  void reset_car();
  void import_exchange_state(loom::sdk::StateReader& in);

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
  void gather_grads(const std::vector<StepGroup>& groups, float inv_scale);
  // The uncompressed average of buf over the ranks (on the state's device and stream).
  void allreduce_avg(Buffer& buf);
  // warmup_wire = "bf16": wire = src[0, n) rounded to bf16; dst[0, n) = wire widened (exact).
  void to_bf16(const Buffer& src, std::size_t n, Buffer& wire);
  void from_bf16(const Buffer& wire, std::size_t n, Buffer& dst);
  // The compressed average of `buf` (flat layout) over the tensors outside non_freeze groups;
  // the non_freeze tensors' entries are left as they are.
  void compressed(Buffer& buf);
  // Packs (gather) or unpacks the flat-layout entries of the tensors whose non_freeze flag is
  // `non_freeze` into / from the dense `packed`, in layout order.
  void copy_subset(Buffer& flat, Buffer& packed, bool non_freeze, bool gather);
  // buf (flat layout) *= each tensor's exp_avg_mask, for tensors that have one and are not in
  // a non_freeze group (those are averaged exactly and need no mask).
  void apply_masks(const std::vector<StepGroup>& groups, Buffer& buf);
  // p = p * (1 - lr * wd) - lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps) over each tensor,
  // with the moments in the flat layout (no moment update). `masks`: m *= exp_avg_mask
  // first (written back), as apply_masks(groups, m_) would.
  void apply_adam(const std::vector<StepGroup>& groups, double lr_base, double bc1, double bc2,
                  Groups which, bool masks);
  // The fused Adam kernel's scalars for group g (its lr_scale and weight decay).
  loom::optim::AdamHyper adam_hyper(const StepGroup& g, double lr_base, double bc1,
                                    double bc2) const;
  // Warmup: the averaged gradient through the fused Adam kernel (identical to `adam`).
  void adam_full(const std::vector<StepGroup>& groups, double lr_base, double bc1, double bc2,
                 Groups which = Groups::kAll);
  // m = beta1 * m + (1 - beta1) * g over the whole flat layout.
  void momentum_flat(const Buffer& g);

  // Buckets (bucket_mb > 0; onebit_overlap.cpp): the flat layout cut into the compressed
  // allreduce's segments of bucket_elements_, each exchanged (an uncompressed allreduce too) as
  // soon as the gradients it covers are final; the finite check agreed after the exchange, a
  // skipped step undone. The same bits whether grads_ready() started some buckets during the
  // backward or step() starts them all. A variant says what each step exchanges and splits its
  // step around the exchange with the bucket_* hooks below.
  bool bucketed() const;
  void bucketed_step(const std::vector<StepGroup>& groups, const loom_optimizer_step_args& args);
  static loom::sdk::Float bucket_mb_param();
  uint64_t bucket_elements_ = 0;

  enum class Exchange {
    kNone,        // nothing early (0/1 Adam after its freeze): step() runs algorithm_step
    kAverage,     // the gradients (flat_) averaged uncompressed, fp32 or bf16 on the wire
    kCompressed,  // bucket_buffer() through the compressed allreduce, bucket_prepare()d first
  };
  // What step t exchanges (the state as it is before the step; not the lr, which only step()
  // has: docs/abi.md).
  virtual Exchange bucket_exchange(uint64_t t) const = 0;
  // kCompressed: the flat buffer compressed (m_ unless the variant says otherwise).
  virtual Buffer& bucket_buffer() { return m_; }
  // kCompressed, before the first bucket: what the step needs from the state as it was.
  virtual void bucket_begin(const std::vector<StepGroup>& /*groups*/) {}
  // kCompressed: the bucket [lo, lo + n) of the step's update before it leaves, keeping what
  // bucket_restore() puts back. `zeros`: this rank's step will be skipped, and the codec
  // refuses a non-finite input, so the bucket sends zeros.
  virtual void bucket_prepare(const std::vector<StepGroup>& groups, std::size_t lo, std::size_t n,
                              bool zeros) = 0;
  virtual void bucket_restore(std::size_t /*lo*/, std::size_t /*n*/) {}  // nothing kept
  // After every bucket's exchange (the step is taken): the rest of the step.
  virtual void bucket_finish(const std::vector<StepGroup>& groups, Exchange e, double lr,
                             uint64_t t) = 0;
  // The step's segments clipped to the flat range [lo, lo + n) (pointers moved with them);
  // `kept` (optional) gets the index in `all` of each segment returned.
  static Segments clip(const Segments& all, std::size_t lo, std::size_t n,
                       std::vector<std::size_t>* kept = nullptr);

  // shard_state (onebit_shard.cpp). One step of onebit_adam on this rank's slice: the
  // gradients reduce-scattered (compressed after freeze_step), Adam on the slice (v frozen
  // after freeze_step), the parameters allgathered.
  void sharded_adam(const std::vector<StepGroup>& groups, double lr, uint64_t t,
                    uint64_t freeze_step);
  // The slice's length for `total` elements over world_ ranks (0 for none).
  uint64_t shard_numel(uint64_t total) const;
  // shard_state: the parts of the step's tensors inside [lo, hi) of the flat layout, their
  // offsets counted from `base`; the gradient pointers are the parameters (fp32), for copies.
  // `group_of` and `tensor_of` (optional) get each piece's group and flat tensor index.
  Segments pieces(const std::vector<StepGroup>& groups, uint64_t lo, uint64_t hi, uint64_t base,
                  bool masks, std::vector<std::size_t>* group_of = nullptr,
                  std::vector<std::size_t>* tensor_of = nullptr) const;
  // shard_state: slice_ = the ranks' average of flat_'s slice (fp32, or the compressed
  // allreduce's worker half when `compressed_run`).
  void reduce_scatter_grads(bool compressed_run);
  // shard_state: every rank's updated slice of the parameters into every rank's tensors.
  void allgather_params(const std::vector<StepGroup>& groups);
  // shard_state: every rank's `part` (the same length on each), rank 0's first: per-tensor
  // partial sums that every rank then combines in the same order, to the same bits.
  std::vector<double> gather_parts(const std::vector<double>& part);

  // Parameters every variant has.
  loom::sdk::Context ctx_;
  loom::sdk::InstanceRef<loom_comm_v1> comm_;
  loom::sdk::InstanceRef<loom_codec_v1> codec_;
  double beta1_;
  double beta2_;
  double eps_;
  double weight_decay_;
  bool bias_correction_;
  bool skip_nonfinite_;
  bool hierarchical_;
  bool warmup_bf16_;  // warmup_wire = "bf16"
  bool shard_;        // shard_state
  bool gather_fp32_;  // shard_gather = "fp32"
  int32_t rank_ = 0;
  int32_t world_ = 1;

  // State (all exported; a variant uses the fields its comment names). The flat buffers
  // are on device_ after a step; an import puts them on the host until the next step moves
  // them.
  uint64_t steps_ = 0;
  uint64_t total_ = 0;
  std::vector<uint64_t> offsets_;
  Buffer m_;
  Buffer v_;
  Buffer aux_;                     // 0/1 Adam: the local-step accumulator u; 1-bit LAMB: v_fresh
  bool frozen_ = false;            // 0/1 Adam: past var_freeze_step
  uint64_t var_interval_ = 1;      // 0/1 Adam
  uint64_t var_counter_ = 0;       // 0/1 Adam
  uint64_t var_updates_ = 0;       // 0/1 Adam
  uint64_t local_interval_ = 1;    // 0/1 Adam
  uint64_t local_counter_ = 0;     // 0/1 Adam
  double lrs_ = 0.0;               // 0/1 Adam
  std::vector<TensorState> lamb_;  // 1-bit LAMB
  bool scaling_set_ = false;       // 1-bit LAMB
  uint64_t bytes_sent_ = 0;
  uint64_t bytes_received_ = 0;
  uint64_t rounds_ = 0;
  uint64_t comm_wait_ns_ = 0;  // blocked in the transport (comm_info; not exported)
  uint64_t uncompressed_bytes_ = 0;
  std::unique_ptr<loom::sdk::CompressedAllreduce> car_;
  // Instead of car_ with `hierarchical = true`: compression between hosts only.
  std::unique_ptr<loom::sdk::HierarchicalCompressedAllreduce> hier_;
  Buffer wire_;        // warmup_wire = "bf16": the allreduce's n bf16 values, in (n + 1) / 2 floats
  Buffer wire_slice_;  // and with shard_state, the reduce-scatter's slice
  std::vector<std::byte> pending_car_;  // imported before the first step built car_

  // Set with car_ (not exported: the groups' flags come with every step): per flat tensor, 1
  // when its group is non_freeze; the element count the compressed allreduce covers.
  bool laid_out_ = false;
  std::vector<uint8_t> non_freeze_;
  uint64_t compressed_numel_ = 0;

  // Steps skipped for a non-finite gradient on any rank, and the flag the ranks agree on
  // (neither exported: the state after a skipped step is byte-identical to the one before).
  uint64_t skipped_ = 0;
  FiniteFlag finite_;

  // The bucketed step begun by grads_ready() and finished by step() (onebit_overlap.cpp).
  struct Pending {
    int64_t step = 0;
    Exchange exchange = Exchange::kNone;
    float inv_scale = 1.0f;
    std::vector<uint8_t> ready;      // per flat tensor
    std::vector<uint8_t> begun;      // per bucket: started
    std::size_t started = 0;         // how many
    std::vector<std::size_t> last;   // per bucket: the last flat tensor it covers
    std::vector<std::size_t> first;  // and the first
    loom_comm_stats before{};        // the comm's counters when the step began (warmup)
    // kAverage's allreduces, one per bucket (their args point here: sized once).
    std::vector<int64_t> shape;
    std::vector<DLTensor> tensor;
    std::vector<loom_allreduce_args> args;
    std::vector<loom::sdk::CommRequest> request;
  };
  std::unique_ptr<Pending> pending_;
  Buffer m_keep_;  // onebit_adam's compressed buckets: m before the step, for a skipped step

  // Scratch on device_ (not exported).
  Buffer flat_;    // the step's gradients in the flat layout
  Buffer subset_;  // the compressed or non_freeze tensors, packed
  Buffer prev_;    // 1-bit LAMB: m before this step's momentum update (m_prev)
  Buffer slice_;   // shard_state: this rank's slice of the averaged gradient, then of the params
  Buffer old_;     // shard_state, compressed gather: the slice's parameters before the step

  // shard_state: flat_ holds padded_ elements (the codec's padding, zero past total_); this
  // rank's slice is [shard_lo_, shard_lo_ + m_.size()).
  uint64_t padded_ = 0;
  uint64_t shard_lo_ = 0;

 private:
  // 2: followed by the shard record (shard_state only; unsharded states stay version 1).
  static constexpr uint32_t kVersion = 2;

  static loom_status* append(void* ctx, const void* data, size_t bytes);
  static bool same_device(DLDevice a, DLDevice b) {
    return a.device_type == b.device_type &&
           (a.device_type == kDLCPU || a.device_id == b.device_id);
  }
  // The device of the step's tensors (collect() already refused CPU mixed with CUDA and
  // devices other than those two); a step without tensors keeps the state's device.
  DLDevice step_device(const std::vector<StepGroup>& groups) const;
  // The state's device is fixed by the first step; the comm and the codec must support it.
  void check_device(DLDevice device);
  // shard_state after the freeze, shard_gather = "compressed": `segs` (the slice's pieces with
  // their decay and step) stepped on a copy of the slice's parameters; the change shared
  // through the compressed allreduce's allgather and added to every rank's tensors.
  void share_update(const std::vector<StepGroup>& groups, Segments segs, float inv_bc2);
  // step() once the device and stream are set (and, on CUDA, ordered after the last step).
  void ordered_step(const std::vector<StepGroup>& groups, const loom_optimizer_step_args& args);
  // The flat layout: tensor k of the step occupies [offsets_[k], offsets_[k+1]).
  void layout(const std::vector<StepGroup>& groups);
  // True when flat_ (the step's local gradients) is finite on every rank: each rank checks
  // its own, then one allreduce MAX of the flag, so that all ranks skip the same steps.
  bool finite_on_every_rank();
  // The allreduce MAX of finite_ (checked so far) and its outcome: true when no rank raised it.
  bool agreed_finite();
  // The bucketed step's parts (onebit_overlap.cpp).
  void begin_pending(const std::vector<StepGroup>& groups, const loom_optimizer_step_args& args);
  void mark_ready(const std::vector<StepGroup>& groups, std::size_t first, std::size_t count);
  void start_buckets(const std::vector<StepGroup>& groups);
  void start_bucket(const std::vector<StepGroup>& groups, std::size_t k);
  void drop_pending() noexcept;
  void finish_pending(const std::vector<StepGroup>& groups, const loom_optimizer_step_args& args);

  // Counts what `fn` (one collective) did on the transport and the time it kept this rank
  // waiting: all of a plain collective's, only a compressed run's time in the transport.
  void counted(const std::function<void()>& fn, bool compressed_run);

  Variant variant_;

  // Where the state lives: fixed by the first step (device_set_); stream_ is the last step's
  // (export_state's copies run on it; on CUDA the next step on another stream waits for its
  // work through cuda_'s event, docs/abi.md Streams).
  bool device_set_ = false;
  DLDevice device_{kDLCPU, 0};
  void* stream_ = nullptr;
  CpuBackend cpu_;
  CudaBackend cuda_;
};

// ---------------------------------------------------------------- the three variants

class OnebitAdam final : public Onebit {
 public:
  static loom::sdk::Schema schema();
  explicit OnebitAdam(loom::sdk::Context& ctx);

 private:
  void algorithm_step(const std::vector<StepGroup>& groups, double lr, uint64_t t) override;
  Exchange bucket_exchange(uint64_t t) const override;
  void bucket_begin(const std::vector<StepGroup>& groups) override;
  void bucket_prepare(const std::vector<StepGroup>& groups, std::size_t lo, std::size_t n,
                      bool zeros) override;
  void bucket_restore(std::size_t lo, std::size_t n) override;
  void bucket_finish(const std::vector<StepGroup>& groups, Exchange e, double lr,
                     uint64_t t) override;
  uint64_t freeze_step_ = 0;
};

class ZeroOneAdam final : public Onebit {
 public:
  static loom::sdk::Schema schema();
  explicit ZeroOneAdam(loom::sdk::Context& ctx);

 private:
  void algorithm_step(const std::vector<StepGroup>& groups, double lr, uint64_t t) override;
  Exchange bucket_exchange(uint64_t t) const override;
  void bucket_prepare(const std::vector<StepGroup>& groups, std::size_t lo, std::size_t n,
                      bool zeros) override;
  void bucket_finish(const std::vector<StepGroup>& groups, Exchange e, double lr,
                     uint64_t t) override;
  Buffer& bucket_buffer() override { return flat_; }  // the 1-bit gradient
  // The parts of a step before the freeze around its exchange (algorithm_step and the bucket
  // hooks share them).
  void variance_step(const std::vector<StepGroup>& groups, double lr, uint64_t t);
  void gradient_step(const std::vector<StepGroup>& groups, double lr, uint64_t t);
  void end_of_warmup(uint64_t t);
  uint64_t var_freeze_step_ = 0;
  uint64_t var_update_scaler_ = 16;
  uint64_t local_step_scaler_ = 32678;
  uint64_t local_step_clipper_ = 16;
};

class OnebitLamb final : public Onebit {
 public:
  static loom::sdk::Schema schema();
  // min_coeff <= max_coeff and factor_min <= factor_max, checked by `loom check`.
  static void validate_params(loom::sdk::Context& params);
  explicit OnebitLamb(loom::sdk::Context& ctx);

 private:
  void algorithm_step(const std::vector<StepGroup>& groups, double lr, uint64_t t) override;
  Exchange bucket_exchange(uint64_t t) const override;
  void bucket_begin(const std::vector<StepGroup>& groups) override;
  void bucket_prepare(const std::vector<StepGroup>& groups, std::size_t lo, std::size_t n,
                      bool zeros) override;
  void bucket_restore(std::size_t lo, std::size_t n) override;
  void bucket_finish(const std::vector<StepGroup>& groups, Exchange e, double lr,
                     uint64_t t) override;
  // The parts of a step around its exchange (algorithm_step and the bucket hooks share them).
  void warmup_update(const std::vector<StepGroup>& groups, double lr, uint64_t t);
  // Each tensor's trust ratio from its sums (sum p^2, sum u^2), folded into lamb_coeff_freeze.
  std::vector<double> trust_ratios(const std::vector<double>& sums);
  // The first compression step's per-tensor scales (equal momentum magnitudes), from m_, or
  // from each tensor's sum of m^2.
  std::vector<double> momentum_scales(const std::vector<StepGroup>& groups);
  std::vector<double> scales_of(const std::vector<double>& squares) const;
  void set_scales();  // scales_ into the state, once
  // Each tensor's compression factor from its stats, clamped and rate-limited (last_factor).
  std::vector<double> factors(const std::vector<StepGroup>& groups,
                              const std::vector<LambPostStats>& stats);
  float inv_bc1(uint64_t t) const;
  float inv_bc2_frozen() const;
  float inv_bc2_fresh(uint64_t t) const;
  // shard_state (host memory): each rank the moments of its slice (onebit_lamb.cpp).
  void sharded_step(const std::vector<StepGroup>& groups, double lr, uint64_t t);
  // The compression momentum's segments: masks, and each tensor's scale (scales_, or the
  // state's once set).
  Segments momentum_segments(const std::vector<StepGroup>& groups) const;
  void compression_update(const std::vector<StepGroup>& groups, double lr, uint64_t t);
  std::vector<double> scales_;  // the step's scaling coefficients until it is taken
  uint64_t freeze_step_ = 0;
  double max_coeff_ = 10.0;
  double min_coeff_ = 0.01;
  double coeff_beta_ = 0.9;
  double factor_max_ = 4.0;
  double factor_min_ = 0.5;
  double factor_threshold_ = 0.1;
};

}  // namespace loom::optim::onebit
