// The SDK's tables for loom.curriculum/1 and loom.sampler/1, in process: which entries a
// class gets (the NULL rules), the roles the table sets from the class's methods, the
// defaults and the class's plan, and the argument checks made before the class is called.
#include <loom/sdk.hpp>
#include <loom/sdk/kinds/curriculum.hpp>
#include <loom/sdk/kinds/sampler.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace {

using loom::sdk::Context;

// ---- classes: one per combination the rules distinguish

// A metric with a first pass: stats = vocab_size counts, score = count of token 0 in the
// sample plus the stats' total (so a test sees that both reached it).
class CountingMetric : public loom::sdk::Curriculum {
 public:
  explicit CountingMetric(Context& /*ctx*/) {}
  void plan(loom_curriculum_plan_args& a) {
    a.stats_count = a.vocab_size;
    a.roles = 0xff;  // overwritten by the table
  }
  void count(const loom_curriculum_count_args& a) {
    const auto* tok = loom::sdk::data_as<const uint16_t>(*a.samples.tokens);
    auto* stats = loom::sdk::data_as<int64_t>(*a.stats);
    const auto s = loom::sdk::curriculum_samples(a.samples);
    for (int64_t i = s.begin(0); i < s.end(s.count - 1); ++i) stats[tok[i]] += 1;
  }
  void score(const loom_curriculum_score_args& a) {
    const auto s = loom::sdk::curriculum_samples(a.samples);
    const auto* tok = loom::sdk::data_as<const uint16_t>(*s.tokens);
    auto* out = loom::sdk::data_as<double>(*a.scores);
    const auto* stats = loom::sdk::data_as<const int64_t>(*a.stats);
    int64_t total = 0;
    for (int64_t k = 0; k < a.stats->shape[0]; ++k) total += stats[k];
    for (int64_t i = 0; i < s.count; ++i) {
      int64_t zeros = 0;
      for (int64_t t = s.begin(i); t < s.end(i); ++t) zeros += tok[t] == 0 ? 1 : 0;
      out[i] = static_cast<double>(zeros) + static_cast<double>(total) * 1000.0;
    }
  }
};

// A metric with neither plan nor count: the length of each sample.
class LengthMetric : public loom::sdk::Curriculum {
 public:
  explicit LengthMetric(Context& /*ctx*/) {}
  void score(const loom_curriculum_score_args& a) {
    const auto s = loom::sdk::curriculum_samples(a.samples);
    auto* out = loom::sdk::data_as<double>(*a.scores);
    for (int64_t i = 0; i < s.count; ++i) out[i] = static_cast<double>(s.end(i) - s.begin(i));
  }
};

// A schedule without plan: difficulty = step.
class StepSchedule : public loom::sdk::Curriculum {
 public:
  explicit StepSchedule(Context& /*ctx*/) {}
  void at(loom_curriculum_at_args& a) { a.difficulty = static_cast<double>(a.step); }
};

// Both halves, a sequence-length schedule.
class Both : public loom::sdk::Curriculum {
 public:
  explicit Both(Context& /*ctx*/) {}
  void plan(loom_curriculum_plan_args& a) { a.seq_len_mode = LOOM_SEQ_LEN_RESHAPE; }
  void score(const loom_curriculum_score_args& a) {
    auto* out = loom::sdk::data_as<double>(*a.scores);
    for (int64_t i = 0; i < a.scores->shape[0]; ++i) out[i] = 1.0;
  }
  void at(loom_curriculum_at_args& a) {
    a.seq_len = 8 * a.step;
    a.difficulty = static_cast<double>(a.seq_len);
  }
};

// A schedule whose plan claims stats: a plugin bug the table reports.
class BadSchedule : public loom::sdk::Curriculum {
 public:
  explicit BadSchedule(Context& /*ctx*/) {}
  void plan(loom_curriculum_plan_args& a) { a.stats_count = 4; }
  void at(loom_curriculum_at_args& a) { a.difficulty = 0; }
};

