#include "config.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <loom_cli_support.hpp>
#include <loom_toml.hpp>  // toml++, patched for bad input
#include <numbers>
#include <sstream>

#include <loom/data/metric_index.hpp>
#include <vector>
#include "quantization.hpp"

namespace loom::trainer {

namespace {

std::string where(const std::string& file, const toml::source_region& r) {
  std::ostringstream s;
  s << file << ":" << r.begin.line << ":" << r.begin.column;
  return s.str();
}

// Every problem found, in file order of discovery; load_config throws them all at once.
struct Errors {
  std::vector<std::string> list;
  void add(std::string e) { list.push_back(std::move(e)); }
};

struct Reader {
  std::string file;
  const toml::table* table;
  std::string section;
  Errors* errors;
  std::vector<std::string> known{};

  const toml::node* node(const char* key) {
    known.emplace_back(key);
    return table ? table->get(key) : nullptr;
  }
  // Where a key's value is, or its section (or the file's start) when the key is absent.
  std::string at(const char* key) const {
    const toml::node* n = table ? table->get(key) : nullptr;
    if (n) return where(file, n->source());
    if (table) return where(file, table->source());
    return file + ":1:1";
  }
  void fail(const toml::node& n, const std::string& key, const std::string& what) {
    errors->add(where(file, n.source()) + ": [" + section + "] " + key + ": " + what);
  }
  void str(const char* key, std::string& out) {
    if (auto* n = node(key)) {
      if (!n->is_string()) return fail(*n, key, "expected a string");
      out = n->as_string()->get();
    }
  }
  template <class T>
  void integer(const char* key, T& out, int64_t lo, int64_t hi) {
    if (auto* n = node(key)) {
      if (!n->is_integer()) return fail(*n, key, "expected an integer");
      const int64_t v = n->as_integer()->get();
      if (v < lo || v > hi) {
        return fail(*n, key,
                    std::to_string(v) + " is out of range [" + std::to_string(lo) + ", " +
                        std::to_string(hi) + "]");
      }
      out = static_cast<T>(v);
    }
  }
  void boolean(const char* key, bool& out) {
    if (auto* n = node(key)) {
      if (!n->is_boolean()) return fail(*n, key, "expected true or false");
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
        return fail(*n, key, "expected a number");
      }
      if (!(v >= lo && v <= hi)) {
        return fail(*n, key,
                    loom_cli::number(v) + " is out of range [" + loom_cli::number(lo) + ", " +
                        loom_cli::number(hi) + "]");
      }
      out = v;
    }
  }
  void finish() {
    if (!table) return;
    for (const auto& [k, v] : *table) {
      const std::string name(k.str());
      if (std::find(known.begin(), known.end(), name) == known.end()) {
        (void)v;
        errors->add(where(file, k.source()) + ": [" + section + "] " + name + ": unknown key" +
                    loom_text::did_you_mean(name, known));
      }
    }
  }
};

std::string resolve(const std::filesystem::path& dir, const std::string& p) {
  if (p.empty()) return p;
  std::filesystem::path q(p);
  return (q.is_absolute() ? q : (dir / q)).lexically_normal().string();
}

std::string joined(const std::vector<std::string>& lines) {
  std::string out;
  for (const auto& l : lines) out += (out.empty() ? "" : "\n") + l;
  return out;
}

// [moe]: instance, layers, experts (one or one per layer), hidden, aux_loss_coef.
void read_moe(Reader m, TrainConfig& c, Errors& errors) {
  m.str("instance", c.moe);
  c.moe_at = m.at("instance");
  c.moe_layers_at = m.at("layers");
  c.moe_experts_at = m.at("experts");
  m.integer("hidden", c.moe_hidden, 1, 1 << 20);
  m.number("aux_loss_coef", c.moe_aux_loss_coef, 0.0, 1e6);
  const toml::node* layers = m.node("layers");
  const toml::node* experts = m.node("experts");
  m.finish();
  if (m.table == nullptr) return;
  const toml::node* inst = m.table->get("instance");
  if (inst == nullptr) {
    errors.add(c.moe_at +
               ": [moe]: no instance (the manifest's [moe.NAME]; leave [moe] out for "
               "a dense model)");
  } else if (inst->is_string() && inst->as_string()->get().empty()) {
    errors.add(c.moe_at + ": [moe] instance: empty (leave [moe] out for a dense model)");
  }
  const toml::array* la = layers != nullptr ? layers->as_array() : nullptr;
  const size_t count = la != nullptr ? la->size() : 0;
  // experts: one count for every layer, or one per entry of layers (in the same order).
  auto one = [&](const toml::node& e) {
    if (!e.is_integer()) {
      m.fail(e, "experts", "expected an integer expert count");
      return 0;
    }
    const int64_t v = e.as_integer()->get();
    if (v < 1 || v > 65536) {
      m.fail(e, "experts", std::to_string(v) + " is out of range [1, 65536]");
      return 0;
    }
    return static_cast<int>(v);
  };
  std::vector<int> per(count, 0);  // 0: the instance's num_experts
  if (experts != nullptr && experts->is_array()) {
    const toml::array& a = *experts->as_array();
    if (a.size() != count) {
      m.fail(*experts, "experts",
             std::to_string(a.size()) + " counts for " + std::to_string(count) +
                 " layers (give one count for every layer, or one per entry of layers)");
    }
    for (size_t i = 0; i < a.size(); ++i) {
      const int v = one(*a.get(i));
      if (i < count) per[i] = v;
    }
  } else if (experts != nullptr) {
    std::fill(per.begin(), per.end(), one(*experts));
  }
  const int L = c.model.layers;
  if (layers == nullptr) {
    errors.add(c.moe_layers_at +
               ": [moe]: no layers (the indices of the MoE blocks, e.g. layers = [1, 3])");
    return;
  }
  if (la == nullptr || la->empty()) {
    m.fail(*layers, "layers", "expected a non-empty array of layer indices");
    return;
  }
  for (size_t i = 0; i < count; ++i) {
    const toml::node& e = *la->get(i);
    if (!e.is_integer()) {
      m.fail(e, "layers", "expected an integer layer index");
      continue;
    }
    const int64_t v = e.as_integer()->get();
    if (v < 0 || v >= L) {
      m.fail(e, "layers",
             std::to_string(v) + " is not a layer of the model ([model] layers " +
                 std::to_string(L) + ": 0 .. " + std::to_string(L - 1) + ")");
    } else if (std::find(c.moe_layers.begin(), c.moe_layers.end(), static_cast<int>(v)) !=
               c.moe_layers.end()) {
      m.fail(e, "layers", "layer " + std::to_string(v) + " is listed twice");
    } else {
      c.moe_layers.push_back(static_cast<int>(v));
      c.moe_experts.push_back(per[i]);
    }
  }
}

}  // namespace

