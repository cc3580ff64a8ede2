// The trainer's [routing] keys, lr_unit = "layer_tokens" and train_layer_tokens: values read,
// every bad value at FILE:LINE:COL, a router name the manifest lacks or gives another kind,
// the decay's end in layer tokens (and its overflow), and the learning rate by layer tokens.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
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
  const fs::path d =
      fs::temp_directory_path() / ("loom-trainer-routing-" + std::to_string(::getpid()));
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

const std::string kBase = "[manifest]\npath = \"m.toml\"\n[data]\ndataset = \"x\"\n";

}  // namespace

TEST(RoutingConfig, KeysAreReadAndBadValuesNamedAtTheirPlace) {
  const auto dir = temp_dir();
  const auto cfg = dir / "r.toml";
  write(cfg, kBase +
                 "[routing]\nrouter = \"ltd\"\n[train]\nlr_unit = \"layer_tokens\"\n"
                 "train_layer_tokens = 123456\n");
  const TrainConfig c = load_config(cfg.string());
  EXPECT_EQ(c.router, "ltd");
  EXPECT_EQ(c.router_at, cfg.string() + ":6:10");
  EXPECT_EQ(c.lr_unit, "layer_tokens");
  EXPECT_EQ(c.train_layer_tokens, 123456);
  write(cfg, kBase);
  const TrainConfig d = load_config(cfg.string());
  EXPECT_TRUE(d.router.empty());
  EXPECT_EQ(d.train_layer_tokens, 0);

  auto expect = [&](const std::string& text, const std::string& what) {
    const std::string e = error_of(cfg, text);
    EXPECT_NE(e.find(cfg.string() + what), std::string::npos) << "wanted " << what << "\ngot " << e;
  };
  expect(kBase + "[routing]\nrouter = 3\n", ":6:10: [routing] router: expected a string");
  expect(kBase + "[routing]\nrouter = \"\"\n", ":6:10: [routing] router: empty");
  expect(kBase + "[routing]\nrouters = \"a\"\n", ":6:1: [routing] routers: unknown key");
  EXPECT_NE(error_of(cfg, kBase + "[routing]\nrouters = \"a\"\n").find("did you mean 'router'"),
            std::string::npos);
  expect(kBase + "[routng]\nrouter = \"a\"\n", ":5:1: unknown top-level key or section 'routng'");
  expect(kBase + "[train]\nlr_unit = \"layer_token\"\n",
         ":6:11: [train] lr_unit: 'layer_token' is not one of steps, tokens, layer_tokens");
  expect(kBase + "[train]\ntrain_layer_tokens = -2\n",
         ":6:22: [train] train_layer_tokens: -2 is out of range");
}

