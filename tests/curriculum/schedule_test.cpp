// The curriculum schedules (plugins/data/curriculum/schedule.hpp) against the formulas written
// out here, DeepSpeed's published and unit-test values, and Loom's two changes (the clamp to
// min_difficulty, frozen at the maximum).
#include <gtest/gtest.h>
#include <loom/sdk/status.hpp>

#include <cmath>
#include <cstdint>
#include <map>
#include <string>

#include "schedule.hpp"

namespace {

namespace cl = loom::data::curriculum;

cl::RootSchedule root(double lo, double hi, int64_t total, int64_t q, double k = 1) {
  cl::RootSchedule s;
  s.min_difficulty = lo;
  s.max_difficulty = hi;
  s.total_curriculum_step = total;
  s.difficulty_step = q;
  s.root_degree = k;
  return s;
}

// The formula as DeepSpeed writes it (Python floats: fp64 pow), plus Loom's clamp to
// [min, max], written independently: the rounding to a multiple of q in integers (floor
// division). No rule for steps from T on: the tests check that one on its own.
double reference(const cl::RootSchedule& s, int64_t step) {
  const double v =
      std::pow(static_cast<double>(step) / static_cast<double>(s.total_curriculum_step),
               1.0 / s.root_degree);
  auto d = static_cast<int64_t>(
      std::floor(v * (s.max_difficulty - s.min_difficulty) + s.min_difficulty));
  const int64_t q = s.difficulty_step;
  d = (d >= 0 ? d / q : -((-d + q - 1) / q)) * q;  // floor to a multiple of q
  double r = std::min(static_cast<double>(d), s.max_difficulty);
  return std::max(r, s.min_difficulty);
}

// Expect loom::sdk::Error naming `key` with `text` in its message.
template <class F>
void expect_error(F&& f, const std::string& key, const std::string& text) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one at " << key;
  } catch (const loom::sdk::Error& e) {
    EXPECT_EQ(e.param(), key) << e.what();
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    EXPECT_EQ(e.code(), LOOM_ERR_INVALID_ARGUMENT);
  }
}

TEST(CurriculumSchedule, VocabularyPercentileWorkedValues) {
  // voc percentile 1 -> 100, root 2, q 1, T 110000 (DeepSpeed's GPT-3 recipe).
  const auto s = root(1, 100, 110000, 1, 2);
  cl::validate(s);
  const std::map<int64_t, double> expected = {{1, 1},      {1000, 10},  {10000, 30},
                                              {27500, 50}, {55000, 71}, {110000, 100}};
  for (const auto& [step, d] : expected) EXPECT_EQ(cl::difficulty_at(s, step), d) << step;
}

TEST(CurriculumSchedule, SeqlenLinearWorkedValues) {
  // seqlen 80 -> 2048, linear, q 8, T 110000.
  const auto s = root(80, 2048, 110000, 8);
  const std::map<int64_t, double> expected = {{1, 80},       {1000, 96},     {10000, 256},
                                              {55000, 1064}, {110000, 2048}, {200000, 2048}};
  for (const auto& [step, d] : expected) {
    EXPECT_EQ(cl::difficulty_at(s, step), d) << step;
    EXPECT_EQ(cl::seq_len_at(s, step), static_cast<int64_t>(d)) << step;
  }
}

TEST(CurriculumSchedule, DeepSpeedFixedLinearUnitTest) {
  // 2 -> 10, T 8, q 2: DeepSpeed's test expects these at steps 1..10.
  const auto s = root(2, 10, 8, 2);
  const std::map<int64_t, double> expected = {{1, 2}, {2, 4}, {3, 4},  {4, 6},  {5, 6},
                                              {6, 8}, {7, 8}, {8, 10}, {9, 10}, {10, 10}};
  for (const auto& [step, d] : expected) EXPECT_EQ(cl::difficulty_at(s, step), d) << step;
  // The same with root_degree 1 through the root form.
  const auto r = root(2, 10, 8, 2, 1.0);
  for (const auto& [step, d] : expected) EXPECT_EQ(cl::difficulty_at(r, step), d) << step;
}

