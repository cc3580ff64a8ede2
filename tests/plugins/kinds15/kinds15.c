/* kinds15: the kinds of ABI 1.5, loom.moe/1 and loom.quantizer/1, from plain C11 (no SDK), for
 * the host's tests (tests/host/kinds15_test.cpp).
 *
 * The MoE layer: top-1 routing to the expert of the largest gate logit (ties to the lower
 * index), a ReLU expert MLP on the host in fp32, y = p * (w2 relu(w1 x + b1) + b2) with p the
 * chosen expert's softmax probability; capacity = tokens (nothing is dropped), no expert
 * parallelism. Parameter `num_experts` (default 2). backward is UNIMPLEMENTED; dispatch,
 * combine and reduce_gradients are NULL (they are optional).
 *
 * The quantizer: symmetric INT8 with one float32 scale per row (max |x| / 127, 1 for a zero
 * row), codes round(x / scale) half to even; no matmul. Parameter `bits` (8 only, to have a
 * range to check).
 *
 * Built three times: KINDS15_SHORT_MOE makes "kinds15shortmoe", whose MoE table is 8 bytes
 * short of LOOM_MOE_V1_MIN_SIZE, KINDS15_SHORT_QUANTIZER "kinds15shortquant", with a short
 * quantizer table; the host refuses both. */
#include <loom/abi.h>
#include <loom/kinds/moe.h>
#include <loom/kinds/quantizer.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(KINDS15_SHORT_MOE)
#define KINDS15_NAME "kinds15shortmoe"
#define KINDS15_MOE_TABLE_SIZE (LOOM_MOE_V1_MIN_SIZE - 8)
#define KINDS15_QUANTIZER_TABLE_SIZE LOOM_QUANTIZER_V1_SIZE
#elif defined(KINDS15_SHORT_QUANTIZER)
#define KINDS15_NAME "kinds15shortquant"
#define KINDS15_MOE_TABLE_SIZE LOOM_MOE_V1_SIZE
#define KINDS15_QUANTIZER_TABLE_SIZE (LOOM_QUANTIZER_V1_MIN_SIZE - 8)
#else
#define KINDS15_NAME "kinds15"
#define KINDS15_MOE_TABLE_SIZE LOOM_MOE_V1_SIZE
#define KINDS15_QUANTIZER_TABLE_SIZE LOOM_QUANTIZER_V1_SIZE
#endif

typedef struct instance {
  const loom_host_services* host;
  int64_t value; /* num_experts or bits */
} instance;

static loom_status* fail(const instance* s, int32_t code, const char* message) {
  return s->host->make_status(s->host->host_ctx, code, message);
}

static void static_destroy(loom_status* self) { (void)self; }
static loom_status k_no_host = {LOOM_STATUS_SIZE, LOOM_ERR_INVALID_ARGUMENT,
                                "kinds15: no host services", static_destroy};

/* The INT parameter `name` of the instance's parameters, or `fallback`. */
static int64_t int_param(const loom_host_services* host, const char* name, int64_t fallback) {
  if (host->param_count == 0 || host->params == NULL) return fallback;
  const uint32_t step = host->params[0].struct_size;
  const unsigned char* base = (const unsigned char*)host->params;
  for (size_t i = 0; i < host->param_count; ++i) {
    const loom_param* p = (const loom_param*)(const void*)(base + i * step);
    if (p->name != NULL && strcmp(p->name, name) == 0) return p->value.int_value;
  }
  return fallback;
}

static loom_status* make(const loom_host_services* host, void** out, const char* param,
                         int64_t fallback) {
  if (host == NULL || out == NULL || host->make_status == NULL) return &k_no_host;
  instance* s = calloc(1, sizeof *s);
  if (s == NULL) {
    return host->make_status(host->host_ctx, LOOM_ERR_RESOURCE_EXHAUSTED, "kinds15: out of memory");
  }
  s->host = host;
  s->value = int_param(host, param, fallback);
  *out = s;
  return NULL;
}

static void destroy(void* p) { free(p); }

/* A contiguous host fp32 tensor with `n` elements. */
static const float* host_f32(const DLTensor* t, int64_t n) {
  if (t == NULL || t->data == NULL || t->device.device_type != kDLCPU ||
      t->dtype.code != kDLFloat || t->dtype.bits != 32 || t->strides != NULL) {
    return NULL;
  }
  int64_t m = 1;
  for (int32_t d = 0; d < t->ndim; ++d) m *= t->shape[d];
  return m == n ? (const float*)((const char*)t->data + t->byte_offset) : NULL;
}

/* ---- loom.moe/1 */

static loom_status* moe_create(const loom_host_services* host, void** out) {
  return make(host, out, "num_experts", 2);
}

