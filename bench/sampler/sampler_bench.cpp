// loom-bench-sampler [--steps N] [--repeat R]
//
// The curriculum sampler's cost per global batch (its core, as the plugin runs it; one rank,
// since every rank draws the same global batch and takes its slice), for global batches of
// 16 and 512 over datasets of 20k and 10M samples, in three regimes:
//   single_cluster      an epoch-shuffled sampler (one cluster, passes over all N)
//   percentile_ramp     schedule_based, percentile difficulty rising 1 -> 100 over the run
//                       in whole percents (a new cluster every 20 steps of 2000, 100 in the end)
//   value_ramp          schedule_based, value difficulty rising over 1000 distinct values
//                       (a new cluster every other step, 1000 in the end)
// One JSON object per line: {"regime", "n", "global_batch", "steps", "clusters",
// "us_per_batch", "ns_per_sample"}: the mean over a run of N steps (default 2000) from step 1,
// schedule calls included, the best of R runs (default 3; the machine may be shared).
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include <loom_cli_support.hpp>

#include <loom/data/sampler_core.hpp>

#include "bench_support.hpp"

namespace {

using loom::bench::Clock;
using loom::data::SortedEntry;
using loom::data::sampler::Clustering;
using loom::data::sampler::DifficultyType;
using loom::data::sampler::SamplerCore;

// N entries in sorted order: 1000 distinct values in equal runs, ids ascending within a run.
std::vector<SortedEntry> make_universe(uint64_t n) {
  std::vector<SortedEntry> out(n);
  for (uint64_t i = 0; i < n; ++i) out[i] = SortedEntry{static_cast<double>(i * 1000 / n), i};
  return out;
}

nlohmann::json run_once(const std::string& regime, const std::vector<SortedEntry>& universe,
                        uint64_t n, int64_t batch, int64_t steps) {
  const bool single = regime == "single_cluster";
  const bool percentile = regime == "percentile_ramp";
  SamplerCore core(single ? std::span<const SortedEntry>{} : std::span(universe),
                   percentile ? DifficultyType::kPercentile : DifficultyType::kValue,
                   single ? Clustering::kSingleCluster : Clustering::kScheduleBased, "bench");
  core.plan(n, batch, 1);
  const double total = static_cast<double>(steps);
  const SamplerCore::DifficultyFn fn = [&](int64_t s) {
    const double f = static_cast<double>(s) / total;
    // Whole steps of difficulty, as the bundled schedules round (difficulty_step 1).
    return percentile ? std::floor(1.0 + 99.0 * f) : std::floor(999.0 * f);
  };
  uint64_t sink = 0;
  const auto t0 = Clock::now();
  for (int64_t s = 1; s <= steps; ++s) {
    const auto share = core.next(s, 42, 0, 1, fn);
    sink += static_cast<uint64_t>(share.ids[0]);
  }
  const double seconds = loom::bench::since(t0);
  const double us = seconds * 1e6 / total;
  return {{"regime", regime},
          {"n", n},
          {"global_batch", batch},
          {"steps", steps},
          {"clusters", core.position().clusters.size()},
          {"us_per_batch", us},
          {"ns_per_sample", us * 1e3 / static_cast<double>(batch)},
          {"checksum", sink}};
}

nlohmann::json run(const std::string& regime, const std::vector<SortedEntry>& universe, uint64_t n,
                   int64_t batch, int64_t steps, int repeat) {
  nlohmann::json best;
  for (int k = 0; k < repeat; ++k) {
    nlohmann::json one = run_once(regime, universe, n, batch, steps);
    if (best.is_null() || one["us_per_batch"].get<double>() < best["us_per_batch"].get<double>()) {
      best = std::move(one);
    }
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "The curriculum sampler's cost per global batch (single_cluster, percentile_ramp,\n"
      "value_ramp; 20k and 10M samples; batches of 16 and 512), one JSON object per line"};
  loom_cli::configure(app, "loom bench sampler");
  int64_t steps = 2000;
  int repeat = 3;
  app.add_option("--steps", steps, "Steps per run, from step 1")
      ->check(loom_cli::integer_in(1, 100000000))
      ->type_name("N");
  app.add_option("--repeat", repeat, "Runs per case; the best is reported")
      ->check(loom_cli::integer_in(1, 1000))
      ->type_name("R");
  if (const int rc = loom_cli::parse(app, argc, argv, false); rc >= 0) return rc;
  try {
    for (const uint64_t n : {uint64_t{20000}, uint64_t{10000000}}) {
      const std::vector<SortedEntry> universe = make_universe(n);
      for (const int64_t batch : {int64_t{16}, int64_t{512}}) {
        for (const char* regime : {"single_cluster", "percentile_ramp", "value_ramp"}) {
          loom::bench::emit(run(regime, universe, n, batch, steps, repeat));
        }
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "loom-bench-sampler: %s\n", e.what());
    return 1;
  }
  return 0;
}
