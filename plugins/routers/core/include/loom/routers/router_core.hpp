// Declared public interface of loom_router_core: bench/, the trainer and tests may include this
// header (as <loom/routers/router_core.hpp>); the core's other headers are private to it.
//
// What every token router of plugins/routers shares (kind loom.router/1): the row copies of
// gather and scatter, the `layers` parameter, and the layer-token bookkeeping of advance.
// The routers (random_ltd, topk_router), their tests and the benchmarks link it.
#pragma once

#include <loom/kinds/router.h>
#include <loom/sdk/context.hpp>
#include <loom/sdk/router.hpp>
#include <loom/sdk/schema.hpp>
#include <loom/sdk/state.hpp>
#include <loom/sdk/status.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace loom::routers {

// Whether this build moves CUDA tensors (LOOM_CUDA on); without it a CUDA tensor is
// UNIMPLEMENTED, the message naming the build.
bool have_cuda();

// gather: kept[b, j, :] = full[b, indices[b, j], :];
// scatter: full[b, indices[b, j], :] = kept[b, j, :], the other rows of full untouched.
// Bit-for-bit copies of 8/16/32/64-bit elements, any batch and position strides. Host
// tensors: the rows split over the host pool (loom::sdk::parallel_for), one copy per row (a
// memcpy; non-temporal 16-byte stores once a move writes 8 MiB or more and its destination
// rows are 16-byte aligned, see set_streaming_threshold; such a gather of rows that are whole
// cache lines copies 8 rows at a time, a line of each in turn).
// CUDA tensors: one kernel on m.stream (16-byte vector copies when the rows' addresses and
// lengths allow, else the widest unit that divides them), the device made current for the
// call; device indices are not read back (that would synchronise): a row whose index is
// outside [0, seq_len) is skipped, never written out of bounds. Dispatch on m.device; any
// device other than CPU and CUDA is INVALID_ARGUMENT.
void gather(const loom::sdk::RouterMove& m);
void scatter(const loom::sdk::RouterMove& m);

// The bytes a host move writes from which it uses non-temporal stores (x86-64); 0 restores
// the default, 8 MiB. For tests and benchmarks;
// applies to every later call, on every thread.
void set_streaming_threshold(std::size_t bytes);

// Copies `bytes` from src to dst with the core's non-temporal 16-byte stores (dst 16-byte
// aligned; any tail by memcpy), fenced, so the copy is complete when it returns: the copy
// the host moves stream with, for a benchmark's roof. Returns false, copying nothing, on a
// build without those stores (not x86-64).
bool stream_copy_bytes(char* dst, const char* src, std::size_t bytes);

// The `layers` parameter of a router: an INT_LIST of the routed layer indices, strictly
// increasing and >= 0. Empty (the default, also when the parameter is absent): every middle
// layer 1 .. num_layers - 2, so the first and the last layer always see the whole sequence
// (DeepSpeed's recommended setup).
class RoutedLayers {
 public:
  static constexpr const char* kParam = "layers";

  RoutedLayers() = default;
  // Throws INVALID_ARGUMENT (param "layers") for a negative or non-increasing entry.
  explicit RoutedLayers(std::vector<int64_t> layers);

  // The schema entry (with its `loom describe` text).
  static loom::sdk::IntList param();
  // Checks a manifest's (or an instance's) value; for validate_params.
  static void validate(const loom::sdk::Context& params);
  // The parameter's value; absent: the default.
  static RoutedLayers from(const loom::sdk::Context& params);

  // Whether `layer` (0 .. num_layers - 1) is routed in a model of num_layers layers. Throws
  // INVALID_ARGUMENT naming the parameter when an entry is outside the model:
  // "layers[2] = 7 is outside the model's 6 layers (0 .. 5)".
  bool routed(int32_t layer, int32_t num_layers) const;
  // The routed layers of such a model, in increasing order (the same check).
  std::vector<int32_t> of(int32_t num_layers) const;

  bool is_default() const { return layers_.empty(); }
  const std::vector<int64_t>& list() const { return layers_; }

 private:
  void check_model(int32_t num_layers) const;
  std::vector<int64_t> layers_;  // empty: the middle layers
};

// The advance() bookkeeping of a router: the last step accounted and the layer tokens
// consumed so far. advance accounts step last + 1 (the first is step 1) or repeats the last
// one (nothing changes; the outs are the same for the same arguments); any other step is
// FAILED_PRECONDITION (a resumed run imports the exported state first). Not thread-safe:
// advance, export and import are [instance] calls.
class LayerTokenCounter {
 public:
  // The state blob: header "loom.router.layer_tokens" version 1, int64 step, uint64
  // consumed (framed and checksummed by the SDK).
  static constexpr const char* kMagic = "loom.router.layer_tokens";
  static constexpr uint32_t kVersion = 1;

  // Sum over layers 0 .. num_layers - 1 of batch * kept(layer); OUT_OF_RANGE when it does
  // not fit int64.
  template <class KeptFn>
  static int64_t layer_tokens(int64_t batch, int32_t num_layers, KeptFn&& kept) {
    int64_t total = 0;
    for (int32_t l = 0; l < num_layers; ++l) {
      const int64_t k = kept(l);
      int64_t t = 0;
      if (__builtin_mul_overflow(batch, k, &t) || __builtin_add_overflow(total, t, &total)) {
        overflow(batch, num_layers);
      }
    }
    return total;
  }

  // Accounts a.step with `layer_tokens` (this step's, from layer_tokens()), and fills
  // a.layer_tokens and a.consumed_layer_tokens.
  void advance(loom_router_advance_args& a, int64_t layer_tokens);

  int64_t step() const { return step_; }
  uint64_t consumed() const { return consumed_; }

  void export_state(loom::sdk::StateWriter& out) const;
  // DATA_LOSS for a truncated or extended blob, INVALID_ARGUMENT for another plugin's or a
  // newer version's; nothing changes then.
  void import_state(std::span<const std::byte> blob);

 private:
  [[noreturn]] static void overflow(int64_t batch, int32_t num_layers);
  int64_t step_ = 0;  // 0: nothing accounted yet
  uint64_t consumed_ = 0;
};

}  // namespace loom::routers
