// FNV-1a 64, the checksum of the file formats Loom writes: the ABI's loom/checksum.h holds the
// one definition (the host needs it too and may not include plugins); this forwards to it for
// the plugins that spell it loom::common::fnv1a64.
#pragma once

#include <loom/checksum.h>

#include <cstddef>
#include <cstdint>

namespace loom::common {

inline constexpr uint64_t kFnv1a64Offset = LOOM_FNV1A64_OFFSET;

inline uint64_t fnv1a64(const void* data, size_t bytes, uint64_t seed = kFnv1a64Offset) {
  return loom_fnv1a64(data, bytes, seed);
}

}  // namespace loom::common
