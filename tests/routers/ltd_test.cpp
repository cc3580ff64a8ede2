// random_ltd's schedule and host selection, directly: the schedule against an independent
// (exact integer) reference at every step of published settings, the key definition against
// loom::sdk::CounterRng, the selection against a full sort, its purity (thread counts, batch
// splits with first_sample, instances) and a uniformity bound, and 32768+ positions.
#include <gtest/gtest.h>
#include <loom/sdk/random.hpp>
#include <loom/sdk/status.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "schedule.hpp"
#include "select.hpp"
#include "select_key.hpp"
#include "tensors.hpp"

namespace {

namespace ltd = loom::routers::ltd;
using routers_test::TestPool;

// The schedule written independently: integer floor division (exact), Loom's clamps.
int64_t reference_value(int64_t min, int64_t max, int64_t R, int64_t q, int64_t step) {
  const int64_t t = step - 1;
  if (t >= R) return max;
  int64_t r = min + t * (max - min) / R;
  r = r / q * q;
  if (r > max) r = max;
  if (r < min) r = min;
  return r;
}

TEST(RouterLtd, ScheduleMatchesTheFormulaAtEveryStep) {
  struct Setting {
    int64_t min, max, R, q;
  };
  // GPT-3 1.3B (100% / 67% / 50% data), BERT-large, GPT-2 fine-tuning, min not a multiple of q.
  const Setting settings[] = {{128, 2048, 200000, 16}, {128, 2048, 133333, 16},
                              {128, 2048, 100000, 16}, {128, 512, 2000000, 16},
                              {128, 1024, 400, 8},     {8, 2048, 1000, 16},
                              {8, 64, 10, 16},         {1, 10, 49, 1},
                              {5, 5, 3, 16},           {100, 130, 7, 16}};
  for (const Setting& s : settings) {
    SCOPED_TRACE(std::to_string(s.min) + " -> " + std::to_string(s.max) + " R " +
                 std::to_string(s.R) + " q " + std::to_string(s.q));
    const ltd::Schedule sch{s.min, s.max, s.R, s.q};
    ltd::validate(sch, "fixed_linear");
    // Every step up to R + 2 for short schedules; for long ones every 7th and the ends.
    const int64_t stride = s.R > 200000 ? 97 : (s.R > 20000 ? 7 : 1);
    int64_t previous = 0;
    for (int64_t step = 1; step <= s.R + 3; step += (step > s.R - 3 ? 1 : stride)) {
      const int64_t v = ltd::value_at(sch, step);
      ASSERT_EQ(v, reference_value(s.min, s.max, s.R, s.q, step)) << "step " << step;
      ASSERT_GE(v, s.min);
      ASSERT_LE(v, s.max);
      ASSERT_GE(v, previous) << "step " << step;
      previous = v;
    }
    EXPECT_EQ(ltd::value_at(sch, s.R + 1), s.max);
    EXPECT_EQ(ltd::value_at(sch, int64_t{1} << 40), s.max);
  }
  // Published values: 128 -> 2048, q 16, R 200000.
  const ltd::Schedule gpt{128, 2048, 200000, 16};
  EXPECT_EQ(ltd::value_at(gpt, 1), 128);
  EXPECT_EQ(ltd::value_at(gpt, 100001), 1088);  // 128 + 1920 / 2
  EXPECT_EQ(ltd::value_at(gpt, 10418), 224);    // 128 + 100.0032, rounded down to 16
  EXPECT_EQ(ltd::value_at(gpt, 200000), 2032);  // t = 199999: 2047.99, rounded down
  EXPECT_EQ(ltd::value_at(gpt, 200001), 2048);
  // min 8, q 16: DeepSpeed's rounding keeps 0 tokens while r < 16; Loom keeps min_value.
  const ltd::Schedule small{8, 2048, 1000, 16};
  EXPECT_EQ(ltd::value_at(small, 1), 8);   // t = 0: 8 -> 0 in DeepSpeed
  EXPECT_EQ(ltd::value_at(small, 4), 8);   // t = 3: 14.12 -> 0 in DeepSpeed
  EXPECT_EQ(ltd::value_at(small, 5), 16);  // t = 4: 16.16 -> 16
  EXPECT_EQ(ltd::value_at(small, 6), 16);  // t = 5: 18.2 -> 16
}

TEST(RouterLtd, KeptFollowsRoutingAndTraining) {
  const ltd::Schedule s{128, 2048, 200000, 16};
  EXPECT_EQ(ltd::kept_at(s, 1, 2048, true, true), 128);
  EXPECT_EQ(ltd::kept_at(s, 1, 2048, false, true), 2048);  // not a routed layer
  EXPECT_EQ(ltd::kept_at(s, 1, 2048, true, false), 2048);  // evaluation
  EXPECT_EQ(ltd::kept_at(s, 1, 100, true, true), 100);     // a curriculum-cut sequence
  EXPECT_EQ(ltd::kept_at(s, 300000, 4096, true, true), 2048);
}

template <class Fn>
std::string error_of(Fn&& fn, std::string* param = nullptr) {
  try {
    fn();
  } catch (const loom::sdk::Error& e) {
    if (param != nullptr) *param = e.param();
    return e.what();
  }
  return "";
}

TEST(RouterLtd, BadSchedulesNameTheParameter) {
  std::string param;
  EXPECT_NE(error_of(
                [] {
                  ltd::validate({0, 10, 5, 1}, "fixed_linear");
                },
                &param)
                .find("min_value is 0; must be >= 1"),
            std::string::npos);
  EXPECT_EQ(param, "min_value");
  EXPECT_NE(error_of(
                [] {
                  ltd::validate({10, 9, 5, 1}, "fixed_linear");
                },
                &param)
                .find("max_value (9) is below min_value (10)"),
            std::string::npos);
  EXPECT_EQ(param, "max_value");
  EXPECT_NE(error_of(
                [] {
                  ltd::validate({1, 9, 5, 1}, "fixed_root");
                },
                &param)
                .find("schedule_type is \"fixed_root\"; the only schedule random_ltd has is "
                      "\"fixed_linear\""),
            std::string::npos);
  EXPECT_EQ(param, "schedule_type");
  EXPECT_NE(error_of(
                [] {
                  ltd::validate({1, 9, 0, 1}, "fixed_linear");
                },
                &param)
                .find("must be"),
            std::string::npos);
  EXPECT_EQ(param, "require_steps");
  EXPECT_NE(error_of(
                [] {
                  ltd::validate({1, 9, 5, 0}, "fixed_linear");
                },
                &param)
                .find("must be"),
            std::string::npos);
  EXPECT_EQ(param, "seq_per_step");
  EXPECT_NE(error_of(
                [] {
                  (void)ltd::value_at({1, 9, 5, 1}, 0);
                },
                &param)
                .find("1-based"),
            std::string::npos);
}

TEST(RouterLtd, KeysAreTheCounterRngWords) {
  for (const int64_t sample : {int64_t{0}, int64_t{3}, int64_t{1} << 33}) {
    const uint64_t seed = 0x1234567890abcdefull;
    const ltd::KeyStream ks = ltd::key_stream(seed, 77, 5, sample);
    const loom::sdk::CounterRng rng(seed, 77, 5, static_cast<uint32_t>(sample), ltd::kPurpose);
    for (uint32_t p = 0; p < 41; ++p) {
      const uint64_t want = (uint64_t{rng.word(2 * p)} << 32) | rng.word(2 * p + 1);
      ASSERT_EQ(ltd::key_of(ks, p), want) << p;
    }
  }
}

// The `kept` smallest (key, position) pairs, in position order: a full sort.
std::vector<int32_t> reference_select(const ltd::SelectJob& j, int64_t b) {
  const ltd::KeyStream ks = ltd::key_stream(j.seed, j.step, j.layer, j.first_sample + b);
  std::vector<std::pair<uint64_t, int32_t>> all;
  for (int64_t p = 0; p < j.seq_len; ++p) {
    all.emplace_back(ltd::key_of(ks, static_cast<uint32_t>(p)), static_cast<int32_t>(p));
  }
  std::sort(all.begin(), all.end());
  std::vector<int32_t> out;
  for (int64_t i = 0; i < j.kept; ++i) out.push_back(all[static_cast<std::size_t>(i)].second);
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<int32_t> run(const ltd::SelectJob& j) {
  std::vector<int32_t> out(static_cast<std::size_t>(j.batch * j.kept), -1);
  ltd::select_cpu(j, out.data());
  return out;
}

void expect_rows_valid(const std::vector<int32_t>& idx, int64_t batch, int64_t kept,
                       int64_t seq_len) {
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < kept; ++i) {
      const int32_t v = idx[static_cast<std::size_t>(b * kept + i)];
      ASSERT_GE(v, 0);
      ASSERT_LT(v, seq_len);
      if (i > 0) {
        ASSERT_GT(v, idx[static_cast<std::size_t>(b * kept + i - 1)]) << b << ", " << i;
      }
    }
  }
}

