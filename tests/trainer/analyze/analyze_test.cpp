// `loom data analyze` end to end, with a raw-C test metric (toy_metric.c):
//  - the index files match a plain reference computed here (scores, sorted order with ties
//    by sample id, percentiles) and the summary's percentiles agree;
//  - threads and chunk sizes do not change a byte of the files;
//  - 2 ranks under mpirun (ucx) write files byte-identical to 1 rank;
//  - every bad input gets a clear error naming the file or option.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <loom/data/metric_index.hpp>
#include "analyzer.hpp"
#include "dataset.hpp"
#include "free_port.hpp"

namespace fs = std::filesystem;
using loom::data::IndexFile;
using loom::data::MetricIndex;

namespace {

struct Result {
  int code = -1;
  std::string out;  // stdout and stderr
};

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

constexpr uint32_t kVocab = 300;
constexpr uint64_t kTrain = 20001;
constexpr uint64_t kL = 16;

class Analyze : public ::testing::Test {
 protected:
  static fs::path dir_;
  static std::vector<uint16_t> train_;

  static void SetUpTestSuite() {
    ::setenv("LOOM_LOG_LEVEL", "", 1);
    ::setenv("UCX_LOG_LEVEL", "error", 1);
    ::setenv("OMPI_MCA_rmaps_base_oversubscribe", "1", 1);
    ::setenv("LOOM_BOOTSTRAP_TIMEOUT", "30", 1);
    dir_ = fs::temp_directory_path() / ("loom-analyze-test-" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    // Skewed tokens, so token counts differ and many samples tie.
    std::mt19937 rng(11);
    train_.resize(kTrain);
    for (auto& t : train_) {
      const auto a = static_cast<uint32_t>(rng() % kVocab),
                 b = static_cast<uint32_t>(rng() % kVocab);
      t = static_cast<uint16_t>(std::min(a, b) % 40);
    }
    std::vector<uint16_t> heldout(100, 1);
    loom::trainer::write_dataset((dir_ / "data.bin").string(), kVocab, train_, heldout);
    const std::string toy = "plugin = \"toy_metric\"\n";
    std::ofstream(dir_ / "toy.toml") << "[curriculum.tsum]\n"
                                     << toy << "mode = \"sum\"\n"
                                     << "[curriculum.tfreq]\n"
                                     << toy << "mode = \"freq\"\n"
                                     << "[curriculum.sched]\n"
                                     << toy << "mode = \"schedule\"\n";
    std::ofstream(dir_ / "toy_mpi.toml") << "[comm.world]\nplugin = \"ucx\"\n"
                                         << "[curriculum.tsum]\n"
                                         << toy << "mode = \"sum\"\n"
                                         << "[curriculum.tfreq]\n"
                                         << toy << "mode = \"freq\"\n";
    std::ofstream(dir_ / "bundled.toml") << "[curriculum.len]\nplugin = \"seqlen\"\npad_token = 3\n"
                                         << "[curriculum.voc]\nplugin = \"vocabulary_rarity\"\n";
    std::ofstream(dir_ / "none.toml") << "[curriculum.sched]\n" << toy << "mode = \"schedule\"\n";
    std::ofstream(dir_ / "bad.toml") << "[curriculum.n]\n"
                                     << toy << "mode = \"nan\"\n"
                                     << "[curriculum.f]\n"
                                     << toy << "mode = \"fail\"\n";
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  static Result sh(const std::string& cmd) {
    const fs::path log = dir_ / ("log-" + std::to_string(::getpid()) + ".txt");
    const int st = std::system((cmd + " > " + log.string() + " 2>&1").c_str());
    Result r;
    r.code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    r.out = slurp(log);
    return r;
  }
  // Runs the analyzer into folder `out` (created) with `args` after the required options.
  static Result analyze(const std::string& manifest, const std::string& out,
                        const std::string& args = "", int ranks = 1, uint64_t seq_len = kL) {
    fs::create_directories(dir_ / out);
    std::string cmd = std::string(LOOM_DATA_EXE) + " analyze " + (dir_ / manifest).string() +
                      " --dataset " + (dir_ / "data.bin").string() + " --seq-len " +
                      std::to_string(seq_len) + " --output " + (dir_ / out).string() +
                      " --plugin-path " + LOOM_TEST_PLUGIN_DIR + " " + args;
    if (ranks > 1) {
      cmd = std::string(LOOM_MPIRUN) + " --oversubscribe --allow-run-as-root -np " +
            std::to_string(ranks) + " " + cmd;
    }
    return sh(cmd);
  }
  static std::string file(const std::string& out, const std::string& metric, IndexFile f) {
    return slurp(loom::data::index_file_path((dir_ / out).string(), metric, f));
  }
  static void expect_same_files(const std::string& a, const std::string& b,
                                const std::vector<std::string>& metrics) {
    for (const auto& m : metrics) {
      for (IndexFile f : {IndexFile::sample_to_metric, IndexFile::sorted, IndexFile::percentiles}) {
        const std::string x = file(a, m, f), y = file(b, m, f);
        EXPECT_FALSE(x.empty()) << a << " " << m;
        EXPECT_TRUE(x == y) << a << " vs " << b << ": metric " << m << " file "
                            << static_cast<int>(f) << " differs";
      }
    }
  }
  static void expect_error(const Result& r, const std::vector<std::string>& parts) {
    EXPECT_EQ(r.code, 2) << r.out;
    for (const auto& p : parts) EXPECT_NE(r.out.find(p), std::string::npos) << p << "\n" << r.out;
    EXPECT_EQ(r.out.find("Segmentation"), std::string::npos) << r.out;
  }
};
fs::path Analyze::dir_;
std::vector<uint16_t> Analyze::train_;

TEST_F(Analyze, MatchesReference) {
  const Result r = analyze("toy.toml", "ref", "--threads 3 --chunk-samples 7");
  ASSERT_EQ(r.code, 0) << r.out;
  const uint64_t n = (kTrain - 1) / kL;
  // Reference scores: toy "sum" and "freq" over the samples' input tokens [i*L, (i+1)*L).
  std::vector<int64_t> counts(kVocab, 0);
  for (uint64_t i = 0; i < n * kL; ++i) counts[train_[i]] += 1;
  std::vector<double> sum(n), freq(n);
  for (uint64_t s = 0; s < n; ++s) {
    int64_t a = 0, b = 0;
    for (uint64_t i = s * kL; i < (s + 1) * kL; ++i) {
      a += train_[i];
      b += counts[train_[i]];
    }
    sum[s] = static_cast<double>(a);
    freq[s] = static_cast<double>(b) / static_cast<double>(kL);
  }
  const std::vector<std::pair<std::string, std::vector<double>>> cases = {{"tsum", sum},
                                                                          {"tfreq", freq}};
  for (const auto& c : cases) {
    const std::string& name = c.first;
    const std::vector<double>& ref = c.second;
    SCOPED_TRACE(name);
    const MetricIndex idx = MetricIndex::open((dir_ / "ref").string(), name);
    EXPECT_EQ(idx.info().samples, n);
    EXPECT_EQ(idx.info().sample_tokens, kL);
    EXPECT_EQ(idx.info().vocab_size, kVocab);
    EXPECT_EQ(idx.info().plugin, "toy_metric");
    ASSERT_EQ(idx.sample_to_metric().size(), n);
    for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(idx.sample_to_metric()[i], ref[i]) << i;
    std::vector<uint64_t> order(n);
    for (uint64_t i = 0; i < n; ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(),
                     [&](uint64_t a, uint64_t b) { return ref[a] < ref[b]; });
    size_t ties = 0;
    for (uint64_t k = 0; k < n; ++k) {
      ASSERT_EQ(idx.sorted()[k].sample, order[k]) << k;
      ASSERT_EQ(idx.sorted()[k].value, ref[order[k]]) << k;
      if (k > 0 && ref[order[k]] == ref[order[k - 1]]) ++ties;
    }
    EXPECT_GT(ties, 10u);  // the tie rule was exercised
    for (uint64_t p = 0; p <= 100; ++p) {
      EXPECT_EQ(idx.percentiles()[p], ref[order[p * (n - 1) / 100]]) << p;
    }
    const auto js = nlohmann::json::parse(slurp(dir_ / "ref" / (name + ".summary.json")));
    EXPECT_EQ(js["samples"], n);
    EXPECT_EQ(js["metric"], name);
    EXPECT_EQ(js["run"]["threads_per_rank"], 3);
    EXPECT_EQ(js["percentiles"].size(), 21u);
    for (int p = 0; p <= 100; p += 5) {
      EXPECT_EQ(js["percentiles"][std::to_string(p)].get<double>(),
                idx.percentiles()[static_cast<size_t>(p)]);
    }
    EXPECT_EQ(js["min"].get<double>(), ref[order.front()]);
    EXPECT_EQ(js["max"].get<double>(), ref[order.back()]);
  }
  // The schedule instance was not analyzed.
  EXPECT_FALSE(fs::exists(dir_ / "ref" / "sched.sorted.idx"));
  // Not a terminal: only the final lines, no carriage returns.
  EXPECT_EQ(r.out.find('\r'), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("samples/s"), std::string::npos) << r.out;
}

// The bundled metrics: seqlen (tokens that are not pad_token) and vocabulary_rarity (sum of
// -log p(t), p from the counts of every scored token, a count of 0 taken as 1), each token's
// value as round(-log p * 2^32) and a sample's score their int64 sum times 2^-32, as
// docs/data.md defines them.
TEST_F(Analyze, BundledMetricsMatchReference) {
  if (!LOOM_HAVE_BUNDLED_METRICS) GTEST_SKIP() << "seqlen / vocabulary_rarity are not built";
  const Result r = analyze("bundled.toml", "bundled", "--threads 2 --chunk-samples 9");
  ASSERT_EQ(r.code, 0) << r.out;
  const uint64_t n = (kTrain - 1) / kL;
  std::vector<int64_t> counts(kVocab, 0);
  for (uint64_t i = 0; i < n * kL; ++i) counts[train_[i]] += 1;
  int64_t total = 0;
  for (int64_t c : counts) total += std::max<int64_t>(c, 1);
  std::vector<int64_t> table(kVocab);
  for (uint32_t t = 0; t < kVocab; ++t) {
    table[t] = std::llround(-std::log(static_cast<double>(std::max<int64_t>(counts[t], 1)) /
                                      static_cast<double>(total)) *
                            0x1p32);
  }
  const MetricIndex len = MetricIndex::open((dir_ / "bundled").string(), "len");
  const MetricIndex voc = MetricIndex::open((dir_ / "bundled").string(), "voc");
  EXPECT_EQ(len.info().plugin, "seqlen");
  EXPECT_EQ(voc.info().plugin, "vocabulary_rarity");
  size_t padded = 0;
  for (uint64_t s = 0; s < n; ++s) {
    int64_t rarity = 0;
    int64_t kept = 0;
    for (uint64_t i = s * kL; i < (s + 1) * kL; ++i) {
      rarity += table[train_[i]];
      kept += train_[i] != 3 ? 1 : 0;
    }
    padded += kept < static_cast<int64_t>(kL) ? 1 : 0;
    ASSERT_EQ(len.sample_to_metric()[s], static_cast<double>(kept)) << s;
    ASSERT_EQ(voc.sample_to_metric()[s], static_cast<double>(rarity) * 0x1p-32) << s;
  }
  EXPECT_GT(padded, 10u);  // pad_token mattered
  // Sorted: ascending, ties by id (seqlen has few distinct values: many ties).
  for (uint64_t k = 1; k < n; ++k) {
    const auto& a = len.sorted()[k - 1];
    const auto& b = len.sorted()[k];
    ASSERT_TRUE(a.value < b.value || (a.value == b.value && a.sample < b.sample)) << k;
  }
}

TEST_F(Analyze, ThreadsAndChunksChangeNothing) {
  ASSERT_EQ(analyze("toy.toml", "t1", "--threads 1 --chunk-samples 1000000").code, 0);
  ASSERT_EQ(analyze("toy.toml", "t4", "--threads 4 --chunk-samples 3").code, 0);
  expect_same_files("t1", "t4", {"tsum", "tfreq"});
  // --metric picks one; the other is not written.
  const Result r = analyze("toy.toml", "one", "--metric tfreq");
  ASSERT_EQ(r.code, 0) << r.out;
  expect_same_files("t1", "one", {"tfreq"});
  EXPECT_FALSE(fs::exists(dir_ / "one" / "tsum.sorted.idx"));
}

// A chunk size far above the shard is clamped to it: the passes hold one chunk's offsets
// per thread, so 2^40 samples per chunk must not allocate 2^40 offsets (it threw bad_alloc).
namespace {
loom_status* sum_score(void*, const loom_curriculum_score_args* a) {
  const auto* tok = static_cast<const uint16_t*>(a->samples.tokens->data);
  const auto* off = static_cast<const int64_t*>(a->samples.offsets->data);
  auto* out = static_cast<double*>(a->scores->data);
  for (int64_t s = 0; s + 1 < a->samples.offsets->shape[0]; ++s) {
    double v = 0;
    for (int64_t i = off[s]; i < off[s + 1]; ++i) v += tok[i];
    out[s] = v;
  }
  return nullptr;
}
loom_status* one_count(void*, const loom_curriculum_count_args* a) {
  auto* stats = static_cast<int64_t*>(a->stats->data);
  stats[0] += a->samples.offsets->shape[0] - 1;  // samples seen
  return nullptr;
}
}  // namespace

TEST_F(Analyze, HugeChunkIsClampedToTheShard) {
  namespace an = loom::trainer::analyze;
  loom_curriculum_v1 table{};
  table.struct_size = LOOM_CURRICULUM_V1_SIZE;
  table.score = sum_score;
  table.count = one_count;
  an::Metric m;
  m.name = "fake";
  m.plugin = "fake";
  m.table = &table;
  m.stats_count = 1;
  std::vector<an::Metric> metrics{m};
  an::PassOptions o;
  o.threads = 4;
  o.chunk_samples = uint64_t{1} << 40;
  const uint64_t n = (kTrain - 1) / kL;
  an::count_pass(metrics, train_, kL, 10, n, o);
  EXPECT_EQ(metrics[0].stats[0], static_cast<int64_t>(n - 10));
  const auto scores = an::score_pass(metrics, train_, kL, 10, n, o);
  ASSERT_EQ(scores.size(), 1u);
  ASSERT_EQ(scores[0].size(), n - 10);
  for (uint64_t s = 10; s < n; ++s) {
    double v = 0;
    for (uint64_t i = s * kL; i < (s + 1) * kL; ++i) v += train_[i];
    ASSERT_EQ(scores[0][s - 10], v) << s;
  }
  // The command line's bound: 2^24 samples per chunk works, above it is a usage error.
  ASSERT_EQ(analyze("toy.toml", "c0").code, 0);
  const Result big = analyze("toy.toml", "cbig", "--chunk-samples 16777216");
  ASSERT_EQ(big.code, 0) << big.out;
  expect_same_files("c0", "cbig", {"tsum", "tfreq"});
  const Result over = analyze("toy.toml", "cover", "--chunk-samples 16777217");
  EXPECT_EQ(over.code, 2) << over.out;
  EXPECT_NE(over.out.find("--chunk-samples"), std::string::npos) << over.out;
  EXPECT_TRUE(fs::is_empty(dir_ / "cover"));
}

TEST_F(Analyze, TwoRanksMatchOne) {
  if (std::string(LOOM_MPIRUN).empty()) GTEST_SKIP() << "mpirun not found";
  if (!LOOM_HAVE_UCX) GTEST_SKIP() << "the ucx plugin is not built";
  const Result one = analyze("toy_mpi.toml", "r1", "--threads 2 --chunk-samples 5");
  ASSERT_EQ(one.code, 0) << one.out;
  const Result two = analyze("toy_mpi.toml", "r2", "--threads 1 --chunk-samples 5", 2);
  ASSERT_EQ(two.code, 0) << two.out;
  expect_same_files("r1", "r2", {"tsum", "tfreq"});
  const auto js = nlohmann::json::parse(slurp(dir_ / "r2" / "tfreq.summary.json"));
  EXPECT_EQ(js["run"]["ranks"], 2);
  // The same files as the single-process run without a comm instance.
  ASSERT_EQ(analyze("toy.toml", "r0").code, 0);
  expect_same_files("r0", "r2", {"tsum", "tfreq"});
  // Several ranks and no comm instance: refused, not written N times over.
  expect_error(analyze("toy.toml", "r3", "", 2), {"launched as 2 ranks", "[comm.world]"});
}

// Two ranks started as torchrun starts them (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT), not by mpirun: the same files.
TEST_F(Analyze, TorchrunVariablesMatchOne) {
  if (!LOOM_HAVE_UCX) GTEST_SKIP() << "the ucx plugin is not built";
  ASSERT_EQ(analyze("toy_mpi.toml", "e1").code, 0);
  fs::create_directories(dir_ / "e2");
  const int port = loom_test_common::free_port();
  ASSERT_GT(port, 0);
  const std::string cmd =
      std::string(LOOM_DATA_EXE) + " analyze " + (dir_ / "toy_mpi.toml").string() + " --dataset " +
      (dir_ / "data.bin").string() + " --seq-len 16 --output " + (dir_ / "e2").string() +
      " --plugin-path " + LOOM_TEST_PLUGIN_DIR + " --threads 1";
  const Result r =
      sh("(pids=; for r in 0 1; do RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 "
         "LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
         std::to_string(port) + " " + cmd +
         " & pids=\"$pids $!\"; done; rc=0; for p in $pids; do wait $p || rc=$?; "
         "done; exit $rc)");
  ASSERT_EQ(r.code, 0) << r.out;
  expect_same_files("e1", "e2", {"tsum", "tfreq"});
}

// Only rank 0 writes, so only its --output must exist; a rank that fails a check (here rank
// 1, whose dataset is missing) stops both at once with exit status 2, not after the comm's
// bootstrap timeout (30 s here).
TEST_F(Analyze, OneRankFailingStopsBothPromptly) {
  if (!LOOM_HAVE_UCX) GTEST_SKIP() << "the ucx plugin is not built";
  // Two ranks started with torchrun's variables, each with its own command-line tail (as
  // when the ranks run on machines of their own); out: both logs, then "codes RC0 RC1".
  auto two_ranks = [&](const std::string& manifest, const std::string& rank0,
                       const std::string& rank1, double* seconds) {
    const int port = loom_test_common::free_port();
    const std::string cmd = std::string(LOOM_DATA_EXE) + " analyze " + manifest +
                            " --seq-len 16 --threads 1 --plugin-path " + LOOM_TEST_PLUGIN_DIR;
    std::string script = "pids=; ";
    for (int r = 0; r < 2; ++r) {
      script += "RANK=" + std::to_string(r) + " LOCAL_RANK=" + std::to_string(r) +
                " WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                std::to_string(port) + " " + cmd + " " + (r == 0 ? rank0 : rank1) + " > " +
                (dir_ / ("rank" + std::to_string(r) + ".log")).string() +
                " 2>&1 & pids=\"$pids $!\"; ";
    }
    script += "set -- $pids; wait $1; a=$?; wait $2; b=$?; cat " + (dir_ / "rank0.log").string() +
              " " + (dir_ / "rank1.log").string() + "; echo \"codes $a $b\"";
    const auto t0 = std::chrono::steady_clock::now();
    Result r = sh("(" + script + ")");
    *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return r;
  };
  const std::string man = (dir_ / "toy_mpi.toml").string();
  const std::string data = " --dataset " + (dir_ / "data.bin").string();
  ASSERT_EQ(analyze("toy_mpi.toml", "p1").code, 0);
  fs::create_directories(dir_ / "p2");
  double s = 0;
  Result r = two_ranks(man, data + " --output " + (dir_ / "p2").string(),
                       data + " --output " + (dir_ / "not-on-rank-1").string(), &s);
  EXPECT_NE(r.out.find("codes 0 0"), std::string::npos) << r.out;
  expect_same_files("p1", "p2", {"tsum", "tfreq"});
  EXPECT_FALSE(fs::exists(dir_ / "not-on-rank-1"));
  // Rank 1 lacks the dataset.
  fs::create_directories(dir_ / "p3");
  r = two_ranks(
      man, data + " --output " + (dir_ / "p3").string(),
      " --dataset " + (dir_ / "missing.bin").string() + " --output " + (dir_ / "p3").string(), &s);
  EXPECT_NE(r.out.find("codes 2 2"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("missing.bin"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rank 1 failed"), std::string::npos) << r.out;
  EXPECT_LT(s, 20.0) << r.out;
  EXPECT_TRUE(fs::is_empty(dir_ / "p3"));
  // Rank 0's --output is missing: rank 0 says so, both stop.
  r = two_ranks(man, data + " --output " + (dir_ / "nope0").string(),
                data + " --output " + (dir_ / "p3").string(), &s);
  EXPECT_NE(r.out.find("codes 2 2"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("nope0: the folder does not exist"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rank 0 failed"), std::string::npos) << r.out;
  EXPECT_LT(s, 20.0) << r.out;
}

// loom bench data runs the same passes and reports them against the read bandwidth.
TEST_F(Analyze, BenchmarkReportsRatios) {
  if (std::string(LOOM_BENCH_DATA_EXE).empty()) GTEST_SKIP() << "loom-bench-data is not built";
  const Result r =
      sh(std::string(LOOM_BENCH_DATA_EXE) + " --dataset " + (dir_ / "data.bin").string() +
         " --seq-len 16 --reps 2 --threads 2 --metrics toy_metric --plugin-path " +
         LOOM_TEST_PLUGIN_DIR);
  ASSERT_EQ(r.code, 0) << r.out;
  std::istringstream lines(r.out);
  std::string line;
  int reads = 0, maps = 0;
  while (std::getline(lines, line)) {
    const auto j = nlohmann::json::parse(line);
    EXPECT_EQ(j["threads"], 2);
    if (j["kind"] == "read") {
      ++reads;
      EXPECT_GT(j["gb_per_s"].get<double>(), 0.0);
    } else {
      ++maps;
      EXPECT_EQ(j["metric"], "toy_metric");
      EXPECT_EQ(j["samples"], (kTrain - 1) / kL);
      EXPECT_GT(j["ratio_to_read"].get<double>(), 0.0);
    }
  }
  EXPECT_EQ(reads, 1);
  EXPECT_EQ(maps, 2);  // score and map (the sum mode counts nothing)
  const Result bad = sh(std::string(LOOM_BENCH_DATA_EXE) + " --dataset " +
                        (dir_ / "data.bin").string() + " --metrics nosuch --reps 1");
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_NE(bad.out.find("nosuch"), std::string::npos) << bad.out;
}

TEST_F(Analyze, BadInputs) {
  const std::string data = (dir_ / "data.bin").string();
  const std::string base = std::string(LOOM_DATA_EXE) + " analyze " + (dir_ / "toy.toml").string() +
                           " --plugin-path " + LOOM_TEST_PLUGIN_DIR + " --seq-len 16 ";
  fs::create_directories(dir_ / "bad");
  const std::string out = " --output " + (dir_ / "bad").string();
  expect_error(sh(base + "--dataset " + (dir_ / "missing.bin").string() + out),
               {"missing.bin", "cannot open the dataset"});
  expect_error(sh(base + "--dataset " + data + " --output " + (dir_ / "nope").string()),
               {"--output", "nope", "does not exist"});
  expect_error(analyze("toy.toml", "bad", "", 1, kTrain),
               {"data.bin", "--seq-len 20001 is too large", "the largest --seq-len is 20000"});
  expect_error(analyze("none.toml", "bad"), {"none.toml", "declares no metric"});
  expect_error(analyze("toy.toml", "bad", "--metric sched"),
               {"toy.toml", "--metric sched", "is not a metric", "tsum, tfreq"});
  expect_error(analyze("toy.toml", "bad", "--metric nosuch"),
               {"toy.toml", "--metric nosuch", "no [curriculum.nosuch]"});
  expect_error(analyze("toy.toml", "bad", "--comm nosuch"), {"--comm nosuch", "no [comm.nosuch]"});
  expect_error(analyze("missing.toml", "bad"), {"missing.toml"});
  expect_error(analyze("bad.toml", "bad", "--metric n"),
               {"metric \"n\" (plugin toy_metric)", "as nan", "must be finite"});
  expect_error(analyze("bad.toml", "bad", "--metric f"),
               {"metric \"f\" (plugin toy_metric)", "score failed", "refused to score"});
  // Nothing was written by any failed run.
  EXPECT_TRUE(fs::is_empty(dir_ / "bad"));
  // A usage error for a bad --seq-len.
  const Result r = analyze("toy.toml", "bad", "", 1, 0);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("--seq-len"), std::string::npos) << r.out;
}

}  // namespace