// Schedules that break at's promise (a finite difficulty; seq_len >= 1 for a
// sequence-length schedule, 0 otherwise), at the steps the test picks: step 2 breaks it.
template <uint32_t Mode>
class BrokenAt : public loom::sdk::Curriculum {
 public:
  explicit BrokenAt(Context& /*ctx*/) {}
  void plan(loom_curriculum_plan_args& a) { a.seq_len_mode = Mode; }
  void at(loom_curriculum_at_args& a) {
    const bool length = Mode != LOOM_SEQ_LEN_NONE;
    a.difficulty = 16;
    a.seq_len = length ? 16 : 0;
    if (a.step == 2) a.seq_len = length ? 0 : 16;  // the wrong seq_len for the mode
    if (a.step == 3) a.seq_len = length ? -4 : -1;
    if (a.step == 4) a.difficulty = NAN;
    if (a.step == 5) a.difficulty = -INFINITY;
  }
};

// A sampler: ids step*B + slot modulo the dataset, this rank's share of them.
class RoundRobin : public loom::sdk::Sampler {
 public:
  explicit RoundRobin(Context& /*ctx*/) {}
  void plan(loom_sampler_plan_args& a) {
    n_ = a.dataset_size;
    b_ = a.global_batch;
    w_ = a.world_size;
    a.capacity = (b_ + w_ - 1) / w_;
  }
  void next(loom_sampler_next_args& a) {
    const int64_t lo = (a.rank * b_) / w_;
    const int64_t hi = ((a.rank + 1) * b_) / w_;
    auto* ids = loom::sdk::data_as<int64_t>(*a.indices);
    for (int64_t j = lo; j < hi; ++j) {
      ids[j - lo] = static_cast<int64_t>(static_cast<uint64_t>((a.step - 1) * b_ + j) % n_);
    }
    a.count = hi - lo;
    a.difficulty = NAN;
    a.consumed = static_cast<uint64_t>(a.step * b_);
    a.epoch = a.consumed / n_;
  }

 private:
  uint64_t n_ = 1;
  int64_t b_ = 1;
  int64_t w_ = 1;
};

// ---- an in-process instance of T through its factory, as a host would make it

template <class T>
class Instance {
 public:
  // A host of ABI 1.`minor` whose services table has `services_size` bytes.
  explicit Instance(uint16_t minor = LOOM_ABI_MINOR,
                    uint32_t services_size = LOOM_HOST_SERVICES_SIZE) {
    factory_ = loom::sdk::factory<T>()();
    svc_.struct_size = services_size;
    svc_.abi_major = LOOM_ABI_MAJOR;
    svc_.abi_minor = minor;
    svc_.instance_name = "test";
    loom_status* st = factory_->create(&svc_, &obj_);
    if (st != nullptr) {
      ADD_FAILURE() << st->message;
      st->destroy(st);
    }
  }
  ~Instance() {
    if (obj_ != nullptr) factory_->destroy(obj_);
  }
  Instance(const Instance&) = delete;
  Instance& operator=(const Instance&) = delete;

  const loom_factory* factory() const { return factory_; }
  void* object() const { return obj_; }
  template <class Table>
  const Table* table() const {
    return static_cast<const Table*>(factory_->vtable);
  }

 private:
  const loom_factory* factory_ = nullptr;
  loom_host_services svc_{};
  void* obj_ = nullptr;
};

// The status's message ("" for success), destroying it; `code` receives its code.
std::string take(loom_status* st, int32_t* code = nullptr) {
  if (code != nullptr) *code = st == nullptr ? LOOM_OK : st->code;
  if (st == nullptr) return "";
  std::string m = st->message;
  st->destroy(st);
  return m;
}

template <class T>
loom_curriculum_plan_args plan_of(uint32_t vocab) {
  Instance<T> inst;
  loom_curriculum_plan_args p{};
  p.struct_size = LOOM_CURRICULUM_PLAN_ARGS_SIZE;
  p.vocab_size = vocab;
  p.roles = 0x55;
  p.seq_len_mode = 7;
  p.stats_count = 99;
  EXPECT_EQ(take(inst.template table<loom_curriculum_v1>()->plan(inst.object(), &p)), "");
  return p;
}

