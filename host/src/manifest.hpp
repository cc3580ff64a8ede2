// The manifest as written: TOML parsed into plain values that remember where they came
// from, with the structural checks that need no plugin (sections, [loom] keys).
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "diagnostics.hpp"

namespace loom::host {

struct ManifestValue {
  enum class Type { kBool, kInt, kFloat, kString, kArray, kTable, kOther };
  Type type = Type::kOther;
  bool bool_value = false;
  int64_t int_value = 0;
  double float_value = 0;
  std::string string_value;
  std::vector<ManifestValue> items;  // kArray
  SourcePos pos;
};

// "an integer", "a string", ... for messages.
std::string type_phrase(ManifestValue::Type type);

struct ManifestEntry {
  std::string key;
  SourcePos key_pos;
  ManifestValue value;
};

// One [section.name] table.
struct InstanceDecl {
  std::string section;  // "optimizer"
  std::string kind;     // "loom.optimizer/1"
  std::string name;     // "main"
  SourcePos pos;        // the table header
  std::string plugin;   // empty when missing or not a string
  SourcePos plugin_pos;
  std::vector<ManifestEntry> entries;  // every key but `plugin`, in file order
  // "optimizer.main"; a huge name is cut (it is for messages and logs, not a key).
  [[nodiscard]] std::string label() const;
};

// One [[quantize]] rule of `loom quantize`: the tensors whose names match one of `patterns`
// (globs: '*' any run of characters, '?' one character) go to the [quantizer.NAME] instance
// `quantizer`, or are copied unchanged when `copy` is set. The first matching rule wins.
struct QuantizeRule {
  SourcePos pos;  // the [[quantize]] header
  std::vector<std::string> patterns;
  std::vector<SourcePos> pattern_pos;
  std::string quantizer;  // empty with copy = true
  SourcePos quantizer_pos;
  bool copy = false;
};

struct Manifest {
  std::string origin;              // the file name used in messages
  std::filesystem::path base_dir;  // relative plugin_path entries resolve against it
  int64_t abi = 1;
  std::vector<std::filesystem::path> plugin_path;  // absolute
  std::optional<std::string> log_level;
  SourcePos log_level_pos;
  std::vector<InstanceDecl> instances;       // in file order
  std::vector<QuantizeRule> quantize_rules;  // in file order
};

// Parses TOML text. Syntax errors and structural errors go to `diags`; what could be
// read is returned either way.
// `only`, when set, lists the sections to read besides [loom]; the others are skipped unread.
Manifest parse_manifest(std::string_view text, const std::string& origin,
                        const std::filesystem::path& base_dir, Diagnostics& diags,
                        const std::vector<std::string>* only = nullptr);

// The log levels a manifest or LOOM_LOG_LEVEL may name, and their loom_log_level.
std::optional<int32_t> parse_log_level(std::string_view name);
std::vector<std::string> log_level_names();

}  // namespace loom::host
