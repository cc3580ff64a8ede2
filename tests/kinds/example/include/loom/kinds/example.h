/* loom.example/1: a kind that exists only in tests, added the way docs/abi.md ("Adding a
 * kind") says: this header, its SDK header (loom/sdk/kinds/example.hpp) and one line in a
 * kind list (example_kinds.def). No file of the host, the SDK or the plugins names it.
 *
 * An instance is a counter: run adds `steps` to its total and returns the total. */
#ifndef LOOM_KINDS_EXAMPLE_H
#define LOOM_KINDS_EXAMPLE_H

#include <loom/abi.h>

#ifdef __cplusplus
extern "C" {
#endif

#define LOOM_KIND_EXAMPLE "loom.example/1"

typedef struct loom_example_args {
  uint32_t struct_size; /* LOOM_EXAMPLE_ARGS_SIZE */
  int32_t steps;        /* >= 1 */
  int64_t result;       /* out: the instance's total after the call */
} loom_example_args;
#define LOOM_EXAMPLE_ARGS_SIZE LOOM_STRUCT_SIZE(loom_example_args, result)
LOOM_CHECK_STRUCT_SIZE(loom_example_args, LOOM_EXAMPLE_ARGS_SIZE);

typedef struct loom_example_v1 {
  uint32_t struct_size; /* LOOM_EXAMPLE_V1_SIZE */
  uint32_t reserved;
  /* [instance] */
  loom_status* (*run)(void* self, loom_example_args* args);
} loom_example_v1;
#define LOOM_EXAMPLE_V1_SIZE LOOM_STRUCT_SIZE(loom_example_v1, run)
LOOM_CHECK_STRUCT_SIZE(loom_example_v1, LOOM_EXAMPLE_V1_SIZE);
/* The smallest table a host accepts for this kind (every field). */
#define LOOM_EXAMPLE_V1_MIN_SIZE LOOM_EXAMPLE_V1_SIZE

#ifdef __cplusplus
}
#endif

#endif /* LOOM_KINDS_EXAMPLE_H */

/* This kind's row in a kind list (see loom/kinds/kinds.def). */
#ifdef LOOM_KIND
LOOM_KIND(example, EXAMPLE)
#endif