// Host tensors over vectors, kept alive with their shapes.
struct Tensor {
  template <class E>
  Tensor(std::vector<E>& v, DLDataType dtype) : shape{static_cast<int64_t>(v.size())} {
    t = loom::sdk::flat_view(v.data(), DLDevice{kDLCPU, 0}, dtype, shape);
  }
  // Copies point at their own shape.
  Tensor(const Tensor& o) : shape{o.shape[0]}, t(o.t) { t.shape = shape; }
  Tensor& operator=(const Tensor& o) {
    if (this != &o) {
      shape[0] = o.shape[0];
      t = o.t;
      t.shape = shape;
    }
    return *this;
  }
  ~Tensor() = default;
  int64_t shape[1];
  DLTensor t{};
};
constexpr DLDataType kU16{kDLUInt, 16, 1};
constexpr DLDataType kI64{kDLInt, 64, 1};
constexpr DLDataType kF64{kDLFloat, 64, 1};
constexpr DLDataType kF32{kDLFloat, 32, 1};

TEST(SdkKinds, CurriculumTablesHaveWhatTheClassHas) {
  Instance<CountingMetric> m;
  const auto* tm = m.table<loom_curriculum_v1>();
  EXPECT_STREQ(m.factory()->kind, LOOM_KIND_CURRICULUM);
  EXPECT_EQ(tm->struct_size, LOOM_CURRICULUM_V1_SIZE);
  EXPECT_NE(tm->plan, nullptr);
  EXPECT_NE(tm->count, nullptr);
  EXPECT_NE(tm->score, nullptr);
  EXPECT_EQ(tm->at, nullptr);

  Instance<LengthMetric> l;
  const auto* tl = l.table<loom_curriculum_v1>();
  EXPECT_NE(tl->plan, nullptr);  // always: the table answers roles itself
  EXPECT_EQ(tl->count, nullptr);
  EXPECT_NE(tl->score, nullptr);
  EXPECT_EQ(tl->at, nullptr);

  Instance<StepSchedule> s;
  const auto* ts = s.table<loom_curriculum_v1>();
  EXPECT_NE(ts->plan, nullptr);
  EXPECT_EQ(ts->count, nullptr);
  EXPECT_EQ(ts->score, nullptr);
  EXPECT_NE(ts->at, nullptr);

  Instance<Both> b;
  const auto* tb = b.table<loom_curriculum_v1>();
  EXPECT_EQ(tb->count, nullptr);
  EXPECT_NE(tb->score, nullptr);
  EXPECT_NE(tb->at, nullptr);
}

TEST(SdkKinds, PlanSetsRolesFromTheMethodsAndDefaults) {
  const auto m = plan_of<CountingMetric>(300);
  EXPECT_EQ(m.roles, LOOM_CURRICULUM_METRIC);  // the class's 0xff is overwritten
  EXPECT_EQ(m.seq_len_mode, LOOM_SEQ_LEN_NONE);
  EXPECT_EQ(m.stats_count, 300u);  // from the class's plan, which read vocab_size
  EXPECT_EQ(m.vocab_size, 300u);   // the in-field is left as given

  const auto l = plan_of<LengthMetric>(300);
  EXPECT_EQ(l.roles, LOOM_CURRICULUM_METRIC);
  EXPECT_EQ(l.seq_len_mode, LOOM_SEQ_LEN_NONE);  // the caller's 7 replaced by the default
  EXPECT_EQ(l.stats_count, 0u);                  // the caller's 99 replaced by the default

  const auto s = plan_of<StepSchedule>(0);
  EXPECT_EQ(s.roles, LOOM_CURRICULUM_SCHEDULE);
  EXPECT_EQ(s.seq_len_mode, LOOM_SEQ_LEN_NONE);
  EXPECT_EQ(s.stats_count, 0u);

  const auto b = plan_of<Both>(10);
  EXPECT_EQ(b.roles, LOOM_CURRICULUM_METRIC | LOOM_CURRICULUM_SCHEDULE);
  EXPECT_EQ(b.seq_len_mode, LOOM_SEQ_LEN_RESHAPE);
  EXPECT_EQ(b.stats_count, 0u);
}

