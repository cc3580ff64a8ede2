/* Kind "loom.sampler/1" (since ABI 1.3): which samples of a dataset each data-parallel rank
 * trains on at each step.
 *
 * A sampler's next batch is a pure function of its position (the samples consumed so far,
 * the epoch, the seed it is given and, for a curriculum sampler, where each difficulty
 * cluster is in its shuffled order), so a resumed run draws exactly the batches the
 * uninterrupted run would have: its exported state is that position, a few bytes, and no
 * random generator. Every rank computes the same global batch and takes its own share, so
 * ranks never overlap and need no communication.
 *
 * A curriculum sampler's parameters REF a loom.curriculum schedule, which gives the
 * difficulty of each step, and name the index files `loom data analyze` wrote for a metric.
 *
 * The factory's vtable points to a loom_sampler_v1. */
#ifndef LOOM_KINDS_SAMPLER_H
#define LOOM_KINDS_SAMPLER_H

#include <loom/abi.h>

/* This kind's ID: loom_factory.kind of a plugin that provides it. */
#define LOOM_KIND_SAMPLER "loom.sampler/1"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct loom_sampler_plan_args {
  uint32_t struct_size;
  uint32_t reserved;
  /* The number of samples in the dataset the caller draws from (sample ids are
   * 0 .. dataset_size - 1). A sampler with an index checks only this count against the
   * index; that the index was written for the caller's dataset and sample length is the
   * caller's check (the reference trainer compares the index's dataset checksum and L). */
  uint64_t dataset_size;
  int64_t global_batch; /* samples per step, over all ranks (>= 1) */
  int32_t world_size;   /* data-parallel ranks the global batch is split over (>= 1) */
  int32_t reserved2;
  /* out */
  int64_t capacity; /* the most sample ids `next` writes for one rank */
} loom_sampler_plan_args;
#define LOOM_SAMPLER_PLAN_ARGS_SIZE LOOM_STRUCT_SIZE(loom_sampler_plan_args, capacity)
LOOM_CHECK_STRUCT_SIZE(loom_sampler_plan_args, LOOM_SAMPLER_PLAN_ARGS_SIZE);

typedef struct loom_sampler_next_args {
  uint32_t struct_size;
  uint32_t reserved;
  /* The same on every rank: the randomness of the batch is a function of (seed, step,
   * position), so data-parallel ranks that pass the same seed draw the same global batch. */
  uint64_t seed;
  /* 1-based. The step after the last one drawn (the position advances by one global
   * batch), or the last one again (another rank's share of the same global batch; the
   * position does not move). Any other step is LOOM_ERR_FAILED_PRECONDITION: a run that
   * resumes imports the exported state, which records the step. */
  int64_t step;
  int32_t rank;       /* 0 .. world_size - 1 */
  int32_t world_size; /* as given to plan */
  /* int64, 1-D, host memory, at least plan's capacity elements: this rank's sample ids, in
   * the order they form its share of the batch. */
  DLTensor* indices;
  /* out */
  int64_t count;     /* ids written; rank r's share is ids [round(r B / W), round((r+1) B / W))
                      * of the global batch of B = global_batch ids */
  double difficulty; /* the difficulty the batch was drawn at (NaN: not a curriculum) */
  uint64_t epoch;    /* full passes over the dataset completed before this batch */
  uint64_t consumed; /* samples drawn over all ranks, this batch included */
} loom_sampler_next_args;
#define LOOM_SAMPLER_NEXT_ARGS_SIZE LOOM_STRUCT_SIZE(loom_sampler_next_args, consumed)
LOOM_CHECK_STRUCT_SIZE(loom_sampler_next_args, LOOM_SAMPLER_NEXT_ARGS_SIZE);

typedef struct loom_sampler_v1 {
  uint32_t struct_size;
  uint32_t reserved;
  /* [instance] Fills plan's out field; also fixes dataset_size, global_batch and world_size
   * for the calls to `next` that follow. Calling plan again with other values restarts the
   * position at step 0, except for the first plan after a state was imported: it must give
   * the values that state was planned with (others are LOOM_ERR_INVALID_ARGUMENT and keep
   * the imported position). */
  loom_status* (*plan)(void* instance, loom_sampler_plan_args* args);
  /* [instance] This rank's share of the global batch of `args->step`. */
  loom_status* (*next)(void* instance, loom_sampler_next_args* args);
} loom_sampler_v1;
#define LOOM_SAMPLER_V1_SIZE LOOM_STRUCT_SIZE(loom_sampler_v1, next)
LOOM_CHECK_STRUCT_SIZE(loom_sampler_v1, LOOM_SAMPLER_V1_SIZE);
/* The smallest table a host accepts for this kind (every field: the kind is new in 1.3). */
#define LOOM_SAMPLER_V1_MIN_SIZE LOOM_SAMPLER_V1_SIZE

#ifdef __cplusplus
}
#endif

#endif /* LOOM_KINDS_SAMPLER_H */

/* This kind's row in the kind list (loom/kinds/kinds.def): outside the include guard, so a
 * reader that defines LOOM_KIND(section, NAME) and includes the list gets one row per kind. */
#ifdef LOOM_KIND
LOOM_KIND(sampler, SAMPLER)
#endif
