// From a C++ class to the C tables: kind base classes, factory<T>() and LOOM_PLUGIN.
//
//   class Sgd : public loom::sdk::Optimizer {
//    public:
//     explicit Sgd(loom::sdk::Context& ctx);
//     static loom::sdk::Schema schema();                             // optional
//     static void validate_params(loom::sdk::Context& params);       // optional
//     void step(const loom_optimizer_step_args& args);
//     void export_state(loom::sdk::StateWriter& out);                // optional, with
//     void import_state(std::span<const std::byte> blob);            //   import_state
//   };
//   LOOM_PLUGIN("sgd", "1.0.0", "SGD with momentum", loom::sdk::factory<Sgd>());
//
// Every generated C function is noexcept and reports exceptions as statuses (see guard()).
#ifndef LOOM_SDK_PLUGIN_HPP
#define LOOM_SDK_PLUGIN_HPP

#include <loom/abi.h>
#include <loom/kinds/codec.h>
#include <loom/kinds/comm.h>
#include <loom/kinds/curriculum.h>
#include <loom/kinds/moe.h>
#include <loom/kinds/optimizer.h>
#include <loom/kinds/quantizer.h>
#include <loom/kinds/router.h>
#include <loom/kinds/sampler.h>
#include <loom/sdk/context.hpp>
#include <loom/sdk/moe.hpp>
#include <loom/sdk/parallel.hpp>
#include <loom/sdk/quantizer.hpp>
#include <loom/sdk/router.hpp>
#include <loom/sdk/schema.hpp>
#include <loom/sdk/state.hpp>
#include <loom/sdk/status.hpp>
#include <loom/sdk/tensor.hpp>

#include <charconv>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

namespace loom::sdk {

// What LOOM_PLUGIN takes for each kind: a function that builds the factory on first call
// (inside the entry point, where a broken schema can be reported rather than crash).
using FactoryFn = const loom_factory* (*)();

// ---- kind base classes: derive from exactly one to say which kind a class implements.
// They hold nothing; the methods a kind needs are listed beside each and found at compile
// time, so a missing required method is a compile error and a missing optional one leaves
// its table entry NULL.

// "loom.optimizer/1"
//   required: void step(const loom_optimizer_step_args&)
//   optional: void comm_info(loom_optimizer_comm_info&)
struct Optimizer {
  static constexpr const char* kKind = LOOM_KIND_OPTIMIZER;
};

// "loom.comm/1"
//   required: int32_t rank(), int32_t size(), bool supports_device(DLDevice),
//             void allreduce(const loom_allreduce_args&),
//             void allgather(const loom_allgather_args&),
//             void all_to_all(const loom_all_to_all_args&),
//             void broadcast(const loom_broadcast_args&), void barrier(void* stream),
//             void stats(loom_comm_stats&)
//   optional: NativeHandle native_handle()
//             std::optional<S> split(int32_t color, int32_t key), with a constructor
//             T(Context&, S&&): split runs the collective over this instance and returns
//             what the sub-communicator needs (std::nullopt for a negative color); the SDK
//             then constructs it with this instance's Context, so it must not outlive it
//             (the ABI's rule: children are destroyed before their parent).
struct Comm {
  static constexpr const char* kKind = LOOM_KIND_COMM;
};

// What Comm::native_handle returns: e.g. {"nccl", comm}, owned by the instance.
struct NativeHandle {
  const char* kind = nullptr;
  void* handle = nullptr;
};

// "loom.codec/1"
//   required: void layout(loom_codec_layout&), bool supports_device(DLDevice),
//             void encode(const loom_codec_encode_args&),
//             void decode(const loom_codec_decode_args&)
//   optional: void decode_sum(const loom_codec_decode_args&) (one chunk-length output)
struct Codec {
  static constexpr const char* kKind = LOOM_KIND_CODEC;
};

// "loom.curriculum/1" (since 1.3): a difficulty metric, a schedule, or both.
//   every method optional, but a class needs score or at (or both):
//             void score(const loom_curriculum_score_args&)   [any]: the metric half
//             void count(const loom_curriculum_count_args&)   [any]: a metric's first pass
//             void at(loom_curriculum_at_args&)               [instance]: the schedule half
//             void plan(loom_curriculum_plan_args&)           [any]
//   The table sets `roles` itself, from which of score and at the class has (METRIC,
//   SCHEDULE), and defaults seq_len_mode to LOOM_SEQ_LEN_NONE and stats_count to 0; a plan
//   the class has then fills seq_len_mode and stats_count (what it writes to roles is
//   overwritten). What the class lacks stays NULL in the table. Before count and score the
//   SDK checks what it can (curriculum_samples below: tokens 1-D uint16/int32/int64,
//   offsets int64 with samples + 1 elements, non-decreasing and within tokens when in host
//   memory, stats int64 with stats_count elements, scores fp64 with one per sample, all
//   contiguous and on one device), so the class gets clean arguments; that every token is
//   below vocab_size is the class's to check where it matters. score, count and plan are
//   [any]: the class must allow concurrent calls; at step is >= 1.
struct Curriculum {
  static constexpr const char* kKind = LOOM_KIND_CURRICULUM;
};

// "loom.sampler/1" (since 1.3)
//   required: void plan(loom_sampler_plan_args&), void next(loom_sampler_next_args&)
//   Before plan the SDK checks dataset_size >= 1, global_batch >= 1 and world_size >= 1;
//   before next, step >= 1, world_size >= 1, 0 <= rank < world_size, and that indices is an
//   int64 1-D contiguous tensor in host memory. That indices holds plan's capacity and that
//   world_size matches plan's are the class's to check (it knows its plan).
struct Sampler {
  static constexpr const char* kKind = LOOM_KIND_SAMPLER;
};

// "loom.router/1" (since 1.4)
//   required: void plan(loom_router_plan_args&)                   [any]: kept, buffer sizes
//             void select(const loom_router_select_args&)         [any]
//             void gather(const loom::sdk::RouterMove&)            [any]
//             void scatter(const loom::sdk::RouterMove&)           [any]
//             void advance(loom_router_advance_args&)              [instance]
//   optional: void backward(const loom_router_backward_args&)     [any]: a learned router
//   The table sets `flags` itself: ROUTED when the class's plan keeps fewer than seq_len
//   positions, LEARNED when the class has backward; a kept outside 1 .. seq_len from the
//   class is a plugin bug (INTERNAL). Before plan, select and advance the SDK checks the
//   scalars (batch, seq_len, channels, step, num_layers >= 1; seq_len <= 2^31 - 1;
//   0 <= layer < num_layers). Before select it plans the same arguments and checks every
//   tensor against that plan: indices int32 [batch, kept], x [batch, seq_len, channels]
//   (required for a learned router, and weight [channels] of x's dtype with it), gates
//   [batch, kept] of x's dtype (a learned router), saved and workspace present, as large
//   as planned and 256-byte aligned when their sizes are not 0, one device. backward's
//   arguments name no step or layer, so it cannot plan: kept is indices' second extent
//   (1 .. seq_len), and x, weight, dgates [batch, kept], dx [batch, seq_len, channels] and
//   dweight [channels] must agree with it, of x's dtype, on one device; that saved holds
//   what select wrote is the class's to trust. The values of device index rows are the
//   class's to trust too. gather and scatter receive a RouterMove (loom/sdk/router.hpp),
//   whose host index rows are already checked. The tensor a call writes (gather's kept,
//   scatter's full, backward's dx) must have rows that do not overlap
//   (expect_disjoint_rows); the tensors it only reads may (a zero batch stride broadcasts).
struct Router {
  static constexpr const char* kKind = LOOM_KIND_ROUTER;
};

// "loom.moe/1" (since 1.5): a whole Mixture-of-Experts layer.
//   required: void plan(loom_moe_plan_args&)                                 [any]
//             void forward(const loom_moe_forward_args&, const loom_moe_plan_args&)
//             void backward(const loom_moe_backward_args&, const loom_moe_plan_args&)
//   optional: void dispatch(const loom_moe_dispatch_args&)
//             void combine(const loom_moe_dispatch_args&)
//             void reduce_gradients(const loom_moe_reduce_args&)
//   forward, backward, dispatch, combine and reduce_gradients are [instance] (collective).
//   What the class lacks stays NULL in the table. Before plan the SDK checks the scalars
//   (tokens, model_dim, hidden_dim, num_layers >= 1; num_experts >= 0; 0 <= layer <
//   num_layers) and zeroes the outputs; after it, that the outputs make sense (experts =
//   local_experts * ep_size, num_experts honoured, 0 <= ep_rank < ep_size, 1 <= top_k <=
//   experts, a known activation, known flags, capacity 0 exactly when DROPLESS): a plan that
//   breaks them is the plugin's bug (INTERNAL). The table sets LOOM_MOE_EXPERT_PARALLEL itself
//   from ep_size. Before forward and backward it checks the same scalars (tokens >= 0 there,
//   step >= 1 in training, first_token >= 0), plans the call's scalars (tokens = the call's,
//   at least 1; dtype = x's) and hands that plan to the class, after checking against it:
//   x, y, dy, dx [tokens, M]; every weight and gradient (loom/sdk/moe.hpp moe_weights: gate_w
//   [E, M], w1 [E_l, H, M], b1 [E_l, H], w2 [E_l, M, H], b2 [E_l, M], the residual MLP's
//   exactly when RESIDUAL); expert_bias float32 [E] exactly when EXPERT_BIAS; the optional
//   routing outputs int32 / float32 [tokens, k]; stats (struct size, load_count = E), whose
//   outputs it zeroes; saved and workspace present, 256-byte aligned and at least that plan's
//   sizes; every tensor of x's dtype, contiguous and on x's device. The plan's buffer sizes
//   are for the call's tokens: under expert parallelism the rows other ranks send are the
//   class's to fit in the saved_bytes it is given. Before dispatch and combine: x [tokens, M],
//   rows [R, M] of x's dtype, the routing (host expert indices -1 .. E-1), top_k and
//   counts_count equal to the plan's top_k and local_experts; that rows holds every row the
//   routing sends is the class's to check. Before reduce_gradients: every tensor float32,
//   contiguous, on one device.
struct Moe {
  static constexpr const char* kKind = LOOM_KIND_MOE;
};

// "loom.quantizer/1" (since 1.5): weight and activation quantization.
//   required: void layout(loom_quantizer_layout_args&)                       [any]
//             void quantize(const loom_quantizer_quantize_args&,
//                           const loom_quantizer_layout_args& layout)        [any]
//             void dequantize(const loom_quantizer_quantize_args&,
//                             const loom_quantizer_layout_args& layout)      [any]
//   optional: void matmul(const loom_quantizer_matmul_args&,
//                         const loom_quantizer_layout_args& layout)          [any]
//   Before layout the SDK checks role, ndim 2, the shape, a float dtype, matmul_rows >= 0
//   and the caller's format struct; it zeroes every output, points the format's ndim and
//   shape at the caller's and sets LOOM_QUANTIZER_HAS_MATMUL when the class has matmul and
//   the role is WEIGHT (a layout clears it for a format its matmul does not take). After it,
//   the table clears HAS_MATMUL (and INT8_ACTIVATIONS, matmul_workspace_bytes) when there is
//   no matmul for the format, checks the format (check_quant_format) and fills packed_bytes,
//   scale_count and zero_point_count from it; a class that set one of them differently, or a
//   broken format, is the plugin's bug (INTERNAL). Before quantize and dequantize (and
//   matmul, for W [N, K] from the format's shape and x [M, K]) it lays out the call's shape
//   and role itself and hands that layout to the class, after checking against it: the
//   given format field by field (expect_same_format), x 2-D float contiguous, packed,
//   scales and zero points (quant_tensors), the workspace; for matmul also that the layout
//   has HAS_MATMUL (else UNIMPLEMENTED), K agreeing, bias [N] and y [M, N] of x's dtype;
//   every tensor on x's device. The values (NaN, codes 3 of ternary data) are the class's.
struct Quantizer {
  static constexpr const char* kKind = LOOM_KIND_QUANTIZER;
};

// The checked batch of samples a curriculum's count and score receive (the SDK builds it
// from loom_curriculum_samples before calling the class; a class may call it too).
struct CurriculumSamples {
  const DLTensor* tokens = nullptr;   // 1-D, uint16, int32 or int64, contiguous
  const DLTensor* offsets = nullptr;  // 1-D int64, count + 1 elements, same device
  int64_t count = 0;                  // samples: numel(offsets) - 1
  DLDevice device{kDLCPU, 0};         // of tokens and offsets

