// host/cli/main.cpp: the `loom` command, run as a user would run it.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

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
  Result loom(const std::string& args) {
    const auto err_file = dir_.path() / "stderr.txt";
    const std::string cmd = quote(LOOM_CLI_PATH) + " " + args + " 2>" + quote(err_file.string());
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

  loom_test::TempDir dir_;
};

TEST_F(Cli, VersionNamesTheAbi) {
  const auto r = loom("--version");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, std::string("loom ") + LOOM_EXPECTED_VERSION + " (plugin ABI 1.1)\n");
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
  EXPECT_EQ((*probe)["abi"], "1.1");
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
      r.out, std::regex(R"(\nprobe +1\.2\.3 +1\.1 +loom\.optimizer/1,loom\.comm/1 )")))
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

}  // namespace
