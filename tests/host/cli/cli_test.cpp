// host/cli/main.cpp: the `loom` command, run as a user would run it.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <loom/abi.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

#include "abi_version.hpp"
#include "loom_test.hpp"

namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

struct Result {
  int exit_code = -1;
  std::string out;
  std::string err;
};

std::string quote(const std::string& s) {
  std::string q = "'";
  for (const char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

class Cli : public ::testing::Test {
 protected:
  // Runs `loom ARGS` with stdout and stderr captured separately.
  Result loom(const std::string& args) { return loom_env("", args); }
  // The same with VAR=VALUE assignments before the command.
  Result loom_env(const std::string& env, const std::string& args) {
    const auto err_file = dir_.path() / "stderr.txt";
    const std::string cmd = (env.empty() ? "" : "env " + env + " ") + quote(LOOM_CLI_PATH) + " " +
                            args + " 2>" + quote(err_file.string());
    Result r;
    FILE* pipe = ::popen(cmd.c_str(), "r");
    if (pipe == nullptr) return r;
    std::array<char, 4096> buf{};
    size_t n = 0;
    while ((n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0) r.out.append(buf.data(), n);
    const int status = ::pclose(pipe);
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    std::ifstream in(err_file);
    std::ostringstream os;
    os << in.rdbuf();
    r.err = os.str();
    return r;
  }
  std::string plugin_path() const {
    return "--plugin-path " + quote(loom_test::plugin_dir().string());
  }

  // The folder of `loom`, where the programs it runs are installed.
  static std::filesystem::path beside() {
    return std::filesystem::path(LOOM_CLI_PATH).parent_path();
  }
  static bool installed(const std::string& program) {
    return std::filesystem::exists(beside() / program);
  }
  // A usage error: exit 2, nothing on stdout, one line on stderr that names `command` and
  // points to its --help.
  static void expect_usage_error(const Result& r, const std::string& command,
                                 const std::string& problem) {
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_EQ(r.out, "");
    const auto l = loom_test::lines(r.err);
    ASSERT_EQ(l.size(), 1U) << r.err;
    EXPECT_THAT(l[0], StartsWith(command + ": "));
    EXPECT_THAT(l[0], HasSubstr(problem));
    EXPECT_THAT(l[0], ::testing::EndsWith("(see '" + command + " --help')"));
  }
  // Help text: no absolute path of the build or source tree (CLI11 would print argv[0]).
  static void expect_no_build_paths(const std::string& text) {
    EXPECT_THAT(text, Not(HasSubstr(beside().string())));
    EXPECT_THAT(text, Not(HasSubstr(beside().parent_path().string() + "/")));
  }

  loom_test::TempDir dir_;
};

TEST_F(Cli, VersionNamesTheAbi) {
  const auto r = loom("--version");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out,
            std::string("loom ") + LOOM_EXPECTED_VERSION + " (plugin ABI " + kHostAbi + ")\n");
}

TEST_F(Cli, VersionJsonNamesTheAbiAndTheDlpackItWasBuiltWith) {
  const auto r = loom("--version --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto doc = nlohmann::json::parse(r.out);
  EXPECT_EQ(doc["version"], LOOM_EXPECTED_VERSION);
  EXPECT_EQ(doc["abi"]["major"], 1);
  EXPECT_EQ(doc["abi"]["minor"], LOOM_ABI_MINOR);
  const std::string dlpack = doc["dlpack"]["version"];
  EXPECT_TRUE(std::regex_match(dlpack, std::regex("[0-9]+\\.[0-9]+"))) << dlpack;
  EXPECT_EQ(dlpack, std::to_string(DLPACK_VERSION / 100) + "." +
                        std::to_string(DLPACK_VERSION / 10 % 10));  // the headers built with
  const auto bare = loom("--json");
  EXPECT_EQ(bare.exit_code, 2);
  EXPECT_THAT(bare.err, HasSubstr("--version"));
}

TEST_F(Cli, CheckAcceptsAValidManifest) {
  const auto file = dir_.write("good.toml",
                               "[comm.world]\nplugin = \"probe\"\n\n[optimizer.main]\nplugin = "
                               "\"probe\"\ntag = \"t\"\ncomm = \"world\"\n");
  const auto r = loom("check " + quote(file.string()) + " " + plugin_path());
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, file.string() + ": ok\n");
  EXPECT_EQ(r.err, "");
}

// The kinds of ABI 1.3: [curriculum.NAME] and [sampler.NAME] sections, a sampler's REF to a
// curriculum checked by kind, and describe's view of both (plugin kinds13).
TEST_F(Cli, CheckAndDescribeTheCurriculumAndSamplerKinds) {
  const auto good = dir_.write("data.toml",
                               "[curriculum.lin]\nplugin = \"kinds13\"\ntotal_steps = 5\n\n"
                               "[sampler.s]\nplugin = \"kinds13\"\nschedule = \"lin\"\n");
  const auto r = loom("check " + quote(good.string()) + " " + plugin_path());
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, good.string() + ": ok\n");
  const auto bad = dir_.write("bad.toml",
                              "[comm.lin]\nplugin = \"probe\"\n\n"
                              "[sampler.s]\nplugin = \"kinds13\"\nschedule = \"lin\"\n");
  const auto b = loom("check " + quote(bad.string()) + " " + plugin_path());
  EXPECT_EQ(b.exit_code, 2) << b.out;
  EXPECT_THAT(b.err, HasSubstr(bad.string() +
                               ":6:12: parameter 'schedule' of sampler.s must name a "
                               "loom.curriculum/1 instance, but 'lin' is comm.lin (loom.comm/1)"));
  const auto d = loom("describe kinds13 " + plugin_path());
  EXPECT_EQ(d.exit_code, 0) << d.err;
  EXPECT_THAT(d.out, HasSubstr("loom.curriculum/1\n"));
  EXPECT_THAT(d.out, HasSubstr("  total_steps (an integer), default 10, range [1, 1000000000]\n"));
  EXPECT_THAT(d.out,
              HasSubstr("loom.sampler/1\n  schedule (the name of a loom.curriculum/1 instance)"));
}

// A launcher's variables in the environment (a job script that exports them) must not make
// `loom check` start a bootstrap: no error about missing RANK, no wait for other ranks.
TEST_F(Cli, CheckIgnoresLauncherVariables) {
  const auto file = dir_.write("good.toml", "[comm.world]\nplugin = \"probe\"\n");
  for (const std::string env : {"MASTER_ADDR=127.0.0.1 MASTER_PORT=29999",
                                "RANK=0 WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 "
                                "MASTER_PORT=29999 LOOM_BOOTSTRAP_TIMEOUT=30",
                                "LOOM_BOOTSTRAP=env RANK=1 WORLD_SIZE=2"}) {
    const auto r = loom_env(env, "check " + quote(file.string()) + " " + plugin_path());
    EXPECT_EQ(r.exit_code, 0) << env << ": " << r.err;
    EXPECT_EQ(r.out, file.string() + ": ok\n") << env;
  }
}

TEST_F(Cli, CheckRejectsAnInvalidManifestWithEveryError) {
  const auto file =
      dir_.write("bad.toml",
                 "[optimizer.main]\nplugin = \"probe\"\nweight_decay = 7\n"
                 "mode = \"adam\"\n\n[comm.world]\nplugin = \"probe\"\npeer = \"wrld\"\n");
  const auto r = loom("check " + quote(file.string()) + " " + plugin_path());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.out, "");
  const auto l = loom_test::lines(r.err);
  ASSERT_EQ(l.size(), 4U) << r.err;
  const std::regex shape(
      "^" + std::regex_replace(file.string(), std::regex(R"([.^$|()\[\]{}*+?\\])"), R"(\$&)") +
      ":[0-9]+:[0-9]+: .+$");
  for (const auto& line : l) EXPECT_TRUE(std::regex_match(line, shape)) << line;
  EXPECT_THAT(
      l[0], StartsWith(file.string() + ":1:1: optimizer.main is missing required parameter 'tag'"));
  EXPECT_THAT(l[1], StartsWith(file.string() + ":3:16: parameter 'weight_decay'"));
  EXPECT_THAT(l[2], StartsWith(file.string() + ":4:8: parameter 'mode'"));
  EXPECT_THAT(
      l[3], StartsWith(file.string() +
                       ":8:8: parameter 'peer' of comm.world references unknown instance 'wrld'"));
}

