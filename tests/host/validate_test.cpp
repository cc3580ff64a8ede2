// host/src/validate.cpp: a manifest checked against the schemas its plugins publish
// (the probe plugin's schema uses every parameter type), references resolved, cycles and
// duplicates found. One test per error class; each asserts the text and FILE:LINE:COL.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <regex>

#include "loom_test.hpp"

namespace {

using ::testing::EndsWith;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

class Validate : public loom_test::ManifestTest {
 protected:
  // An optimizer.main of the probe plugin with `extra` lines after its required tag
  // (line 3 is the first extra line).
  int32_t check_probe(const std::string& extra) {
    return check("[optimizer.main]\nplugin = \"probe\"\n" + extra + "\ntag = \"t\"\n");
  }
  std::string probe_path() const { return loom_test::plugin_file("probe").string(); }
};

TEST_F(Validate, EveryParameterTypeAccepted) {
  EXPECT_EQ(check("[comm.world]\nplugin = \"probe\"\n\n"
                  "[optimizer.main]\nplugin = \"probe\"\ntag = \"t\"\nmaximize = true\n"
                  "start_step = 1000000\nweight_decay = 1\nmode = \"signsgd\"\n"
                  "expect_numels = [0, 1000000000]\nclip = [-1, 1.5]\n"
                  "labels = [\"a\", \"b\"]\ncomm = \"world\"\n"),
            LOOM_OK)
      << error_;
}

TEST_F(Validate, UnknownParameterSuggestsTheClosestOne) {
  EXPECT_EQ(check_probe("weight_decy = 0.1"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_, at(3, 1) +
                        "unknown parameter 'weight_decy' for optimizer.main (plugin 'probe') (did "
                        "you mean 'weight_decay'?); it takes: tag, maximize, start_step, "
                        "weight_decay, mode, expect_numels, clip, labels, comm");
}

TEST_F(Validate, DeepSpeedKeysSayWhatLoomDoesInstead) {
  EXPECT_EQ(check_probe("lr = 0.001"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(error_, StartsWith(at(3, 1) + "unknown parameter 'lr' for optimizer.main"));
  EXPECT_THAT(error_, EndsWith("comm; 'lr' is a DeepSpeed key: Loom takes the learning rate "
                               "per step from the trainer or its scheduler, not from the "
                               "manifest"));
  EXPECT_EQ(check_probe("cuda_aware = false"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(error_, HasSubstr("'cuda_aware' is a DeepSpeed key: the transport is the [comm]"));
  // Only for optimizers, and only for DeepSpeed's keys.
  EXPECT_EQ(check("[comm.w]\nplugin = \"probe\"\nlr = 1\n"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(error_, Not(HasSubstr("DeepSpeed")));
  EXPECT_EQ(check_probe("momentum = 0.9"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(error_, Not(HasSubstr("DeepSpeed")));
}

TEST_F(Validate, WrongTypeScalar) {
  EXPECT_EQ(check_probe("maximize = \"yes\""), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_,
            at(3, 12) + "parameter 'maximize' of optimizer.main must be a boolean, not a string");
}

TEST_F(Validate, WrongTypeIntegerGivenAFloat) {
  EXPECT_EQ(check_probe("start_step = 1.5"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_,
            at(3, 14) + "parameter 'start_step' of optimizer.main must be an integer, not a float");
}

TEST_F(Validate, WrongTypeListGivenAScalar) {
  EXPECT_EQ(check_probe("clip = 1.0"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(
      error_,
      at(3, 8) + "parameter 'clip' of optimizer.main must be an array of 2 numbers, not a float");
}

TEST_F(Validate, WrongTypeListElement) {
  EXPECT_EQ(check_probe("labels = [\"a\", 2]"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(
      error_,
      at(3, 16) +
          "element 1 of parameter 'labels' of optimizer.main must be a string, not an integer");
}

TEST_F(Validate, FloatParameterAcceptsAnInteger) {
  EXPECT_EQ(check_probe("weight_decay = 1\nclip = [-2, 2]"), LOOM_OK) << error_;
}

TEST_F(Validate, OutOfRangeFloat) {
  EXPECT_EQ(check_probe("weight_decay = 2.5"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_,
            at(3, 16) + "parameter 'weight_decay' of optimizer.main = 2.5 is out of range [0, 1]");
}

TEST_F(Validate, OutOfRangeInt) {
  EXPECT_EQ(check_probe("start_step = -1"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(
      error_,
      at(3, 14) + "parameter 'start_step' of optimizer.main = -1 is out of range [0, 1000000]");
}

TEST_F(Validate, NanIsOutOfRange) {
  EXPECT_EQ(check_probe("weight_decay = nan"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_,
            at(3, 16) + "parameter 'weight_decay' of optimizer.main = nan is out of range [0, 1]");
}

TEST_F(Validate, OutOfRangeListElement) {
  EXPECT_EQ(check_probe("expect_numels = [4, -1]"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_, at(3, 21) +
                        "element 1 of parameter 'expect_numels' of optimizer.main = -1 is out of "
                        "range [0, 1000000000]");
}

TEST_F(Validate, ListOfTheWrongLength) {
  EXPECT_EQ(check_probe("clip = [1.0]"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_, at(3, 8) + "parameter 'clip' of optimizer.main must have 2 elements, not 1");
}

TEST_F(Validate, StringNotAmongTheChoices) {
  EXPECT_EQ(check_probe("mode = \"sgdd\""), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_, at(3, 8) +
                        "parameter 'mode' of optimizer.main = 'sgdd' is not one of 'sgd', "
                        "'signsgd' (did you mean 'sgd'?)");
}

TEST_F(Validate, MissingRequiredParameter) {
  EXPECT_EQ(check("[optimizer.main]\nplugin = \"probe\"\nmaximize = true\n"),
            LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_, at(1, 1) + "optimizer.main is missing required parameter 'tag' (a string)");
}

TEST_F(Validate, UnknownPluginSuggestsTheClosestOne) {
  EXPECT_EQ(check("[optimizer.main]\nplugin = \"prob\"\n"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(error_, StartsWith(at(2, 10) +
                                 "optimizer.main: unknown plugin 'prob' (did you mean 'probe'?); "
                                 "no loom_prob.so in " +
                                 loom_test::plugin_dir().string()));
  EXPECT_EQ(loom_test::lines(error_).size(), 1U);
}

TEST_F(Validate, PluginWithoutTheSectionsKind) {
  EXPECT_EQ(check("[codec.c]\nplugin = \"probe\"\n"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_, at(2, 10) + "codec.c: plugin 'probe' (" + probe_path() +
                        ") does not provide loom.codec/1 (it provides loom.optimizer/1, "
                        "loom.comm/1)");
}

TEST_F(Validate, UnknownReferenceSuggestsTheClosestName) {
  EXPECT_EQ(check("[comm.world]\nplugin = \"probe\"\n\n"
                  "[optimizer.main]\nplugin = \"probe\"\ntag = \"t\"\ncomm = \"wrld\"\n"),
            LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_, at(7, 8) +
                        "parameter 'comm' of optimizer.main references unknown instance 'wrld' "
                        "(did you mean 'world'?)");
}

TEST_F(Validate, ReferenceToAnInstanceOfTheWrongKind) {
  EXPECT_EQ(check("[optimizer.other]\nplugin = \"probe\"\ntag = \"o\"\n\n"
                  "[optimizer.main]\nplugin = \"probe\"\ntag = \"t\"\ncomm = \"other\"\n"),
            LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_, at(8, 8) +
                        "parameter 'comm' of optimizer.main must name a loom.comm/1 instance, but "
                        "'other' is optimizer.other (loom.optimizer/1)");
}

TEST_F(Validate, ReferenceMustBeAString) {
  EXPECT_EQ(check_probe("comm = 1"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_,
            at(3, 8) + "parameter 'comm' of optimizer.main must be a string, not an integer");
}

TEST_F(Validate, ReferenceCycleReportedOnceWithItsPath) {
  EXPECT_EQ(check("[comm.a]\nplugin = \"probe\"\npeer = \"b\"\n\n"
                  "[comm.b]\nplugin = \"probe\"\npeer = \"a\"\n"),
            LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_, at(7, 8) + "reference cycle: comm.a -> comm.b -> comm.a");
}

TEST_F(Validate, LongerCycleThroughAnOptimizer) {
  EXPECT_EQ(check("[optimizer.main]\nplugin = \"probe\"\ntag = \"t\"\ncomm = \"a\"\n\n"
                  "[comm.a]\nplugin = \"probe\"\npeer = \"b\"\n\n"
                  "[comm.b]\nplugin = \"probe\"\npeer = \"c\"\n\n"
                  "[comm.c]\nplugin = \"probe\"\npeer = \"a\"\n"),
            LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_, at(16, 8) + "reference cycle: comm.a -> comm.b -> comm.c -> comm.a");
}

TEST_F(Validate, SelfReferenceIsACycle) {
  EXPECT_EQ(check("[comm.a]\nplugin = \"probe\"\npeer = \"a\"\n"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_, at(3, 8) + "reference cycle: comm.a -> comm.a");
}

TEST_F(Validate, DuplicateInstanceNameAcrossKinds) {
  // The error points at the second declaration and names the first one's place.
  EXPECT_EQ(check("[optimizer.main]\nplugin = \"probe\"\ntag = \"t\"\n\n"
                  "[comm.main]\nplugin = \"probe\"\n"),
            LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_, at(5, 1) +
                        "duplicate instance name 'main': comm.main and optimizer.main (declared at "
                        "1:1); names must be unique across all kinds");
}

TEST_F(Validate, EveryErrorOfAManifestIsReportedInOneRun) {
  const std::string toml =
      "[loom]\n"
      "abi = 1\n"
      "log_levl = \"info\"\n"  // 3: unknown [loom] key
      "\n"
      "[optimzer.x]\n"  // 5: unknown section
      "plugin = \"probe\"\n"
      "\n"
      "[optimizer.main]\n"  // 8: missing required 'tag'
      "plugin = \"probe\"\n"
      "weight_decay = 3.0\n"  // 10: out of range
      "mode = 1\n"            // 11: wrong type
      "comm = \"nobody\"\n"   // 12: unknown reference
      "lables = []\n"         // 13: unknown parameter
      "\n"
      "[comm.world]\n"
      "plugin = \"nosuchplugin\"\n";  // 16: unknown plugin
  EXPECT_EQ(check(toml), LOOM_ERR_INVALID_ARGUMENT);
  const auto l = loom_test::lines(error_);
  ASSERT_EQ(l.size(), 8U) << error_;
  // Sorted by position, each with its own FILE:LINE:COL.
  EXPECT_THAT(l[0], StartsWith(at(3, 1) + "unknown key 'log_levl'"));
  EXPECT_THAT(l[1], StartsWith(at(5, 2) + "unknown section 'optimzer'"));
  EXPECT_THAT(l[2], StartsWith(at(8, 1) + "optimizer.main is missing required parameter 'tag'"));
  EXPECT_THAT(l[3], StartsWith(at(10, 16) + "parameter 'weight_decay'"));
  EXPECT_THAT(l[4], StartsWith(at(11, 8) + "parameter 'mode' of optimizer.main must be a string"));
  EXPECT_THAT(l[5],
              StartsWith(at(12, 8) + "parameter 'comm' of optimizer.main references unknown"));
  EXPECT_THAT(l[6], StartsWith(at(13, 1) + "unknown parameter 'lables'"));
  EXPECT_THAT(l[7], StartsWith(at(16, 10) + "comm.world: unknown plugin 'nosuchplugin'"));
  const std::regex shape("^.+:[0-9]+:[0-9]+: .+$");
  for (const auto& line : l) EXPECT_TRUE(std::regex_match(line, shape)) << line;
}

TEST_F(Validate, InvalidManifestCreatesNothing) {
  auto* events = [&] {
    EXPECT_EQ(open("[comm.world]\nplugin = \"probe\"\n"), LOOM_OK) << error_;
    return loom_test::probe_event_log(session_, "world");
  }();
  ASSERT_NE(events, nullptr);
  loom_close(session_);
  session_ = nullptr;
  loom_test::take_events(events);
  EXPECT_EQ(open("[comm.world]\nplugin = \"probe\"\n[optimizer.main]\nplugin = \"probe\"\n"),
            LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(session_, nullptr);
  EXPECT_EQ(loom_test::take_events(events), "");
}

}  // namespace
