/* kinds14: the kind of ABI 1.4, loom.router/1, from plain C11 (no SDK), for the host's tests
 * (tests/host/kinds14_test.cpp).
 *
 * A strided router: every `stride`-th position of a sequence is kept (0, stride, 2 stride,
 * ...), so kept = ceil(seq_len / stride), the same at every step and layer, in training and
 * evaluation; it does not learn (no backward). gather and scatter move host fp32 tokens
 * whose channels are contiguous. advance counts layer tokens (num_layers * batch * kept) and
 * follows the kind's step rule: the next step, or the last one again.
 *
 * Built twice: KINDS14_SHORT_TABLE makes "kinds14short", whose router table is 8 bytes short
 * of LOOM_ROUTER_V1_MIN_SIZE, which the host refuses. */
#include <loom/abi.h>
#include <loom/kinds/router.h>

#include <stdlib.h>
#include <string.h>

#ifdef KINDS14_SHORT_TABLE
#define KINDS14_NAME "kinds14short"
#define KINDS14_ROUTER_TABLE_SIZE (LOOM_ROUTER_V1_MIN_SIZE - 8)
#else
#define KINDS14_NAME "kinds14"
#define KINDS14_ROUTER_TABLE_SIZE LOOM_ROUTER_V1_SIZE
#endif

typedef struct router {
  const loom_host_services* host;
  int64_t stride;
  int64_t last_step; /* 0 before the first advance */
  int64_t last_tokens;
  uint64_t consumed;
} router;

static loom_status* fail(const router* r, int32_t code, const char* message) {
  return r->host->make_status(r->host->host_ctx, code, message);
}

/* For a call without host services, which has no make_status to borrow. */
static void static_destroy(loom_status* self) { (void)self; }
static loom_status k_no_host = {LOOM_STATUS_SIZE, LOOM_ERR_INVALID_ARGUMENT,
                                "kinds14: no host services", static_destroy};

static int64_t kept_of(const router* r, int64_t seq_len) {
  return (seq_len + r->stride - 1) / r->stride;
}

static loom_status* rt_plan(void* instance, loom_router_plan_args* args) {
  const router* r = instance;
  if (args == NULL || args->struct_size < LOOM_ROUTER_PLAN_ARGS_SIZE || args->seq_len < 1 ||
      args->batch < 1 || args->layer < 0 || args->layer >= args->num_layers) {
    return fail(r, LOOM_ERR_INVALID_ARGUMENT, "kinds14: bad plan args");
  }
  args->kept = kept_of(r, args->seq_len);
  args->flags = args->kept < args->seq_len ? LOOM_ROUTER_ROUTED : 0u;
  args->saved_bytes = 0;
  args->workspace_bytes = 0;
  return NULL;
}

/* A 2-D int32 host tensor [batch, kept], contiguous. */
static int is_index_tensor(const DLTensor* t, int64_t batch, int64_t kept) {
  return t != NULL && t->data != NULL && t->device.device_type == kDLCPU && t->ndim == 2 &&
         t->dtype.code == kDLInt && t->dtype.bits == 32 && t->dtype.lanes == 1 &&
         t->shape[0] == batch && t->shape[1] == kept &&
         (t->strides == NULL || (t->strides[1] == 1 && t->strides[0] == kept));
}

static loom_status* rt_select(void* instance, const loom_router_select_args* args) {
  const router* r = instance;
  if (args == NULL || args->struct_size < LOOM_ROUTER_SELECT_ARGS_SIZE || args->seq_len < 1 ||
      args->batch < 1) {
    return fail(r, LOOM_ERR_INVALID_ARGUMENT, "kinds14: bad select args");
  }
  const int64_t kept = kept_of(r, args->seq_len);
  if (!is_index_tensor(args->indices, args->batch, kept)) {
    return fail(r, LOOM_ERR_INVALID_ARGUMENT, "kinds14: indices must be host int32 [batch, kept]");
  }
  int32_t* idx = (int32_t*)((char*)args->indices->data + args->indices->byte_offset);
  for (int64_t b = 0; b < args->batch; ++b) {
    for (int64_t j = 0; j < kept; ++j) idx[b * kept + j] = (int32_t)(j * r->stride);
  }
  return NULL;
}

/* A 3-D fp32 host tensor [batch, positions, channels], contiguous. */
static int is_token_tensor(const DLTensor* t) {
  return t != NULL && t->data != NULL && t->device.device_type == kDLCPU && t->ndim == 3 &&
         t->dtype.code == kDLFloat && t->dtype.bits == 32 && t->dtype.lanes == 1 &&
         t->strides == NULL;
}