TEST_F(Cli, CheckOfAMissingFile) {
  const auto r = loom("check " + quote((dir_.path() / "nope.toml").string()));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("nope.toml: cannot open manifest"));
}

TEST_F(Cli, PluginsJsonListsTheTestPlugins) {
  const auto r = loom("plugins --json " + plugin_path());
  // The folder also holds deliberately broken plugins: they are listed as errors, and
  // their presence makes the exit code 1.
  EXPECT_EQ(r.exit_code, 1) << r.err;
  const auto doc = nlohmann::json::parse(r.out);
  ASSERT_TRUE(doc["plugins"].is_array());
  const nlohmann::json* probe = nullptr;
  for (const auto& p : doc["plugins"]) {
    if (p["name"] == "probe") probe = &p;
  }
  ASSERT_NE(probe, nullptr) << r.out;
  EXPECT_EQ((*probe)["version"], "1.2.3");
  EXPECT_EQ((*probe)["abi"], kHostAbi);
  EXPECT_EQ((*probe)["path"], loom_test::plugin_file("probe").string());
  ASSERT_EQ((*probe)["kinds"].size(), 2U);
  EXPECT_EQ((*probe)["kinds"][0]["kind"], "loom.optimizer/1");
  EXPECT_EQ((*probe)["kinds"][0]["has_state"], true);
  EXPECT_EQ((*probe)["kinds"][1]["kind"], "loom.comm/1");
  std::string errors;
  for (const auto& e : doc["errors"]) errors += e["path"].get<std::string>() + "\n";
  EXPECT_THAT(errors, HasSubstr("loom_major2.so"));
  EXPECT_THAT(errors, HasSubstr("loom_nosymbol.so"));
}

