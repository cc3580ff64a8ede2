/* Kind "loom.comm/1": a transport that runs collectives among the job's ranks.
 * The factory's vtable points to a loom_comm_v1. Every collective is called by all
 * ranks in the same order ([main] on each rank). Tensors are borrowed for the call;
 * device tensors are stream-ordered on `stream` (a cudaStream_t), host tensors
 * complete before the call returns. */
#ifndef LOOM_KINDS_COMM_H
#define LOOM_KINDS_COMM_H

#include <loom/abi.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum loom_reduce_op {
  LOOM_REDUCE_SUM = 0,
  LOOM_REDUCE_AVG = 1,
  LOOM_REDUCE_MAX = 2,
  LOOM_REDUCE_MIN = 3
} loom_reduce_op;

typedef struct loom_allreduce_args {
  uint32_t struct_size;
  int32_t op;           /* loom_reduce_op */
  const DLTensor* send; /* NULL: in place on recv */
  DLTensor* recv;
  void* stream;
} loom_allreduce_args;
#define LOOM_ALLREDUCE_ARGS_SIZE LOOM_STRUCT_SIZE(loom_allreduce_args, stream)
LOOM_CHECK_STRUCT_SIZE(loom_allreduce_args, LOOM_ALLREDUCE_ARGS_SIZE);

/* recv holds size * numel(send) elements, rank i's at offset i * numel(send). */
typedef struct loom_allgather_args {
  uint32_t struct_size;
  uint32_t reserved;
  const DLTensor* send;
  DLTensor* recv;
  void* stream;
} loom_allgather_args;
#define LOOM_ALLGATHER_ARGS_SIZE LOOM_STRUCT_SIZE(loom_allgather_args, stream)
LOOM_CHECK_STRUCT_SIZE(loom_allgather_args, LOOM_ALLGATHER_ARGS_SIZE);

/* Rank r sends send_counts[i] elements to rank i, in rank order from the start of
 * send, and receives recv_counts[i] from rank i, in rank order into recv. Both count
 * arrays NULL: equal splits of numel(send) / size. */
typedef struct loom_all_to_all_args {
  uint32_t struct_size;
  uint32_t reserved;
  const DLTensor* send;
  DLTensor* recv;
  const int64_t* send_counts; /* size entries, in elements, or NULL */
  const int64_t* recv_counts; /* size entries, in elements, or NULL */
  void* stream;
} loom_all_to_all_args;
#define LOOM_ALL_TO_ALL_ARGS_SIZE LOOM_STRUCT_SIZE(loom_all_to_all_args, stream)
LOOM_CHECK_STRUCT_SIZE(loom_all_to_all_args, LOOM_ALL_TO_ALL_ARGS_SIZE);

typedef struct loom_broadcast_args {
  uint32_t struct_size;
  int32_t root;
  DLTensor* tensor; /* root's data is copied into every rank's tensor */
  void* stream;
} loom_broadcast_args;
#define LOOM_BROADCAST_ARGS_SIZE LOOM_STRUCT_SIZE(loom_broadcast_args, stream)
LOOM_CHECK_STRUCT_SIZE(loom_broadcast_args, LOOM_BROADCAST_ARGS_SIZE);

/* Traffic counters since creation. */
typedef struct loom_comm_stats {
  uint32_t struct_size;
  uint32_t reserved;
  uint64_t bytes_sent;
  uint64_t bytes_received;
  uint64_t rounds; /* collective calls */
} loom_comm_stats;
#define LOOM_COMM_STATS_SIZE LOOM_STRUCT_SIZE(loom_comm_stats, rounds)
LOOM_CHECK_STRUCT_SIZE(loom_comm_stats, LOOM_COMM_STATS_SIZE);

typedef struct loom_comm_v1 {
  uint32_t struct_size;
  uint32_t reserved;
  /* [any] This rank and the number of ranks. */
  int32_t (*rank)(void* instance);
  int32_t (*size)(void* instance);
  /* [any] 1 when the transport can operate on tensors on `device`. */
  int32_t (*supports_device)(void* instance, DLDevice device);
  loom_status* (*allreduce)(void* instance, const loom_allreduce_args* args);
  loom_status* (*allgather)(void* instance, const loom_allgather_args* args);
  loom_status* (*all_to_all)(void* instance, const loom_all_to_all_args* args);
  loom_status* (*broadcast)(void* instance, const loom_broadcast_args* args);
  loom_status* (*barrier)(void* instance, void* stream);
  /* [any] Fills `out`, whose struct_size the caller sets. */
  loom_status* (*stats)(void* instance, loom_comm_stats* out);
  /* [main] Optional. The native communicator, e.g. kind "nccl" and an ncclComm_t,
   * owned by the instance. */
  loom_status* (*native_handle)(void* instance, const char** kind, void** handle);
} loom_comm_v1;
#define LOOM_COMM_V1_SIZE LOOM_STRUCT_SIZE(loom_comm_v1, native_handle)
LOOM_CHECK_STRUCT_SIZE(loom_comm_v1, LOOM_COMM_V1_SIZE);

#ifdef __cplusplus
}
#endif

#endif /* LOOM_KINDS_COMM_H */
