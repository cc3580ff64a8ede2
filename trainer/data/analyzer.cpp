#include "analyzer.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include <loom/data/metric_index.hpp>
#include "dataset.hpp"

namespace fs = std::filesystem;

namespace loom::trainer::analyze {

const char* const kHelpFooter =
    "Samples: with L = --seq-len, sample i is the train tokens [i*L, (i+1)*L) (its label is\n"
    "token (i+1)*L), for i < N = floor((train tokens - 1) / L).\n"
    "Memory: 8 bytes per sample per metric (every rank), plus 32 bytes per sample on rank 0\n"
    "while one metric is sorted and written, plus per thread 8 bytes per sample of a chunk\n"
    "and 8 bytes per counter of each counting metric (vocabulary_rarity: 8 * vocab).\n"
    "The dataset is read in place (mapped), a chunk at a time.\n"
    "Writes DIR/METRIC.{sample_to_metric,sorted,percentiles}.idx and DIR/METRIC.summary.json.\n"
    "Under mpirun (or torchrun's variables) each rank scores a shard; the manifest's comm\n"
    "instance (--comm, default \"world\") gathers the scores on rank 0, which writes (only\n"
    "rank 0 needs DIR; every rank needs the manifest and the dataset).";

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string take(loom_status* st) {
  std::string m = st->message != nullptr ? st->message : "failed";
  if (st->destroy != nullptr) st->destroy(st);
  return m;
}

std::string what_of(const Metric& m) {
  return "metric \"" + m.name + "\" (plugin " + m.plugin + ")";
}

DLTensor tensor_1d(const void* data, int64_t* shape, uint8_t code, uint8_t bits) {
  DLTensor t{};
  t.data = const_cast<void*>(data);
  t.device = {kDLCPU, 0};
  t.ndim = 1;
  t.dtype = {code, bits, 1};
  t.shape = shape;
  return t;
}

// Runs job(thread, chunk) for every chunk on `threads` threads (chunks taken in order from a
// shared counter), the calling thread reporting progress meanwhile. The first exception a
// job throws stops the others and is rethrown here.
template <class Job>
void run_chunks(unsigned threads, uint64_t chunks, const Job& job,
                const std::function<void(uint64_t)>& done_chunks) {
  std::atomic<uint64_t> next{0}, done{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex mu;
  std::condition_variable cv;
  unsigned running = threads;
  auto worker = [&](unsigned t) {
    try {
      for (;;) {
        if (failed.load(std::memory_order_relaxed)) break;
        const uint64_t c = next.fetch_add(1);
        if (c >= chunks) break;
        job(t, c);
        done.fetch_add(1, std::memory_order_relaxed);
      }
    } catch (...) {
      std::lock_guard<std::mutex> g(mu);
      if (!error) error = std::current_exception();
      failed = true;
    }
    std::lock_guard<std::mutex> g(mu);
    if (--running == 0) cv.notify_all();
  };
  std::vector<std::thread> pool;
  pool.reserve(threads);
  for (unsigned t = 0; t < threads; ++t) pool.emplace_back(worker, t);
  {
    std::unique_lock<std::mutex> g(mu);
    while (running > 0) {
      cv.wait_for(g, std::chrono::milliseconds(100));
      if (done_chunks && running > 0) {
        g.unlock();
        done_chunks(done.load());
        g.lock();
      }
    }
  }
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

// A progress line on stderr for rank 0: on a terminal rewritten at most 4 times a second,
// elsewhere only the final line.
class ProgressLine {
 public:
  ProgressLine(bool enabled, std::string what, uint64_t total, double bytes_per_sample)
      : enabled_(enabled),
        tty_(enabled && ::isatty(2) == 1),
        what_(std::move(what)),
        total_(total),
        bytes_per_sample_(bytes_per_sample),
        start_(Clock::now()),
        last_(start_) {}
  void update(uint64_t done) {
    if (!tty_) return;
    const auto now = Clock::now();
    if (std::chrono::duration<double>(now - last_).count() < 0.25) return;
    last_ = now;
    const double s = std::chrono::duration<double>(now - start_).count();
    const double rate = s > 0 ? static_cast<double>(done) / s : 0;
    const double eta = rate > 0 ? static_cast<double>(total_ - std::min(done, total_)) / rate : 0;
    std::fprintf(stderr,
                 "\rloom data analyze: %s: %llu/%llu samples (%.0f%%), %.3g samples/s, %.3g "
                 "MB/s, ETA %.0fs   ",
                 what_.c_str(), static_cast<unsigned long long>(done),
                 static_cast<unsigned long long>(total_),
                 total_ > 0 ? 100.0 * static_cast<double>(done) / static_cast<double>(total_) : 100,
                 rate, rate * bytes_per_sample_ / 1e6, eta);
    std::fflush(stderr);
    shown_ = true;
  }
  // The final line, whatever the output is; returns the seconds since the start.
  double finish(uint64_t done) {
    const double s = since(start_);
    if (!enabled_) return s;
    const double rate = s > 0 ? static_cast<double>(done) / s : 0;
    std::fprintf(stderr,
                 "%sloom data analyze: %s: %llu samples in %.3gs, %.3g samples/s, %.3g MB/s\n",
                 shown_ ? "\r" : "", what_.c_str(), static_cast<unsigned long long>(done), s, rate,
                 rate * bytes_per_sample_ / 1e6);
    return s;
  }

 private:
  bool enabled_, tty_;
  std::string what_;
  uint64_t total_;
  double bytes_per_sample_;
  Clock::time_point start_, last_;
  bool shown_ = false;
};

// The manifest's comm instance (or a world of one).
struct Comm {
  void* obj = nullptr;
  const loom_comm_v1* vt = nullptr;
  std::string name;
  int rank = 0;
  int size = 1;

  void allgather(const void* send, size_t bytes, void* recv, const char* what) const {
    if (size == 1) {
      std::memcpy(recv, send, bytes);
      return;
    }
    int64_t s1[1] = {static_cast<int64_t>(bytes)};
    int64_t s2[1] = {static_cast<int64_t>(bytes * static_cast<size_t>(size))};
    DLTensor a = tensor_1d(send, s1, kDLUInt, 8);
    DLTensor b = tensor_1d(recv, s2, kDLUInt, 8);
    loom_allgather_args args{LOOM_ALLGATHER_ARGS_SIZE, 0, &a, &b, nullptr};
    if (loom_status* st = vt->allgather(obj, &args)) {
      throw AnalyzeError("comm \"" + name + "\": allgather of the " + what +
                         " failed: " + take(st));
    }
  }
  // Collective: every rank says whether its part of a step succeeded, so that no rank waits
  // forever in the next collective for one that failed. Throws on every rank when one failed.
  void agree(const std::string& error) const {
    if (size == 1) {
      if (!error.empty()) throw AnalyzeError(error);
      return;
    }
    const int32_t mine = error.empty() ? 0 : 1;
    std::vector<int32_t> all(static_cast<size_t>(size));
    allgather(&mine, sizeof(mine), all.data(), "status");
    if (!error.empty()) throw AnalyzeError(error);
    for (int r = 0; r < size; ++r) {
      if (all[static_cast<size_t>(r)] != 0) {
        throw AnalyzeError("rank " + std::to_string(r) +
                           " failed (its message is above); this rank stops too");
      }
    }
  }
};

// Runs `step` and agrees on its outcome over the ranks.
template <class F>
void agreed(const Comm& comm, F&& step) {
  std::string error;
  try {
    step();
  } catch (const std::exception& e) {
    error = e.what();
  }
  comm.agree(error);
}

uint64_t read_dataset_checksum(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  unsigned char b[8] = {};
  f.seekg(40);
  f.read(reinterpret_cast<char*>(b), 8);
  if (!f) throw AnalyzeError(path + ": cannot read the dataset's payload checksum");
  uint64_t v = 0;
  std::memcpy(&v, b, 8);
  return v;
}

int env_world_size() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "WORLD_SIZE"}) {
    if (const char* e = std::getenv(v)) {
      const int n = std::atoi(e);
      if (n > 0) return n;
    }
  }
  return 1;
}

