/* Kind "loom.moe/1" (since ABI 1.5): a Mixture-of-Experts layer.
 *
 * One call runs a whole MoE layer over the tokens of this rank:
 *   gate:     logits = x . gate_w^T (fp32), probabilities = softmax(logits); each token chooses
 *             k experts (top-k, optionally with noise or an aux-loss-free bias on the choice);
 *   capacity: each expert takes at most `capacity` tokens per rank (the choices beyond it are
 *             dropped, the k-th choices first, then by probability or at random), or every
 *             token when the layer is dropless;
 *   dispatch: the kept (token, choice) pairs are sorted stably by expert, their rows gathered
 *             and, with expert parallelism, exchanged with a variable all_to_all inside the
 *             expert-parallel group (counts first, so ranks with different token counts never
 *             hang);
 *   experts:  each expert is a two-layer MLP, h = act(rows . w1^T + b1), out = h . w2^T + b2,
 *             run as grouped GEMMs over the experts' variable row counts;
 *   combine:  y[t] = sum over t's kept choices of weight * out (the exchange reversed); a
 *             token whose choices were all dropped gets y = 0 (the caller's residual carries it);
 *   residual: PR-MoE (flag LOOM_MOE_RESIDUAL) adds a dense MLP of the same shape and mixes the
 *             two per token, y = c0 * moe(x) + c1 * mlp(x), c = softmax(x . coef_w^T + coef_b).
 * `backward` runs the adjoint of all of it and of the load-balancing auxiliary loss.
 *
 * Every weight is the caller's: the gate, the experts held by this rank and the residual MLP
 * are trainer-owned parameters passed in, and their gradients are ADDED into trainer-owned
 * buffers, so any optimizer updates them. The expert weights on a rank are its
 * `local_experts` experts, global experts ep_rank * local_experts ... + local_experts - 1.
 * Expert gradients are the sum over the tokens of the whole expert-parallel group (the
 * all_to_all brings them); `reduce_gradients` then averages them over the expert-data-parallel
 * group as a data-parallel trainer averages its other gradients over all ranks.
 *
 * Parallel groups: the instance's `comm` parameter (a REF to a loom.comm) is the data-parallel
 * world of W ranks; its `ep_size` parameter splits it into W / ep_size expert-parallel groups
 * of consecutive ranks ([0, ep_size), [ep_size, 2 ep_size), ...) and ep_size
 * expert-data-parallel groups of the ranks with the same place in theirs ({r : r % ep_size ==
 * i}). forward, backward, dispatch, combine and reduce_gradients are collective over the
 * expert-parallel group (reduce_gradients over the expert-data-parallel group): every rank of
 * it makes the same calls in the same order. Without `comm`, ep_size is 1.
 *
 * The routing is a pure function of (x, gate_w, expert_bias, seed, step, layer, first_token):
 * noise, random token selection and jitter draw from a counter-based generator, so evaluation
 * (training = 0: no noise, no random selection, the eval capacity) is deterministic, and CPU
 * and CUDA choose the same experts. Tensors of a call live on one device (CPU or CUDA); device
 * work is enqueued on `stream`. The counts a call returns in host memory (the load, the
 * dropped choices, the aux loss) make a device call synchronise its stream before it returns.
 *
 * The factory's vtable points to a loom_moe_v1. */
#ifndef LOOM_KINDS_MOE_H
#define LOOM_KINDS_MOE_H

#include <loom/abi.h>

/* This kind's ID: loom_factory.kind of a plugin that provides it. */
#define LOOM_KIND_MOE "loom.moe/1"

