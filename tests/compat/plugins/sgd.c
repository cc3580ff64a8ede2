/* compatNN_sgd: SGD with momentum as a third party would have written it against an old
 * minor's ABI headers (tests/compat/abi_1_0 or abi_1_1), in plain C11, without the SDK.
 * Built once per era (COMPAT_NAME, COMPAT_MINOR); the 1.1 build also reads what 1.1 added
 * (loom_optimizer_tensor.exp_avg_mask, loom_optimizer_group.flags), the 1.0 build cannot.
 *
 * Per element, for every tensor of every group (fp32 CPU, contiguous):
 *   g  = grad / grad_scale                 (through the codec when `codec` is set:
 *                                           g = decode(encode(g)), one chunk)
 *   d  = g + wd * p                        (wd: the group's weight_decay, NaN = the param)
 *   m  = momentum * m + d                  (1.1: m *= exp_avg_mask when one is passed)
 *   p -= lr * lr_scale * (nesterov ? d + momentum * m : m)
 * computed in double, rounded to fp32 where m and p are stored. Exported state: the
 * momentum buffers and the step count (format below). */
#include <loom/abi.h>
#include <loom/kinds/codec.h>
#include <loom/kinds/optimizer.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "compat_common.h"

/* The headers really are the era's: today's would fail these. */
LOOM_STATIC_ASSERT(LOOM_ABI_MAJOR == 1 && LOOM_ABI_MINOR == COMPAT_MINOR,
                   "built against the wrong ABI headers");
#if COMPAT_MINOR == 0
LOOM_STATIC_ASSERT(LOOM_OPTIMIZER_TENSOR_SIZE == 32 && LOOM_OPTIMIZER_GROUP_SIZE == 40,
                   "ABI 1.0 optimizer structs");
#else
LOOM_STATIC_ASSERT(LOOM_OPTIMIZER_TENSOR_SIZE == 40 && LOOM_OPTIMIZER_GROUP_SIZE == 48,
                   "ABI 1.1 optimizer structs");
#endif
#if COMPAT_MINOR >= 2
LOOM_STATIC_ASSERT(LOOM_FACTORY_SIZE == LOOM_STRUCT_SIZE(loom_factory, import_state_with_args) &&
                       LOOM_PARAM_SPEC_SIZE == LOOM_STRUCT_SIZE(loom_param_spec, int_max),
                   "ABI 1.2 factory and parameter spec");
#endif

#define STATE_MAGIC "LCSG"
#define STATE_VERSION 1u

typedef struct sgd {
  const loom_host_services* host;
  double momentum;
  double weight_decay;
  int nesterov;
  void* codec; /* referenced codec instance, or NULL */
  const loom_codec_v1* codec_table;
  int64_t steps;
  size_t buffer_count; /* 0 until the first step or an import */
  int64_t* numels;
  float** buffers;
} sgd;

/* The instance's parameters as the host passed them (walked by struct_size). */
static const loom_param* find_param(const loom_host_services* host, const char* name) {
  if (host->param_count == 0 || host->params == NULL) return NULL;
  const uint32_t stride = host->params[0].struct_size;
  for (size_t i = 0; i < host->param_count; ++i) {
    const loom_param* p = compat_element(host->params, stride, i);
    if (p->name != NULL && strcmp(p->name, name) == 0) return p;
  }
  return NULL;
}

static void free_buffers(sgd* s) {
  for (size_t i = 0; i < s->buffer_count; ++i) free(s->buffers[i]);
  free(s->buffers);
  free(s->numels);
  s->buffers = NULL;
  s->numels = NULL;
  s->buffer_count = 0;
}

/* Fresh zeroed buffers for `count` tensors of the given sizes; 0 on failure. */
static int make_buffers(size_t count, const int64_t* numels, float*** out_buffers,
                        int64_t** out_numels) {
  float** buffers = calloc(count > 0 ? count : 1, sizeof *buffers);
  int64_t* sizes = calloc(count > 0 ? count : 1, sizeof *sizes);
  if (buffers == NULL || sizes == NULL) {
    free(buffers);
    free(sizes);
    return 0;
  }
  for (size_t i = 0; i < count; ++i) {
    sizes[i] = numels[i];
    buffers[i] = calloc(numels[i] > 0 ? (size_t)numels[i] : 1, sizeof(float));
    if (buffers[i] == NULL) {
      for (size_t j = 0; j < i; ++j) free(buffers[j]);
      free(buffers);
      free(sizes);
      return 0;
    }
  }
  *out_buffers = buffers;
  *out_numels = sizes;
  return 1;
}