  // Sample i is tokens [begin(i), end(i)); host memory only (the offsets are read here).
  int64_t begin(int64_t i) const { return data_as<const int64_t>(*offsets)[i]; }
  int64_t end(int64_t i) const { return data_as<const int64_t>(*offsets)[i + 1]; }
};

// Checks a loom_curriculum_samples (`what` names it in messages) and returns its view.
// Throws Error(INVALID_ARGUMENT) naming the tensor and what is wrong.
inline CurriculumSamples curriculum_samples(const loom_curriculum_samples& s,
                                            const std::string& what = "samples") {
  if (s.struct_size < LOOM_CURRICULUM_SAMPLES_SIZE) {
    fail_argument(what + " has struct_size " + std::to_string(s.struct_size) + ", expected " +
                  std::to_string(LOOM_CURRICULUM_SAMPLES_SIZE));
  }
  const DLTensor& tokens = expect_tensor(s.tokens, what + ".tokens");
  const DLTensor& offsets = expect_tensor(s.offsets, what + ".offsets");
  if (tokens.ndim != 1) fail_argument(what + ".tokens is not 1-D: shape " + shape_string(tokens));
  if (!(is_dtype(tokens, kDLUInt, 16) || is_dtype(tokens, kDLInt, 32) ||
        is_dtype(tokens, kDLInt, 64))) {
    fail_argument(what + ".tokens has dtype " + dtype_string(tokens.dtype) +
                  ", expected uint16, int32 or int64");
  }
  expect_contiguous(tokens, what + ".tokens");
  if (offsets.ndim != 1 || offsets.shape[0] < 1) {
    fail_argument(what + ".offsets has shape " + shape_string(offsets) +
                  ", expected 1-D with samples + 1 (>= 1) elements");
  }
  expect_dtype(offsets, DLDataType{kDLInt, 64, 1}, what + ".offsets");
  expect_contiguous(offsets, what + ".offsets");
  expect_same_device(offsets, what + ".offsets", tokens, what + ".tokens");
  CurriculumSamples out;
  out.tokens = &tokens;
  out.offsets = &offsets;
  out.count = offsets.shape[0] - 1;
  out.device = tokens.device;
  if (is_cpu(offsets)) {
    const int64_t n = tokens.shape[0];
    const auto* o = data_as<const int64_t>(offsets);
    for (int64_t i = 0; i <= out.count; ++i) {
      if (o[i] < 0 || o[i] > n || (i > 0 && o[i] < o[i - 1])) {
        fail_argument(what + ".offsets[" + std::to_string(i) + "] = " + std::to_string(o[i]) +
                      (o[i] < 0 || o[i] > n ? " is outside the " + std::to_string(n) + " tokens"
                                            : " is below offsets[" + std::to_string(i - 1) +
                                                  "] = " + std::to_string(o[i - 1])));
      }
    }
  }
  return out;
}

namespace detail {

// An instance as the host sees it: the Context first, so it outlives the object that may
// hold a reference to it.
//
// `exported` keeps the framed blob of the last export_state until any other call on the
// instance: hosts ask for the size first and then for the bytes, and the second export is
// served from it instead of serialising the whole state again. The state can only change
// inside a call on the instance (calls are one at a time per instance), and every call but
// export_state goes through object<T>(), which drops the blob.
//
// `pool` registers the host's thread pool (1.2 hosts) for parallel_for() in this library
// before the object is built and drops it after the object is gone, so kernels the object
// runs in its constructor or destructor use it too.
template <class T>
struct Holder {
  explicit Holder(const loom_host_services* host) : pool(host), ctx(host), object(ctx) {}
  // A sub-instance (a comm's split): T(Context&, args...), sharing its parent's services.
  template <class... A>
  Holder(const loom_host_services* host, std::in_place_t /*tag*/, A&&... a)
      : pool(host), ctx(host), object(ctx, std::forward<A>(a)...) {}

  void forget_export() noexcept {
    if (has_exported) {
      std::vector<std::byte>().swap(exported);
      has_exported = false;
    }
  }

  PoolRegistration pool;
  Context ctx;
  T object;
  std::vector<std::byte> exported;
  bool has_exported = false;
};

template <class T>
Holder<T>& holder(void* instance) {
  if (instance == nullptr) throw Error(LOOM_ERR_INVALID_ARGUMENT, "instance is NULL");
  return *static_cast<Holder<T>*>(instance);
}

// The plugin object for a call on the instance; any call but export_state ends the
// export cache's validity.
template <class T>
T& object(void* instance) {
  Holder<T>& h = holder<T>(instance);
  h.forget_export();
  return h.object;
}

// Copies an args struct from the caller into a zeroed full-size one, so plugin code can
// read every field it knows: fields an older caller did not send read as zero. The
// caller's struct_size is kept, so a plugin can still tell.
template <class Args>
Args normalized(const Args* in, const char* what) {
  if (in == nullptr) throw Error(LOOM_ERR_INVALID_ARGUMENT, std::string(what) + " is NULL");
  if (in->struct_size < sizeof(uint32_t)) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT, std::string(what) + " has no struct_size");
  }
  Args out;
  std::memset(static_cast<void*>(&out), 0,
              sizeof(Args));  // Args may have default member initializers
  std::memcpy(&out, in, in->struct_size < sizeof(Args) ? in->struct_size : sizeof(Args));
  return out;
}

// For in/out structs whose struct_size the caller sets: the plugin fills a full-size copy,
// and only the prefix the caller knows is written back.
template <class Out, class Fn>
void fill(Out* out, const char* what, Fn&& fn) {
  Out full = normalized(out, what);
  const uint32_t caller_size = out->struct_size;
  std::forward<Fn>(fn)(full);
  full.struct_size = caller_size;
  std::memcpy(out, &full, caller_size < sizeof(Out) ? caller_size : sizeof(Out));
}

template <class T, class Base>
constexpr bool kIs = std::is_base_of_v<Base, T>;

// ---- the optimizer table

template <class T>
struct OptimizerTable {
  static loom_status* step(void* instance, const loom_optimizer_step_args* args) noexcept {
    return guard([&] { object<T>(instance).step(normalized(args, "step args")); });
  }
  static loom_status* comm_info(void* instance, loom_optimizer_comm_info* out) noexcept {
    return guard([&] {
      fill(out, "comm_info out",
           [&](loom_optimizer_comm_info& full) { object<T>(instance).comm_info(full); });
    });
  }

  static const loom_optimizer_v1* get() {
    static_assert(
        requires(T & t, const loom_optimizer_step_args& a) { t.step(a); },
        "an Optimizer needs void step(const loom_optimizer_step_args&)");
    static const loom_optimizer_v1 table = [] {
      loom_optimizer_v1 v{};
      v.struct_size = LOOM_OPTIMIZER_V1_SIZE;
      v.step = &step;
      if constexpr (requires(T & t, loom_optimizer_comm_info & o) { t.comm_info(o); }) {
        v.comm_info = &comm_info;
      }
      return v;
    }();
    return &table;
  }
};

// ---- the comm table

// What T::split returns (std::optional<S>), and whether T can make a sub-instance from S.
template <class T>
using SplitPlanOf = typename decltype(std::declval<T&>().split(0, 0))::value_type;
template <class T>
concept CommSplits = requires(T& t, int32_t v) {
  { t.split(v, v).has_value() } -> std::convertible_to<bool>;
  requires std::is_constructible_v<T, Context&, SplitPlanOf<T> &&>;
};

// An args struct from a caller must reach `end` (its last field this SDK reads or writes).
template <class Args>
const Args& expect_args(const Args* args, uint32_t end, const char* what) {
  if (args == nullptr) throw Error(LOOM_ERR_INVALID_ARGUMENT, std::string(what) + " is NULL");
  if (args->struct_size < end) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT, std::string(what) + " has struct_size " +
                                               std::to_string(args->struct_size) +
                                               ", smaller than the " + std::to_string(end) +
                                               " bytes of the fields this plugin reads");
  }
  return *args;
}

template <class T>
struct CommTable {
  static int32_t rank(void* instance) noexcept {
    return guard_value<int32_t>(-1, [&] { return object<T>(instance).rank(); });
  }
  static int32_t size(void* instance) noexcept {
    return guard_value<int32_t>(0, [&] { return object<T>(instance).size(); });
  }
  static int32_t supports_device(void* instance, DLDevice device) noexcept {
    return guard_value<int32_t>(
        0, [&] { return object<T>(instance).supports_device(device) ? 1 : 0; });
  }
  static loom_status* allreduce(void* instance, const loom_allreduce_args* args) noexcept {
    return guard([&] { object<T>(instance).allreduce(normalized(args, "allreduce args")); });
  }
  static loom_status* allgather(void* instance, const loom_allgather_args* args) noexcept {
    return guard([&] { object<T>(instance).allgather(normalized(args, "allgather args")); });
  }
  static loom_status* all_to_all(void* instance, const loom_all_to_all_args* args) noexcept {
    return guard([&] { object<T>(instance).all_to_all(normalized(args, "all_to_all args")); });
  }
  static loom_status* broadcast(void* instance, const loom_broadcast_args* args) noexcept {
    return guard([&] { object<T>(instance).broadcast(normalized(args, "broadcast args")); });
  }
  static loom_status* barrier(void* instance, void* stream) noexcept {
    return guard([&] { object<T>(instance).barrier(stream); });
  }
  static loom_status* stats(void* instance, loom_comm_stats* out) noexcept {
    return guard([&] {
      fill(out, "stats out", [&](loom_comm_stats& full) { object<T>(instance).stats(full); });
    });
  }
  static loom_status* native_handle(void* instance, const char** kind, void** handle) noexcept {
    return guard([&] {
      if (kind == nullptr || handle == nullptr) {
        throw Error(LOOM_ERR_INVALID_ARGUMENT, "native_handle outputs are NULL");
      }
      NativeHandle h = object<T>(instance).native_handle();
      *kind = h.kind;
      *handle = h.handle;
    });
  }
  // ---- since 1.2
  static loom_status* split(void* instance, loom_comm_split_args* args) noexcept {
    return guard([&] {
      expect_args(args, LOOM_STRUCT_SIZE(loom_comm_split_args, result), "split args");
      args->result = nullptr;
      Holder<T>& h = holder<T>(instance);
      h.forget_export();
      auto plan = h.object.split(args->color, args->key);
      if (!plan.has_value()) return;
      // bad_alloc is caught by guard() and reported as RESOURCE_EXHAUSTED.
      args->result = new Holder<T>(h.ctx.raw(), std::in_place,  // NOLINT
                                   std::move(*plan));
    });
  }
  static void destroy_split(void* instance) noexcept {
    try {
      delete static_cast<Holder<T>*>(instance);
    } catch (...) {
    }
  }
  static loom_status* barrier2(void* instance, const loom_comm_barrier_args* args) noexcept {
    return guard([&] {
      const loom_comm_barrier_args& a =
          expect_args(args, LOOM_STRUCT_SIZE(loom_comm_barrier_args, stream), "barrier args");
      object<T>(instance).barrier(a.stream);
    });
  }
  static loom_status* supports_device2(void* instance, loom_comm_device_args* args) noexcept {
    return guard([&] {
      expect_args(args, LOOM_STRUCT_SIZE(loom_comm_device_args, supported), "device args");
      args->supported = object<T>(instance).supports_device(args->device) ? 1 : 0;
    });
  }
  static loom_status* native_handle2(void* instance, loom_comm_native_handle_args* args) noexcept {
    return guard([&] {
      expect_args(args, LOOM_STRUCT_SIZE(loom_comm_native_handle_args, handle),
                  "native_handle args");
      NativeHandle h = object<T>(instance).native_handle();
      args->kind = h.kind;
      args->handle = h.handle;
    });
  }

