/* FNV-1a 64: the checksum of the file formats Loom reads and writes (safetensors'
 * "loom.checksum" and the trainer's "fnv1a64", the trainer's dataset file, the data
 * analyzer's index files). It is part of those formats, so it lives in the ABI: one
 * definition that the host, the plugins and the trainer all use.
 *
 * loom_fnv1a64(data, bytes, seed) hashes `bytes` bytes; pass LOOM_FNV1A64_OFFSET as the
 * seed for a fresh hash, or a previous result to continue it over a further chunk.
 * C11 and C++; no includes but <stdint.h> and <stddef.h>. */
#ifndef LOOM_CHECKSUM_H
#define LOOM_CHECKSUM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* static inline, marked unused for GCC and Clang: a file that includes the header without
 * calling the function (or compiles the header alone) gets no -Wunused-function. */
#ifndef LOOM_STATIC_INLINE
#if defined(__GNUC__) || defined(__clang__)
#define LOOM_STATIC_INLINE static inline __attribute__((unused))
#else
#define LOOM_STATIC_INLINE static inline
#endif
#endif

#define LOOM_FNV1A64_OFFSET UINT64_C(0xcbf29ce484222325)
#define LOOM_FNV1A64_PRIME UINT64_C(0x100000001b3)

LOOM_STATIC_INLINE uint64_t loom_fnv1a64(const void* data, size_t bytes, uint64_t seed) {
  const unsigned char* p = (const unsigned char*)data;
  uint64_t h = seed;
  size_t i;
  for (i = 0; i < bytes; ++i) {
    h ^= p[i];
    h *= LOOM_FNV1A64_PRIME;
  }
  return h;
}

#ifdef __cplusplus
}
#endif

#endif /* LOOM_CHECKSUM_H */
