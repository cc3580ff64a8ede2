// The index files (plugins/data/index): a written index reads back exactly, and every kind
// of damage is refused with an IndexError that names the file and what is wrong.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <loom/data/metric_index.hpp>

namespace fs = std::filesystem;
using loom::data::IndexError;
using loom::data::IndexFile;
using loom::data::IndexInfo;
using loom::data::MetricIndex;
using loom::data::SortedEntry;

namespace {

class IndexTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("loom_index_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    info_.samples = 1000;
    info_.dataset_checksum = 0x1234567890abcdefull;
    info_.sample_tokens = 64;
    info_.vocab_size = 50257;
    info_.metric = "voc";
    info_.plugin = "vocabulary_rarity";
    std::mt19937_64 rng(7);
    values_.resize(info_.samples);
    // Few distinct values, so ties (broken by sample id) are common.
    for (double& v : values_) v = static_cast<double>(rng() % 50) * 0.25 - 3.0;
  }
  void TearDown() override { fs::remove_all(dir_); }

  void write() {
    const auto sorted = loom::data::sort_by_value(values_, 3);
    loom::data::write_metric_index(dir_.string(), info_, values_, sorted);
  }
  std::string path(IndexFile f) const {
    return loom::data::index_file_path(dir_.string(), info_.metric, f);
  }
  std::vector<unsigned char> read(IndexFile f) const {
    std::ifstream in(path(f), std::ios::binary);
    return {std::istreambuf_iterator<char>(in), {}};
  }
  void store(IndexFile f, const std::vector<unsigned char>& b) const {
    std::ofstream out(path(f), std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
  }
  // Recomputes both checksums, so a test can reach the checks behind them.
  static void reseal(std::vector<unsigned char>& b) {
    const uint64_t payload = loom::data::index_fnv1a64(b.data() + 256, b.size() - 256);
    std::memcpy(b.data() + 184, &payload, 8);
    const uint64_t header = loom::data::index_fnv1a64(b.data(), 248);
    std::memcpy(b.data() + 248, &header, 8);
  }
  // Opening fails with an IndexError whose message starts with the file and contains `what`.
  void expect_error(IndexFile f, const std::string& what) {
    try {
      (void)MetricIndex::open(dir_.string(), info_.metric);
      FAIL() << "open succeeded, expected: " << what;
    } catch (const IndexError& e) {
      const std::string msg = e.what();
      EXPECT_EQ(msg.rfind(path(f) + ": ", 0), 0u) << msg;
      EXPECT_NE(msg.find(what), std::string::npos) << msg;
    }
  }

  fs::path dir_;
  IndexInfo info_;
  std::vector<double> values_;
};

TEST_F(IndexTest, RoundTrip) {
  write();
  const MetricIndex idx = MetricIndex::open(dir_.string(), "voc");
  EXPECT_EQ(idx.info().samples, info_.samples);
  EXPECT_EQ(idx.info().dataset_checksum, info_.dataset_checksum);
  EXPECT_EQ(idx.info().sample_tokens, 64u);
  EXPECT_EQ(idx.info().vocab_size, 50257u);
  EXPECT_EQ(idx.info().metric, "voc");
  EXPECT_EQ(idx.info().plugin, "vocabulary_rarity");
  ASSERT_EQ(idx.sample_to_metric().size(), values_.size());
  for (size_t i = 0; i < values_.size(); ++i) EXPECT_EQ(idx.sample_to_metric()[i], values_[i]);
  // The sorted list against a plain reference: ascending value, ties by id.
  std::vector<SortedEntry> ref;
  for (size_t i = 0; i < values_.size(); ++i) ref.push_back({values_[i], i});
  std::stable_sort(ref.begin(), ref.end(),
                   [](const SortedEntry& a, const SortedEntry& b) { return a.value < b.value; });
  ASSERT_EQ(idx.sorted().size(), ref.size());
  for (size_t k = 0; k < ref.size(); ++k) {
    EXPECT_EQ(idx.sorted()[k].sample, ref[k].sample) << k;
    EXPECT_EQ(idx.sorted()[k].value, ref[k].value) << k;
  }
  ASSERT_EQ(idx.percentiles().size(), 101u);
  EXPECT_EQ(idx.percentiles()[0], ref.front().value);
  EXPECT_EQ(idx.percentiles()[100], ref.back().value);
  EXPECT_EQ(idx.percentiles()[50], ref[50 * 999 / 100].value);
  // A moved-from index gives up its mappings; the moved-to one still reads.
  MetricIndex moved = MetricIndex::open(dir_.string(), "voc");
  MetricIndex other = std::move(moved);
  EXPECT_EQ(other.sorted()[0].sample, ref[0].sample);
  // No temporary file is left behind.
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(dir_)) {
    EXPECT_EQ(e.path().extension(), ".idx") << e.path();
    ++files;
  }
  EXPECT_EQ(files, 3u);
}

