// Declared public interface of loom_data_index: bench/, the trainer and tests may include this
// header (as <loom/data/metric_index.hpp>); the core's other headers are private to it.
//
// Index files of the data-efficiency family: what `loom data analyze` writes for each metric
// and what the curriculum sampler reads. Three files per metric, in one folder:
//
//   METRIC.sample_to_metric.idx  N doubles: the metric's value of sample i, by sample id
//   METRIC.sorted.idx            N SortedEntry: (value, sample), ascending value, ties by id
//   METRIC.percentiles.idx       101 doubles: the value at 0, 1, ..., 100 percent
//
// Every file is a 256-byte little-endian header then its payload (docs/data.md, "Index
// files", has the byte-by-byte table):
//   offset  size  field
//        0     8  magic "LOOMINDX"
//        8     4  version (1)
//       12     4  file type (1 sample_to_metric, 2 sorted, 3 percentiles)
//       16     4  header bytes (256)
//       20     4  entry bytes (8, 16, 8)
//       24     8  N: samples of the dataset
//       32     8  entries in the payload (N, N, 101)
//       40     8  the dataset file's payload checksum (its header offset 40)
//       48     4  L: tokens per sample
//       52     4  vocab size of the dataset
//       56    64  metric instance name, NUL-padded (at most 63 bytes)
//      120    64  metric plugin name, NUL-padded (at most 63 bytes)
//      184     8  FNV-1a 64 of the payload
//      192    56  reserved (0)
//      248     8  FNV-1a 64 of header bytes 0..247
//      256        payload
//
// Readers check everything (sizes against N, both checksums, that the three files describe
// the same run, sorted order, finite values, percentiles that match the sorted list) and
// throw IndexError("FILE: what is wrong"); no input bytes make them crash.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace loom::data {

class IndexError : public std::runtime_error {
 public:
  using runtime_error::runtime_error;
};

struct SortedEntry {
  double value;
  uint64_t sample;
};
static_assert(sizeof(SortedEntry) == 16, "SortedEntry is 16 bytes on disk");

struct IndexInfo {
  uint64_t samples = 0;           // N
  uint64_t dataset_checksum = 0;  // the dataset file's payload checksum
  uint32_t sample_tokens = 0;     // L
  uint32_t vocab_size = 0;
  std::string metric;  // the metric's instance name in the analyzer's manifest
  std::string plugin;  // the metric's plugin name
};

// The on-disk constants (the format's version 1).
inline constexpr char kIndexMagic[8] = {'L', 'O', 'O', 'M', 'I', 'N', 'D', 'X'};
inline constexpr uint32_t kIndexVersion = 1;
inline constexpr size_t kIndexHeaderBytes = 256;
inline constexpr size_t kIndexNameBytes = 64;  // names are at most 63 bytes
inline constexpr size_t kPercentiles = 101;

enum class IndexFile : uint32_t { sample_to_metric = 1, sorted = 2, percentiles = 3 };

// The path of one file of metric `metric` in folder `dir`.
std::string index_file_path(const std::string& dir, const std::string& metric, IndexFile file);

// The command that writes metric `metric`'s index into `dir`, for messages. MANIFEST, DATASET
// and SEQ_LEN are placeholders; a caller that knows the run (the trainer) replaces the
// "--dataset DATASET --seq-len SEQ_LEN" part with fill_analyze_hint().
inline constexpr const char* kAnalyzeHintRunValues =
    "; DATASET and SEQ_LEN: the training run's dataset and [train] seq_len";
std::string analyze_hint(const std::string& dir, const std::string& metric);
// `message` with the hint's DATASET and SEQ_LEN replaced by these values.
std::string fill_analyze_hint(std::string message, const std::string& dataset, int64_t seq_len);

// FNV-1a 64, the checksum of the dataset and index files.
uint64_t index_fnv1a64(const void* data, size_t bytes, uint64_t seed = 0xcbf29ce484222325ull);

// Ascending value, ties by sample id: the order of the sorted file.
inline bool sorted_before(const SortedEntry& a, const SortedEntry& b) {
  return a.value < b.value || (a.value == b.value && a.sample < b.sample);
}

// The sorted list of `values` (sample i has values[i]), sorted on `threads` threads (0: the
// machine's cores): one std::sort per thread's range, then pairwise merges.
std::vector<SortedEntry> sort_by_value(std::span<const double> values, unsigned threads = 0);

// The percentile table of a sorted list of N >= 1 entries: entry p is the value of
// sorted[floor(p * (N - 1) / 100)] (so 0 is the minimum, 100 the maximum).
std::vector<double> percentiles_of(std::span<const SortedEntry> sorted);

// Writes the three files of `info.metric` into the existing folder `dir`, each atomically
// (a temporary file in `dir`, fsync, rename, fsync of the folder). `sorted` must be
// sort_by_value(values). Throws IndexError naming the file on a bad input or a failed write.
void write_metric_index(const std::string& dir, const IndexInfo& info,
                        std::span<const double> sample_to_metric,
                        std::span<const SortedEntry> sorted);

// The files of one metric in folder `dir`, memory-mapped and validated on open (magic,
// version, sizes, checksums, that the three files agree, sorted order, N matches).
// Throws IndexError with "FILE: what is wrong".
class MetricIndex {
 public:
  static MetricIndex open(const std::string& dir, const std::string& metric);
  MetricIndex(MetricIndex&& other) noexcept;
  MetricIndex& operator=(MetricIndex&& other) noexcept;
  MetricIndex(const MetricIndex&) = delete;
  MetricIndex& operator=(const MetricIndex&) = delete;
  ~MetricIndex();

  const IndexInfo& info() const { return info_; }
  std::span<const double> sample_to_metric() const { return values_; }  // N, by sample id
  std::span<const SortedEntry> sorted() const { return sorted_; }       // N, ascending value, id
  std::span<const double> percentiles() const { return percentiles_; }  // 101

  struct Mapping {
    void* data = nullptr;
    size_t bytes = 0;
  };

 private:
  MetricIndex() = default;
  void release() noexcept;
  IndexInfo info_;
  Mapping maps_[3];
  std::span<const double> values_;
  std::span<const SortedEntry> sorted_;
  std::span<const double> percentiles_;
};

}  // namespace loom::data
