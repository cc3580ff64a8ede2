/* Kind "loom.comm/1": a transport that runs collectives among the job's ranks.
 * The factory's vtable points to a loom_comm_v1. Every collective is called by all
 * ranks in the same order ([instance] on each rank). Tensors are borrowed for the call;
 * device tensors are stream-ordered on `stream` (a cudaStream_t), host tensors
 * complete before the call returns.
 *
 * Process groups (since 1.2): `split` makes a sub-communicator of some of an instance's
 * ranks, an instance of the same plugin with the same function table; its collectives
 * run among those ranks only ("all ranks" above then means the group's ranks).
 *
 * Non-blocking collectives (since 1.6): `start` begins a collective and returns a request;
 * `test` asks whether it has finished and `wait` finishes it. Collectives run in the order
 * they were started or called, the same order on every rank; a blocking call made while
 * requests are outstanding runs after them. */
#ifndef LOOM_KINDS_COMM_H
#define LOOM_KINDS_COMM_H

#include <loom/abi.h>

/* This kind's ID: loom_factory.kind of a plugin that provides it. */
#define LOOM_KIND_COMM "loom.comm/1"

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

/* Since 1.6: reduce_scatter's arguments. send holds size * numel(recv) elements in rank
 * order; rank i receives the reduction over all ranks of block i (send elements
 * [i * numel(recv), (i + 1) * numel(recv))). */
typedef struct loom_reduce_scatter_args {
  uint32_t struct_size;
  int32_t op; /* loom_reduce_op */
  const DLTensor* send;
  DLTensor* recv;
  void* stream;
} loom_reduce_scatter_args;
#define LOOM_REDUCE_SCATTER_ARGS_SIZE LOOM_STRUCT_SIZE(loom_reduce_scatter_args, stream)
LOOM_CHECK_STRUCT_SIZE(loom_reduce_scatter_args, LOOM_REDUCE_SCATTER_ARGS_SIZE);

/* Since 1.6: the collective a start begins, and the args struct its `args` points to. */
typedef enum loom_comm_collective {
  LOOM_COLLECTIVE_ALLREDUCE = 0,      /* const loom_allreduce_args* */
  LOOM_COLLECTIVE_ALLGATHER = 1,      /* const loom_allgather_args* */
  LOOM_COLLECTIVE_REDUCE_SCATTER = 2, /* const loom_reduce_scatter_args* */
  LOOM_COLLECTIVE_ALL_TO_ALL = 3,     /* const loom_all_to_all_args* */
  LOOM_COLLECTIVE_BROADCAST = 4       /* const loom_broadcast_args* */
} loom_comm_collective;

/* Since 1.6: start's arguments. The args struct and everything it points to (tensors, their
 * shapes and data, count arrays) stay valid, and the tensors untouched by the caller, until
 * the request's wait returns. */
typedef struct loom_comm_start_args {
  uint32_t struct_size;
  int32_t collective; /* loom_comm_collective */
  const void* args;   /* that collective's args struct */
  void* request;      /* out: the request, for test and wait */
} loom_comm_start_args;
#define LOOM_COMM_START_ARGS_SIZE LOOM_STRUCT_SIZE(loom_comm_start_args, request)
LOOM_CHECK_STRUCT_SIZE(loom_comm_start_args, LOOM_COMM_START_ARGS_SIZE);

/* Since 1.6: test's and wait's arguments. */
typedef struct loom_comm_request_args {
  uint32_t struct_size;
  int32_t done;  /* out (test): 1 when the collective has finished, 0 while it runs */
  void* request; /* from start */
} loom_comm_request_args;
#define LOOM_COMM_REQUEST_ARGS_SIZE LOOM_STRUCT_SIZE(loom_comm_request_args, request)
LOOM_CHECK_STRUCT_SIZE(loom_comm_request_args, LOOM_COMM_REQUEST_ARGS_SIZE);

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

/* A `color` for split: this rank joins no group, and its result is NULL. Any negative
 * color means the same. */
#define LOOM_COMM_SPLIT_NONE (-1)

/* Since 1.2. The ranks that pass the same non-negative color form one group; within it
 * they are ordered by (key, rank in the parent), so equal keys keep the parent's order. */
typedef struct loom_comm_split_args {
  uint32_t struct_size;
  int32_t color; /* >= 0, or negative (LOOM_COMM_SPLIT_NONE): in no group */
  int32_t key;   /* orders the group's ranks */
  int32_t reserved;
  void* result; /* out: the sub-communicator, or NULL for a negative color */
} loom_comm_split_args;
#define LOOM_COMM_SPLIT_ARGS_SIZE LOOM_STRUCT_SIZE(loom_comm_split_args, result)
LOOM_CHECK_STRUCT_SIZE(loom_comm_split_args, LOOM_COMM_SPLIT_ARGS_SIZE);

/* Since 1.2: barrier2's arguments. */
typedef struct loom_comm_barrier_args {
  uint32_t struct_size;
  uint32_t reserved;
  void* stream; /* device transports: the barrier completes on this stream */
} loom_comm_barrier_args;
#define LOOM_COMM_BARRIER_ARGS_SIZE LOOM_STRUCT_SIZE(loom_comm_barrier_args, stream)
LOOM_CHECK_STRUCT_SIZE(loom_comm_barrier_args, LOOM_COMM_BARRIER_ARGS_SIZE);