  static const loom_comm_v1* get() {
    static_assert(
        requires(T & t) {
          { t.rank() } -> std::convertible_to<int32_t>;
          { t.size() } -> std::convertible_to<int32_t>;
        },
        "a Comm needs int32_t rank() and int32_t size()");
    static_assert(
        requires(T & t, DLDevice d) {
          { t.supports_device(d) } -> std::convertible_to<bool>;
        },
        "a Comm needs bool supports_device(DLDevice)");
    static_assert(
        requires(T & t, const loom_allreduce_args& a, const loom_allgather_args& g,
                 const loom_all_to_all_args& x, const loom_broadcast_args& b) {
          t.allreduce(a);
          t.allgather(g);
          t.all_to_all(x);
          t.broadcast(b);
        },
        "a Comm needs allreduce, allgather, all_to_all and broadcast taking their args");
    static_assert(
        requires(T & t, void* s, loom_comm_stats& st) {
          t.barrier(s);
          t.stats(st);
        },
        "a Comm needs void barrier(void* stream) and void stats(loom_comm_stats&)");
    static const loom_comm_v1 table = [] {
      loom_comm_v1 v{};
      v.struct_size = LOOM_COMM_V1_SIZE;
      v.rank = &rank;
      v.size = &size;
      v.supports_device = &supports_device;
      v.allreduce = &allreduce;
      v.allgather = &allgather;
      v.all_to_all = &all_to_all;
      v.broadcast = &broadcast;
      v.barrier = &barrier;
      v.stats = &stats;
      v.barrier2 = &barrier2;  // beside barrier and supports_device, for 1.0 and 1.1 hosts
      v.supports_device2 = &supports_device2;
      if constexpr (requires(T & t) {
                      { t.native_handle() } -> std::convertible_to<NativeHandle>;
                    }) {
        v.native_handle = &native_handle;
        v.native_handle2 = &native_handle2;
      }
      if constexpr (CommSplits<T>) {
        v.split = &split;
        v.destroy_split = &destroy_split;
      }
      return v;
    }();
    return &table;
  }
};

// ---- the codec table

template <class T>
struct CodecTable {
  static loom_status* layout(void* instance, loom_codec_layout* layout) noexcept {
    return guard([&] {
      fill(layout, "codec layout",
           [&](loom_codec_layout& full) { object<T>(instance).layout(full); });
    });
  }
  static int32_t supports_device(void* instance, DLDevice device) noexcept {
    return guard_value<int32_t>(
        0, [&] { return object<T>(instance).supports_device(device) ? 1 : 0; });
  }
  static loom_status* encode(void* instance, const loom_codec_encode_args* args) noexcept {
    return guard([&] { object<T>(instance).encode(normalized(args, "encode args")); });
  }
  static loom_status* decode(void* instance, const loom_codec_decode_args* args) noexcept {
    return guard([&] { object<T>(instance).decode(normalized(args, "decode args")); });
  }
  static loom_status* decode_sum(void* instance, const loom_codec_decode_args* args) noexcept {
    return guard([&] { object<T>(instance).decode_sum(normalized(args, "decode args")); });
  }

  static const loom_codec_v1* get() {
    static_assert(
        requires(T & t, loom_codec_layout & l, DLDevice d, const loom_codec_encode_args& e,
                 const loom_codec_decode_args& x) {
          t.layout(l);
          { t.supports_device(d) } -> std::convertible_to<bool>;
          t.encode(e);
          t.decode(x);
        },
        "a Codec needs layout, supports_device, encode and decode");
    static const loom_codec_v1 table = [] {
      loom_codec_v1 v{};
      v.struct_size = LOOM_CODEC_V1_SIZE;
      v.layout = &layout;
      v.supports_device = &supports_device;
      v.encode = &encode;
      v.decode = &decode;
      // Optional: a codec without decode_sum leaves it NULL (callers fall back to decode).
      if constexpr (requires(T & t, const loom_codec_decode_args& x) { t.decode_sum(x); }) {
        v.decode_sum = &decode_sum;
      }
      return v;
    }();
    return &table;
  }
};

// ---- the curriculum table (since 1.3)

template <class T>
constexpr bool kCurriculumScores = requires(T& t, const loom_curriculum_score_args& a) {
  t.score(a);
};
template <class T>
constexpr bool kCurriculumCounts = requires(T& t, const loom_curriculum_count_args& a) {
  t.count(a);
};
template <class T>
constexpr bool kCurriculumSchedules = requires(T& t, loom_curriculum_at_args& a) {
  t.at(a);
};
template <class T>
constexpr bool kCurriculumPlans = requires(T& t, loom_curriculum_plan_args& a) {
  t.plan(a);
};

// The plugin object for an [any] call: it does not touch the export cache (concurrent calls
// may run on one instance, and these calls do not change the state).
template <class T>
T& shared_object(void* instance) {
  return holder<T>(instance).object;
}

template <class T>
struct CurriculumTable {
  // The roles from the class's methods, then the class's plan for the rest.
  static void plan_into(T& obj, loom_curriculum_plan_args& full) {
    full.seq_len_mode = LOOM_SEQ_LEN_NONE;
    full.stats_count = 0;
    if constexpr (kCurriculumPlans<T>) obj.plan(full);
    full.roles = (kCurriculumScores<T> ? LOOM_CURRICULUM_METRIC : 0u) |
                 (kCurriculumSchedules<T> ? LOOM_CURRICULUM_SCHEDULE : 0u);
    if (full.seq_len_mode > LOOM_SEQ_LEN_RESHAPE) {
      throw Error(LOOM_ERR_INTERNAL, "the plugin's plan set seq_len_mode " +
                                         std::to_string(full.seq_len_mode) +
                                         ", which is not a LOOM_SEQ_LEN_* value");
    }
    if (!kCurriculumScores<T> && full.stats_count != 0) {
      throw Error(LOOM_ERR_INTERNAL, "the plugin's plan set stats_count " +
                                         std::to_string(full.stats_count) +
                                         " but it has no score (a schedule has no stats)");
    }
  }
  static uint64_t stats_count(T& obj, uint32_t vocab_size) {
    loom_curriculum_plan_args p{};
    p.struct_size = LOOM_CURRICULUM_PLAN_ARGS_SIZE;
    p.vocab_size = vocab_size;
    plan_into(obj, p);
    return p.stats_count;
  }
  static void check_stats(const DLTensor* stats, uint64_t want, const CurriculumSamples& s,
                          const char* what) {
    const DLTensor& t = expect_tensor(stats, what);
    expect_dtype(t, DLDataType{kDLInt, 64, 1}, what);
    expect_contiguous(t, what);
    if (static_cast<uint64_t>(numel(t)) != want) {
      fail_argument(std::string(what) + " has " + std::to_string(numel(t)) +
                    " elements, expected the plan's stats_count " + std::to_string(want));
    }
    expect_device(t, s.device, what);
  }

  // What the ABI promises of at's answer (loom/kinds/curriculum.h): a finite difficulty, and
  // seq_len >= 1 for a sequence-length schedule (seq_len_mode TRUNCATE or RESHAPE) or 0 for
  // one whose difficulty is not a length. A class that breaks it is a plugin bug.
  static void check_at(T& obj, const loom_curriculum_at_args& a) {
    const std::string step = " at step " + std::to_string(a.step);
    if (!std::isfinite(a.difficulty)) {
      throw Error(LOOM_ERR_INTERNAL, "the plugin's at gave difficulty " +
                                         std::string(std::isnan(a.difficulty) ? "NaN" : "inf") +
                                         step + "; a schedule's difficulty must be finite");
    }
    loom_curriculum_plan_args p{};
    p.struct_size = LOOM_CURRICULUM_PLAN_ARGS_SIZE;
    plan_into(obj, p);
    if (p.seq_len_mode == LOOM_SEQ_LEN_NONE) {
      if (a.seq_len != 0) {
        throw Error(LOOM_ERR_INTERNAL, "the plugin's at gave seq_len " + std::to_string(a.seq_len) +
                                           step +
                                           " but its seq_len_mode is NONE (the seq_len must be 0)");
      }
    } else if (a.seq_len < 1) {
      throw Error(LOOM_ERR_INTERNAL,
                  "the plugin's at gave seq_len " + std::to_string(a.seq_len) + step +
                      " but it is a sequence-length schedule (seq_len_mode " +
                      (p.seq_len_mode == LOOM_SEQ_LEN_TRUNCATE ? "TRUNCATE" : "RESHAPE") +
                      "), whose seq_len must be >= 1");
    }
  }

  static loom_status* plan(void* instance, loom_curriculum_plan_args* args) noexcept {
    return guard([&] {
      expect_args(args, LOOM_CURRICULUM_PLAN_ARGS_SIZE, "plan args");
      fill(args, "plan args",
           [&](loom_curriculum_plan_args& full) { plan_into(shared_object<T>(instance), full); });
    });
  }
  static loom_status* count(void* instance, const loom_curriculum_count_args* args) noexcept {
    return guard([&] {
      const loom_curriculum_count_args& a =
          expect_args(args, LOOM_CURRICULUM_COUNT_ARGS_SIZE, "count args");
      T& obj = shared_object<T>(instance);
      const CurriculumSamples s = curriculum_samples(a.samples);
      const uint64_t want = stats_count(obj, a.vocab_size);
      if (want == 0 && a.stats == nullptr) {
        // Nothing to count into: a metric whose plan asks for no stats.
      } else {
        check_stats(a.stats, want, s, "stats");
      }
      obj.count(a);
    });
  }
  static loom_status* score(void* instance, const loom_curriculum_score_args* args) noexcept {
    return guard([&] {
      const loom_curriculum_score_args& a =
          expect_args(args, LOOM_CURRICULUM_SCORE_ARGS_SIZE, "score args");
      T& obj = shared_object<T>(instance);
      const CurriculumSamples s = curriculum_samples(a.samples);
      const uint64_t want = stats_count(obj, a.vocab_size);
      if (want == 0) {
        if (a.stats != nullptr) fail_argument("stats is set but the metric's stats_count is 0");
      } else {
        check_stats(a.stats, want, s, "stats");
      }
      const DLTensor& scores = expect_tensor(a.scores, "scores");
      expect_dtype(scores, DLDataType{kDLFloat, 64, 1}, "scores");
      expect_contiguous(scores, "scores");
      expect_numel(scores, s.count, "scores");
      expect_device(scores, s.device, "scores");
      obj.score(a);
    });
  }
  static loom_status* at(void* instance, loom_curriculum_at_args* args) noexcept {
    return guard([&] {
      expect_args(args, LOOM_CURRICULUM_AT_ARGS_SIZE, "at args");
      if (args->step < 1) {
        fail_argument("at: step is " + std::to_string(args->step) + "; steps start at 1");
      }
      fill(args, "at args", [&](loom_curriculum_at_args& full) {
        T& obj = object<T>(instance);
        full.difficulty = 0;
        full.seq_len = 0;
        obj.at(full);
        check_at(obj, full);
      });
    });
  }

  static const loom_curriculum_v1* get() {
    static_assert(kCurriculumScores<T> || kCurriculumSchedules<T>,
                  "a Curriculum needs void score(const loom_curriculum_score_args&) (a metric), "
                  "void at(loom_curriculum_at_args&) (a schedule), or both");
    static_assert(!kCurriculumCounts<T> || kCurriculumScores<T>,
                  "a Curriculum with count needs score: count is a metric's first pass");
    static const loom_curriculum_v1 table = [] {
      loom_curriculum_v1 v{};
      v.struct_size = LOOM_CURRICULUM_V1_SIZE;
      v.plan = &plan;
      if constexpr (kCurriculumCounts<T>) v.count = &count;
      if constexpr (kCurriculumScores<T>) v.score = &score;
      if constexpr (kCurriculumSchedules<T>) v.at = &at;
      return v;
    }();
    return &table;
  }
};

