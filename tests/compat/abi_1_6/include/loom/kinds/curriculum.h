/* Kind "loom.curriculum/1" (since ABI 1.3): the two halves of curriculum learning, a
 * difficulty metric and a difficulty schedule. A plugin provides one half or both; `plan`
 * says which, and the functions of a half it does not provide are NULL.
 *
 * - A metric scores samples: how hard each one is (its length, the rarity of its tokens).
 *   Scores depend only on the samples' tokens and, for metrics that need a first pass over
 *   the dataset (token frequencies), on statistics the caller accumulates with `count` and
 *   passes back to `score`. The data analyzer (`loom data analyze`) runs metrics over a
 *   whole dataset; a sampler reads the index files it writes.
 * - A schedule maps a training step to a difficulty, and a sequence-length schedule
 *   (sequence-length warmup) also to the sequence length the trainer cuts each batch to.
 *
 * The factory's vtable points to a loom_curriculum_v1. */
#ifndef LOOM_KINDS_CURRICULUM_H
#define LOOM_KINDS_CURRICULUM_H

#include <loom/abi.h>

/* This kind's ID: loom_factory.kind of a plugin that provides it. */
#define LOOM_KIND_CURRICULUM "loom.curriculum/1"

#ifdef __cplusplus
extern "C" {
#endif

/* loom_curriculum_plan_args.roles: the halves a plugin provides. */
#define LOOM_CURRICULUM_METRIC (1u << 0)   /* count (optional) and score are set */
#define LOOM_CURRICULUM_SCHEDULE (1u << 1) /* at is set */

/* loom_curriculum_plan_args.seq_len_mode: what a schedule's seq_len asks of the trainer. */
#define LOOM_SEQ_LEN_NONE 0u     /* the schedule's difficulty is not a sequence length */
#define LOOM_SEQ_LEN_TRUNCATE 1u /* keep each sequence's first seq_len tokens, drop the rest */
#define LOOM_SEQ_LEN_RESHAPE                                    \
  2u /* cut each sequence into seq_len pieces that become extra \
      * sequences, so the tokens per step stay the same */

typedef struct loom_curriculum_plan_args {
  uint32_t struct_size;
  uint32_t reserved;
  uint32_t vocab_size; /* tokens of the dataset are < vocab_size */
  uint32_t reserved2;
  /* out */
  uint32_t roles;        /* LOOM_CURRICULUM_* bits */
  uint32_t seq_len_mode; /* schedules: LOOM_SEQ_LEN_*; metrics: LOOM_SEQ_LEN_NONE */
  /* Metrics: int64 counters the metric needs summed over the whole dataset before it can
   * score (vocabulary_rarity: vocab_size token counts); 0 when it needs no first pass. */
  uint64_t stats_count;
} loom_curriculum_plan_args;
#define LOOM_CURRICULUM_PLAN_ARGS_SIZE LOOM_STRUCT_SIZE(loom_curriculum_plan_args, stats_count)
LOOM_CHECK_STRUCT_SIZE(loom_curriculum_plan_args, LOOM_CURRICULUM_PLAN_ARGS_SIZE);

/* A batch of samples: sample i is tokens[offsets[i] .. offsets[i + 1]). */
typedef struct loom_curriculum_samples {
  uint32_t struct_size;
  uint32_t reserved;
  const DLTensor* tokens;  /* 1-D uint16, int32 or int64; every token < vocab_size */
  const DLTensor* offsets; /* 1-D int64, samples + 1 elements, non-decreasing, within tokens;
                            * on the same device as tokens */
} loom_curriculum_samples;
#define LOOM_CURRICULUM_SAMPLES_SIZE LOOM_STRUCT_SIZE(loom_curriculum_samples, offsets)
LOOM_CHECK_STRUCT_SIZE(loom_curriculum_samples, LOOM_CURRICULUM_SAMPLES_SIZE);

typedef struct loom_curriculum_count_args {
  uint32_t struct_size;
  uint32_t reserved;
  loom_curriculum_samples samples;
  uint32_t vocab_size;
  uint32_t reserved2;
  /* int64, stats_count elements, on the samples' device: the counts of these samples are
   * ADDED to it. Counts merge by elementwise sum, so threads and ranks may each count a
   * shard into their own buffer and the caller adds the buffers. */
  DLTensor* stats;
  void* stream; /* cudaStream_t for device tensors, NULL otherwise */
} loom_curriculum_count_args;
#define LOOM_CURRICULUM_COUNT_ARGS_SIZE LOOM_STRUCT_SIZE(loom_curriculum_count_args, stream)
LOOM_CHECK_STRUCT_SIZE(loom_curriculum_count_args, LOOM_CURRICULUM_COUNT_ARGS_SIZE);

typedef struct loom_curriculum_score_args {
  uint32_t struct_size;
  uint32_t reserved;
  loom_curriculum_samples samples;
  uint32_t vocab_size;
  uint32_t reserved2;
  /* int64, stats_count elements: the counts summed over the whole dataset; NULL when the
   * metric's stats_count is 0. */
  const DLTensor* stats;
  DLTensor* scores; /* out: fp64, one per sample, on the samples' device */
  void* stream;     /* cudaStream_t for device tensors, NULL otherwise */
} loom_curriculum_score_args;
#define LOOM_CURRICULUM_SCORE_ARGS_SIZE LOOM_STRUCT_SIZE(loom_curriculum_score_args, stream)
LOOM_CHECK_STRUCT_SIZE(loom_curriculum_score_args, LOOM_CURRICULUM_SCORE_ARGS_SIZE);

typedef struct loom_curriculum_at_args {
  uint32_t struct_size;
  uint32_t reserved;
  int64_t step; /* the training step, 1-based (the first step is 1) */
  /* out */
  double difficulty; /* the schedule's difficulty at `step` */
  /* LOOM_SEQ_LEN_TRUNCATE / RESHAPE schedules: the sequence length for `step` (>= 1);
   * 0 for LOOM_SEQ_LEN_NONE. */
  int64_t seq_len;
} loom_curriculum_at_args;
#define LOOM_CURRICULUM_AT_ARGS_SIZE LOOM_STRUCT_SIZE(loom_curriculum_at_args, seq_len)
LOOM_CHECK_STRUCT_SIZE(loom_curriculum_at_args, LOOM_CURRICULUM_AT_ARGS_SIZE);

typedef struct loom_curriculum_v1 {
  uint32_t struct_size;
  uint32_t reserved;
  /* [any] Pure: fills the out fields of `args` from the instance's parameters. */
  loom_status* (*plan)(void* instance, loom_curriculum_plan_args* args);
  /* [any] Metrics with stats_count > 0: adds the samples' counts to args->stats. Pure
   * apart from that addition; NULL for a metric that needs no first pass, and for a
   * schedule. */
  loom_status* (*count)(void* instance, const loom_curriculum_count_args* args);
  /* [any] Metrics: writes one score per sample. Pure: the same samples and stats give the
   * same scores, bit for bit, on every thread, rank and device. NULL for a schedule. */
  loom_status* (*score)(void* instance, const loom_curriculum_score_args* args);
  /* [instance] Schedules: the difficulty (and seq_len) of a step. NULL for a metric. */
  loom_status* (*at)(void* instance, loom_curriculum_at_args* args);
} loom_curriculum_v1;
#define LOOM_CURRICULUM_V1_SIZE LOOM_STRUCT_SIZE(loom_curriculum_v1, at)
LOOM_CHECK_STRUCT_SIZE(loom_curriculum_v1, LOOM_CURRICULUM_V1_SIZE);
/* The smallest table a host accepts for this kind (every field: the kind is new in 1.3). */
#define LOOM_CURRICULUM_V1_MIN_SIZE LOOM_CURRICULUM_V1_SIZE

#ifdef __cplusplus
}
#endif

#endif /* LOOM_KINDS_CURRICULUM_H */

/* This kind's row in the kind list (loom/kinds/kinds.def): outside the include guard, so a
 * reader that defines LOOM_KIND(section, NAME) and includes the list gets one row per kind. */
#ifdef LOOM_KIND
LOOM_KIND(curriculum, CURRICULUM)
#endif
