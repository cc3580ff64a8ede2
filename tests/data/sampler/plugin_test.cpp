// The curriculum_sampler plugin through the host: a manifest with a schedule (the kinds13
// test plugin's linear one) and index files written here; its batches against the core
// driven by the same schedule, its state through export/import (and the SDK's frame), and
// the errors of bad parameters, a mismatched index and bad calls.
#include <gtest/gtest.h>
#include <loom/abi.h>
#include <loom/embed.h>
#include <loom/kinds/sampler.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include <loom/data/metric_index.hpp>
#include <loom/data/sampler_core.hpp>

namespace {

namespace fs = std::filesystem;
using loom::data::sampler::Clustering;
using loom::data::sampler::DifficultyType;
using loom::data::sampler::SamplerCore;

constexpr uint64_t kN = 300;
constexpr uint64_t kSeed = 77;

// A folder with the index files of metric "voc": values 0 .. 19 spread over the samples.
class IndexDir {
 public:
  IndexDir() {
    dir_ =
        fs::temp_directory_path() /
        ("loom_sampler_test_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) +
         "_" + std::to_string(reinterpret_cast<uintptr_t>(this)));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::mt19937_64 gen(3);
    values_.resize(kN);
    for (double& v : values_) v = static_cast<double>(gen() % 20);
    sorted_ = loom::data::sort_by_value(values_, 1);
    loom::data::IndexInfo info;
    info.samples = kN;
    info.dataset_checksum = 0x1234;
    info.sample_tokens = 16;
    info.vocab_size = 100;
    info.metric = "voc";
    info.plugin = "vocabulary_rarity";
    loom::data::write_metric_index(dir_.string(), info, values_, sorted_);
  }
  ~IndexDir() {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  IndexDir(const IndexDir&) = delete;
  IndexDir& operator=(const IndexDir&) = delete;
  std::string path() const { return dir_.string(); }
  const std::vector<loom::data::SortedEntry>& sorted() const { return sorted_; }

 private:
  fs::path dir_;
  std::vector<double> values_;
  std::vector<loom::data::SortedEntry> sorted_;
};

std::string manifest(const std::string& index, const std::string& extra = "",
                     const std::string& metric = "voc") {
  return "[curriculum.lin]\nplugin = \"kinds13\"\nmin_difficulty = 0.0\n"
         "max_difficulty = 20.0\ntotal_steps = 11\n"
         "[sampler.s]\nplugin = \"curriculum_sampler\"\nschedule = \"lin\"\nindex = \"" +
         index + "\"\nmetric = \"" + metric + "\"\n" + extra;
}

// kinds13's schedule, computed the same way.
double linear(int64_t step) {
  const int64_t s = std::min<int64_t>(step, 11);
  const double f = static_cast<double>(s - 1) / 10.0;
  return 0.0 + (20.0 - 0.0) * f;
}

struct Session {
  loom_session* s = nullptr;
  loom_instance* inst = nullptr;
  void* obj = nullptr;
  const loom_sampler_v1* t = nullptr;
  int32_t rc = 0;
  std::string error;