// ---- the sampler table (since 1.3)

template <class T>
struct SamplerTable {
  static loom_status* plan(void* instance, loom_sampler_plan_args* args) noexcept {
    return guard([&] {
      const loom_sampler_plan_args& a =
          expect_args(args, LOOM_SAMPLER_PLAN_ARGS_SIZE, "sampler plan args");
      if (a.dataset_size < 1) fail_argument("sampler plan: dataset_size is 0");
      if (a.global_batch < 1) {
        fail_argument("sampler plan: global_batch is " + std::to_string(a.global_batch) +
                      "; must be >= 1");
      }
      if (a.world_size < 1) {
        fail_argument("sampler plan: world_size is " + std::to_string(a.world_size) +
                      "; must be >= 1");
      }
      fill(args, "sampler plan args", [&](loom_sampler_plan_args& full) {
        full.capacity = 0;
        object<T>(instance).plan(full);
      });
    });
  }
  static loom_status* next(void* instance, loom_sampler_next_args* args) noexcept {
    return guard([&] {
      const loom_sampler_next_args& a =
          expect_args(args, LOOM_SAMPLER_NEXT_ARGS_SIZE, "sampler next args");
      if (a.step < 1) {
        fail_argument("sampler next: step is " + std::to_string(a.step) + "; steps start at 1");
      }
      if (a.world_size < 1) {
        fail_argument("sampler next: world_size is " + std::to_string(a.world_size) +
                      "; must be >= 1");
      }
      if (a.rank < 0 || a.rank >= a.world_size) {
        fail_argument("sampler next: rank " + std::to_string(a.rank) + " is outside 0 .. " +
                      std::to_string(a.world_size - 1));
      }
      const DLTensor& idx = expect_tensor(a.indices, "indices");
      if (idx.ndim != 1) fail_argument("indices is not 1-D: shape " + shape_string(idx));
      expect_dtype(idx, DLDataType{kDLInt, 64, 1}, "indices");
      expect_contiguous(idx, "indices");
      expect_cpu(idx, "indices");
      fill(args, "sampler next args", [&](loom_sampler_next_args& full) {
        full.count = 0;
        full.difficulty = 0;
        full.epoch = 0;
        full.consumed = 0;
        object<T>(instance).next(full);
      });
    });
  }

  static const loom_sampler_v1* get() {
    static_assert(
        requires(T & t, loom_sampler_plan_args & p, loom_sampler_next_args & n) {
          t.plan(p);
          t.next(n);
        },
        "a Sampler needs void plan(loom_sampler_plan_args&) and void "
        "next(loom_sampler_next_args&)");
    static const loom_sampler_v1 table = [] {
      loom_sampler_v1 v{};
      v.struct_size = LOOM_SAMPLER_V1_SIZE;
      v.plan = &plan;
      v.next = &next;
      return v;
    }();
    return &table;
  }
};

// ---- the router table (since 1.4)

template <class T>
constexpr bool kRouterLearns = requires(T& t, const loom_router_backward_args& a) {
  t.backward(a);
};

template <class T>
struct RouterTable {
  static void at_least_one(int64_t v, const char* name, const std::string& call) {
    if (v < 1) fail_argument(call + ": " + name + " is " + std::to_string(v) + "; must be >= 1");
  }

  static void check_scalars(int64_t batch, int64_t seq_len, int64_t channels, int64_t step,
                            int32_t layer, int32_t num_layers, const char* call) {
    const std::string c(call);
    at_least_one(batch, "batch", c);
    at_least_one(seq_len, "seq_len", c);
    at_least_one(channels, "channels", c);
    at_least_one(step, "step", c);
    at_least_one(num_layers, "num_layers", c);
    if (seq_len > INT32_MAX) {
      fail_argument(c + ": seq_len " + std::to_string(seq_len) +
                    " is above 2^31 - 1, the most int32 indices address");
    }
    if (layer < 0 || layer >= num_layers) {
      fail_argument(c + ": layer " + std::to_string(layer) + " is outside 0 .. " +
                    std::to_string(num_layers - 1) + " (num_layers " + std::to_string(num_layers) +
                    ")");
    }
  }

  // The class's plan, then the flags the table owns and the check of kept.
  static void plan_into(T& obj, loom_router_plan_args& full) {
    full.flags = 0;
    full.kept = 0;
    full.saved_bytes = 0;
    full.workspace_bytes = 0;
    obj.plan(full);
    if (full.kept < 1 || full.kept > full.seq_len) {
      throw Error(LOOM_ERR_INTERNAL, "the plugin's plan kept " + std::to_string(full.kept) +
                                         " of " + std::to_string(full.seq_len) +
                                         " positions; kept must be 1 .. seq_len");
    }
    full.flags = (full.kept < full.seq_len ? LOOM_ROUTER_ROUTED : 0u) |
                 (kRouterLearns<T> ? LOOM_ROUTER_LEARNED : 0u);
  }

  static loom_router_plan_args plan_for(T& obj, int64_t batch, int64_t seq_len, int64_t channels,
                                        int64_t step, int32_t layer, int32_t num_layers,
                                        uint32_t training, DLDataType dtype) {
    loom_router_plan_args p{};
    p.struct_size = LOOM_ROUTER_PLAN_ARGS_SIZE;
    p.batch = batch;
    p.seq_len = seq_len;
    p.channels = channels;
    p.step = step;
    p.layer = layer;
    p.num_layers = num_layers;
    p.training = training;
    p.dtype = dtype;
    plan_into(obj, p);
    return p;
  }

  static void check_buffer(const void* ptr, uint64_t given, uint64_t want, const char* what) {
    if (want == 0) return;
    if (ptr == nullptr || given < want) {
      fail_argument(std::string(what) + " is " +
                    (ptr == nullptr ? std::string("NULL") : std::to_string(given) + " bytes") +
                    " but the plan asks for " + std::to_string(want) + " bytes");
    }
    if (reinterpret_cast<uintptr_t>(ptr) % 256 != 0) {
      fail_argument(std::string(what) + " is not 256-byte aligned");
    }
  }

  // x [batch, seq_len, channels] and weight [channels] of one dtype on `device`.
  static void check_x_weight(const DLTensor* x, const DLTensor* weight, int64_t batch,
                             int64_t seq_len, int64_t channels, DLDevice device) {
    const TokenTensor xv = token_tensor(x, "x");
    if (xv.batch != batch || xv.positions != seq_len || xv.channels != channels) {
      fail_argument("x has shape " + shape_string(*x) + ", expected [" + std::to_string(batch) +
                    ", " + std::to_string(seq_len) + ", " + std::to_string(channels) + "]");
    }
    expect_device(*x, device, "x");
    if (weight != nullptr) {
      const DLTensor& w = expect_tensor(weight, "weight");
      expect_dtype(w, x->dtype, "weight");
      expect_contiguous(w, "weight");
      if (w.ndim != 1 || w.shape[0] != channels) {
        fail_argument("weight has shape " + shape_string(w) + ", expected [" +
                      std::to_string(channels) + "]");
      }
      expect_device(w, device, "weight");
    }
  }

  static void check_per_kept(const DLTensor* t, DLDataType dtype, int64_t batch, int64_t kept,
                             DLDevice device, const char* what) {
    const DLTensor& d = expect_tensor(t, what);
    expect_dtype(d, dtype, what);
    expect_contiguous(d, what);
    if (d.ndim != 2 || d.shape[0] != batch || d.shape[1] != kept) {
      fail_argument(std::string(what) + " has shape " + shape_string(d) + ", expected [" +
                    std::to_string(batch) + ", " + std::to_string(kept) + "] (batch, kept)");
    }
    expect_device(d, device, what);
  }

  static loom_status* plan(void* instance, loom_router_plan_args* args) noexcept {
    return guard([&] {
      const loom_router_plan_args& a =
          expect_args(args, LOOM_ROUTER_PLAN_ARGS_SIZE, "router plan args");
      check_scalars(a.batch, a.seq_len, a.channels, a.step, a.layer, a.num_layers, "router plan");
      fill(args, "router plan args",
           [&](loom_router_plan_args& full) { plan_into(shared_object<T>(instance), full); });
    });
  }

  static loom_status* select(void* instance, const loom_router_select_args* args) noexcept {
    return guard([&] {
      const loom_router_select_args& a =
          expect_args(args, LOOM_ROUTER_SELECT_ARGS_SIZE, "router select args");
      check_scalars(a.batch, a.seq_len, a.channels, a.step, a.layer, a.num_layers, "router select");
      T& obj = shared_object<T>(instance);
      const DLTensor& idx = expect_tensor(a.indices, "indices");
      if constexpr (kRouterLearns<T>) {
        // Before the plan, which a learned router makes for x's dtype.
        if (a.x == nullptr) fail_argument("x is NULL; a learned router scores the layer's input");
        if (a.weight == nullptr) fail_argument("weight is NULL; a learned router needs its weight");
      }
      const DLDataType dtype = a.x != nullptr ? a.x->dtype : DLDataType{kDLFloat, 32, 1};
      const loom_router_plan_args p = plan_for(obj, a.batch, a.seq_len, a.channels, a.step, a.layer,
                                               a.num_layers, a.training, dtype);
      router_indices(&idx, a.batch, p.kept, "indices");
      if constexpr (kRouterLearns<T>) {
        check_x_weight(a.x, a.weight, a.batch, a.seq_len, a.channels, idx.device);
        check_per_kept(a.gates, a.x->dtype, a.batch, p.kept, idx.device, "gates");
      } else if (a.x != nullptr) {
        check_x_weight(a.x, a.weight, a.batch, a.seq_len, a.channels, idx.device);
      }
      check_buffer(a.saved, a.saved_bytes, p.saved_bytes, "saved");
      check_buffer(a.workspace, a.workspace_bytes, p.workspace_bytes, "workspace");
      obj.select(a);
    });
  }

  static loom_status* gather(void* instance, const loom_router_move_args* args) noexcept {
    return guard([&] {
      const loom_router_move_args& a =
          expect_args(args, LOOM_ROUTER_MOVE_ARGS_SIZE, "router gather args");
      const RouterMove m = router_move(a, RouterMoveKind::kGather);
      shared_object<T>(instance).gather(m);
    });
  }

  static loom_status* scatter(void* instance, const loom_router_move_args* args) noexcept {
    return guard([&] {
      const loom_router_move_args& a =
          expect_args(args, LOOM_ROUTER_MOVE_ARGS_SIZE, "router scatter args");
      const RouterMove m = router_move(a, RouterMoveKind::kScatter);
      shared_object<T>(instance).scatter(m);
    });
  }

  static loom_status* advance(void* instance, loom_router_advance_args* args) noexcept {
    return guard([&] {
      const loom_router_advance_args& a =
          expect_args(args, LOOM_ROUTER_ADVANCE_ARGS_SIZE, "router advance args");
      check_scalars(a.batch, a.seq_len, 1, a.step, 0, a.num_layers, "router advance");
      fill(args, "router advance args", [&](loom_router_advance_args& full) {
        full.layer_tokens = 0;
        full.consumed_layer_tokens = 0;
        object<T>(instance).advance(full);
      });
    });
  }

