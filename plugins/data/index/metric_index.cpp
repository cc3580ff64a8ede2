#include <common/fnv1a.hpp>
#include <loom/data/metric_index.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <thread>
#include <utility>

namespace loom::data {

static_assert(std::endian::native == std::endian::little,
              "the index files are little-endian and mapped in place");

namespace {

// Bounds that keep every size computation far from overflow (2^48 samples is 4 PiB of
// sorted entries, far beyond any dataset this format is for).
constexpr uint64_t kMaxSamples = 1ull << 48;

template <class T>
T get(const unsigned char* p, size_t off) {
  T v;
  std::memcpy(&v, p + off, sizeof(T));
  return v;
}
template <class T>
void put(unsigned char* p, size_t off, T v) {
  std::memcpy(p + off, &v, sizeof(T));
}

const char* file_suffix(IndexFile f) {
  switch (f) {
    case IndexFile::sample_to_metric:
      return ".sample_to_metric.idx";
    case IndexFile::sorted:
      return ".sorted.idx";
    case IndexFile::percentiles:
      return ".percentiles.idx";
  }
  return ".unknown.idx";
}

const char* file_type_name(uint32_t t) {
  switch (t) {
    case 1:
      return "sample_to_metric";
    case 2:
      return "sorted";
    case 3:
      return "percentiles";
    default:
      return "unknown";
  }
}

uint32_t entry_bytes_of(IndexFile f) { return f == IndexFile::sorted ? 16u : 8u; }

// Names are what the manifest allows for instance names and plugin names, and must fit the
// header: 1..63 bytes, no NUL, no path separator.
std::string name_problem(const std::string& name) {
  if (name.empty()) return "is empty";
  if (name.size() >= kIndexNameBytes) {
    return "is " + std::to_string(name.size()) + " bytes, at most " +
           std::to_string(kIndexNameBytes - 1) + " fit the index header";
  }
  for (char c : name) {
    if (c == '\0' || c == '/' || c == '\\') return "contains a NUL or a path separator";
  }
  if (name == "." || name == "..") return "is not a file name";
  return {};
}

// One parsed header.
struct Header {
  uint32_t type = 0;
  uint64_t entries = 0;
  IndexInfo info;
};

// A name field: NUL-terminated within its 64 bytes, zero after the terminator.
bool read_name(const unsigned char* h, size_t off, std::string& out) {
  const auto* p = reinterpret_cast<const char*>(h + off);
  const void* nul = std::memchr(p, 0, kIndexNameBytes);
  if (nul == nullptr) return false;
  const size_t n = static_cast<size_t>(static_cast<const char*>(nul) - p);
  for (size_t i = n; i < kIndexNameBytes; ++i) {
    if (p[i] != 0) return false;
  }
  out.assign(p, n);
  return !name_problem(out).size();
}

void build_header(unsigned char* h, IndexFile f, const IndexInfo& info, uint64_t entries,
                  uint64_t payload_checksum) {
  std::memset(h, 0, kIndexHeaderBytes);
  std::memcpy(h, kIndexMagic, 8);
  put<uint32_t>(h, 8, kIndexVersion);
  put<uint32_t>(h, 12, static_cast<uint32_t>(f));
  put<uint32_t>(h, 16, static_cast<uint32_t>(kIndexHeaderBytes));
  put<uint32_t>(h, 20, entry_bytes_of(f));
  put<uint64_t>(h, 24, info.samples);
  put<uint64_t>(h, 32, entries);
  put<uint64_t>(h, 40, info.dataset_checksum);
  put<uint32_t>(h, 48, info.sample_tokens);
  put<uint32_t>(h, 52, info.vocab_size);
  std::memcpy(h + 56, info.metric.data(), info.metric.size());
  std::memcpy(h + 120, info.plugin.data(), info.plugin.size());
  put<uint64_t>(h, 184, payload_checksum);
  put<uint64_t>(h, 248, index_fnv1a64(h, 248));
}

// Validates the header and the size of a mapped file; returns what it says.
Header parse_header(const std::string& path, const unsigned char* h, size_t size, IndexFile want) {
  if (size < kIndexHeaderBytes) {
    throw IndexError(path + ": truncated index file: " + std::to_string(size) +
                     " bytes, the header alone is " + std::to_string(kIndexHeaderBytes));
  }
  if (std::memcmp(h, kIndexMagic, 8) != 0) {
    throw IndexError(path + ": not a Loom index file (bad magic; expected \"LOOMINDX\")");
  }
  const uint32_t version = get<uint32_t>(h, 8);
  if (version != kIndexVersion) {
    throw IndexError(path + ": index format version " + std::to_string(version) +
                     " is not supported (this reader knows version " +
                     std::to_string(kIndexVersion) + "; rerun `loom data analyze`)");
  }
  if (get<uint64_t>(h, 248) != index_fnv1a64(h, 248)) {
    throw IndexError(path + ": corrupted index header (header checksum mismatch)");
  }
  Header out;
  out.type = get<uint32_t>(h, 12);
  if (out.type != static_cast<uint32_t>(want)) {
    throw IndexError(path + ": is a " + file_type_name(out.type) + " index file (type " +
                     std::to_string(out.type) + "), expected a " +
                     file_type_name(static_cast<uint32_t>(want)) + " file");
  }
  if (get<uint32_t>(h, 16) != kIndexHeaderBytes) {
    throw IndexError(path + ": corrupted index header (header size " +
                     std::to_string(get<uint32_t>(h, 16)) + ", expected 256)");
  }
  if (get<uint32_t>(h, 20) != entry_bytes_of(want)) {
    throw IndexError(path + ": corrupted index header (entry size " +
                     std::to_string(get<uint32_t>(h, 20)) + ", expected " +
                     std::to_string(entry_bytes_of(want)) + ")");
  }
  for (size_t i = 192; i < 248; ++i) {
    if (h[i] != 0) throw IndexError(path + ": corrupted index header (reserved bytes not 0)");
  }
  IndexInfo& info = out.info;
  info.samples = get<uint64_t>(h, 24);
  out.entries = get<uint64_t>(h, 32);
  info.dataset_checksum = get<uint64_t>(h, 40);
  info.sample_tokens = get<uint32_t>(h, 48);
  info.vocab_size = get<uint32_t>(h, 52);
  if (!read_name(h, 56, info.metric)) {
    throw IndexError(path + ": corrupted index header (bad metric name field)");
  }
  if (!read_name(h, 120, info.plugin)) {
    throw IndexError(path + ": corrupted index header (bad plugin name field)");
  }
  if (info.samples == 0 || info.samples > kMaxSamples) {
    throw IndexError(path + ": corrupted index header: " + std::to_string(info.samples) +
                     " samples (expected 1 to 2^48)");
  }
  if (info.sample_tokens == 0 || info.vocab_size == 0) {
    throw IndexError(path + ": corrupted index header: sample length " +
                     std::to_string(info.sample_tokens) + ", vocab size " +
                     std::to_string(info.vocab_size) + " (both must be >= 1)");
  }
  const uint64_t want_entries = want == IndexFile::percentiles ? kPercentiles : info.samples;
  if (out.entries != want_entries) {
    throw IndexError(path + ": the header says " + std::to_string(info.samples) + " samples but " +
                     std::to_string(out.entries) + " entries (expected " +
                     std::to_string(want_entries) + ")");
  }
  const uint64_t expected = kIndexHeaderBytes + out.entries * entry_bytes_of(want);
  if (size < expected) {
    throw IndexError(path + ": truncated index file: " + std::to_string(size) +
                     " bytes, the header says " + std::to_string(expected) + " (" +
                     std::to_string(out.entries) + " entries)");
  }
  if (size > expected) {
    throw IndexError(path + ": index file has " + std::to_string(size - expected) +
                     " trailing bytes after the payload the header describes");
  }
  if (get<uint64_t>(h, 184) != index_fnv1a64(h + kIndexHeaderBytes, expected - kIndexHeaderBytes)) {
    throw IndexError(path + ": corrupted index file: payload checksum mismatch");
  }
  return out;
}

std::string describe(const IndexInfo& i) {
  return std::to_string(i.samples) + " samples of " + std::to_string(i.sample_tokens) +
         " tokens, vocab " + std::to_string(i.vocab_size) + ", dataset checksum " +
         std::to_string(i.dataset_checksum) + ", metric \"" + i.metric + "\" (plugin \"" +
         i.plugin + "\")";
}

bool same_info(const IndexInfo& a, const IndexInfo& b) {
  return a.samples == b.samples && a.dataset_checksum == b.dataset_checksum &&
         a.sample_tokens == b.sample_tokens && a.vocab_size == b.vocab_size &&
         a.metric == b.metric && a.plugin == b.plugin;
}

bool same_bits(double a, double b) {
  return std::bit_cast<uint64_t>(a) == std::bit_cast<uint64_t>(b);
}

// The payload checks shared by the writer and the reader. `values_path` etc. name the files
// in the messages.
void check_values(const std::string& path, std::span<const double> values) {
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) {
      throw IndexError(path + ": the value of sample " + std::to_string(i) + " is not finite (" +
                       std::to_string(values[i]) + ")");
    }
  }
}