ConfigError::ConfigError(std::vector<std::string> errors)
    : std::runtime_error(joined(errors)), errors_(std::move(errors)) {}

TrainConfig read_config(const std::string& path, std::vector<std::string>& problems) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    throw ConfigError(path + ": is a folder, not a trainer config file");
  }
  toml::parse_result r = toml::parse_file(path);
  if (!r) {
    const auto& e = r.error();
    if (!std::filesystem::exists(path, ec)) {
      throw ConfigError(path + ": cannot open the config file" +
                        (ec ? " (" + ec.message() + ")" : std::string()));
    }
    throw ConfigError(where(path, e.source()) + ": " + std::string(e.description()));
  }
  const toml::table& root = r.table();
  // A file with none of the trainer's own tables is not a config with many mistakes but some
  // other file, most often the Loom manifest a config names: one message that says so.
  if (root["manifest"].as_table() == nullptr && root["model"].as_table() == nullptr &&
      root["data"].as_table() == nullptr && root["train"].as_table() == nullptr) {
    const toml::node* loom = root.get("loom");
    const std::string what =
        loom != nullptr && loom->is_table()
            ? where(path, loom->source()) + ": this is a Loom manifest, not a trainer config"
            : path +
                  ": not a trainer config: it has none of the [manifest], [model], [data] "
                  "and [train] tables";
    throw ConfigError(
        what +
        ". `loom train` takes a trainer config: a TOML file whose [manifest] table names the "
        "manifest (path = \"MANIFEST.toml\", optimizer = \"NAME\"), with [model], [data] and "
        "[train] tables (docs/trainer.md; examples/train_adam.toml is one). `loom check FILE` "
        "validates a manifest.");
  }
  TrainConfig c;
  c.config_path = path;
  Errors errors;
  const std::vector<std::string> sections{"manifest",     "model",     "data",
                                          "curriculum",   "routing",   "moe",
                                          "quantization", "gradients", "train"};
  for (const auto& [k, v] : root) {
    const std::string name(k.str());
    if (std::find(sections.begin(), sections.end(), name) == sections.end() || !v.is_table()) {
      errors.add(where(path, v.source()) + ": unknown top-level key or section '" + name + "'" +
                 loom_text::did_you_mean(name, sections) +
                 " (expected tables [manifest], [model], [data], [curriculum], [routing], [moe], "
                 "[quantization], [gradients], [train])");
    }
  }
  auto sect = [&](const char* name) { return Reader{path, root[name].as_table(), name, &errors}; };
  const auto dir = std::filesystem::absolute(path).parent_path();

  Reader man = sect("manifest");
  man.str("path", c.manifest);
  man.str("optimizer", c.optimizer);
  man.str("comm", c.comm);
  man.finish();
  if (c.manifest.empty()) {
    errors.add(man.at("path") + ": [manifest] path is required (the Loom manifest to use)");
  }
  c.manifest = resolve(dir, c.manifest);

  Reader model = sect("model");
  model.integer("vocab_size", c.model.vocab_size, 0, 65536);
  model.integer("context", c.model.context, 1, 1 << 16);
  model.integer("layers", c.model.layers, 1, 1024);
  model.integer("heads", c.model.heads, 1, 1024);
  model.integer("dim", c.model.dim, 1, 1 << 16);
  model.finish();
  if (c.model.heads > 0 && c.model.dim % c.model.heads != 0) {
    errors.add(model.at("dim") + ": [model] dim " + std::to_string(c.model.dim) +
               " is not divisible by heads " + std::to_string(c.model.heads));
  }
  const double params = static_cast<double>(c.model.vocab_size + c.model.context) * c.model.dim +
                        static_cast<double>(c.model.layers) * 12.0 * c.model.dim * c.model.dim;
  if (params > 4.0e9) {
    errors.add(model.at("dim") + ": [model] the model is too large: about " +
               loom_cli::number(std::round(params / 1e6)) +
               "M parameters, more than the 4000M the reference trainer takes");
  }

  Reader data = sect("data");
  data.str("dataset", c.dataset);
  data.finish();
  if (c.dataset.empty()) {
    errors.add(data.at("dataset") +
               ": [data] dataset is required (a file written by loom data prepare)");
  }
  c.dataset = resolve(dir, c.dataset);

  Reader cur = sect("curriculum");
  cur.str("sampler", c.sampler);
  cur.str("seqlen", c.seqlen);
  cur.finish();
  c.sampler_at = cur.at("sampler");
  c.seqlen_at = cur.at("seqlen");
  if (cur.table != nullptr) {
    for (const char* key : {"sampler", "seqlen"}) {
      const toml::node* n = cur.table->get(key);
      if (n != nullptr && n->is_string() && n->as_string()->get().empty()) {
        errors.add(cur.at(key) + ": [curriculum] " + key + ": empty (leave the key out for none)");
      }
    }
  }

  Reader routing = sect("routing");
  routing.str("router", c.router);
  routing.finish();
  c.router_at = routing.at("router");
  if (routing.table != nullptr) {
    const toml::node* n = routing.table->get("router");
    if (n == nullptr) {
      errors.add(routing.at("router") + ": [routing]: no router (leave [routing] out for none)");
    } else if (n->is_string() && n->as_string()->get().empty()) {
      errors.add(routing.at("router") + ": [routing] router: empty (leave [routing] out for none)");
    }
  }

  read_moe(sect("moe"), c, errors);

  Reader grads = sect("gradients");
  c.grad_buckets = grads.table != nullptr;
  grads.number("bucket_mb", c.bucket_mb, 0.001, 65536.0);
  grads.boolean("overlap", c.overlap);
  grads.str("wire", c.wire);
  grads.finish();
  c.wire_at = grads.at("wire");
  if (c.wire != "fp32" && c.wire != "bf16") {
    errors.add(c.wire_at + ": [gradients] wire: '" + c.wire + "' is not one of fp32, bf16");
  }

  Reader q = sect("quantization");
  q.str("quantizer", c.quantizer);
  auto str_list = [&](const char* key, std::vector<std::string>& out) {
    if (auto* n = q.node(key)) {
      const toml::array* a = n->as_array();
      if (a == nullptr || a->empty())
        return q.fail(*n, key, "expected a non-empty array of strings");
      out.clear();
      for (const auto& e : *a) {
        if (!e.is_string() || e.as_string()->get().empty()) {
          return q.fail(e, key, "expected a non-empty string (a tensor name pattern)");
        }
        out.push_back(e.as_string()->get());
      }
    }
  };
  str_list("tensors", c.quant_tensors);
  if (auto* n = q.node("layers")) {
    const toml::array* a = n->as_array();
    if (a == nullptr || a->empty()) {
      q.fail(*n, "layers", "expected a non-empty array of layer indices");
    } else {
      for (const auto& e : *a) {
        if (!e.is_integer()) {
          q.fail(e, "layers", "expected an integer (a layer index)");
          break;
        }
        const int64_t v = e.as_integer()->get();
        if (v < 0 || v >= c.model.layers) {
          q.fail(e, "layers",
                 "layer " + std::to_string(v) + " is out of range [0, " +
                     std::to_string(c.model.layers) + ") ([model] layers " +
                     std::to_string(c.model.layers) + ")");
          break;
        }
        c.quant_layers.push_back(static_cast<int>(v));
      }
    }
  }
  q.boolean("qat", c.qat);
  q.str("weights", c.weights);
  q.str("checkpoint", c.checkpoint);
  q.str("teacher", c.teacher);
  q.integer("lkd_steps", c.lkd_steps, 0, int64_t{1} << 30);
  q.number("lkd_lr", c.lkd_lr, 0.0, 10.0);
  q.boolean("kd", c.kd);
  q.number("kd_weight", c.kd_weight, 0.0, 1e6);
  q.number("hidden_weight", c.hidden_weight, 0.0, 1e6);
  q.finish();
  c.quantizer_at = q.at("quantizer");
  c.quant_tensors_at = q.at("tensors");
  c.quant_layers_at = q.at("layers");
  c.weights_at = q.at("weights");
  c.checkpoint_at = q.at("checkpoint");
  c.teacher_at = q.at("teacher");
  if (q.table != nullptr) {
    if (!c.checkpoint.empty()) {
      // A quantized file is evaluated as it is: the file names its quantizers.
      for (const char* key :
           {"quantizer", "tensors", "layers", "qat", "weights", "teacher", "lkd_steps", "kd"}) {
        if (q.table->get(key) != nullptr) {
          errors.add(q.at(key) + ": [quantization] " + key +
                     ": not with checkpoint (a quantized file is evaluated as it is, with the "
                     "quantizers it names)");
        }
      }
      c.checkpoint = resolve(dir, c.checkpoint);
    } else if (q.table->get("quantizer") == nullptr) {
      errors.add(q.at("quantizer") +
                 ": [quantization] quantizer is required (the manifest's [quantizer.NAME])");
    } else if (c.quantizer.empty() && q.table->get("quantizer")->is_string()) {
      errors.add(q.at("quantizer") + ": [quantization] quantizer: empty");
    }
    const bool teaches = c.kd || c.lkd_steps > 0;
    if (teaches && c.teacher.empty() && c.weights.empty()) {
      errors.add(q.at(c.kd ? "kd" : "lkd_steps") + ": [quantization] " +
                 (c.kd ? "kd" : "lkd_steps") +
                 ": needs the fp32 teacher: set teacher (or weights, which the teacher defaults "
                 "to)");
    }
    if (!teaches && !c.teacher.empty()) {
      errors.add(q.at("teacher") +
                 ": [quantization] teacher: no procedure uses it (set lkd_steps or kd = true)");
    }
    if (c.quant_tensors.empty()) c.quant_tensors = default_quant_tensors();
    for (auto* file : {&c.weights, &c.teacher}) {
      if (!file->empty()) *file = resolve(dir, *file);
    }
    if (c.teacher.empty() && teaches) c.teacher = c.weights;
    if (!c.quantizer.empty()) {
      std::vector<std::string> qp;
      (void)quantized_tensor_names(c, &qp);
      for (auto& e : qp) errors.add(std::move(e));
    }
  }

  Reader t = sect("train");
  constexpr int64_t kBig = int64_t{1} << 40;
  t.integer("steps", c.steps, 1, kBig);
  t.integer("batch_size", c.batch_size, 1, 1 << 20);
  t.integer("seq_len", c.seq_len, 1, 1 << 16);
  t.integer("seed", c.seed, 0, INT64_MAX);
  t.number("lr", c.lr, 0.0, 10.0);
  t.number("min_lr", c.min_lr, 0.0, 10.0);
  t.integer("warmup_steps", c.warmup_steps, 0, kBig);
  t.integer("train_tokens", c.train_tokens, 0, int64_t{1} << 62);
  t.integer("train_layer_tokens", c.train_layer_tokens, 0, int64_t{1} << 62);
  t.str("lr_unit", c.lr_unit);
  t.str("precision", c.precision);
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
  c.train_tokens_at = t.at("train_tokens");
  c.train_layer_tokens_at = t.at("train_layer_tokens");
  c.lr_unit_at = t.at("lr_unit");
  const std::vector<std::string> decays{"cosine", "linear", "constant"};
  if (std::find(decays.begin(), decays.end(), c.decay) == decays.end()) {
    errors.add(t.at("decay") + ": [train] decay: '" + c.decay +
               "' is not one of cosine, linear, constant" +
               loom_text::did_you_mean(c.decay, decays));
  }
  c.precision_at = t.at("precision");
  const std::vector<std::string> precisions{"fp32", "bf16"};
  if (std::find(precisions.begin(), precisions.end(), c.precision) == precisions.end()) {
    errors.add(c.precision_at + ": [train] precision: '" + c.precision +
               "' is not one of fp32, bf16" + loom_text::did_you_mean(c.precision, precisions));
  }
  const std::vector<std::string> units{"steps", "tokens", "layer_tokens"};
  if (std::find(units.begin(), units.end(), c.lr_unit) == units.end()) {
    errors.add(t.at("lr_unit") + ": [train] lr_unit: '" + c.lr_unit +
               "' is not one of steps, tokens, layer_tokens" +
               loom_text::did_you_mean(c.lr_unit, units));
  }
  // The decay's end in tokens when train_tokens does not give it: steps x batch_size x
  // seq_len must fit the range train_tokens has.
  if (c.lr_unit == "tokens" && c.train_tokens == 0) {
    uint64_t p = 0;
    if (__builtin_mul_overflow(static_cast<uint64_t>(c.steps), static_cast<uint64_t>(c.batch_size),
                               &p) ||
        __builtin_mul_overflow(p, static_cast<uint64_t>(c.seq_len), &p) ||
        p > (uint64_t{1} << 62)) {
      errors.add(t.at("steps") + ": [train] steps " + std::to_string(c.steps) + " x batch_size " +
                 std::to_string(c.batch_size) + " x seq_len " + std::to_string(c.seq_len) +
                 " tokens exceed 2^62, too many for lr_unit = \"tokens\" to decay over (set "
                 "train_tokens, or fewer steps)");
    }
  }
  // The decay's end in layer tokens when train_layer_tokens does not give it: layers x the
  // decay's tokens must fit the same range.
  if (c.lr_unit == "layer_tokens" && c.train_layer_tokens == 0) {
    const uint64_t tokens = decay_tokens(c);
    uint64_t p = 0;
    if (tokens > (uint64_t{1} << 62) ||
        __builtin_mul_overflow(tokens, static_cast<uint64_t>(std::max(1, c.model.layers)), &p) ||
        p > (uint64_t{1} << 62)) {
      errors.add((c.train_tokens > 0 ? t.at("train_tokens") : t.at("steps")) +
                 ": [train] [model] layers " + std::to_string(c.model.layers) + " x " +
                 (c.train_tokens > 0 ? "train_tokens " + std::to_string(c.train_tokens)
                                     : "steps x batch_size x seq_len") +
                 " layer tokens exceed 2^62, too many for lr_unit = \"layer_tokens\" to decay "
                 "over (set train_layer_tokens, or fewer steps)");
    }
  }
  if (!c.seqlen.empty() && c.seq_len < 8) {
    errors.add(t.at("seq_len") + ": [train] seq_len " + std::to_string(c.seq_len) +
               " is below 8, the shortest length [curriculum] seqlen cuts to");
  }
  if (c.seq_len > c.model.context) {
    errors.add(t.at("seq_len") + ": [train] seq_len " + std::to_string(c.seq_len) +
               " exceeds [model] context " + std::to_string(c.model.context));
  }
  if (c.min_lr > c.lr) {
    errors.add(t.at("min_lr") + ": [train] min_lr " + loom_cli::number(c.min_lr) + " is above lr " +
               loom_cli::number(c.lr));
  }
  if (c.plot != "auto" && c.plot != "none" && !c.plot.empty()) {
    const std::string ext = std::filesystem::path(c.plot).extension().string();
    if (ext != ".png" && ext != ".svg") {
      errors.add(t.at("plot") + ": [train] plot: '" + c.plot +
                 "' must end in .png or .svg (or be \"auto\" or \"none\")");
    }
  }
  if (!errors.list.empty()) {
    // In file order: "PATH:LINE:COL: ..." sorted by line and column.
    auto pos = [&](const std::string& e) {
      unsigned line = 0, col = 0;
      if (e.rfind(path + ":", 0) == 0) {
        std::sscanf(e.c_str() + path.size() + 1, "%u:%u", &line, &col);
      }
      return std::make_pair(line, col);
    };
    std::stable_sort(errors.list.begin(), errors.list.end(),
                     [&](const std::string& a, const std::string& b) { return pos(a) < pos(b); });
    problems.insert(problems.end(), errors.list.begin(), errors.list.end());
  }
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