TEST_F(Cli, PluginsTableListsProbe) {
  const auto r = loom("plugins " + plugin_path());
  EXPECT_THAT(r.out, StartsWith("NAME"));
  EXPECT_TRUE(std::regex_search(
      r.out, std::regex("\nprobe +1\\.2\\.3 +" + std::to_string(LOOM_ABI_MAJOR) + "\\." +
                        std::to_string(LOOM_ABI_MINOR) + " +loom\\.optimizer/1,loom\\.comm/1 ")))
      << r.out;
  EXPECT_THAT(r.err, HasSubstr("built for Loom ABI 2"));
}

TEST_F(Cli, DescribeListsEveryParameter) {
  const auto r = loom("describe probe " + plugin_path());
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, StartsWith("probe 1.2.3: Test plugin"));
  EXPECT_THAT(r.out, HasSubstr("loom.optimizer/1 (exports state)"));
  EXPECT_THAT(r.out, HasSubstr("  tag (a string), required\n"));
  EXPECT_THAT(r.out, HasSubstr("  maximize (a boolean), default false\n"));
  EXPECT_THAT(r.out, HasSubstr("  start_step (an integer), default 0, range ["));
  EXPECT_THAT(r.out, HasSubstr("  weight_decay (a number), default 0.0, range [0.0, 1.0]\n"));
  EXPECT_THAT(r.out, HasSubstr("  mode (a string), default \"sgd\", one of sgd|signsgd\n"));
  EXPECT_THAT(r.out, HasSubstr("  expect_numels (an array of integers), default [], range ["));
  EXPECT_THAT(r.out, HasSubstr("  clip (an array of 2 numbers), default [-1e+30,1e+30]"));
  EXPECT_THAT(r.out, HasSubstr("  labels (an array of strings), default [\"probe\"]\n"));
  EXPECT_THAT(r.out, HasSubstr("  comm (the name of a loom.comm/1 instance)"));
  EXPECT_THAT(r.out, HasSubstr("loom.comm/1\n  peer (the name of a loom.comm/1 instance)"));
  EXPECT_THAT(r.out, HasSubstr("  fail_create (a boolean), default false\n"));
  EXPECT_THAT(r.out, HasSubstr("      L2 penalty added to the gradient.\n"));
}