TEST(RouterLtd, SelectIsTheSmallestKeysInOrder) {
  ltd::SelectJob j{42, 9, 3, 100, 5, 257, 60};
  const auto got = run(j);
  expect_rows_valid(got, j.batch, j.kept, j.seq_len);
  for (int64_t b = 0; b < j.batch; ++b) {
    const std::vector<int32_t> row(got.begin() + b * j.kept, got.begin() + (b + 1) * j.kept);
    EXPECT_EQ(row, reference_select(j, b)) << b;
  }
  // Every position kept: 0 .. S - 1. One kept.
  j.kept = j.seq_len;
  const auto all = run(j);
  for (int64_t i = 0; i < j.seq_len; ++i) ASSERT_EQ(all[static_cast<std::size_t>(i)], i);
  j.kept = 1;
  j.batch = 1;
  EXPECT_EQ(run(j), reference_select(j, 0));
  // Sequences of a batch differ; other steps, layers and seeds differ.
  ltd::SelectJob a{42, 9, 3, 0, 2, 512, 64};
  const auto r = run(a);
  EXPECT_NE(std::vector<int32_t>(r.begin(), r.begin() + 64),
            std::vector<int32_t>(r.begin() + 64, r.end()));
  for (int v = 0; v < 3; ++v) {
    ltd::SelectJob o = a;
    if (v == 0) o.step = 10;
    if (v == 1) o.layer = 4;
    if (v == 2) o.seed = 43;
    EXPECT_NE(run(o), r) << v;
  }
}