#ifdef __cplusplus
extern "C" {
#endif

/* loom_moe_plan_args.flags (out) */
#define LOOM_MOE_RESIDUAL (1u << 0) /* PR-MoE: the residual MLP and coefficient are required */
#define LOOM_MOE_DROPLESS (1u << 1) /* no capacity: every kept choice is processed */
#define LOOM_MOE_EXPERT_BIAS                                         \
  (1u << 2) /* aux-loss-free balancing: forward reads expert_bias to \
             * choose and, in training, updates it from the load */
#define LOOM_MOE_EXPERT_PARALLEL (1u << 3) /* ep_size > 1: forward exchanges tokens */

/* Expert activation (loom_moe_plan_args.activation, out). */
typedef enum loom_moe_activation {
  LOOM_MOE_GELU = 1, /* tanh approximation, as the dense MLP of GPT-2 */
  LOOM_MOE_RELU = 2,
  LOOM_MOE_SILU = 3
} loom_moe_activation;

typedef struct loom_moe_plan_args {
  uint32_t struct_size;
  uint32_t reserved;
  /* The most tokens any rank of the expert-parallel group passes to one forward (>= 1): it
   * bounds every buffer. A forward may pass fewer. */
  int64_t tokens;
  int64_t model_dim;   /* M: features per token (>= 1) */
  int64_t hidden_dim;  /* H: each expert's (and the residual MLP's) hidden width (>= 1) */
  int32_t num_experts; /* E, over all ranks; 0: the instance's `num_experts` parameter */
  int32_t layer;       /* 0 .. num_layers - 1 */
  int32_t num_layers;
  uint32_t training; /* 1: capacity_factor and noise; 0: eval_capacity_factor, no noise */
  DLDataType dtype;  /* of x, y and every weight: float32, bfloat16 or float16 (a plugin
                      * refuses one it does not take, naming it) */
  /* out */
  uint32_t flags;        /* LOOM_MOE_* */
  int32_t experts;       /* E as resolved */
  int32_t local_experts; /* E / ep_size: the experts this rank holds */
  int32_t ep_size;       /* ranks of the expert-parallel group */
  int32_t ep_rank;       /* this rank's place in it */
  int32_t top_k;         /* experts per token */
  int32_t activation;    /* loom_moe_activation */
  int32_t reserved2;
  int64_t capacity;         /* tokens per expert per rank at `tokens`; 0 when dropless */
  int64_t max_expert_rows;  /* the most rows this rank's experts can receive in one call */
  uint64_t saved_bytes;     /* forward -> backward buffer */
  uint64_t workspace_bytes; /* scratch of every call */
} loom_moe_plan_args;
#define LOOM_MOE_PLAN_ARGS_SIZE LOOM_STRUCT_SIZE(loom_moe_plan_args, workspace_bytes)
LOOM_CHECK_STRUCT_SIZE(loom_moe_plan_args, LOOM_MOE_PLAN_ARGS_SIZE);

/* The layer's weights, in dtype, contiguous. With E_l = local_experts:
 *   gate_w [E, M]; w1 [E_l, H, M]; b1 [E_l, H]; w2 [E_l, M, H]; b2 [E_l, M];
 *   residual (LOOM_MOE_RESIDUAL only, NULL otherwise): res_w1 [H, M], res_b1 [H],
 *   res_w2 [M, H], res_b2 [M], coef_w [2, M], coef_b [2].
 * The same struct carries the gradients in backward (each ADDED to). */
typedef struct loom_moe_weights {
  uint32_t struct_size;
  uint32_t reserved;
  const DLTensor* gate_w;
  const DLTensor* w1;
  const DLTensor* b1;
  const DLTensor* w2;
  const DLTensor* b2;
  const DLTensor* res_w1;
  const DLTensor* res_b1;
  const DLTensor* res_w2;
  const DLTensor* res_b2;
  const DLTensor* coef_w;
  const DLTensor* coef_b;
} loom_moe_weights;
#define LOOM_MOE_WEIGHTS_SIZE LOOM_STRUCT_SIZE(loom_moe_weights, coef_b)
LOOM_CHECK_STRUCT_SIZE(loom_moe_weights, LOOM_MOE_WEIGHTS_SIZE);

/* Per-call statistics, host memory, written by forward (and by dispatch). */
typedef struct loom_moe_stats {
  uint32_t struct_size;
  uint32_t reserved;
  double aux_loss;     /* the load-balancing loss of this rank's tokens (before any coefficient) */
  int64_t dropped;     /* (token, choice) pairs of this rank dropped by capacity */
  int64_t expert_rows; /* rows this rank's experts processed (after the exchange) */
  /* Optional, caller-owned host int64 [E] (NULL: not written): tokens of this rank whose
   * choices included each expert, before capacity (the load the aux loss and the bias see). */
  int64_t* load;
  int64_t load_count; /* entries in load: E */
  /* Since 1.7 (out). Nanoseconds of host wall clock this call spent in each phase of the layer
   * (forward, and backward where its args carry stats); what a phase counts is in
   * docs/moe.md. A call on CUDA tensors enqueues its work without waiting for it and writes 0
   * to all five. A 1.6 caller's shorter struct does not receive them; a 1.6 plugin leaves them
   * as the caller set them, so initialise them to 0. */
  uint64_t gate_ns LOOM_APPENDED_FIELD;     /* scores, softmax, the choice, capacity (gradient) */
  uint64_t dispatch_ns LOOM_APPENDED_FIELD; /* the sort by expert and the row gather */
  uint64_t exchange_ns LOOM_APPENDED_FIELD; /* counts and rows between the ranks, agreements */
  uint64_t experts_ns LOOM_APPENDED_FIELD;  /* the experts' MLPs (and PR-MoE's residual MLP) */
  uint64_t combine_ns LOOM_APPENDED_FIELD;  /* rows back to tokens, weighted (and the PR-MoE mix) */
} loom_moe_stats;
#define LOOM_MOE_STATS_SIZE LOOM_STRUCT_SIZE(loom_moe_stats, combine_ns)
/* The size of a 1.5 / 1.6 caller's stats (no phase times), the least a plugin accepts. */
#define LOOM_MOE_STATS_SIZE_1_5 LOOM_STRUCT_SIZE(loom_moe_stats, load_count)
LOOM_CHECK_STRUCT_SIZE(loom_moe_stats, LOOM_MOE_STATS_SIZE);

typedef struct loom_moe_forward_args {
  uint32_t struct_size;
  uint32_t reserved;
  uint64_t seed;       /* the same on every rank; with step, layer, token: the noise */
  int64_t step;        /* 1-based training step */
  int64_t tokens;      /* this rank's rows (>= 0, <= the plan's tokens) */
  int64_t first_token; /* this rank's first token's index in the global batch (the noise's
                        * counter, so a split of the batch draws as the whole) */
  int64_t model_dim;   /* as planned */
  int64_t hidden_dim;  /* as planned */
  int32_t num_experts; /* as planned (0: the parameter) */
  int32_t layer;
  int32_t num_layers;
  uint32_t training;
  const DLTensor* x; /* [tokens, M] */
  const loom_moe_weights* weights;
  /* aux-loss-free balancing (LOOM_MOE_EXPERT_BIAS): float32 [E], the caller's state; added to
   * the scores for the choice only (never to the combine weights); in training, forward then
   * adds bias_update_rate * sign(mean load - load_e), the load summed over every rank of the
   * comm (the expert-parallel group and its data-parallel copies), so every copy keeps the same
   * bias; without a comm, this rank's load. Only after the call's checks pass on every rank of
   * the group (a refused forward leaves it as it was). NULL otherwise. */
  DLTensor* expert_bias;
  DLTensor* y; /* out: [tokens, M] (written) */
  /* out, optional: int32 [tokens, k] the chosen experts (-1: dropped) and float32 [tokens, k]
   * their combine weights: the routing, for a caller that runs its own experts */
  DLTensor* route_experts;
  DLTensor* route_weights;
  loom_moe_stats* stats; /* out, optional */
  void* saved;           /* saved_bytes from plan (256-byte aligned), on x's device */
  uint64_t saved_bytes;
  void* workspace; /* workspace_bytes from plan (256-byte aligned) */
  uint64_t workspace_bytes;
  void* stream; /* cudaStream_t for device tensors, NULL otherwise */
} loom_moe_forward_args;
#define LOOM_MOE_FORWARD_ARGS_SIZE LOOM_STRUCT_SIZE(loom_moe_forward_args, stream)
LOOM_CHECK_STRUCT_SIZE(loom_moe_forward_args, LOOM_MOE_FORWARD_ARGS_SIZE);

/* The adjoint of the forward whose `saved` is passed (same scalars, x and weights). dx is
 * written; every gradient in `grads` (same shapes as `weights`; the residual ones only with
 * LOOM_MOE_RESIDUAL) is ADDED to. With a 16-bit dtype the gradients are either all of that
 * dtype or all float32 (16-bit weights, float32 gradients: the mixed-precision layout).
 * aux_loss_coef scales the aux loss's gradient: the caller's loss is task + aux_loss_coef *
 * aux_loss. */
typedef struct loom_moe_backward_args {
  uint32_t struct_size;
  uint32_t reserved;
  uint64_t seed;
  int64_t step;
  int64_t tokens;
  int64_t first_token;
  int64_t model_dim;
  int64_t hidden_dim;
  int32_t num_experts;
  int32_t layer;
  int32_t num_layers;
  uint32_t training;
  double aux_loss_coef;
  const DLTensor* x; /* as given to forward, unchanged */
  const loom_moe_weights* weights;
  const DLTensor* dy;            /* [tokens, M] */
  DLTensor* dx;                  /* out: [tokens, M] (written) */
  const loom_moe_weights* grads; /* added to; the DLTensors are written through */
  const void* saved;             /* what forward wrote, unchanged */
  uint64_t saved_bytes;
  void* workspace;
  uint64_t workspace_bytes;
  void* stream;
  /* Since 1.7. Optional, out: backward writes the five phase times of `stats` (the phases'
   * adjoints; the other fields are left as they were). NULL, or a 1.6 caller's shorter args:
   * not asked. */
  loom_moe_stats* stats LOOM_APPENDED_FIELD;
} loom_moe_backward_args;
#define LOOM_MOE_BACKWARD_ARGS_SIZE LOOM_STRUCT_SIZE(loom_moe_backward_args, stats)
/* The size of a 1.5 / 1.6 caller's backward args (no stats). */
#define LOOM_MOE_BACKWARD_ARGS_SIZE_1_5 LOOM_STRUCT_SIZE(loom_moe_backward_args, stream)
LOOM_CHECK_STRUCT_SIZE(loom_moe_backward_args, LOOM_MOE_BACKWARD_ARGS_SIZE);

/* dispatch and combine alone, for a caller that runs its own experts, with a routing
 * (route_experts, route_weights) from forward or its own:
 *   dispatch: rows = the rows of x for this rank's experts, grouped by local expert in order
 *     (expert, source rank, token, choice); counts[e] = rows of local expert e. With weights,
 *     each row is scaled by its choice's weight (else copied).
 *   combine: y[t] = sum over t's choices j of (weights ? weights[t, j] : 1) * rows[slot(t, j)],
 *     the exchange reversed; y written.
 * They are each other's adjoints: the gradient of rows under dispatch is combine without
 * weights, that of rows under combine is dispatch with them. Collective over the
 * expert-parallel group. */
typedef struct loom_moe_dispatch_args {
  uint32_t struct_size;
  uint32_t reserved;
  int64_t tokens; /* this rank's rows */
  int64_t model_dim;
  int32_t num_experts;           /* as planned (0: the parameter) */
  int32_t top_k;                 /* columns of the routing: the plan's top_k */
  DLTensor* x;                   /* dispatch reads it; combine writes it as y: [tokens, M] */
  DLTensor* rows;                /* dispatch writes it; combine reads it: [max_expert_rows, M] */
  const DLTensor* route_experts; /* int32 [tokens, k], -1: none */
  const DLTensor* route_weights; /* float32 [tokens, k], or NULL */
  int64_t* counts;               /* out (dispatch): host int64 [local_experts] */
  int64_t counts_count;
  /* A 16-bit x's float32 staging (the plan's workspace_bytes, 256-byte aligned); float32 calls
   * may pass NULL. */
  void* workspace;
  uint64_t workspace_bytes;
  void* stream;
} loom_moe_dispatch_args;
#define LOOM_MOE_DISPATCH_ARGS_SIZE LOOM_STRUCT_SIZE(loom_moe_dispatch_args, stream)
LOOM_CHECK_STRUCT_SIZE(loom_moe_dispatch_args, LOOM_MOE_DISPATCH_ARGS_SIZE);

/* Averages expert gradients over the expert-data-parallel group: each tensor becomes the sum
 * over that group divided by the world size W (each rank's expert gradient already sums the
 * tokens of its expert-parallel group), which is the gradient of the world's mean loss. In
 * place; float32. With ep_size 1 it is the world average. */
typedef struct loom_moe_reduce_args {
  uint32_t struct_size;
  uint32_t reserved;
  DLTensor* const* tensors; /* count tensors, each contiguous */
  int64_t count;
  void* stream;
} loom_moe_reduce_args;
#define LOOM_MOE_REDUCE_ARGS_SIZE LOOM_STRUCT_SIZE(loom_moe_reduce_args, stream)
LOOM_CHECK_STRUCT_SIZE(loom_moe_reduce_args, LOOM_MOE_REDUCE_ARGS_SIZE);

typedef struct loom_moe_v1 {
  uint32_t struct_size;
  uint32_t reserved;
  /* [any] Pure: the resolved layout and buffer sizes. Refuses k > E, E not a multiple of
   * ep_size, and the like, naming the parameter. */
  loom_status* (*plan)(void* instance, loom_moe_plan_args* args);
  /* [instance] Collective over the expert-parallel group (see the top). */
  loom_status* (*forward)(void* instance, const loom_moe_forward_args* args);
  loom_status* (*backward)(void* instance, const loom_moe_backward_args* args);
  loom_status* (*dispatch)(void* instance, const loom_moe_dispatch_args* args);
  loom_status* (*combine)(void* instance, const loom_moe_dispatch_args* args);
  /* [instance] Collective over the expert-data-parallel group. */
  loom_status* (*reduce_gradients)(void* instance, const loom_moe_reduce_args* args);
} loom_moe_v1;
#define LOOM_MOE_V1_SIZE LOOM_STRUCT_SIZE(loom_moe_v1, reduce_gradients)
LOOM_CHECK_STRUCT_SIZE(loom_moe_v1, LOOM_MOE_V1_SIZE);
/* The smallest table a host accepts for this kind (every field: the kind is new in 1.5). */
#define LOOM_MOE_V1_MIN_SIZE LOOM_MOE_V1_SIZE

#ifdef __cplusplus
}
#endif

#endif /* LOOM_KINDS_MOE_H */

/* This kind's row in the kind list (loom/kinds/kinds.def): outside the include guard, so a
 * reader that defines LOOM_KIND(section, NAME) and includes the list gets one row per kind. */
#ifdef LOOM_KIND
LOOM_KIND(moe, MOE)
#endif