TrainConfig load_config(const std::string& path) {
  std::vector<std::string> problems;
  TrainConfig c = read_config(path, problems);
  if (!problems.empty()) throw ConfigError(std::move(problems));
  return c;
}

std::vector<std::string> config_warnings(const TrainConfig& c) {
  std::vector<std::string> out;
  if (c.train_layer_tokens > 0 && c.lr_unit != "layer_tokens") {
    out.push_back(c.train_layer_tokens_at +
                  ": [train] train_layer_tokens: warning: " + std::to_string(c.train_layer_tokens) +
                  " layer tokens end the run, but lr_unit = \"" + c.lr_unit +
                  "\" decays by another measure, so a run that ends by layer tokens may stop "
                  "before the learning rate reaches min_lr (set lr_unit = \"layer_tokens\")");
  }
  if (!c.router.empty() && c.lr_unit == "layer_tokens" && c.train_layer_tokens == 0) {
    out.push_back(c.lr_unit_at +
                  ": [train] lr_unit: warning: \"layer_tokens\" without train_layer_tokens "
                  "decays over the unrouted run's layer tokens ([model] layers x the tokens), "
                  "which the routed run ([routing] router = \"" +
                  c.router +
                  "\") does not consume by its last step, so the learning rate ends above "
                  "min_lr (to anneal fully, set train_layer_tokens and raise steps)");
  }
  if (c.train_tokens > 0 && c.lr_unit == "steps") {
    out.push_back(c.train_tokens_at +
                  ": [train] train_tokens: warning: " + std::to_string(c.train_tokens) +
                  " tokens end the run, but with lr_unit = \"steps\" the decay runs over steps " +
                  std::to_string(c.steps) +
                  ", an upper bound: a run that ends by tokens stops before the learning rate "
                  "reaches min_lr (set lr_unit = \"tokens\" to decay by the tokens)");
  }
  return out;
}