static loom_status* moe_plan(void* p, loom_moe_plan_args* a) {
  const instance* s = p;
  if (a == NULL || a->struct_size < LOOM_MOE_PLAN_ARGS_SIZE || a->tokens < 1) {
    return fail(s, LOOM_ERR_INVALID_ARGUMENT, "kinds15: bad moe plan args");
  }
  if (a->dtype.code != kDLFloat || a->dtype.bits != 32) {
    return fail(s, LOOM_ERR_INVALID_ARGUMENT, "kinds15: the MoE layer takes float32");
  }
  const int32_t e = a->num_experts != 0 ? a->num_experts : (int32_t)s->value;
  a->flags = 0;
  a->experts = e;
  a->local_experts = e;
  a->ep_size = 1;
  a->ep_rank = 0;
  a->top_k = 1;
  a->activation = LOOM_MOE_RELU;
  a->capacity = a->tokens;
  a->max_expert_rows = a->tokens;
  a->saved_bytes = 0;
  a->workspace_bytes = 0;
  return NULL;
}

static loom_status* moe_forward(void* p, const loom_moe_forward_args* a) {
  const instance* s = p;
  if (a == NULL || a->struct_size < LOOM_MOE_FORWARD_ARGS_SIZE || a->weights == NULL) {
    return fail(s, LOOM_ERR_INVALID_ARGUMENT, "kinds15: bad moe forward args");
  }
  const int64_t t = a->tokens, m = a->model_dim, h = a->hidden_dim;
  const int64_t e = a->num_experts != 0 ? a->num_experts : s->value;
  const loom_moe_weights* w = a->weights;
  const float* x = host_f32(a->x, t * m);
  const float* gate = host_f32(w->gate_w, e * m);
  const float* w1 = host_f32(w->w1, e * h * m);
  const float* b1 = host_f32(w->b1, e * h);
  const float* w2 = host_f32(w->w2, e * m * h);
  const float* b2 = host_f32(w->b2, e * m);
  float* y = (float*)host_f32(a->y, t * m);
  if (x == NULL || gate == NULL || w1 == NULL || b1 == NULL || w2 == NULL || b2 == NULL ||
      y == NULL || h > 64 || e > 64) {
    return fail(s, LOOM_ERR_INVALID_ARGUMENT,
                "kinds15: tensors must be host fp32 of the planned shapes (at most 64 experts "
                "and hidden units)");
  }
  int64_t load[64] = {0};
  for (int64_t i = 0; i < t; ++i) {
    const float* xi = x + i * m;
    float logits[64];
    int64_t best = 0;
    for (int64_t j = 0; j < e; ++j) {
      float d = 0;
      for (int64_t c = 0; c < m; ++c) d += xi[c] * gate[j * m + c];
      logits[j] = d;
      if (d > logits[best]) best = j;
    }
    double z = 0;
    for (int64_t j = 0; j < e; ++j) z += exp((double)(logits[j] - logits[best]));
    const float prob = (float)(1.0 / z);
    ++load[best];
    float hid[64];
    for (int64_t u = 0; u < h; ++u) {
      float v = b1[best * h + u];
      for (int64_t c = 0; c < m; ++c) v += w1[(best * h + u) * m + c] * xi[c];
      hid[u] = v > 0 ? v : 0;
    }
    for (int64_t c = 0; c < m; ++c) {
      float v = b2[best * m + c];
      for (int64_t u = 0; u < h; ++u) v += w2[(best * m + c) * h + u] * hid[u];
      y[i * m + c] = prob * v;
    }
  }
  if (a->stats != NULL && a->stats->struct_size >= LOOM_MOE_STATS_SIZE) {
    a->stats->aux_loss = 0;
    a->stats->dropped = 0;
    a->stats->expert_rows = t;
    if (a->stats->load != NULL && a->stats->load_count == e) {
      for (int64_t j = 0; j < e; ++j) a->stats->load[j] = load[j];
    }
  }
  return NULL;
}

static loom_status* moe_backward(void* p, const loom_moe_backward_args* a) {
  (void)a;
  return fail(p, LOOM_ERR_UNIMPLEMENTED, "kinds15: the test MoE layer has no backward");
}

static const loom_param_spec k_moe_specs[] = {
    {.struct_size = LOOM_PARAM_SPEC_SIZE,
     .type = LOOM_PARAM_INT,
     .name = "num_experts",
     .doc = "Experts of the layer.",
     .default_value = {.struct_size = LOOM_VALUE_SIZE, .type = LOOM_PARAM_INT, .int_value = 2},
     .min = 1,
     .max = 64},
};

static const loom_moe_v1 k_moe_table = {
    .struct_size = KINDS15_MOE_TABLE_SIZE,
    .plan = moe_plan,
    .forward = moe_forward,
    .backward = moe_backward,
    .dispatch = NULL, /* optional */
    .combine = NULL,
    .reduce_gradients = NULL,
};

/* ---- loom.quantizer/1 */

static loom_status* quant_create(const loom_host_services* host, void** out) {
  return make(host, out, "bits", 8);
}