TEST_F(Cli, DescribeShowsIntegerRangesAsIntegers) {
  // An integer parameter's bounds are integers: "[0.0, 1000000.0]" would suggest that
  // fractions are accepted.
  const auto r = loom("describe probe " + plugin_path());
  EXPECT_THAT(r.out, HasSubstr("  start_step (an integer), default 0, range [0, 1000000]\n"));
  EXPECT_THAT(
      r.out,
      HasSubstr("  expect_numels (an array of integers), default [], range [0, 1000000000]\n"));
  const auto j = loom("describe probe --json " + plugin_path());
  const auto doc = nlohmann::json::parse(j.out);
  EXPECT_TRUE(doc["kinds"][0]["params"][2]["max"].is_number_integer())
      << doc["kinds"][0]["params"][2];
}

TEST_F(Cli, DescribeShowsExclusiveAndExactBoundsAndTheCrossCheck) {
  // abi12 (ABI 1.2): exclusive bounds print with "(" / ")", exact int64 bounds in full.
  const auto r = loom("describe abi12 " + plugin_path());
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("loom.optimizer/1 (exports state) (checks its parameters "
                               "together)\n"));
  EXPECT_THAT(r.out, HasSubstr("  gain (a number), default 1.0, range (0.0, inf]\n"));
  EXPECT_THAT(r.out, HasSubstr("  ratio (a number), default 0.5, range (0.0, 1.0)\n"));
  EXPECT_THAT(r.out, HasSubstr("  seed (an integer), default 0, range [0, 9007199254740993]\n"));
  EXPECT_THAT(r.out, HasSubstr("  offsets (an array of integers), default [], range "
                               "(-9007199254740993, inf]\n"));
}

TEST_F(Cli, CheckReportsACrossParameterErrorAtTheBlamedKey) {
  const auto file = dir_.write("x.toml", "[optimizer.a]\nplugin = \"abi12\"\nlow = 3\nhigh = 2\n");
  const auto r = loom("check " + quote(file.string()) + " " + plugin_path());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.err, file.string() +
                       ":4:1: parameter 'high' of optimizer.a: must be greater than "
                       "low\n");
}

TEST_F(Cli, DescribeOptionalParameterWithoutDefaultSaysOptional) {
  // A parameter that is neither required nor has a default must not print a dangling
  // "default " with nothing after it.
  const auto r = loom("describe probe " + plugin_path());
  EXPECT_THAT(r.out, Not(HasSubstr(", default \n")));
  EXPECT_THAT(r.out, HasSubstr("  comm (the name of a loom.comm/1 instance), optional\n"));
  EXPECT_THAT(r.out, HasSubstr("  peer (the name of a loom.comm/1 instance), optional\n"));
}

TEST_F(Cli, DescribeJsonHasTheSchema) {
  const auto r = loom("describe probe --json " + plugin_path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto doc = nlohmann::json::parse(r.out);
  std::vector<std::string> names;
  for (const auto& p : doc["kinds"][0]["params"]) names.push_back(p["name"]);
  EXPECT_EQ(names, (std::vector<std::string>{"tag", "maximize", "start_step", "weight_decay",
                                             "mode", "expect_numels", "clip", "labels", "comm"}));
  const auto& clip = doc["kinds"][0]["params"][6];
  EXPECT_EQ(clip["type"], "float_list");
  EXPECT_EQ(clip["list_length"], 2);
  EXPECT_EQ(doc["kinds"][0]["params"][8]["ref_kind"], "loom.comm/1");
  EXPECT_EQ(doc["kinds"][0]["params"][0]["required"], true);
}

TEST_F(Cli, DescribeOldMinorShowsItsParameters) {
  const auto r = loom("describe oldminor " + plugin_path());
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("  scale (a number), default 1.0, range [0.0, 10.0]\n"));
  EXPECT_THAT(r.out, HasSubstr("  note (a string), default \"none\"\n"));
}

TEST_F(Cli, DescribeUnknownPluginFails) {
  const auto r = loom("describe prob " + plugin_path());
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("unknown plugin 'prob' (did you mean 'probe'?)"));
}

