/* Kind "loom.router/1" (since ABI 1.4): token routing, for layers that process only some of
 * a sequence's tokens (random layerwise token dropping, Mixture-of-Depths).
 *
 * At each step and for each layer, a router chooses the positions of every sequence the
 * layer processes ("kept"); the others bypass the layer unchanged. The caller gathers the
 * kept tokens into a dense tensor, runs the layer on it (a causal layer sees the kept
 * positions in their original order, since every row of indices is increasing), and
 * scatters the layer's output back over the kept positions. Scatter is gather's adjoint, so
 * the same two calls move the gradients in backward (gather the output's gradient; scatter
 * the layer's input gradient over the kept positions).
 *
 * - A random router (random_ltd) keeps a uniformly random subset whose size follows a
 *   schedule of the step. Its choice is a pure function of (seed, step, layer, sample), so
 *   data-parallel ranks and a resumed run choose the same tokens, and CPU and CUDA agree.
 * - A learned router (flag LOOM_ROUTER_LEARNED) scores tokens with a weight the trainer
 *   owns and trains, keeps the best-scoring ones, and returns a gate per kept token: the
 *   caller scales the layer's update of that token by it, out = x + gate * (layer(x) - x),
 *   which is how the weight receives a gradient. `backward` turns the gates' gradient into
 *   the weight's and the input's.
 *
 * The kept count is static per (step, layer, seq_len): `plan` gives it, so every tensor is
 * sized before any data is read, and no call synchronises a device to report a count.
 * Tensors live on one device per call (CPU or CUDA); work on CUDA tensors is enqueued on
 * the call's `stream`.
 *
 * A router's exported state is its schedule position (the last step accounted and the
 * layer tokens consumed so far); it holds no random generator.
 *
 * The factory's vtable points to a loom_router_v1. */
#ifndef LOOM_KINDS_ROUTER_H
#define LOOM_KINDS_ROUTER_H

#include <loom/abi.h>

/* This kind's ID: loom_factory.kind of a plugin that provides it. */
#define LOOM_KIND_ROUTER "loom.router/1"

