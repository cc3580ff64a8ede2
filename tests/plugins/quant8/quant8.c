/* quant8: a plain INT8 weight quantizer (loom.quantizer/1) in C11, for the tests of
 * `loom quantize`, the safetensors C API and the [[quantize]] rules (tests/host/quantize_test.cpp).
 *
 * Role WEIGHT only, float32 on the CPU. Groups of `group_size` along K (0: one group per
 * row). symmetric: s = max|x| / 127 (1 when the group is all zero), q = round(x / s) in
 * [-127, 127]. asymmetric: s = (max - min) / 255 (1 when max = min), z = clamp(round(-min /
 * s), 0, 255), q = clamp(round(x / s) + z, 0, 255). Codes are 8 bits, so both packings are
 * the identity; `msb_first` only changes the descriptor. No matmul. */
#include <loom/abi.h>
#include <loom/kinds/quantizer.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct quant8 {
  const loom_host_services* host;
  int64_t group_size;
  int symmetric;
} quant8;

static loom_status* fail(const quant8* q, int32_t code, const char* message) {
  return q->host->make_status(q->host->host_ctx, code, message);
}

static void static_destroy(loom_status* self) { (void)self; }
static loom_status k_no_host = {LOOM_STATUS_SIZE, LOOM_ERR_INVALID_ARGUMENT,
                                "quant8: no host services", static_destroy};

static int64_t group_of(const quant8* q, int64_t k) {
  return q->group_size > 0 ? q->group_size : k;
}

static loom_status* q8_layout(void* instance, loom_quantizer_layout_args* a) {
  const quant8* q = instance;
  if (a == NULL || a->struct_size < LOOM_QUANTIZER_LAYOUT_ARGS_SIZE || a->format == NULL ||
      a->shape == NULL) {
    return fail(q, LOOM_ERR_INVALID_ARGUMENT, "quant8: bad layout args");
  }
  if (a->role != LOOM_QUANTIZER_WEIGHT || a->ndim != 2 || a->dtype.code != kDLFloat ||
      a->dtype.bits != 32) {
    return fail(q, LOOM_ERR_INVALID_ARGUMENT, "quant8: only float32 [N, K] weights");
  }
  const int64_t n = a->shape[0], k = a->shape[1];
  const int64_t g = group_of(q, k);
  const int64_t groups = k == 0 ? 0 : (k + g - 1) / g;
  loom_quant_format* f = a->format;
  const uint32_t size = f->struct_size;
  memset(f, 0, sizeof *f);
  f->struct_size = size;
  f->scheme = LOOM_QUANT_INT;
  f->bits = 8;
  f->flags = q->symmetric ? LOOM_QUANT_SYMMETRIC : 0u;
  f->packing = LOOM_QUANT_PACK_LSB_FIRST;
  f->axis = 1;
  f->group_size = g > 0 ? g : 1;
  f->ndim = 2;
  f->shape = a->shape;
  f->scale_dtype = (DLDataType){kDLFloat, 32, 1};
  if (!q->symmetric) f->zero_point_dtype = (DLDataType){kDLUInt, 8, 1};
  a->flags = 0;
  a->packed_bytes = (uint64_t)(n * k);
  a->scale_count = n * groups;
  a->zero_point_count = q->symmetric ? 0 : n * groups;
  a->workspace_bytes = 0;
  a->matmul_workspace_bytes = 0;
  return NULL;
}

static int is_f32(const DLTensor* t, int64_t n, int64_t k) {
  return t != NULL && t->data != NULL && t->device.device_type == kDLCPU && t->ndim == 2 &&
         t->dtype.code == kDLFloat && t->dtype.bits == 32 && t->shape[0] == n && t->shape[1] == k;
}

