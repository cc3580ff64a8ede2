#include "config.hpp"

#include <toml++/toml.h>
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <numbers>
#include <set>
#include <sstream>

namespace loom::trainer {

namespace {

std::string where(const std::string& file, const toml::source_region& r) {
  std::ostringstream s;
  s << file << ":" << r.begin.line << ":" << r.begin.column;
  return s.str();
}

struct Reader {
  std::string file;
  const toml::table* table;
  std::string section;
  std::set<std::string> known;

  const toml::node* node(const char* key) {
    known.insert(key);
    return table ? table->get(key) : nullptr;
  }
  [[noreturn]] void fail(const toml::node& n, const std::string& key, const std::string& what) {
    throw ConfigError(where(file, n.source()) + ": [" + section + "] " + key + ": " + what);
  }
  void str(const char* key, std::string& out) {
    if (auto* n = node(key)) {
      if (!n->is_string()) fail(*n, key, "expected a string");
      out = n->as_string()->get();
    }
  }
  template <class T>
  void integer(const char* key, T& out, int64_t lo, int64_t hi) {
    if (auto* n = node(key)) {
      if (!n->is_integer()) fail(*n, key, "expected an integer");
      const int64_t v = n->as_integer()->get();
      if (v < lo || v > hi) {
        fail(*n, key,
             std::to_string(v) + " is out of range [" + std::to_string(lo) + ", " +
                 std::to_string(hi) + "]");
      }
      out = static_cast<T>(v);
    }
  }
  void boolean(const char* key, bool& out) {
    if (auto* n = node(key)) {
      if (!n->is_boolean()) fail(*n, key, "expected true or false");
      out = n->as_boolean()->get();
    }
  }
  void number(const char* key, double& out, double lo, double hi) {
    if (auto* n = node(key)) {
      double v;
      if (n->is_floating_point()) {
        v = n->as_floating_point()->get();
      } else if (n->is_integer()) {
        v = static_cast<double>(n->as_integer()->get());
      } else {
        fail(*n, key, "expected a number");
      }
      if (!(v >= lo && v <= hi)) {
        std::ostringstream s;
        s << v << " is out of range [" << lo << ", " << hi << "]";
        fail(*n, key, s.str());
      }
      out = v;
    }
  }
  void finish() {
    if (!table) return;
    for (const auto& [k, v] : *table) {
      if (!known.count(std::string(k.str()))) {
        (void)v;
        throw ConfigError(where(file, k.source()) + ": [" + section + "] " + std::string(k.str()) +
                          ": unknown key");
      }
    }
  }
};

std::string resolve(const std::filesystem::path& dir, const std::string& p) {
  if (p.empty()) return p;
  std::filesystem::path q(p);
  return (q.is_absolute() ? q : (dir / q)).lexically_normal().string();
}

}  // namespace

TrainConfig load_config(const std::string& path) {
  toml::parse_result r = toml::parse_file(path);
  if (!r) {
    const auto& e = r.error();
    if (!std::filesystem::exists(path)) throw ConfigError(path + ": cannot open the config file");
    throw ConfigError(where(path, e.source()) + ": " + std::string(e.description()));
  }
  const toml::table& root = r.table();
  TrainConfig c;
  c.config_path = path;
  const std::set<std::string> sections{"manifest", "model", "data", "train"};
  for (const auto& [k, v] : root) {
    if (!sections.count(std::string(k.str())) || !v.is_table()) {
      throw ConfigError(where(path, v.source()) + ": unknown top-level key or section '" +
                        std::string(k.str()) +
                        "' (expected tables [manifest], [model], [data], [train])");
    }
  }
  auto sect = [&](const char* name) { return Reader{path, root[name].as_table(), name, {}}; };
  const auto dir = std::filesystem::absolute(path).parent_path();

  Reader man = sect("manifest");
  man.str("path", c.manifest);
  man.str("optimizer", c.optimizer);
  man.str("comm", c.comm);
  man.finish();
  if (c.manifest.empty()) throw ConfigError(path + ": [manifest] path is required");
  c.manifest = resolve(dir, c.manifest);

  Reader model = sect("model");
  model.integer("vocab_size", c.model.vocab_size, 0, 65536);
  model.integer("context", c.model.context, 1, 1 << 16);
  model.integer("layers", c.model.layers, 1, 1024);
  model.integer("heads", c.model.heads, 1, 1024);
  model.integer("dim", c.model.dim, 1, 1 << 16);
  model.finish();

  Reader data = sect("data");
  data.str("dataset", c.dataset);
  data.finish();
  if (c.dataset.empty()) throw ConfigError(path + ": [data] dataset is required");
  c.dataset = resolve(dir, c.dataset);

  Reader t = sect("train");
  constexpr int64_t kBig = int64_t{1} << 40;
  t.integer("steps", c.steps, 1, kBig);
  t.integer("batch_size", c.batch_size, 1, 1 << 20);
  t.integer("seq_len", c.seq_len, 1, 1 << 16);
  t.integer("seed", c.seed, 0, INT64_MAX);
  t.number("lr", c.lr, 0.0, 10.0);
  t.number("min_lr", c.min_lr, 0.0, 10.0);
  t.integer("warmup_steps", c.warmup_steps, 0, kBig);
  t.str("decay", c.decay);
  t.number("clip_grad_norm", c.clip_grad_norm, 0.0, 1e30);
  t.integer("eval_interval", c.eval_interval, 0, kBig);
  t.integer("eval_batches", c.eval_batches, 1, 1 << 20);
  t.integer("checkpoint_interval", c.checkpoint_interval, 0, kBig);
  t.integer("log_interval", c.log_interval, 1, kBig);
  t.integer("stop_after", c.stop_after, 0, kBig);
  t.str("run_dir", c.run_dir);
  t.str("plot", c.plot);
  t.integer("threads", c.threads, 0, 1024);
  t.boolean("mask_unused_positions", c.mask_unused_positions);
  t.finish();
  if (c.decay != "cosine" && c.decay != "linear" && c.decay != "constant") {
    throw ConfigError(path + ": [train] decay: '" + c.decay +
                      "' is not one of cosine, linear, constant");
  }
  if (c.seq_len > c.model.context) {
    throw ConfigError(path + ": [train] seq_len " + std::to_string(c.seq_len) +
                      " exceeds [model] context " + std::to_string(c.model.context));
  }
  if (c.min_lr > c.lr) throw ConfigError(path + ": [train] min_lr is above lr");
  if (c.run_dir.empty()) {
    c.run_dir = (dir / "runs" / std::filesystem::path(path).stem()).string();
  } else {
    c.run_dir = resolve(dir, c.run_dir);
  }
  if (c.plot == "auto")
    c.plot = (std::filesystem::path(c.run_dir) / "loss.png").string();
  else if (c.plot == "none")
    c.plot.clear();
  else
    c.plot = resolve(dir, c.plot);
  return c;
}

double lr_at(const TrainConfig& c, int64_t step) {
  if (c.warmup_steps > 0 && step <= c.warmup_steps) {
    return c.lr * static_cast<double>(step) / static_cast<double>(c.warmup_steps);
  }
  if (c.decay == "constant" || c.steps <= c.warmup_steps) return c.lr;
  const double p = std::clamp(
      static_cast<double>(step - c.warmup_steps) / static_cast<double>(c.steps - c.warmup_steps),
      0.0, 1.0);
  const double f = c.decay == "cosine" ? 0.5 * (1.0 + std::cos(std::numbers::pi * p)) : 1.0 - p;
  return c.min_lr + (c.lr - c.min_lr) * f;
}

}  // namespace loom::trainer