void check_sorted(const std::string& path, std::span<const double> values,
                  std::span<const SortedEntry> sorted) {
  if (sorted.size() != values.size()) {
    throw IndexError(path + ": " + std::to_string(sorted.size()) + " sorted entries for " +
                     std::to_string(values.size()) + " samples");
  }
  const uint64_t n = values.size();
  std::vector<bool> seen(n, false);
  for (size_t k = 0; k < sorted.size(); ++k) {
    const SortedEntry& e = sorted[k];
    if (e.sample >= n) {
      throw IndexError(path + ": entry " + std::to_string(k) + " names sample " +
                       std::to_string(e.sample) + ", past the " + std::to_string(n) + " samples");
    }
    if (seen[e.sample]) {
      throw IndexError(path + ": sample " + std::to_string(e.sample) + " appears twice");
    }
    seen[e.sample] = true;
    if (!same_bits(e.value, values[e.sample])) {
      throw IndexError(path + ": entry " + std::to_string(k) + " gives sample " +
                       std::to_string(e.sample) + " the value " + std::to_string(e.value) +
                       ", the sample_to_metric file " + std::to_string(values[e.sample]) +
                       " (files of different runs?)");
    }
    if (k > 0 && !sorted_before(sorted[k - 1], e)) {
      throw IndexError(path + ": entries " + std::to_string(k - 1) + " and " + std::to_string(k) +
                       " are out of order (expected ascending value, ties by sample id)");
    }
  }
}