static loom_status* sgd_create(const loom_host_services* host, void** out_instance) {
  if (host == NULL || out_instance == NULL) {
    return compat_fail(COMPAT_NAME, LOOM_ERR_INVALID_ARGUMENT, "create: NULL argument");
  }
  const loom_param* momentum = find_param(host, "momentum");
  const loom_param* wd = find_param(host, "weight_decay");
  const loom_param* update = find_param(host, "update");
  const loom_param* codec = find_param(host, "codec");
  if (momentum == NULL || wd == NULL || update == NULL || codec == NULL) {
    return compat_fail(COMPAT_NAME, LOOM_ERR_INVALID_ARGUMENT,
                       "create: the host passed %zu parameters, not momentum, weight_decay, "
                       "update and codec",
                       host->param_count);
  }
  sgd* s = calloc(1, sizeof *s);
  if (s == NULL) return compat_fail(COMPAT_NAME, LOOM_ERR_RESOURCE_EXHAUSTED, "out of memory");
  s->host = host;
  s->momentum = momentum->value.float_value;
  s->weight_decay = wd->value.float_value;
  s->nesterov =
      update->value.string_value != NULL && strcmp(update->value.string_value, "nesterov") == 0;
  if (codec->value.ref_instance != NULL) {
    /* It needs layout, encode and decode: what every minor's codec table has. */
    s->codec = codec->value.ref_instance;
    s->codec_table = codec->value.ref_vtable;
    if (s->codec_table == NULL ||
        s->codec_table->struct_size < LOOM_STRUCT_SIZE(loom_codec_v1, decode)) {
      free(s);
      return compat_fail(COMPAT_NAME, LOOM_ERR_INVALID_ARGUMENT,
                         "create: codec '%s' has no usable function table",
                         codec->value.string_value);
    }
  }
  if (host->log != NULL) {
    char line[160];
    snprintf(line, sizeof line, "%s (ABI 1.%d) created in a host that speaks ABI %u.%u",
             COMPAT_NAME, COMPAT_MINOR, (unsigned)host->abi_major, (unsigned)host->abi_minor);
    host->log(host->host_ctx, LOOM_LOG_DEBUG, line);
  }
  *out_instance = s;
  return NULL;
}

static void sgd_destroy(void* instance) {
  sgd* s = instance;
  if (s == NULL) return;
  free_buffers(s);
  free(s);
}

/* Sends n values through the codec (one chunk, no error feedback) into out. */
static loom_status* through_codec(sgd* s, const float* in, int64_t n, float* out) {
  loom_codec_layout layout;
  memset(&layout, 0, sizeof layout);
  layout.struct_size = LOOM_CODEC_LAYOUT_SIZE;
  layout.elements = (uint64_t)n;
  layout.world_size = 1;
  loom_status* st = s->codec_table->layout(s->codec, &layout);
  if (st != NULL) return st;
  const size_t padded = (size_t)layout.padded_elements;
  float* buf = s->host->host_alloc(s->host->host_ctx, (padded > 0 ? padded : 1) * sizeof(float), 0);
  float* dec = s->host->host_alloc(s->host->host_ctx, (padded > 0 ? padded : 1) * sizeof(float), 0);
  void* enc =
      s->host->host_alloc(s->host->host_ctx, layout.chunk_bytes > 0 ? layout.chunk_bytes : 1, 0);
  if (buf == NULL || dec == NULL || enc == NULL) {
    st = compat_fail(COMPAT_NAME, LOOM_ERR_RESOURCE_EXHAUSTED, "step: host_alloc failed");
  } else {
    memset(buf, 0, padded * sizeof(float));
    memcpy(buf, in, (size_t)n * sizeof(float));
    int64_t shape = (int64_t)padded;
    DLTensor tin;
    memset(&tin, 0, sizeof tin);
    tin.data = buf;
    tin.device.device_type = kDLCPU;
    tin.ndim = 1;
    tin.dtype.code = kDLFloat;
    tin.dtype.bits = 32;
    tin.dtype.lanes = 1;
    tin.shape = &shape;
    DLTensor tout = tin;
    tout.data = dec;
    loom_codec_encode_args ea;
    memset(&ea, 0, sizeof ea);
    ea.struct_size = LOOM_CODEC_ENCODE_ARGS_SIZE;
    ea.chunk_count = 1;
    ea.input = &tin;
    ea.output = enc;
    st = s->codec_table->encode(s->codec, &ea);
    if (st == NULL) {
      loom_codec_decode_args da;
      memset(&da, 0, sizeof da);
      da.struct_size = LOOM_CODEC_DECODE_ARGS_SIZE;
      da.chunk_count = 1;
      da.input = enc;
      da.output = &tout;
      da.alpha = 1.0f;
      st = s->codec_table->decode(s->codec, &da);
    }
    if (st == NULL) memcpy(out, dec, (size_t)n * sizeof(float));
  }
  s->host->host_free(s->host->host_ctx, buf);
  s->host->host_free(s->host->host_ctx, dec);
  s->host->host_free(s->host->host_ctx, enc);
  return st;
}

