// `loom plugins`, `loom describe`, `loom check` and `loom validate-plugin` load plugin code in a
// child process: a plugin that crashes, hangs or exits while loading (cli/broken_plugins) is
// reported by file name with the reason, and the command goes on and exits 1, never dying of
// the plugin's signal.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "loom_test.hpp"

namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

struct Result {
  int exit_code = -1;  // -1 when it did not exit
  int signal = 0;      // the signal that ended it, 0 when none
  std::string out;
  std::string err;
};

std::string quote(const std::string& s) {
  std::string q = "'";
  for (const char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

fs::path broken(const std::string& name) {
  return fs::path(LOOM_BROKEN_PLUGIN_DIR) / ("loom_" + name + ".so");
}

// What each broken plugin's child dies of, as `loom plugins` words it.
struct Breakage {
  const char* name;
  const char* reason;
};
constexpr std::array<Breakage, 6> kBroken{{
    {"segv_entry", "the plugin crashed while loading (SIGSEGV)"},
    {"segv_ctor", "the plugin crashed while loading (SIGSEGV)"},
    {"garbage", "the plugin crashed while loading (SIGSEGV)"},
    {"abort", "the plugin crashed while loading (SIGABRT)"},
    {"exit", "the process exited with status 3 while loading the plugin"},
    {"hang", "the plugin did not finish loading within 1 s"},
}};

class PluginScan : public ::testing::Test {
 protected:
  // Runs `loom ARGS` with a 1 s scan limit (the hanging plugin), stdout and stderr apart.
  Result loom(const std::string& args) {
    const auto err_file = dir_.path() / "stderr.txt";
    const std::string cmd = "env LOOM_SCAN_TIMEOUT=1 " + quote(LOOM_CLI_PATH) + " " + args + " 2>" +
                            quote(err_file.string());
    Result r;
    FILE* pipe = ::popen(cmd.c_str(), "r");
    if (pipe == nullptr) return r;
    std::array<char, 4096> buf{};
    size_t n = 0;
    while ((n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0) r.out.append(buf.data(), n);
    const int status = ::pclose(pipe);
    if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
    if (WIFSIGNALED(status)) r.signal = WTERMSIG(status);
    std::ifstream in(err_file);
    std::ostringstream os;
    os << in.rdbuf();
    r.err = os.str();
    return r;
  }

  // A plugin folder with two good test plugins and the broken plugin `name`.
  fs::path folder_with(const std::string& name) {
    const fs::path dir = dir_.path() / ("plugins_" + name);
    fs::create_directory(dir);
    for (const char* good : {"probe", "oldminor"}) {
      fs::copy_file(loom_test::plugin_file(good), dir / ("loom_" + std::string(good) + ".so"));
    }
    fs::copy_file(broken(name), dir / broken(name).filename());
    return dir;
  }

  loom_test::TempDir dir_;
};

// The files come from the search path without loading any: this process would die of them.
TEST_F(PluginScan, ListPluginFilesLoadsNothing) {
  char* raw = nullptr;
  ASSERT_EQ(loom_list_plugin_files(nullptr, LOOM_BROKEN_PLUGIN_DIR, &raw), LOOM_OK)
      << loom_last_error();
  auto doc = nlohmann::json::parse(raw);
  loom_free_string(raw);
  EXPECT_EQ(doc["search_path"][0], LOOM_BROKEN_PLUGIN_DIR);
  std::vector<std::string> files;
  for (const auto& f : doc["files"]) files.push_back(f.get<std::string>());
  for (const auto& b : kBroken) {
    EXPECT_THAT(files, ::testing::Contains(broken(b.name).string()));
  }
  // One name: the file loom_describe_plugins would load, or none.
  ASSERT_EQ(loom_list_plugin_files("segv_ctor", LOOM_BROKEN_PLUGIN_DIR, &raw), LOOM_OK);
  doc = nlohmann::json::parse(raw);
  loom_free_string(raw);
  EXPECT_EQ(doc["files"], nlohmann::json::array({broken("segv_ctor").string()}));
  ASSERT_EQ(loom_list_plugin_files("nosuch", LOOM_BROKEN_PLUGIN_DIR, &raw), LOOM_OK);
  doc = nlohmann::json::parse(raw);
  loom_free_string(raw);
  EXPECT_TRUE(doc["files"].empty());
  EXPECT_EQ(loom_list_plugin_files(nullptr, nullptr, nullptr), LOOM_ERR_INVALID_ARGUMENT);
}

TEST_F(PluginScan, PluginsListsTheGoodOnesAndNamesTheBrokenOne) {
  for (const auto& b : kBroken) {
    SCOPED_TRACE(b.name);
    const fs::path dir = folder_with(b.name);
    const auto r = loom("plugins --plugin-path " + quote(dir.string()));
    EXPECT_EQ(r.signal, 0);
    EXPECT_EQ(r.exit_code, 1) << r.err;
    EXPECT_THAT(r.out, HasSubstr((dir / "loom_probe.so").string()));
    EXPECT_THAT(r.out, HasSubstr((dir / "loom_oldminor.so").string()));
    EXPECT_THAT(r.out, Not(HasSubstr("loom_" + std::string(b.name) + ".so")));
    EXPECT_THAT(r.err,
                HasSubstr("loom: " + (dir / broken(b.name).filename()).string() + ": " + b.reason));
    EXPECT_THAT(r.err, HasSubstr("; skipped\n"));
  }
}

TEST_F(PluginScan, PluginsJsonListsTheBrokenOneAsAnError) {
  const fs::path dir = folder_with("segv_ctor");
  const auto r = loom("plugins --json --plugin-path " + quote(dir.string()));
  EXPECT_EQ(r.exit_code, 1) << r.err;
  const auto doc = nlohmann::json::parse(r.out);
  bool probe = false;
  for (const auto& p : doc["plugins"]) probe = probe || p["name"] == "probe";
  EXPECT_TRUE(probe) << r.out;
  const std::string file = (dir / "loom_segv_ctor.so").string();
  bool named = false;
  for (const auto& e : doc["errors"]) {
    if (e["path"] == file) {
      named = true;
      EXPECT_EQ(e["error"], file + ": the plugin crashed while loading (SIGSEGV); skipped");
    }
  }
  EXPECT_TRUE(named) << r.out;
}

TEST_F(PluginScan, DescribeOfABrokenPluginExitsOneAndNamesIt) {
  for (const auto& b : kBroken) {
    SCOPED_TRACE(b.name);
    const auto r =
        loom(std::string("describe ") + b.name + " --plugin-path " + LOOM_BROKEN_PLUGIN_DIR);
    EXPECT_EQ(r.signal, 0);
    EXPECT_EQ(r.exit_code, 1) << r.err;
    EXPECT_EQ(r.out, "");
    EXPECT_THAT(r.err, HasSubstr("loom: " + broken(b.name).string() + ": " + b.reason));
    EXPECT_THAT(r.err, Not(HasSubstr("skipped")));
  }
}

TEST_F(PluginScan, CheckNamesTheBrokenPluginAManifestUses) {
  const auto file = dir_.write("m.toml",
                               "[optimizer.main]\nplugin = \"segv_entry\"\n\n"
                               "[comm.world]\nplugin = \"abort\"\n");
  const auto r = loom("check " + quote(file.string()) + " --plugin-path " +
                      quote(std::string(LOOM_BROKEN_PLUGIN_DIR)));
  EXPECT_EQ(r.signal, 0);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_EQ(r.out, "");
  EXPECT_THAT(r.err, HasSubstr("loom check: " + file.string() + ": plugin 'segv_entry' (" +
                               broken("segv_entry").string() +
                               "): the plugin crashed while loading (SIGSEGV)\n"));
  EXPECT_THAT(r.err, HasSubstr("plugin 'abort' (" + broken("abort").string() +
                               "): the plugin crashed while loading (SIGABRT)\n"));
  // Plugins that load still get the check in process, with its messages and exit status.
  const auto good = dir_.write("g.toml", "[optimizer.main]\nplugin = \"oldminor\"\n");
  const auto g = loom("check " + quote(good.string()) + " --plugin-path " +
                      quote(loom_test::plugin_dir().string()));
  EXPECT_EQ(g.exit_code, 0) << g.err;
  EXPECT_EQ(g.out, good.string() + ": ok\n");
}

TEST_F(PluginScan, ValidatePluginRunsAGoodPluginThroughEveryStage) {
#if !defined(LOOM_HAVE_ADAM)
  GTEST_SKIP() << "this build has no adam plugin";
#else
  const std::string adam = std::string(LOOM_BUNDLED_PLUGIN_DIR) + "/loom_adam.so";
  const auto r = loom("validate-plugin " + quote(adam));
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  const auto lines = loom_test::lines(r.out);
  ASSERT_EQ(lines.size(), 8U) << r.out;
  EXPECT_EQ(lines[0], "validating " + adam + " in a child process");
  EXPECT_THAT(lines[1], ::testing::StartsWith("  load: ok (adam "));
  const char* stages[] = {"schema", "create", "step", "state", "destroy"};
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_THAT(lines[2 + i],
                ::testing::StartsWith("  loom.optimizer/1 " + std::string(stages[i]) + ": ok"));
  }
  EXPECT_THAT(lines[5], HasSubstr("exported, imported and exported again: identical"));
  EXPECT_EQ(lines[7], "ok: 6 ok, 0 skipped, 0 failed");
  // By name, on the search path, the same.
  const auto by_name = loom("validate-plugin adam");
  EXPECT_EQ(by_name.exit_code, 0) << by_name.err;
  EXPECT_EQ(by_name.out, r.out);
#endif
}

TEST_F(PluginScan, ValidatePluginNamesTheStageABrokenPluginDiedIn) {
  const std::pair<const char*, const char*> cases[] = {
      {"segv_entry", "  load: failed: the plugin crashed in this stage (SIGSEGV)\n"},
      {"segv_ctor", "  load: failed: the plugin crashed in this stage (SIGSEGV)\n"},
      {"garbage", "  load: failed: the plugin crashed in this stage (SIGSEGV)\n"},
      {"abort", "  load: failed: the plugin crashed in this stage (SIGABRT)\n"},
      {"exit", "  load: failed: the process exited with status 3 in this stage"},
      {"hang", "  load: failed: no result within 1 s"},
      {"step_crash",
       "  loom.optimizer/1 step: failed: the plugin crashed in this stage (SIGSEGV)\n"},
  };
  for (const auto& [name, line] : cases) {
    SCOPED_TRACE(name);
    const auto r = loom("validate-plugin " + quote(broken(name).string()));
    EXPECT_EQ(r.signal, 0);
    EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
    EXPECT_THAT(r.out, HasSubstr(line));
    EXPECT_THAT(r.out, HasSubstr("\nFAILED: "));
  }
  // The stages before the crash ran, and passed.
  const auto r = loom("validate-plugin " + quote(broken("step_crash").string()));
  EXPECT_THAT(r.out, HasSubstr("  load: ok (step_crash 1.0.0"));
  EXPECT_THAT(r.out, HasSubstr("  loom.optimizer/1 create: ok"));
  EXPECT_THAT(r.out, HasSubstr("FAILED: 3 ok, 0 skipped, 1 failed\n"));
}

TEST_F(PluginScan, ValidatePluginSkipsWhatNeedsParametersAndFailsABadStateRoundTrip) {
  const auto dir = quote(loom_test::plugin_dir().string());
  // probe's optimizer requires `tag`: not a failure, the stages that need it are skipped.
  const auto probe = loom("validate-plugin probe --plugin-path " + dir);
  EXPECT_THAT(probe.out, HasSubstr("  loom.optimizer/1 create: skipped: needs parameters tag\n"));
  EXPECT_THAT(probe.out, HasSubstr("  loom.optimizer/1 destroy: skipped: needs parameters tag\n"));
  // state_counter counts its exports in its state, so a second export differs from the first.
  const auto counter = loom("validate-plugin state_counter --plugin-path " + dir);
  EXPECT_EQ(counter.exit_code, 1) << counter.out << counter.err;
  EXPECT_THAT(counter.out, HasSubstr("  loom.optimizer/1 state: failed: the state exported after "
                                     "importing it differs from the one imported"));
  EXPECT_THAT(counter.out, HasSubstr("  loom.optimizer/1 destroy: ok\n"));
  // An unknown name is the library's message, and loads nothing.
  const auto unknown = loom("validate-plugin prob --plugin-path " + dir);
  EXPECT_EQ(unknown.exit_code, 1);
  EXPECT_THAT(unknown.err, HasSubstr("unknown plugin 'prob' (did you mean 'probe'?)"));
}

}  // namespace