TEST_F(IndexTest, ParallelSortMatchesSequential) {
  std::mt19937_64 rng(3);
  std::vector<double> v(100003);
  for (double& x : v) x = static_cast<double>(rng() % 1000);
  const auto one = loom::data::sort_by_value(v, 1);
  for (unsigned t : {2u, 3u, 7u, 16u}) {
    const auto many = loom::data::sort_by_value(v, t);
    ASSERT_EQ(many.size(), one.size());
    for (size_t k = 0; k < one.size(); ++k) {
      ASSERT_EQ(many[k].sample, one[k].sample) << "threads " << t << " entry " << k;
    }
  }
  for (size_t k = 1; k < one.size(); ++k)
    ASSERT_TRUE(loom::data::sorted_before(one[k - 1], one[k]));
}

TEST_F(IndexTest, PercentilesOfOneSample) {
  const std::vector<SortedEntry> one = {{2.5, 0}};
  for (double p : loom::data::percentiles_of(one)) EXPECT_EQ(p, 2.5);
}

TEST_F(IndexTest, MissingFile) {
  write();
  fs::remove(path(IndexFile::sorted));
  expect_error(IndexFile::sorted, "cannot open the index file");
  // The message gives the command that writes the index, and a caller that knows the run
  // fills in its dataset and sequence length.
  const std::string dir = dir_.string(), metric = info_.metric;
  const std::string command = "mkdir -p " + dir + " && loom data analyze MANIFEST --dataset " +
                              "DATASET --seq-len SEQ_LEN --metric " + metric + " --output " + dir;
  expect_error(IndexFile::sorted, command);
  try {
    (void)MetricIndex::open(dir, metric);
  } catch (const IndexError& e) {
    const std::string filled = loom::data::fill_analyze_hint(e.what(), "data.bin", 128);
    EXPECT_NE(filled.find("loom data analyze MANIFEST --dataset data.bin --seq-len 128 --metric " +
                          metric + " --output " + dir),
              std::string::npos)
        << filled;
    EXPECT_EQ(filled.find("DATASET"), std::string::npos) << filled;
    EXPECT_NE(filled.find("examples/data_efficiency/analyze.toml"), std::string::npos) << filled;
  }
}

TEST_F(IndexTest, Truncated) {
  write();
  auto b = read(IndexFile::sample_to_metric);
  b.resize(b.size() - 8);
  store(IndexFile::sample_to_metric, b);
  expect_error(IndexFile::sample_to_metric, "truncated index file");
  b.resize(100);
  store(IndexFile::sample_to_metric, b);
  expect_error(IndexFile::sample_to_metric, "the header alone is 256");
  store(IndexFile::sample_to_metric, {});
  expect_error(IndexFile::sample_to_metric, "truncated index file: 0 bytes");
}

TEST_F(IndexTest, TrailingBytes) {
  write();
  auto b = read(IndexFile::percentiles);
  b.push_back(0);
  store(IndexFile::percentiles, b);
  expect_error(IndexFile::percentiles, "1 trailing bytes");
}

