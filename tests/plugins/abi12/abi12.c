/* abi12: a raw C optimizer built against ABI 1.2 that uses what 1.2 added to the core:
 *  - parameter specs with exclusive bounds and exact int64 ranges (loom_param_spec.flags,
 *    int_min, int_max);
 *  - a cross-parameter check (loom_factory.validate) that blames one key through bad_param:
 *    `low` must be below `high` (blamed: high); `mode` "blame_instance" fails blaming no key,
 *    "blame_outside" blames an index past the parameters (the host falls back to the table);
 *  - both create entries and both import_state entries. Its exported state says which were
 *    used: int32 created_with (1 create, 2 create_with_args), imports through import_state,
 *    imports through import_state_with_args, params the validate hook last saw.
 * The step does nothing. */
#include <loom/abi.h>
#include <loom/kinds/optimizer.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct abi12_state {
  int32_t created_with;
  int32_t imports_old;
  int32_t imports_args;
  int32_t validated_count;
} abi12_state;

/* How many parameters the last validate call saw (the host passes them all, defaults too). */
static int32_t g_validated_count = -1;

static loom_status* fail(const loom_host_services* host, const char* msg) {
  return host->make_status(host->host_ctx, LOOM_ERR_INVALID_ARGUMENT, msg);
}

static const loom_param* find(const loom_param* params, size_t count, const char* name) {
  for (size_t i = 0; i < count; ++i) {
    if (strcmp(params[i].name, name) == 0) return &params[i];
  }
  return NULL;
}

static loom_status* make(const loom_host_services* host, void** out, int32_t how) {
  if (host == NULL || out == NULL) return NULL;
  abi12_state* s = calloc(1, sizeof *s);
  if (s == NULL) return fail(host, "abi12: out of memory");
  s->created_with = how;
  s->validated_count = g_validated_count;
  *out = s;
  return NULL;
}

static loom_status* abi12_create(const loom_host_services* host, void** out) {
  return make(host, out, 1);
}

static loom_status* abi12_create_with_args(const loom_create_args* args, void** out) {
  if (args == NULL || args->struct_size < LOOM_STRUCT_SIZE(loom_create_args, host)) return NULL;
  return make(args->host, out, 2);
}

static void abi12_destroy(void* instance) { free(instance); }

static loom_status* abi12_step(void* instance, const loom_optimizer_step_args* args) {
  (void)instance;
  (void)args;
  return NULL;
}

static loom_status* abi12_export(void* instance, const loom_state_writer* w) {
  return w->write(w->ctx, instance, sizeof(abi12_state));
}

static void noop_destroy(loom_status* self) { (void)self; }

static loom_status* import(void* instance, const void* data, size_t bytes, int args) {
  abi12_state* s = instance;
  if (bytes != sizeof(abi12_state) || data == NULL) {
    /* No host services here: a static status whose destroy does nothing. */
    static loom_status bad = {LOOM_STATUS_SIZE, LOOM_ERR_DATA_LOSS, "abi12: state must be 16 bytes",
                              noop_destroy};
    return &bad;
  }
  if (args) {
    ++s->imports_args;
  } else {
    ++s->imports_old;
  }
  return NULL;
}

static loom_status* abi12_import(void* instance, const void* data, size_t bytes) {
  return import(instance, data, bytes, 0);
}

static loom_status* abi12_import_with_args(void* instance, const loom_import_state_args* a) {
  return import(instance, a->data, a->bytes, 1);
}

static loom_status* abi12_validate(loom_validate_args* a) {
  g_validated_count = (int32_t)a->param_count;
  const loom_param* low = find(a->params, a->param_count, "low");
  const loom_param* high = find(a->params, a->param_count, "high");
  const loom_param* mode = find(a->params, a->param_count, "mode");
  if (low == NULL || high == NULL || mode == NULL) {
    return a->make_status(a->host_ctx, LOOM_ERR_INTERNAL, "abi12: parameters missing");
  }
  if (strcmp(mode->value.string_value, "blame_instance") == 0) {
    return a->make_status(a->host_ctx, LOOM_ERR_INVALID_ARGUMENT, "abi12: refused as a whole");
  }
  if (strcmp(mode->value.string_value, "blame_outside") == 0) {
    a->bad_param = 99;
    return a->make_status(a->host_ctx, LOOM_ERR_INVALID_ARGUMENT, "abi12: blames no real key");
  }
  if (low->value.int_value >= high->value.int_value) {
    a->bad_param = (int32_t)(high - a->params);
    return a->make_status(a->host_ctx, LOOM_ERR_INVALID_ARGUMENT, "must be greater than low");
  }
  return NULL;
}