struct SessionCloser {
  void operator()(loom_session* s) const { loom_close(s); }
};

std::string num(double v) {
  char b[32];
  std::snprintf(b, sizeof(b), "%.10g", v);
  return b;
}

std::string hex64(uint64_t v) {
  char b[24];
  std::snprintf(b, sizeof(b), "%016llx", static_cast<unsigned long long>(v));
  return b;
}

void write_text_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    throw AnalyzeError(tmp + ": cannot create the summary file: " + std::strerror(errno));
  }
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t w = ::write(fd, text.data() + done, text.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const std::string why = std::strerror(errno);
      ::close(fd);
      ::unlink(tmp.c_str());
      throw AnalyzeError(tmp + ": write failed: " + why);
    }
    done += static_cast<size_t>(w);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    const std::string why = std::strerror(errno);
    ::unlink(tmp.c_str());
    throw AnalyzeError(tmp + ": cannot flush the summary to disk: " + why);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    ::unlink(tmp.c_str());
    throw AnalyzeError(path + ": cannot rename the summary into place: " + why);
  }
  // The rename itself is durable once the folder is flushed.
  const std::string dir = fs::path(path).parent_path().string();
  const int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    const int rc = ::fsync(dfd);
    const int err = errno;
    ::close(dfd);
    if (rc != 0) {
      throw AnalyzeError(dir + ": cannot flush the folder to disk: " + std::strerror(err));
    }
  }
}

}  // namespace