TEST_F(IndexTest, WrongMagic) {
  write();
  auto b = read(IndexFile::sorted);
  b[0] = 'X';
  store(IndexFile::sorted, b);
  expect_error(IndexFile::sorted, "bad magic");
}

TEST_F(IndexTest, WrongVersion) {
  write();
  auto b = read(IndexFile::sorted);
  b[8] = 2;
  reseal(b);
  store(IndexFile::sorted, b);
  expect_error(IndexFile::sorted, "version 2 is not supported");
}

TEST_F(IndexTest, FlippedHeaderByte) {
  write();
  auto b = read(IndexFile::sample_to_metric);
  b[50] ^= 1;  // the sample length
  store(IndexFile::sample_to_metric, b);
  expect_error(IndexFile::sample_to_metric, "header checksum mismatch");
}

TEST_F(IndexTest, FlippedPayloadByte) {
  write();
  auto b = read(IndexFile::sorted);
  b[256 + 16 * 500 + 3] ^= 0x10;
  store(IndexFile::sorted, b);
  expect_error(IndexFile::sorted, "payload checksum mismatch");
}

TEST_F(IndexTest, WrongFileType) {
  write();
  // The percentiles file under the sample_to_metric name: same entry size, other type.
  fs::copy_file(path(IndexFile::percentiles), path(IndexFile::sample_to_metric),
                fs::copy_options::overwrite_existing);
  expect_error(IndexFile::sample_to_metric, "is a percentiles index file");
}

TEST_F(IndexTest, HeaderLiesAboutN) {
  write();
  auto b = read(IndexFile::sample_to_metric);
  const uint64_t n = 999;
  std::memcpy(b.data() + 24, &n, 8);  // N only: entries still says 1000
  reseal(b);
  store(IndexFile::sample_to_metric, b);
  expect_error(IndexFile::sample_to_metric, "the header says 999 samples but 1000 entries");
  std::memcpy(b.data() + 32, &n, 8);  // N and entries agree, the size does not
  reseal(b);
  store(IndexFile::sample_to_metric, b);
  expect_error(IndexFile::sample_to_metric, "8 trailing bytes");
  const uint64_t huge = 1ull << 60;
  std::memcpy(b.data() + 24, &huge, 8);
  std::memcpy(b.data() + 32, &huge, 8);
  reseal(b);
  store(IndexFile::sample_to_metric, b);
  expect_error(IndexFile::sample_to_metric, "samples (expected 1 to 2^48)");
}

TEST_F(IndexTest, UnsortedEntries) {
  write();
  auto b = read(IndexFile::sorted);
  // Swap the first and the last entries: both stay consistent with the values, the order
  // does not.
  std::vector<unsigned char> first(b.begin() + 256, b.begin() + 272);
  std::copy(b.end() - 16, b.end(), b.begin() + 256);
  std::copy(first.begin(), first.end(), b.end() - 16);
  reseal(b);
  store(IndexFile::sorted, b);
  expect_error(IndexFile::sorted, "out of order");
}

TEST_F(IndexTest, TiesOutOfOrder) {
  values_.assign(info_.samples, 1.0);
  write();
  auto b = read(IndexFile::sorted);
  std::vector<unsigned char> e0(b.begin() + 256, b.begin() + 272);
  std::copy(b.begin() + 272, b.begin() + 288, b.begin() + 256);
  std::copy(e0.begin(), e0.end(), b.begin() + 272);
  reseal(b);
  store(IndexFile::sorted, b);
  expect_error(IndexFile::sorted, "entries 0 and 1 are out of order");
}