// The decay's end: train_layer_tokens, else layers x the decay's tokens (train_tokens, or
// steps x batch_size x seq_len); a product past 2^62 is refused where it comes from.
TEST(RoutingConfig, DecayLayerTokensAndTheirOverflow) {
  const auto dir = temp_dir();
  const auto cfg = dir / "d.toml";
  const std::string model = "[model]\nlayers = 6\ncontext = 128\n";
  write(cfg, kBase + model +
                 "[train]\nlr_unit = \"layer_tokens\"\nsteps = 10\nbatch_size = 4\nseq_len = "
                 "32\n");
  EXPECT_EQ(decay_layer_tokens(load_config(cfg.string())), 6u * 10 * 4 * 32);
  write(cfg, kBase + model + "[train]\nlr_unit = \"layer_tokens\"\ntrain_tokens = 1000\n");
  EXPECT_EQ(decay_layer_tokens(load_config(cfg.string())), 6000u);
  write(cfg, kBase + model +
                 "[train]\nlr_unit = \"layer_tokens\"\ntrain_tokens = 1000\ntrain_layer_tokens "
                 "= 777\n");
  EXPECT_EQ(decay_layer_tokens(load_config(cfg.string())), 777u);
  const std::string e = error_of(cfg, kBase + model +
                                          "[train]\nlr_unit = \"layer_tokens\"\ntrain_tokens = "
                                          "1000000000000000000\n");
  EXPECT_NE(e.find(cfg.string() + ":10:16: [train] [model] layers 6 x train_tokens"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("exceed 2^62"), std::string::npos) << e;
  const std::string f =
      error_of(cfg, kBase + model +
                        "[train]\nlr_unit = \"layer_tokens\"\nsteps = 1099511627776\nbatch_size = "
                        "1048576\n");
  EXPECT_NE(f.find(cfg.string() + ":10:9: [train] [model] layers 6 x steps x batch_size"),
            std::string::npos)
      << f;
  // An explicit end needs no product.
  EXPECT_EQ(error_of(cfg, kBase + model +
                              "[train]\nlr_unit = \"layer_tokens\"\ntrain_tokens = "
                              "1000000000000000000\ntrain_layer_tokens = 5\n"),
            "");
}

TEST(RoutingConfig, LrByLayerTokensFollowsTheirProgress) {
  TrainConfig c;
  c.model.layers = 4;
  c.steps = 100;
  c.batch_size = 2;
  c.seq_len = 16;
  c.lr = 1.0;
  c.min_lr = 0.1;
  c.warmup_steps = 10;
  c.lr_unit = "layer_tokens";
  const uint64_t end = decay_layer_tokens(c);
  ASSERT_EQ(end, 4u * 100 * 2 * 16);
  const uint64_t per_step = 4u * 2 * 16;  // no routing: every layer every token
  // Without routing it is the step schedule.
  for (int64_t s : {1, 5, 10, 11, 50, 99, 100}) {
    EXPECT_NEAR(lr_at_layer_tokens(c, s, per_step * s, per_step * 10), lr_at(c, s), 1e-12) << s;
  }
  // Half the layer tokens of the decay: the cosine's midpoint, whatever the step.
  const uint64_t w = 1000;
  const uint64_t mid = w + (end - w) / 2;
  EXPECT_NEAR(lr_at_layer_tokens(c, 40, mid, w), 0.1 + 0.9 * 0.5, 1e-9);
  EXPECT_NEAR(lr_at_layer_tokens(c, 40, end + 5, w), 0.1, 1e-12);
  EXPECT_NEAR(lr_at_layer_tokens(c, 40, w, w), 1.0, 1e-12);
  EXPECT_NEAR(lr_at_layer_tokens(c, 3, mid, w), 0.3, 1e-12);  // warmup is by step
}

TEST(RoutingConfig, RouterNamesTheManifestLacksOrGivesAnotherKind) {
  const auto dir = temp_dir();
  write(dir / "m.toml",
        "[optimizer.main]\nplugin = \"adam\"\n[router.ltd]\nplugin = \"random_ltd\"\n"
        "[router.mod]\nplugin = \"topk_router\"\n");
  const auto cfg = dir / "k.toml";
  write(cfg,
        "[manifest]\npath = \"m.toml\"\ncomm = \"\"\n[data]\ndataset = \"x\"\n"
        "[routing]\nrouter = \"ldt\"\n");
  auto p = manifest_name_problems(load_config(cfg.string()));
  ASSERT_EQ(p.size(), 1u);
  EXPECT_NE(p[0].find(cfg.string() + ":7:10: [routing] router 'ldt': "), std::string::npos) << p[0];
  EXPECT_NE(p[0].find("has no [router.ldt] (it has [router.ltd], [router.mod])"), std::string::npos)
      << p[0];
  write(cfg,
        "[manifest]\npath = \"m.toml\"\ncomm = \"\"\n[data]\ndataset = \"x\"\n"
        "[routing]\nrouter = \"main\"\n");
  p = manifest_name_problems(load_config(cfg.string()));
  ASSERT_EQ(p.size(), 1u);
  EXPECT_NE(p[0].find("[optimizer.main] is not a router"), std::string::npos) << p[0];
  write(cfg,
        "[manifest]\npath = \"m.toml\"\ncomm = \"\"\n[data]\ndataset = \"x\"\n"
        "[routing]\nrouter = \"mod\"\n");
  EXPECT_TRUE(manifest_name_problems(load_config(cfg.string())).empty());
}

TEST(RoutingConfig, TrainLayerTokensWithAnotherLrUnitWarns) {
  const auto dir = temp_dir();
  const auto cfg = dir / "w.toml";
  write(cfg, kBase + "[train]\ntrain_layer_tokens = 5000\n");
  const auto w = config_warnings(load_config(cfg.string()));
  ASSERT_EQ(w.size(), 1u);
  EXPECT_NE(w[0].find(cfg.string() + ":6:22: [train] train_layer_tokens: warning:"),
            std::string::npos)
      << w[0];
  write(cfg, kBase + "[train]\ntrain_layer_tokens = 5000\nlr_unit = \"layer_tokens\"\n");
  EXPECT_TRUE(config_warnings(load_config(cfg.string())).empty());
}