uint64_t default_chunk_samples(uint64_t seq_len) {
  return std::max<uint64_t>(1, (uint64_t{1} << 20) / std::max<uint64_t>(1, seq_len));
}

uint64_t sample_count(uint64_t train_tokens, uint64_t seq_len) {
  if (seq_len == 0 || train_tokens < 1) return 0;
  return (train_tokens - 1) / seq_len;
}

std::vector<Metric> find_metrics(loom_session* session, const std::string& manifest,
                                 const std::vector<std::string>& names, uint32_t vocab_size) {
  // Every curriculum instance with its plan, so messages can list the metrics there are.
  struct Candidate {
    Metric m;
    uint32_t roles = 0;
  };
  std::vector<Candidate> all;
  const size_t count = loom_instance_count(session);
  for (size_t i = 0; i < count; ++i) {
    loom_instance* inst = loom_instance_at(session, i);
    if (inst == nullptr || std::strcmp(loom_instance_kind(inst), LOOM_KIND_CURRICULUM) != 0) {
      continue;
    }
    Candidate c;
    c.m.instance = inst;
    c.m.name = loom_instance_name(inst);
    c.m.plugin = loom_instance_plugin(inst);
    void* obj = nullptr;
    const void* table = nullptr;
    if (loom_instance_table(inst, LOOM_KIND_CURRICULUM, LOOM_CURRICULUM_V1_MIN_SIZE, &obj,
                            &table) != LOOM_OK) {
      throw AnalyzeError(manifest + ": [curriculum." + c.m.name + "]: " + loom_last_error());
    }
    c.m.object = obj;
    c.m.table = static_cast<const loom_curriculum_v1*>(table);
    loom_curriculum_plan_args plan{};
    plan.struct_size = LOOM_CURRICULUM_PLAN_ARGS_SIZE;
    plan.vocab_size = vocab_size;
    if (c.m.table->plan == nullptr) {
      throw AnalyzeError(manifest + ": [curriculum." + c.m.name + "] (plugin " + c.m.plugin +
                         "): the plugin has no plan function");
    }
    if (loom_status* st = c.m.table->plan(obj, &plan)) {
      throw AnalyzeError(manifest + ": [curriculum." + c.m.name + "] (plugin " + c.m.plugin +
                         "): plan failed: " + take(st));
    }
    c.roles = plan.roles;
    c.m.stats_count = plan.stats_count;
    c.m.vocab_size = vocab_size;
    all.push_back(std::move(c));
  }
  auto is_metric = [](const Candidate& c) {
    return (c.roles & LOOM_CURRICULUM_METRIC) != 0 && c.m.table->score != nullptr;
  };
  std::string listing;
  for (const auto& c : all) {
    if (is_metric(c)) listing += (listing.empty() ? "" : ", ") + c.m.name;
  }
  if (listing.empty()) listing = "none";
  std::vector<Metric> out;
  if (names.empty()) {
    for (auto& c : all) {
      if (is_metric(c)) out.push_back(c.m);
    }
    if (out.empty()) {
      throw AnalyzeError(manifest +
                         ": declares no metric: add a [curriculum.NAME] section whose plugin "
                         "scores samples (e.g. plugin = \"seqlen\"), or name one with --metric");
    }
  } else {
    for (const auto& n : names) {
      auto it =
          std::find_if(all.begin(), all.end(), [&](const Candidate& c) { return c.m.name == n; });
      if (it == all.end()) {
        throw AnalyzeError(manifest + ": --metric " + n + ": no [curriculum." + n +
                           "] section in the manifest (its metrics: " + listing + ")");
      }
      if (!is_metric(*it)) {
        throw AnalyzeError(manifest + ": --metric " + n + ": [curriculum." + n + "] (plugin " +
                           it->m.plugin +
                           ") is not a metric: it scores no samples (a schedule?); "
                           "the manifest's metrics: " +
                           listing);
      }
      if (std::any_of(out.begin(), out.end(), [&](const Metric& m) { return m.name == n; })) {
        throw AnalyzeError("--metric " + n + ": given twice");
      }
      out.push_back(it->m);
    }
  }
  for (auto& m : out) {
    if (m.name.size() >= data::kIndexNameBytes || m.plugin.size() >= data::kIndexNameBytes) {
      throw AnalyzeError(manifest + ": [curriculum." + m.name + "]: the instance and plugin " +
                         "names must be at most 63 bytes to fit the index files");
    }
    if (m.stats_count > 0 && m.table->count == nullptr) {
      throw AnalyzeError(manifest + ": " + what_of(m) + " asks for " +
                         std::to_string(m.stats_count) +
                         " counters but has no count function (a plugin bug)");
    }
    if (m.stats_count > (uint64_t{1} << 28)) {
      throw AnalyzeError(manifest + ": " + what_of(m) + " asks for " +
                         std::to_string(m.stats_count) +
                         " counters, more than this analyzer holds per thread (2^28)");
    }
  }
  return out;
}