void check_percentiles(const std::string& path, std::span<const SortedEntry> sorted,
                       std::span<const double> pct) {
  const std::vector<double> want = percentiles_of(sorted);
  for (size_t p = 0; p < kPercentiles; ++p) {
    if (!same_bits(pct[p], want[p])) {
      throw IndexError(path + ": percentile " + std::to_string(p) + " is " +
                       std::to_string(pct[p]) + ", the sorted file gives " +
                       std::to_string(want[p]) + " (files of different runs?)");
    }
  }
}

std::string errno_text() { return std::strerror(errno); }

// Writes all of `bytes` to fd; false on failure (errno set).
bool write_all(int fd, const void* data, size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  while (bytes > 0) {
    const ssize_t w = ::write(fd, p, std::min<size_t>(bytes, size_t{1} << 30));
    if (w < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += w;
    bytes -= static_cast<size_t>(w);
  }
  return true;
}

void write_temp(const std::string& tmp, const unsigned char* header, const void* payload,
                size_t payload_bytes) {
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw IndexError(tmp + ": cannot create the index file: " + errno_text());
  const bool ok = write_all(fd, header, kIndexHeaderBytes) &&
                  write_all(fd, payload, payload_bytes) && ::fsync(fd) == 0;
  const std::string why = ok ? std::string() : errno_text();
  if (::close(fd) != 0 && ok) {
    ::unlink(tmp.c_str());
    throw IndexError(tmp + ": write failed: " + errno_text());
  }
  if (!ok) {
    ::unlink(tmp.c_str());
    throw IndexError(tmp + ": write failed (disk full?): " + why);
  }
}

}  // namespace

uint64_t index_fnv1a64(const void* data, size_t bytes, uint64_t seed) {
  return loom::common::fnv1a64(data, bytes, seed);
}

std::string index_file_path(const std::string& dir, const std::string& metric, IndexFile file) {
  std::string p = dir;
  if (!p.empty() && p.back() != '/') p += '/';
  return p + metric + file_suffix(file);
}

