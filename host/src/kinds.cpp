// The host's kind rows, expanded from the kind list. A new kind changes nothing here.
#include "kinds.hpp"

#include <loom/abi.h>
#include <loom/kinds/kinds.def>  // the headers themselves, before their rows below

namespace loom::host {

namespace {

#define LOOM_KIND(section, NAME) KindInfo{#section, LOOM_KIND_##NAME, LOOM_##NAME##_V1_MIN_SIZE},
constexpr KindInfo kKinds[] = {
#include <loom/kinds/kinds.def>
};
#undef LOOM_KIND

}  // namespace

std::span<const KindInfo> known_kinds() { return kKinds; }

}  // namespace loom::host