void count_pass(std::vector<Metric>& metrics, std::span<const uint16_t> train, uint64_t seq_len,
                uint64_t first, uint64_t last, const PassOptions& o) {
  std::vector<Metric*> counting;
  for (auto& m : metrics) {
    if (m.stats_count > 0) {
      if (m.stats.size() != m.stats_count) m.stats.assign(m.stats_count, 0);
      counting.push_back(&m);
    }
  }
  if (counting.empty() || last <= first) return;
  // A chunk never holds more than the shard: the offsets buffer is sized by it.
  const uint64_t k = std::min<uint64_t>(std::max<uint64_t>(1, o.chunk_samples), last - first);
  const uint64_t chunks = (last - first + k - 1) / k;
  const unsigned threads =
      static_cast<unsigned>(std::max<uint64_t>(1, std::min<uint64_t>(o.threads, chunks)));
  // Per thread: its own counters for every counting metric, and a chunk's offsets.
  std::vector<std::vector<std::vector<int64_t>>> local(threads);
  for (auto& l : local) {
    for (Metric* m : counting) l.emplace_back(m->stats_count, 0);
  }
  std::vector<std::vector<int64_t>> offsets(threads, std::vector<int64_t>(k + 1));
  run_chunks(
      threads, chunks,
      [&](unsigned t, uint64_t c) {
        const uint64_t s0 = first + c * k;
        const uint64_t n = std::min(k, last - s0);
        auto& off = offsets[t];
        for (uint64_t i = 0; i <= n; ++i) off[i] = static_cast<int64_t>(i * seq_len);
        int64_t tshape[1] = {static_cast<int64_t>(n * seq_len)};
        int64_t oshape[1] = {static_cast<int64_t>(n + 1)};
        DLTensor tokens = tensor_1d(train.data() + s0 * seq_len, tshape, kDLUInt, 16);
        DLTensor offs = tensor_1d(off.data(), oshape, kDLInt, 64);
        for (size_t j = 0; j < counting.size(); ++j) {
          const Metric& m = *counting[j];
          int64_t sshape[1] = {static_cast<int64_t>(m.stats_count)};
          DLTensor stats = tensor_1d(local[t][j].data(), sshape, kDLInt, 64);
          loom_curriculum_count_args a{};
          a.struct_size = LOOM_CURRICULUM_COUNT_ARGS_SIZE;
          a.samples = {LOOM_CURRICULUM_SAMPLES_SIZE, 0, &tokens, &offs};
          a.vocab_size = m.vocab_size;
          a.stats = &stats;
          if (loom_status* st = m.table->count(m.object, &a)) {
            throw AnalyzeError(what_of(m) + ": count failed on samples " + std::to_string(s0) +
                               ".." + std::to_string(s0 + n - 1) + ": " + take(st));
          }
        }
      },
      [&](uint64_t done) {
        if (o.progress) o.progress(std::min(last - first, done * k));
      });
  // Integer sums: exact, so the order does not matter.
  for (size_t j = 0; j < counting.size(); ++j) {
    auto& total = counting[j]->stats;
    for (const auto& l : local) {
      for (size_t i = 0; i < total.size(); ++i) total[i] += l[j][i];
    }
  }
}