static const char* const k_modes[] = {"ok", "blame_instance", "blame_outside", NULL};

#define VALUE(type, i, f, s) \
  { LOOM_VALUE_SIZE, type, i, f, s, 0, NULL, NULL, NULL, NULL, NULL }

static const loom_param_spec k_specs[] = {
    {LOOM_PARAM_SPEC_SIZE, LOOM_PARAM_FLOAT, "gain", "Strictly positive.", 0, 0,
     VALUE(LOOM_PARAM_FLOAT, 0, 1.0, NULL), 0.0, INFINITY, NULL, NULL, LOOM_PARAM_MIN_EXCLUSIVE, 0,
     0, 0},
    {LOOM_PARAM_SPEC_SIZE, LOOM_PARAM_FLOAT, "ratio", "Strictly between 0 and 1.", 0, 0,
     VALUE(LOOM_PARAM_FLOAT, 0, 0.5, NULL), 0.0, 1.0, NULL, NULL,
     LOOM_PARAM_MIN_EXCLUSIVE | LOOM_PARAM_MAX_EXCLUSIVE, 0, 0, 0},
    /* [0, 2^53 + 1]: 2^53 + 1 has no double, so only exact bounds can say it. */
    {LOOM_PARAM_SPEC_SIZE, LOOM_PARAM_INT, "seed", "Exact int64 bounds.", 0, 0,
     VALUE(LOOM_PARAM_INT, 0, 0.0, NULL), 0.0, 9007199254740994.0, NULL, NULL, LOOM_PARAM_INT_RANGE,
     0, 0, 9007199254740993LL},
    /* Each element > -2^53 - 1, no upper bound. */
    {LOOM_PARAM_SPEC_SIZE, LOOM_PARAM_INT_LIST, "offsets", "Elements > -(2^53 + 1).", 0, 0,
     VALUE(LOOM_PARAM_INT_LIST, 0, 0.0, NULL), -9007199254740994.0, INFINITY, NULL, NULL,
     LOOM_PARAM_INT_RANGE | LOOM_PARAM_MIN_EXCLUSIVE, 0, -9007199254740993LL, INT64_MAX},
    {LOOM_PARAM_SPEC_SIZE, LOOM_PARAM_INT, "low", "Must be below high.", 0, 0,
     VALUE(LOOM_PARAM_INT, 0, 0.0, NULL), -1e6, 1e6, NULL, NULL, 0, 0, 0, 0},
    {LOOM_PARAM_SPEC_SIZE, LOOM_PARAM_INT, "high", "Must be above low.", 0, 0,
     VALUE(LOOM_PARAM_INT, 10, 0.0, NULL), -1e6, 1e6, NULL, NULL, 0, 0, 0, 0},
    {LOOM_PARAM_SPEC_SIZE, LOOM_PARAM_STRING, "mode", "What validate does.", 0, 0,
     VALUE(LOOM_PARAM_STRING, 0, 0.0, "ok"), -INFINITY, INFINITY, k_modes, NULL, 0, 0, 0, 0},
};

static const loom_optimizer_v1 k_vtable = {.struct_size = LOOM_OPTIMIZER_V1_SIZE,
                                           .step = abi12_step};

static const loom_factory k_factory = {.struct_size = LOOM_FACTORY_SIZE,
                                       .kind = LOOM_KIND_OPTIMIZER,
                                       .param_specs = k_specs,
                                       .param_count = sizeof k_specs / sizeof k_specs[0],
                                       .create = abi12_create,
                                       .destroy = abi12_destroy,
                                       .vtable = &k_vtable,
                                       .export_state = abi12_export,
                                       .import_state = abi12_import,
                                       .validate = abi12_validate,
                                       .create_with_args = abi12_create_with_args,
                                       .import_state_with_args = abi12_import_with_args};

static const loom_factory* const k_factories[] = {&k_factory};

static const loom_plugin_v1 k_plugin = {LOOM_PLUGIN_V1_SIZE,
                                        LOOM_ABI_MAJOR,
                                        LOOM_ABI_MINOR,
                                        "abi12",
                                        "1.2.0",
                                        "Test plugin using the ABI 1.2 core",
                                        k_factories,
                                        1};

LOOM_EXPORT const loom_plugin_v1* loom_plugin_entry_v1(void) { return &k_plugin; }