  static loom_status* backward(void* instance, const loom_router_backward_args* args) noexcept {
    return guard([&] {
      const loom_router_backward_args& a =
          expect_args(args, LOOM_ROUTER_BACKWARD_ARGS_SIZE, "router backward args");
      const std::string call = "router backward";
      at_least_one(a.batch, "batch", call);
      at_least_one(a.seq_len, "seq_len", call);
      at_least_one(a.channels, "channels", call);
      if (a.x == nullptr || a.weight == nullptr) {
        fail_argument(std::string(a.x == nullptr ? "x" : "weight") +
                      " is NULL; backward needs x and weight as given to select");
      }
      const DLTensor& idx = expect_tensor(a.indices, "indices");
      const int64_t kept = idx.ndim == 2 ? idx.shape[1] : -1;
      if (kept < 1 || kept > a.seq_len) {
        fail_argument("indices has shape " + shape_string(idx) + ", expected [batch, kept] with " +
                      "1 <= kept <= seq_len " + std::to_string(a.seq_len));
      }
      router_indices(&idx, a.batch, kept, "indices");
      check_x_weight(a.x, a.weight, a.batch, a.seq_len, a.channels, idx.device);
      check_per_kept(a.dgates, a.x->dtype, a.batch, kept, idx.device, "dgates");
      const TokenTensor dx = token_tensor(a.dx, "dx");
      if (dx.batch != a.batch || dx.positions != a.seq_len || dx.channels != a.channels) {
        fail_argument("dx has shape " + shape_string(*a.dx) + " but x has " + shape_string(*a.x));
      }
      expect_dtype(*a.dx, a.x->dtype, "dx");
      expect_device(*a.dx, idx.device, "dx");
      expect_disjoint_rows(dx, "dx");
      const DLTensor& dw = expect_tensor(a.dweight, "dweight");
      expect_same_shape(dw, "dweight", *a.weight, "weight");
      expect_dtype(dw, a.x->dtype, "dweight");
      expect_contiguous(dw, "dweight");
      expect_device(dw, idx.device, "dweight");
      if constexpr (kRouterLearns<T>) shared_object<T>(instance).backward(a);
    });
  }

  static const loom_router_v1* get() {
    static_assert(
        requires(T & t, loom_router_plan_args & p, const loom_router_select_args& s,
                 const RouterMove& m, loom_router_advance_args& adv) {
          t.plan(p);
          t.select(s);
          t.gather(m);
          t.scatter(m);
          t.advance(adv);
        },
        "a Router needs void plan(loom_router_plan_args&), void select(const "
        "loom_router_select_args&), void gather(const loom::sdk::RouterMove&), void "
        "scatter(const loom::sdk::RouterMove&) and void advance(loom_router_advance_args&)");
    static const loom_router_v1 table = [] {
      loom_router_v1 v{};
      v.struct_size = LOOM_ROUTER_V1_SIZE;
      v.plan = &plan;
      v.select = &select;
      v.gather = &gather;
      v.scatter = &scatter;
      v.advance = &advance;
      if constexpr (kRouterLearns<T>) v.backward = &backward;
      return v;
    }();
    return &table;
  }
};

// ---- the MoE table (since 1.5)

template <class T>
constexpr bool kMoeDispatches = requires(T& t, const loom_moe_dispatch_args& a) {
  t.dispatch(a);
};
template <class T>
constexpr bool kMoeCombines = requires(T& t, const loom_moe_dispatch_args& a) {
  t.combine(a);
};
template <class T>
constexpr bool kMoeReduces = requires(T& t, const loom_moe_reduce_args& a) {
  t.reduce_gradients(a);
};

template <class T>
struct MoeTable {
  static constexpr uint32_t kKnownFlags =
      LOOM_MOE_RESIDUAL | LOOM_MOE_DROPLESS | LOOM_MOE_EXPERT_BIAS | LOOM_MOE_EXPERT_PARALLEL;

  static void at_least(int64_t v, int64_t least, const char* name, const std::string& call) {
    if (v < least) {
      fail_argument(call + ": " + name + " is " + std::to_string(v) +
                    "; must be >= " + std::to_string(least));
    }
  }

  // The scalars every planned call carries. `least_tokens`: 1 for plan, 0 for the calls.
  static void check_scalars(int64_t tokens, int64_t least_tokens, int64_t model_dim,
                            int64_t hidden_dim, int32_t num_experts, int32_t layer,
                            int32_t num_layers, const std::string& call) {
    at_least(tokens, least_tokens, "tokens", call);
    at_least(model_dim, 1, "model_dim", call);
    at_least(hidden_dim, 1, "hidden_dim", call);
    at_least(num_experts, 0, "num_experts", call);
    at_least(num_layers, 1, "num_layers", call);
    if (layer < 0 || layer >= num_layers) {
      fail_argument(call + ": layer " + std::to_string(layer) + " is outside 0 .. " +
                    std::to_string(num_layers - 1) + " (num_layers " + std::to_string(num_layers) +
                    ")");
    }
  }

  [[noreturn]] static void plugin_bug(const std::string& message) {
    throw Error(LOOM_ERR_INTERNAL, "the plugin's plan " + message);
  }

  // The class's plan on zeroed outputs, then the checks of what it returned and the flag the
  // table owns.
  static void plan_into(T& obj, loom_moe_plan_args& full) {
    const int32_t asked = full.num_experts;
    full.flags = 0;
    full.experts = 0;
    full.local_experts = 0;
    full.ep_size = 0;
    full.ep_rank = 0;
    full.top_k = 0;
    full.activation = 0;
    full.reserved2 = 0;
    full.capacity = 0;
    full.max_expert_rows = 0;
    full.saved_bytes = 0;
    full.workspace_bytes = 0;
    obj.plan(full);
    if (full.experts < 1) plugin_bug("resolved " + std::to_string(full.experts) + " experts");
    if (asked != 0 && full.experts != asked) {
      plugin_bug("resolved " + std::to_string(full.experts) +
                 " experts, but the caller asked for " + std::to_string(asked));
    }
    if (full.ep_size < 1 || full.local_experts < 1 ||
        static_cast<int64_t>(full.local_experts) * full.ep_size != full.experts) {
      plugin_bug("gave local_experts " + std::to_string(full.local_experts) + " and ep_size " +
                 std::to_string(full.ep_size) + " for " + std::to_string(full.experts) +
                 " experts (experts must be local_experts * ep_size, both >= 1)");
    }
    if (full.ep_rank < 0 || full.ep_rank >= full.ep_size) {
      plugin_bug("gave ep_rank " + std::to_string(full.ep_rank) + " outside 0 .. " +
                 std::to_string(full.ep_size - 1));
    }
    if (full.top_k < 1 || full.top_k > full.experts) {
      plugin_bug("gave top_k " + std::to_string(full.top_k) + " for " +
                 std::to_string(full.experts) + " experts");
    }
    if (full.activation != LOOM_MOE_GELU && full.activation != LOOM_MOE_RELU &&
        full.activation != LOOM_MOE_SILU) {
      plugin_bug("gave activation " + std::to_string(full.activation) +
                 ", not a loom_moe_activation");
    }
    if ((full.flags & ~kKnownFlags) != 0) {
      plugin_bug("set unknown flags 0x" + [&] {
        char buf[16];
        std::snprintf(buf, sizeof buf, "%x", full.flags & ~kKnownFlags);
        return std::string(buf);
      }());
    }
    const bool dropless = (full.flags & LOOM_MOE_DROPLESS) != 0;
    if (dropless ? full.capacity != 0 : full.capacity < 1) {
      plugin_bug("gave capacity " + std::to_string(full.capacity) +
                 (dropless ? " for a dropless layer (must be 0)" : " (must be >= 1)"));
    }
    if (full.max_expert_rows < 0) {
      plugin_bug("gave max_expert_rows " + std::to_string(full.max_expert_rows));
    }
    full.flags = (full.flags & ~LOOM_MOE_EXPERT_PARALLEL) |
                 (full.ep_size > 1 ? LOOM_MOE_EXPERT_PARALLEL : 0u);
  }

  static loom_moe_plan_args plan_for(T& obj, int64_t tokens, int64_t model_dim, int64_t hidden_dim,
                                     int32_t num_experts, int32_t layer, int32_t num_layers,
                                     uint32_t training, DLDataType dtype) {
    loom_moe_plan_args p{};
    p.struct_size = LOOM_MOE_PLAN_ARGS_SIZE;
    p.tokens = tokens < 1 ? 1 : tokens;
    p.model_dim = model_dim;
    p.hidden_dim = hidden_dim;
    p.num_experts = num_experts;
    p.layer = layer;
    p.num_layers = num_layers;
    p.training = training;
    p.dtype = dtype;
    plan_into(obj, p);
    return p;
  }

  static void check_buffer(const void* ptr, uint64_t given, uint64_t want, const char* what) {
    if (want == 0) return;
    if (ptr == nullptr || given < want) {
      fail_argument(std::string(what) + " is " +
                    (ptr == nullptr ? std::string("NULL") : std::to_string(given) + " bytes") +
                    " but the plan asks for " + std::to_string(want) + " bytes");
    }
    if (reinterpret_cast<uintptr_t>(ptr) % 256 != 0) {
      fail_argument(std::string(what) + " is not 256-byte aligned");
    }
  }

  static void check_tokens(const DLTensor* t, const loom_moe_plan_args& p, int64_t tokens,
                           DLDevice device, const char* what) {
    expect_moe_tensor(t, {tokens, p.model_dim}, p.dtype, device, what, "[tokens, model_dim]");
  }

  static void check_bias(const DLTensor* bias, const loom_moe_plan_args& p, DLDevice device) {
    if ((p.flags & LOOM_MOE_EXPERT_BIAS) == 0) {
      if (bias != nullptr) {
        fail_argument(
            "expert_bias is given but the layer does not balance by bias "
            "(bias_update_rate is 0): pass NULL");
      }
      return;
    }
    if (bias == nullptr) {
      fail_argument(
          "expert_bias is NULL but the layer balances by bias (bias_update_rate > 0): "
          "pass its float32 [experts] state");
    }
    expect_moe_tensor(bias, {p.experts}, DLDataType{kDLFloat, 32, 1}, device, "expert_bias",
                      "[experts]");
  }

  static const DLTensor& x_of(const DLTensor* x) { return expect_tensor(x, "x"); }

  static loom_status* plan(void* instance, loom_moe_plan_args* args) noexcept {
    return guard([&] {
      const loom_moe_plan_args& a = expect_args(args, LOOM_MOE_PLAN_ARGS_SIZE, "moe plan args");
      check_scalars(a.tokens, 1, a.model_dim, a.hidden_dim, a.num_experts, a.layer, a.num_layers,
                    "moe plan");
      fill(args, "moe plan args",
           [&](loom_moe_plan_args& full) { plan_into(shared_object<T>(instance), full); });
    });
  }

  static loom_status* forward(void* instance, const loom_moe_forward_args* args) noexcept {
    return guard([&] {
      const loom_moe_forward_args& a =
          expect_args(args, LOOM_MOE_FORWARD_ARGS_SIZE, "moe forward args");
      const std::string call = "moe forward";
      check_scalars(a.tokens, 0, a.model_dim, a.hidden_dim, a.num_experts, a.layer, a.num_layers,
                    call);
      at_least(a.step, a.training != 0 ? 1 : 0, "step", call);
      at_least(a.first_token, 0, "first_token", call);
      T& obj = object<T>(instance);
      const DLTensor& x = x_of(a.x);
      const loom_moe_plan_args p = plan_for(obj, a.tokens, a.model_dim, a.hidden_dim, a.num_experts,
                                            a.layer, a.num_layers, a.training, x.dtype);
      check_tokens(a.x, p, a.tokens, x.device, "x");
      moe_weights(a.weights, p, x.device, "weights");
      check_bias(a.expert_bias, p, x.device);
      check_tokens(a.y, p, a.tokens, x.device, "y");
      if (a.route_experts != nullptr) {
        expect_moe_tensor(a.route_experts, {a.tokens, p.top_k}, DLDataType{kDLInt, 32, 1}, x.device,
                          "route_experts", "[tokens, top_k]");
      }
      if (a.route_weights != nullptr) {
        expect_moe_tensor(a.route_weights, {a.tokens, p.top_k}, DLDataType{kDLFloat, 32, 1},
                          x.device, "route_weights", "[tokens, top_k]");
      }
      if (a.stats != nullptr) {
        if (a.stats->struct_size < LOOM_MOE_STATS_SIZE) {
          fail_argument("stats has struct_size " + std::to_string(a.stats->struct_size) +
                        ", expected " + std::to_string(LOOM_MOE_STATS_SIZE));
        }
        if (a.stats->load != nullptr && a.stats->load_count != p.experts) {
          fail_argument("stats.load_count is " + std::to_string(a.stats->load_count) +
                        ", expected the " + std::to_string(p.experts) + " experts");
        }
        a.stats->aux_loss = 0;
        a.stats->dropped = 0;
        a.stats->expert_rows = 0;
        if (a.stats->load != nullptr) {
          std::memset(a.stats->load, 0, sizeof(int64_t) * static_cast<std::size_t>(p.experts));
        }
      }
      check_buffer(a.saved, a.saved_bytes, p.saved_bytes, "saved");
      check_buffer(a.workspace, a.workspace_bytes, p.workspace_bytes, "workspace");
      obj.forward(a, p);
    });
  }