std::vector<SortedEntry> sort_by_value(std::span<const double> values, unsigned threads) {
  const size_t n = values.size();
  std::vector<SortedEntry> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = SortedEntry{values[i], i};
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  // Below a few thousand entries per thread, threads cost more than they save.
  const size_t parts = std::max<size_t>(1, std::min<size_t>(threads, n / 4096));
  std::vector<size_t> bounds(parts + 1);
  for (size_t k = 0; k <= parts; ++k) bounds[k] = n * k / parts;
  auto run = [](size_t jobs, auto&& job) {
    std::vector<std::thread> pool;
    for (size_t j = 1; j < jobs; ++j) pool.emplace_back(job, j);
    if (jobs > 0) job(size_t{0});
    for (auto& t : pool) t.join();
  };
  run(parts, [&](size_t k) {
    std::sort(out.begin() + static_cast<ptrdiff_t>(bounds[k]),
              out.begin() + static_cast<ptrdiff_t>(bounds[k + 1]), sorted_before);
  });
  std::vector<SortedEntry> tmp(parts > 1 ? n : 0);
  while (bounds.size() > 2) {
    const size_t ranges = bounds.size() - 1;
    std::vector<size_t> next;
    for (size_t k = 0; k < ranges; k += 2) next.push_back(bounds[k]);
    next.push_back(n);
    run((ranges + 1) / 2, [&](size_t j) {
      const size_t lo = bounds[2 * j];
      const size_t mid = bounds[std::min(2 * j + 1, ranges)];
      const size_t hi = bounds[std::min(2 * j + 2, ranges)];
      std::merge(
          out.begin() + static_cast<ptrdiff_t>(lo), out.begin() + static_cast<ptrdiff_t>(mid),
          out.begin() + static_cast<ptrdiff_t>(mid), out.begin() + static_cast<ptrdiff_t>(hi),
          tmp.begin() + static_cast<ptrdiff_t>(lo), sorted_before);
    });
    out.swap(tmp);
    bounds.swap(next);
  }
  return out;
}

std::vector<double> percentiles_of(std::span<const SortedEntry> sorted) {
  std::vector<double> out(kPercentiles, 0.0);
  if (sorted.empty()) return out;
  const uint64_t last = sorted.size() - 1;
  for (uint64_t p = 0; p < kPercentiles; ++p) out[p] = sorted[p * last / 100].value;
  return out;
}

void write_metric_index(const std::string& dir, const IndexInfo& info,
                        std::span<const double> sample_to_metric,
                        std::span<const SortedEntry> sorted) {
  const std::string what = dir + " (metric \"" + info.metric + "\")";
  if (std::string p = name_problem(info.metric); !p.empty()) {
    throw IndexError(what + ": the metric name " + p);
  }
  if (std::string p = name_problem(info.plugin); !p.empty()) {
    throw IndexError(what + ": the plugin name \"" + info.plugin + "\" " + p);
  }
  if (info.samples == 0 || info.samples > kMaxSamples || sample_to_metric.size() != info.samples) {
    throw IndexError(what + ": " + std::to_string(sample_to_metric.size()) + " values for " +
                     std::to_string(info.samples) +
                     " samples (expected 1 to 2^48, one value each)");
  }
  if (info.sample_tokens == 0 || info.vocab_size == 0) {
    throw IndexError(what + ": the sample length and vocab size must be >= 1");
  }
  check_values(what, sample_to_metric);
  check_sorted(what, sample_to_metric, sorted);
  const std::vector<double> pct = percentiles_of(sorted);

  struct Out {
    IndexFile file;
    const void* data;
    size_t entries;
  };
  const Out outs[3] = {{IndexFile::sample_to_metric, sample_to_metric.data(), info.samples},
                       {IndexFile::sorted, sorted.data(), info.samples},
                       {IndexFile::percentiles, pct.data(), kPercentiles}};
  std::vector<std::string> temps;
  try {
    for (const Out& o : outs) {
      const std::string path = index_file_path(dir, info.metric, o.file);
      const std::string tmp = path + ".tmp." + std::to_string(::getpid());
      const size_t bytes = o.entries * entry_bytes_of(o.file);
      unsigned char h[kIndexHeaderBytes];
      build_header(h, o.file, info, o.entries, index_fnv1a64(o.data, bytes));
      write_temp(tmp, h, o.data, bytes);
      temps.push_back(tmp);
    }
    for (size_t k = 0; k < 3; ++k) {
      const std::string path = index_file_path(dir, info.metric, outs[k].file);
      if (::rename(temps[k].c_str(), path.c_str()) != 0) {
        throw IndexError(path + ": cannot rename the index file into place: " + errno_text());
      }
      temps[k].clear();
    }
  } catch (...) {
    for (const std::string& t : temps) {
      if (!t.empty()) ::unlink(t.c_str());
    }
    throw;
  }
  // The renames are durable once the folder is.
  const int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    (void)::fsync(dfd);
    ::close(dfd);
  }
}

