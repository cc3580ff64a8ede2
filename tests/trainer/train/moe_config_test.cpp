// The trainer's [moe] keys: values read (one expert count for every layer, or one per layer),
// the defaults, every bad value at FILE:LINE:COL, an instance name the manifest lacks, and the
// text `loom check` opens to plan the MoE instance without its comm.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "config.hpp"

namespace fs = std::filesystem;
using namespace loom::trainer;

namespace {

fs::path temp_dir() {
  const fs::path d = fs::temp_directory_path() / ("loom-trainer-moe-" + std::to_string(::getpid()));
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

// [model] layers 4; [moe] starts on line 7.
const std::string kBase =
    "[manifest]\npath = \"m.toml\"\n[data]\ndataset = \"x\"\n[model]\nlayers = 4\n";

}  // namespace

TEST(MoeConfig, KeysAreReadWithTheirDefaults) {
  const auto dir = temp_dir();
  const auto cfg = dir / "m.toml";
  write(cfg, kBase +
                 "[moe]\ninstance = \"experts\"\nlayers = [1, 3]\nexperts = [4, 8]\n"
                 "hidden = 96\naux_loss_coef = 0.05\n");
  const TrainConfig c = load_config(cfg.string());
  EXPECT_EQ(c.moe, "experts");
  EXPECT_EQ(c.moe_at, cfg.string() + ":8:12");
  EXPECT_EQ(c.moe_layers, (std::vector<int>{1, 3}));
  EXPECT_EQ(c.moe_experts, (std::vector<int>{4, 8}));
  EXPECT_EQ(c.moe_hidden, 96);
  EXPECT_DOUBLE_EQ(c.moe_aux_loss_coef, 0.05);
  // One count for every layer; no count: the instance's num_experts (0); defaults.
  write(cfg, kBase + "[moe]\ninstance = \"e\"\nlayers = [0, 2, 3]\nexperts = 8\n");
  const TrainConfig d = load_config(cfg.string());
  EXPECT_EQ(d.moe_experts, (std::vector<int>{8, 8, 8}));
  EXPECT_EQ(d.moe_hidden, 0);
  EXPECT_DOUBLE_EQ(d.moe_aux_loss_coef, 0.01);
  write(cfg, kBase + "[moe]\ninstance = \"e\"\nlayers = [2]\n");
  EXPECT_EQ(load_config(cfg.string()).moe_experts, (std::vector<int>{0}));
  write(cfg, kBase);
  const TrainConfig none = load_config(cfg.string());
  EXPECT_TRUE(none.moe.empty());
  EXPECT_TRUE(none.moe_layers.empty());
}

TEST(MoeConfig, BadValuesAreNamedAtTheirPlace) {
  const auto dir = temp_dir();
  const auto cfg = dir / "m.toml";
  auto expect = [&](const std::string& moe, const std::string& what) {
    const std::string e = error_of(cfg, kBase + "[moe]\n" + moe);
    EXPECT_NE(e.find(cfg.string() + what), std::string::npos) << "wanted " << what << "\ngot " << e;
  };
  expect("layers = [1]\n", ":7:1: [moe]: no instance");
  expect("instance = \"\"\nlayers = [1]\n", ":8:12: [moe] instance: empty");
  expect("instance = 2\nlayers = [1]\n", ":8:12: [moe] instance: expected a string");
  expect("instance = \"e\"\n", ":7:1: [moe]: no layers");
  expect("instance = \"e\"\nlayers = []\n", ":9:10: [moe] layers: expected a non-empty array");
  expect("instance = \"e\"\nlayers = [1, 4]\n",
         ":9:14: [moe] layers: 4 is not a layer of the model ([model] layers 4: 0 .. 3)");
  expect("instance = \"e\"\nlayers = [1, -1]\n", ":9:14: [moe] layers: -1 is not a layer");
  expect("instance = \"e\"\nlayers = [1, 1]\n", ":9:14: [moe] layers: layer 1 is listed twice");
  expect("instance = \"e\"\nlayers = [\"1\"]\n",
         ":9:11: [moe] layers: expected an integer layer index");
  expect("instance = \"e\"\nlayers = [1, 2]\nexperts = [4]\n",
         ":10:11: [moe] experts: 1 counts for 2 layers (give one count for every layer, or one "
         "per entry of layers)");
  expect("instance = \"e\"\nlayers = [1, 2]\nexperts = [4, 0]\n",
         ":10:15: [moe] experts: 0 is out of range [1, 65536]");
  expect("instance = \"e\"\nlayers = [1]\nexperts = 2.5\n",
         ":10:11: [moe] experts: expected an integer expert count");
  expect("instance = \"e\"\nlayers = [1]\nhidden = 0\n", ":10:10: [moe] hidden: 0 is out of range");
  expect("instance = \"e\"\nlayers = [1]\naux_loss_coef = -1\n",
         ":10:17: [moe] aux_loss_coef: -1 is out of range");
  expect("instance = \"e\"\nlayers = [1]\nexpert = 4\n", ":10:1: [moe] expert: unknown key");
  EXPECT_NE(error_of(cfg, kBase + "[moe]\ninstance = \"e\"\nlayers = [1]\nexpert = 4\n")
                .find("did you mean 'experts'"),
            std::string::npos);
  // Every problem is reported, not just the first.
  const std::string e =
      error_of(cfg, kBase + "[moe]\ninstance = \"e\"\nlayers = [9]\nhidden = -3\n");
  EXPECT_NE(e.find(":9:11: [moe] layers: 9"), std::string::npos) << e;
  EXPECT_NE(e.find(":10:10: [moe] hidden: -3"), std::string::npos) << e;
}

TEST(MoeConfig, TheManifestMustHaveTheInstance) {
  const auto dir = temp_dir();
  const auto cfg = dir / "n.toml";
  write(dir / "m.toml", "[optimizer.main]\nplugin = \"adam\"\n[moe.experts]\nplugin = \"moe\"\n");
  write(cfg, kBase + "[moe]\ninstance = \"expert\"\nlayers = [1]\n");
  const TrainConfig c = load_config(cfg.string());
  TrainConfig one = c;
  one.comm.clear();
  const auto problems = manifest_name_problems(one);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_NE(problems[0].find(cfg.string() + ":8:12: [moe] instance 'expert': "), std::string::npos)
      << problems[0];
  EXPECT_NE(problems[0].find("has no [moe.expert] (it has [moe.experts])"), std::string::npos)
      << problems[0];
}

// loom check plans the instance from the manifest's [loom] and [moe.*] tables alone, its comm
// and ep_size lines blanked (the rest keep their line numbers); the ep_size and its place come
// from libloom's validated parameters.
TEST(MoeConfig, CheckManifestDropsTheCommAndKeepsLines) {
  const auto dir = temp_dir();
  const auto cfg = dir / "c.toml";
  write(dir / "m.toml",
        "[comm.world]\nplugin = \"ucx\"\n[optimizer.main]\nplugin = \"adam\"\n"
        "[moe.experts]\nplugin = \"moe\"\nk = 2\ncomm = \"world\"\nep_size = 4\n");
  write(cfg, kBase + "[moe]\ninstance = \"experts\"\nlayers = [1]\n");
  const TrainConfig c = load_config(cfg.string());
  // The manifest as libloom validated it, as loom check opens it.
  auto ep_size = [&](std::string& at) {
    loom_open_options o{};
    o.struct_size = LOOM_OPEN_OPTIONS_SIZE;
    o.validate_only = 1;
    o.log_level = LOOM_LOG_WARN;
    loom_session* s = nullptr;
    EXPECT_EQ(loom_open_file(c.manifest.c_str(), &o, &s), LOOM_OK) << loom_last_error();
    const int64_t ep = s != nullptr ? moe_instance_ep_size(s, c, at) : -1;
    loom_close(s);
    return ep;
  };
  std::string at;
  EXPECT_EQ(ep_size(at), 4);
  EXPECT_EQ(at, (dir / "m.toml").string() + ":9:1");
  const std::string text = moe_check_manifest(c);
  EXPECT_EQ(text, "\n\n\n\n[moe.experts]\nplugin = \"moe\"\nk = 2\n\n\n");
  write(dir / "m.toml", "[optimizer.main]\nplugin = \"adam\"\n[moe.experts]\nplugin = \"moe\"\n");
  EXPECT_FALSE(moe_check_manifest(c).empty());
  EXPECT_EQ(ep_size(at), 1);
  EXPECT_TRUE(at.empty());
}
