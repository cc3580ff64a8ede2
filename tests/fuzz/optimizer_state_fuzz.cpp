// libFuzzer target for the optimizers' state import: every optimizer with a state format of
// its own (adam, lamb, onebit_adam (also with shard_state), zero_one_adam, onebit_lamb, and the
// SDK template's sgd),
// compiled into the target and made by plugin_host.hpp through its factory, as a host makes
// it; the 1-bit family over the thread_comm test transport (one rank) and the onebit codec.
// The blob goes through the factory's import_state_with_args (the SDK's frame check, then the
// plugin's parser), and an accepted state through two optimizer steps, so a state that
// parses but does not fit what the step does with it shows up here.
//
// Input: one byte of mode, then the blob. Mode bits 0-2 pick the optimizer (modulo 7);
// bit 3 wraps the blob in a valid SDK frame first (tag, size, CRC32C), so mutations of the
// payload get past the checksum to the plugin's own checks; bit 4 imports into an instance
// that has already stepped (the 1-bit family then imports its compressed allreduce's error
// buffers at once rather than at the next step).
//
// Besides crashes and sanitizer reports, it checks:
//  - a refused blob leaves the instance unchanged (its export is the same before and after);
//  - a state the optimizer accepted and stepped with exports a blob that a fresh instance
//    accepts and exports again unchanged.
#include <loom/kinds/codec.h>
#include <loom/kinds/comm.h>
#include <loom/kinds/optimizer.h>
#include <loom/sdk/state.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "fuzz_common.hpp"
#include "plugin_host.hpp"

extern "C" {
const loom_plugin_v1* loom_fuzz_entry_adam(void) noexcept;
const loom_plugin_v1* loom_fuzz_entry_lamb(void) noexcept;
const loom_plugin_v1* loom_fuzz_entry_onebit_adam(void) noexcept;
const loom_plugin_v1* loom_fuzz_entry_zero_one_adam(void) noexcept;
const loom_plugin_v1* loom_fuzz_entry_onebit_lamb(void) noexcept;
const loom_plugin_v1* loom_fuzz_entry_sgd(void) noexcept;
const loom_plugin_v1* loom_fuzz_entry_thread_comm(void) noexcept;
const loom_plugin_v1* loom_fuzz_entry_onebit_codec(void) noexcept;
}

