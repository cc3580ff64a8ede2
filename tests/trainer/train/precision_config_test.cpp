// The trainer's [train] precision key: fp32 by default, bf16 read, any other value named at
// FILE:LINE:COL.
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
      fs::temp_directory_path() / ("loom-trainer-precision-" + std::to_string(::getpid()));
  fs::create_directories(d);
  return d / "p.toml";
}
void write(const fs::path& p, const std::string& s) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f << s;
}

const std::string kBase = "[manifest]\npath = \"m.toml\"\n[data]\ndataset = \"x\"\n";

}  // namespace

TEST(PrecisionConfig, DefaultsToFp32ReadsBf16AndNamesABadValueAtItsPlace) {
  const auto cfg = config_file();
  write(cfg, kBase);
  EXPECT_EQ(load_config(cfg.string()).precision, "fp32");
  write(cfg, kBase + "[train]\nprecision = \"bf16\"\n");
  EXPECT_EQ(load_config(cfg.string()).precision, "bf16");
  write(cfg, kBase + "[train]\nprecision = \"fp32\"\n");
  EXPECT_EQ(load_config(cfg.string()).precision, "fp32");

  auto error_of = [&](const std::string& text) -> std::string {
    write(cfg, text);
    try {
      load_config(cfg.string());
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "";
  };
  std::string e = error_of(kBase + "[train]\nsteps = 3\nprecision = \"bf61\"\n");
  EXPECT_NE(e.find(cfg.string() + ":7:13: [train] precision: 'bf61' is not one of fp32, bf16"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("bf16"), std::string::npos) << e;  // the suggestion
  e = error_of(kBase + "[train]\nprecision = \"fp16\"\n");
  EXPECT_NE(e.find(":6:13: [train] precision: 'fp16' is not one of fp32, bf16"), std::string::npos)
      << e;
  e = error_of(kBase + "[train]\nprecision = 16\n");
  EXPECT_NE(e.find(":6:13: [train] precision: expected a string"), std::string::npos) << e;
}