static loom_status* run(const quant8* q, const loom_quantizer_quantize_args* a, int forward) {
  if (a == NULL || a->struct_size < LOOM_QUANTIZER_QUANTIZE_ARGS_SIZE || a->format == NULL ||
      a->format->ndim != 2 || a->packed == NULL || a->scales == NULL) {
    return fail(q, LOOM_ERR_INVALID_ARGUMENT, "quant8: bad quantize args");
  }
  const int64_t n = a->format->shape[0], k = a->format->shape[1];
  const int64_t g = group_of(q, k);
  const int64_t groups = k == 0 ? 0 : (k + g - 1) / g;
  if (!is_f32(a->x, n, k) ||
      (!q->symmetric && (a->zero_points == NULL || a->zero_points->data == NULL))) {
    return fail(q, LOOM_ERR_INVALID_ARGUMENT, "quant8: x must be float32 [N, K] on the CPU");
  }
  float* x = a->x->data;
  uint8_t* codes = a->packed->data;
  float* scales = a->scales->data;
  uint8_t* zeros = q->symmetric ? NULL : a->zero_points->data;
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t gi = 0; gi < groups; ++gi) {
      const int64_t lo = gi * g, hi = lo + g < k ? lo + g : k;
      float* row = x + r * k;
      uint8_t* c = codes + r * k;
      float* s = scales + r * groups + gi;
      if (forward) {
        float mx = -INFINITY, mn = INFINITY, amax = 0;
        for (int64_t j = lo; j < hi; ++j) {
          if (!isfinite(row[j])) {
            char msg[96];
            snprintf(msg, sizeof msg, "quant8: element (%lld, %lld) is not finite", (long long)r,
                     (long long)j);
            return fail(q, LOOM_ERR_INVALID_ARGUMENT, msg);
          }
          mx = row[j] > mx ? row[j] : mx;
          mn = row[j] < mn ? row[j] : mn;
          amax = fabsf(row[j]) > amax ? fabsf(row[j]) : amax;
        }
        if (q->symmetric) {
          *s = amax > 0 ? amax / 127.0f : 1.0f;
          for (int64_t j = lo; j < hi; ++j) {
            float v = nearbyintf(row[j] / *s);
            v = v > 127 ? 127 : (v < -127 ? -127 : v);
            c[j] = (uint8_t)(int8_t)v;
          }
        } else {
          *s = mx > mn ? (mx - mn) / 255.0f : 1.0f;
          float z = nearbyintf(-mn / *s);
          z = z < 0 ? 0 : (z > 255 ? 255 : z);
          zeros[r * groups + gi] = (uint8_t)z;
          for (int64_t j = lo; j < hi; ++j) {
            float v = nearbyintf(row[j] / *s) + z;
            v = v > 255 ? 255 : (v < 0 ? 0 : v);
            c[j] = (uint8_t)v;
          }
        }
      } else {
        for (int64_t j = lo; j < hi; ++j) {
          row[j] = q->symmetric ? *s * (float)(int8_t)c[j]
                                : *s * ((float)c[j] - (float)zeros[r * groups + gi]);
        }
      }
    }
  }
  return NULL;
}

static loom_status* q8_quantize(void* instance, const loom_quantizer_quantize_args* a) {
  return run(instance, a, 1);
}

static loom_status* q8_dequantize(void* instance, const loom_quantizer_quantize_args* a) {
  return run(instance, a, 0);
}

static const loom_param* find_param(const loom_host_services* host, const char* name) {
  if (host->param_count == 0 || host->params == NULL) return NULL;
  const uint32_t step = host->params[0].struct_size;
  const unsigned char* base = (const unsigned char*)host->params;
  for (size_t i = 0; i < host->param_count; ++i) {
    const loom_param* p = (const loom_param*)(const void*)(base + i * step);
    if (p->name != NULL && strcmp(p->name, name) == 0) return p;
  }
  return NULL;
}

static loom_status* q8_create(const loom_host_services* host, void** out_instance) {
  if (host == NULL || out_instance == NULL || host->make_status == NULL) return &k_no_host;
  quant8* q = calloc(1, sizeof *q);
  if (q == NULL) {
    return host->make_status(host->host_ctx, LOOM_ERR_RESOURCE_EXHAUSTED, "quant8: out of memory");
  }
  q->host = host;
  const loom_param* g = find_param(host, "group_size");
  const loom_param* sym = find_param(host, "symmetric");
  q->group_size = g != NULL ? g->value.int_value : 0;
  q->symmetric = sym != NULL ? sym->value.int_value != 0 : 1;
  *out_instance = q;
  return NULL;
}

static void q8_destroy(void* instance) { free(instance); }

static const loom_param_spec k_specs[] = {
    {.struct_size = LOOM_PARAM_SPEC_SIZE,
     .type = LOOM_PARAM_INT,
     .name = "group_size",
     .doc = "Elements per group along K; 0: one group per row.",
     .default_value = {.struct_size = LOOM_VALUE_SIZE, .type = LOOM_PARAM_INT, .int_value = 0},
     .min = 0,
     .max = 1e9},
    {.struct_size = LOOM_PARAM_SPEC_SIZE,
     .type = LOOM_PARAM_BOOL,
     .name = "symmetric",
     .doc = "Signed codes without zero points; false: uint8 codes with zero points.",
     .default_value = {.struct_size = LOOM_VALUE_SIZE, .type = LOOM_PARAM_BOOL, .int_value = 1},
     .min = -INFINITY,
     .max = INFINITY},
};

static const loom_quantizer_v1 k_table = {
    .struct_size = LOOM_QUANTIZER_V1_SIZE,
    .layout = q8_layout,
    .quantize = q8_quantize,
    .dequantize = q8_dequantize,
    .matmul = NULL,
};

static const loom_factory k_factory = {
    .struct_size = LOOM_FACTORY_SIZE,
    .kind = LOOM_KIND_QUANTIZER,
    .param_specs = k_specs,
    .param_count = sizeof k_specs / sizeof k_specs[0],
    .create = q8_create,
    .destroy = q8_destroy,
    .vtable = &k_table,
};

static const loom_factory* const k_factories[] = {&k_factory};

static const loom_plugin_v1 k_plugin = {
    LOOM_PLUGIN_V1_SIZE,
    LOOM_ABI_MAJOR,
    LOOM_ABI_MINOR,
    "quant8",
    "1.5.0",
    "Test plugin: INT8 weight quantization, per row or per group",
    k_factories,
    sizeof k_factories / sizeof k_factories[0],
};

LOOM_EXPORT const loom_plugin_v1* loom_plugin_entry_v1(void) { return &k_plugin; }
