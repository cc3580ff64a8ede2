// The command-line conventions of loom-train, loom-data and loom-plot, run as a user runs
// them: --help on stdout with exit 0 and no build paths, a bare run prints usage and exits 2,
// a usage error is one line with a pointer to --help and exit 2, bad paths and values are
// errors (never silently created folders or formats), and long work reports progress.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "corpus.hpp"

namespace fs = std::filesystem;

namespace {

struct Result {
  int code = -1;
  std::string out, err;
};

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

std::vector<std::string> lines(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

class Programs : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("loom-programs-cli-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  Result run(const std::string& program, const std::string& args, const std::string& env = "") {
    const fs::path o = dir_ / "stdout.txt", e = dir_ / "stderr.txt";
    const std::string cmd = "cd '" + dir_.string() + "' && " + env + " '" + program + "' " + args +
                            " >'" + o.string() + "' 2>'" + e.string() + "'";
    const int st = std::system(cmd.c_str());
    Result r;
    r.code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    r.out = slurp(o);
    r.err = slurp(e);
    return r;
  }
  void write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name, std::ios::binary) << text;
  }
  static void expect_usage_error(const Result& r, const std::string& command,
                                 const std::string& problem) {
    EXPECT_EQ(r.code, 2) << r.err;
    EXPECT_EQ(r.out, "");
    const auto l = lines(r.err);
    ASSERT_EQ(l.size(), 1U) << r.err;
    EXPECT_EQ(l[0].rfind(command + ": ", 0), 0U) << l[0];
    EXPECT_NE(l[0].find(problem), std::string::npos) << l[0];
    const std::string tail = "(see '" + command + " --help')";
    EXPECT_TRUE(l[0].size() >= tail.size() &&
                l[0].compare(l[0].size() - tail.size(), tail.size(), tail) == 0)
        << l[0];
  }
  static void expect_help(const Result& r, const std::string& usage) {
    EXPECT_EQ(r.code, 0) << r.err;
    EXPECT_NE(r.out.find("Usage: " + usage), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find(fs::path(LOOM_TRAIN_EXE).parent_path().string()), std::string::npos)
        << "help shows a build path:\n"
        << r.out;
  }
  fs::path dir_;
};