static loom_status* sgd_step(void* instance, const loom_optimizer_step_args* args) {
  sgd* s = instance;
  if (args == NULL || args->struct_size < LOOM_OPTIMIZER_STEP_ARGS_SIZE) {
    return compat_fail(COMPAT_NAME, LOOM_ERR_INVALID_ARGUMENT, "step: args missing or too small");
  }
  if (args->group_count > 0 && args->groups == NULL) {
    return compat_fail(COMPAT_NAME, LOOM_ERR_INVALID_ARGUMENT, "step: groups is NULL");
  }
  if (!(args->grad_scale > 0.0)) {
    return compat_fail(COMPAT_NAME, LOOM_ERR_INVALID_ARGUMENT, "step: grad_scale %g is not > 0",
                       args->grad_scale);
  }
  /* Check everything before changing anything. */
  const uint32_t gstride = args->group_count > 0 ? args->groups[0].struct_size : 0;
  if (args->group_count > 0 && gstride < LOOM_STRUCT_SIZE(loom_optimizer_group, weight_decay)) {
    return compat_fail(COMPAT_NAME, LOOM_ERR_INVALID_ARGUMENT,
                       "step: groups of %u bytes are too small", (unsigned)gstride);
  }
  size_t total = 0;
  for (size_t gi = 0; gi < args->group_count; ++gi) {
    const loom_optimizer_group* g = compat_element(args->groups, gstride, gi);
#if COMPAT_MINOR >= 1
    if (gstride >= LOOM_STRUCT_SIZE(loom_optimizer_group, flags) && g->flags != 0) {
      /* An optimizer refuses bits it does not know; NON_FREEZE means nothing to SGD. */
      return compat_fail(COMPAT_NAME, LOOM_ERR_INVALID_ARGUMENT,
                         "step: group %zu has flags 0x%x, which this optimizer does not support",
                         gi, (unsigned)g->flags);
    }
#endif
    if (g->tensor_count > 0 && g->tensors == NULL) {
      return compat_fail(COMPAT_NAME, LOOM_ERR_INVALID_ARGUMENT, "step: group %zu has no tensors",
                         gi);
    }
    const uint32_t tstride = g->tensor_count > 0 ? g->tensors[0].struct_size : 0;
    if (g->tensor_count > 0 && tstride < LOOM_STRUCT_SIZE(loom_optimizer_tensor, master)) {
      return compat_fail(COMPAT_NAME, LOOM_ERR_INVALID_ARGUMENT,
                         "step: group %zu has tensors of %u bytes, too small", gi,
                         (unsigned)tstride);
    }
    for (size_t ti = 0; ti < g->tensor_count; ++ti, ++total) {
      const loom_optimizer_tensor* t = compat_element(g->tensors, tstride, ti);
      if (!compat_is_f32_cpu(t->param) || !compat_is_f32_cpu(t->grad) || t->master != NULL ||
          compat_numel(t->param) != compat_numel(t->grad)) {
        return compat_fail(COMPAT_NAME, LOOM_ERR_INVALID_ARGUMENT,
                           "step: group %zu tensor %zu: param and grad must be contiguous fp32 "
                           "CPU tensors of the same size (no master copy)",
                           gi, ti);
      }
#if COMPAT_MINOR >= 1
      if (tstride >= LOOM_STRUCT_SIZE(loom_optimizer_tensor, exp_avg_mask) &&
          t->exp_avg_mask != NULL &&
          (!compat_is_f32_cpu(t->exp_avg_mask) ||
           compat_numel(t->exp_avg_mask) != compat_numel(t->param))) {
        return compat_fail(COMPAT_NAME, LOOM_ERR_INVALID_ARGUMENT,
                           "step: group %zu tensor %zu: exp_avg_mask must be fp32 CPU, the "
                           "param's size",
                           gi, ti);
      }
#endif
      if (s->buffer_count > 0 &&
          (total >= s->buffer_count || s->numels[total] != compat_numel(t->param))) {
        return compat_fail(COMPAT_NAME, LOOM_ERR_INVALID_ARGUMENT,
                           "step: group %zu tensor %zu does not match the tensors of earlier "
                           "steps (or of the imported state)",
                           gi, ti);
      }
    }
  }
  if (s->buffer_count > 0 && total != s->buffer_count) {
    return compat_fail(COMPAT_NAME, LOOM_ERR_INVALID_ARGUMENT,
                       "step: %zu tensors, but earlier steps (or the imported state) had %zu",
                       total, s->buffer_count);
  }
  if (s->buffer_count == 0 && total > 0) {
    int64_t* sizes = calloc(total, sizeof *sizes);
    if (sizes == NULL)
      return compat_fail(COMPAT_NAME, LOOM_ERR_RESOURCE_EXHAUSTED, "out of memory");
    size_t k = 0;
    for (size_t gi = 0; gi < args->group_count; ++gi) {
      const loom_optimizer_group* g = compat_element(args->groups, gstride, gi);
      const uint32_t tstride = g->tensor_count > 0 ? g->tensors[0].struct_size : 0;
      for (size_t ti = 0; ti < g->tensor_count; ++ti) {
        sizes[k++] = compat_numel(
            ((const loom_optimizer_tensor*)compat_element(g->tensors, tstride, ti))->param);
      }
    }
    float** buffers = NULL;
    int64_t* numels = NULL;
    const int ok = make_buffers(total, sizes, &buffers, &numels);
    free(sizes);
    if (!ok) return compat_fail(COMPAT_NAME, LOOM_ERR_RESOURCE_EXHAUSTED, "out of memory");
    s->buffers = buffers;
    s->numels = numels;
    s->buffer_count = total;
  }

  size_t k = 0;
  for (size_t gi = 0; gi < args->group_count; ++gi) {
    const loom_optimizer_group* g = compat_element(args->groups, gstride, gi);
    const double wd = isnan(g->weight_decay) ? s->weight_decay : g->weight_decay;
    const double lr = args->lr * g->lr_scale;
    const uint32_t tstride = g->tensor_count > 0 ? g->tensors[0].struct_size : 0;
    for (size_t ti = 0; ti < g->tensor_count; ++ti, ++k) {
      const loom_optimizer_tensor* t = compat_element(g->tensors, tstride, ti);
      const int64_t n = compat_numel(t->param);
      float* p = compat_f32(t->param);
      const float* gr = compat_f32(t->grad);
      const float* mask = NULL;
#if COMPAT_MINOR >= 1
      if (tstride >= LOOM_STRUCT_SIZE(loom_optimizer_tensor, exp_avg_mask) &&
          t->exp_avg_mask != NULL) {
        mask = compat_f32(t->exp_avg_mask);
      }
#endif
      float* scaled = malloc((n > 0 ? (size_t)n : 1) * sizeof(float));
      if (scaled == NULL)
        return compat_fail(COMPAT_NAME, LOOM_ERR_RESOURCE_EXHAUSTED, "out of memory");
      for (int64_t i = 0; i < n; ++i) scaled[i] = (float)((double)gr[i] / args->grad_scale);
      if (s->codec != NULL) {
        loom_status* st = through_codec(s, scaled, n, scaled);
        if (st != NULL) {
          free(scaled);
          return st;
        }
      }
      float* m = s->buffers[k];
      for (int64_t i = 0; i < n; ++i) {
        const double d = (double)scaled[i] + wd * (double)p[i];
        m[i] = (float)(s->momentum * (double)m[i] + d);
        if (mask != NULL) m[i] *= mask[i];
        const double upd = s->nesterov ? d + s->momentum * (double)m[i] : (double)m[i];
        p[i] = (float)((double)p[i] - lr * upd);
      }
      free(scaled);
    }
  }
  ++s->steps;
  return NULL;
}