nlohmann::json instance_params(loom_session* session, const char* kind, const std::string& name) {
  char* raw = nullptr;
  if (loom_instance_params(session, kind, name.c_str(), &raw) != LOOM_OK) return nullptr;
  nlohmann::json doc = nlohmann::json::parse(raw, nullptr, false);
  loom_free_string(raw);
  return doc.is_discarded() ? nlohmann::json() : doc;
}

std::vector<std::string> manifest_name_problems(const TrainConfig& c) {
  std::vector<std::string> out;
  toml::parse_result r = toml::parse_file(c.manifest);
  if (!r) return out;
  // `who`: where the config names the instance, e.g. "FILE: [manifest] optimizer".
  auto need = [&](const char* section, const std::string& name, const std::string& who) {
    const toml::table* t = r.table()[section].as_table();
    if (t != nullptr && t->get_as<toml::table>(name) != nullptr) return;
    std::vector<std::string> have;
    if (t != nullptr) {
      for (const auto& [k, v] : *t) {
        if (v.is_table()) have.emplace_back(k.str());
      }
    }
    std::string list;
    for (const auto& h : have)
      list += (list.empty() ? "" : ", ") + std::string("[") + section + "." + h + "]";
    out.push_back(who + " '" + name + "': " + c.manifest + " has no [" + section + "." + name +
                  "]" +
                  (have.empty() ? std::string(" (it has no ") + section + " at all)"
                                : " (it has " + list + ")" + loom_text::did_you_mean(name, have)));
  };
  need("optimizer", c.optimizer, c.config_path + ": [manifest] optimizer");
  if (!c.comm.empty()) need("comm", c.comm, c.config_path + ": [manifest] comm");
  // The curriculum's instances are reported at their key in the config.
  if (!c.sampler.empty()) need("sampler", c.sampler, c.sampler_at + ": [curriculum] sampler");
  if (!c.seqlen.empty()) need("curriculum", c.seqlen, c.seqlen_at + ": [curriculum] seqlen");
  if (!c.moe.empty()) need("moe", c.moe, c.moe_at + ": [moe] instance");
  if (!c.quantizer.empty()) {
    need("quantizer", c.quantizer, c.quantizer_at + ": [quantization] quantizer");
  }
  if (!c.router.empty()) {
    const size_t before = out.size();
    need("router", c.router, c.router_at + ": [routing] router");
    // A name the manifest gives an instance of another kind: say which.
    if (out.size() > before) {
      for (const auto& [k, v] : r.table()) {
        const toml::table* t = v.as_table();
        if (t != nullptr && std::string(k.str()) != "router" && t->get_as<toml::table>(c.router)) {
          out.back() += "; [" + std::string(k.str()) + "." + c.router +
                        "] is not a router (kind loom.router/1 instances are [router.NAME])";
          break;
        }
      }
    }
  }
  return out;
}