TEST(SdkKinds, PlanReportsASchedulesStatsAndAShortStruct) {
  Instance<BadSchedule> bad;
  loom_curriculum_plan_args p{};
  p.struct_size = LOOM_CURRICULUM_PLAN_ARGS_SIZE;
  int32_t code = 0;
  const std::string msg = take(bad.table<loom_curriculum_v1>()->plan(bad.object(), &p), &code);
  EXPECT_EQ(code, LOOM_ERR_INTERNAL);
  EXPECT_NE(msg.find("stats_count 4"), std::string::npos) << msg;

  Instance<LengthMetric> l;
  p.struct_size = 8;
  const std::string shortmsg = take(l.table<loom_curriculum_v1>()->plan(l.object(), &p), &code);
  EXPECT_EQ(code, LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(shortmsg.find("struct_size 8"), std::string::npos) << shortmsg;
  EXPECT_EQ(take(l.table<loom_curriculum_v1>()->plan(l.object(), nullptr), &code),
            "plan args is NULL");
}

// A batch of 3 samples over 7 tokens, the scores' and stats' buffers.
struct Batch {
  std::vector<uint16_t> tokens{0, 1, 0, 2, 0, 0, 3};
  std::vector<int64_t> offsets{0, 3, 3, 7};  // lengths 3, 0, 4
  std::vector<double> scores = std::vector<double>(3, -1.0);
  std::vector<int64_t> stats = std::vector<int64_t>(4, 0);
  Tensor tok{tokens, kU16}, off{offsets, kI64}, sc{scores, kF64}, st{stats, kI64};

  loom_curriculum_samples samples() const {
    return loom_curriculum_samples{LOOM_CURRICULUM_SAMPLES_SIZE, 0, &tok.t, &off.t};
  }
  loom_curriculum_count_args count_args() {
    loom_curriculum_count_args a{};
    a.struct_size = LOOM_CURRICULUM_COUNT_ARGS_SIZE;
    a.samples = samples();
    a.vocab_size = 4;
    a.stats = &st.t;
    return a;
  }
  loom_curriculum_score_args score_args(bool with_stats) {
    loom_curriculum_score_args a{};
    a.struct_size = LOOM_CURRICULUM_SCORE_ARGS_SIZE;
    a.samples = samples();
    a.vocab_size = 4;
    a.stats = with_stats ? &st.t : nullptr;
    a.scores = &sc.t;
    return a;
  }
};

TEST(SdkKinds, CountThenScoreReachTheClass) {
  Instance<CountingMetric> m;
  const auto* t = m.table<loom_curriculum_v1>();
  Batch b;
  auto ca = b.count_args();
  ASSERT_EQ(take(t->count(m.object(), &ca)), "");
  EXPECT_EQ(b.stats, (std::vector<int64_t>{4, 1, 1, 1}));
  auto sa = b.score_args(true);
  ASSERT_EQ(take(t->score(m.object(), &sa)), "");
  EXPECT_EQ(b.scores, (std::vector<double>{7002, 7000, 7002}));

  Instance<LengthMetric> l;
  auto la = b.score_args(false);
  ASSERT_EQ(take(l.table<loom_curriculum_v1>()->score(l.object(), &la)), "");
  EXPECT_EQ(b.scores, (std::vector<double>{3, 0, 4}));
}

// Each bad argument is refused before the class runs, naming what is wrong.
TEST(SdkKinds, ScoreAndCountArgumentsAreChecked) {
  Instance<CountingMetric> m;
  const auto* t = m.table<loom_curriculum_v1>();
  auto expect_refused = [&](loom_curriculum_score_args a, const std::string& needle) {
    int32_t code = 0;
    const std::string msg = take(t->score(m.object(), &a), &code);
    EXPECT_EQ(code, LOOM_ERR_INVALID_ARGUMENT) << needle;
    EXPECT_NE(msg.find(needle), std::string::npos) << "'" << msg << "' lacks '" << needle << "'";
  };
  {
    Batch b;
    expect_refused(b.score_args(false), "stats is NULL");
  }
  {
    Batch b;
    b.stats.resize(3);
    b.st = Tensor(b.stats, kI64);
    expect_refused(b.score_args(true), "stats has 3 elements, expected the plan's stats_count 4");
  }
  {
    Batch b;
    b.sc = Tensor(b.scores, kF32);
    expect_refused(b.score_args(true), "scores has dtype float32, expected float64");
  }
  {
    Batch b;
    b.scores.resize(2);
    b.sc = Tensor(b.scores, kF64);
    expect_refused(b.score_args(true), "scores has 2 elements, expected 3");
  }
  {
    Batch b;
    std::vector<float> f(7);
    b.tok = Tensor(f, kF32);
    expect_refused(b.score_args(true), "samples.tokens has dtype float32");
  }
  {
    Batch b;
    b.offsets = {0, 3, 2, 7};
    expect_refused(b.score_args(true), "samples.offsets[2] = 2 is below offsets[1] = 3");
  }
  {
    Batch b;
    b.offsets = {0, 3, 3, 8};
    expect_refused(b.score_args(true), "samples.offsets[3] = 8 is outside the 7 tokens");
  }
  {
    Batch b;
    std::vector<int64_t> none;
    b.off = Tensor(none, kI64);
    expect_refused(b.score_args(true), "samples.offsets has shape [0]");
  }
  {
    Batch b;
    b.st.t.device = DLDevice{kDLCUDA, 0};
    expect_refused(b.score_args(true), "stats is on cuda:0, expected cpu");
  }
  {
    Batch b;
    auto a = b.score_args(true);
    a.samples.struct_size = 4;
    expect_refused(a, "samples has struct_size 4");
  }
  {
    Batch b;
    auto a = b.score_args(true);
    a.struct_size = LOOM_CURRICULUM_SCORE_ARGS_SIZE - 8;
    expect_refused(a, "score args has struct_size");
  }
  // A metric without stats refuses stats it would not read.
  Instance<LengthMetric> l;
  Batch b;
  auto a = b.score_args(true);
  int32_t code = 0;
  EXPECT_EQ(take(l.table<loom_curriculum_v1>()->score(l.object(), &a), &code),
            "stats is set but the metric's stats_count is 0");
  EXPECT_EQ(code, LOOM_ERR_INVALID_ARGUMENT);
  // count checks its stats too.
  Batch c;
  c.stats.resize(5);
  c.st = Tensor(c.stats, kI64);
  auto ca = c.count_args();
  EXPECT_NE(take(t->count(m.object(), &ca), &code).find("stats has 5 elements"), std::string::npos);
  EXPECT_EQ(c.stats, std::vector<int64_t>(5, 0));  // nothing was added
}

TEST(SdkKinds, AtFillsTheOutFieldsAndRefusesStepZero) {
  Instance<Both> b;
  const auto* t = b.table<loom_curriculum_v1>();
  loom_curriculum_at_args a{};
  a.struct_size = LOOM_CURRICULUM_AT_ARGS_SIZE;
  a.step = 3;
  a.difficulty = -5;
  ASSERT_EQ(take(t->at(b.object(), &a)), "");
  EXPECT_EQ(a.seq_len, 24);
  EXPECT_EQ(a.difficulty, 24.0);

  Instance<StepSchedule> s;
  a.step = 5;
  a.seq_len = 77;  // a schedule that leaves seq_len alone reports 0
  ASSERT_EQ(take(s.table<loom_curriculum_v1>()->at(s.object(), &a)), "");
  EXPECT_EQ(a.difficulty, 5.0);
  EXPECT_EQ(a.seq_len, 0);

  a.step = 0;
  int32_t code = 0;
  EXPECT_EQ(take(t->at(b.object(), &a), &code), "at: step is 0; steps start at 1");
  EXPECT_EQ(code, LOOM_ERR_INVALID_ARGUMENT);
}

template <class T>
std::string at_error(int64_t step, int32_t* code, loom_curriculum_at_args* out = nullptr) {
  Instance<T> inst;
  loom_curriculum_at_args a{};
  a.struct_size = LOOM_CURRICULUM_AT_ARGS_SIZE;
  a.step = step;
  std::string msg = take(inst.template table<loom_curriculum_v1>()->at(inst.object(), &a), code);
  if (out != nullptr) *out = a;
  return msg;
}

TEST(SdkKinds, AtRefusesAnAnswerThatBreaksTheAbi) {
  using Truncate = BrokenAt<LOOM_SEQ_LEN_TRUNCATE>;
  using Reshape = BrokenAt<LOOM_SEQ_LEN_RESHAPE>;
  using None = BrokenAt<LOOM_SEQ_LEN_NONE>;
  int32_t code = 0;
  loom_curriculum_at_args a{};
  // Step 1 keeps the promise.
  EXPECT_EQ(at_error<Truncate>(1, &code, &a), "");
  EXPECT_EQ(a.seq_len, 16);
  EXPECT_EQ(at_error<None>(1, &code, &a), "");
  EXPECT_EQ(a.seq_len, 0);

  EXPECT_EQ(at_error<Truncate>(2, &code),
            "the plugin's at gave seq_len 0 at step 2 but it is a sequence-length schedule "
            "(seq_len_mode TRUNCATE), whose seq_len must be >= 1");
  EXPECT_EQ(code, LOOM_ERR_INTERNAL);
  EXPECT_EQ(at_error<Reshape>(3, &code),
            "the plugin's at gave seq_len -4 at step 3 but it is a sequence-length schedule "
            "(seq_len_mode RESHAPE), whose seq_len must be >= 1");
  EXPECT_EQ(code, LOOM_ERR_INTERNAL);
  EXPECT_EQ(at_error<None>(2, &code),
            "the plugin's at gave seq_len 16 at step 2 but its seq_len_mode is NONE (the "
            "seq_len must be 0)");
  EXPECT_EQ(code, LOOM_ERR_INTERNAL);
  EXPECT_NE(at_error<None>(3, &code).find("seq_len -1 at step 3"), std::string::npos);
  EXPECT_EQ(code, LOOM_ERR_INTERNAL);
  EXPECT_EQ(at_error<Truncate>(4, &code),
            "the plugin's at gave difficulty NaN at step 4; a schedule's difficulty must be "
            "finite");
  EXPECT_EQ(code, LOOM_ERR_INTERNAL);
  EXPECT_NE(at_error<None>(5, &code).find("difficulty inf at step 5"), std::string::npos);
  EXPECT_EQ(code, LOOM_ERR_INTERNAL);
}

TEST(SdkKinds, SamplerPlanAndNext) {
  Instance<RoundRobin> r;
  EXPECT_STREQ(r.factory()->kind, LOOM_KIND_SAMPLER);
  const auto* t = r.table<loom_sampler_v1>();
  EXPECT_EQ(t->struct_size, LOOM_SAMPLER_V1_SIZE);
  loom_sampler_plan_args p{};
  p.struct_size = LOOM_SAMPLER_PLAN_ARGS_SIZE;
  p.dataset_size = 10;
  p.global_batch = 5;
  p.world_size = 2;
  ASSERT_EQ(take(t->plan(r.object(), &p)), "");
  EXPECT_EQ(p.capacity, 3);

  std::vector<int64_t> ids(3, -1);
  Tensor idx(ids, kI64);
  loom_sampler_next_args n{};
  n.struct_size = LOOM_SAMPLER_NEXT_ARGS_SIZE;
  n.step = 3;
  n.rank = 1;
  n.world_size = 2;
  n.indices = &idx.t;
  ASSERT_EQ(take(t->next(r.object(), &n)), "");
  EXPECT_EQ(n.count, 3);  // slots [2, 5) of ids 10..14 mod 10
  EXPECT_EQ(ids, (std::vector<int64_t>{2, 3, 4}));
  EXPECT_TRUE(std::isnan(n.difficulty));
  EXPECT_EQ(n.consumed, 15u);
  EXPECT_EQ(n.epoch, 1u);
}

// A plugin built with this SDK needs no 1.3 host for these kinds: the services table did not
// change in 1.3, so a 1.2 host's (and a 1.1 host's shorter one) serves it. A host before 1.3
// has no manifest section for them, but an embedder may create instances through the factory.
TEST(SdkKinds, CreatedByOlderHosts) {
  const uint32_t v11 = LOOM_STRUCT_SIZE(loom_host_services, param_count);
  for (const auto& [minor, size] :
       {std::pair<uint16_t, uint32_t>{2, LOOM_HOST_SERVICES_SIZE}, {1, v11}}) {
    SCOPED_TRACE("ABI 1." + std::to_string(minor));
    Instance<Both> b(minor, size);
    ASSERT_NE(b.object(), nullptr);
    loom_curriculum_at_args a{};
    a.struct_size = LOOM_CURRICULUM_AT_ARGS_SIZE;
    a.step = 2;
    ASSERT_EQ(take(b.table<loom_curriculum_v1>()->at(b.object(), &a)), "");
    EXPECT_EQ(a.seq_len, 16);
    Instance<RoundRobin> r(minor, size);
    ASSERT_NE(r.object(), nullptr);
  }
}

TEST(SdkKinds, SamplerArgumentsAreChecked) {
  Instance<RoundRobin> r;
  const auto* t = r.table<loom_sampler_v1>();
  int32_t code = 0;
  auto plan = [&](uint64_t n, int64_t b, int32_t w) {
    loom_sampler_plan_args p{};
    p.struct_size = LOOM_SAMPLER_PLAN_ARGS_SIZE;
    p.dataset_size = n;
    p.global_batch = b;
    p.world_size = w;
    return take(t->plan(r.object(), &p), &code);
  };
  EXPECT_EQ(plan(0, 1, 1), "sampler plan: dataset_size is 0");
  EXPECT_EQ(code, LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(plan(4, 0, 1), "sampler plan: global_batch is 0; must be >= 1");
  EXPECT_EQ(plan(4, 1, -1), "sampler plan: world_size is -1; must be >= 1");
  ASSERT_EQ(plan(4, 4, 2), "");

  std::vector<int64_t> ids(2, -1);
  std::vector<int32_t> small(2, -1);
  Tensor idx(ids, kI64);
  Tensor bad_dtype(small, DLDataType{kDLInt, 32, 1});
  auto next = [&](int64_t step, int32_t rank, int32_t w, DLTensor* indices) {
    loom_sampler_next_args n{};
    n.struct_size = LOOM_SAMPLER_NEXT_ARGS_SIZE;
    n.step = step;
    n.rank = rank;
    n.world_size = w;
    n.indices = indices;
    return take(t->next(r.object(), &n), &code);
  };
  EXPECT_EQ(next(0, 0, 2, &idx.t), "sampler next: step is 0; steps start at 1");
  EXPECT_EQ(next(1, 2, 2, &idx.t), "sampler next: rank 2 is outside 0 .. 1");
  EXPECT_EQ(next(1, -1, 2, &idx.t), "sampler next: rank -1 is outside 0 .. 1");
  EXPECT_EQ(next(1, 0, 0, &idx.t), "sampler next: world_size is 0; must be >= 1");
  EXPECT_EQ(next(1, 0, 2, nullptr), "indices is NULL");
  EXPECT_EQ(next(1, 0, 2, &bad_dtype.t), "indices has dtype int32, expected int64");
  idx.t.device = DLDevice{kDLCUDA, 0};
  EXPECT_EQ(next(1, 0, 2, &idx.t), "indices is on cuda:0, expected host memory");
  EXPECT_EQ(code, LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(ids, std::vector<int64_t>(2, -1));  // nothing reached the class
  idx.t.device = DLDevice{kDLCPU, 0};
  EXPECT_EQ(next(1, 0, 2, &idx.t), "");
  EXPECT_EQ(ids, (std::vector<int64_t>{0, 1}));
}

}  // namespace