TEST(CurriculumSchedule, DeepSpeedFixedDiscreteUnitTest) {
  cl::DiscreteSchedule s;
  s.difficulty = {1, 2, 3, 4, 5};
  s.max_step = {2, 4, 6, 8};
  cl::validate(s);
  const std::map<int64_t, double> expected = {{1, 1}, {2, 1}, {3, 2}, {4, 2}, {5, 3},
                                              {6, 3}, {7, 4}, {8, 4}, {9, 5}, {1000000, 5}};
  for (const auto& [step, d] : expected) EXPECT_EQ(cl::difficulty_at(s, step), d) << step;
}

TEST(CurriculumSchedule, FormulaAtManySteps) {
  const cl::RootSchedule cases[] = {root(1, 100, 110000, 1, 2), root(80, 2048, 110000, 8),
                                    root(8, 1024, 4500, 8, 3),  root(5, 100, 960000, 1, 2),
                                    root(64, 1024, 45000, 16),  root(0, 1, 7, 1, 0.5),
                                    root(-50, 50, 1000, 3, 1.5)};
  for (const auto& s : cases) {
    cl::validate(s);
    double prev = -1e300;
    for (int64_t step = 1; step <= s.total_curriculum_step + 100;
         step += 1 + s.total_curriculum_step / 997) {
      const double d = cl::difficulty_at(s, step);
      if (step < s.total_curriculum_step) {
        EXPECT_EQ(d, reference(s, step)) << "step " << step << " T " << s.total_curriculum_step;
      } else {
        // Loom's rule from T on (the formula may round max down at T).
        EXPECT_EQ(d, s.max_difficulty) << "step " << step << " T " << s.total_curriculum_step;
      }
      EXPECT_GE(d, prev) << "not monotone at step " << step;
      EXPECT_GE(d, s.min_difficulty);
      EXPECT_LE(d, s.max_difficulty);
      prev = d;
    }
  }
}

TEST(CurriculumSchedule, HugeFiniteBoundsStayFinite) {
  // The largest spans validate accepts: every step's difficulty is finite and in [min, max].
  const cl::RootSchedule cases[] = {root(-8e307, 8e307, 1000, 8), root(0, 1.7e308, 50, 1, 3),
                                    root(-1.7e308, 0, 50, 1024, 0.5)};
  for (const auto& s : cases) {
    cl::validate(s);
    for (int64_t step = 1; step <= s.total_curriculum_step + 2; ++step) {
      const double d = cl::difficulty_at(s, step);
      EXPECT_TRUE(std::isfinite(d)) << "step " << step;
      EXPECT_GE(d, s.min_difficulty) << "step " << step;
      EXPECT_LE(d, s.max_difficulty) << "step " << step;
    }
  }
}

TEST(CurriculumSchedule, ClampedToMin) {
  // min 1, q 8: DeepSpeed's rounding gives 0 at step 1; Loom keeps min.
  const auto s = root(1, 1024, 1000, 8);
  EXPECT_EQ(cl::difficulty_at(s, 1), 1);
  EXPECT_EQ(cl::seq_len_at(s, 1), 1);
  // Still 1 until the formula reaches 8, then multiples of 8.
  EXPECT_EQ(cl::difficulty_at(s, 6), 1);      // floor(6/1000*1023+1) = 7 -> 0 -> 1
  EXPECT_EQ(cl::difficulty_at(s, 7), 8);      // floor(8.16) = 8
  EXPECT_EQ(cl::difficulty_at(s, 500), 512);  // floor(0.5 * 1023 + 1) = 512
}