std::optional<SamplerIndexRef> sampler_index_ref(loom_session* session, const TrainConfig& c) {
  if (c.sampler.empty()) return std::nullopt;
  const nlohmann::json doc = instance_params(session, "sampler", c.sampler);
  if (!doc.is_object() || doc["plugin"] != "curriculum_sampler") return std::nullopt;
  const nlohmann::json& p = doc["params"];
  auto text = [&](const char* key) {
    const auto it = p.find(key);
    return it != p.end() && (*it)["value"].is_string() ? (*it)["value"].get<std::string>()
                                                       : std::string();
  };
  if (text("clustering_type") == "single_cluster") return std::nullopt;
  const std::string index = text("index"), metric = text("metric");
  if (index.empty() || metric.empty()) return std::nullopt;  // the plugin reports it
  return SamplerIndexRef{index, metric};
}

std::string sampler_index_problem(loom_session* session, const TrainConfig& c,
                                  uint64_t dataset_checksum) {
  const auto ref = sampler_index_ref(session, c);
  if (!ref) return {};
  std::string problem;
  try {
    const loom::data::MetricIndex idx = loom::data::MetricIndex::open(ref->index, ref->metric);
    const loom::data::IndexInfo& info = idx.info();
    char want[24], have[24];
    std::snprintf(want, sizeof(want), "%016llx",
                  static_cast<unsigned long long>(info.dataset_checksum));
    std::snprintf(have, sizeof(have), "%016llx", static_cast<unsigned long long>(dataset_checksum));
    if (info.dataset_checksum != dataset_checksum) {
      problem = "the index " + ref->index + " (metric " + ref->metric +
                ") was written for another dataset: its dataset checksum is " + want + ", " +
                c.dataset + "'s is " + have;
    }
    if (info.sample_tokens != static_cast<uint32_t>(c.seq_len)) {
      problem += std::string(problem.empty() ? "the index " + ref->index + " (metric " +
                                                   ref->metric + ") was written for"
                                             : ", and for") +
                 " samples of " + std::to_string(info.sample_tokens) +
                 " tokens, not [train] seq_len " + std::to_string(c.seq_len);
    }
    if (!problem.empty()) {
      problem += " (run loom data analyze on " + c.dataset + " with --seq-len " +
                 std::to_string(c.seq_len) + ")";
    }
  } catch (const std::exception& e) {
    problem = with_run_values(e.what(), c);
  }
  return problem;
}

