// The trainer's curriculum pieces that need no plugin: the sequence-length cuts (truncate,
// reshape) against windows taken straight from a token stream, sample windows, the length a
// scheduled seq_len rounds to, the learning rate by tokens, and the [curriculum] config keys.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <numbers>
#include <sstream>
#include <string>
#include <vector>

#include "batch.hpp"
#include "config.hpp"

namespace fs = std::filesystem;
using namespace loom::trainer;

namespace {

// A token stream whose every token says where it is: token t = t mod 65521.
std::vector<uint16_t> stream(size_t n) {
  std::vector<uint16_t> s(n);
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<uint16_t>(i % 65521);
  return s;
}

// The full batch of sequences starting at `offsets`, the way the trainer builds it.
void full_batch(const std::vector<uint16_t>& s, const std::vector<size_t>& offsets, int seq,
                std::vector<int32_t>& x, std::vector<int32_t>& y) {
  x.clear();
  y.clear();
  for (size_t o : offsets) {
    for (int j = 0; j < seq; ++j) {
      x.push_back(s[o + j]);
      y.push_back(s[o + j + 1]);
    }
  }
}

TEST(SeqLenCut, TruncateKeepsTheFirstLTokensAndTheirLabels) {
  const auto s = stream(5000);
  const std::vector<size_t> offsets{0, 17, 999, 3000};
  const int seq = 64;
  std::vector<int32_t> x, y, ox, oy;
  full_batch(s, offsets, seq, x, y);
  for (int L : {8, 16, 24, 40, 64}) {
    const int rows = cut_batch(SeqLenCut::kTruncate, x.data(), y.data(), 4, seq, L, ox, oy);
    ASSERT_EQ(rows, 4);
    ASSERT_EQ(cut_rows(SeqLenCut::kTruncate, 4, seq, L), 4);
    ASSERT_EQ(ox.size(), 4u * L);
    // Reference: the window of L + 1 stream tokens at each offset.
    for (int r = 0; r < rows; ++r) {
      for (int j = 0; j < L; ++j) {
        EXPECT_EQ(ox[r * L + j], s[offsets[r] + j]) << "L " << L << " row " << r << " pos " << j;
        EXPECT_EQ(oy[r * L + j], s[offsets[r] + j + 1]) << "L " << L << " row " << r;
      }
    }
  }
}

TEST(SeqLenCut, ReshapeCutsEachSequenceIntoPiecesOfLPlusOneTokens) {
  const auto s = stream(5000);
  const std::vector<size_t> offsets{5, 1200, 4000};
  const int seq = 60;  // not a multiple of most L: the remainder is dropped
  std::vector<int32_t> x, y, ox, oy;
  full_batch(s, offsets, seq, x, y);
  for (int L : {8, 16, 24, 32, 56, 60}) {
    const int pieces = seq / L;
    const int rows = cut_batch(SeqLenCut::kReshape, x.data(), y.data(), 3, seq, L, ox, oy);
    ASSERT_EQ(rows, 3 * pieces) << "L " << L;
    ASSERT_EQ(cut_rows(SeqLenCut::kReshape, 3, seq, L), rows);
    ASSERT_EQ(ox.size(), static_cast<size_t>(rows) * L);
    // Reference: sequence i's piece k is the stream window at offsets[i] + k*L, L + 1 long.
    for (int i = 0; i < 3; ++i) {
      for (int k = 0; k < pieces; ++k) {
        const int row = i * pieces + k;
        for (int j = 0; j < L; ++j) {
          EXPECT_EQ(ox[row * L + j], s[offsets[i] + k * L + j]) << "L " << L << " row " << row;
          EXPECT_EQ(oy[row * L + j], s[offsets[i] + k * L + j + 1]) << "L " << L;
        }
      }
    }
    // No token of the remainder (positions pieces*L .. seq-1) appears as an input.
    for (int i = 0; i < 3; ++i) {
      for (int p = pieces * L; p < seq; ++p) {
        const int32_t t = s[offsets[i] + p];
        EXPECT_EQ(std::count(ox.begin(), ox.end(), t), 0) << "L " << L << " token " << t;
      }
    }
  }
  // With L = seq both cuts are the identity.
  cut_batch(SeqLenCut::kReshape, x.data(), y.data(), 3, seq, seq, ox, oy);
  EXPECT_EQ(ox, x);
  EXPECT_EQ(oy, y);
  EXPECT_THROW(cut_batch(SeqLenCut::kReshape, x.data(), y.data(), 3, seq, seq + 1, ox, oy),
               std::invalid_argument);
  EXPECT_THROW(cut_batch(SeqLenCut::kTruncate, x.data(), y.data(), 3, seq, 0, ox, oy),
               std::invalid_argument);
}

TEST(SeqLenCut, ScheduledLengthsRoundDownToMultiplesOfEight) {
  EXPECT_EQ(step_seq_len(1, 128), 8);
  EXPECT_EQ(step_seq_len(8, 128), 8);
  EXPECT_EQ(step_seq_len(15, 128), 8);
  EXPECT_EQ(step_seq_len(16, 128), 16);
  EXPECT_EQ(step_seq_len(127, 128), 120);
  EXPECT_EQ(step_seq_len(128, 128), 128);
  EXPECT_EQ(step_seq_len(4096, 128), 128);
  EXPECT_EQ(step_seq_len(99, 100), 96);
  EXPECT_EQ(step_seq_len(100, 100), 100);  // the full length is never rounded
  EXPECT_EQ(step_seq_len(-5, 100), 8);
}

TEST(Samples, WindowsAreSeqLenPlusOneTokensAtMultiplesOfSeqLen) {
  const auto s = stream(1001);
  EXPECT_EQ(sample_count(1001, 100), 10u);
  EXPECT_EQ(sample_count(1000, 100), 9u);  // sample 9 would need token 1000
  EXPECT_EQ(sample_count(0, 100), 0u);
  const std::vector<int64_t> ids{9, 0, 4};
  std::vector<int32_t> x, y;
  fill_samples(s, 100, ids, x, y);
  ASSERT_EQ(x.size(), 300u);
  for (size_t r = 0; r < ids.size(); ++r) {
    for (int j = 0; j < 100; ++j) {
      EXPECT_EQ(x[r * 100 + j], ids[r] * 100 + j);
      EXPECT_EQ(y[r * 100 + j], ids[r] * 100 + j + 1);
    }
  }
  const std::vector<int64_t> bad{3, 10};
  try {
    fill_samples(s, 100, bad, x, y);
    FAIL() << "no error for sample 10 of 10";
  } catch (const std::out_of_range& e) {
    EXPECT_NE(std::string(e.what()).find("sample id 10 at place 1"), std::string::npos) << e.what();
  }
}

TrainConfig lr_config() {
  TrainConfig c;
  c.steps = 100;
  c.batch_size = 4;
  c.seq_len = 64;
  c.lr = 1e-3;
  c.min_lr = 1e-4;
  c.warmup_steps = 10;
  c.lr_unit = "tokens";
  return c;
}

TEST(LrByTokens, EqualsTheStepScheduleAtAConstantLength) {
  TrainConfig c = lr_config();
  const uint64_t per_step = 4 * 64;
  for (const char* decay : {"cosine", "linear", "constant"}) {
    c.decay = decay;
    for (int64_t s = 1; s <= 100; ++s) {
      EXPECT_NEAR(lr_at_tokens(c, s, s * per_step, 10 * per_step), lr_at(c, s), 1e-15)
          << decay << " step " << s;
    }
  }
}

TEST(LrByTokens, FollowsTheTokensConsumedUnderSequenceLengthWarmup) {
  TrainConfig c = lr_config();
  c.decay = "linear";
  c.train_tokens = 20000;
  EXPECT_EQ(decay_tokens(c), 20000u);
  c.train_tokens = 0;
  EXPECT_EQ(decay_tokens(c), 100u * 4 * 64);
  c.train_tokens = 20000;
  // Warmup is by step whatever the tokens.
  EXPECT_DOUBLE_EQ(lr_at_tokens(c, 5, 123, 0), 0.5e-3);
  EXPECT_DOUBLE_EQ(lr_at_tokens(c, 10, 999, 0), 1e-3);
  // Past it: r = (tokens - warmup_tokens) / (decay_tokens - warmup_tokens).
  const uint64_t wt = 10 * 4 * 8;  // the warmup ran at length 8
  for (uint64_t tokens : {wt, wt + 1000, uint64_t{10000}, uint64_t{19999}, uint64_t{20000}}) {
    const double r = static_cast<double>(tokens - wt) / static_cast<double>(20000 - wt);
    EXPECT_NEAR(lr_at_tokens(c, 11, tokens, wt), 1e-4 + (1e-3 - 1e-4) * (1 - r), 1e-15) << tokens;
  }
  c.decay = "cosine";
  const double r = (12000.0 - wt) / (20000.0 - wt);
  EXPECT_NEAR(lr_at_tokens(c, 50, 12000, wt),
              1e-4 + 0.9e-3 * 0.5 * (1 + std::cos(std::numbers::pi * r)), 1e-15);
  // Past the decay's end: min_lr.
  EXPECT_DOUBLE_EQ(lr_at_tokens(c, 99, 30000, wt), 1e-4);
}

fs::path temp_dir() {
  const fs::path d =
      fs::temp_directory_path() / ("loom-trainer-curriculum-" + std::to_string(::getpid()));
  fs::create_directories(d);
  return d;
}

void write(const fs::path& p, const std::string& s) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f << s;
}

