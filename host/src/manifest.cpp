#include "manifest.hpp"

#include <algorithm>
#include <tuple>

#include <loom_toml.hpp>  // toml++, patched for bad input

#include <loom/abi.h>
#include <loom_text.hpp>

#include "kinds.hpp"

namespace loom::host {
namespace {

SourcePos pos_of(const toml::source_region& src, const std::string& origin) {
  return SourcePos{origin, src.begin.line, src.begin.column};
}

ManifestValue convert(const toml::node& node, const std::string& origin) {
  ManifestValue v;
  v.pos = pos_of(node.source(), origin);
  switch (node.type()) {
    case toml::node_type::boolean:
      v.type = ManifestValue::Type::kBool;
      v.bool_value = node.as_boolean()->get();
      break;
    case toml::node_type::integer:
      v.type = ManifestValue::Type::kInt;
      v.int_value = node.as_integer()->get();
      break;
    case toml::node_type::floating_point:
      v.type = ManifestValue::Type::kFloat;
      v.float_value = node.as_floating_point()->get();
      break;
    case toml::node_type::string:
      v.type = ManifestValue::Type::kString;
      v.string_value = node.as_string()->get();
      break;
    case toml::node_type::array:
      v.type = ManifestValue::Type::kArray;
      for (const auto& item : *node.as_array()) v.items.push_back(convert(item, origin));
      break;
    case toml::node_type::table:
      v.type = ManifestValue::Type::kTable;
      break;
    default:
      v.type = ManifestValue::Type::kOther;
      break;
  }
  return v;
}

// toml++ quotes a key in some errors ("cannot redefine existing integer 'KEY'"), whole up to
// its own buffer's end: a huge key gets the length of the host's own quotes.
std::string short_description(std::string_view d) {
  constexpr size_t kMax = 160;
  if (d.size() <= kMax) return std::string(d);
  size_t n = kMax;  // cut at a UTF-8 character boundary
  while (n > 0 && (static_cast<unsigned char>(d[n]) & 0xC0U) == 0x80U) --n;
  const std::string head(d.substr(0, n));
  const bool open_quote = std::count(head.begin(), head.end(), '\'') % 2 == 1;
  return head + (open_quote ? "...'" : "...");
}

bool valid_instance_name(std::string_view s) {
  if (s.empty()) return false;
  for (const char c : s) {
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
          c == '-')) {
      return false;
    }
  }
  return true;
}

void parse_loom_table(const toml::table& table, Manifest& m, Diagnostics& diags) {
  const std::vector<std::string> keys{"abi", "plugin_path", "log_level"};
  for (const auto& [key, node] : table) {
    const std::string k(key.str());
    const SourcePos kpos = pos_of(key.source(), m.origin);
    const SourcePos vpos = pos_of(node.source(), m.origin);
    if (k == "abi") {
      if (!node.is_integer()) {
        diags.error(vpos, "[loom] abi must be an integer, not " +
                              type_phrase(convert(node, m.origin).type));
        continue;
      }
      m.abi = node.as_integer()->get();
      if (m.abi != LOOM_ABI_MAJOR) {
        diags.error(vpos, "[loom] abi = " + std::to_string(m.abi) +
                              " is not supported: this host speaks ABI " +
                              std::to_string(LOOM_ABI_MAJOR) + "." +
                              std::to_string(LOOM_ABI_MINOR));
      }
    } else if (k == "plugin_path") {
      const auto* arr = node.as_array();
      if (arr == nullptr) {
        diags.error(vpos, "[loom] plugin_path must be an array of strings, not " +
                              type_phrase(convert(node, m.origin).type));
        continue;
      }
      for (const auto& item : *arr) {
        if (!item.is_string()) {
          diags.error(pos_of(item.source(), m.origin),
                      "[loom] plugin_path entries must be strings, not " +
                          type_phrase(convert(item, m.origin).type));
          continue;
        }
        std::filesystem::path p(item.as_string()->get());
        m.plugin_path.push_back(p.is_absolute() ? p : (m.base_dir / p).lexically_normal());
      }
    } else if (k == "log_level") {
      m.log_level_pos = vpos;
      if (!node.is_string() || !parse_log_level(node.as_string()->get())) {
        std::string got = node.is_string() ? loom_text::quoted(node.as_string()->get())
                                           : type_phrase(convert(node, m.origin).type);
        std::string names;
        for (const auto& n : log_level_names()) names += (names.empty() ? "" : ", ") + n;
        diags.error(vpos, "[loom] log_level must be one of " + names + ", not " + got);
        continue;
      }
      m.log_level = node.as_string()->get();
    } else {
      diags.error(kpos, "unknown key " + loom_text::quoted(k) + " in [loom]" +
                            did_you_mean(k, keys) +
                            "; [loom] takes abi, plugin_path and log_level");
    }
  }
}

