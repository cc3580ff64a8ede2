// libFuzzer target for the trainer's config reader (trainer/train/config.cpp). The
// input is a trainer config, optionally followed by a NUL byte and a Loom manifest (TOML
// cannot contain NUL, so the split never hides a config byte). The config goes through
// read_config from an in-memory file; an accepted one through everything that reads its
// values (warnings, quantized tensor names, the learning-rate schedules), and, with the
// manifest part standing in for the manifest it names, through the functions that read the
// manifest (name checks, the curriculum and MoE check manifests). Paths the input names are
// never opened: the manifest path is replaced, and index files are not looked at.
// Besides crashes and sanitizer reports, it checks:
//  - every problem and every ConfigError line names the config file;
//  - a config without problems gives learning rates in [0, lr] at every step looked at.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "config.hpp"
#include "fuzz_common.hpp"

namespace {

using loom::trainer::ConfigError;
using loom::trainer::TrainConfig;

constexpr const char* kTarget = "config_fuzz";
volatile double g_sink = 0;  // keeps computed values from being optimised out

loom_fuzz::MemFile* g_config = nullptr;
loom_fuzz::MemFile* g_manifest = nullptr;

void check_named(const std::string& line) {
  if (line.rfind(g_config->path(), 0) != 0) {
    loom_fuzz::invariant_failed(kTarget, "a problem that does not name the file", line);
  }
}

void check_lr(const TrainConfig& c, double lr, int64_t step) {
  if (!(lr >= 0.0 && lr <= c.lr * (1 + 1e-12))) {
    loom_fuzz::invariant_failed(kTarget, "learning rate out of [0, lr]",
                                std::to_string(lr) + " at step " + std::to_string(step));
  }
}

// Every reader of an accepted config's values.
void use(const TrainConfig& c, bool valid) {
  for (const auto& w : loom::trainer::config_warnings(c)) check_named(w);
  std::vector<std::string> problems;
  g_sink = g_sink + static_cast<double>(loom::trainer::quantized_tensor_names(c, &problems).size());
  for (const auto& p : problems) check_named(p);
  const uint64_t tokens = loom::trainer::decay_tokens(c);
  const uint64_t layer_tokens = loom::trainer::decay_layer_tokens(c);
  const int64_t steps[] = {1, c.warmup_steps, c.warmup_steps + 1, c.steps / 2, c.steps};
  for (const int64_t s : steps) {
    if (s < 1) continue;
    const double a = loom::trainer::lr_at(c, s);
    const double b = loom::trainer::lr_at_tokens(c, s, tokens / 2, tokens / 4);
    const double d = loom::trainer::lr_at_layer_tokens(c, s, layer_tokens, layer_tokens / 3);
    if (valid) {
      check_lr(c, a, s);
      check_lr(c, b, s);
      check_lr(c, d, s);
    }
    g_sink = g_sink + a + b + d;
  }
  g_sink = g_sink + loom::trainer::step_seq_len(c.steps, c.seq_len);
  g_sink = g_sink + static_cast<double>(
                        loom::trainer::with_run_values("run loom data analyze DATASET", c).size());
}

// The readers of the manifest a config names, over the input's manifest part.
void use_manifest(TrainConfig c) {
  c.manifest = g_manifest->path();
  for (const auto& p : loom::trainer::manifest_name_problems(c)) {
    g_sink = g_sink + static_cast<double>(p.size());
  }
  // (The sampler's index, the MoE instance's comm and ep_size come from libloom's validated
  // parameters now, and the curriculum's sections are opened by libloom: manifest_fuzz.)
  g_sink = g_sink + static_cast<double>(loom::trainer::moe_check_manifest(c).size());
}

std::string read_text(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Seeds: the example trainer configs with the manifests they name, and a few variants.
std::vector<loom_fuzz::Seed> seeds() {
  const std::filesystem::path ex = std::filesystem::path(LOOM_FUZZ_SOURCE_DIR) / "examples";
  const std::pair<const char*, const char*> pairs[] = {
      {"train_adam.toml", "adam.toml"},
      {"train_slw.toml", "slw.toml"},
      {"train_zero_one_adam.toml", "zero_one_adam.toml"},
      {"moe/prmoe.toml", "moe/manifest.toml"},
      {"quantization/w4a8_lkd.toml", "quantization/quantization.toml"},
      {"quantization/eval.toml", "quantization/quantization.toml"},
      {"token_routing/routing_ltd.toml", "token_routing/routing.toml"},
      {"data_efficiency/curriculum_voc_slw.toml", "data_efficiency/curriculum.toml"},
  };
  std::vector<loom_fuzz::Seed> out;
  for (const auto& [config, manifest] : pairs) {
    const std::string c = read_text(ex / config);
    const std::string m = read_text(ex / manifest);
    if (c.empty() || m.empty()) {
      std::fprintf(stderr, "config_fuzz: cannot read %s or %s\n", config, manifest);
      std::exit(1);
    }
    std::string name = config;
    for (char& ch : name) ch = ch == '/' ? '_' : ch;
    out.push_back({name, loom_fuzz::bytes_of(c + std::string(1, '\0') + m)});
    out.push_back({"config_only_" + name, loom_fuzz::bytes_of(c)});
  }
  out.push_back({"lr_units",
                 loom_fuzz::bytes_of("[manifest]\npath = \"m.toml\"\n[data]\ndataset = \"d.bin\"\n"
                                     "[train]\nlr_unit = \"layer_tokens\"\nsteps = 7\n"
                                     "warmup_steps = 9\ntrain_layer_tokens = 5\n"
                                     "decay = \"linear\"\n[routing]\nrouter = \"r\"\n")});
  out.push_back({"manifest_not_config", loom_fuzz::bytes_of("[loom]\nversion = 1\n")});
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  loom_fuzz::write_seeds_if_asked(seeds());
  g_config = new loom_fuzz::MemFile("config_fuzz.toml");
  g_manifest = new loom_fuzz::MemFile("config_fuzz_manifest.toml");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto* nul = static_cast<const uint8_t*>(std::memchr(data, 0, size));
  const size_t config_size = nul != nullptr ? static_cast<size_t>(nul - data) : size;
  g_config->set(data, config_size);
  if (nul != nullptr) g_manifest->set(nul + 1, size - config_size - 1);
  std::vector<std::string> problems;
  TrainConfig c;
  try {
    c = loom::trainer::read_config(g_config->path(), problems);
  } catch (const ConfigError& e) {
    for (const auto& line : e.errors()) check_named(line);
    return 0;
  }
  for (const auto& p : problems) check_named(p);
  use(c, problems.empty());
  if (nul != nullptr) use_manifest(c);
  return 0;
}
