// FNV-1a 64, the checksum of the file formats Loom writes (the trainer's dataset file, the
// data analyzer's index files): one definition, so both formats' docs name the same function.
#pragma once

#include <cstddef>
#include <cstdint>

namespace loom::common {

inline constexpr uint64_t kFnv1a64Offset = 0xcbf29ce484222325ull;

inline uint64_t fnv1a64(const void* data, size_t bytes, uint64_t seed = kFnv1a64Offset) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t h = seed;
  for (size_t i = 0; i < bytes; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

}  // namespace loom::common