TEST_F(Cli, HelpListsEveryCommandAndExitsZero) {
  for (const std::string args : {"help", "--help", "-h"}) {
    const auto r = loom(args);
    EXPECT_EQ(r.exit_code, 0) << args << ": " << r.err;
    EXPECT_THAT(r.out, StartsWith("loom: a plugin host"));
    EXPECT_THAT(r.out, HasSubstr("Usage: loom [OPTIONS] [SUBCOMMAND]"));
    for (const char* cmd :
         {"plugins", "describe", "check", "quantize", "bench", "train", "data", "plot"}) {
      EXPECT_TRUE(std::regex_search(r.out, std::regex(std::string("\\n  ") + cmd + " +\\S")))
          << cmd << " in:\n"
          << r.out;
    }
    EXPECT_EQ(r.err, "");
    expect_no_build_paths(r.out);
  }
}

TEST_F(Cli, HelpOfEachCommandMatchesItsHelpOption) {
  for (const std::string cmd : {"plugins", "describe", "check", "quantize"}) {
    const auto a = loom("help " + cmd);
    const auto b = loom(cmd + " --help");
    EXPECT_EQ(a.exit_code, 0) << a.err;
    EXPECT_EQ(b.exit_code, 0) << b.err;
    EXPECT_THAT(a.out, HasSubstr("Usage: loom " + cmd + " [OPTIONS]"));
    EXPECT_EQ(a.out, b.out);
    expect_no_build_paths(a.out);
  }
  expect_usage_error(loom("help nosuch"), "loom help", "unknown command 'nosuch'");
}

TEST_F(Cli, HelpOfTheProgramsBesideLoom) {
  if (!installed("loom-train") || !installed("loom-data")) {
    GTEST_SKIP() << "loom-train and loom-data are not built beside loom";
  }
  const auto train = loom("help train");
  EXPECT_EQ(train.exit_code, 0) << train.err;
  EXPECT_THAT(train.out, HasSubstr("Usage: loom train [OPTIONS] CONFIG"));
  EXPECT_EQ(loom("train --help").out, train.out);
  expect_no_build_paths(train.out);
  const auto prepare = loom("help data prepare");
  EXPECT_EQ(prepare.exit_code, 0) << prepare.err;
  EXPECT_THAT(prepare.out, HasSubstr("Usage: loom data prepare [OPTIONS]"));
  EXPECT_EQ(loom("data prepare --help").out, prepare.out);
  const auto bare = loom("train");
  EXPECT_EQ(bare.exit_code, 2);
  EXPECT_THAT(bare.err, HasSubstr("Usage: loom train"));
}

TEST_F(Cli, BareLoomPrintsUsageAndExitsTwo) {
  const auto r = loom("");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.out, "");
  EXPECT_THAT(r.err, HasSubstr("Usage: loom [OPTIONS] [SUBCOMMAND]"));
}

TEST_F(Cli, UsageErrorsExitTwoWithOneLine) {
  // CLI11 would exit 106 (missing required), 109 (extras), 105 or 114 here.
  expect_usage_error(loom("check"), "loom check", "FILE is required");
  expect_usage_error(loom("describe"), "loom describe", "PLUGIN is required");
  expect_usage_error(loom("describe probe extra"), "loom describe", "extra");
  expect_usage_error(loom("plugins --nope"), "loom plugins", "--nope");
  expect_usage_error(loom("--nope"), "loom", "--nope");
  expect_usage_error(loom("frob"), "loom", "unknown command 'frob'");
  expect_usage_error(loom("plugin"), "loom", "unknown command 'plugin' (did you mean 'plugins'?)");
}

TEST_F(Cli, BenchHelpListsTheInstalledBenchmarks) {
  const auto r = loom("bench --help");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("Usage: loom bench NAME [ARGS...]"));
  EXPECT_THAT(r.out, HasSubstr("Benchmarks installed: "));
  EXPECT_THAT(r.out, Not(HasSubstr("not installed")));
  EXPECT_EQ(loom("help bench").out, r.out);
  if (installed("loom-bench-optim")) {
    EXPECT_THAT(r.out, HasSubstr("optim"));
  }

  const auto bare = loom("bench");
  EXPECT_EQ(bare.exit_code, 2);
  EXPECT_THAT(bare.err, HasSubstr("Usage: loom bench NAME"));
  expect_usage_error(loom("bench nosuch"), "loom bench", "no benchmark 'nosuch'; installed:");
  expect_usage_error(loom("bench --iters 3"), "loom bench",
                     "expected a benchmark NAME before '--iters'");
}