  static loom_status* backward(void* instance, const loom_moe_backward_args* args) noexcept {
    return guard([&] {
      const loom_moe_backward_args& a =
          expect_args(args, LOOM_MOE_BACKWARD_ARGS_SIZE, "moe backward args");
      const std::string call = "moe backward";
      check_scalars(a.tokens, 0, a.model_dim, a.hidden_dim, a.num_experts, a.layer, a.num_layers,
                    call);
      at_least(a.step, a.training != 0 ? 1 : 0, "step", call);
      at_least(a.first_token, 0, "first_token", call);
      if (!std::isfinite(a.aux_loss_coef)) {
        fail_argument(call + ": aux_loss_coef is not finite");
      }
      T& obj = object<T>(instance);
      const DLTensor& x = x_of(a.x);
      const loom_moe_plan_args p = plan_for(obj, a.tokens, a.model_dim, a.hidden_dim, a.num_experts,
                                            a.layer, a.num_layers, a.training, x.dtype);
      check_tokens(a.x, p, a.tokens, x.device, "x");
      moe_weights(a.weights, p, x.device, "weights");
      check_tokens(a.dy, p, a.tokens, x.device, "dy");
      check_tokens(a.dx, p, a.tokens, x.device, "dx");
      moe_weights(a.grads, p, x.device, "grads");
      check_buffer(a.saved, a.saved_bytes, p.saved_bytes, "saved");
      check_buffer(a.workspace, a.workspace_bytes, p.workspace_bytes, "workspace");
      obj.backward(a, p);
    });
  }

  // dispatch and combine carry no hidden_dim, layer or training: the plan made here (hidden_dim
  // 1, layer 0 of 1, eval) resolves only what the routing's shape needs (experts, top_k,
  // local_experts).
  static void check_dispatch(T& obj, const loom_moe_dispatch_args& a, const char* call_name) {
    const std::string call(call_name);
    at_least(a.tokens, 0, "tokens", call);
    at_least(a.model_dim, 1, "model_dim", call);
    at_least(a.num_experts, 0, "num_experts", call);
    at_least(a.top_k, 1, "top_k", call);
    const DLTensor& x = x_of(a.x);
    const loom_moe_plan_args p =
        plan_for(obj, a.tokens, a.model_dim, 1, a.num_experts, 0, 1, 0, x.dtype);
    if (a.top_k != p.top_k) {
      fail_argument(call + ": top_k is " + std::to_string(a.top_k) + " but the layer chooses " +
                    std::to_string(p.top_k) + " experts per token");
    }
    expect_moe_tensor(a.x, {a.tokens, a.model_dim}, x.dtype, x.device, "x", "[tokens, model_dim]");
    const DLTensor& rows = expect_tensor(a.rows, "rows");
    if (rows.ndim != 2 || rows.shape[1] != a.model_dim) {
      fail_argument("rows has shape " + shape_string(rows) + ", expected [rows, " +
                    std::to_string(a.model_dim) + "] (rows, model_dim)");
    }
    expect_dtype(rows, x.dtype, "rows");
    expect_contiguous(rows, "rows");
    expect_device(rows, x.device, "rows");
    moe_routing(a.route_experts, a.route_weights, a.tokens, a.top_k, p.experts, x.device);
    if (a.counts != nullptr && a.counts_count != p.local_experts) {
      fail_argument("counts_count is " + std::to_string(a.counts_count) + ", expected the " +
                    std::to_string(p.local_experts) + " local experts");
    }
  }

  static loom_status* dispatch(void* instance, const loom_moe_dispatch_args* args) noexcept {
    return guard([&] {
      const loom_moe_dispatch_args& a =
          expect_args(args, LOOM_MOE_DISPATCH_ARGS_SIZE, "moe dispatch args");
      T& obj = object<T>(instance);
      check_dispatch(obj, a, "moe dispatch");
      if (a.counts == nullptr) fail_argument("moe dispatch: counts is NULL");
      if constexpr (kMoeDispatches<T>) obj.dispatch(a);
    });
  }

  static loom_status* combine(void* instance, const loom_moe_dispatch_args* args) noexcept {
    return guard([&] {
      const loom_moe_dispatch_args& a =
          expect_args(args, LOOM_MOE_DISPATCH_ARGS_SIZE, "moe combine args");
      T& obj = object<T>(instance);
      check_dispatch(obj, a, "moe combine");
      if constexpr (kMoeCombines<T>) obj.combine(a);
    });
  }

  static loom_status* reduce_gradients(void* instance, const loom_moe_reduce_args* args) noexcept {
    return guard([&] {
      const loom_moe_reduce_args& a =
          expect_args(args, LOOM_MOE_REDUCE_ARGS_SIZE, "moe reduce_gradients args");
      if (a.count < 0) fail_argument("moe reduce_gradients: count is " + std::to_string(a.count));
      if (a.count > 0 && a.tensors == nullptr) {
        fail_argument("moe reduce_gradients: tensors is NULL for " + std::to_string(a.count) +
                      " tensors");
      }
      for (int64_t i = 0; i < a.count; ++i) {
        const std::string what = "tensors[" + std::to_string(i) + "]";
        const DLTensor& t = expect_tensor(a.tensors[i], what);
        expect_fp32(t, what);
        expect_contiguous(t, what);
        if (i > 0) expect_same_device(t, what, *a.tensors[0], "tensors[0]");
      }
      if constexpr (kMoeReduces<T>) object<T>(instance).reduce_gradients(a);
    });
  }

  static const loom_moe_v1* get() {
    static_assert(
        requires(T & t, loom_moe_plan_args & p, const loom_moe_forward_args& f,
                 const loom_moe_backward_args& b) {
          t.plan(p);
          t.forward(f, p);
          t.backward(b, p);
        },
        "a Moe needs void plan(loom_moe_plan_args&), void forward(const loom_moe_forward_args&, "
        "const loom_moe_plan_args&) and void backward(const loom_moe_backward_args&, const "
        "loom_moe_plan_args&)");
    static const loom_moe_v1 table = [] {
      loom_moe_v1 v{};
      v.struct_size = LOOM_MOE_V1_SIZE;
      v.plan = &plan;
      v.forward = &forward;
      v.backward = &backward;
      if constexpr (kMoeDispatches<T>) v.dispatch = &dispatch;
      if constexpr (kMoeCombines<T>) v.combine = &combine;
      if constexpr (kMoeReduces<T>) v.reduce_gradients = &reduce_gradients;
      return v;
    }();
    return &table;
  }
};

// ---- the quantizer table (since 1.5)

template <class T>
constexpr bool kQuantizerMultiplies = requires(T& t, const loom_quantizer_matmul_args& a,
                                               const loom_quantizer_layout_args& l) {
  t.matmul(a, l);
};

template <class T>
struct QuantizerTable {
  static constexpr uint32_t kKnownFlags =
      LOOM_QUANTIZER_HAS_MATMUL | LOOM_QUANTIZER_INT8_ACTIVATIONS;

  static void check_role(int32_t role, const std::string& call) {
    if (role != LOOM_QUANTIZER_WEIGHT && role != LOOM_QUANTIZER_ACTIVATION) {
      fail_argument(call + ": role " + std::to_string(role) +
                    " is not LOOM_QUANTIZER_WEIGHT (1) or LOOM_QUANTIZER_ACTIVATION (2)");
    }
  }

  [[noreturn]] static void plugin_bug(const std::string& message) {
    throw Error(LOOM_ERR_INTERNAL, "the plugin's layout " + message);
  }

  // The class's layout into `full` (whose format points to a caller's descriptor that this
  // zeroes first), then the checks and the fields the table owns.
  static void layout_into(T& obj, loom_quantizer_layout_args& full) {
    loom_quant_format* f = full.format;
    const uint32_t format_size = f->struct_size;
    std::memset(static_cast<void*>(f), 0,
                format_size < sizeof(loom_quant_format) ? format_size : sizeof(loom_quant_format));
    f->struct_size = format_size;
    f->ndim = full.ndim;
    f->shape = full.shape;
    const bool can = kQuantizerMultiplies<T> && full.role == LOOM_QUANTIZER_WEIGHT;
    full.flags = can ? LOOM_QUANTIZER_HAS_MATMUL : 0u;
    full.reserved3 = 0;
    full.packed_bytes = 0;
    full.scale_count = 0;
    full.zero_point_count = 0;
    full.workspace_bytes = 0;
    full.matmul_workspace_bytes = 0;
    obj.layout(full);
    if ((full.flags & ~kKnownFlags) != 0) {
      plugin_bug("set unknown flags 0x" + [&] {
        char buf[16];
        std::snprintf(buf, sizeof buf, "%x", full.flags & ~kKnownFlags);
        return std::string(buf);
      }());
    }
    if (!can || (full.flags & LOOM_QUANTIZER_HAS_MATMUL) == 0) {
      full.flags = 0;
      full.matmul_workspace_bytes = 0;
    }
    if (f->ndim != full.ndim || f->shape != full.shape) {
      plugin_bug("changed the format's ndim or shape (they are the caller's)");
    }
    loom_quant_format checked{};
    try {
      checked = check_quant_format(f, "format");
    } catch (const Error& e) {
      plugin_bug(std::string("returned a broken format: ") + e.what());
    }
    const uint64_t bytes = packed_bytes(checked);
    const auto groups = static_cast<int64_t>(quant_group_count(checked));
    const bool zeros =
        checked.scheme == LOOM_QUANT_INT && (checked.flags & LOOM_QUANT_SYMMETRIC) == 0;
    const int64_t zero_count = zeros ? groups : 0;
    if (full.packed_bytes != 0 && full.packed_bytes != bytes) {
      plugin_bug("gave packed_bytes " + std::to_string(full.packed_bytes) +
                 ", but its format takes " + std::to_string(bytes));
    }
    if (full.scale_count != 0 && full.scale_count != groups) {
      plugin_bug("gave scale_count " + std::to_string(full.scale_count) + ", but its format has " +
                 std::to_string(groups) + " groups");
    }
    if (full.zero_point_count != 0 && full.zero_point_count != zero_count) {
      plugin_bug("gave zero_point_count " + std::to_string(full.zero_point_count) +
                 ", but its format has " + std::to_string(zero_count));
    }
    full.packed_bytes = bytes;
    full.scale_count = groups;
    full.zero_point_count = zero_count;
  }

  static void check_layout_args(const loom_quantizer_layout_args& a, const std::string& call) {
    check_role(a.role, call);
    if (a.ndim != 2) {
      fail_argument(call + ": ndim is " + std::to_string(a.ndim) + "; a quantizer takes 2-D " +
                    (a.role == LOOM_QUANTIZER_WEIGHT ? "[N, K] weights" : "[M, K] activations"));
    }
    if (a.shape == nullptr) fail_argument(call + ": shape is NULL");
    for (int d = 0; d < 2; ++d) {
      if (a.shape[d] < 0) {
        fail_argument(call + ": shape[" + std::to_string(d) + "] is " + std::to_string(a.shape[d]));
      }
    }
    if (!is_quantizer_float(a.dtype)) {
      fail_argument(call + ": dtype " + dtype_string(a.dtype) +
                    " is not float32, float16 or bfloat16");
    }
    if (a.matmul_rows < 0) {
      fail_argument(call + ": matmul_rows is " + std::to_string(a.matmul_rows));
    }
    if (a.format == nullptr) fail_argument(call + ": format is NULL");
    if (a.format->struct_size < LOOM_QUANT_FORMAT_SIZE) {
      fail_argument(call + ": format has struct_size " + std::to_string(a.format->struct_size) +
                    ", expected " + std::to_string(LOOM_QUANT_FORMAT_SIZE));
    }
  }