/* to_kept: kept = full at the indices; otherwise full at the indices = kept. */
static loom_status* move(const router* r, const loom_router_move_args* args, int to_kept) {
  if (args == NULL || args->struct_size < LOOM_ROUTER_MOVE_ARGS_SIZE ||
      !is_token_tensor(args->full) || !is_token_tensor(args->kept)) {
    return fail(r, LOOM_ERR_INVALID_ARGUMENT, "kinds14: full and kept must be host fp32 [B, T, C]");
  }
  const int64_t batch = args->full->shape[0];
  const int64_t seq_len = args->full->shape[1];
  const int64_t channels = args->full->shape[2];
  const int64_t kept = args->kept->shape[1];
  if (args->kept->shape[0] != batch || args->kept->shape[2] != channels || kept > seq_len ||
      !is_index_tensor(args->indices, batch, kept)) {
    return fail(r, LOOM_ERR_INVALID_ARGUMENT, "kinds14: shapes do not agree");
  }
  const int32_t* idx = (const int32_t*)args->indices->data;
  float* full = (float*)args->full->data;
  float* k = (float*)args->kept->data;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t j = 0; j < kept; ++j) {
      const int64_t p = idx[b * kept + j];
      if (p < 0 || p >= seq_len) {
        return fail(r, LOOM_ERR_INVALID_ARGUMENT, "kinds14: an index is out of range");
      }
      float* f = full + (b * seq_len + p) * channels;
      float* d = k + (b * kept + j) * channels;
      if (to_kept) {
        memcpy(d, f, (size_t)channels * sizeof(float));
      } else {
        memcpy(f, d, (size_t)channels * sizeof(float));
      }
    }
  }
  return NULL;
}

static loom_status* rt_gather(void* instance, const loom_router_move_args* args) {
  return move(instance, args, 1);
}

static loom_status* rt_scatter(void* instance, const loom_router_move_args* args) {
  return move(instance, args, 0);
}

static loom_status* rt_advance(void* instance, loom_router_advance_args* args) {
  router* r = instance;
  if (args == NULL || args->struct_size < LOOM_ROUTER_ADVANCE_ARGS_SIZE || args->batch < 1 ||
      args->seq_len < 1 || args->num_layers < 1) {
    return fail(r, LOOM_ERR_INVALID_ARGUMENT, "kinds14: bad advance args");
  }
  if (args->step == r->last_step && r->last_step > 0) {
    args->layer_tokens = r->last_tokens;
    args->consumed_layer_tokens = r->consumed;
    return NULL;
  }
  if (args->step != r->last_step + 1) {
    return fail(r, LOOM_ERR_FAILED_PRECONDITION,
                "kinds14: advance must be given the next step or the last one again");
  }
  r->last_step = args->step;
  r->last_tokens = (int64_t)args->num_layers * args->batch * kept_of(r, args->seq_len);
  r->consumed += (uint64_t)r->last_tokens;
  args->layer_tokens = r->last_tokens;
  args->consumed_layer_tokens = r->consumed;
  return NULL;
}

static loom_status* rt_create(const loom_host_services* host, void** out_instance) {
  if (host == NULL || out_instance == NULL || host->make_status == NULL) return &k_no_host;
  const loom_param* stride = NULL;
  if (host->param_count > 0 && host->params != NULL) {
    const uint32_t step = host->params[0].struct_size;
    const unsigned char* base = (const unsigned char*)host->params;
    for (size_t i = 0; i < host->param_count; ++i) {
      const loom_param* p = (const loom_param*)(const void*)(base + i * step);
      if (p->name != NULL && strcmp(p->name, "stride") == 0) stride = p;
    }
  }
  router* r = calloc(1, sizeof *r);
  if (r == NULL) {
    return host->make_status(host->host_ctx, LOOM_ERR_RESOURCE_EXHAUSTED, "kinds14: out of memory");
  }
  r->host = host;
  r->stride = stride != NULL ? stride->value.int_value : 2;
  *out_instance = r;
  return NULL;
}

static void rt_destroy(void* instance) { free(instance); }

static const loom_param_spec k_specs[] = {
    {.struct_size = LOOM_PARAM_SPEC_SIZE,
     .type = LOOM_PARAM_INT,
     .name = "stride",
     .doc = "Every stride-th position is kept.",
     .default_value = {.struct_size = LOOM_VALUE_SIZE, .type = LOOM_PARAM_INT, .int_value = 2},
     .min = 1,
     .max = 1e6},
};

static const loom_router_v1 k_table = {
    .struct_size = KINDS14_ROUTER_TABLE_SIZE,
    .plan = rt_plan,
    .select = rt_select,
    .gather = rt_gather,
    .scatter = rt_scatter,
    .advance = rt_advance,
    .backward = NULL, /* not a learned router */
};

static const loom_factory k_factory = {
    .struct_size = LOOM_FACTORY_SIZE,
    .kind = LOOM_KIND_ROUTER,
    .param_specs = k_specs,
    .param_count = sizeof k_specs / sizeof k_specs[0],
    .create = rt_create,
    .destroy = rt_destroy,
    .vtable = &k_table,
};

static const loom_factory* const k_factories[] = {&k_factory};

static const loom_plugin_v1 k_plugin = {
    LOOM_PLUGIN_V1_SIZE,
    LOOM_ABI_MAJOR,
    LOOM_ABI_MINOR,
    KINDS14_NAME,
    "1.4.0",
    "Test plugin: a router that keeps every stride-th position",
    k_factories,
    sizeof k_factories / sizeof k_factories[0],
};

LOOM_EXPORT const loom_plugin_v1* loom_plugin_entry_v1(void) { return &k_plugin; }
