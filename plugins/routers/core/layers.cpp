// RoutedLayers (the `layers` parameter) and LayerTokenCounter (advance's bookkeeping).
#include <loom/sdk/status.hpp>

#include <string>
#include <utility>

#include <loom/routers/router_core.hpp>

namespace loom::routers {
namespace {

// The last step a counter may hold: advance compares the next step with step + 1.
constexpr int64_t kMaxStep = INT64_MAX - 1;

[[noreturn]] void fail_layers(const std::string& message) {
  throw loom::sdk::Error(LOOM_ERR_INVALID_ARGUMENT, message, RoutedLayers::kParam);
}

std::string entry(std::size_t i, int64_t v) {
  return std::string(RoutedLayers::kParam) + "[" + std::to_string(i) + "] = " + std::to_string(v);
}

}  // namespace

RoutedLayers::RoutedLayers(std::vector<int64_t> layers) : layers_(std::move(layers)) {
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    if (layers_[i] < 0) fail_layers(entry(i, layers_[i]) + " is negative; layers count from 0");
    if (layers_[i] > INT32_MAX) fail_layers(entry(i, layers_[i]) + " is above 2^31 - 1");
    if (i > 0 && layers_[i] <= layers_[i - 1]) {
      fail_layers(entry(i, layers_[i]) + " is not above " + entry(i - 1, layers_[i - 1]) +
                  "; the list must be strictly increasing");
    }
  }
}

loom::sdk::IntList RoutedLayers::param() {
  return loom::sdk::IntList(kParam, {},
                            "The routed layers: indices from 0, strictly increasing; the other "
                            "layers see every token. Empty (the default): every middle layer "
                            "1 .. num_layers - 2, so the first and last layers see the whole "
                            "sequence. An index outside the model is an error when the model "
                            "is known (at the first plan).")
      .int_min(0);
}

void RoutedLayers::validate(const loom::sdk::Context& params) { (void)from(params); }

RoutedLayers RoutedLayers::from(const loom::sdk::Context& params) {
  if (!params.has(kParam)) return RoutedLayers();
  return RoutedLayers(params.get_int_list(kParam));
}

void RoutedLayers::check_model(int32_t num_layers) const {
  if (num_layers < 1) {
    fail_layers("the model has " + std::to_string(num_layers) + " layers; it needs at least 1");
  }
  if (!layers_.empty() && layers_.back() >= num_layers) {
    // The first entry outside the model (the list is increasing).
    std::size_t i = 0;
    while (layers_[i] < num_layers) ++i;
    fail_layers(entry(i, layers_[i]) + " is outside the model's " + std::to_string(num_layers) +
                " layers (0 .. " + std::to_string(num_layers - 1) + ")");
  }
}

bool RoutedLayers::routed(int32_t layer, int32_t num_layers) const {
  check_model(num_layers);
  if (layer < 0 || layer >= num_layers) {
    throw loom::sdk::Error(LOOM_ERR_INVALID_ARGUMENT,
                           "layer " + std::to_string(layer) + " is outside the model's " +
                               std::to_string(num_layers) + " layers (0 .. " +
                               std::to_string(num_layers - 1) + ")");
  }
  if (layers_.empty()) return layer >= 1 && layer <= num_layers - 2;
  for (const int64_t l : layers_) {
    if (l == layer) return true;
    if (l > layer) break;
  }
  return false;
}

std::vector<int32_t> RoutedLayers::of(int32_t num_layers) const {
  check_model(num_layers);
  std::vector<int32_t> out;
  if (layers_.empty()) {
    for (int32_t l = 1; l + 1 < num_layers; ++l) out.push_back(l);
  } else {
    for (const int64_t l : layers_) out.push_back(static_cast<int32_t>(l));
  }
  return out;
}

void LayerTokenCounter::overflow(int64_t batch, int32_t num_layers) {
  throw loom::sdk::Error(LOOM_ERR_OUT_OF_RANGE,
                         "router advance: the layer tokens of one step (batch " +
                             std::to_string(batch) + " over " + std::to_string(num_layers) +
                             " layers) do not fit a 64-bit count");
}

void LayerTokenCounter::advance(loom_router_advance_args& a, int64_t layer_tokens) {
  if (a.step == step_ && step_ >= 1) {
    // The last step again: nothing changes.
    a.layer_tokens = layer_tokens;
    a.consumed_layer_tokens = consumed_;
    return;
  }
  // step_ < INT64_MAX always (import and the check below keep it so): step_ + 1 fits.
  if (a.step != step_ + 1) {
    throw loom::sdk::Error(
        LOOM_ERR_FAILED_PRECONDITION,
        "router advance: step " + std::to_string(a.step) + " does not follow the last step " +
            "accounted (" +
            (step_ == 0 ? std::string("none yet, so the next is 1") : std::to_string(step_)) +
            "); the schedule advances one step at a time, repeating the last one at most (a "
            "resumed run imports the router's state first)");
  }
  if (a.step == kMaxStep + 1) {
    throw loom::sdk::Error(LOOM_ERR_OUT_OF_RANGE,
                           "router advance: step " + std::to_string(a.step) +
                               " is the largest int64, so no step could follow it; the last "
                               "step a router accounts is " +
                               std::to_string(kMaxStep));
  }
  if (layer_tokens < 0) {
    throw loom::sdk::Error(LOOM_ERR_INTERNAL,
                           "router advance: negative layer tokens " + std::to_string(layer_tokens));
  }
  uint64_t consumed = 0;
  if (__builtin_add_overflow(consumed_, static_cast<uint64_t>(layer_tokens), &consumed)) {
    throw loom::sdk::Error(LOOM_ERR_OUT_OF_RANGE,
                           "router advance: the consumed layer tokens overflow a 64-bit count");
  }
  step_ = a.step;
  consumed_ = consumed;
  a.layer_tokens = layer_tokens;
  a.consumed_layer_tokens = consumed_;
}

void LayerTokenCounter::export_state(loom::sdk::StateWriter& out) const {
  out.write_header(kMagic, kVersion);
  out.write_pod<int64_t>(step_);
  out.write_pod<uint64_t>(consumed_);
}

void LayerTokenCounter::import_state(std::span<const std::byte> blob) {
  loom::sdk::StateReader in(blob);
  in.read_header(kMagic, kVersion);
  const auto step = in.read_pod<int64_t>();
  const auto consumed = in.read_pod<uint64_t>();
  in.expect_end();
  if (step < 0 || step > kMaxStep) {
    throw loom::sdk::Error(LOOM_ERR_DATA_LOSS, "router state has step " + std::to_string(step) +
                                                   "; it must be in 0 .. " +
                                                   std::to_string(kMaxStep) +
                                                   " (the next advance accounts step + 1)");
  }
  if (step == 0 && consumed != 0) {
    throw loom::sdk::Error(LOOM_ERR_DATA_LOSS, "router state has consumed layer tokens " +
                                                   std::to_string(consumed) +
                                                   " before any step was accounted");
  }
  step_ = step;
  consumed_ = consumed;
}

}  // namespace loom::routers