MetricIndex::MetricIndex(MetricIndex&& other) noexcept { *this = std::move(other); }

MetricIndex& MetricIndex::operator=(MetricIndex&& other) noexcept {
  if (this != &other) {
    release();
    info_ = std::move(other.info_);
    for (int k = 0; k < 3; ++k) maps_[k] = std::exchange(other.maps_[k], Mapping{});
    values_ = std::exchange(other.values_, {});
    sorted_ = std::exchange(other.sorted_, {});
    percentiles_ = std::exchange(other.percentiles_, {});
  }
  return *this;
}

MetricIndex::~MetricIndex() { release(); }

void MetricIndex::release() noexcept {
  for (Mapping& m : maps_) {
    if (m.data != nullptr) ::munmap(m.data, m.bytes);
    m = Mapping{};
  }
}

std::string analyze_hint(const std::string& dir, const std::string& metric) {
  return "loom data analyze MANIFEST --dataset DATASET --seq-len SEQ_LEN --metric " + metric +
         " --output " + dir + " (MANIFEST: one that declares [curriculum." + metric +
         "], such as examples/data_efficiency/analyze.toml for the bundled metrics" +
         std::string(kAnalyzeHintRunValues) + "; docs/data.md)";
}

std::string fill_analyze_hint(std::string message, const std::string& dataset, int64_t seq_len) {
  const std::string placeholders = "--dataset DATASET --seq-len SEQ_LEN";
  const size_t at = message.find(placeholders);
  if (at == std::string::npos) return message;
  message.replace(at, placeholders.size(),
                  "--dataset " + dataset + " --seq-len " + std::to_string(seq_len));
  const size_t clause = message.find(kAnalyzeHintRunValues, at);
  if (clause != std::string::npos) {
    message.erase(clause, std::char_traits<char>::length(kAnalyzeHintRunValues));
  }
  return message;
}

MetricIndex MetricIndex::open(const std::string& dir, const std::string& metric) {
  if (std::string p = name_problem(metric); !p.empty()) {
    throw IndexError(dir + ": the metric name \"" + metric + "\" " + p);
  }
  MetricIndex idx;  // unmaps whatever was mapped if a check throws
  const IndexFile files[3] = {IndexFile::sample_to_metric, IndexFile::sorted,
                              IndexFile::percentiles};
  Header headers[3];
  std::string paths[3];
  for (int k = 0; k < 3; ++k) {
    paths[k] = index_file_path(dir, metric, files[k]);
    const std::string& path = paths[k];
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      throw IndexError(path + ": cannot open the index file: " + errno_text() +
                       "; write it first with: mkdir -p " + dir + " && " +
                       analyze_hint(dir, metric));
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      throw IndexError(path + ": not a regular file");
    }
    const size_t size = static_cast<size_t>(st.st_size);
    const unsigned char* h = nullptr;
    if (size > 0) {
      void* m = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
      if (m == MAP_FAILED) {
        const std::string why = errno_text();
        ::close(fd);
        throw IndexError(path + ": cannot map the index file: " + why);
      }
      idx.maps_[k] = Mapping{m, size};
      h = static_cast<const unsigned char*>(m);
    }
    ::close(fd);
    headers[k] = parse_header(path, h, size, files[k]);
    if (headers[k].info.metric != metric) {
      throw IndexError(path + ": written for metric \"" + headers[k].info.metric + "\", not \"" +
                       metric + "\"");
    }
    if (k > 0 && !same_info(headers[k].info, headers[0].info)) {
      throw IndexError(path + ": does not belong with " + paths[0] + ": it describes " +
                       describe(headers[k].info) + ", the other " + describe(headers[0].info) +
                       " (files of different runs?)");
    }
  }
  idx.info_ = headers[0].info;
  const uint64_t n = idx.info_.samples;
  auto payload = [&](int k) {
    return static_cast<const unsigned char*>(idx.maps_[k].data) + kIndexHeaderBytes;
  };
  idx.values_ = {reinterpret_cast<const double*>(payload(0)), n};
  idx.sorted_ = {reinterpret_cast<const SortedEntry*>(payload(1)), n};
  idx.percentiles_ = {reinterpret_cast<const double*>(payload(2)), kPercentiles};
  check_values(paths[0], idx.values_);
  check_sorted(paths[1], idx.values_, idx.sorted_);
  check_percentiles(paths[2], idx.sorted_, idx.percentiles_);
  return idx;
}

}  // namespace loom::data