void parse_kind_section(const std::string& section, const toml::table& table, Manifest& m,
                        Diagnostics& diags) {
  const std::string kind(kind_id_for_section(section));
  for (const auto& [key, node] : table) {
    const std::string name(key.str());
    const SourcePos kpos = pos_of(key.source(), m.origin);
    const auto* inst = node.as_table();
    if (inst == nullptr) {
      diags.error(kpos, loom_text::quoted(section + "." + name) +
                            " must be a table: instances are declared as [" + section +
                            ".NAME] with plugin = \"...\" inside");
      continue;
    }
    if (!valid_instance_name(name)) {
      diags.error(kpos, "instance name " + loom_text::quoted(name) +
                            " may only use letters, digits, '_' and '-'");
      continue;
    }
    InstanceDecl decl;
    decl.section = section;
    decl.kind = kind;
    decl.name = name;
    decl.pos = pos_of(inst->source(), m.origin);
    if (decl.pos.line == 0) decl.pos = kpos;
    bool has_plugin = false;
    for (const auto& [ikey, inode] : *inst) {
      const std::string k(ikey.str());
      if (k == "plugin") {
        has_plugin = true;
        decl.plugin_pos = pos_of(inode.source(), m.origin);
        if (!inode.is_string() || inode.as_string()->get().empty()) {
          diags.error(decl.plugin_pos, decl.label() +
                                           ": plugin must be a plugin name string, not " +
                                           type_phrase(convert(inode, m.origin).type));
        } else {
          decl.plugin = inode.as_string()->get();
        }
        continue;
      }
      decl.entries.push_back(
          ManifestEntry{k, pos_of(ikey.source(), m.origin), convert(inode, m.origin)});
    }
    if (!has_plugin) {
      diags.error(decl.pos, decl.label() +
                                " is missing required key 'plugin' (the plugin that "
                                "implements it, e.g. plugin = \"name\")");
    }
    m.instances.push_back(std::move(decl));
  }
}

void parse_quantize_rules(const toml::node& node, const SourcePos& kpos, Manifest& m,
                          Diagnostics& diags) {
  const auto* arr = node.as_array();
  if (arr == nullptr) {
    diags.error(kpos,
                "'quantize' must be an array of tables, one per rule: write [[quantize]] "
                "with tensors = [\"PATTERN\", ...] and quantizer = \"NAME\"");
    return;
  }
  const std::vector<std::string> keys{"tensors", "quantizer", "copy"};
  size_t index = 0;
  for (const auto& item : *arr) {
    ++index;
    const std::string label = "[[quantize]] rule " + std::to_string(index);
    const auto* table = item.as_table();
    const SourcePos ipos = pos_of(item.source(), m.origin);
    if (table == nullptr) {
      diags.error(ipos,
                  label + " must be a table, not " + type_phrase(convert(item, m.origin).type));
      continue;
    }
    QuantizeRule rule;
    rule.pos = ipos.line == 0 ? kpos : ipos;
    bool has_tensors = false;
    bool has_quantizer = false;
    for (const auto& [ikey, inode] : *table) {
      const std::string k(ikey.str());
      const SourcePos vpos = pos_of(inode.source(), m.origin);
      if (k == "tensors") {
        has_tensors = true;
        const auto* list = inode.as_array();
        if (list == nullptr || list->empty()) {
          diags.error(vpos, label +
                                ": tensors must be a non-empty array of name patterns "
                                "(e.g. [\"h.*.mlp.*.w\"]), not " +
                                (list == nullptr ? type_phrase(convert(inode, m.origin).type)
                                                 : std::string("an empty array")));
          continue;
        }
        for (const auto& pat : *list) {
          const SourcePos ppos = pos_of(pat.source(), m.origin);
          if (!pat.is_string() || pat.as_string()->get().empty()) {
            diags.error(ppos, label +
                                  ": each tensors entry must be a non-empty name pattern "
                                  "string, not " +
                                  (pat.is_string() ? std::string("an empty string")
                                                   : type_phrase(convert(pat, m.origin).type)));
            continue;
          }
          rule.patterns.push_back(pat.as_string()->get());
          rule.pattern_pos.push_back(ppos);
        }
      } else if (k == "quantizer") {
        has_quantizer = true;
        rule.quantizer_pos = vpos;
        if (!inode.is_string() || inode.as_string()->get().empty()) {
          diags.error(vpos, label + ": quantizer must name a [quantizer.NAME] instance, not " +
                                type_phrase(convert(inode, m.origin).type));
          continue;
        }
        rule.quantizer = inode.as_string()->get();
      } else if (k == "copy") {
        if (!inode.is_boolean() || !inode.as_boolean()->get()) {
          diags.error(vpos, label +
                                ": copy must be true (the rule's tensors are copied "
                                "unchanged), or left out");
          continue;
        }
        rule.copy = true;
      } else {
        diags.error(pos_of(ikey.source(), m.origin),
                    "unknown key " + loom_text::quoted(k) + " in " + label + did_you_mean(k, keys) +
                        "; a rule takes tensors, and quantizer or copy = true");
      }
    }
    if (!has_tensors) {
      diags.error(rule.pos, label +
                                " is missing 'tensors' (the name patterns it applies to, "
                                "e.g. tensors = [\"h.*.mlp.*.w\"])");
    }
    if (rule.copy && has_quantizer) {
      diags.error(rule.quantizer_pos,
                  label + " has both quantizer and copy = true: a rule does one or the other");
    } else if (!rule.copy && !has_quantizer) {
      diags.error(rule.pos, label +
                                " is missing 'quantizer' (the [quantizer.NAME] instance "
                                "for its tensors; or copy = true to keep them unchanged)");
    }
    m.quantize_rules.push_back(std::move(rule));
  }
}