TEST_F(Cli, EveryBenchmarkHasOneHelpFormatWithDefaults) {
  size_t seen = 0;
  for (const auto& e : std::filesystem::directory_iterator(beside())) {
    const std::string f = e.path().filename().string();
    if (f.rfind("loom-bench-", 0) != 0) continue;
    const std::string name = f.substr(11);
    ++seen;
    const auto r = loom("bench " + name + " --help");
    EXPECT_EQ(r.exit_code, 0) << name << ": " << r.err;
    EXPECT_THAT(r.out, HasSubstr("\nUsage: loom bench " + name + " [OPTIONS]\n")) << r.out;
    EXPECT_THAT(r.out, HasSubstr("\nOptions:\n  -h,--help "));
    EXPECT_THAT(r.out, HasSubstr("(default: ")) << r.out;
    expect_no_build_paths(r.out);
    EXPECT_EQ(loom("help bench " + name).out, r.out);
    expect_usage_error(loom("bench " + name + " --no-such-option"), "loom bench " + name,
                       "--no-such-option");
  }
  if (seen == 0) GTEST_SKIP() << "no loom-bench-* program is built beside " << LOOM_CLI_PATH;
}

TEST_F(Cli, BenchmarkSizesAreStrict) {
  if (!installed("loom-bench-optim")) GTEST_SKIP() << "loom-bench-optim is not built";
  for (const std::string bad : {"1X", "1MX", "-1", "0", "M", "1.5"}) {
    expect_usage_error(loom("bench optim --sizes 1M," + bad), "loom bench optim",
                       "--sizes: '" + bad + "' is not a size");
  }
  expect_usage_error(loom("bench optim --iters 0"), "loom bench optim", "--iters: '0'");
  if (installed("loom-bench-comm")) {  // parses before MPI_Init: no mpirun needed
    expect_usage_error(loom("bench comm --max-bytes 1X"), "loom bench comm",
                       "--max-bytes: '1X' is not a size");
    expect_usage_error(loom("bench comm --sizes 1X"), "loom bench comm", "--sizes");
    expect_usage_error(loom("bench comm --min-bytes 4M --max-bytes 1M"), "loom bench comm",
                       "--min-bytes 4M is larger than --max-bytes 1M");
  }
}

TEST_F(Cli, CheckOfAFolderIsAnError) {
  const auto r = loom("check " + quote(dir_.path().string()) + " " + plugin_path());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.out, "");
  EXPECT_THAT(r.err, HasSubstr(dir_.path().string() + ": is a folder, not a manifest file"));
}

TEST_F(Cli, CheckPrintsNumbersInShortestForm) {
  const auto file = dir_.write("num.toml",
                               "[optimizer.main]\nplugin = \"probe\"\ntag = \"t\"\n"
                               "weight_decay = 1.1\n");
  const auto r = loom("check " + quote(file.string()) + " " + plugin_path());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("optimizer.main = 1.1 is out of range [0, 1]")) << r.err;
  EXPECT_THAT(r.err, Not(HasSubstr("1.1000000000000001")));
  const auto tiny = dir_.write("tiny.toml",
                               "[optimizer.main]\nplugin = \"probe\"\ntag = \"t\"\n"
                               "weight_decay = -1e-6\n");
  const auto t = loom("check " + quote(tiny.string()) + " " + plugin_path());
  EXPECT_EQ(t.exit_code, 2);
  EXPECT_THAT(t.err, HasSubstr("optimizer.main = -1e-06 is out of range [0, 1]")) << t.err;
}

