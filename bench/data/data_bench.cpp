// loom-bench-data [--dataset FILE | --tokens N] [--seq-len L] [--metrics seqlen,...]
//                 [--save-dataset FILE] [--threads T] [--reps R] [--chunk-samples K] [--plugin-path
//                 DIRS]
//
// The map stage of `loom data analyze` (analyzer.hpp: count_pass and score_pass over every
// sample, on T threads) for each metric plugin, against the page-cache read bandwidth of the
// same mapped tokens measured in the same run (a plain summing loop over the train tokens on
// the same T threads). Repetitions interleave the read loop and the metrics; every figure is
// the best of R. Without --dataset it writes
// a synthetic dataset of N tokens (Zipf-like over a 50257-token vocabulary) to a temporary
// file (kept with --save-dataset). One JSON object per line:
//  {"kind":"read", "threads", "bytes", "seconds", "gb_per_s"}
//  {"kind":"map", "metric", "pass" ("count", "score" or "map" = both), "threads", "samples",
//   "seconds", "samples_per_s", "gb_per_s", "ratio_to_read"}
// ratio_to_read is the pass's token bytes per second over the read bandwidth: 1 means the
// pass runs as fast as the tokens can be read.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <loom_cli_support.hpp>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "analyzer.hpp"
#include "bench_support.hpp"
#include "dataset.hpp"

namespace {

namespace fs = std::filesystem;
namespace az = loom::trainer::analyze;
using loom::bench::Clock;
using loom::bench::since;

std::atomic<uint64_t> g_sink{0};

// Reads the tokens on `threads` threads, each over its contiguous share, as 8-byte words
// summed into eight independent accumulators (the loop vectorises and is bound by the
// reads alone): the bandwidth ceiling of anything that reads every token once. Each thread
// times itself from the moment all are ready; the time is the first start to the last end,
// so thread start-up is not part of it.
double read_seconds(std::span<const uint16_t> tokens, unsigned threads) {
  const size_t words = tokens.size() * sizeof(uint16_t) / sizeof(uint64_t);
  const auto* base = reinterpret_cast<const unsigned char*>(tokens.data());
  std::barrier start(static_cast<std::ptrdiff_t>(threads));
  std::vector<Clock::time_point> begin(threads), end(threads);
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      const size_t lo = words * t / threads, hi = words * (t + 1) / threads;
      start.arrive_and_wait();
      begin[t] = Clock::now();
      uint64_t s[8] = {};
      size_t i = lo;
      for (; i + 8 <= hi; i += 8) {
        for (int k = 0; k < 8; ++k) {
          uint64_t w;
          std::memcpy(&w, base + (i + k) * sizeof(uint64_t), sizeof w);
          s[k] += w;
        }
      }
      for (; i < hi; ++i) {
        uint64_t w;
        std::memcpy(&w, base + i * sizeof(uint64_t), sizeof w);
        s[0] += w;
      }
      uint64_t total = 0;
      for (uint64_t v : s) total += v;
      g_sink.fetch_add(total, std::memory_order_relaxed);
      end[t] = Clock::now();
    });
  }
  for (auto& p : pool) p.join();
  return std::chrono::duration<double>(*std::max_element(end.begin(), end.end()) -
                                       *std::min_element(begin.begin(), begin.end()))
      .count();
}