// Each rule's quantizer names a declared [quantizer.NAME].
void check_quantize_rules(const Manifest& m, Diagnostics& diags) {
  std::vector<std::string> declared;
  for (const auto& d : m.instances) {
    if (d.section == "quantizer") declared.push_back(d.name);
  }
  for (size_t i = 0; i < m.quantize_rules.size(); ++i) {
    const auto& r = m.quantize_rules[i];
    if (r.quantizer.empty() ||
        std::find(declared.begin(), declared.end(), r.quantizer) != declared.end()) {
      continue;
    }
    std::string names;
    for (const auto& n : declared) names += (names.empty() ? "" : ", ") + n;
    diags.error(r.quantizer_pos,
                "[[quantize]] rule " + std::to_string(i + 1) + ": quantizer " +
                    loom_text::quoted(r.quantizer) + " is not declared" +
                    did_you_mean(r.quantizer, declared) + "; " +
                    (declared.empty() ? "declare [quantizer." + loom_text::shown(r.quantizer) +
                                            "] with its plugin"
                                      : "declared: " + names));
  }
}

}  // namespace

std::string InstanceDecl::label() const { return section + "." + loom_text::shown(name); }

std::string type_phrase(ManifestValue::Type type) {
  switch (type) {
    case ManifestValue::Type::kBool:
      return "a boolean";
    case ManifestValue::Type::kInt:
      return "an integer";
    case ManifestValue::Type::kFloat:
      return "a float";
    case ManifestValue::Type::kString:
      return "a string";
    case ManifestValue::Type::kArray:
      return "an array";
    case ManifestValue::Type::kTable:
      return "a table";
    case ManifestValue::Type::kOther:
      return "a date or time";
  }
  return "a value";
}

std::optional<int32_t> parse_log_level(std::string_view name) {
  if (name == "trace") return LOOM_LOG_TRACE;
  if (name == "debug") return LOOM_LOG_DEBUG;
  if (name == "info") return LOOM_LOG_INFO;
  if (name == "warn" || name == "warning") return LOOM_LOG_WARN;
  if (name == "error") return LOOM_LOG_ERROR;
  if (name == "off") return LOOM_LOG_ERROR + 1;
  return std::nullopt;
}

std::vector<std::string> log_level_names() {
  return {"trace", "debug", "info", "warn", "error", "off"};
}

Manifest parse_manifest(std::string_view text, const std::string& origin,
                        const std::filesystem::path& base_dir, Diagnostics& diags,
                        const std::vector<std::string>* only) {
  Manifest m;
  m.origin = origin;
  m.base_dir = base_dir;
  toml::parse_result parsed = toml::parse(text, origin);
  if (!parsed) {
    const auto& err = parsed.error();
    diags.error(pos_of(err.source(), origin),
                "TOML syntax error: " + short_description(err.description()));
    return m;
  }
  const toml::table& root = parsed.table();
  const auto sections = known_sections();
  // [[quantize]] rules are not a kind's section, but a misspelling of them is caught too.
  auto candidates = sections;
  candidates.emplace_back("quantize");
  for (const auto& [key, node] : root) {
    const std::string k(key.str());
    const SourcePos kpos = pos_of(key.source(), origin);
    const auto* table = node.as_table();
    if (only != nullptr && k != "loom" && std::find(only->begin(), only->end(), k) == only->end()) {
      continue;  // left out by the caller (loom_open_options.sections)
    }
    if (k == "loom") {
      if (table == nullptr) {
        diags.error(kpos, "'loom' must be a table: write [loom]");
      } else {
        parse_loom_table(*table, m, diags);
      }
    } else if (k == "quantize") {
      parse_quantize_rules(node, kpos, m, diags);
    } else if (!kind_id_for_section(k).empty()) {
      if (table == nullptr) {
        diags.error(kpos, "'" + k + "' must be a table of instances: write [" + k + ".NAME]");
      } else {
        parse_kind_section(k, *table, m, diags);
      }
    } else {
      std::string known;
      for (const auto& s : sections) known += (known.empty() ? "" : ", ") + s;
      diags.error(kpos, "unknown section " + loom_text::quoted(k) + did_you_mean(k, candidates) +
                            "; known sections: " + known);
    }
  }
  // toml++ iterates tables by key; keep the file's order so "first" means first written.
  std::stable_sort(m.instances.begin(), m.instances.end(),
                   [](const InstanceDecl& a, const InstanceDecl& b) {
                     return std::tie(a.pos.line, a.pos.column) < std::tie(b.pos.line, b.pos.column);
                   });
  check_quantize_rules(m, diags);
  return m;
}

}  // namespace loom::host
