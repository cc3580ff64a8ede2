/* oldminor: a plugin built against an older minor of ABI 1, whose loom_factory ended at
 * `vtable` (no export_state/import_state) and whose loom_param_spec ended at `max` (no
 * choices/ref_kind), and whose optimizer table ended at `step` (no comm_info). It declares
 * those smaller sizes; the host must read only that prefix, with the spec array's stride
 * taken from the specs' own struct_size. Plain SGD: p -= lr * lr_scale * scale * g. */
#include <loom/abi.h>
#include <loom/kinds/optimizer.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The older minor's structs, field for field the prefix of today's. */
typedef struct old_param_spec {
  uint32_t struct_size;
  int32_t type;
  const char* name;
  const char* doc;
  int32_t required;
  int32_t list_length;
  loom_value default_value;
  double min;
  double max;
} old_param_spec;
#define OLD_PARAM_SPEC_SIZE LOOM_STRUCT_SIZE(old_param_spec, max)
LOOM_CHECK_STRUCT_SIZE(old_param_spec, OLD_PARAM_SPEC_SIZE);
LOOM_STATIC_ASSERT(OLD_PARAM_SPEC_SIZE < LOOM_PARAM_SPEC_SIZE, "old spec must be smaller");
LOOM_STATIC_ASSERT(OLD_PARAM_SPEC_SIZE == LOOM_STRUCT_SIZE(loom_param_spec, max),
                   "old spec must be today's prefix");

typedef struct old_factory {
  uint32_t struct_size;
  uint32_t reserved;
  const char* kind;
  const old_param_spec* param_specs;
  size_t param_count;
  loom_status* (*create)(const loom_host_services* host, void** out_instance);
  void (*destroy)(void* instance);
  const void* vtable;
} old_factory;
#define OLD_FACTORY_SIZE LOOM_STRUCT_SIZE(old_factory, vtable)
LOOM_CHECK_STRUCT_SIZE(old_factory, OLD_FACTORY_SIZE);
LOOM_STATIC_ASSERT(OLD_FACTORY_SIZE == LOOM_STRUCT_SIZE(loom_factory, vtable),
                   "old factory must be today's prefix");

typedef struct old_optimizer_v1 {
  uint32_t struct_size;
  uint32_t reserved;
  loom_status* (*step)(void* instance, const loom_optimizer_step_args* args);
} old_optimizer_v1;
#define OLD_OPTIMIZER_V1_SIZE LOOM_STRUCT_SIZE(old_optimizer_v1, step)

typedef struct old_optimizer {
  double scale;
  int64_t steps;
} old_optimizer;

static loom_status* old_fail(const loom_host_services* host, int32_t code, const char* msg) {
  /* This plugin has no allocator of its own: it borrows the host's. */
  return host->make_status(host->host_ctx, code, msg);
}

static loom_status* old_create(const loom_host_services* host, void** out_instance) {
  if (host == NULL || out_instance == NULL) return NULL;
  double scale = 1.0;
  int found = 0;
  for (size_t i = 0; i < host->param_count; ++i) {
    if (strcmp(host->params[i].name, "scale") == 0) {
      scale = host->params[i].value.float_value;
      found = 1;
    }
  }
  if (!found || host->param_count != 2) {
    return old_fail(host, LOOM_ERR_INVALID_ARGUMENT, "oldminor: expected parameters scale, note");
  }
  old_optimizer* o = calloc(1, sizeof *o);
  if (o == NULL) return old_fail(host, LOOM_ERR_RESOURCE_EXHAUSTED, "oldminor: out of memory");
  o->scale = scale;
  *out_instance = o;
  return NULL;
}

static void old_destroy(void* instance) { free(instance); }

static loom_status* old_step(void* instance, const loom_optimizer_step_args* args) {
  old_optimizer* o = instance;
  for (size_t gi = 0; gi < args->group_count; ++gi) {
    const loom_optimizer_group* g = &args->groups[gi];
    for (size_t ti = 0; ti < g->tensor_count; ++ti) {
      const DLTensor* pt = g->tensors[ti].param;
      const DLTensor* gt = g->tensors[ti].grad;
      int64_t n = 1;
      for (int32_t d = 0; d < pt->ndim; ++d) n *= pt->shape[d];
      float* p = (float*)((char*)pt->data + pt->byte_offset);
      const float* gr = (const float*)((const char*)gt->data + gt->byte_offset);
      for (int64_t i = 0; i < n; ++i) {
        p[i] = (float)((double)p[i] -
                       args->lr * g->lr_scale * o->scale * (double)gr[i] / args->grad_scale);
      }
    }
  }
  ++o->steps;
  return NULL;
}

static const old_param_spec k_specs[] = {
    {OLD_PARAM_SPEC_SIZE,
     LOOM_PARAM_FLOAT,
     "scale",
     "Multiplies every update.",
     0,
     0,
     {LOOM_VALUE_SIZE, LOOM_PARAM_FLOAT, 0, 1.0, NULL, 0, NULL, NULL, NULL, NULL, NULL},
     0.0,
     10.0},
    {OLD_PARAM_SPEC_SIZE,
     LOOM_PARAM_STRING,
     "note",
     "A free-form note.",
     0,
     0,
     {LOOM_VALUE_SIZE, LOOM_PARAM_STRING, 0, 0.0, "none", 0, NULL, NULL, NULL, NULL, NULL},
     -INFINITY,
     INFINITY},
};

static const old_optimizer_v1 k_vtable = {OLD_OPTIMIZER_V1_SIZE, 0, old_step};

static const old_factory k_factory = {OLD_FACTORY_SIZE,
                                      0,
                                      LOOM_KIND_OPTIMIZER,
                                      k_specs,
                                      sizeof k_specs / sizeof k_specs[0],
                                      old_create,
                                      old_destroy,
                                      &k_vtable};

static const loom_factory* const k_factories[] = {(const loom_factory*)&k_factory};

static const loom_plugin_v1 k_plugin = {
    LOOM_PLUGIN_V1_SIZE, 1,       0,
    "oldminor",          "0.9.0", "Test plugin built with an older minor's smaller structs",
    k_factories,         1};

LOOM_EXPORT const loom_plugin_v1* loom_plugin_entry_v1(void) { return &k_plugin; }