/* State: "LCSG", u32 version, u32 the writer's ABI minor, i64 steps, u64 buffer count,
 * then per buffer u64 numel and numel fp32 values (host byte order). */
static loom_status* put(const loom_state_writer* w, const void* data, size_t bytes) {
  return w->write(w->ctx, data, bytes);
}

static loom_status* sgd_export(void* instance, const loom_state_writer* w) {
  const sgd* s = instance;
  if (w == NULL || w->struct_size < LOOM_STATE_WRITER_SIZE || w->write == NULL) {
    return compat_fail(COMPAT_NAME, LOOM_ERR_INVALID_ARGUMENT, "export_state: no writer");
  }
  const uint32_t version = STATE_VERSION;
  const uint32_t minor = COMPAT_MINOR;
  const uint64_t count = s->buffer_count;
  loom_status* st = put(w, STATE_MAGIC, 4);
  if (st == NULL) st = put(w, &version, sizeof version);
  if (st == NULL) st = put(w, &minor, sizeof minor);
  if (st == NULL) st = put(w, &s->steps, sizeof s->steps);
  if (st == NULL) st = put(w, &count, sizeof count);
  for (size_t i = 0; st == NULL && i < s->buffer_count; ++i) {
    const uint64_t n = (uint64_t)s->numels[i];
    st = put(w, &n, sizeof n);
    if (st == NULL) st = put(w, s->buffers[i], (size_t)n * sizeof(float));
  }
  return st;
}