std::string error_of(const fs::path& cfg, const std::string& text) {
  write(cfg, text);
  try {
    load_config(cfg.string());
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(CurriculumConfig, ReadsTheKeysAndNamesEveryErrorsPlace) {
  const auto dir = temp_dir();
  const auto cfg = dir / "c.toml";
  const std::string base = "[manifest]\npath = \"m.toml\"\n[data]\ndataset = \"x\"\n";
  write(cfg, base +
                 "[curriculum]\nsampler = \"voc\"\nseqlen = \"slw\"\n[train]\n"
                 "train_tokens = 5000\nlr_unit = \"tokens\"\n");
  const TrainConfig c = load_config(cfg.string());
  EXPECT_EQ(c.sampler, "voc");
  EXPECT_EQ(c.seqlen, "slw");
  EXPECT_EQ(c.sampler_at, cfg.string() + ":6:11");
  EXPECT_EQ(c.seqlen_at, cfg.string() + ":7:10");
  EXPECT_EQ(c.train_tokens, 5000);
  EXPECT_EQ(c.lr_unit, "tokens");
  write(cfg, base);
  const TrainConfig d = load_config(cfg.string());
  EXPECT_TRUE(d.sampler.empty());
  EXPECT_TRUE(d.seqlen.empty());
  EXPECT_EQ(d.lr_unit, "steps");
  EXPECT_EQ(d.train_tokens, 0);

  auto expect = [&](const std::string& text, const std::string& what) {
    const std::string e = error_of(cfg, text);
    EXPECT_NE(e.find(cfg.string() + what), std::string::npos) << "wanted " << what << "\ngot " << e;
  };
  expect(base + "[curriculum]\nsampler = 3\n", ":6:11: [curriculum] sampler: expected a string");
  expect(base + "[curriculum]\nseqlen = \"\"\n", ":6:10: [curriculum] seqlen: empty");
  expect(base + "[curriculum]\nindex = \"idx\"\n", ":6:1: [curriculum] index: unknown key");
  expect(base + "[curriculum]\nsamplr = \"v\"\n", ":6:1: [curriculum] samplr: unknown key");
  EXPECT_NE(error_of(cfg, base + "[curriculum]\nsamplr = \"v\"\n").find("did you mean 'sampler'"),
            std::string::npos);
  expect(base + "[train]\nlr_unit = \"tokenz\"\n",
         ":6:11: [train] lr_unit: 'tokenz' is not one of steps, tokens");
  expect(base + "[train]\ntrain_tokens = -1\n", ":6:16: [train] train_tokens: -1 is out of range");
  expect(base + "[train]\ntrain_tokens = 1.5\n",
         ":6:16: [train] train_tokens: expected an integer");
  expect(base + "[curriculum]\nseqlen = \"s\"\n[train]\nseq_len = 4\n",
         ":8:11: [train] seq_len 4 is below 8");
  expect(base + "[curriculm]\nseqlen = \"s\"\n",
         ":5:1: unknown top-level key or section 'curriculm'");
}

// lr_unit = "tokens" without train_tokens decays over steps x batch_size x seq_len tokens:
// a product past 2^62 (or past 2^64) is refused at `steps`, not wrapped around.
TEST(CurriculumConfig, DecayTokensThatOverflowAreRefused) {
  const auto dir = temp_dir();
  const auto cfg = dir / "o.toml";
  const std::string base = "[manifest]\npath = \"m.toml\"\n[data]\ndataset = \"x\"\n";
  const std::string huge =
      "[model]\ncontext = 65536\n[train]\nsteps = 1099511627776\nbatch_size = 1048576\n"
      "seq_len = 65536\n";
  const std::string e = error_of(cfg, base + huge + "lr_unit = \"tokens\"\n");
  EXPECT_NE(e.find(cfg.string() + ":8:9: [train] steps 1099511627776 x batch_size 1048576 x "
                                  "seq_len 65536 tokens exceed 2^62"),
            std::string::npos)
      << e;
  // Fine by steps, or with train_tokens giving the decay's end.
  EXPECT_EQ(error_of(cfg, base + huge), "");
  EXPECT_EQ(error_of(cfg, base + huge + "lr_unit = \"tokens\"\ntrain_tokens = 1000000\n"), "");
  // decay_tokens itself saturates.
  TrainConfig c;
  c.steps = int64_t{1} << 40;
  c.batch_size = 1 << 20;
  c.seq_len = 1 << 16;
  EXPECT_EQ(decay_tokens(c), UINT64_MAX);
}

// train_tokens with lr_unit = "steps" is valid but decays over `steps`: a warning at the key.
TEST(CurriculumConfig, TrainTokensWithLrByStepsWarns) {
  const auto dir = temp_dir();
  const auto cfg = dir / "w.toml";
  const std::string base = "[manifest]\npath = \"m.toml\"\n[data]\ndataset = \"x\"\n";
  write(cfg, base + "[train]\nsteps = 500\ntrain_tokens = 1000\n");
  auto w = config_warnings(load_config(cfg.string()));
  ASSERT_EQ(w.size(), 1u);
  EXPECT_NE(w[0].find(cfg.string() + ":7:16: [train] train_tokens: warning: 1000 tokens end the "
                                     "run, but with lr_unit = \"steps\" the decay runs over "
                                     "steps 500"),
            std::string::npos)
      << w[0];
  write(cfg, base + "[train]\nsteps = 500\ntrain_tokens = 1000\nlr_unit = \"tokens\"\n");
  EXPECT_TRUE(config_warnings(load_config(cfg.string())).empty());
  write(cfg, base + "[train]\nsteps = 500\n");
  EXPECT_TRUE(config_warnings(load_config(cfg.string())).empty());
}

TEST(CurriculumConfig, InstancesMissingFromTheManifestAreReportedAtTheirKey) {
  const auto dir = temp_dir();
  const auto cfg = dir / "n.toml";
  write(dir / "m.toml",
        "[optimizer.main]\nplugin = \"adam\"\n[curriculum.slw]\nplugin = \"seqlen_warmup\"\n"
        "[sampler.cs]\nplugin = \"curriculum_sampler\"\n");
  write(cfg,
        "[manifest]\npath = \"m.toml\"\ncomm = \"\"\n[data]\ndataset = \"x\"\n"
        "[curriculum]\nsampler = \"c\"\nseqlen = \"slow\"\n");
  const TrainConfig c = load_config(cfg.string());
  const auto p = manifest_name_problems(c);
  ASSERT_EQ(p.size(), 2u);
  EXPECT_NE(p[0].find(cfg.string() + ":7:11: [curriculum] sampler 'c': "), std::string::npos)
      << p[0];
  EXPECT_NE(p[0].find("has no [sampler.c] (it has [sampler.cs])"), std::string::npos) << p[0];
  EXPECT_NE(p[1].find(cfg.string() + ":8:10: [curriculum] seqlen 'slow': "), std::string::npos)
      << p[1];
  EXPECT_NE(p[1].find("did you mean 'slw'"), std::string::npos) << p[1];
  write(cfg,
        "[manifest]\npath = \"m.toml\"\ncomm = \"\"\n[data]\ndataset = \"x\"\n"
        "[curriculum]\nsampler = \"cs\"\nseqlen = \"slw\"\n");
  EXPECT_TRUE(manifest_name_problems(load_config(cfg.string())).empty());
}

// What `loom check` opens to create the curriculum's instances: only [loom] and the
// curriculum's sections (kCurriculumSections), on the lines they have in the manifest; the
// comm, optimizer and codec are not even read.
TEST(CurriculumConfig, CurriculumManifestKeepsOnlyTheCurriculumTablesOnTheirLines) {
  const auto dir = temp_dir();
  const std::string slw_steps =
      "min_difficulty = 8\nmax_difficulty = 128\ntotal_curriculum_step = 150\n";
  write(dir / "m.toml",
        "[loom]\nlog_level = \"warn\"\n[comm.world]\nplugin = \"ucx\"\n"
        "[curriculum.slw]\nplugin = \"seqlen_warmup\"\nmode = \"truncate\"\n" +
            slw_steps +
            "[optimizer.main]\nplugin = \"adam\"\nbetas = [\n  0.9,\n  0.99,\n]\n"
            "  [codec.c]\nplugin = \"onebit\"\nno_such_key = 1\n");
  auto open = [&](std::string& at) {
    loom_open_options o{};
    o.struct_size = LOOM_OPEN_OPTIONS_SIZE;
    o.log_level = LOOM_LOG_WARN;
    o.sections = kCurriculumSections;
    loom_session* s = nullptr;
    const std::string m = (dir / "m.toml").string();
    EXPECT_EQ(loom_open_file(m.c_str(), &o, &s), LOOM_OK) << loom_last_error();
    const size_t n = s != nullptr ? loom_instance_count(s) : 0;
    const nlohmann::json p = s != nullptr ? instance_params(s, "curriculum", "slw") : nullptr;
    at = p.is_object() ? p["at"].get<std::string>() : "";
    loom_close(s);
    return n;
  };
  std::string at;
  EXPECT_EQ(open(at), 1U);  // the codec's unknown key was never read either
  EXPECT_EQ(at, (dir / "m.toml").string() + ":5:1");
  // Dotted keys at the root belong to their section too, and are left out with it.
  write(dir / "m.toml",
        "optimizer.main.plugin = \"adam\"\n[curriculum.slw]\nplugin = \"seqlen_warmup\"\n" +
            slw_steps);
  EXPECT_EQ(open(at), 1U);
  EXPECT_EQ(at, (dir / "m.toml").string() + ":2:1");
}

}  // namespace