static loom_status* quant_layout(void* p, loom_quantizer_layout_args* a) {
  const instance* s = p;
  if (a == NULL || a->struct_size < LOOM_QUANTIZER_LAYOUT_ARGS_SIZE || a->ndim != 2 ||
      a->shape == NULL || a->format == NULL || a->format->struct_size < LOOM_QUANT_FORMAT_SIZE) {
    return fail(s, LOOM_ERR_INVALID_ARGUMENT, "kinds15: bad layout args");
  }
  loom_quant_format* f = a->format;
  const uint32_t size = f->struct_size;
  memset(f, 0, sizeof *f);
  f->struct_size = size;
  f->scheme = LOOM_QUANT_INT;
  f->bits = 8;
  f->flags = LOOM_QUANT_SYMMETRIC;
  f->packing = LOOM_QUANT_PACK_LSB_FIRST;
  f->axis = 1;
  f->group_size = a->shape[1];
  f->ndim = 2;
  f->shape = a->shape;
  f->scale_dtype = (DLDataType){kDLFloat, 32, 1};
  a->flags = 0;
  a->packed_bytes = (uint64_t)(a->shape[0] * a->shape[1]);
  a->scale_count = a->shape[0];
  a->zero_point_count = 0;
  a->workspace_bytes = 0;
  a->matmul_workspace_bytes = 0;
  return NULL;
}

static loom_status* quant_code(void* p, const loom_quantizer_quantize_args* a, int quantize) {
  const instance* s = p;
  if (a == NULL || a->struct_size < LOOM_QUANTIZER_QUANTIZE_ARGS_SIZE || a->x == NULL ||
      a->x->ndim != 2 || a->packed == NULL || a->scales == NULL) {
    return fail(s, LOOM_ERR_INVALID_ARGUMENT, "kinds15: bad quantize args");
  }
  const int64_t rows = a->x->shape[0], cols = a->x->shape[1];
  float* x = (float*)host_f32(a->x, rows * cols);
  float* scale = (float*)host_f32(a->scales, rows);
  int8_t* q =
      a->packed->data != NULL ? (int8_t*)((char*)a->packed->data + a->packed->byte_offset) : NULL;
  if (x == NULL || scale == NULL || q == NULL || a->packed->ndim != 1 ||
      a->packed->shape[0] != rows * cols) {
    return fail(s, LOOM_ERR_INVALID_ARGUMENT, "kinds15: tensors must be host fp32 / uint8");
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (quantize) {
      float mx = 0;
      for (int64_t c = 0; c < cols; ++c) {
        const float v = x[r * cols + c];
        if (!isfinite(v)) return fail(s, LOOM_ERR_INVALID_ARGUMENT, "kinds15: non-finite input");
        mx = fmaxf(mx, fabsf(v));
      }
      scale[r] = mx > 0 ? mx / 127 : 1;
      for (int64_t c = 0; c < cols; ++c) {
        q[r * cols + c] = (int8_t)nearbyintf(x[r * cols + c] / scale[r]);
      }
    } else {
      for (int64_t c = 0; c < cols; ++c) x[r * cols + c] = scale[r] * (float)q[r * cols + c];
    }
  }
  return NULL;
}

static loom_status* quant_quantize(void* p, const loom_quantizer_quantize_args* a) {
  return quant_code(p, a, 1);
}

static loom_status* quant_dequantize(void* p, const loom_quantizer_quantize_args* a) {
  return quant_code(p, a, 0);
}

static const loom_param_spec k_quant_specs[] = {
    {.struct_size = LOOM_PARAM_SPEC_SIZE,
     .type = LOOM_PARAM_INT,
     .name = "bits",
     .doc = "Bits per code (8 only).",
     .default_value = {.struct_size = LOOM_VALUE_SIZE, .type = LOOM_PARAM_INT, .int_value = 8},
     .min = 8,
     .max = 8},
};

static const loom_quantizer_v1 k_quant_table = {
    .struct_size = KINDS15_QUANTIZER_TABLE_SIZE,
    .layout = quant_layout,
    .quantize = quant_quantize,
    .dequantize = quant_dequantize,
    .matmul = NULL, /* optional: layout never sets LOOM_QUANTIZER_HAS_MATMUL */
};

/* ---- the plugin */

static const loom_factory k_moe_factory = {
    .struct_size = LOOM_FACTORY_SIZE,
    .kind = LOOM_KIND_MOE,
    .param_specs = k_moe_specs,
    .param_count = sizeof k_moe_specs / sizeof k_moe_specs[0],
    .create = moe_create,
    .destroy = destroy,
    .vtable = &k_moe_table,
};

static const loom_factory k_quant_factory = {
    .struct_size = LOOM_FACTORY_SIZE,
    .kind = LOOM_KIND_QUANTIZER,
    .param_specs = k_quant_specs,
    .param_count = sizeof k_quant_specs / sizeof k_quant_specs[0],
    .create = quant_create,
    .destroy = destroy,
    .vtable = &k_quant_table,
};

static const loom_factory* const k_factories[] = {&k_moe_factory, &k_quant_factory};

static const loom_plugin_v1 k_plugin = {
    LOOM_PLUGIN_V1_SIZE,
    LOOM_ABI_MAJOR,
    LOOM_ABI_MINOR,
    KINDS15_NAME,
    "1.5.0",
    "Test plugin: a top-1 MoE layer and a per-row INT8 quantizer",
    k_factories,
    sizeof k_factories / sizeof k_factories[0],
};

LOOM_EXPORT const loom_plugin_v1* loom_plugin_entry_v1(void) { return &k_plugin; }