TEST_F(Programs, HelpOnStdoutWithDefaults) {
  auto r = run(LOOM_TRAIN_EXE, "--help");
  expect_help(r, "loom train [OPTIONS] CONFIG");
  EXPECT_NE(r.out.find("--stop-after STEP"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("(default: -1)"), std::string::npos) << r.out;
  expect_help(run(LOOM_DATA_EXE, "--help"), "loom data [OPTIONS] SUBCOMMAND");
  r = run(LOOM_DATA_EXE, "prepare --help");
  expect_help(r, "loom data prepare [OPTIONS]");
  EXPECT_NE(r.out.find("(default: 0.05)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("(default: byte)"), std::string::npos) << r.out;
  expect_help(run(LOOM_PLOT_EXE, "--help"), "loom plot [OPTIONS] RUN_DIR...");
}

TEST_F(Programs, BareRunPrintsUsageAndExitsTwo) {
  for (const auto& [exe, usage] :
       std::vector<std::pair<std::string, std::string>>{{LOOM_TRAIN_EXE, "loom train"},
                                                        {LOOM_DATA_EXE, "loom data"},
                                                        {LOOM_PLOT_EXE, "loom plot"}}) {
    const auto r = run(exe, "");
    EXPECT_EQ(r.code, 2) << exe;
    EXPECT_EQ(r.out, "");
    EXPECT_NE(r.err.find("Usage: " + usage), std::string::npos) << r.err;
  }
}

TEST_F(Programs, UsageErrorsAreOneLineAndExitTwo) {
  expect_usage_error(run(LOOM_TRAIN_EXE, "c.toml --resume --fresh"), "loom train",
                     "--resume excludes --fresh");
  expect_usage_error(run(LOOM_TRAIN_EXE, "c.toml --steps abc"), "loom train",
                     "--steps: 'abc' is not a whole number");
  expect_usage_error(run(LOOM_TRAIN_EXE, "a.toml b.toml"), "loom train", "b.toml");
  expect_usage_error(run(LOOM_DATA_EXE, "prepare --output x.bin"), "loom data prepare",
                     "--input is required");
  expect_usage_error(run(LOOM_DATA_EXE, "frob"), "loom data",
                     "unknown command 'frob' (one of: prepare, info, analyze)");
  expect_usage_error(run(LOOM_DATA_EXE, "prepare --input a --output b --tokenizer wordpiece"),
                     "loom data prepare", "wordpiece");
  expect_usage_error(run(LOOM_DATA_EXE, "prepare --input a --output b --heldout-fraction 1"),
                     "loom data prepare", "--heldout-fraction: '1' is not a number in [0, 1)");
  expect_usage_error(run(LOOM_PLOT_EXE, "run"), "loom plot", "--output is required");
}

TEST_F(Programs, DataRefusesVocabSizeWithTheByteTokenizer) {
  write("c.txt", "some text\n");
  expect_usage_error(run(LOOM_DATA_EXE, "prepare --input c.txt --output x.bin --vocab-size 300"),
                     "loom data prepare", "--vocab-size applies to --tokenizer bpe");
  EXPECT_FALSE(fs::exists(dir_ / "x.bin"));
}

TEST_F(Programs, DataCreatesNoFolderTheUserDidNotAskFor) {
  write("c.txt", loom::trainer::test_corpus::generated_corpus(30000));
  const auto r = run(LOOM_DATA_EXE, "prepare --input c.txt --output missing/dir/x.bin");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("missing/dir/x.bin: the folder missing/dir does not exist"),
            std::string::npos)
      << r.err;
  EXPECT_FALSE(fs::exists(dir_ / "missing"));
  // Control: the same into a folder that exists.
  fs::create_directories(dir_ / "out");
  EXPECT_EQ(run(LOOM_DATA_EXE, "prepare --input c.txt --output out/x.bin").code, 0);
  EXPECT_TRUE(fs::exists(dir_ / "out/x.bin"));
}

TEST_F(Programs, DataRefusesAnEmptyHeldoutSplitWithTheFix) {
  write("small.txt", loom::trainer::test_corpus::generated_corpus(3000).substr(0, 3000));
  auto r = run(LOOM_DATA_EXE, "prepare --input small.txt --output s.bin");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("s.bin: the heldout split would have 0 tokens: 3000 tokens make 3 "
                       "block(s) of 1024"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("use --heldout-fraction 0.34 or more"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(dir_ / "s.bin"));
  // The fix it names works.
  r = run(LOOM_DATA_EXE, "prepare --input small.txt --output s.bin --heldout-fraction 0.34");
  EXPECT_EQ(r.code, 0) << r.err;
  r = run(LOOM_DATA_EXE, "prepare --input small.txt --output s.bin --heldout-fraction 0");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--heldout-fraction 0 holds out no tokens"), std::string::npos) << r.err;
}

TEST_F(Programs, BpeTrainingAndEncodingReportProgress) {
  write("c.txt", loom::trainer::test_corpus::generated_corpus(200000));
  const auto r =
      run(LOOM_DATA_EXE, "prepare --input c.txt --output x.bin --tokenizer bpe --vocab-size 300",
          "LOOM_PROGRESS_INTERVAL=0");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("loom data: training BPE: 1/44 merges (2%), "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("loom data: training BPE: 44/44 merges (100%), "), std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find(" merges/s, ETA "), std::string::npos) << r.err;
  // Without the override, work this short stays silent.
  const auto quiet =
      run(LOOM_DATA_EXE, "prepare --input c.txt --output y.bin --tokenizer bpe --vocab-size 300");
  ASSERT_EQ(quiet.code, 0) << quiet.err;
  EXPECT_EQ(quiet.err, "");
}

TEST_F(Programs, PlotWritesTheFormatItsNameSaysOrRefuses) {
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) GTEST_SKIP() << "no gnuplot";
  fs::create_directories(dir_ / "run");
  std::string m;
  for (int i = 1; i <= 20; ++i) {
    m += "{\"type\":\"train\",\"step\":" + std::to_string(i) +
         ",\"loss\":" + std::to_string(6.0 - 0.1 * i) +
         ",\"comm_bytes_sent\":0,\"uncompressed_bytes\":0}\n";
  }
  write("run/metrics.jsonl", m);
  auto r = run(LOOM_PLOT_EXE, "run -o x.svg");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string svg = slurp(dir_ / "x.svg");
  EXPECT_EQ(svg.rfind("<?xml", 0), 0U) << svg.substr(0, 100);
  EXPECT_NE(svg.find("<svg"), std::string::npos);
  // No curriculum in the run: no curriculum panels.
  EXPECT_EQ(svg.find("seq_len per step"), std::string::npos);
  EXPECT_EQ(svg.find("difficulty per step"), std::string::npos);
  r = run(LOOM_PLOT_EXE, "run -o x.png");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(slurp(dir_ / "x.png").substr(1, 3), "PNG");
  // --loss-max sets the top of the loss axis (to show a spike the default range cuts off).
  EXPECT_EQ(svg.find("> 100<"), std::string::npos);
  r = run(LOOM_PLOT_EXE, "run --loss-max 100 -o top.svg");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(slurp(dir_ / "top.svg").find("> 100<"), std::string::npos);
  expect_usage_error(run(LOOM_PLOT_EXE, "run --loss-max -1 -o y.svg"), "loom plot",
                     "--loss-max: '-1' is not a number in [0, 1000000000)");
  expect_usage_error(run(LOOM_PLOT_EXE, "run -o x.pdf"), "loom plot",
                     "-o x.pdf: the file name must end in .png or .svg");
  EXPECT_FALSE(fs::exists(dir_ / "x.pdf"));
  r = run(LOOM_PLOT_EXE, "run -o nodir/x.png");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("the folder nodir does not exist"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(dir_ / "nodir"));
}

// A run killed mid-write leaves a torn line: plot warns with file:line for each one and draws
// the rest; a folder where metrics.jsonl should be is named as such.
TEST_F(Programs, PlotSkipsTornLinesWithAWarning) {
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) GTEST_SKIP() << "no gnuplot";
  fs::create_directories(dir_ / "run");
  std::string m;
  for (int i = 1; i <= 30; ++i) {
    if (i == 23) {
      m += "{\"type\":\"train\",\"step\":23,\"lo\n";  // torn in the middle
      continue;
    }
    m += "{\"type\":\"train\",\"step\":" + std::to_string(i) +
         ",\"loss\":" + std::to_string(6.0 - 0.1 * i) +
         ",\"comm_bytes_sent\":0,\"uncompressed_bytes\":0}\n";
  }
  m += "{\"type\":\"eval\",\"st";  // torn at the end, no newline
  write("run/metrics.jsonl", m);
  auto r = run(LOOM_PLOT_EXE, "run -o t.svg");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, "");
  const auto l = lines(r.err);
  ASSERT_EQ(l.size(), 2U) << r.err;
  EXPECT_EQ(l[0], "loom plot: warning: run/metrics.jsonl:23: not JSON, skipped");
  EXPECT_EQ(l[1], "loom plot: warning: run/metrics.jsonl:31: not JSON, skipped");
  EXPECT_NE(slurp(dir_ / "t.svg").find("<svg"), std::string::npos);
  // Many torn lines: the first ten are named, then a count, so the warnings stay short.
  std::string many = m + "\n";
  for (int i = 0; i < 14; ++i) many += "{\"type\":\n";
  write("run/metrics.jsonl", many);
  r = run(LOOM_PLOT_EXE, "run -o t.svg");
  ASSERT_EQ(r.code, 0) << r.err;
  ASSERT_EQ(lines(r.err).size(), 11U) << r.err;
  EXPECT_EQ(lines(r.err)[9], "loom plot: warning: run/metrics.jsonl:39: not JSON, skipped");
  EXPECT_EQ(lines(r.err)[10],
            "loom plot: warning: run/metrics.jsonl: 6 more lines not JSON, skipped");
  // Nothing but torn lines: nothing to plot, an error as for an empty file.
  write("run/metrics.jsonl", "{\"type\":\"tr\n");
  r = run(LOOM_PLOT_EXE, "run -o u.svg");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("run/metrics.jsonl:1: not JSON, skipped"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("loom plot: error: run/metrics.jsonl: no train records"), std::string::npos)
      << r.err;
  write("run/metrics.jsonl", "");
  r = run(LOOM_PLOT_EXE, "run -o u.svg");
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "loom plot: error: run/metrics.jsonl: no train records\n");
  r = run(LOOM_PLOT_EXE, "missing -o u.svg");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("missing/metrics.jsonl: cannot open"), std::string::npos) << r.err;
  fs::create_directories(dir_ / "odd" / "metrics.jsonl");
  r = run(LOOM_PLOT_EXE, "odd -o u.svg");
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "loom plot: error: odd/metrics.jsonl: is a folder, not a file\n");
}

