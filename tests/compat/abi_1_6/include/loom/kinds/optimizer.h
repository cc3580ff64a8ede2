/* Kind "loom.optimizer/1": an optimizer that updates parameters from gradients.
 * The factory's vtable points to a loom_optimizer_v1. */
#ifndef LOOM_KINDS_OPTIMIZER_H
#define LOOM_KINDS_OPTIMIZER_H

#include <loom/abi.h>

/* This kind's ID: loom_factory.kind of a plugin that provides it. */
#define LOOM_KIND_OPTIMIZER "loom.optimizer/1"

#ifdef __cplusplus
extern "C" {
#endif

/* One parameter tensor and its gradient. Borrowed for the call. */
typedef struct loom_optimizer_tensor {
  uint32_t struct_size;
  uint32_t reserved;
  DLTensor* param;      /* updated in place; fp32, or bf16/fp16 when `master` is set */
  const DLTensor* grad; /* same shape as param; fp32, bf16 or fp16 */
  DLTensor* master;     /* fp32 master copy of a low-precision param, or NULL */
  /* Since 1.1. Momentum mask of the 1-bit optimizers, or NULL for none: fp32, the param's
   * shape and device; the communicated momentum (or update) is multiplied by it, so a 0
   * keeps an element whose gradient is always 0 exactly where it is (1-bit compression
   * cannot represent 0). Pass it on every step; it is never part of exported state.
   * Optimizers with an exact allreduce (adam, lamb) check it and ignore it. */
  const DLTensor* exp_avg_mask LOOM_APPENDED_FIELD;
} loom_optimizer_tensor;
#define LOOM_OPTIMIZER_TENSOR_SIZE LOOM_STRUCT_SIZE(loom_optimizer_tensor, exp_avg_mask)
LOOM_CHECK_STRUCT_SIZE(loom_optimizer_tensor, LOOM_OPTIMIZER_TENSOR_SIZE);

/* loom_optimizer_group.flags (since 1.1). An optimizer refuses bits it does not know. */
/* onebit_adam: after freeze_step this group is still averaged with the uncompressed fp32
 * allreduce and updates both moments, as in warmup (DeepSpeed's `non_freeze`). The other
 * 1-bit optimizers refuse it; adam and lamb ignore it. */
#define LOOM_OPTIMIZER_GROUP_NON_FREEZE 1u
#define LOOM_OPTIMIZER_GROUP_KNOWN_FLAGS LOOM_OPTIMIZER_GROUP_NON_FREEZE

/* A parameter group: tensors that share hyperparameter overrides. The same groups,
 * with the same tensor shapes and flags in the same order, must be passed on every step:
 * the optimizer keys its state by (group, tensor) position. */
typedef struct loom_optimizer_group {
  uint32_t struct_size;
  uint32_t reserved;
  const loom_optimizer_tensor* tensors;
  size_t tensor_count;
  double lr_scale;                    /* multiplies the step's lr; 1.0 for none */
  double weight_decay;                /* NaN: use the instance's weight_decay parameter */
  uint32_t flags LOOM_APPENDED_FIELD; /* since 1.1: LOOM_OPTIMIZER_GROUP_* bits */
  uint32_t reserved2 LOOM_APPENDED_FIELD;
} loom_optimizer_group;
#define LOOM_OPTIMIZER_GROUP_SIZE LOOM_STRUCT_SIZE(loom_optimizer_group, reserved2)
LOOM_CHECK_STRUCT_SIZE(loom_optimizer_group, LOOM_OPTIMIZER_GROUP_SIZE);

typedef struct loom_optimizer_step_args {
  uint32_t struct_size;
  uint32_t reserved;
  const loom_optimizer_group* groups;
  size_t group_count;
  double lr;         /* the trainer's learning rate for this step */
  double grad_scale; /* gradients are divided by this (loss scaling); 1.0 for none */
  int64_t step;      /* the trainer's global step, 1-based; informational */
  void* stream;      /* cudaStream_t for device tensors, NULL otherwise */
  /* out */
  /* Since 1.2. Caller-owned; set to 1 when the step was skipped because a gradient divided
   * by grad_scale is not finite (NaN or +-Inf; parameters and optimizer state are then left
   * exactly as they were), 0 otherwise; NULL: the caller does not ask. Optimizers skip such
   * steps whether or not the caller asks (an older caller's shorter struct has no field)
   * unless their manifest sets skip_nonfinite = false. Written during the call; unspecified
   * after an error. Initialise it to 0: an optimizer built against an older minor does not
   * know the field and leaves it as it was. */
  int32_t* found_inf LOOM_APPENDED_FIELD;
} loom_optimizer_step_args;
#define LOOM_OPTIMIZER_STEP_ARGS_SIZE LOOM_STRUCT_SIZE(loom_optimizer_step_args, found_inf)
LOOM_CHECK_STRUCT_SIZE(loom_optimizer_step_args, LOOM_OPTIMIZER_STEP_ARGS_SIZE);

/* Communication an optimizer did on its own (the 1-bit family), and (since 1.2) the steps it
 * skipped. */
typedef struct loom_optimizer_comm_info {
  uint32_t struct_size;
  /* 1 when, for the next step, the optimizer reduces gradients itself and the
   * trainer must pass local (not allreduced) gradients. */
  int32_t owns_communication;
  uint64_t bytes_sent; /* totals since creation (restored on import) */
  uint64_t bytes_received;
  uint64_t rounds;                  /* collective calls */
  uint64_t uncompressed_bytes_sent; /* what a plain fp32 allreduce would have sent */
  /* Since 1.2 (out, as every field here). Steps skipped for a non-finite gradient
   * (loom_optimizer_step_args.found_inf) since the instance was created; not part of the
   * exported state, so a restored instance counts from 0. */
  uint64_t skipped_steps LOOM_APPENDED_FIELD;
  /* Since 1.6. Nanoseconds the instance spent blocked in its transport's calls (waiting on
   * the network, not compressing) since it was created; not part of the exported state. */
  uint64_t comm_wait_ns LOOM_APPENDED_FIELD;
} loom_optimizer_comm_info;
#define LOOM_OPTIMIZER_COMM_INFO_SIZE LOOM_STRUCT_SIZE(loom_optimizer_comm_info, comm_wait_ns)
LOOM_CHECK_STRUCT_SIZE(loom_optimizer_comm_info, LOOM_OPTIMIZER_COMM_INFO_SIZE);

/* Since 1.6. Overlap with the backward (loom_optimizer_v1.grads_ready): the gradients of some
 * tensors of the coming step are final. */
typedef struct loom_optimizer_ready_args {
  uint32_t struct_size;
  uint32_t reserved;
  /* The coming step's args: the groups, grad_scale, step and stream that step() will get (its
   * lr is read by step() only). Borrowed for the call; the gradients it names must stay as
   * they are until step() returns. */
  const loom_optimizer_step_args* step;
  size_t first; /* tensors [first, first + count), numbered across the groups in order */
  size_t count;
} loom_optimizer_ready_args;
#define LOOM_OPTIMIZER_READY_ARGS_SIZE LOOM_STRUCT_SIZE(loom_optimizer_ready_args, count)
LOOM_CHECK_STRUCT_SIZE(loom_optimizer_ready_args, LOOM_OPTIMIZER_READY_ARGS_SIZE);

typedef struct loom_optimizer_v1 {
  uint32_t struct_size;
  uint32_t reserved;
  /* [instance] One optimizer step over all groups. On error no parameter is changed
   * when the error is in the arguments (shapes, dtypes, devices). */
  loom_status* (*step)(void* instance, const loom_optimizer_step_args* args);
  /* [instance] Optional (NULL: the optimizer never communicates and reports no skipped
   * steps). Fills `out`, whose struct_size the caller sets. */
  loom_status* (*comm_info)(void* instance, loom_optimizer_comm_info* out);
  /* [instance] Since 1.6. Optional (NULL: step() does all of the step's work). The gradients of
   * tensors [first, first + count) of the coming step are final: the optimizer may start its
   * communication of them (the 1-bit family: the exchange of the buckets they complete) while
   * the caller computes the rest. The step() that follows, with the same groups, grad_scale,
   * step and stream, finishes the step, whatever was announced (step() takes the tensors
   * never announced as they are then); every rank must announce the same tensors in the same
   * order. A call for another step number than the one in progress, or one that names a
   * tensor announced already in this step (a second backward), is FAILED_PRECONDITION; after
   * any error the step in progress is dropped with the state as it was before it. The outcome
   * (parameters, state, skipped steps) is the same, bit for bit, as step() alone. */
  /* clang-format off */
  loom_status* (*grads_ready)(void* instance, const loom_optimizer_ready_args* args)
      LOOM_APPENDED_FIELD;
  /* clang-format on */
} loom_optimizer_v1;
#define LOOM_OPTIMIZER_V1_SIZE LOOM_STRUCT_SIZE(loom_optimizer_v1, grads_ready)
LOOM_CHECK_STRUCT_SIZE(loom_optimizer_v1, LOOM_OPTIMIZER_V1_SIZE);
/* The smallest table a host accepts for this kind: the fields of the first ABI minor that
 * had it (later fields are optional and checked against struct_size before use). */
#define LOOM_OPTIMIZER_V1_MIN_SIZE LOOM_STRUCT_SIZE(loom_optimizer_v1, step)

#ifdef __cplusplus
}
#endif

#endif /* LOOM_KINDS_OPTIMIZER_H */

/* This kind's row in the kind list (loom/kinds/kinds.def): outside the include guard, so a
 * reader that defines LOOM_KIND(section, NAME) and includes the list gets one row per kind. */
#ifdef LOOM_KIND
LOOM_KIND(optimizer, OPTIMIZER)
#endif
