// The trainer's [gradients] keys: defaults without the section, values read, and every bad
// value named at FILE:LINE:COL.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "config.hpp"

namespace fs = std::filesystem;
using namespace loom::trainer;

namespace {

fs::path config_file() {
  const fs::path d =
      fs::temp_directory_path() / ("loom-trainer-gradients-" + std::to_string(::getpid()));
  fs::create_directories(d);
  return d / "g.toml";
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

TEST(GradientsConfig, KeysAreReadAndBadValuesNamedAtTheirPlace) {
  const auto cfg = config_file();
  write(cfg, kBase);
  const TrainConfig plain = load_config(cfg.string());
  EXPECT_FALSE(plain.grad_buckets);
  write(cfg, kBase + "[gradients]\n");
  const TrainConfig defaults = load_config(cfg.string());
  EXPECT_TRUE(defaults.grad_buckets);
  EXPECT_EQ(defaults.bucket_mb, 25.0);
  EXPECT_TRUE(defaults.overlap);
  EXPECT_EQ(defaults.wire, "fp32");
  write(cfg, kBase + "[gradients]\nbucket_mb = 4\noverlap = false\nwire = \"bf16\"\n");
  const TrainConfig c = load_config(cfg.string());
  EXPECT_EQ(c.bucket_mb, 4.0);
  EXPECT_FALSE(c.overlap);
  EXPECT_EQ(c.wire, "bf16");

  auto expect = [&](const std::string& text, const std::string& what) {
    const std::string e = error_of(cfg, text);
    EXPECT_NE(e.find(cfg.string() + what), std::string::npos) << "wanted " << what << "\ngot " << e;
  };
  expect(kBase + "[gradients]\nwire = \"fp16\"\n",
         ":6:8: [gradients] wire: 'fp16' is not one of fp32, bf16");
  expect(kBase + "[gradients]\nbucket_mb = 0\n", ":6:13: [gradients] bucket_mb: 0 is out of range");
  expect(kBase + "[gradients]\noverlap = 1\n",
         ":6:11: [gradients] overlap: expected true or false");
  expect(kBase + "[gradients]\nbucket = 1\n", ":6:1: [gradients] bucket: unknown key");
  expect(kBase + "[gradient]\n", ":5:1: unknown top-level key or section 'gradient'");
}
