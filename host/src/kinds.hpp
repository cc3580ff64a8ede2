// The kinds this host knows, one row each: the manifest section, the ABI kind ID and the
// smallest function table accepted, all from the kind's own header through the kind list
// (loom/kinds/kinds.def). The rows are built in kinds.cpp alone, so a host built with kinds
// of its own (LOOM_EXTRA_KINDS, as the example-kind test does) recompiles that one file.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace loom::host {

struct KindInfo {
  std::string_view section;  // [optimizer.NAME]
  std::string_view id;       // "loom.optimizer/1"
  uint32_t min_table_size;   // LOOM_OPTIMIZER_V1_MIN_SIZE
};

// Every kind of the kind list, in its order.
std::span<const KindInfo> known_kinds();

// The row of a section name or kind ID, or nullptr.
inline const KindInfo* find_kind(std::string_view kind) {
  for (const auto& k : known_kinds()) {
    if (k.section == kind || k.id == kind) return &k;
  }
  return nullptr;
}

// "" when unknown.
inline std::string_view kind_id_for_section(std::string_view section) {
  for (const auto& k : known_kinds()) {
    if (k.section == section) return k.id;
  }
  return {};
}

// Accepts a section name or a kind ID; returns the kind ID or "".
inline std::string_view normalize_kind(std::string_view kind) {
  const KindInfo* k = find_kind(kind);
  return k != nullptr ? k->id : std::string_view();
}

inline std::vector<std::string> known_sections() {
  std::vector<std::string> out{"loom"};
  for (const auto& k : known_kinds()) out.emplace_back(k.section);
  return out;
}

// "loom.optimizer/1, loom.comm/1, ...": for messages that refuse a kind.
inline std::string known_kind_ids() {
  std::string out;
  for (const auto& k : known_kinds()) out += (out.empty() ? "" : ", ") + std::string(k.id);
  return out;
}

}  // namespace loom::host