TEST(RouterLtd, SelectIsPureAcrossThreadsAndSplits) {
  const ltd::SelectJob whole{7, 1234, 2, 16, 12, 700, 128};
  std::vector<int32_t> base;
  for (const std::size_t threads : {1u, 3u, 8u}) {
    const TestPool pool(threads);
    const auto got = run(whole);
    if (base.empty()) {
      base = got;
      expect_rows_valid(base, whole.batch, whole.kept, whole.seq_len);
    }
    EXPECT_EQ(got, base) << threads << " threads";
  }
  // The same global batch split over three ranks (first_sample = each rank's offset).
  std::vector<int32_t> joined;
  for (const auto& [first, count] : {std::pair<int64_t, int64_t>{16, 5}, {21, 1}, {22, 6}}) {
    ltd::SelectJob part = whole;
    part.first_sample = first;
    part.batch = count;
    const auto got = run(part);
    joined.insert(joined.end(), got.begin(), got.end());
  }
  EXPECT_EQ(joined, base);
}

// How often each position is kept over many sequences: about N K / S each. The data are
// deterministic (fixed seeds), so the bounds (far outside what a uniform choice gives) cannot
// flake; they catch a biased or constant selection.
TEST(RouterLtd, SelectIsUniform) {
  const TestPool pool(2);
  const int64_t S = 64, K = 16, N = 4000;
  const ltd::SelectJob j{99, 5, 1, 0, N, S, K};
  const auto got = run(j);
  std::vector<double> hits(static_cast<std::size_t>(S), 0.0);
  for (const int32_t p : got) hits[static_cast<std::size_t>(p)] += 1;
  const double expect = static_cast<double>(N * K) / S;  // 1000, sd ~ 27
  double chi2 = 0;
  for (int64_t p = 0; p < S; ++p) {
    const double d = hits[static_cast<std::size_t>(p)] - expect;
    EXPECT_LT(std::abs(d), 250.0) << "position " << p;
    chi2 += d * d / expect;
  }
  // 63 degrees of freedom (scaled by 1 - K/S for sampling without replacement): mean ~47;
  // 250 is astronomically unlikely for a uniform choice.
  EXPECT_LT(chi2, 250.0);
  // Pairs: position 0 and 1 kept together about N (K/S)((K-1)/(S-1)) = 238 times.
  int together = 0;
  for (int64_t b = 0; b < N; ++b) {
    const auto* row = got.data() + b * K;
    together += (row[0] == 0 && row[1] == 1) ? 1 : 0;
  }
  EXPECT_GT(together, 120);
  EXPECT_LT(together, 400);
}

TEST(RouterLtd, LongSequences) {
  const TestPool pool(2);
  for (const auto& [S, K] : {std::pair<int64_t, int64_t>{32768, 4096}, {65536 + 1, 30001}}) {
    const ltd::SelectJob j{5, 3, 1, 0, 2, S, K};
    const auto got = run(j);
    expect_rows_valid(got, j.batch, j.kept, j.seq_len);
    const std::vector<int32_t> row(got.begin(), got.begin() + K);
    EXPECT_EQ(row, reference_select(j, 0)) << S;
  }
}

}  // namespace