std::string with_run_values(const std::string& message, const TrainConfig& c) {
  return loom::data::fill_analyze_hint(message, c.dataset, c.seq_len);
}

std::vector<std::string> quantized_tensor_names(const TrainConfig& c,
                                                std::vector<std::string>* problems) {
  // The model's parameter names and ranks (what Model holds, in its order).
  std::vector<ParamTensor> params;
  auto add = [&](std::string name, int ndim) {
    params.push_back(
        {std::move(name), std::vector<int64_t>(static_cast<size_t>(ndim), 1), nullptr, nullptr, 1});
  };
  add("wte", 2);
  add("wpe", 2);
  for (int l = 0; l < c.model.layers; ++l) {
    const std::string p = "h." + std::to_string(l) + ".";
    for (const char* n : {"ln1.w", "ln1.b"}) add(p + n, 1);
    add(p + "attn.qkv.w", 2);
    add(p + "attn.qkv.b", 1);
    add(p + "attn.proj.w", 2);
    add(p + "attn.proj.b", 1);
    for (const char* n : {"ln2.w", "ln2.b"}) add(p + n, 1);
    add(p + "mlp.fc.w", 2);
    add(p + "mlp.fc.b", 1);
    add(p + "mlp.proj.w", 2);
    add(p + "mlp.proj.b", 1);
  }
  add("lnf.w", 1);
  add("lnf.b", 1);
  std::vector<std::string> local;
  std::vector<std::string> names = select_quant_tensors(
      params, c.quant_tensors.empty() ? default_quant_tensors() : c.quant_tensors, c.quant_layers,
      c.quant_tensors_at + ": [quantization] tensors", local);
  if (problems != nullptr) problems->insert(problems->end(), local.begin(), local.end());
  return names;
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

int64_t moe_instance_ep_size(loom_session* session, const TrainConfig& c, std::string& at) {
  at.clear();
  const nlohmann::json doc = instance_params(session, "moe", c.moe);
  if (!doc.is_object() || !doc["params"].contains("ep_size")) return 1;
  const nlohmann::json& e = doc["params"]["ep_size"];
  at = e["at"].get<std::string>();
  return e["value"].is_number_integer() ? e["value"].get<int64_t>() : 1;
}

std::string moe_instance_comm(loom_session* session, const TrainConfig& c) {
  const nlohmann::json doc = instance_params(session, "moe", c.moe);
  if (!doc.is_object() || !doc["params"].contains("comm")) return {};
  const nlohmann::json& v = doc["params"]["comm"]["value"];
  return v.is_string() ? v.get<std::string>() : std::string();
}

std::string moe_check_manifest(const TrainConfig& c) {
  std::ifstream in(c.manifest, std::ios::binary);
  std::string text, line, section;
  bool kept = true;
  auto is_key = [](const std::string& l, size_t b, const char* key) {
    const size_t n = std::strlen(key);
    if (l.compare(b, n, key) != 0) return false;
    const size_t e = l.find_first_not_of(" \t", b + n);
    return e != std::string::npos && l[e] == '=';
  };
  while (std::getline(in, line)) {
    const size_t b = line.find_first_not_of(" \t");
    if (b != std::string::npos && line[b] == '[') {
      const size_t from = line.find_first_not_of("[ \t", b);
      const size_t to = from == std::string::npos ? from : line.find_first_of(".] \t", from);
      section = from == std::string::npos ? std::string() : line.substr(from, to - from);
      kept = section == "loom" || section == "moe";
    }
    const bool drop = section == "moe" && b != std::string::npos &&
                      (is_key(line, b, "comm") || is_key(line, b, "ep_size"));
    text += (kept && !drop ? line : std::string()) + "\n";
  }
  toml::parse_result blanked = toml::parse(text, c.manifest);
  if (!blanked) return {};
  for (const auto& [k, v] : blanked.table()) {
    const std::string name(k.str());
    if (name != "loom" && name != "moe") return {};
  }
  return text;
}

uint64_t decay_tokens(const TrainConfig& c) {
  if (c.train_tokens > 0) return static_cast<uint64_t>(c.train_tokens);
  // Saturating (read_config refuses a product above 2^62 when it is used).
  uint64_t p = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(std::max<int64_t>(0, c.steps)),
                             static_cast<uint64_t>(std::max(0, c.batch_size)), &p) ||
      __builtin_mul_overflow(p, static_cast<uint64_t>(std::max(0, c.seq_len)), &p)) {
    return UINT64_MAX;
  }
  return p;
}

