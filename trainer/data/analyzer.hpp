// `loom data analyze`: runs curriculum metrics (kind loom.curriculum, role METRIC) over a
// dataset and writes their index files (<loom/data/metric_index.hpp>) and a summary.
//
// Samples (docs/data.md, "The data analyzer"): with sample length L, sample i is the L
// input tokens [i*L, (i+1)*L) of the train split (its label is token (i+1)*L), for i in
// [0, N), N = floor((T - 1) / L), T = train tokens.
//
// Map and reduce: pass 1 (only when a metric has stats_count > 0) counts each chunk of
// samples into per-thread int64 buffers, summed over the threads and then the ranks; pass 2
// scores the chunks on every thread. Ranks each take a contiguous shard of the samples; rank
// 0 gathers the scores through the manifest's comm instance, sorts them on every core and
// writes the files. Tokens are read in place from the mapped dataset, a chunk at a time.
//
// Memory: 8 bytes per sample per metric for the scores (on every rank, since the gather is an
// allgather), plus 32 bytes per sample on rank 0 while one metric's sorted list is built and
// written, plus per thread one chunk's offsets (8 bytes per sample of a chunk) and each
// counting metric's stats (8 bytes per counter). The dataset's pages are the OS's to keep or
// drop.
#pragma once

#include <loom/embed.h>
#include <loom/kinds/curriculum.h>

#include <cstdint>
#include <functional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace loom::trainer::analyze {

// Every error of the analyzer: a message that names the file or option and the problem.
class AnalyzeError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Options {
  std::string manifest;
  std::string dataset;
  std::string output;  // an existing folder
  int64_t seq_len = 0;
  std::vector<std::string> metrics;  // empty: every metric instance of the manifest
  std::string comm;                  // empty: "world" when the manifest has one
  std::string plugin_path;           // extra plugin folders, ':'-separated
  unsigned threads = 0;              // 0: loom_thread_count()
  uint64_t chunk_samples = 0;        // 0: default_chunk_samples(seq_len)
  bool progress = true;              // rank 0's progress lines on stderr
};

// One metric instance of the session and what its plan said.
struct Metric {
  loom_instance* instance = nullptr;
  void* object = nullptr;
  const loom_curriculum_v1* table = nullptr;
  std::string name;         // the [curriculum.NAME] of the manifest
  std::string plugin;       // its plugin's name
  uint32_t vocab_size = 0;  // the dataset's, as planned
  uint64_t stats_count = 0;
  std::vector<int64_t> stats;  // pass 1's counts (stats_count of them)
};

// Samples per chunk by default: about 1 Mi tokens (2 MiB), so a call's fixed cost is
// amortised (vocabulary_rarity builds its table of -log p on every score call) while the
// chunk still stays in a core's cache for every metric that reads it.
uint64_t default_chunk_samples(uint64_t seq_len);

// The samples of the train split for sample length L: N = floor((T - 1) / L).
uint64_t sample_count(uint64_t train_tokens, uint64_t seq_len);

// The metric instances named in `names` (empty: every metric of the session), planned for
// vocabulary `vocab_size`. Throws AnalyzeError naming `manifest` and the instance.
std::vector<Metric> find_metrics(loom_session* session, const std::string& manifest,
                                 const std::vector<std::string>& names, uint32_t vocab_size);

// How the passes run: threads, samples per chunk, and a progress callback the calling
// thread runs about every 100 ms with the samples done so far.
struct PassOptions {
  unsigned threads = 1;
  uint64_t chunk_samples = 1;
  std::function<void(uint64_t)> progress;
};

// Pass 1 over samples [first, last): adds their counts into each counting metric's `stats`
// (sized and zeroed by the caller or by this call when empty).
void count_pass(std::vector<Metric>& metrics, std::span<const uint16_t> train, uint64_t seq_len,
                uint64_t first, uint64_t last, const PassOptions& options);

// Pass 2 over samples [first, last): out[m][i - first] is metric m's score of sample i.
// Counting metrics are passed their `stats`.
std::vector<std::vector<double>> score_pass(const std::vector<Metric>& metrics,
                                            std::span<const uint16_t> train, uint64_t seq_len,
                                            uint64_t first, uint64_t last,
                                            const PassOptions& options);

// The whole command. Returns the exit code (0); throws AnalyzeError (or DataError,
// IndexError) on a bad input.
int run(const Options& options);

// The text `loom data analyze --help` shows below the options (the memory bound).
extern const char* const kHelpFooter;

}  // namespace loom::trainer::analyze