  // The layout the table makes for a call: its format lives in `out`, its shape in `shape`.
  static loom_quantizer_layout_args layout_for(T& obj, int32_t role, const int64_t* shape,
                                               DLDataType dtype, int64_t matmul_rows,
                                               loom_quant_format& out) {
    loom_quantizer_layout_args l{};
    l.struct_size = LOOM_QUANTIZER_LAYOUT_ARGS_SIZE;
    l.role = role;
    l.ndim = 2;
    l.shape = shape;
    l.dtype = dtype;
    l.matmul_rows = matmul_rows;
    out = loom_quant_format{};
    out.struct_size = LOOM_QUANT_FORMAT_SIZE;
    l.format = &out;
    check_layout_args(l, "quantizer layout");
    layout_into(obj, l);
    return l;
  }

  static void check_workspace(const void* ptr, uint64_t given, uint64_t want) {
    if (want == 0) return;
    if (ptr == nullptr || given < want) {
      fail_argument(std::string("workspace is ") +
                    (ptr == nullptr ? std::string("NULL") : std::to_string(given) + " bytes") +
                    " but the layout asks for " + std::to_string(want) + " bytes");
    }
    if (reinterpret_cast<uintptr_t>(ptr) % 256 != 0) {
      fail_argument("workspace is not 256-byte aligned");
    }
  }

  static loom_status* layout(void* instance, loom_quantizer_layout_args* args) noexcept {
    return guard([&] {
      const loom_quantizer_layout_args& a =
          expect_args(args, LOOM_QUANTIZER_LAYOUT_ARGS_SIZE, "quantizer layout args");
      check_layout_args(a, "quantizer layout");
      fill(args, "quantizer layout args", [&](loom_quantizer_layout_args& full) {
        layout_into(shared_object<T>(instance), full);
      });
    });
  }

  // quantize and dequantize: the same checks.
  template <bool kQuantize>
  static loom_status* code(void* instance, const loom_quantizer_quantize_args* args) noexcept {
    return guard([&] {
      const char* what = kQuantize ? "quantizer quantize args" : "quantizer dequantize args";
      const loom_quantizer_quantize_args& a =
          expect_args(args, LOOM_QUANTIZER_QUANTIZE_ARGS_SIZE, what);
      const std::string call = kQuantize ? "quantizer quantize" : "quantizer dequantize";
      check_role(a.role, call);
      if (a.format == nullptr) fail_argument(call + ": format is NULL");
      const loom_quant_format given = check_quant_format(a.format, "format");
      quant_matrix(a.x, "x");
      const DLTensor& x = *a.x;
      T& obj = shared_object<T>(instance);
      const int64_t shape[2] = {x.shape[0], x.shape[1]};
      loom_quant_format expected{};
      const loom_quantizer_layout_args l = layout_for(obj, a.role, shape, x.dtype, 0, expected);
      expect_same_format(given, expected, "format");
      quant_tensors(a.packed, a.scales, a.zero_points, l, x.device);
      check_workspace(a.workspace, a.workspace_bytes, l.workspace_bytes);
      if constexpr (kQuantize) {
        obj.quantize(a, l);
      } else {
        obj.dequantize(a, l);
      }
    });
  }

  static loom_status* matmul(void* instance, const loom_quantizer_matmul_args* args) noexcept {
    return guard([&] {
      const loom_quantizer_matmul_args& a =
          expect_args(args, LOOM_QUANTIZER_MATMUL_ARGS_SIZE, "quantizer matmul args");
      if (a.format == nullptr) fail_argument("quantizer matmul: format is NULL");
      const loom_quant_format given = check_quant_format(a.format, "format");
      if (given.ndim != 2) {
        fail_argument("format.ndim is " + std::to_string(given.ndim) +
                      "; the weight of a matmul is [N, K]");
      }
      quant_matrix(a.x, "x");
      const DLTensor& x = *a.x;
      const int64_t n = given.shape[0], k = given.shape[1], m = x.shape[0];
      if (x.shape[1] != k) {
        fail_argument("x has shape " + shape_string(x) + " but the weight is [" +
                      std::to_string(n) + ", " + std::to_string(k) + "]: x's columns must be K " +
                      std::to_string(k));
      }
      T& obj = shared_object<T>(instance);
      const int64_t shape[2] = {n, k};
      loom_quant_format expected{};
      const loom_quantizer_layout_args l =
          layout_for(obj, LOOM_QUANTIZER_WEIGHT, shape, x.dtype, m, expected);
      if ((l.flags & LOOM_QUANTIZER_HAS_MATMUL) == 0) {
        throw Error(LOOM_ERR_UNIMPLEMENTED,
                    "quantizer matmul: this quantizer has no matmul for its " +
                        std::to_string(expected.bits) + "-bit format of this weight");
      }
      expect_same_format(given, expected, "format");
      quant_tensors(a.packed, a.scales, a.zero_points, l, x.device);
      if (a.bias != nullptr) {
        expect_moe_tensor(a.bias, {n}, x.dtype, x.device, "bias", "[N]");
      }
      expect_moe_tensor(a.y, {m, n}, x.dtype, x.device, "y", "[M, N]");
      check_workspace(a.workspace, a.workspace_bytes, l.matmul_workspace_bytes);
      if constexpr (kQuantizerMultiplies<T>) obj.matmul(a, l);
    });
  }

  static const loom_quantizer_v1* get() {
    static_assert(
        requires(T & t, loom_quantizer_layout_args & l, const loom_quantizer_quantize_args& q) {
          t.layout(l);
          t.quantize(q, l);
          t.dequantize(q, l);
        },
        "a Quantizer needs void layout(loom_quantizer_layout_args&), void quantize(const "
        "loom_quantizer_quantize_args&, const loom_quantizer_layout_args&) and void "
        "dequantize(const loom_quantizer_quantize_args&, const loom_quantizer_layout_args&)");
    static const loom_quantizer_v1 table = [] {
      loom_quantizer_v1 v{};
      v.struct_size = LOOM_QUANTIZER_V1_SIZE;
      v.layout = &layout;
      v.quantize = &code<true>;
      v.dequantize = &code<false>;
      if constexpr (kQuantizerMultiplies<T>) v.matmul = &matmul;
      return v;
    }();
    return &table;
  }
};

// ---- the factory

template <class T>
constexpr bool kHasState = requires(T& t, StateWriter& w, std::span<const std::byte> b) {
  t.export_state(w);
  t.import_state(b);
};

// The ABI minor a plugin class needs its host to speak: T::kRequiredHostMinor when the class
// declares it (it uses something a later minor added), else 0 (any 1.x host).
template <class T>
constexpr uint16_t required_host_minor() {
  if constexpr (requires {
                  { T::kRequiredHostMinor } -> std::convertible_to<uint16_t>;
                }) {
    return static_cast<uint16_t>(T::kRequiredHostMinor);
  } else {
    return 0;
  }
}

// An older host reads only the prefix of the plugin's structs it knows and cannot tell what
// the plugin needs: the plugin refuses instead, naming both versions, before it reads a
// field the host does not have.
template <class T>
void check_host_version(const loom_host_services* host) {
  if (host == nullptr || host->struct_size < LOOM_STRUCT_SIZE(loom_host_services, abi_minor)) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT, "the host services table is missing or too short");
  }
  constexpr uint16_t need = required_host_minor<T>();
  if (host->abi_major != LOOM_ABI_MAJOR || host->abi_minor < need) {
    throw Error(LOOM_ERR_ABI_MISMATCH,
                "this plugin needs a Loom host that speaks ABI " + std::to_string(LOOM_ABI_MAJOR) +
                    "." + std::to_string(need) + " or newer; this host speaks ABI " +
                    std::to_string(host->abi_major) + "." + std::to_string(host->abi_minor) +
                    " (update Loom, or use a build of the plugin for this version)");
  }
}

// The cross-parameter hook: static void validate_params(Context&), given the same typed
// view of the parameters as the constructor. It throws Error(code, message, "key") to name
// the parameter to blame.
template <class T>
constexpr bool kHasValidate = requires(Context& c) {
  T::validate_params(c);
};

// The index of parameter `name` in an array the host passed (walked by its own stride), or -1.
inline int32_t param_index(const loom_param* params, std::size_t count, const std::string& name) {
  if (params == nullptr || count == 0 || params[0].struct_size < sizeof(loom_param)) return -1;
  const std::size_t stride = params[0].struct_size;
  const auto* bytes = reinterpret_cast<const unsigned char*>(params);  // NOLINT
  for (std::size_t i = 0; i < count && i < 0x7fffffff; ++i) {
    const auto* p = reinterpret_cast<const loom_param*>(bytes + i * stride);  // NOLINT
    if (p->name != nullptr && name == p->name) return static_cast<int32_t>(i);
  }
  return -1;
}

template <class T>
struct FactoryStorage;
template <class T>
const FactoryStorage<T>& factory_storage();

// Shortest text that reads back as `v` ("1e-08", "0.5"), for messages.
inline std::string number_text(double v) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return r.ec == std::errc() ? std::string(buf, r.ptr) : std::to_string(v);
}

// What a host before ABI 1.2 does not check: exclusive bounds and exact int64 ranges (it reads
// only the inclusive double bounds, which the SDK rounds outward). Run in create on such a
// host, so a value the schema refuses never reaches the constructor.
inline void check_12_bounds(const Context& params, const loom_param_spec* specs,
                            std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) {
    const loom_param_spec& spec = specs[i];
    if ((spec.flags &
         (LOOM_PARAM_MIN_EXCLUSIVE | LOOM_PARAM_MAX_EXCLUSIVE | LOOM_PARAM_INT_RANGE)) == 0 ||
        !params.has(spec.name)) {
      continue;
    }
    const bool lo_ex = (spec.flags & LOOM_PARAM_MIN_EXCLUSIVE) != 0;
    const bool hi_ex = (spec.flags & LOOM_PARAM_MAX_EXCLUSIVE) != 0;
    const bool exact = (spec.flags & LOOM_PARAM_INT_RANGE) != 0;
    const std::string range =
        std::string(lo_ex ? "(" : "[") +
        (exact ? std::to_string(spec.int_min) : number_text(spec.min)) + ", " +
        (exact ? std::to_string(spec.int_max) : number_text(spec.max)) + (hi_ex ? ")" : "]");
    auto refuse = [&](const std::string& value) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT, "parameter '" + std::string(spec.name) +
                                                 "' = " + value + " is out of range " + range);
    };
    auto check_double = [&](double x) {
      if (!((lo_ex ? x > spec.min : x >= spec.min) && (hi_ex ? x < spec.max : x <= spec.max))) {
        refuse(number_text(x));
      }
    };
    auto check_int = [&](int64_t x) {
      if (!exact) return check_double(static_cast<double>(x));
      if (!((lo_ex ? x > spec.int_min : x >= spec.int_min) &&
            (hi_ex ? x < spec.int_max : x <= spec.int_max))) {
        refuse(std::to_string(x));
      }
    };
    const loom_value& v = params.value(spec.name);
    switch (v.type) {
      case LOOM_PARAM_FLOAT:
        check_double(v.float_value);
        break;
      case LOOM_PARAM_INT:
        check_int(v.int_value);
        break;
      case LOOM_PARAM_FLOAT_LIST:
        for (std::size_t k = 0; k < v.count && v.float_list != nullptr; ++k) {
          check_double(v.float_list[k]);
        }
        break;
      case LOOM_PARAM_INT_LIST:
        for (std::size_t k = 0; k < v.count && v.int_list != nullptr; ++k) check_int(v.int_list[k]);
        break;
      default:
        break;
    }
  }
}