/* Since 1.2: supports_device2's arguments. */
typedef struct loom_comm_device_args {
  uint32_t struct_size;
  uint32_t reserved;
  DLDevice device;
  int32_t supported; /* out: 1 when the transport can operate on tensors on `device` */
} loom_comm_device_args;
#define LOOM_COMM_DEVICE_ARGS_SIZE LOOM_STRUCT_SIZE(loom_comm_device_args, supported)
LOOM_CHECK_STRUCT_SIZE(loom_comm_device_args, LOOM_COMM_DEVICE_ARGS_SIZE);

/* Since 1.2: native_handle2's arguments. */
typedef struct loom_comm_native_handle_args {
  uint32_t struct_size;
  uint32_t reserved;
  const char* kind; /* out: e.g. "nccl" */
  void* handle;     /* out: e.g. an ncclComm_t, owned by the instance */
} loom_comm_native_handle_args;
#define LOOM_COMM_NATIVE_HANDLE_ARGS_SIZE LOOM_STRUCT_SIZE(loom_comm_native_handle_args, handle)
LOOM_CHECK_STRUCT_SIZE(loom_comm_native_handle_args, LOOM_COMM_NATIVE_HANDLE_ARGS_SIZE);

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
  /* [instance] Optional. The native communicator, e.g. kind "nccl" and an ncclComm_t,
   * owned by the instance. */
  loom_status* (*native_handle)(void* instance, const char** kind, void** handle);

  /* clang-format off */
  /* ---- since 1.2: process groups, and args-struct forms of the positional calls above.
   * All optional (NULL, or beyond a 1.1 plugin's struct_size: absent). A plugin that sets
   * one of the *2 calls also sets the older call beside it, for 1.0 and 1.1 hosts. */

  /* [instance] Optional; collective over the instance: every rank of it calls split, in
   * the same order relative to its other collectives. Sets args->result to a new instance
   * (same plugin, same table) whose ranks are this instance's ranks that passed the same
   * color, ordered by (key, rank here); NULL for a negative color. A child's stats count
   * its own calls only. On an error this rank has no child (result NULL); an argument
   * error found before any exchange leaves the instance as it was, a later one may leave
   * other ranks with their child: destroy it. A child may be split in turn. Calls on an instance and on its children may run concurrently
   * (they are different instances); the plugin orders whatever they share. */
  loom_status* (*split)(void* instance, loom_comm_split_args* args) LOOM_APPENDED_FIELD;
  /* [instance] Set whenever split is. Destroys a sub-communicator split returned (NULL is
   * a no-op; a child is never passed to the factory's destroy). Not collective. Every
   * child must be destroyed before its parent: a child may use what its parent holds. */
  void (*destroy_split)(void* instance) LOOM_APPENDED_FIELD;
  /* [instance] Optional. barrier with an args struct; collective. */
  loom_status* (*barrier2)(void* instance,
                           const loom_comm_barrier_args* args) LOOM_APPENDED_FIELD;
  /* [any] Optional. supports_device with an args struct: sets args->supported. */
  loom_status* (*supports_device2)(void* instance,
                                   loom_comm_device_args* args) LOOM_APPENDED_FIELD;
  /* [instance] Optional. native_handle with an args struct; an instance without a native
   * communicator returns UNIMPLEMENTED. */
  loom_status* (*native_handle2)(void* instance,
                                 loom_comm_native_handle_args* args) LOOM_APPENDED_FIELD;

  /* ---- since 1.6: reduce-scatter and non-blocking collectives. All optional; start, test
   * and wait come together. A caller of an older plugin falls back to the blocking calls
   * (loom::sdk::comm_start runs the collective at once and returns a finished request). */

  /* [instance] Optional. Collective: the reduction of block r of every rank's send, on
   * rank r. */
  loom_status* (*reduce_scatter)(void* instance,
                                 const loom_reduce_scatter_args* args) LOOM_APPENDED_FIELD;
  /* [instance] Optional. Begins a collective (in the order of this instance's other
   * collectives) and sets args->request. Host tensors may be read and written until wait
   * returns; device tensors are stream-ordered on the collective's stream as for the
   * blocking call, and wait also orders nothing more. An error here means no request was
   * made. Once a collective has failed the instance is broken: later calls fail too. */
  loom_status* (*start)(void* instance, loom_comm_start_args* args) LOOM_APPENDED_FIELD;
  /* [instance] Set with start. Sets args->done without blocking (it may make progress on
   * the request's collective and those before it). An error is the collective's: the
   * request still needs its wait. */
  loom_status* (*test)(void* instance, loom_comm_request_args* args) LOOM_APPENDED_FIELD;
  /* [instance] Set with start. Blocks until the request's collective has finished, returns
   * its error if it failed, and frees the request, also on an error: every request is
   * waited for exactly once, before the instance is destroyed. Requests may be waited for
   * in any order. */
  loom_status* (*wait)(void* instance, const loom_comm_request_args* args) LOOM_APPENDED_FIELD;
  /* clang-format on */
} loom_comm_v1;
#define LOOM_COMM_V1_SIZE LOOM_STRUCT_SIZE(loom_comm_v1, wait)
LOOM_CHECK_STRUCT_SIZE(loom_comm_v1, LOOM_COMM_V1_SIZE);
/* The smallest table a host accepts for this kind: the fields of the first ABI minor that
 * had it (later fields are optional and checked against struct_size before use). */
#define LOOM_COMM_V1_MIN_SIZE LOOM_STRUCT_SIZE(loom_comm_v1, stats)

#ifdef __cplusplus
}
#endif

#endif /* LOOM_KINDS_COMM_H */

/* This kind's row in the kind list (loom/kinds/kinds.def): outside the include guard, so a
 * reader that defines LOOM_KIND(section, NAME) and includes the list gets one row per kind. */
#ifdef LOOM_KIND
LOOM_KIND(comm, COMM)
#endif
