// The kinds this host knows, one row each: the manifest section, the ABI kind ID and the
// smallest function table accepted, all three from the kind's own header. Adding a kind to
// the host is one row here plus its header's include (docs/abi.md, "Adding a kind").
#pragma once

#include <loom/abi.h>
#include <loom/kinds/codec.h>
#include <loom/kinds/comm.h>
#include <loom/kinds/curriculum.h>
#include <loom/kinds/moe.h>
#include <loom/kinds/optimizer.h>
#include <loom/kinds/quantizer.h>
#include <loom/kinds/router.h>
#include <loom/kinds/sampler.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace loom::host {

struct KindInfo {
  std::string_view section;  // [optimizer.NAME]
  std::string_view id;       // "loom.optimizer/1"
  uint32_t min_table_size;   // LOOM_OPTIMIZER_V1_MIN_SIZE
};

inline constexpr KindInfo kKnownKinds[] = {
    {"optimizer", LOOM_KIND_OPTIMIZER, LOOM_OPTIMIZER_V1_MIN_SIZE},
    {"comm", LOOM_KIND_COMM, LOOM_COMM_V1_MIN_SIZE},
    {"codec", LOOM_KIND_CODEC, LOOM_CODEC_V1_MIN_SIZE},
    {"curriculum", LOOM_KIND_CURRICULUM, LOOM_CURRICULUM_V1_MIN_SIZE},  // since 1.3
    {"sampler", LOOM_KIND_SAMPLER, LOOM_SAMPLER_V1_MIN_SIZE},           // since 1.3
    {"router", LOOM_KIND_ROUTER, LOOM_ROUTER_V1_MIN_SIZE},              // since 1.4
    {"moe", LOOM_KIND_MOE, LOOM_MOE_V1_MIN_SIZE},                       // since 1.5
    {"quantizer", LOOM_KIND_QUANTIZER, LOOM_QUANTIZER_V1_MIN_SIZE},     // since 1.5
};

// The row of a section name or kind ID, or nullptr.
inline const KindInfo* find_kind(std::string_view kind) {
  for (const auto& k : kKnownKinds) {
    if (k.section == kind || k.id == kind) return &k;
  }
  return nullptr;
}

// "" when unknown.
inline std::string_view kind_id_for_section(std::string_view section) {
  for (const auto& k : kKnownKinds) {
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
  for (const auto& k : kKnownKinds) out.emplace_back(k.section);
  return out;
}

}  // namespace loom::host