// A run with a curriculum (difficulty, a seq_len that rises) gets two more panels beside the
// loss; beside a run without one (constant seq_len, no difficulty) too.
TEST_F(Programs, PlotDrawsDifficultyAndSeqLenPanelsWhenARunHasThem) {
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) GTEST_SKIP() << "no gnuplot";
  fs::create_directories(dir_ / "slw");
  fs::create_directories(dir_ / "base");
  std::string m, b;
  for (int i = 1; i <= 20; ++i) {
    const std::string common = "\"step\":" + std::to_string(i) +
                               ",\"loss\":" + std::to_string(6.0 - 0.1 * i) +
                               ",\"comm_bytes_sent\":0,\"uncompressed_bytes\":0";
    m += "{\"type\":\"train\"," + common + ",\"seq_len\":" + std::to_string(8 * ((i + 3) / 4)) +
         ",\"difficulty\":" + (i == 3 ? std::string("null") : std::to_string(10 + i)) + "}\n";
    b += "{\"type\":\"train\"," + common + ",\"seq_len\":64}\n";
  }
  write("slw/metrics.jsonl", m);
  write("base/metrics.jsonl", b);
  auto r = run(LOOM_PLOT_EXE, "base slw -o c.svg");
  ASSERT_EQ(r.code, 0) << r.err;
  std::string svg = slurp(dir_ / "c.svg");
  EXPECT_NE(svg.find("sequence-length warmup: seq_len per step"), std::string::npos);
  EXPECT_NE(svg.find("curriculum: the sampler's difficulty per step"), std::string::npos);
  EXPECT_NE(svg.find("width=\"2800"), std::string::npos) << svg.substr(0, 400);
  // A constant seq_len alone draws no seq_len panel.
  r = run(LOOM_PLOT_EXE, "base -o b.svg");
  ASSERT_EQ(r.code, 0) << r.err;
  svg = slurp(dir_ / "b.svg");
  EXPECT_EQ(svg.find("seq_len per step"), std::string::npos);
  EXPECT_NE(svg.find("width=\"1400"), std::string::npos) << svg.substr(0, 400);
}