  explicit Session(const std::string& toml, bool validate_only = false) {
    loom_open_options o{};
    o.struct_size = LOOM_OPEN_OPTIONS_SIZE;
    o.validate_only = validate_only ? 1 : 0;
    o.log_level = -1;
    o.plugin_path = LOOM_TEST_PLUGIN_DIR;
    rc = loom_open_string(toml.c_str(), "test.toml", &o, &s);
    if (rc != LOOM_OK) {
      error = loom_last_error();
      return;
    }
    if (validate_only) return;
    if (loom_find_instance(s, "sampler", "s", &inst) != LOOM_OK) {
      ADD_FAILURE() << loom_last_error();
      return;
    }
    const void* raw = nullptr;
    if (loom_instance_table(inst, "sampler", LOOM_SAMPLER_V1_MIN_SIZE, &obj, &raw) != LOOM_OK) {
      ADD_FAILURE() << loom_last_error();
      return;
    }
    t = static_cast<const loom_sampler_v1*>(raw);
  }
  ~Session() { loom_close(s); }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // The status's code; its message in `error`.
  int32_t take(loom_status* st) {
    error = st != nullptr ? st->message : "";
    return loom_instance_take_status(inst, st, nullptr, 0);
  }
  int32_t plan(uint64_t n, int64_t b, int32_t w, int64_t* capacity = nullptr) {
    loom_sampler_plan_args p{};
    p.struct_size = LOOM_SAMPLER_PLAN_ARGS_SIZE;
    p.dataset_size = n;
    p.global_batch = b;
    p.world_size = w;
    const int32_t code = take(t->plan(obj, &p));
    if (capacity != nullptr) *capacity = p.capacity;
    return code;
  }
  int32_t next(int64_t step, int32_t rank, int32_t world, std::vector<int64_t>& ids,
               loom_sampler_next_args* out = nullptr, DLDataType dtype = {kDLInt, 64, 1}) {
    int64_t shape = static_cast<int64_t>(ids.size());
    DLTensor tensor{ids.data(), {kDLCPU, 0}, 1, dtype, &shape, nullptr, 0};
    loom_sampler_next_args a{};
    a.struct_size = LOOM_SAMPLER_NEXT_ARGS_SIZE;
    a.seed = kSeed;
    a.step = step;
    a.rank = rank;
    a.world_size = world;
    a.indices = &tensor;
    const int32_t code = take(t->next(obj, &a));
    if (code == LOOM_OK) ids.resize(static_cast<std::size_t>(a.count));
    if (out != nullptr) *out = a;
    return code;
  }
  std::vector<uint8_t> export_state() {
    size_t size = 0;
    EXPECT_EQ(loom_instance_export_state(inst, nullptr, 0, &size), LOOM_OK) << loom_last_error();
    std::vector<uint8_t> buf(size);
    EXPECT_EQ(loom_instance_export_state(inst, buf.data(), buf.size(), &size), LOOM_OK)
        << loom_last_error();
    buf.resize(size);
    return buf;
  }
  int32_t import_state(const std::vector<uint8_t>& blob) {
    const int32_t code = loom_instance_import_state(inst, blob.data(), blob.size());
    error = code != LOOM_OK ? loom_last_error() : "";
    return code;
  }
};

// Steps from..to, every rank's share concatenated per step.
std::vector<std::vector<int64_t>> steps(Session& s, int64_t from, int64_t to, int32_t world,
                                        int64_t capacity) {
  std::vector<std::vector<int64_t>> out;
  for (int64_t step = from; step <= to; ++step) {
    std::vector<int64_t> all;
    for (int32_t r = 0; r < world; ++r) {
      std::vector<int64_t> ids(static_cast<std::size_t>(capacity));
      EXPECT_EQ(s.next(step, r, world, ids), LOOM_OK) << s.error;
      all.insert(all.end(), ids.begin(), ids.end());
    }
    out.push_back(all);
  }
  return out;
}

TEST(Plugin, BatchesAreTheCoresUnderTheSchedule) {
  IndexDir idx;
  for (const std::string type : {"value", "percentile"}) {
    Session s(manifest(idx.path(), "difficulty_type = \"" + type + "\"\n"));
    ASSERT_EQ(s.rc, LOOM_OK) << s.error;
    int64_t capacity = 0;
    ASSERT_EQ(s.plan(kN, 16, 3, &capacity), LOOM_OK) << s.error;
    EXPECT_EQ(capacity, 6);
    SamplerCore core(idx.sorted(),
                     type == "value" ? DifficultyType::kValue : DifficultyType::kPercentile,
                     Clustering::kScheduleBased, "t");
    core.plan(kN, 16, 3);
    for (int64_t step = 1; step <= 40; ++step) {
      for (int32_t r = 0; r < 3; ++r) {
        std::vector<int64_t> ids(6, -1);
        loom_sampler_next_args out{};
        ASSERT_EQ(s.next(step, r, 3, ids, &out), LOOM_OK) << s.error;
        const auto want = core.next(step, kSeed, r, 3, linear);
        ASSERT_EQ(ids, std::vector<int64_t>(want.ids.begin(), want.ids.end()))
            << type << " step " << step << " rank " << r;
        EXPECT_EQ(out.difficulty, want.difficulty);
        EXPECT_EQ(out.difficulty, linear(step));  // the schedule rises, so its last value
        EXPECT_EQ(out.consumed, static_cast<uint64_t>(16 * step));
        EXPECT_EQ(out.epoch, static_cast<uint64_t>(16 * (step - 1)) / kN);
      }
    }
  }
}

// With the bundled fixed_linear schedule (the docs' example): every id drawn at a step is
// among the easiest floor(N d / 100) samples for the difficulty reported, which rises to 100.
TEST(Plugin, FixedLinearPercentileCurriculum) {
  IndexDir idx;
  const std::string toml =
      "[curriculum.ramp]\nplugin = \"fixed_linear\"\nmin_difficulty = 1.0\n"
      "max_difficulty = 100.0\ntotal_curriculum_step = 20\ndifficulty_step = 1\n"
      "[sampler.s]\nplugin = \"curriculum_sampler\"\nschedule = \"ramp\"\nindex = \"" +
      idx.path() + "\"\nmetric = \"voc\"\ndifficulty_type = \"percentile\"\n";
  Session s(toml);
  ASSERT_EQ(s.rc, LOOM_OK) << s.error;
  ASSERT_EQ(s.plan(kN, 8, 2), LOOM_OK) << s.error;
  double last = 0;
  for (int64_t step = 1; step <= 25; ++step) {
    for (int32_t r = 0; r < 2; ++r) {
      std::vector<int64_t> ids(4);
      loom_sampler_next_args out{};
      ASSERT_EQ(s.next(step, r, 2, ids, &out), LOOM_OK) << s.error;
      ASSERT_EQ(ids.size(), 4u);
      EXPECT_GE(out.difficulty, last);
      EXPECT_GE(out.difficulty, 1.0);
      last = out.difficulty;
      const auto admitted = std::max<uint64_t>(
          1, static_cast<uint64_t>(std::floor(static_cast<double>(kN) * out.difficulty / 100)));
      for (const int64_t id : ids) {
        const auto it = std::find_if(
            idx.sorted().begin(), idx.sorted().end(),
            [&](const loom::data::SortedEntry& e) { return static_cast<int64_t>(e.sample) == id; });
        ASSERT_NE(it, idx.sorted().end());
        EXPECT_LT(static_cast<uint64_t>(it - idx.sorted().begin()), admitted)
            << "step " << step << " difficulty " << out.difficulty;
      }
    }
  }
  EXPECT_EQ(last, 100.0);
}

TEST(Plugin, SingleClusterNeedsNoIndexOrSchedule) {
  Session s("[sampler.s]\nplugin = \"curriculum_sampler\"\nclustering_type = \"single_cluster\"\n");
  ASSERT_EQ(s.rc, LOOM_OK) << s.error;
  int64_t capacity = 0;
  ASSERT_EQ(s.plan(50, 10, 1, &capacity), LOOM_OK) << s.error;
  std::vector<int64_t> all;
  for (int64_t step = 1; step <= 5; ++step) {
    std::vector<int64_t> ids(static_cast<std::size_t>(capacity));
    loom_sampler_next_args out{};
    ASSERT_EQ(s.next(step, 0, 1, ids, &out), LOOM_OK) << s.error;
    EXPECT_TRUE(std::isnan(out.difficulty));
    all.insert(all.end(), ids.begin(), ids.end());
  }
  std::sort(all.begin(), all.end());
  for (int64_t i = 0; i < 50; ++i) EXPECT_EQ(all[static_cast<std::size_t>(i)], i);
}

TEST(Plugin, StateResumesThroughTheHost) {
  IndexDir idx;
  Session whole(manifest(idx.path()));
  ASSERT_EQ(whole.rc, LOOM_OK) << whole.error;
  ASSERT_EQ(whole.plan(kN, 24, 2), LOOM_OK);
  const auto want = steps(whole, 1, 40, 2, 12);

  Session first(manifest(idx.path()));
  ASSERT_EQ(first.plan(kN, 24, 2), LOOM_OK);
  steps(first, 1, 9, 2, 12);
  const auto blob = first.export_state();
  ASSERT_FALSE(blob.empty());

  Session second(manifest(idx.path()));
  ASSERT_EQ(second.plan(kN, 24, 2), LOOM_OK);
  ASSERT_EQ(second.import_state(blob), LOOM_OK) << second.error;
  const auto rest = steps(second, 9, 40, 2, 12);
  for (std::size_t i = 0; i < rest.size(); ++i) ASSERT_EQ(rest[i], want[i + 8]) << "step " << i + 9;

  // Every changed byte and every truncation is refused, and leaves the instance as it was.
  Session third(manifest(idx.path()));
  ASSERT_EQ(third.plan(kN, 24, 2), LOOM_OK);
  for (std::size_t k = 0; k < blob.size(); ++k) {
    std::vector<uint8_t> bad = blob;
    bad[k] ^= 0x10;
    const int32_t code = third.import_state(bad);
    EXPECT_TRUE(code == LOOM_ERR_DATA_LOSS || code == LOOM_ERR_INVALID_ARGUMENT)
        << "byte " << k << ": " << code;
    std::vector<uint8_t> cut(blob.begin(), blob.begin() + static_cast<std::ptrdiff_t>(k));
    EXPECT_NE(third.import_state(cut), LOOM_OK) << "length " << k;
  }
  EXPECT_EQ(steps(third, 1, 3, 2, 12),
            std::vector<std::vector<int64_t>>(want.begin(), want.begin() + 3));
}

TEST(Plugin, BadCallsAreClearErrors) {
  IndexDir idx;
  Session s(manifest(idx.path()));
  ASSERT_EQ(s.rc, LOOM_OK) << s.error;
  std::vector<int64_t> ids(8);
  EXPECT_EQ(s.next(1, 0, 2, ids), LOOM_ERR_FAILED_PRECONDITION);
  EXPECT_NE(s.error.find("before plan"), std::string::npos) << s.error;

  EXPECT_EQ(s.plan(kN + 1, 16, 2), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(
      s.error.find("dataset_size 301 differs from the 300 samples of index '" + idx.path() + "'"),
      std::string::npos)
      << s.error;
  ASSERT_EQ(s.plan(kN, 16, 2), LOOM_OK);

  std::vector<int64_t> small(7);
  EXPECT_EQ(s.next(1, 0, 2, small), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(s.error.find("indices has 7 elements, fewer than plan's capacity 8"), std::string::npos)
      << s.error;
  std::vector<int64_t> wrong(8);
  EXPECT_EQ(s.next(1, 0, 2, wrong, nullptr, DLDataType{kDLInt, 32, 1}), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(s.error.find("indices"), std::string::npos) << s.error;
  EXPECT_EQ(s.next(1, 2, 2, ids), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(s.error.find("rank 2"), std::string::npos) << s.error;
  EXPECT_EQ(s.next(1, 0, 3, ids), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(s.error.find("world_size 3 differs from plan's 2"), std::string::npos) << s.error;
  EXPECT_EQ(s.next(2, 0, 2, ids), LOOM_ERR_FAILED_PRECONDITION);
  EXPECT_NE(s.error.find("step 2 is not the next step (1)"), std::string::npos) << s.error;
  // None of that moved the position.
  loom_sampler_next_args out{};
  ids.assign(8, 0);
  ASSERT_EQ(s.next(1, 0, 2, ids, &out), LOOM_OK) << s.error;
  EXPECT_EQ(out.consumed, 16u);
}

TEST(Plugin, ParametersAndIndexAreChecked) {
  IndexDir idx;
  EXPECT_EQ(Session(manifest(idx.path()), true).rc, LOOM_OK);
  {
    // schedule_based without an index, a metric or a schedule: loom check names the key.
    Session s("[sampler.s]\nplugin = \"curriculum_sampler\"\nmetric = \"voc\"\n", true);
    EXPECT_EQ(s.rc, LOOM_ERR_INVALID_ARGUMENT);
    EXPECT_NE(s.error.find("index is required when clustering_type is schedule_based"),
              std::string::npos)
        << s.error;
  }
  {
    Session s("[sampler.s]\nplugin = \"curriculum_sampler\"\nindex = \"x\"\nmetric = \"voc\"\n",
              true);
    EXPECT_EQ(s.rc, LOOM_ERR_INVALID_ARGUMENT);
    EXPECT_NE(s.error.find("schedule is required"), std::string::npos) << s.error;
  }
  {
    Session s(manifest(idx.path(), "difficulty_type = \"rank\"\n"), true);
    EXPECT_EQ(s.rc, LOOM_ERR_INVALID_ARGUMENT);
    EXPECT_NE(s.error.find("difficulty_type"), std::string::npos) << s.error;
  }
  {
    // A folder without the metric's files.
    Session s(manifest(idx.path() + "/missing"));
    EXPECT_NE(s.rc, LOOM_OK);
    EXPECT_NE(s.error.find("parameter 'index'"), std::string::npos) << s.error;
    EXPECT_NE(s.error.find("missing"), std::string::npos) << s.error;
  }
  {
    // Files renamed to another metric's names: the header still says "voc".
    const std::string other = idx.path() + "/other";
    fs::create_directories(other);
    for (const auto file : {loom::data::IndexFile::sample_to_metric, loom::data::IndexFile::sorted,
                            loom::data::IndexFile::percentiles}) {
      fs::copy_file(loom::data::index_file_path(idx.path(), "voc", file),
                    loom::data::index_file_path(other, "rare", file));
    }
    // MetricIndex::open refuses them (the plugin has no check of its own).
    Session s(manifest(other, "", "rare"));
    EXPECT_NE(s.rc, LOOM_OK);
    EXPECT_NE(s.error.find("parameter 'index'"), std::string::npos) << s.error;
    EXPECT_NE(s.error.find("voc"), std::string::npos) << s.error;
  }
}

}  // namespace