std::string synthesize(uint64_t tokens, std::string path) {
  if (path.empty())
    path = (fs::temp_directory_path() / ("loom-bench-data-" + std::to_string(::getpid()) + ".bin"))
               .string();
  std::vector<uint16_t> train(tokens);
  std::mt19937_64 rng(1);
  // Zipf-like: token = floor(V^u) - 1 for uniform u, so small ids are far more frequent.
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (auto& t : train) {
    t = static_cast<uint16_t>(std::min(50256.0, std::floor(std::pow(50257.0, u(rng))) - 1.0));
  }
  std::vector<uint16_t> heldout(1024, 0);
  loom::trainer::write_dataset(path, 50257, train, heldout);
  return path;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "The map stage of loom data analyze (count and score passes) against the page-cache "
      "read bandwidth of the same tokens"};
  loom_cli::configure(app, "loom bench data");
  std::string dataset, plugin_path, save, tokens_text = "32M";
  int64_t seq_len = 1024, reps = 5, chunk = 0;
  int threads = 0;
  std::vector<std::string> metrics = {"seqlen", "vocabulary_rarity"};
  app.add_option("--dataset", dataset, "A dataset file (default: a synthetic one, --tokens)")
      ->type_name("FILE");
  app.add_option("--tokens", tokens_text, "Train tokens of the synthetic dataset (K, M, G)")
      ->check(loom_cli::size_validator())
      ->type_name("N");
  app.add_option("--save-dataset", save, "Keep the synthetic dataset in this file")
      ->type_name("FILE");
  app.add_option("--seq-len", seq_len, "Tokens per sample")
      ->check(loom_cli::integer_in(1, int64_t{1} << 30))
      ->type_name("L");
  app.add_option("--metrics", metrics, "Metric plugins to time")->delimiter(',')->type_name("LIST");
  app.add_option("--threads", threads, "Threads (default: the cores of this process)")
      ->check(loom_cli::integer_in(1, 1024))
      ->type_name("T")
      ->default_str("");
  app.add_option("--reps", reps, "Repetitions; the best is reported")
      ->check(loom_cli::integer_in(1, 1000))
      ->type_name("R");
  app.add_option("--chunk-samples", chunk, "Samples per chunk (default: as loom data analyze)")
      ->check(loom_cli::integer_in(1, int64_t{1} << 40))
      ->type_name("K")
      ->default_str("");
  app.add_option("--plugin-path", plugin_path, "Extra plugin folders, ':'-separated")
      ->type_name("DIRS");
  if (const int rc = loom_cli::parse(app, argc, argv, false); rc >= 0) return rc;
  std::string temp;
  try {
    if (dataset.empty()) {
      dataset = synthesize(*loom_cli::parse_size(tokens_text), save);
      if (save.empty()) temp = dataset;
    }
    loom::trainer::Dataset ds(dataset);  // validating it reads every page into the cache
    const auto train = ds.train();
    const uint64_t L = static_cast<uint64_t>(seq_len);
    const uint64_t n = az::sample_count(train.size(), L);
    if (n == 0) throw az::AnalyzeError(dataset + ": --seq-len is too large for the dataset");
    const unsigned t = threads > 0
                           ? static_cast<unsigned>(threads)
                           : static_cast<unsigned>(std::max<size_t>(1, loom_thread_count()));
    const std::span<const uint16_t> mapped = train.first(n * L);
    const double bytes = 2.0 * static_cast<double>(n * L);
    // Every metric's session, opened before any timing.
    struct Timed {
      std::string plugin;
      std::unique_ptr<loom_session, void (*)(loom_session*)> session{nullptr, loom_close};
      std::vector<az::Metric> metric;
      double count = 1e30, score = 1e30, map = 1e30;
    };
    std::vector<Timed> timed(metrics.size());
    for (size_t k = 0; k < metrics.size(); ++k) {
      Timed& tm = timed[k];
      tm.plugin = metrics[k];
      const std::string toml = "[curriculum.m]\nplugin = \"" + tm.plugin + "\"\n";
      loom_open_options opts{};
      opts.struct_size = LOOM_OPEN_OPTIONS_SIZE;
      opts.log_level = -1;
      opts.plugin_path = plugin_path.empty() ? nullptr : plugin_path.c_str();
      loom_session* s = nullptr;
      if (loom_open_string(toml.c_str(), "<bench>", &opts, &s) != LOOM_OK) {
        throw az::AnalyzeError("metric plugin " + tm.plugin + ": " + loom_last_error());
      }
      tm.session.reset(s);
      tm.metric = az::find_metrics(s, "<bench>", {"m"}, ds.vocab_size());
    }
    az::PassOptions po;
    po.threads = t;
    po.chunk_samples = chunk > 0 ? static_cast<uint64_t>(chunk) : az::default_chunk_samples(L);
    // Repetitions interleave the read loop and every metric, so a busy machine slows the
    // ceiling and the passes alike; each figure is the best of its repetitions.
    double best_read = 1e30;
    for (int64_t r = 0; r < reps; ++r) {
      best_read = std::min(best_read, read_seconds(mapped, t));
      for (Timed& tm : timed) {
        tm.metric[0].stats.clear();
        const auto t0 = Clock::now();
        az::count_pass(tm.metric, train, L, 0, n, po);
        const double c = since(t0);
        const auto t1 = Clock::now();
        const auto scores = az::score_pass(tm.metric, train, L, 0, n, po);
        const double sc = since(t1);
        g_sink.fetch_add(static_cast<uint64_t>(scores[0][n / 2]), std::memory_order_relaxed);
        tm.count = std::min(tm.count, c);
        tm.score = std::min(tm.score, sc);
        tm.map = std::min(tm.map, c + sc);
      }
    }
    const double read_gbs = bytes / best_read / 1e9;
    nlohmann::ordered_json jr;
    jr["kind"] = "read";
    jr["threads"] = t;
    jr["bytes"] = bytes;
    jr["seconds"] = best_read;
    jr["gb_per_s"] = read_gbs;
    loom::bench::emit(jr);
    for (const Timed& tm : timed) {
      auto line = [&](const char* pass, double sec) {
        nlohmann::ordered_json j;
        j["kind"] = "map";
        j["metric"] = tm.plugin;
        j["pass"] = pass;
        j["threads"] = t;
        j["chunk_samples"] = po.chunk_samples;
        j["samples"] = n;
        j["seconds"] = sec;
        j["samples_per_s"] = static_cast<double>(n) / sec;
        j["gb_per_s"] = bytes / sec / 1e9;
        j["ratio_to_read"] = (bytes / sec / 1e9) / read_gbs;
        loom::bench::emit(j);
      };
      if (tm.metric[0].stats_count > 0) line("count", tm.count);
      line("score", tm.score);
      line("map", tm.map);
    }
    std::fflush(stdout);
  } catch (const std::exception& e) {
    if (!temp.empty()) fs::remove(temp);
    std::fprintf(stderr, "loom bench data: error: %s\n", e.what());
    return 2;
  }
  if (!temp.empty()) fs::remove(temp);
  return 0;
}