std::vector<std::vector<double>> score_pass(const std::vector<Metric>& metrics,
                                            std::span<const uint16_t> train, uint64_t seq_len,
                                            uint64_t first, uint64_t last, const PassOptions& o) {
  std::vector<std::vector<double>> out(metrics.size());
  for (auto& v : out) v.assign(last > first ? last - first : 0, 0.0);
  if (last <= first || metrics.empty()) return out;
  // A chunk never holds more than the shard: the offsets buffer is sized by it.
  const uint64_t k = std::min<uint64_t>(std::max<uint64_t>(1, o.chunk_samples), last - first);
  const uint64_t chunks = (last - first + k - 1) / k;
  const unsigned threads =
      static_cast<unsigned>(std::max<uint64_t>(1, std::min<uint64_t>(o.threads, chunks)));
  std::vector<std::vector<int64_t>> offsets(threads, std::vector<int64_t>(k + 1));
  run_chunks(
      threads, chunks,
      [&](unsigned t, uint64_t c) {
        const uint64_t s0 = first + c * k;
        const uint64_t n = std::min(k, last - s0);
        auto& off = offsets[t];
        for (uint64_t i = 0; i <= n; ++i) off[i] = static_cast<int64_t>(i * seq_len);
        int64_t tshape[1] = {static_cast<int64_t>(n * seq_len)};
        int64_t oshape[1] = {static_cast<int64_t>(n + 1)};
        int64_t rshape[1] = {static_cast<int64_t>(n)};
        DLTensor tokens = tensor_1d(train.data() + s0 * seq_len, tshape, kDLUInt, 16);
        DLTensor offs = tensor_1d(off.data(), oshape, kDLInt, 64);
        for (size_t j = 0; j < metrics.size(); ++j) {
          const Metric& m = metrics[j];
          int64_t sshape[1] = {static_cast<int64_t>(m.stats_count)};
          DLTensor stats = tensor_1d(m.stats.data(), sshape, kDLInt, 64);
          DLTensor scores = tensor_1d(out[j].data() + (s0 - first), rshape, kDLFloat, 64);
          loom_curriculum_score_args a{};
          a.struct_size = LOOM_CURRICULUM_SCORE_ARGS_SIZE;
          a.samples = {LOOM_CURRICULUM_SAMPLES_SIZE, 0, &tokens, &offs};
          a.vocab_size = m.vocab_size;
          a.stats = m.stats_count > 0 ? &stats : nullptr;
          a.scores = &scores;
          if (loom_status* st = m.table->score(m.object, &a)) {
            throw AnalyzeError(what_of(m) + ": score failed on samples " + std::to_string(s0) +
                               ".." + std::to_string(s0 + n - 1) + ": " + take(st));
          }
        }
      },
      [&](uint64_t done) {
        if (o.progress) o.progress(std::min(last - first, done * k));
      });
  return out;
}