#ifdef __cplusplus
extern "C" {
#endif

/* loom_router_plan_args.flags */
#define LOOM_ROUTER_ROUTED (1u << 0) /* this layer keeps a subset (kept < seq_len) now */
#define LOOM_ROUTER_LEARNED                                    \
  (1u << 1) /* select reads x and weight and writes gates; the \
             * table's backward is set */

typedef struct loom_router_plan_args {
  uint32_t struct_size;
  uint32_t reserved;
  int64_t batch;    /* sequences in the call (>= 1) */
  int64_t seq_len;  /* positions per sequence (>= 1), after any curriculum cut */
  int64_t channels; /* features per token (>= 1) */
  int64_t step;     /* the training step, 1-based */
  int32_t layer;    /* the layer, 0 .. num_layers - 1 */
  int32_t num_layers;
  uint32_t training; /* 1: a training step; 0: evaluation (random routers keep everything) */
  DLDataType dtype;  /* of the hidden states x */
  /* out */
  uint32_t flags; /* LOOM_ROUTER_* */
  uint32_t reserved2;
  int64_t kept;             /* positions kept per sequence, 1 .. seq_len */
  uint64_t saved_bytes;     /* select -> backward buffer (learned routers; 0 otherwise) */
  uint64_t workspace_bytes; /* scratch of select and backward */
} loom_router_plan_args;
#define LOOM_ROUTER_PLAN_ARGS_SIZE LOOM_STRUCT_SIZE(loom_router_plan_args, workspace_bytes)
LOOM_CHECK_STRUCT_SIZE(loom_router_plan_args, LOOM_ROUTER_PLAN_ARGS_SIZE);

typedef struct loom_router_select_args {
  uint32_t struct_size;
  uint32_t reserved;
  /* The same on every data-parallel rank; with step, layer and the sample's index in the
   * batch, it determines a random router's choice. */
  uint64_t seed;
  int64_t step; /* as given to plan */
  int64_t batch;
  int64_t seq_len;
  int64_t channels;
  /* The global index of the batch's first sequence (a data-parallel rank's offset in the
   * global batch): sequence b draws as sample first_sample + b, so every sequence of a step
   * gets its own subset and the choice does not depend on how the batch is split. */
  int64_t first_sample;
  int32_t layer;
  int32_t num_layers;
  uint32_t training;
  uint32_t reserved2;
  /* [batch, seq_len, channels], channels contiguous (the batch and position strides are
   * free, so [seq_len, batch, channels] storage passes as strides): the layer's input.
   * Learned routers read it; others accept NULL. */
  const DLTensor* x;
  /* Learned routers: [channels], x's dtype: the scoring weight (the trainer's parameter).
   * NULL otherwise. */
  const DLTensor* weight;
  /* out: int32 [batch, kept], contiguous: each row the kept positions, strictly
   * increasing, in [0, seq_len). */
  DLTensor* indices;
  /* out, learned routers: [batch, kept], x's dtype, contiguous: each kept token's gate.
   * NULL otherwise (random routers' gates are 1). */
  DLTensor* gates;
  void* saved; /* saved_bytes from plan (256-byte aligned; NULL when 0), on x's device */
  uint64_t saved_bytes;
  void* workspace; /* workspace_bytes from plan (256-byte aligned; NULL when 0) */
  uint64_t workspace_bytes;
  void* stream; /* cudaStream_t for device tensors, NULL otherwise */
} loom_router_select_args;
#define LOOM_ROUTER_SELECT_ARGS_SIZE LOOM_STRUCT_SIZE(loom_router_select_args, stream)
LOOM_CHECK_STRUCT_SIZE(loom_router_select_args, LOOM_ROUTER_SELECT_ARGS_SIZE);

/* gather: kept[b, j, :] = full[b, indices[b, j], :].
 * scatter: full[b, indices[b, j], :] = kept[b, j, :]; the other positions of full are left
 * as they are (so a caller that put the layer's input there gets the bypass for free).
 * full is [batch, seq_len, channels] and kept is [batch, kept, channels], of one dtype of
 * 8, 16, 32 or 64 bits (the values are copied bit for bit), channels contiguous, other
 * strides free; indices is select's (rows strictly increasing, so scatter writes each
 * position at most once). */
typedef struct loom_router_move_args {
  uint32_t struct_size;
  uint32_t reserved;
  DLTensor* full;          /* gather reads it; scatter writes its kept positions */
  DLTensor* kept;          /* gather writes it; scatter reads it */
  const DLTensor* indices; /* int32 [batch, kept] */
  void* stream;            /* cudaStream_t for device tensors, NULL otherwise */
} loom_router_move_args;
#define LOOM_ROUTER_MOVE_ARGS_SIZE LOOM_STRUCT_SIZE(loom_router_move_args, stream)
LOOM_CHECK_STRUCT_SIZE(loom_router_move_args, LOOM_ROUTER_MOVE_ARGS_SIZE);

/* A learned router's backward: given dL/dgates, ADDS the gates' contribution to dL/dx (at
 * the kept positions) and to dL/dweight. */
typedef struct loom_router_backward_args {
  uint32_t struct_size;
  uint32_t reserved;
  int64_t batch;
  int64_t seq_len;
  int64_t channels;
  const DLTensor* x;       /* as given to select */
  const DLTensor* weight;  /* as given to select */
  const DLTensor* indices; /* select's */
  const DLTensor* dgates;  /* [batch, kept], x's dtype, contiguous */
  DLTensor* dx;            /* [batch, seq_len, channels], x's dtype: added to */
  DLTensor* dweight;       /* [channels], x's dtype: added to */
  const void* saved;       /* what select wrote, unchanged */
  uint64_t saved_bytes;
  void* workspace;
  uint64_t workspace_bytes;
  void* stream;
} loom_router_backward_args;
#define LOOM_ROUTER_BACKWARD_ARGS_SIZE LOOM_STRUCT_SIZE(loom_router_backward_args, stream)
LOOM_CHECK_STRUCT_SIZE(loom_router_backward_args, LOOM_ROUTER_BACKWARD_ARGS_SIZE);

/* Accounting of one training step: the tokens all layers processed. The router's schedule
 * position, and what a layer-token learning-rate schedule follows. */
typedef struct loom_router_advance_args {
  uint32_t struct_size;
  uint32_t reserved;
  /* 1-based: the step after the last one accounted (the position advances), or the last
   * one again (nothing changes; the same outs). Any other step is
   * LOOM_ERR_FAILED_PRECONDITION: a resumed run imports the exported state first. */
  int64_t step;
  int64_t batch;   /* sequences of the step over all ranks and micro-batches (>= 1) */
  int64_t seq_len; /* their length, after any curriculum cut (>= 1) */
  int32_t num_layers;
  int32_t reserved2;
  /* out */
  int64_t layer_tokens;           /* this step: the sum over layers of batch * kept(step, layer) */
  uint64_t consumed_layer_tokens; /* every step accounted so far, this one included */
} loom_router_advance_args;
#define LOOM_ROUTER_ADVANCE_ARGS_SIZE \
  LOOM_STRUCT_SIZE(loom_router_advance_args, consumed_layer_tokens)
LOOM_CHECK_STRUCT_SIZE(loom_router_advance_args, LOOM_ROUTER_ADVANCE_ARGS_SIZE);

typedef struct loom_router_v1 {
  uint32_t struct_size;
  uint32_t reserved;
  /* [any] Pure: the kept count, flags and buffer sizes for these arguments. */
  loom_status* (*plan)(void* instance, loom_router_plan_args* args);
  /* [any] Writes indices (and gates and saved). Pure: the same arguments give the same
   * outputs, bit for bit, on every thread, rank and device. */
  loom_status* (*select)(void* instance, const loom_router_select_args* args);
  /* [any] Stream-ordered on device tensors; see loom_router_move_args. */
  loom_status* (*gather)(void* instance, const loom_router_move_args* args);
  loom_status* (*scatter)(void* instance, const loom_router_move_args* args);
  /* [instance] Advances the schedule position by one step (see the args). */
  loom_status* (*advance)(void* instance, loom_router_advance_args* args);
  /* [any] Learned routers only (NULL otherwise): reads select's saved. */
  loom_status* (*backward)(void* instance, const loom_router_backward_args* args);
} loom_router_v1;
#define LOOM_ROUTER_V1_SIZE LOOM_STRUCT_SIZE(loom_router_v1, backward)
LOOM_CHECK_STRUCT_SIZE(loom_router_v1, LOOM_ROUTER_V1_SIZE);
/* The smallest table a host accepts for this kind (every field: the kind is new in 1.4). */
#define LOOM_ROUTER_V1_MIN_SIZE LOOM_ROUTER_V1_SIZE

#ifdef __cplusplus
}
#endif

#endif /* LOOM_KINDS_ROUTER_H */

/* This kind's row in the kind list (loom/kinds/kinds.def): outside the include guard, so a
 * reader that defines LOOM_KIND(section, NAME) and includes the list gets one row per kind. */
#ifdef LOOM_KIND
LOOM_KIND(router, ROUTER)
#endif
