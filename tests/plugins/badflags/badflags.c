/* badflags: a plugin whose parameter spec sets a flag bit no ABI minor up to 1.2 defines (as
 * one built against a later minor might). The host must refuse to load it, naming the
 * parameter, rather than ignore a bound it does not understand. */
#include <loom/abi.h>
#include <loom/kinds/optimizer.h>

#include <math.h>
#include <stddef.h>

static loom_status* bad_create(const loom_host_services* host, void** out) {
  (void)host;
  (void)out;
  return NULL;
}

static void bad_destroy(void* instance) { (void)instance; }

static loom_status* bad_step(void* instance, const loom_optimizer_step_args* args) {
  (void)instance;
  (void)args;
  return NULL;
}

static const loom_param_spec k_specs[] = {
    {LOOM_PARAM_SPEC_SIZE,
     LOOM_PARAM_FLOAT,
     "gain",
     "A bound this host cannot read.",
     0,
     0,
     {LOOM_VALUE_SIZE, LOOM_PARAM_FLOAT, 0, 1.0, NULL, 0, NULL, NULL, NULL, NULL, NULL},
     0.0,
     INFINITY,
     NULL,
     NULL,
     LOOM_PARAM_MIN_EXCLUSIVE | (1u << 7),
     0,
     0,
     0},
};

static const loom_optimizer_v1 k_vtable = {.struct_size = LOOM_OPTIMIZER_V1_SIZE, .step = bad_step};

static const loom_factory k_factory = {.struct_size = LOOM_FACTORY_SIZE,
                                       .kind = LOOM_KIND_OPTIMIZER,
                                       .param_specs = k_specs,
                                       .param_count = 1,
                                       .create = bad_create,
                                       .destroy = bad_destroy,
                                       .vtable = &k_vtable};

static const loom_factory* const k_factories[] = {&k_factory};

static const loom_plugin_v1 k_plugin = {LOOM_PLUGIN_V1_SIZE,
                                        LOOM_ABI_MAJOR,
                                        LOOM_ABI_MINOR,
                                        "badflags",
                                        "0.0.1",
                                        "Test plugin with an unknown spec flag",
                                        k_factories,
                                        1};

LOOM_EXPORT const loom_plugin_v1* loom_plugin_entry_v1(void) { return &k_plugin; }
