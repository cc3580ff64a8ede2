/* minor1: a plugin as built against ABI 1.1, whose loom_factory ended at import_state (no
 * validate, create_with_args or import_state_with_args) and whose loom_param_spec ended at
 * ref_kind (no flags or exact int bounds). It declares those sizes; the host must read only
 * that prefix, walk the specs by their own struct_size, and call the positional create and
 * import_state. Its exported state is int32 creates, int32 imports (the step does nothing). */
#include <loom/abi.h>
#include <loom/kinds/optimizer.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The 1.1 structs, field for field the prefix of today's. */
typedef struct v11_param_spec {
  uint32_t struct_size;
  int32_t type;
  const char* name;
  const char* doc;
  int32_t required;
  int32_t list_length;
  loom_value default_value;
  double min;
  double max;
  const char* const* choices;
  const char* ref_kind;
} v11_param_spec;
#define V11_PARAM_SPEC_SIZE LOOM_STRUCT_SIZE(v11_param_spec, ref_kind)
LOOM_CHECK_STRUCT_SIZE(v11_param_spec, V11_PARAM_SPEC_SIZE);
LOOM_STATIC_ASSERT(V11_PARAM_SPEC_SIZE == LOOM_STRUCT_SIZE(loom_param_spec, ref_kind),
                   "the 1.1 spec must be today's prefix");
LOOM_STATIC_ASSERT(V11_PARAM_SPEC_SIZE < LOOM_PARAM_SPEC_SIZE, "the 1.1 spec must be smaller");

typedef struct v11_factory {
  uint32_t struct_size;
  uint32_t reserved;
  const char* kind;
  const v11_param_spec* param_specs;
  size_t param_count;
  loom_status* (*create)(const loom_host_services* host, void** out_instance);
  void (*destroy)(void* instance);
  const void* vtable;
  loom_status* (*export_state)(void* instance, const loom_state_writer* writer);
  loom_status* (*import_state)(void* instance, const void* data, size_t bytes);
} v11_factory;
#define V11_FACTORY_SIZE LOOM_STRUCT_SIZE(v11_factory, import_state)
LOOM_CHECK_STRUCT_SIZE(v11_factory, V11_FACTORY_SIZE);
LOOM_STATIC_ASSERT(V11_FACTORY_SIZE == LOOM_STRUCT_SIZE(loom_factory, import_state),
                   "the 1.1 factory must be today's prefix");

typedef struct minor1_state {
  int32_t creates;
  int32_t imports;
} minor1_state;

static loom_status* minor1_create(const loom_host_services* host, void** out) {
  if (host == NULL || out == NULL) return NULL;
  minor1_state* s = calloc(1, sizeof *s);
  if (s == NULL) return host->make_status(host->host_ctx, LOOM_ERR_RESOURCE_EXHAUSTED, "oom");
  s->creates = 1;
  *out = s;
  return NULL;
}

static void minor1_destroy(void* instance) { free(instance); }

static loom_status* minor1_step(void* instance, const loom_optimizer_step_args* args) {
  (void)instance;
  (void)args;
  return NULL;
}

static loom_status* minor1_export(void* instance, const loom_state_writer* w) {
  return w->write(w->ctx, instance, sizeof(minor1_state));
}

static void noop_destroy(loom_status* self) { (void)self; }

static loom_status* minor1_import(void* instance, const void* data, size_t bytes) {
  static loom_status bad = {LOOM_STATUS_SIZE, LOOM_ERR_DATA_LOSS, "minor1: state must be 8 bytes",
                            noop_destroy};
  if (bytes != sizeof(minor1_state) || data == NULL) return &bad;
  ++((minor1_state*)instance)->imports;
  return NULL;
}

static const char* const k_modes[] = {"fast", "exact", NULL};

static const v11_param_spec k_specs[] = {
    {V11_PARAM_SPEC_SIZE,
     LOOM_PARAM_FLOAT,
     "rate",
     "Inclusive [0, 1].",
     0,
     0,
     {LOOM_VALUE_SIZE, LOOM_PARAM_FLOAT, 0, 0.5, NULL, 0, NULL, NULL, NULL, NULL, NULL},
     0.0,
     1.0,
     NULL,
     NULL},
    {V11_PARAM_SPEC_SIZE,
     LOOM_PARAM_STRING,
     "mode",
     "One of fast, exact.",
     0,
     0,
     {LOOM_VALUE_SIZE, LOOM_PARAM_STRING, 0, 0.0, "fast", 0, NULL, NULL, NULL, NULL, NULL},
     -INFINITY,
     INFINITY,
     k_modes,
     NULL},
};

static const loom_optimizer_v1 k_vtable = {.struct_size = LOOM_OPTIMIZER_V1_SIZE,
                                           .step = minor1_step};

static const v11_factory k_factory = {V11_FACTORY_SIZE,
                                      0,
                                      LOOM_KIND_OPTIMIZER,
                                      k_specs,
                                      sizeof k_specs / sizeof k_specs[0],
                                      minor1_create,
                                      minor1_destroy,
                                      &k_vtable,
                                      minor1_export,
                                      minor1_import};

static const loom_factory* const k_factories[] = {(const loom_factory*)&k_factory};

static const loom_plugin_v1 k_plugin = {
    LOOM_PLUGIN_V1_SIZE,
    1,
    1,
    "minor1",
    "1.1.0",
    "Test plugin built with ABI 1.1's smaller factory and specs",
    k_factories,
    1};

LOOM_EXPORT const loom_plugin_v1* loom_plugin_entry_v1(void) { return &k_plugin; }