static loom_status* sgd_import(void* instance, const void* data, size_t bytes) {
  sgd* s = instance;
  const unsigned char* b = data;
  const size_t header = 4 + 4 + 4 + 8 + 8;
  if (data == NULL || bytes < 4 || memcmp(b, STATE_MAGIC, 4) != 0) {
    return compat_fail(COMPAT_NAME, LOOM_ERR_INVALID_ARGUMENT,
                       "import_state: not a compat_sgd state (no " STATE_MAGIC " magic)");
  }
  if (bytes < header) {
    return compat_fail(COMPAT_NAME, LOOM_ERR_DATA_LOSS,
                       "import_state: %zu bytes, truncated inside the %zu-byte header", bytes,
                       header);
  }
  uint32_t version = 0;
  uint32_t minor = 0;
  int64_t steps = 0;
  uint64_t count = 0;
  memcpy(&version, b + 4, 4);
  memcpy(&minor, b + 8, 4);
  memcpy(&steps, b + 12, 8);
  memcpy(&count, b + 20, 8);
  if (version != STATE_VERSION) {
    return compat_fail(COMPAT_NAME, LOOM_ERR_INVALID_ARGUMENT,
                       "import_state: state version %u, this plugin reads version %u",
                       (unsigned)version, STATE_VERSION);
  }
  /* The builds that write this format are those of minors 0 to 6. */
  if (minor > 6 || steps < 0 || count > (bytes - header) / 8) {
    return compat_fail(COMPAT_NAME, LOOM_ERR_DATA_LOSS, "import_state: corrupt header");
  }
  /* Walk the sizes first, then copy: a bad blob leaves the instance as it was. */
  int64_t* sizes = calloc(count > 0 ? (size_t)count : 1, sizeof *sizes);
  if (sizes == NULL) return compat_fail(COMPAT_NAME, LOOM_ERR_RESOURCE_EXHAUSTED, "out of memory");
  size_t at = header;
  for (uint64_t i = 0; i < count; ++i) {
    uint64_t n = 0;
    if (bytes - at < 8) break;
    memcpy(&n, b + at, 8);
    at += 8;
    if (n > (bytes - at) / sizeof(float)) {
      at = bytes + 1;
      break;
    }
    sizes[i] = (int64_t)n;
    at += (size_t)n * sizeof(float);
  }
  if (at != bytes) {
    free(sizes);
    return compat_fail(COMPAT_NAME, LOOM_ERR_DATA_LOSS,
                       "import_state: %zu bytes do not hold the %llu buffers the header lists",
                       bytes, (unsigned long long)count);
  }
  float** buffers = NULL;
  int64_t* numels = NULL;
  if (!make_buffers((size_t)count, sizes, &buffers, &numels)) {
    free(sizes);
    return compat_fail(COMPAT_NAME, LOOM_ERR_RESOURCE_EXHAUSTED, "out of memory");
  }
  free(sizes);
  at = header;
  for (size_t i = 0; i < (size_t)count; ++i) {
    at += 8;
    memcpy(buffers[i], b + at, (size_t)numels[i] * sizeof(float));
    at += (size_t)numels[i] * sizeof(float);
  }
  free_buffers(s);
  s->buffers = buffers;
  s->numels = numels;
  s->buffer_count = (size_t)count;
  s->steps = steps;
  return NULL;
}

