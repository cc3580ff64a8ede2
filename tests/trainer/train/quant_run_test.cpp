// Whole runs of loom-train with [quantization], against the test plugin trainer_quant
// (tests/trainer/train/probe/trainer_quant.cpp: per-row INT codes of `bits` bits with a
// weight-only matmul): an fp32 run's checkpoint evaluated with --eval-only in fp32 and through
// the quantizer's matmuls (8 bits: within 1% of fp32; 3 bits: further), LKD before the
// evaluation lowering every block's MSE, a QAT run with KD recording the loss's terms, and
// bad names refused at their key by --check. Tiny model, about a second each.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "corpus.hpp"
#include "dataset.hpp"

namespace fs = std::filesystem;

namespace {

struct Result {
  int code = -1;
  std::string out;
};

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

class QuantRun : public ::testing::Test {
 protected:
  static fs::path dir_;

  static void SetUpTestSuite() {
    ::setenv("LOOM_LOG_LEVEL", "", 1);
    ::setenv("LOOM_PROGRESS", "lines", 1);
    dir_ = fs::temp_directory_path() / ("loom-trainer-quant-run-" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::ofstream(dir_ / "corpus.txt") << loom::trainer::test_corpus::generated_corpus(40000);
    Result r =
        sh(std::string(LOOM_DATA_EXE) + " prepare --input " + (dir_ / "corpus.txt").string() +
           " --output " + (dir_ / "data.bin").string() + " --heldout-fraction 0.1");
    ASSERT_EQ(r.code, 0) << r.out;
    std::ofstream(dir_ / "m.toml") << "[optimizer.main]\nplugin = \"adam\"\n"
                                   << "[quantizer.q8]\nplugin = \"trainer_quant\"\nbits = 8\n"
                                   << "[quantizer.q3]\nplugin = \"trainer_quant\"\nbits = 3\n"
                                   << "[[quantize]]\ntensors = [\"h.*.w\"]\nquantizer = \"q8\"\n";
    // The fp32 model the others start from.
    r = train(config("fp32", ""), "--fresh");
    ASSERT_EQ(r.code, 0) << r.out;
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  static Result sh(const std::string& cmd) {
    const fs::path log = dir_ / "log.txt";
    const int st = std::system((cmd + " > " + log.string() + " 2>&1").c_str());
    Result r;
    r.code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    r.out = slurp(log);
    return r;
  }
  // 2 layers, dim 32, context and seq_len 32, batch 4, 12 steps; [quantization] from line 9.
  static std::string config(const std::string& name, const std::string& quant, int steps = 12) {
    const fs::path p = dir_ / (name + ".toml");
    std::ofstream(p) << "[manifest]\npath = \"m.toml\"\ncomm = \"\"\n"
                     << "[model]\ncontext = 32\nlayers = 2\nheads = 2\ndim = 32\n"
                     << (quant.empty() ? "" : "[quantization]\n" + quant)
                     << "[data]\ndataset = \"data.bin\"\n"
                     << "[train]\nsteps = " << steps << "\nbatch_size = 4\nseq_len = 32\n"
                     << "lr = 3e-3\nmin_lr = 3e-4\nwarmup_steps = 2\n"
                     << "eval_interval = 0\neval_batches = 2\ncheckpoint_interval = 0\n"
                     << "log_interval = 1\nthreads = 1\nplot = \"none\"\nrun_dir = \"runs/" << name
                     << "\"\n";
    return p.string();
  }
  static Result train(const std::string& cfg, const std::string& args = "") {
    return sh(std::string(LOOM_TRAIN_EXE) + " " + cfg + " --plugin-path " + LOOM_TEST_PLUGIN_DIR +
              " " + args);
  }
  static nlohmann::json json(const std::string& rel) {
    return nlohmann::json::parse(slurp(dir_ / rel));
  }
  static std::string weights() {
    return "weights = \"runs/fp32/checkpoints/step_00000012/model.rank0.safetensors\"\n";
  }
};
fs::path QuantRun::dir_;

}  // namespace

TEST_F(QuantRun, EvalOnlyRunsTheQuantizersMatmulsAndInt8StaysWithinOnePercent) {
  const auto base = json("runs/fp32/summary.json");
  auto r = train(config("e8", "quantizer = \"q8\"\n" + weights()), "--eval-only");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto e8 = json("runs/e8/eval.json");
  // The same weights and windows as the fp32 run's final evaluation.
  EXPECT_NEAR(double(e8["fp32_eval_loss"]), double(base["final_eval_loss"]), 1e-9);
  EXPECT_EQ(e8["quantized_tensors"].size(), 8u);
  // 2 batches of 4 windows (one forward each) x 8 linear weights.
  EXPECT_EQ(e8["quantized_matmuls"], 16);
  const double fp32 = e8["fp32_eval_ppl"], q8 = e8["eval_ppl"];
  EXPECT_NE(q8, fp32);
  EXPECT_LT(std::fabs(q8 / fp32 - 1), 0.01);
  // Codes of one byte plus a float scale per row, against four bytes per weight.
  const double packed = e8["packed_bytes"], floats = e8["float_bytes"];
  EXPECT_EQ(floats, 4.0 * 2 * (3 + 1 + 4 + 4) * 32 * 32);
  EXPECT_EQ(packed, 2.0 * ((3 + 1 + 4 + 4) * 32 * 32 + 4 * (96 + 32 + 128 + 32)));
  EXPECT_NE(r.out.find("quantized eval loss (q8, trainer_quant)"), std::string::npos) << r.out;
  // 3 bits: further from fp32.
  r = train(config("e3", "quantizer = \"q3\"\n" + weights()), "--eval-only");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto e3 = json("runs/e3/eval.json");
  EXPECT_GT(std::fabs(double(e3["eval_ppl"]) / double(e3["fp32_eval_ppl"]) - 1),
            2 * std::fabs(q8 / fp32 - 1));
  // LKD first (the fp32 teacher's block inputs, 6 steps a block): every block's output MSE
  // against the teacher's falls.
  r = train(config("e3l", "quantizer = \"q3\"\nlkd_steps = 6\nlkd_lr = 1e-4\n" + weights()),
            "--eval-only");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto e3l = json("runs/e3l/eval.json");
  ASSERT_EQ(e3l["lkd"].size(), 2u);
  for (const auto& l : e3l["lkd"]) {
    EXPECT_LT(double(l["mse_after"]), double(l["mse_before"])) << l;
  }
  EXPECT_NE(r.out.find("lkd layer 1: block MSE"), std::string::npos) << r.out;
}

// loom quantize writes the blocks' matrices as q8 codes (the manifest's [[quantize]] rule; 2-D
// only, the biases and LayerNorms stay float); --weights evaluates that file through the C API
// and the same instance's matmul: the loss of the in-memory q8 evaluation, to the bit.
TEST_F(QuantRun, AQuantizedFileEvaluatesAsTheInMemoryQuantization) {
  auto r = sh(std::string(LOOM_CLI_EXE) + " quantize " + (dir_ / "m.toml").string() + " " +
              (dir_ / "runs/fp32/checkpoints/step_00000012/model.rank0.safetensors").string() +
              " " + (dir_ / "q8.safetensors").string() + " --plugin-path " + LOOM_TEST_PLUGIN_DIR);
  ASSERT_EQ(r.code, 0) << r.out;
  r = train(config("e8f", ""), "--eval-only --weights " + (dir_ / "q8.safetensors").string());
  ASSERT_EQ(r.code, 0) << r.out;
  r = train(config("e8m", "quantizer = \"q8\"\n" + weights()), "--eval-only");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto file = json("runs/e8f/eval.json"), mem = json("runs/e8m/eval.json");
  EXPECT_EQ(file["quantized_tensors"], mem["quantized_tensors"]);
  EXPECT_EQ(file["quantizers"].size(), 8u);
  EXPECT_EQ(file["quantizers"][0], "q8");
  EXPECT_EQ(file["quantized_matmuls"], 16);
  EXPECT_EQ(double(file["eval_loss"]), double(mem["eval_loss"]));
  EXPECT_EQ(file["packed_bytes"], mem["packed_bytes"]);
  EXPECT_GT(double(file["file_bytes"]), 0.0);
  // A file of another manifest's quantizer: named.
  std::ofstream(dir_ / "m2.toml") << "[optimizer.main]\nplugin = \"adam\"\n";
  std::string text = slurp(config("other", ""));
  text.replace(text.find("m.toml"), 6, "m2.toml");
  std::ofstream(dir_ / "other.toml") << text;
  r = train((dir_ / "other.toml").string(),
            "--eval-only --weights " + (dir_ / "q8.safetensors").string());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("h.0.attn.qkv.w was quantized by [quantizer.q8], which the manifest lacks"),
            std::string::npos)
      << r.out;
}

// The file loom quantize wrote, damaged: a flipped code byte (its checksum no longer matches)
// and a NaN scale with the checksum recomputed (what a broken writer leaves) each stop
// --eval-only with the file named, the scale blamed on the file and its tensor, never on the
// activations the NaN would have reached.
TEST_F(QuantRun, ADamagedQuantizedFileIsRefusedNamingTheFile) {
  const fs::path q8 = dir_ / "q8d.safetensors";
  auto r = sh(std::string(LOOM_CLI_EXE) + " quantize " + (dir_ / "m.toml").string() + " " +
              (dir_ / "runs/fp32/checkpoints/step_00000012/model.rank0.safetensors").string() +
              " " + q8.string() + " --plugin-path " + LOOM_TEST_PLUGIN_DIR);
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string good = slurp(q8);
  uint64_t n = 0;
  std::memcpy(&n, good.data(), 8);
  const auto header = nlohmann::json::parse(good.substr(8, n));
  const auto& scales = header["h.0.mlp.fc.w.qscale"]["data_offsets"];
  const auto& codes = header["h.0.mlp.fc.w.qcodes"]["data_offsets"];
  ASSERT_TRUE(header["__metadata__"].contains("loom.checksum")) << header.dump();
  auto eval = [&](const std::string& bytes) {
    std::ofstream(q8, std::ios::binary | std::ios::trunc) << bytes;
    return train(config("e8d", ""), "--eval-only --weights " + q8.string());
  };
  std::string code = good;
  code[8 + n + codes[0].get<size_t>() + 3] ^= 0x01;
  r = eval(code);
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find(q8.string() + ": checksum mismatch"), std::string::npos) << r.out;
  // The NaN goes into the second row's scale and the checksum is computed again, as
  // docs/quantization.md defines it.
  std::string nan = good;
  const float v = std::nanf("");
  std::memcpy(nan.data() + 8 + n + scales[0].get<size_t>() + 4, &v, 4);
  const std::string key = R"("loom.checksum":"fnv1a64:)";
  const size_t d = nan.find(key) + key.size();
  nan.replace(d, 16, std::string(16, '0'));
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx",
                static_cast<unsigned long long>(loom::trainer::fnv1a64(nan.data(), nan.size())));
  nan.replace(d, 16, hex);
  r = eval(nan);
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find(q8.string() + ": quantized tensor 'h.0.mlp.fc.w': scale [1, 0] is nan"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("] is nan ("), std::string::npos) << r.out;  // no activation blamed
  EXPECT_EQ(r.out.find("x["), std::string::npos) << r.out;
}