TEST(CurriculumSchedule, FrozenAtMax) {
  // From T on the difficulty is max, also when max is not a multiple of q (DeepSpeed rounds
  // it down to 2040 at T).
  const auto s = root(8, 2047, 1000, 8);
  EXPECT_EQ(cl::difficulty_at(s, 999), 2040);  // floor(0.999 * 2039 + 8) = 2044 -> 2040
  EXPECT_EQ(cl::difficulty_at(s, 1000), 2047);
  EXPECT_EQ(cl::difficulty_at(s, 1001), 2047);
  EXPECT_EQ(cl::difficulty_at(s, INT64_MAX), 2047);
  // A discrete schedule that steps down after its maximum stays at the maximum.
  cl::DiscreteSchedule d;
  d.difficulty = {10, 40, 20, 30};
  d.max_step = {5, 10, 15};
  EXPECT_EQ(cl::difficulty_at(d, 5), 10);
  EXPECT_EQ(cl::difficulty_at(d, 6), 40);
  EXPECT_EQ(cl::difficulty_at(d, 11), 40);
  EXPECT_EQ(cl::difficulty_at(d, 16), 40);
  // min == max: constant.
  const auto c = root(512, 512, 10, 8);
  for (int64_t step = 1; step < 20; ++step) EXPECT_EQ(cl::difficulty_at(c, step), 512);
}

TEST(CurriculumSchedule, BadParameters) {
  expect_error([] { cl::validate(root(10, 2, 8, 2)); }, "min_difficulty", "above max_difficulty");
  expect_error([] { cl::validate(root(1, 2, 0, 1)); }, "total_curriculum_step", ">= 1");
  expect_error([] { cl::validate(root(1, 2, -5, 1)); }, "total_curriculum_step", "-5");
  expect_error([] { cl::validate(root(1, 2, 5, 0)); }, "difficulty_step", ">= 1");
  expect_error([] { cl::validate(root(1, 2, 5, 1, 0)); }, "root_degree", "> 0");
  expect_error([] { cl::validate(root(1, 2, 5, 1, -1)); }, "root_degree", "> 0");
  expect_error([] { cl::validate(root(NAN, 2, 5, 1)); }, "min_difficulty", "not finite");
  expect_error([] { cl::validate(root(1, INFINITY, 5, 1)); }, "max_difficulty", "not finite");
  // Finite bounds whose difference is not: the formula would give inf and NaN.
  expect_error([] { cl::validate(root(-1e308, 1e308, 5, 1)); }, "max_difficulty",
               "(1e+308) minus min_difficulty (-1e+308) is not a finite number");
  expect_error([] { cl::validate(root(-1.7e308, 0.5e308, 5, 8, 2)); }, "max_difficulty",
               "not a finite number");
  // Small values print as themselves (not rounded to six decimals).
  expect_error([] { cl::validate(root(2e-7, 1e-7, 5, 1)); }, "min_difficulty",
               "(2e-07) is above max_difficulty (1e-07)");
  cl::DiscreteSchedule d;
  d.difficulty = {1, 2, 3};
  d.max_step = {2, 4, 6};
  expect_error([&] { cl::validate(d); }, "difficulty", "needs one more than max_step");
  d.difficulty = {1, 2, 3, 4};
  d.max_step = {2, 4, 4};
  expect_error([&] { cl::validate(d); }, "max_step", "strictly increasing");
  d.max_step = {0, 4, 5};
  expect_error([&] { cl::validate(d); }, "max_step", ">= 1");
  d.max_step = {2, 4, 5};
  d.difficulty = {1, 2, NAN, 4};
  expect_error([&] { cl::validate(d); }, "difficulty", "entry 2 is not finite");
  // Steps are 1-based.
  const auto s = root(1, 2, 5, 1);
  expect_error([&] { (void)cl::difficulty_at(s, 0); }, "step", "1-based");
  d.difficulty = {1, 2, 3, 4};
  expect_error([&] { (void)cl::difficulty_at(d, -3); }, "step", "is -3");
}

}  // namespace