double lr_at_tokens(const TrainConfig& c, int64_t step, uint64_t tokens, uint64_t warmup_tokens) {
  if (c.warmup_steps > 0 && step <= c.warmup_steps) {
    return c.lr * static_cast<double>(step) / static_cast<double>(c.warmup_steps);
  }
  const uint64_t end = decay_tokens(c);
  if (c.decay == "constant" || end <= warmup_tokens) return c.lr;
  const double done = tokens > warmup_tokens ? static_cast<double>(tokens - warmup_tokens) : 0.0;
  const double p = std::clamp(done / static_cast<double>(end - warmup_tokens), 0.0, 1.0);
  const double f = c.decay == "cosine" ? 0.5 * (1.0 + std::cos(std::numbers::pi * p)) : 1.0 - p;
  return c.min_lr + (c.lr - c.min_lr) * f;
}

uint64_t decay_layer_tokens(const TrainConfig& c) {
  if (c.train_layer_tokens > 0) return static_cast<uint64_t>(c.train_layer_tokens);
  const uint64_t tokens = decay_tokens(c);
  uint64_t p = 0;
  if (__builtin_mul_overflow(tokens, static_cast<uint64_t>(std::max(0, c.model.layers)), &p)) {
    return UINT64_MAX;
  }
  return p;
}

double lr_at_layer_tokens(const TrainConfig& c, int64_t step, uint64_t layer_tokens,
                          uint64_t warmup_layer_tokens) {
  if (c.warmup_steps > 0 && step <= c.warmup_steps) {
    return c.lr * static_cast<double>(step) / static_cast<double>(c.warmup_steps);
  }
  const uint64_t end = decay_layer_tokens(c);
  if (c.decay == "constant" || end <= warmup_layer_tokens) return c.lr;
  const double done = layer_tokens > warmup_layer_tokens
                          ? static_cast<double>(layer_tokens - warmup_layer_tokens)
                          : 0.0;
  const double p = std::clamp(done / static_cast<double>(end - warmup_layer_tokens), 0.0, 1.0);
  const double f = c.decay == "cosine" ? 0.5 * (1.0 + std::cos(std::numbers::pi * p)) : 1.0 - p;
  return c.min_lr + (c.lr - c.min_lr) * f;
}

int step_seq_len(int64_t scheduled, int seq_len) {
  if (scheduled >= seq_len) return seq_len;
  const int64_t l = std::max<int64_t>(8, scheduled - scheduled % 8);
  return static_cast<int>(std::min<int64_t>(l, seq_len));
}

}  // namespace loom::trainer
