// Whole runs of loom-train in bf16 mode ([train] precision = "bf16", docs/trainer.md "bf16
// mode"), 1 rank: it trains, within a small tolerance of the fp32 run of the same config (and
// not the same bits: the rounding is real); a run stopped after a step past its last
// checkpoint and resumed ends with the same bytes as an uninterrupted one (the checkpoints
// hold the fp32 master weights). Same bytes every run: repro_test.cpp.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "run_env.hpp"

namespace fs = std::filesystem;

namespace {

struct Result {
  int code = -1;
  std::string out;  // stdout and stderr
};

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

class TrainerBf16 : public ::testing::Test {
 protected:
  static fs::path dir_;

  static void SetUpTestSuite() {
    loom::trainer::test_run::set_environment();
    dir_ = fs::temp_directory_path() / ("loom-trainer-bf16-" + std::to_string(::getpid()));
    ASSERT_EQ(loom::trainer::test_run::prepare_dataset(dir_, LOOM_DATA_EXE), 0)
        << slurp(dir_ / "prepare.log");
    std::ofstream(dir_ / "adam.toml") << "[optimizer.main]\nplugin = \"adam\"\n";
    std::ofstream(dir_ / "adam_w8.toml")
        << "[optimizer.main]\nplugin = \"adam\"\n"
        << "[quantizer.w8]\nplugin = \"zeroquant\"\nactivation_bits = 0\n";
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  static Result train(const std::string& cfg, const std::string& args) {
    const fs::path log = dir_ / "log.txt";
    const int st = std::system(
        (std::string(LOOM_TRAIN_EXE) + " " + cfg + " " + args + " > " + log.string() + " 2>&1")
            .c_str());
    Result r;
    r.code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    r.out = slurp(log);
    return r;
  }
  // With `quant`, a [quantization] table over the manifest's zeroquant instance w8.
  static std::string config(const std::string& name, const std::string& precision, int steps,
                            int checkpoint_interval, const std::string& quant = "") {
    const fs::path p = dir_ / (name + ".toml");
    std::ofstream(p) << "[manifest]\npath = \"" << (quant.empty() ? "adam" : "adam_w8")
                     << ".toml\"\ncomm = \"\"\n"
                     << "[model]\ncontext = 32\nlayers = 2\nheads = 2\ndim = 32\n"
                     << (quant.empty() ? "" : "[quantization]\n" + quant)
                     << "[data]\ndataset = \"data.bin\"\n"
                     << "[train]\nsteps = " << steps << "\nbatch_size = 8\nseq_len = 32\n"
                     << "lr = 3e-3\nmin_lr = 3e-4\nwarmup_steps = 10\n"
                     << "eval_interval = 50\neval_batches = 4\n"
                     << "checkpoint_interval = " << checkpoint_interval << "\n"
                     << "log_interval = 1\nthreads = 2\nprecision = \"" << precision << "\"\n"
                     << "plot = \"none\"\nrun_dir = \"runs/" << name << "\"\n";
    return p.string();
  }
  static std::vector<nlohmann::json> metrics(const std::string& run, const std::string& type) {
    std::ifstream f(dir_ / "runs" / run / "metrics.jsonl");
    std::vector<nlohmann::json> v;
    for (std::string line; std::getline(f, line);) {
      auto j = nlohmann::json::parse(line);
      if (j["type"] == type) v.push_back(j);
    }
    return v;
  }
  static nlohmann::json summary(const std::string& run) {
    return nlohmann::json::parse(slurp(dir_ / "runs" / run / "summary.json"));
  }
};
fs::path TrainerBf16::dir_;

// The mean train loss over steps [from, to) (1-based, log_interval 1).
double mean_loss(const std::vector<nlohmann::json>& m, size_t from, size_t to) {
  double s = 0;
  for (size_t i = from - 1; i < to - 1; ++i) s += double(m[i]["loss"]);
  return s / static_cast<double>(to - from);
}

TEST_F(TrainerBf16, TrainsWithinAToleranceOfFp32) {
  const auto fp = train(config("fp32", "fp32", 400, 0), "--fresh");
  ASSERT_EQ(fp.code, 0) << fp.out;
  const auto bf = train(config("bf16", "bf16", 400, 0), "--fresh");
  ASSERT_EQ(bf.code, 0) << bf.out;
  EXPECT_NE(bf.out.find("precision bf16"), std::string::npos) << bf.out;
  EXPECT_EQ(fp.out.find("precision bf16"), std::string::npos) << fp.out;
  const auto sf = summary("fp32"), sb = summary("bf16");
  EXPECT_EQ(sf["precision"], "fp32");
  EXPECT_EQ(sb["precision"], "bf16");
  const auto mf = metrics("fp32", "train"), mb = metrics("bf16", "train");
  ASSERT_EQ(mb.size(), 400U);
  ASSERT_EQ(mf.size(), 400U);
  // It trains: the last 20 steps' mean loss well under the first 10's.
  EXPECT_LT(mean_loss(mb, 381, 401), mean_loss(mb, 1, 11) - 1.0);
  // The first step: the same batch and initial weights, the forward in bf16.
  const double f1 = mf[0]["loss"], b1 = mb[0]["loss"];
  EXPECT_NE(f1, b1) << "bf16 rounding should change the bits";
  EXPECT_NEAR(b1, f1, 0.005 * f1);
  // The end: the held-out loss no more than 3% above fp32's, and within 6% of it either way.
  // The two trajectories drift apart chaotically, and the drift depends on the CPU's OpenBLAS
  // kernels: bf16 ended 1.5% above fp32 on the machine this was written on, 3.2% below on
  // an AVX-512 EPYC whose OpenBLAS runs its Zen kernels.
  const double ef = sf["final_eval_loss"], eb = sb["final_eval_loss"];
  std::string curves;
  const auto vf = metrics("fp32", "eval"), vb = metrics("bf16", "eval");
  for (size_t i = 0; i < vf.size() && i < vb.size(); ++i) {
    curves += "\n  step " + vf[i]["step"].dump() + ": fp32 " + vf[i]["eval_loss"].dump() +
              ", bf16 " + vb[i]["eval_loss"].dump();
  }
  std::cout << "final eval loss: fp32 " << ef << ", bf16 " << eb << curves << "\n";
  EXPECT_LE(eb, 1.03 * ef) << curves;
  EXPECT_NEAR(eb, ef, 0.06 * ef) << curves;
  // The checkpoints hold fp32 master weights, as fp32 runs' do: same names and sizes.
  const std::string ck = "checkpoints/step_00000400/model.rank0.safetensors";
  EXPECT_EQ(fs::file_size(dir_ / "runs/fp32" / ck), fs::file_size(dir_ / "runs/bf16" / ck));
}

TEST_F(TrainerBf16, InterruptedAndResumedMatchesUninterrupted) {
  const auto full = train(config("full", "bf16", 24, 5), "--fresh");
  ASSERT_EQ(full.code, 0) << full.out;
  // Stopped after step 13: the last checkpoint is step 10; steps 11-13 are done again.
  const auto part = train(config("part", "bf16", 24, 5), "--fresh --stop-after 13");
  ASSERT_EQ(part.code, 0) << part.out;
  const auto rest = train(config("part", "bf16", 24, 5), "--resume");
  ASSERT_EQ(rest.code, 0) << rest.out;
  EXPECT_NE(rest.out.find("resumed from"), std::string::npos) << rest.out;
  const auto a = metrics("full", "train"), b = metrics("part", "train");
  ASSERT_EQ(a.size(), 24U);
  ASSERT_EQ(b.size(), 24U);  // the resumed run's lines replace those past its checkpoint
  for (size_t i = 0; i < 24; ++i) {
    EXPECT_EQ(a[i]["step"], b[i]["step"]);
    EXPECT_EQ(a[i]["loss"], b[i]["loss"]) << "step " << i + 1;
    EXPECT_EQ(a[i]["grad_norm"], b[i]["grad_norm"]) << "step " << i + 1;
  }
  for (const char* f : {"model.rank0.safetensors", "optimizer.rank0.bin"}) {
    const std::string x = slurp(dir_ / "runs/full/checkpoints/step_00000024" / f);
    EXPECT_FALSE(x.empty()) << f;
    EXPECT_EQ(x, slurp(dir_ / "runs/part/checkpoints/step_00000024" / f)) << f;
  }
  EXPECT_EQ(summary("full")["final_eval_loss"], summary("part")["final_eval_loss"]);
}

// Quantization-aware training in bf16 mode: the quantizer (zeroquant, weight-only INT8) gets
// bf16 tensors; the run trains, near the fp32 QAT run and not the same bits, and its final
// evaluation runs through the quantizer's matmul.
TEST_F(TrainerBf16, QuantizationAwareTrainingHandsTheQuantizerBf16) {
  const std::string qat = "quantizer = \"w8\"\nqat = true\n";
  const auto fp = train(config("qat_fp32", "fp32", 40, 0, qat), "--fresh");
  ASSERT_EQ(fp.code, 0) << fp.out;
  const auto bf = train(config("qat_bf16", "bf16", 40, 0, qat), "--fresh");
  ASSERT_EQ(bf.code, 0) << bf.out;
  const auto sf = summary("qat_fp32"), sb = summary("qat_bf16");
  EXPECT_TRUE(bool(sb["qat"]));
  const auto mb = metrics("qat_bf16", "train");
  ASSERT_EQ(mb.size(), 40U);
  EXPECT_LT(mean_loss(mb, 31, 41), mean_loss(mb, 1, 11));
  const double ef = sf["final_eval_loss"], eb = sb["final_eval_loss"];
  EXPECT_NE(ef, eb);
  EXPECT_NEAR(eb, ef, 0.05 * ef);
}

}  // namespace