/* ------------------------------------------------------------------ descriptor */

static const char* const k_update_choices[] = {"plain", "nesterov", NULL};

static const loom_param_spec k_specs[] = {
    {LOOM_PARAM_SPEC_SIZE,
     LOOM_PARAM_FLOAT,
     "momentum",
     "Momentum factor.",
     0,
     0,
     {LOOM_VALUE_SIZE, LOOM_PARAM_FLOAT, 0, 0.9, NULL, 0, NULL, NULL, NULL, NULL, NULL},
     0.0,
     0.999,
     NULL,
     NULL COMPAT_SPEC_TAIL},
    {LOOM_PARAM_SPEC_SIZE,
     LOOM_PARAM_FLOAT,
     "weight_decay",
     "L2 penalty added to the gradient (a group's own value overrides it).",
     0,
     0,
     {LOOM_VALUE_SIZE, LOOM_PARAM_FLOAT, 0, 0.0, NULL, 0, NULL, NULL, NULL, NULL, NULL},
     0.0,
     1.0,
     NULL,
     NULL COMPAT_SPEC_TAIL},
    {LOOM_PARAM_SPEC_SIZE,
     LOOM_PARAM_STRING,
     "update",
     "plain or nesterov momentum.",
     0,
     0,
     {LOOM_VALUE_SIZE, LOOM_PARAM_STRING, 0, 0.0, "plain", 0, NULL, NULL, NULL, NULL, NULL},
     -INFINITY,
     INFINITY,
     k_update_choices,
     NULL COMPAT_SPEC_TAIL},
    {LOOM_PARAM_SPEC_SIZE,
     LOOM_PARAM_REF,
     "codec",
     "A codec every gradient goes through before the update (none by default).",
     0,
     0,
     {LOOM_VALUE_SIZE, LOOM_PARAM_REF, 0, 0.0, "", 0, NULL, NULL, NULL, NULL, NULL},
     -INFINITY,
     INFINITY,
     NULL,
     LOOM_KIND_CODEC COMPAT_SPEC_TAIL},
};
#define SPEC_COUNT (sizeof k_specs / sizeof k_specs[0])

#if COMPAT_MINOR >= 6
/* 1.6 added grads_ready: this optimizer starts nothing early. */
static const loom_optimizer_v1 k_table = {LOOM_OPTIMIZER_V1_SIZE, 0, sgd_step, NULL, NULL};
#else
static const loom_optimizer_v1 k_table = {LOOM_OPTIMIZER_V1_SIZE, 0, sgd_step, NULL};
#endif

LOOM_EXPORT const loom_plugin_v1* loom_plugin_entry_v1(void) {
  static const loom_plugin_v1* plugin = NULL;
  if (plugin != NULL) return plugin;
  /* Everything the host reads, each ending where an inaccessible page starts. */
  const loom_param_spec* specs = guarded_copy(k_specs, sizeof k_specs);
  const loom_optimizer_v1* table = guarded_copy(&k_table, LOOM_OPTIMIZER_V1_SIZE);
  if (specs == NULL || table == NULL) return NULL;
  const loom_factory factory = {LOOM_FACTORY_SIZE,   0,
                                LOOM_KIND_OPTIMIZER, specs,
                                SPEC_COUNT,          sgd_create,
                                sgd_destroy,         table,
                                sgd_export,          sgd_import COMPAT_FACTORY_TAIL};
  const loom_factory* f = guarded_copy(&factory, LOOM_FACTORY_SIZE);
  if (f == NULL) return NULL;
  const loom_factory* const* factories = guarded_copy(&f, sizeof f);
  if (factories == NULL) return NULL;
  const loom_plugin_v1 desc = {LOOM_PLUGIN_V1_SIZE,
                               1,
                               COMPAT_MINOR,
                               COMPAT_NAME,
                               "1." COMPAT_MINOR_TEXT ".0",
                               "SGD with momentum built from the ABI 1." COMPAT_MINOR_TEXT
                               " headers (compatibility tests)",
                               factories,
                               1};
  plugin = guarded_copy(&desc, LOOM_PLUGIN_V1_SIZE);
  return plugin;
}
