// The kinds this host knows: a manifest section name and the ABI kind ID it maps to.
// A new kind is one line here (and its header in abi/), added in a minor version.
#pragma once

#include <loom/abi.h>

#include <string>
#include <string_view>
#include <vector>

namespace loom::host {

struct KindName {
  std::string_view section;  // [optimizer.NAME]
  std::string_view id;       // "loom.optimizer/1"
};

inline constexpr KindName kKnownKinds[] = {
    {"optimizer", LOOM_KIND_OPTIMIZER},
    {"comm", LOOM_KIND_COMM},
    {"codec", LOOM_KIND_CODEC},
};

// "" when unknown.
inline std::string_view kind_id_for_section(std::string_view section) {
  for (const auto& k : kKnownKinds) {
    if (k.section == section) return k.id;
  }
  return {};
}

// Accepts a section name or a kind ID; returns the kind ID or "".
inline std::string_view normalize_kind(std::string_view kind) {
  for (const auto& k : kKnownKinds) {
    if (k.section == kind || k.id == kind) return k.id;
  }
  return {};
}

inline std::vector<std::string> known_sections() {
  std::vector<std::string> out{"loom"};
  for (const auto& k : kKnownKinds) out.emplace_back(k.section);
  return out;
}

}  // namespace loom::host
