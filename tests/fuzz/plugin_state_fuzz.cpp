// libFuzzer target for the state blobs of the data and routing plugins: the curriculum
// sampler's position (plugins/data/sampler, SamplerCore::import_state) and the token routers'
// layer-token counter (plugins/routers/core, LayerTokenCounter::import_state, which random_ltd
// and topk_router export and import as their whole state). The parsers are called directly
// on the payload (the SDK's frame around it is the optimizer_state target's); an accepted
// state is then used: the sampler plans and draws the next batches for both ranks of a world
// of two, the counter advances.
//
// Input: one byte of mode, then the payload. Bit 0: 0 the sampler, 1 the router counter.
// For the sampler, bit 1 picks clustering single_cluster (else schedule_based over a
// 24-sample index), bit 2 difficulty_type percentile (else value), bit 3 plans before the
// import (else after it, as a resumed run does), bit 4 plans with the sizes the blob
// records (dataset, batch, world; bounded) instead of 24, 6 and 2.
//
// Besides crashes and sanitizer reports, it checks:
//  - a refused blob changes nothing (the export is the same before and after);
//  - drawn ids are samples of the dataset, each rank's share has its size;
//  - a state exported after drawing is accepted by a fresh instance, which exports it again
//    unchanged.
#include <loom/kinds/router.h>
#include <loom/sdk/state.hpp>
#include <loom/sdk/status.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include <loom/data/metric_index.hpp>
#include <loom/data/sampler_core.hpp>
#include <loom/routers/router_core.hpp>
#include "fuzz_common.hpp"