int run(const Options& o) {
  const auto t_start = Clock::now();
  // ---- what can be checked alone, identically on every rank
  if (o.seq_len < 1 || o.seq_len > (int64_t{1} << 30)) {
    throw AnalyzeError("--seq-len " + std::to_string(o.seq_len) + ": must be 1 to 2^30");
  }
  const uint64_t L = static_cast<uint64_t>(o.seq_len);
  if (!fs::exists(o.manifest)) {
    throw AnalyzeError(o.manifest + ": the manifest does not exist");
  }

  // ---- the manifest: metrics and the comm that joins the ranks
  loom_open_options opts{};
  opts.struct_size = LOOM_OPEN_OPTIONS_SIZE;
  opts.log_level = -1;
  opts.plugin_path = o.plugin_path.empty() ? nullptr : o.plugin_path.c_str();
  loom_session* raw = nullptr;
  if (loom_open_file(o.manifest.c_str(), &opts, &raw) != LOOM_OK) {
    throw AnalyzeError(loom_last_error());
  }
  std::unique_ptr<loom_session, SessionCloser> session(raw);
  Comm comm;
  loom_instance* ci = nullptr;
  if (!o.comm.empty()) {
    if (loom_find_instance(raw, "comm", o.comm.c_str(), &ci) != LOOM_OK) {
      throw AnalyzeError(o.manifest + ": --comm " + o.comm + ": no [comm." + o.comm +
                         "] section in the manifest");
    }
  } else if (loom_find_instance(raw, "comm", "world", &ci) != LOOM_OK) {
    ci = nullptr;
  }
  if (ci != nullptr) {
    void* obj = nullptr;
    const void* table = nullptr;
    if (loom_instance_table(ci, LOOM_KIND_COMM, LOOM_COMM_V1_MIN_SIZE, &obj, &table) != LOOM_OK) {
      throw AnalyzeError(o.manifest + ": comm \"" + loom_instance_name(ci) +
                         "\": " + loom_last_error());
    }
    comm.obj = obj;
    comm.vt = static_cast<const loom_comm_v1*>(table);
    comm.name = loom_instance_name(ci);
    comm.rank = comm.vt->rank(obj);
    comm.size = comm.vt->size(obj);
  } else if (const int w = env_world_size(); w > 1) {
    throw AnalyzeError(o.manifest + ": launched as " + std::to_string(w) +
                       " ranks, but the manifest has no comm instance to gather the scores: "
                       "add [comm.world] with plugin = \"ucx\", or name one with --comm");
  }
  const bool root = comm.rank == 0;
  // ---- the inputs each rank reads, checked once the comm is up, so that a rank that fails
  // stops the others at once (instead of leaving them in the comm's bootstrap): every rank
  // reads the dataset; only rank 0 writes, so only its --output must exist.
  std::optional<Dataset> dataset;
  uint64_t N = 0, checksum = 0;
  agreed(comm, [&] {
    if (root) {
      std::error_code ec;
      if (!fs::exists(o.output, ec)) {
        throw AnalyzeError("--output " + o.output +
                           ": the folder does not exist (create it first: mkdir -p " + o.output +
                           ")");
      }
      if (!fs::is_directory(o.output, ec)) {
        throw AnalyzeError("--output " + o.output + ": is not a folder");
      }
    }
    dataset.emplace(o.dataset);
    const uint64_t T = dataset->header().train_tokens;
    N = sample_count(T, L);
    if (N == 0) {
      throw AnalyzeError(o.dataset + ": --seq-len " + std::to_string(L) +
                         " is too large for the dataset: its " + std::to_string(T) +
                         " train tokens hold no sample of " + std::to_string(L + 1) +
                         " tokens (L inputs and a label)" +
                         (T >= 2 ? "; the largest --seq-len is " + std::to_string(T - 1) : ""));
    }
    checksum = read_dataset_checksum(o.dataset);
  });
  const Dataset& ds = *dataset;
  std::vector<Metric> metrics;
  agreed(comm, [&] { metrics = find_metrics(raw, o.manifest, o.metrics, ds.vocab_size()); });

  const uint64_t first = N * static_cast<uint64_t>(comm.rank) / static_cast<uint64_t>(comm.size);
  const uint64_t last = N * static_cast<uint64_t>(comm.rank + 1) / static_cast<uint64_t>(comm.size);
  PassOptions po;
  po.threads =
      o.threads > 0 ? o.threads : static_cast<unsigned>(std::max<size_t>(1, loom_thread_count()));
  po.chunk_samples = o.chunk_samples > 0 ? o.chunk_samples : default_chunk_samples(L);
  const std::span<const uint16_t> train = ds.train();
  const double sample_bytes = 2.0 * static_cast<double>(L);

  // ---- pass 1: counts, summed over threads (in count_pass) and ranks (here)
  double count_seconds = 0;
  const bool counting = std::any_of(metrics.begin(), metrics.end(),
                                    [](const Metric& m) { return m.stats_count > 0; });
  if (counting) {
    ProgressLine p(root && o.progress, "count", last - first, sample_bytes);
    po.progress = [&](uint64_t done) { p.update(done); };
    agreed(comm, [&] { count_pass(metrics, train, L, first, last, po); });
    count_seconds = p.finish(last - first);
    for (auto& m : metrics) {
      if (m.stats_count == 0 || comm.size == 1) continue;
      std::vector<int64_t> all(m.stats_count * static_cast<size_t>(comm.size));
      comm.allgather(m.stats.data(), m.stats_count * sizeof(int64_t), all.data(), "counts");
      for (uint64_t i = 0; i < m.stats_count; ++i) {
        int64_t s = 0;
        for (int r = 0; r < comm.size; ++r) s += all[static_cast<size_t>(r) * m.stats_count + i];
        m.stats[i] = s;
      }
    }
  }

  // ---- pass 2: scores
  std::vector<std::vector<double>> scores;
  double score_seconds = 0;
  {
    ProgressLine p(root && o.progress, "score", last - first, sample_bytes);
    po.progress = [&](uint64_t done) { p.update(done); };
    agreed(comm, [&] {
      scores = score_pass(metrics, train, L, first, last, po);
      for (size_t j = 0; j < metrics.size(); ++j) {
        for (size_t i = 0; i < scores[j].size(); ++i) {
          if (!std::isfinite(scores[j][i])) {
            throw AnalyzeError(what_of(metrics[j]) + " scored sample " + std::to_string(first + i) +
                               " as " + num(scores[j][i]) + ": scores must be finite");
          }
        }
      }
    });
    score_seconds = p.finish(last - first);
  }

  // ---- reduce: rank 0 gathers each metric's scores, sorts and writes
  const auto t_reduce = Clock::now();
  const uint64_t shard_max =
      (N + static_cast<uint64_t>(comm.size) - 1) / static_cast<uint64_t>(comm.size);
  for (size_t j = 0; j < metrics.size(); ++j) {
    std::vector<double> values;
    if (comm.size == 1) {
      values = std::move(scores[j]);
    } else {
      std::vector<double> send(shard_max, 0.0);
      std::copy(scores[j].begin(), scores[j].end(), send.begin());
      std::vector<double>().swap(scores[j]);
      values.resize(shard_max * static_cast<size_t>(comm.size));
      comm.allgather(send.data(), shard_max * sizeof(double), values.data(), "scores");
      // Rank r's shard starts at N*r/size <= r*shard_max: compact in rank order.
      for (int r = 1; r < comm.size; ++r) {
        const uint64_t lo = N * static_cast<uint64_t>(r) / static_cast<uint64_t>(comm.size);
        const uint64_t hi = N * static_cast<uint64_t>(r + 1) / static_cast<uint64_t>(comm.size);
        std::memmove(values.data() + lo, values.data() + static_cast<size_t>(r) * shard_max,
                     (hi - lo) * sizeof(double));
      }
      values.resize(N);
      values.shrink_to_fit();
    }
    agreed(comm, [&] {
      if (!root) return;
      const Metric& m = metrics[j];
      const auto t_sort = Clock::now();
      const std::vector<data::SortedEntry> sorted = data::sort_by_value(values, po.threads);
      const double sort_seconds = since(t_sort);
      data::IndexInfo info;
      info.samples = N;
      info.dataset_checksum = checksum;
      info.sample_tokens = static_cast<uint32_t>(L);
      info.vocab_size = ds.vocab_size();
      info.metric = m.name;
      info.plugin = m.plugin;
      const auto t_write = Clock::now();
      data::write_metric_index(o.output, info, values, sorted);
      const double write_seconds = since(t_write);
      const std::vector<double> pct = data::percentiles_of(sorted);
      double sum = 0;
      for (double v : values) sum += v;
      nlohmann::ordered_json js;
      js["format"] = "loom-data-analysis";
      js["version"] = 1;
      js["metric"] = m.name;
      js["plugin"] = m.plugin;
      js["dataset"] = o.dataset;
      js["dataset_checksum"] = hex64(checksum);
      js["seq_len"] = L;
      js["vocab_size"] = ds.vocab_size();
      js["samples"] = N;
      js["files"] = {
          fs::path(data::index_file_path(o.output, m.name, data::IndexFile::sample_to_metric))
              .filename()
              .string(),
          fs::path(data::index_file_path(o.output, m.name, data::IndexFile::sorted))
              .filename()
              .string(),
          fs::path(data::index_file_path(o.output, m.name, data::IndexFile::percentiles))
              .filename()
              .string()};
      js["min"] = sorted.front().value;
      js["max"] = sorted.back().value;
      js["mean"] = sum / static_cast<double>(N);
      nlohmann::ordered_json p5;
      for (int p = 0; p <= 100; p += 5) p5[std::to_string(p)] = pct[static_cast<size_t>(p)];
      js["percentiles"] = p5;
      auto pass = [&](double s) {
        nlohmann::ordered_json r;
        r["seconds"] = s;
        r["samples_per_s"] = s > 0 ? static_cast<double>(N) / s : 0.0;
        r["mb_per_s"] = s > 0 ? static_cast<double>(N) * sample_bytes / s / 1e6 : 0.0;
        return r;
      };
      nlohmann::ordered_json run;
      run["ranks"] = comm.size;
      run["threads_per_rank"] = po.threads;
      run["chunk_samples"] = po.chunk_samples;
      if (counting) run["count"] = pass(count_seconds);  // the pass of every counting metric
      run["score"] = pass(score_seconds);
      run["sort_seconds"] = sort_seconds;
      run["write_seconds"] = write_seconds;
      run["seconds_so_far"] = since(t_start);
      js["run"] = run;
      write_text_atomically(o.output + "/" + m.name + ".summary.json", js.dump(2) + "\n");
      std::printf(
          "%s: metric %s (plugin %s): %llu samples of %llu tokens; min %s, median %s, "
          "max %s\n",
          data::index_file_path(o.output, m.name, data::IndexFile::sorted).c_str(), m.name.c_str(),
          m.plugin.c_str(), static_cast<unsigned long long>(N), static_cast<unsigned long long>(L),
          num(pct[0]).c_str(), num(pct[50]).c_str(), num(pct[100]).c_str());
    });
  }
  if (root && o.progress) {
    std::fprintf(stderr,
                 "loom data analyze: %zu metric(s), %llu samples, %d rank(s) x %u threads: "
                 "%.3gs in all (reduce and write %.3gs)\n",
                 metrics.size(), static_cast<unsigned long long>(N), comm.size, po.threads,
                 since(t_start), since(t_reduce));
  }
  return 0;
}

}  // namespace loom::trainer::analyze