TEST_F(QuantRun, QatWithDistillationRecordsItsTermsAndEvaluatesQuantized) {
  const auto r = train(config("qat",
                              "quantizer = \"q3\"\nqat = true\nkd = true\n"
                              "kd_weight = 0.5\n" +
                                  weights(),
                              4),
                       "--fresh");
  ASSERT_EQ(r.code, 0) << r.out;
  std::ifstream f(dir_ / "runs/qat/metrics.jsonl");
  int lines = 0;
  for (std::string line; std::getline(f, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j["type"] != "train") continue;
    ++lines;
    // loss = CE + 0.5 * soft CE + hidden MSE; the student starts as the teacher (but 3-bit).
    const double want =
        double(j["kd_ce"]) + 0.5 * double(j["kd_soft_ce"]) + double(j["kd_hidden_mse"]);
    EXPECT_NEAR(double(j["loss"]), want, 1e-4 * want) << line;
    EXPECT_GT(double(j["kd_hidden_mse"]), 0.0) << line;
  }
  EXPECT_EQ(lines, 4);
  const auto s = json("runs/qat/summary.json");
  EXPECT_EQ(s["quantizer"], "q3");
  EXPECT_TRUE(bool(s["qat"]));
  EXPECT_NE(double(s["final_eval_loss"]), double(s["final_fp32_eval_loss"]));
}

TEST_F(QuantRun, BadNamesAreRefusedAtTheirKey) {
  auto r = train(config("bad", "quantizer = \"q9\"\n"), "--check");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("bad.toml:10:13: [quantization] quantizer 'q9': "), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("has no [quantizer.q9]"), std::string::npos) << r.out;
  r = train(config("bad2", "quantizer = \"q8\"\nkd = true\n"), "--check");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("bad2.toml:11:6: [quantization] kd: needs the fp32 teacher"),
            std::string::npos)
      << r.out;
  r = train(config("good", "quantizer = \"q8\"\n" + weights()), "--check");
  EXPECT_EQ(r.code, 0) << r.out;
  r = train(config("bad3", "checkpoint = \"missing.safetensors\"\n"), "--check");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("bad3.toml:10:14: [quantization] checkpoint: "), std::string::npos) << r.out;
}