TEST_F(Programs, TrainCheckReportsEveryConfigProblem) {
  write("m.toml", "[optimizer.main]\nplugin = \"adam\"\n");
  write("t.toml",
        "[manifest]\npath = \"m.toml\"\noptimizer = \"mian\"\ncomm = \"\"\n[model]\n"
        "heads = 3\n[data]\ndataset = \"d.bin\"\n[train]\nmin_lr = 0.5\nlr = 1e-6\n"
        "decay = \"cosin\"\n[modle]\n");
  auto r = run(LOOM_TRAIN_EXE, "--check t.toml");
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.out, "");
  const auto l = lines(r.err);
  ASSERT_EQ(l.size(), 5U) << r.err;
  // dim is absent (128 by default): the message points at the [model] table.
  EXPECT_EQ(l[0], "t.toml:5:1: [model] dim 128 is not divisible by heads 3");
  EXPECT_EQ(l[1], "t.toml:10:10: [train] min_lr 0.5 is above lr 1e-06");
  EXPECT_EQ(l[2],
            "t.toml:12:9: [train] decay: 'cosin' is not one of cosine, linear, constant "
            "(did you mean 'cosine'?)");
  EXPECT_EQ(l[3],
            "t.toml:13:1: unknown top-level key or section 'modle' (did you mean "
            "'model'?) (expected tables [manifest], [model], [data], [curriculum], [routing], "
            "[moe], [quantization], [gradients], [train])");
  // Then the manifest it names, as far as the config could be read.
  EXPECT_EQ(l[4], "t.toml: [manifest] optimizer 'mian': " + (dir_ / "m.toml").string() +
                      " has no [optimizer.mian] (it has [optimizer.main]) (did you mean 'main'?)");

  write("p.toml",
        "[manifest]\npath = \"m.toml\"\ncomm = \"\"\n[data]\ndataset = \"d.bin\"\n"
        "[train]\nplot = \"loss.pdf\"\n");
  r = run(LOOM_TRAIN_EXE, "--check p.toml");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("p.toml:7:8: [train] plot: 'loss.pdf' must end in .png or .svg"),
            std::string::npos)
      << r.err;

  // Sound keys: the names it gives the manifest's instances, and the dataset.
  write("t.toml",
        "[manifest]\npath = \"m.toml\"\noptimizer = \"mian\"\ncomm = \"\"\n[data]\n"
        "dataset = \"d.bin\"\n");
  r = run(LOOM_TRAIN_EXE, "--check t.toml");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("t.toml: [manifest] optimizer 'mian': " + (dir_ / "m.toml").string() +
                       " has no [optimizer.mian] (it has [optimizer.main]) (did you mean "
                       "'main'?)"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("d.bin: cannot open the dataset"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("loom data prepare"), std::string::npos) << r.err;
}

}  // namespace