namespace {

namespace sampler = loom::data::sampler;
using loom::routers::LayerTokenCounter;
using loom::sdk::Error;

constexpr const char* kTarget = "plugin_state_fuzz";
constexpr uint64_t kSamples = 24;
constexpr int64_t kBatch = 6;
constexpr int32_t kWorld = 2;
constexpr uint64_t kSeed = 1234;

std::vector<loom::data::SortedEntry>* g_sorted = nullptr;

struct SamplerMode {
  bool single;
  bool percentile;
  bool plan_first;
  // The plan: this target's, or (mode bit 4) the one the blob records, when it is small
  // enough to draw from (a run's plan comes from its config, never from the state).
  uint64_t samples = kSamples;
  int64_t batch = kBatch;
  int32_t world = kWorld;
};

// The plan sizes a sampler state records (after its header and the two mode words).
void plan_of_blob(std::span<const std::byte> blob, SamplerMode& m) {
  constexpr size_t kAt = 8 + 23 + 4 + 4 + 4;  // magic length, "loom.curriculum_sampler", ...
  if (blob.size() < kAt + 20) return;
  uint64_t n = 0, b = 0;
  uint32_t w = 0;
  std::memcpy(&n, blob.data() + kAt, 8);
  std::memcpy(&b, blob.data() + kAt + 8, 8);
  std::memcpy(&w, blob.data() + kAt + 16, 4);
  if (n < 1 || n > 4096 || b < 1 || b > 256 || w < 1 || w > 16 || b < w) return;
  if (!m.single && n != kSamples) return;
  m.samples = n;
  m.batch = static_cast<int64_t>(b);
  m.world = static_cast<int32_t>(w);
}

sampler::SamplerCore make_core(const SamplerMode& m) {
  return sampler::SamplerCore(
      m.single ? std::span<const loom::data::SortedEntry>() : *g_sorted,
      m.percentile ? sampler::DifficultyType::kPercentile : sampler::DifficultyType::kValue,
      m.single ? sampler::Clustering::kSingleCluster : sampler::Clustering::kScheduleBased,
      "fuzz index");
}

double difficulty(const SamplerMode& m, int64_t step) {
  const double d = 0.5 * static_cast<double>(step);
  return m.percentile ? std::min(100.0, 12.0 * d) : d;
}

// Draws `steps` batches after the last one drawn (the last one again first), checking
// the shares. false: the sampler refused (a state that does not fit this run).
bool draw(sampler::SamplerCore& core, const SamplerMode& m, int steps) {
  const auto fn = [&](int64_t s) { return difficulty(m, s); };
  const int64_t last = core.last_step();
  int64_t end = 0;  // exclusive; a position too close to int64's end is not drawn from
  if (__builtin_add_overflow(last, steps + 1, &end)) return true;
  for (int64_t step = last > 0 ? last : 1; step < end; ++step) {
    for (int32_t rank = 0; rank < m.world; ++rank) {
      sampler::SamplerCore::Share share;
      try {
        share = core.next(step, kSeed, rank, m.world, fn);
      } catch (const Error&) {
        return false;
      }
      const auto b = static_cast<uint64_t>(m.batch);
      const auto w = static_cast<uint64_t>(m.world);
      const uint64_t want = sampler::share_begin(b, w, static_cast<uint64_t>(rank) + 1) -
                            sampler::share_begin(b, w, static_cast<uint64_t>(rank));
      if (share.ids.size() != want) {
        loom_fuzz::invariant_failed(kTarget, "share size", std::to_string(share.ids.size()));
      }
      for (const int64_t id : share.ids) {
        if (id < 0 || static_cast<uint64_t>(id) >= m.samples) {
          loom_fuzz::invariant_failed(kTarget, "sample id", std::to_string(id));
        }
      }
    }
  }
  return true;
}

std::optional<std::vector<std::byte>> exported(const sampler::SamplerCore& core) {
  if (!core.planned()) return std::nullopt;
  return core.export_state();
}

void fuzz_sampler(const SamplerMode& m, std::span<const std::byte> blob) {
  sampler::SamplerCore core = make_core(m);
  if (m.plan_first) core.plan(m.samples, m.batch, m.world);
  const auto before = exported(core);
  try {
    core.import_state(blob);
  } catch (const Error&) {
    if (exported(core) != before) {
      loom_fuzz::invariant_failed(kTarget, "a refused sampler import changed the state", "");
    }
    return;
  }
  if (!m.plan_first) {
    try {
      core.plan(m.samples, m.batch, m.world);
    } catch (const Error&) {
      return;  // the state was planned with other sizes
    }
  }
  if (!draw(core, m, 2)) return;
  const std::vector<std::byte> after = core.export_state();
  sampler::SamplerCore fresh = make_core(m);
  try {
    fresh.import_state(after);
    fresh.plan(m.samples, m.batch, m.world);
  } catch (const Error& e) {
    loom_fuzz::invariant_failed(kTarget, "an exported sampler state is refused", e.what());
  }
  if (fresh.export_state() != after) {
    loom_fuzz::invariant_failed(kTarget, "sampler import then export changes the state", "");
  }
}

std::vector<uint8_t> counter_blob(const LayerTokenCounter& c) {
  std::vector<uint8_t> out;
  loom_state_writer w{};
  w.struct_size = LOOM_STATE_WRITER_SIZE;
  w.ctx = &out;
  w.write = [](void* ctx, const void* data, size_t bytes) -> loom_status* {
    const auto* b = static_cast<const uint8_t*>(data);
    static_cast<std::vector<uint8_t>*>(ctx)->insert(static_cast<std::vector<uint8_t>*>(ctx)->end(),
                                                    b, b + bytes);
    return nullptr;
  };
  loom::sdk::StateWriter writer(&w);
  c.export_state(writer);
  return out;
}

void fuzz_counter(std::span<const std::byte> blob) {
  LayerTokenCounter c;
  const std::vector<uint8_t> before = counter_blob(c);
  try {
    c.import_state(blob);
  } catch (const Error&) {
    if (counter_blob(c) != before) {
      loom_fuzz::invariant_failed(kTarget, "a refused counter import changed the state", "");
    }
    return;
  }
  const int64_t last = c.step();
  // A step that does not follow is refused.
  if (last > 1) {
    loom_router_advance_args a{};
    a.struct_size = LOOM_ROUTER_ADVANCE_ARGS_SIZE;
    a.step = 1;
    try {
      c.advance(a, 0);
      loom_fuzz::invariant_failed(kTarget, "a step that does not follow", std::to_string(last));
    } catch (const Error&) {
    }
  }
  int64_t end = 0;  // exclusive; a position too close to int64's end is not advanced
  if (__builtin_add_overflow(last, 3, &end)) end = last;
  for (int64_t step = std::max<int64_t>(last, 1); step < end; ++step) {
    loom_router_advance_args a{};
    a.struct_size = LOOM_ROUTER_ADVANCE_ARGS_SIZE;
    a.step = step;
    a.batch = 4;
    a.seq_len = 16;
    a.num_layers = 3;
    try {
      const int64_t tokens = LayerTokenCounter::layer_tokens(a.batch, a.num_layers,
                                                             [&](int32_t) { return a.seq_len; });
      const uint64_t consumed = c.consumed();
      const bool again = step == c.step();
      c.advance(a, tokens);
      if (a.consumed_layer_tokens !=
          (again ? consumed : consumed + static_cast<uint64_t>(tokens))) {
        loom_fuzz::invariant_failed(kTarget, "consumed layer tokens", std::to_string(step));
      }
    } catch (const Error&) {
      return;  // an overflowing count
    }
  }
  const std::vector<uint8_t> after = counter_blob(c);
  LayerTokenCounter fresh;
  try {
    fresh.import_state(std::as_bytes(std::span<const uint8_t>(after)));
  } catch (const Error& e) {
    loom_fuzz::invariant_failed(kTarget, "an exported counter state is refused", e.what());
  }
  if (counter_blob(fresh) != after) {
    loom_fuzz::invariant_failed(kTarget, "counter import then export changes the state", "");
  }
}

std::vector<loom_fuzz::Seed> seeds() {
  std::vector<loom_fuzz::Seed> out;
  for (uint8_t mode = 0; mode < 16; mode += 2) {
    const SamplerMode m{(mode & 2) != 0, (mode & 4) != 0, (mode & 8) != 0};
    for (const int steps : {1, 3, 9}) {
      sampler::SamplerCore core = make_core(m);
      core.plan(m.samples, m.batch, m.world);
      if (!draw(core, m, steps)) loom_fuzz::invariant_failed(kTarget, "seed draw", "");
      const std::vector<std::byte> blob = core.export_state();
      std::vector<uint8_t> b{mode};
      const auto* p = reinterpret_cast<const uint8_t*>(blob.data());
      b.insert(b.end(), p, p + blob.size());
      out.push_back({"sampler_mode" + std::to_string(mode) + "_steps" + std::to_string(steps), b});
    }
  }
  // States of other plans, for mode bit 4.
  struct Plan {
    uint8_t mode;
    uint64_t n;
    int64_t b;
    int32_t w;
  };
  for (const Plan& p :
       {Plan{16 | 2, 10, 3, 1}, Plan{16 | 2 | 8, 7, 8, 4}, Plan{16 | 4, 24, 5, 5}}) {
    SamplerMode m{(p.mode & 2) != 0, (p.mode & 4) != 0, (p.mode & 8) != 0, p.n, p.b, p.w};
    sampler::SamplerCore core = make_core(m);
    core.plan(m.samples, m.batch, m.world);
    if (!draw(core, m, 5)) loom_fuzz::invariant_failed(kTarget, "seed draw", "");
    const std::vector<std::byte> blob = core.export_state();
    std::vector<uint8_t> b{p.mode};
    const auto* bytes = reinterpret_cast<const uint8_t*>(blob.data());
    b.insert(b.end(), bytes, bytes + blob.size());
    out.push_back({"sampler_mode" + std::to_string(p.mode) + "_plan" + std::to_string(p.n) + "_" +
                       std::to_string(p.b) + "_" + std::to_string(p.w),
                   b});
  }
  for (const int steps : {0, 1, 5}) {
    LayerTokenCounter c;
    for (int64_t s = 1; s <= steps; ++s) {
      loom_router_advance_args a{};
      a.struct_size = LOOM_ROUTER_ADVANCE_ARGS_SIZE;
      a.step = s;
      a.batch = 4;
      a.seq_len = 16;
      a.num_layers = 3;
      c.advance(a, 100 * s);
    }
    std::vector<uint8_t> b{1};
    const std::vector<uint8_t> blob = counter_blob(c);
    b.insert(b.end(), blob.begin(), blob.end());
    out.push_back({"router_steps" + std::to_string(steps), b});
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  std::vector<double> values(kSamples);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<double>((i * 7) % 5);
  g_sorted = new std::vector<loom::data::SortedEntry>(loom::data::sort_by_value(values, 1));
  loom_fuzz::write_seeds_if_asked(seeds());
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const auto blob = std::as_bytes(std::span<const uint8_t>(data + 1, size - 1));
  if ((data[0] & 1) != 0) {
    fuzz_counter(blob);
  } else {
    SamplerMode m{(data[0] & 2) != 0, (data[0] & 4) != 0, (data[0] & 8) != 0};
    if ((data[0] & 16) != 0) plan_of_blob(blob, m);
    fuzz_sampler(m, blob);
  }
  return 0;
}
