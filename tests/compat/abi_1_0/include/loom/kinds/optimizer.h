/* Kind "loom.optimizer/1": an optimizer that updates parameters from gradients.
 * The factory's vtable points to a loom_optimizer_v1. */
#ifndef LOOM_KINDS_OPTIMIZER_H
#define LOOM_KINDS_OPTIMIZER_H

#include <loom/abi.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One parameter tensor and its gradient. Borrowed for the call. */
typedef struct loom_optimizer_tensor {
  uint32_t struct_size;
  uint32_t reserved;
  DLTensor *param;  /* updated in place; fp32, or bf16/fp16 when `master` is set */
  const DLTensor *grad; /* same shape as param; fp32, bf16 or fp16 */
  DLTensor *master; /* fp32 master copy of a low-precision param, or NULL */
} loom_optimizer_tensor;
#define LOOM_OPTIMIZER_TENSOR_SIZE LOOM_STRUCT_SIZE(loom_optimizer_tensor, master)
LOOM_CHECK_STRUCT_SIZE(loom_optimizer_tensor, LOOM_OPTIMIZER_TENSOR_SIZE);

/* A parameter group: tensors that share hyperparameter overrides. The same groups,
 * with the same tensor shapes in the same order, must be passed on every step: the
 * optimizer keys its state by (group, tensor) position. */
typedef struct loom_optimizer_group {
  uint32_t struct_size;
  uint32_t reserved;
  const loom_optimizer_tensor *tensors;
  size_t tensor_count;
  double lr_scale;     /* multiplies the step's lr; 1.0 for none */
  double weight_decay; /* NaN: use the instance's weight_decay parameter */
} loom_optimizer_group;
#define LOOM_OPTIMIZER_GROUP_SIZE LOOM_STRUCT_SIZE(loom_optimizer_group, weight_decay)
LOOM_CHECK_STRUCT_SIZE(loom_optimizer_group, LOOM_OPTIMIZER_GROUP_SIZE);

typedef struct loom_optimizer_step_args {
  uint32_t struct_size;
  uint32_t reserved;
  const loom_optimizer_group *groups;
  size_t group_count;
  double lr;          /* the trainer's learning rate for this step */
  double grad_scale;  /* gradients are divided by this (loss scaling); 1.0 for none */
  int64_t step;       /* the trainer's global step, 1-based; informational */
  void *stream;       /* cudaStream_t for device tensors, NULL otherwise */
} loom_optimizer_step_args;
#define LOOM_OPTIMIZER_STEP_ARGS_SIZE LOOM_STRUCT_SIZE(loom_optimizer_step_args, stream)
LOOM_CHECK_STRUCT_SIZE(loom_optimizer_step_args, LOOM_OPTIMIZER_STEP_ARGS_SIZE);

/* Communication an optimizer did on its own (the 1-bit family). */
typedef struct loom_optimizer_comm_info {
  uint32_t struct_size;
  /* 1 when, for the next step, the optimizer reduces gradients itself and the
   * trainer must pass local (not allreduced) gradients. */
  int32_t owns_communication;
  uint64_t bytes_sent;     /* totals since creation (restored on import) */
  uint64_t bytes_received;
  uint64_t rounds;         /* collective calls */
  uint64_t uncompressed_bytes_sent; /* what a plain fp32 allreduce would have sent */
} loom_optimizer_comm_info;
#define LOOM_OPTIMIZER_COMM_INFO_SIZE \
  LOOM_STRUCT_SIZE(loom_optimizer_comm_info, uncompressed_bytes_sent)
LOOM_CHECK_STRUCT_SIZE(loom_optimizer_comm_info, LOOM_OPTIMIZER_COMM_INFO_SIZE);

typedef struct loom_optimizer_v1 {
  uint32_t struct_size;
  uint32_t reserved;
  /* [main] One optimizer step over all groups. On error no parameter is changed
   * when the error is in the arguments (shapes, dtypes, devices). */
  loom_status *(*step)(void *instance, const loom_optimizer_step_args *args);
  /* [main] Optional (NULL: the optimizer never communicates). Fills `out`, whose
   * struct_size the caller sets. */
  loom_status *(*comm_info)(void *instance, loom_optimizer_comm_info *out);
} loom_optimizer_v1;
#define LOOM_OPTIMIZER_V1_SIZE LOOM_STRUCT_SIZE(loom_optimizer_v1, comm_info)
LOOM_CHECK_STRUCT_SIZE(loom_optimizer_v1, LOOM_OPTIMIZER_V1_SIZE);

#ifdef __cplusplus
}
#endif

#endif /* LOOM_KINDS_OPTIMIZER_H */
