/* Shared by the compatibility fixtures (sgd.c, codec.c), which are plain C11 built against
 * an old minor's ABI headers (tests/compat/abi_1_*), not against today's and not with the SDK.
 *
 * guarded_copy: what the plugin hands the host (its descriptor, factories, parameter specs,
 * function tables) is copied so that it ends exactly where an inaccessible page begins. Any
 * read by the host past the struct_size this plugin's era declares then faults, in every
 * build, not only under AddressSanitizer.
 *
 * compat_fail: the plugin's own loom_status objects (its allocator, its destroy), as a plugin
 * that does not borrow the host's make_status would write them. */
#ifndef LOOM_COMPAT_COMMON_H
#define LOOM_COMPAT_COMMON_H

#include <loom/abi.h>

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* The fields 1.2 appended to a parameter spec (flags, reserved2, int_min, int_max) and to a
 * factory (validate, create_with_args, import_state_with_args), set to "none" by the 1.2
 * build: a 1.2 plugin that uses none of them still hands the host 1.2-sized structs. */
#if COMPAT_MINOR >= 2
#define COMPAT_SPEC_TAIL , 0, 0, INT64_MIN, INT64_MAX
#define COMPAT_FACTORY_TAIL , NULL, NULL, NULL
#else
#define COMPAT_SPEC_TAIL
#define COMPAT_FACTORY_TAIL
#endif

/* A copy of `bytes` bytes of `src` whose last byte is followed by a PROT_NONE page (the
 * copy starts 8-byte aligned: every struct here ends with an 8-byte field). Never freed:
 * the descriptor lives as long as the library. NULL when the pages cannot be had. */
static inline const void* guarded_copy(const void* src, size_t bytes) {
  const long page_l = sysconf(_SC_PAGESIZE);
  if (page_l <= 0 || bytes % 8 != 0) return NULL;
  const size_t page = (size_t)page_l;
  const size_t usable = (bytes + page - 1) / page * page;
  unsigned char* base =
      mmap(NULL, usable + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return NULL;
  if (mprotect(base + usable, page, PROT_NONE) != 0) {
    munmap(base, usable + page);
    return NULL;
  }
  unsigned char* dst = base + usable - bytes;
  memcpy(dst, src, bytes);
  /* Read-only from here on, as static data would be. */
  if (mprotect(base, usable, PROT_READ) != 0) return NULL;
  return dst;
}

typedef struct compat_status {
  loom_status base;
  char text[320];
} compat_status;

static inline void compat_status_destroy(loom_status* self) { free(self); }

#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static inline loom_status*
compat_fail(const char* plugin, int32_t code, const char* fmt, ...) {
  compat_status* s = calloc(1, sizeof *s);
  if (s == NULL) return NULL; /* nothing better to do without memory */
  const int prefix = snprintf(s->text, sizeof s->text, "%s: ", plugin);
  va_list ap;
  va_start(ap, fmt);
  if (prefix > 0 && (size_t)prefix < sizeof s->text) {
    vsnprintf(s->text + prefix, sizeof s->text - (size_t)prefix, fmt, ap);
  }
  va_end(ap);
  s->base.struct_size = LOOM_STATUS_SIZE;
  s->base.code = code;
  s->base.message = s->text;
  s->base.destroy = compat_status_destroy;
  return &s->base;
}

/* Element i of an array of ABI structs whose elements are `stride` bytes apart (the
 * sender's struct_size: "arrays of ABI structs use their elements' struct_size as the
 * stride", a rule since 1.0). */
static inline const void* compat_element(const void* first, uint32_t stride, size_t i) {
  return (const unsigned char*)first + (size_t)stride * i;
}

/* Number of elements of a tensor (0 for a negative extent). */
static inline int64_t compat_numel(const DLTensor* t) {
  int64_t n = 1;
  for (int32_t d = 0; d < t->ndim; ++d) {
    if (t->shape[d] < 0) return 0;
    n *= t->shape[d];
  }
  return n;
}

/* 1 for a contiguous fp32 CPU tensor (NULL strides, or strides of a compact row-major one). */
static inline int compat_is_f32_cpu(const DLTensor* t) {
  if (t == NULL || t->data == NULL || t->device.device_type != kDLCPU) return 0;
  if (t->dtype.code != kDLFloat || t->dtype.bits != 32 || t->dtype.lanes != 1) return 0;
  if (t->strides != NULL) {
    int64_t expect = 1;
    for (int32_t d = t->ndim - 1; d >= 0; --d) {
      if (t->shape[d] != 1 && t->strides[d] != expect) return 0;
      expect *= t->shape[d];
    }
  }
  return 1;
}

static inline float* compat_f32(const DLTensor* t) {
  return (float*)(void*)((char*)t->data + t->byte_offset);
}

#endif /* LOOM_COMPAT_COMMON_H */