template <class T>
struct FactoryThunks {
  // `host_validated`: the host ran the factory's validate (a 1.2 host does before create);
  // an older host never calls it, so the hook runs here and fails the create instead.
  static void make(const loom_host_services* host, void** out_instance, bool host_validated) {
    if (out_instance == nullptr) throw Error(LOOM_ERR_INVALID_ARGUMENT, "out_instance is NULL");
    *out_instance = nullptr;
    check_host_version<T>(host);
    if (!host_validated) {
      Context params(host);
      const auto& storage = factory_storage<T>();
      check_12_bounds(params, storage.schema.data(), storage.schema.size());
      if constexpr (kHasValidate<T>) {
        try {
          T::validate_params(params);
        } catch (const Error& e) {
          if (e.param().empty()) throw;
          throw Error(e.code(), "parameter '" + e.param() + "': " + e.what());
        }
      }
    }
    // bad_alloc is caught by guard() and reported as RESOURCE_EXHAUSTED.
    *out_instance = new Holder<T>(host);  // NOLINT(bugprone-unhandled-exception-at-new)
  }
  static loom_status* create(const loom_host_services* host, void** out_instance) noexcept {
    return guard([&] {
      const bool validated = host != nullptr &&
                             host->struct_size >= LOOM_STRUCT_SIZE(loom_host_services, abi_minor) &&
                             host->abi_minor >= 2;
      make(host, out_instance, validated);
    });
  }
  static loom_status* create_with_args(const loom_create_args* args, void** out_instance) noexcept {
    return guard([&] {
      if (out_instance != nullptr) *out_instance = nullptr;
      const loom_create_args in = normalized(args, "create args");
      make(in.host, out_instance, true);  // create_with_args is 1.2: the host validated
    });
  }
  // Runs T::validate_params on the parameters the host passes (no instance exists yet): a
  // Context over a services table that holds only them, the instance's name and the host's
  // make_status. An Error naming a parameter sets bad_param.
  static loom_status* validate(loom_validate_args* args) noexcept {
    if (args == nullptr || args->struct_size < LOOM_STRUCT_SIZE(loom_validate_args, bad_param)) {
      return make_status(LOOM_ERR_INVALID_ARGUMENT, "validate args are missing or too short");
    }
    try {
      const loom_validate_args in = normalized(args, "validate args");
      loom_host_services svc{};
      svc.struct_size = LOOM_HOST_SERVICES_SIZE;
      svc.abi_major = LOOM_ABI_MAJOR;
      svc.abi_minor = 2;  // validate exists since 1.2
      svc.host_ctx = in.host_ctx;
      svc.instance_name = in.instance_name;
      svc.make_status = in.make_status;
      svc.params = in.params;
      svc.param_count = in.params != nullptr ? in.param_count : 0;
      Context params(&svc);
      T::validate_params(params);
      return nullptr;
    } catch (const Error& e) {
      if (e.param().empty()) return make_status(e.code(), e.what());
      const int32_t index = param_index(args->params, args->param_count, e.param());
      if (index < 0) {
        return make_status(e.code(), std::string(e.what()) + " (parameter '" + e.param() +
                                         "', which is not in the schema)");
      }
      args->bad_param = index;
      return make_status(e.code(), e.what());
    } catch (...) {
      return status_from_current_exception();
    }
  }
  static void destroy(void* instance) noexcept {
    // A throwing destructor has nowhere to report to; the C signature returns nothing.
    try {
      delete static_cast<Holder<T>*>(instance);
    } catch (...) {
    }
  }
  // Serialises the state into a checksummed frame (state.hpp), hands it to the host's
  // writer in one piece and keeps it for a repeated export; the export after that one
  // serialises afresh, so at most one extra copy is held, and only until the next call.
  static loom_status* export_state(void* instance, const loom_state_writer* writer) noexcept {
    return guard([&] {
      StateWriter out(writer);
      Holder<T>& h = holder<T>(instance);
      if (h.has_exported) {
        const std::vector<std::byte> blob = std::move(h.exported);
        h.forget_export();
        out.write_bytes(blob);
        return;
      }
      std::vector<std::byte> blob;
      state_frame::begin(blob);
      loom_state_writer append{
          LOOM_STATE_WRITER_SIZE, 0, &blob,
          [](void* ctx, const void* data, std::size_t bytes) noexcept -> loom_status* {
            return guard([&] {
              if (data == nullptr) throw Error(LOOM_ERR_INVALID_ARGUMENT, "state write of NULL");
              auto* b = static_cast<std::vector<std::byte>*>(ctx);
              const auto* p = static_cast<const std::byte*>(data);
              b->insert(b->end(), p, p + bytes);
            });
          }};
      StateWriter payload(&append);
      h.object.export_state(payload);
      state_frame::finish(blob);
      out.write_bytes(blob);
      h.exported = std::move(blob);
      h.has_exported = true;
    });
  }
  // Checks the frame (DATA_LOSS naming what does not match) and gives the plugin the payload;
  // an unframed blob from before frames reaches the plugin whole, as it always did.
  static void import(void* instance, const void* data, std::size_t bytes) {
    if (data == nullptr && bytes != 0) throw Error(LOOM_ERR_INVALID_ARGUMENT, "state data is NULL");
    T& obj = object<T>(instance);
    obj.import_state(state_frame::open(
        std::span<const std::byte>(static_cast<const std::byte*>(data), data ? bytes : 0)));
  }
  static loom_status* import_state(void* instance, const void* data, std::size_t bytes) noexcept {
    return guard([&] { import(instance, data, bytes); });
  }
  static loom_status* import_state_with_args(void* instance,
                                             const loom_import_state_args* args) noexcept {
    return guard([&] {
      const loom_import_state_args in = normalized(args, "import_state args");
      import(instance, in.data, in.bytes);
    });
  }
};

// ---- the kinds the SDK implements, one entry each: the base class a plugin class derives
// from and the table template that builds its function table. Adding a kind is its base
// class (above), its table (above) and one entry here.

template <class Base, template <class> class Table>
struct Kind {
  using base = Base;
  template <class T>
  static const void* table() {
    return Table<T>::get();
  }
};
template <class... Entries>
struct KindList {};
using Kinds =
    KindList<Kind<Optimizer, OptimizerTable>, Kind<Comm, CommTable>, Kind<Codec, CodecTable>,
             Kind<Curriculum, CurriculumTable>, Kind<Sampler, SamplerTable>,
             Kind<Router, RouterTable>, Kind<Moe, MoeTable>, Kind<Quantizer, QuantizerTable>>;

// How many of the kinds' base classes T derives from (a plugin class must derive from one).
template <class T, class... Entries>
constexpr int kind_count(KindList<Entries...> /*kinds*/) {
  return (0 + ... + static_cast<int>(kIs<T, typename Entries::base>));
}

// Sets the factory's kind ID and table from the one kind T derives from.
template <class T, class... Entries>
void set_kind(loom_factory& factory, KindList<Entries...> /*kinds*/) {
  (
      [&] {
        if constexpr (kIs<T, typename Entries::base>) {
          factory.kind = Entries::base::kKind;
          factory.vtable = Entries::template table<T>();
        }
      }(),
      ...);
}

// Everything one factory points to, built once on first use and kept in static storage.
template <class T>
struct FactoryStorage {
  FactoryStorage() : schema(make_schema()) {
    factory.struct_size = LOOM_FACTORY_SIZE;
    factory.param_specs = schema.data();
    factory.param_count = schema.size();
    // Both create entries: create_with_args for hosts from 1.2 on, create for older ones.
    factory.create = &FactoryThunks<T>::create;
    factory.create_with_args = &FactoryThunks<T>::create_with_args;
    factory.destroy = &FactoryThunks<T>::destroy;
    set_kind<T>(factory, Kinds{});
    if constexpr (kHasState<T>) {
      factory.export_state = &FactoryThunks<T>::export_state;
      factory.import_state = &FactoryThunks<T>::import_state;
      factory.import_state_with_args = &FactoryThunks<T>::import_state_with_args;
    }
    if constexpr (kHasValidate<T>) factory.validate = &FactoryThunks<T>::validate;
  }

  static Schema make_schema() {
    if constexpr (requires {
                    { T::schema() } -> std::convertible_to<Schema>;
                  }) {
      return T::schema();
    } else {
      return Schema{};
    }
  }

  SchemaStorage schema;
  loom_factory factory{};
};

// Built on the entry point's first call (a broken schema is reported there), kept while the
// library is loaded.
template <class T>
const FactoryStorage<T>& factory_storage() {
  static const FactoryStorage<T> storage;
  return storage;
}

// Reports a broken plugin declaration where a developer will see it: there is no status to
// return from the entry point, and the host reports the NULL it gets.
inline void report_declaration_error(const char* plugin, const char* message) noexcept {
  std::fprintf(stderr, "loom plugin '%s': %s\n", plugin != nullptr ? plugin : "?", message);
}

inline const char* current_exception_message() noexcept {
  try {
    throw;
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

// The loom_plugin_v1 behind the entry symbol. Never throws; get() is NULL when the
// declaration is invalid (bad name, duplicate kind, invalid schema).
class PluginStorage {
 public:
  PluginStorage(const char* name, const char* version, const char* description,
                std::initializer_list<FactoryFn> factories) noexcept {
    try {
      if (!valid_name(name)) {
        report_declaration_error(name, "plugin name must match [a-z0-9_]+");
        return;
      }
      for (auto make : factories) {
        const loom_factory* f = make();
        for (const loom_factory* g : factories_) {
          if (std::strcmp(g->kind, f->kind) == 0) {
            report_declaration_error(name,
                                     (std::string("two factories for kind ") + f->kind).c_str());
            return;
          }
        }
        factories_.push_back(f);
      }
      plugin_.struct_size = LOOM_PLUGIN_V1_SIZE;
      plugin_.abi_major = LOOM_ABI_MAJOR;
      plugin_.abi_minor = LOOM_ABI_MINOR;
      plugin_.name = name;
      plugin_.version = version != nullptr ? version : "";
      plugin_.description = description != nullptr ? description : "";
      plugin_.factories = factories_.data();
      plugin_.factory_count = factories_.size();
      ok_ = true;
    } catch (...) {
      report_declaration_error(name, current_exception_message());
    }
  }

  const loom_plugin_v1* get() const noexcept { return ok_ ? &plugin_ : nullptr; }

 private:
  static bool valid_name(const char* name) {
    if (name == nullptr || *name == '\0') return false;
    for (const char* c = name; *c != '\0'; ++c) {
      if (!((*c >= 'a' && *c <= 'z') || (*c >= '0' && *c <= '9') || *c == '_')) return false;
    }
    return true;
  }

  std::vector<const loom_factory*> factories_;
  loom_plugin_v1 plugin_{};
  bool ok_ = false;
};

}  // namespace detail

// The factory for class T (deriving from one kind base class: Optimizer, Comm, Codec,
// Curriculum, Sampler, Router, Moe, Quantizer).
template <class T>
FactoryFn factory() {
  static_assert(detail::kind_count<T>(detail::Kinds{}) == 1,
                "derive the plugin class from exactly one kind base class (loom::sdk::Optimizer, "
                "Comm, Codec, Curriculum, Sampler, Router, Moe, Quantizer: the kinds in "
                "loom::sdk::detail::Kinds)");
  static_assert(std::is_constructible_v<T, Context&>,
                "the plugin class needs a constructor taking loom::sdk::Context&");
  return [] { return static_cast<const loom_factory*>(&detail::factory_storage<T>().factory); };
}

}  // namespace loom::sdk

// Defines the plugin's one exported symbol. The arguments after the description are
// loom::sdk::factory<T>() for each kind the plugin provides. Use once per plugin, at
// namespace scope in one source file, followed by a semicolon.
#define LOOM_PLUGIN(name, version, description, ...)                                 \
  extern "C" LOOM_EXPORT const loom_plugin_v1* loom_plugin_entry_v1(void) noexcept { \
    static const ::loom::sdk::detail::PluginStorage loom_sdk_plugin_storage(         \
        name, version, description, {__VA_ARGS__});                                  \
    return loom_sdk_plugin_storage.get();                                            \
  }                                                                                  \
  static_assert(true, "LOOM_PLUGIN(...) is followed by a semicolon")

#endif  // LOOM_SDK_PLUGIN_HPP