TEST_F(Cli, CheckValidatesATrainerConfigAndItsManifest) {
  if (!installed("loom-train") || !installed("loom-data")) {
    GTEST_SKIP() << "loom-train and loom-data are not built beside loom";
  }
  dir_.write("good.toml", "[optimizer.main]\nplugin = \"probe\"\ntag = \"t\"\n");
  dir_.write("bad.toml", "[optimizer.main]\nplugin = \"probe\"\nweight_decay = 7\n");
  std::string text;
  for (int i = 0; i < 4000; ++i) text += "the loom weaves " + std::to_string(i % 97) + " threads\n";
  const auto corpus = dir_.write("corpus.txt", text);
  const auto prep = loom("data prepare --input " + quote(corpus.string()) + " --output " +
                         quote((dir_.path() / "d.bin").string()));
  ASSERT_EQ(prep.exit_code, 0) << prep.err;
  auto config = [&](const std::string& name, const std::string& manifest,
                    const std::string& model) {
    return dir_.write(name, "[manifest]\npath = \"" + manifest +
                                "\"\ncomm = \"\"\n[model]\ncontext = 32\nlayers = 1\n" + model +
                                "[data]\ndataset = \"d.bin\"\n[train]\nseq_len = 32\n");
  };

  const auto ok = config("ok.toml", "good.toml", "heads = 2\ndim = 32\n");
  auto r = loom("check " + quote(ok.string()) + " " + plugin_path());
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, StartsWith(ok.string() + ": ok (trainer config"));

  // The config's own problems, all of them, in file order, with did-you-mean and values.
  const auto bad = dir_.write("t.toml",
                              "[manifest]\npath = \"good.toml\"\ncomm = \"\"\noptimiser = "
                              "\"x\"\n[model]\ndim = 130\nheads = 4\n"
                              "[data]\ndataset = \"d.bin\"\n[train]\nstepz = 3\nlr = 20.1\n");
  r = loom("check " + quote(bad.string()) + " " + plugin_path());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.out, "");
  const auto l = loom_test::lines(r.err);
  ASSERT_EQ(l.size(), 4U) << r.err;
  EXPECT_EQ(l[0], bad.string() +
                      ":4:1: [manifest] optimiser: unknown key (did you mean "
                      "'optimizer'?)");
  EXPECT_EQ(l[1], bad.string() + ":6:7: [model] dim 130 is not divisible by heads 4");
  EXPECT_EQ(l[2], bad.string() + ":11:1: [train] stepz: unknown key (did you mean 'steps'?)");
  EXPECT_EQ(l[3], bad.string() + ":12:6: [train] lr: 20.1 is out of range [0, 10]");

  // A trainer config whose `path` is misspelt is still read as a trainer config: the
  // trainer's own message, not libloom's "unknown section" ones.
  const auto typo = dir_.write("typo.toml",
                               "[manifest]\npth = \"good.toml\"\n[model]\ndim = 32\n"
                               "[train]\nsteps = 3\n");
  r = loom("check " + quote(typo.string()) + " " + plugin_path());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("did you mean 'path'?")) << r.err;
  EXPECT_THAT(r.err, Not(HasSubstr("unknown section"))) << r.err;

  // A sound config whose manifest is not: the manifest's errors, as loom check prints them.
  const auto man = config("m.toml", "bad.toml", "heads = 2\ndim = 32\n");
  r = loom("check " + quote(man.string()) + " " + plugin_path());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err,
              HasSubstr((dir_.path() / "bad.toml").string() + ":1:1: optimizer.main is "
                                                              "missing required parameter 'tag'"));
  EXPECT_THAT(r.err, HasSubstr((dir_.path() / "bad.toml").string() + ":3:16: parameter "
                                                                     "'weight_decay'"));

  // Both at once: the config's problems, then its manifest's.
  const auto both = config("both.toml", "bad.toml", "heads = 3\ndim = 32\n");
  r = loom("check " + quote(both.string()) + " " + plugin_path());
  EXPECT_EQ(r.exit_code, 2);
  const auto b = loom_test::lines(r.err);
  ASSERT_EQ(b.size(), 3U) << r.err;
  EXPECT_EQ(b[0], both.string() + ":8:7: [model] dim 32 is not divisible by heads 3");
  EXPECT_THAT(b[1], StartsWith((dir_.path() / "bad.toml").string() + ":1:1: "));
  EXPECT_THAT(b[2], StartsWith((dir_.path() / "bad.toml").string() + ":3:16: "));
}

}  // namespace