TEST_F(IndexTest, DuplicateOrBadSample) {
  write();
  auto b = read(IndexFile::sorted);
  uint64_t s;
  std::memcpy(&s, b.data() + 256 + 8, 8);
  const uint64_t past = 5000;
  std::memcpy(b.data() + 256 + 8, &past, 8);
  reseal(b);
  store(IndexFile::sorted, b);
  expect_error(IndexFile::sorted, "past the 1000 samples");
  std::memcpy(b.data() + 256 + 8, &s, 8);
  std::memcpy(b.data() + 256 + 16 + 8, &s, 8);
  reseal(b);
  store(IndexFile::sorted, b);
  expect_error(IndexFile::sorted, "appears twice");
}

TEST_F(IndexTest, NonFiniteValue) {
  write();
  auto b = read(IndexFile::sample_to_metric);
  const double nan = std::nan("");
  std::memcpy(b.data() + 256 + 8 * 10, &nan, 8);
  reseal(b);
  store(IndexFile::sample_to_metric, b);
  expect_error(IndexFile::sample_to_metric, "sample 10 is not finite");
}

TEST_F(IndexTest, MismatchedFiles) {
  // Files of two runs: the sorted file of another dataset.
  write();
  const auto other_sorted = read(IndexFile::sorted);
  info_.dataset_checksum ^= 1;
  write();
  store(IndexFile::sorted, other_sorted);
  expect_error(IndexFile::sorted, "does not belong with");
  // Same header, other values: the cross-check of values catches it.
  info_.dataset_checksum ^= 1;
  write();
  const auto old_values = read(IndexFile::sample_to_metric);
  for (double& v : values_) v += 1.0;
  write();
  store(IndexFile::sample_to_metric, old_values);
  expect_error(IndexFile::sorted, "files of different runs");
  // Consistent values and sorted files, a percentile table of another run.
  write();
  auto pct = read(IndexFile::percentiles);
  double p50;
  std::memcpy(&p50, pct.data() + 256 + 8 * 50, 8);
  p50 += 0.5;
  std::memcpy(pct.data() + 256 + 8 * 50, &p50, 8);
  reseal(pct);
  store(IndexFile::percentiles, pct);
  expect_error(IndexFile::percentiles, "percentile 50");
}

TEST_F(IndexTest, OtherMetricsFiles) {
  write();
  // Files renamed from metric "voc" to "len": the header still says voc.
  for (IndexFile f : {IndexFile::sample_to_metric, IndexFile::sorted, IndexFile::percentiles}) {
    fs::rename(path(f), loom::data::index_file_path(dir_.string(), "len", f));
  }
  try {
    (void)MetricIndex::open(dir_.string(), "len");
    FAIL();
  } catch (const IndexError& e) {
    EXPECT_NE(std::string(e.what()).find("written for metric \"voc\", not \"len\""),
              std::string::npos)
        << e.what();
  }
}

TEST_F(IndexTest, WriterRefusesBadInput) {
  auto sorted = loom::data::sort_by_value(values_);
  IndexInfo bad = info_;
  bad.metric = std::string(64, 'a');
  EXPECT_THROW(loom::data::write_metric_index(dir_.string(), bad, values_, sorted), IndexError);
  bad = info_;
  bad.metric = "a/b";
  EXPECT_THROW(loom::data::write_metric_index(dir_.string(), bad, values_, sorted), IndexError);
  bad = info_;
  bad.samples = 999;
  EXPECT_THROW(loom::data::write_metric_index(dir_.string(), bad, values_, sorted), IndexError);
  std::swap(sorted[0], sorted[1]);
  EXPECT_THROW(loom::data::write_metric_index(dir_.string(), info_, values_, sorted), IndexError);
  values_[0] = INFINITY;
  sorted = loom::data::sort_by_value(values_);
  EXPECT_THROW(loom::data::write_metric_index(dir_.string(), info_, values_, sorted), IndexError);
  // A folder that does not exist: the error names the file it could not create.
  values_[0] = 0;
  sorted = loom::data::sort_by_value(values_);
  try {
    loom::data::write_metric_index((dir_ / "nope").string(), info_, values_, sorted);
    FAIL();
  } catch (const IndexError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot create the index file"), std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(fs::is_empty(dir_));
}

}  // namespace