namespace {

using loom_fuzz::Instance;
using loom_fuzz::Override;

constexpr const char* kTarget = "optimizer_state_fuzz";

struct Optimizer {
  const char* name;
  const loom_plugin_v1* (*entry)() noexcept;
  bool needs_comm;
  std::vector<Override> overrides;
};

std::vector<Optimizer>* g_optimizers = nullptr;
Instance* g_comm = nullptr;
Instance* g_codec = nullptr;

void make_globals() {
  g_comm = new Instance(loom_fuzz_entry_thread_comm(), LOOM_KIND_COMM, "world",
                        {{"world", loom_fuzz::string_value("optimizer_state_fuzz")},
                         {"rank", loom_fuzz::int_value(0)},
                         {"size", loom_fuzz::int_value(1)}});
  g_codec = new Instance(loom_fuzz_entry_onebit_codec(), LOOM_KIND_CODEC, "onebit", {});
  // Small intervals, so that a few steps reach the compressed stages and their state.
  g_optimizers = new std::vector<Optimizer>{
      {"adam", &loom_fuzz_entry_adam, false, {}},
      {"lamb", &loom_fuzz_entry_lamb, false, {}},
      {"onebit_adam",
       &loom_fuzz_entry_onebit_adam,
       true,
       {{"freeze_step", loom_fuzz::int_value(2)}}},
      {"zero_one_adam",
       &loom_fuzz_entry_zero_one_adam,
       true,
       {{"var_freeze_step", loom_fuzz::int_value(4)},
        {"var_update_scaler", loom_fuzz::int_value(1)},
        {"local_step_scaler", loom_fuzz::int_value(2)},
        {"local_step_clipper", loom_fuzz::int_value(2)}}},
      {"onebit_lamb",
       &loom_fuzz_entry_onebit_lamb,
       true,
       {{"freeze_step", loom_fuzz::int_value(2)}}},
      {"sgd", &loom_fuzz_entry_sgd, false, {{"momentum", loom_fuzz::float_value(0.9)}}},
      // Its state format's version 2 (the shard record); one rank, so the slice is all.
      {"onebit_adam_sharded",
       &loom_fuzz_entry_onebit_adam,
       true,
       {{"freeze_step", loom_fuzz::int_value(2)}, {"shard_state", loom_fuzz::bool_value(true)}}},
  };
}

std::unique_ptr<Instance> make(size_t which) {
  const Optimizer& o = (*g_optimizers)[which];
  std::vector<Override> overrides = o.overrides;
  if (o.needs_comm) {
    overrides.push_back({"comm", g_comm->ref()});
    overrides.push_back({"codec", g_codec->ref()});
  }
  return std::make_unique<Instance>(o.entry(), LOOM_KIND_OPTIMIZER, o.name, overrides);
}

// The parameters every step uses: two groups, tensors of 3 and 5 elements, then 4.
struct Model {
  static constexpr size_t kGroups = 2;
  std::vector<std::vector<float>> params{std::vector<float>(3), std::vector<float>(5),
                                         std::vector<float>(4)};
  std::vector<std::vector<float>> grads = params;
  Model() {
    for (size_t t = 0; t < params.size(); ++t) {
      for (size_t i = 0; i < params[t].size(); ++i) {
        params[t][i] = 0.5f - 0.01f * static_cast<float>(i + 7 * t);
      }
    }
  }
};

// One step of `opt`; "" on success, else the error.
std::string step(Instance& opt, Model& m, int64_t t) {
  const size_t n = m.params.size();
  std::vector<int64_t> shapes(n);
  std::vector<DLTensor> tp(n), tg(n);
  std::vector<loom_optimizer_tensor> ts(n);
  for (size_t i = 0; i < n; ++i) {
    for (size_t k = 0; k < m.grads[i].size(); ++k) {
      m.grads[i][k] = 0.1f * std::sin(0.7f * static_cast<float>(k + 3 * i) + static_cast<float>(t));
    }
    shapes[i] = static_cast<int64_t>(m.params[i].size());
    tp[i] = DLTensor{};
    tp[i].data = m.params[i].data();
    tp[i].device = {kDLCPU, 0};
    tp[i].ndim = 1;
    tp[i].dtype = {kDLFloat, 32, 1};
    tp[i].shape = &shapes[i];
    tg[i] = tp[i];
    tg[i].data = m.grads[i].data();
    ts[i] = {LOOM_OPTIMIZER_TENSOR_SIZE, 0, &tp[i], &tg[i], nullptr, nullptr};
  }
  loom_optimizer_group g[Model::kGroups] = {
      {LOOM_OPTIMIZER_GROUP_SIZE, 0, ts.data(), 2, 1.0, NAN, 0, 0},
      {LOOM_OPTIMIZER_GROUP_SIZE, 0, ts.data() + 2, 1, 0.5, 0.01, 0, 0}};
  int32_t found_inf = 0;
  loom_optimizer_step_args a{
      LOOM_OPTIMIZER_STEP_ARGS_SIZE, 0, g, Model::kGroups, 1e-2, 1.0, t, nullptr, &found_inf};
  return loom_fuzz::take(opt.table<loom_optimizer_v1>()->step(opt.object(), &a));
}

std::vector<uint8_t> framed(const uint8_t* payload, size_t size) {
  std::vector<std::byte> blob;
  loom::sdk::state_frame::begin(blob);
  const auto* p = reinterpret_cast<const std::byte*>(payload);
  blob.insert(blob.end(), p, p + size);
  loom::sdk::state_frame::finish(blob);
  const auto* b = reinterpret_cast<const uint8_t*>(blob.data());
  return {b, b + blob.size()};
}

std::vector<loom_fuzz::Seed> seeds() {
  std::vector<loom_fuzz::Seed> out;
  for (size_t o = 0; o < g_optimizers->size(); ++o) {
    const std::string name = (*g_optimizers)[o].name;
    for (const int steps : {0, 1, 3, 6}) {
      auto opt = make(o);
      Model m;
      for (int t = 1; t <= steps; ++t) {
        const std::string e = step(*opt, m, t);
        if (!e.empty()) Instance::fail("seed step", e.c_str());
      }
      const std::vector<uint8_t> blob = opt->export_state();
      const std::string base = name + "_after_" + std::to_string(steps);
      std::vector<uint8_t> raw{static_cast<uint8_t>(o)};
      raw.insert(raw.end(), blob.begin(), blob.end());
      out.push_back({base + "_framed", raw});
      // The payload alone, for mode bit 3 (the target frames it).
      const size_t head = loom::sdk::state_frame::kHeaderBytes;
      std::vector<uint8_t> payload{static_cast<uint8_t>(o | 8)};
      payload.insert(
          payload.end(), blob.begin() + static_cast<std::ptrdiff_t>(head),
          blob.end() - static_cast<std::ptrdiff_t>(loom::sdk::state_frame::kTrailerBytes));
      out.push_back({base + "_payload", payload});
      if (steps == 3) {
        payload[0] = static_cast<uint8_t>(o | 8 | 16);
        out.push_back({base + "_payload_warm", payload});
      }
    }
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  make_globals();
  loom_fuzz::write_seeds_if_asked(seeds());
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const size_t which = (data[0] & 7u) % g_optimizers->size();
  const bool frame = (data[0] & 8u) != 0;
  const bool warm = (data[0] & 16u) != 0;
  const std::vector<uint8_t> blob =
      frame ? framed(data + 1, size - 1) : std::vector<uint8_t>(data + 1, data + size);

  auto opt = make(which);
  Model m;
  int64_t t = 1;
  if (warm && !step(*opt, m, t++).empty()) Instance::fail("warm-up step", "");
  const std::vector<uint8_t> before = opt->export_state();
  const std::string error = opt->import_state(blob.data(), blob.size());
  if (!error.empty()) {
    if (opt->export_state() != before) {
      loom_fuzz::invariant_failed(kTarget, "a refused import changed the state", error);
    }
    return 0;
  }
  for (int k = 0; k < 2; ++k) {
    // A state of another layout is refused by the step; that ends the run.
    if (!step(*opt, m, t++).empty()) return 0;
  }
  const std::vector<uint8_t> after = opt->export_state();
  auto fresh = make(which);
  const std::string e = fresh->import_state(after.data(), after.size());
  if (!e.empty()) {
    loom_fuzz::invariant_failed(kTarget, "an exported state is refused", e);
  }
  if (fresh->export_state() != after) {
    loom_fuzz::invariant_failed(kTarget, "import then export changes the state",
                                (*g_optimizers)[which].name);
  }
  return 0;
}
