/* trainer_probe: a test-only plugin, written against the raw C ABI, with one factory of each
 * data-efficiency kind, so the trainer's curriculum path runs end to end without the real
 * plugins:
 *  - loom.curriculum/1: a sequence-length schedule, seq_len(step) = min_len + (max_len -
 *    min_len) * min(step, total_steps) / total_steps (integer division), difficulty the
 *    same. `mode` truncate | reshape gives its seq_len_mode; "none" makes it a schedule of a
 *    plain difficulty and "metric" a metric (for the trainer's role checks). Its state is
 *    the last step it was asked for, and `at` accepts only that step or the next one, so a
 *    resume that does not import the state fails.
 *  - loom.sampler/1: a fixed-order sampler: global slot g of the run (g = (step - 1) * B +
 *    j) is sample (g * P + seed) mod N with P coprime to N, so each pass over N slots sees
 *    every sample once; difficulty = difficulty_base + step. `expect_samples` >= 0 plays an
 *    index's sample count: plan refuses another dataset_size. Its state is (step, N, B, W). */
#include <loom/abi.h>
#include <loom/kinds/curriculum.h>
#include <loom/kinds/sampler.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const loom_param* find(const loom_param* params, size_t count, const char* name) {
  for (size_t i = 0; i < count; ++i) {
    if (strcmp(params[i].name, name) == 0) return &params[i];
  }
  return NULL;
}

static loom_status* fail(const loom_host_services* host, int32_t code, const char* msg) {
  return host->make_status(host->host_ctx, code, msg);
}

/* ------------------------------------------------------------------ the schedule */

typedef struct schedule {
  const loom_host_services* host;
  int mode; /* 0 truncate, 1 reshape, 2 none, 3 metric */
  int64_t min_len, max_len, total_steps;
  int64_t last_step;
} schedule;

static loom_status* schedule_create(const loom_host_services* host, void** out) {
  schedule* s = calloc(1, sizeof *s);
  if (s == NULL) return fail(host, LOOM_ERR_RESOURCE_EXHAUSTED, "trainer_probe: out of memory");
  s->host = host;
  const char* mode = find(host->params, host->param_count, "mode")->value.string_value;
  s->mode = strcmp(mode, "truncate") == 0  ? 0
            : strcmp(mode, "reshape") == 0 ? 1
            : strcmp(mode, "none") == 0    ? 2
                                           : 3;
  s->min_len = find(host->params, host->param_count, "min_len")->value.int_value;
  s->max_len = find(host->params, host->param_count, "max_len")->value.int_value;
  s->total_steps = find(host->params, host->param_count, "total_steps")->value.int_value;
  *out = s;
  return NULL;
}

static void schedule_destroy(void* instance) { free(instance); }

static loom_status* schedule_plan(void* instance, loom_curriculum_plan_args* args) {
  const schedule* s = instance;
  args->roles = s->mode == 3 ? LOOM_CURRICULUM_METRIC : LOOM_CURRICULUM_SCHEDULE;
  args->seq_len_mode = s->mode == 0   ? LOOM_SEQ_LEN_TRUNCATE
                       : s->mode == 1 ? LOOM_SEQ_LEN_RESHAPE
                                      : LOOM_SEQ_LEN_NONE;
  args->stats_count = 0;
  return NULL;
}

static loom_status* schedule_at(void* instance, loom_curriculum_at_args* args) {
  schedule* s = instance;
  if (args->step != s->last_step && args->step != s->last_step + 1) {
    char msg[160];
    snprintf(msg, sizeof msg, "trainer_probe: at(step %lld) after step %lld (state not imported?)",
             (long long)args->step, (long long)s->last_step);
    return fail(s->host, LOOM_ERR_FAILED_PRECONDITION, msg);
  }
  s->last_step = args->step;
  const int64_t k = args->step < s->total_steps ? args->step : s->total_steps;
  const int64_t len = s->min_len + (s->max_len - s->min_len) * k / s->total_steps;
  args->difficulty = (double)len;
  args->seq_len = s->mode <= 1 ? len : 0;
  return NULL;
}

static loom_status* schedule_export(void* instance, const loom_state_writer* w) {
  const schedule* s = instance;
  return w->write(w->ctx, &s->last_step, sizeof s->last_step);
}

static loom_status* schedule_import(void* instance, const void* data, size_t bytes) {
  schedule* s = instance;
  if (bytes != sizeof s->last_step || data == NULL) {
    return fail(s->host, LOOM_ERR_DATA_LOSS, "trainer_probe: a schedule state is 8 bytes");
  }
  memcpy(&s->last_step, data, sizeof s->last_step);
  return NULL;
}

static const char* const k_modes[] = {"truncate", "reshape", "none", "metric", NULL};

#define INT_SPEC(NAME, DEFAULT, LO, DOC)                                                        \
  {                                                                                             \
    LOOM_PARAM_SPEC_SIZE, LOOM_PARAM_INT, NAME, DOC, 0, 0,                                      \
        {LOOM_VALUE_SIZE, LOOM_PARAM_INT, DEFAULT, 0.0, NULL, 0, NULL, NULL, NULL, NULL, NULL}, \
        LO, 1e9, NULL, NULL, 0, 0, 0, 0                                                         \
  }

static const loom_param_spec k_schedule_specs[] = {
    {LOOM_PARAM_SPEC_SIZE,
     LOOM_PARAM_STRING,
     "mode",
     "truncate | reshape (a sequence-length schedule), none (a difficulty), metric.",
     0,
     0,
     {LOOM_VALUE_SIZE, LOOM_PARAM_STRING, 0, 0.0, "truncate", 0, NULL, NULL, NULL, NULL, NULL},
     -INFINITY,
     INFINITY,
     k_modes,
     NULL,
     0,
     0,
     0,
     0},
    INT_SPEC("min_len", 8, 1, "The length at step 0."),
    INT_SPEC("max_len", 64, 1, "The length from total_steps on."),
    INT_SPEC("total_steps", 10, 1, "The steps the length rises over."),
};

static const loom_curriculum_v1 k_schedule_vtable = {
    LOOM_CURRICULUM_V1_SIZE, 0, schedule_plan, NULL, NULL, schedule_at};

static const loom_factory k_schedule_factory = {
    LOOM_FACTORY_SIZE,
    0,
    LOOM_KIND_CURRICULUM,
    k_schedule_specs,
    sizeof k_schedule_specs / sizeof k_schedule_specs[0],
    schedule_create,
    schedule_destroy,
    &k_schedule_vtable,
    schedule_export,
    schedule_import,
    NULL,
    NULL,
    NULL};

/* ------------------------------------------------------------------ the sampler */

typedef struct sampler_state {
  int64_t step;
  uint64_t n;
  int64_t batch;
  int32_t world;
  int32_t pad;
} sampler_state;

typedef struct sampler {
  const loom_host_services* host;
  int64_t expect_samples;
  double difficulty_base;
  uint64_t prime;
  sampler_state st;
} sampler;

static uint64_t gcd(uint64_t a, uint64_t b) {
  while (b != 0) {
    const uint64_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}

static loom_status* sampler_create(const loom_host_services* host, void** out) {
  sampler* s = calloc(1, sizeof *s);
  if (s == NULL) return fail(host, LOOM_ERR_RESOURCE_EXHAUSTED, "trainer_probe: out of memory");
  s->host = host;
  s->expect_samples = find(host->params, host->param_count, "expect_samples")->value.int_value;
  s->difficulty_base = find(host->params, host->param_count, "difficulty_base")->value.float_value;
  *out = s;
  return NULL;
}

static void sampler_destroy(void* instance) { free(instance); }

static loom_status* sampler_plan(void* instance, loom_sampler_plan_args* args) {
  sampler* s = instance;
  if (s->expect_samples >= 0 && args->dataset_size != (uint64_t)s->expect_samples) {
    char msg[200];
    snprintf(msg, sizeof msg,
             "trainer_probe: the index has %lld samples, but dataset_size is %llu (another "
             "dataset or seq_len)",
             (long long)s->expect_samples, (unsigned long long)args->dataset_size);
    return fail(s->host, LOOM_ERR_INVALID_ARGUMENT, msg);
  }
  if (args->dataset_size == 0 || args->global_batch < 1 || args->world_size < 1) {
    return fail(s->host, LOOM_ERR_INVALID_ARGUMENT, "trainer_probe: empty plan");
  }
  s->st.step = 0;
  s->st.n = args->dataset_size;
  s->st.batch = args->global_batch;
  s->st.world = args->world_size;
  s->prime = 1000003;
  while (gcd(s->prime, s->st.n) != 1) s->prime += 2;
  args->capacity = (args->global_batch + args->world_size - 1) / args->world_size + 1;
  return NULL;
}

static loom_status* sampler_next(void* instance, loom_sampler_next_args* args) {
  sampler* s = instance;
  if (s->st.n == 0) return fail(s->host, LOOM_ERR_FAILED_PRECONDITION, "trainer_probe: no plan");
  if (args->step != s->st.step && args->step != s->st.step + 1) {
    char msg[160];
    snprintf(msg, sizeof msg, "trainer_probe: next(step %lld) after step %lld",
             (long long)args->step, (long long)s->st.step);
    return fail(s->host, LOOM_ERR_FAILED_PRECONDITION, msg);
  }
  s->st.step = args->step;
  const int64_t b = s->st.batch, w = s->st.world;
  const int64_t lo = (args->rank * b + w / 2) / w, hi = ((args->rank + 1) * b + w / 2) / w;
  int64_t* ids = args->indices->data;
  for (int64_t j = lo; j < hi; ++j) {
    const uint64_t g = (uint64_t)(args->step - 1) * (uint64_t)b + (uint64_t)j;
    ids[j - lo] = (int64_t)(((g % s->st.n) * (s->prime % s->st.n) + args->seed) % s->st.n);
  }
  args->count = hi - lo;
  args->difficulty = s->difficulty_base + (double)args->step;
  args->epoch = (uint64_t)(args->step - 1) * (uint64_t)b / s->st.n;
  args->consumed = (uint64_t)args->step * (uint64_t)b;
  return NULL;
}

static loom_status* sampler_export(void* instance, const loom_state_writer* w) {
  const sampler* s = instance;
  return w->write(w->ctx, &s->st, sizeof s->st);
}

static loom_status* sampler_import(void* instance, const void* data, size_t bytes) {
  sampler* s = instance;
  sampler_state st;
  if (bytes != sizeof st || data == NULL) {
    return fail(s->host, LOOM_ERR_DATA_LOSS, "trainer_probe: a sampler state is 32 bytes");
  }
  memcpy(&st, data, sizeof st);
  if (st.n != s->st.n || st.batch != s->st.batch || st.world != s->st.world) {
    return fail(s->host, LOOM_ERR_INVALID_ARGUMENT,
                "trainer_probe: the state was planned for another dataset, batch or world");
  }
  s->st = st;
  return NULL;
}

static const loom_param_spec k_sampler_specs[] = {
    INT_SPEC("expect_samples", -1, -1, "The index's sample count (-1: accept any)."),
    {LOOM_PARAM_SPEC_SIZE,
     LOOM_PARAM_FLOAT,
     "difficulty_base",
     "The difficulty of step 0.",
     0,
     0,
     {LOOM_VALUE_SIZE, LOOM_PARAM_FLOAT, 0, 100.0, NULL, 0, NULL, NULL, NULL, NULL, NULL},
     -1e9,
     1e9,
     NULL,
     NULL,
     0,
     0,
     0,
     0},
};

static const loom_sampler_v1 k_sampler_vtable = {LOOM_SAMPLER_V1_SIZE, 0, sampler_plan,
                                                 sampler_next};

static const loom_factory k_sampler_factory = {LOOM_FACTORY_SIZE,
                                               0,
                                               LOOM_KIND_SAMPLER,
                                               k_sampler_specs,
                                               sizeof k_sampler_specs / sizeof k_sampler_specs[0],
                                               sampler_create,
                                               sampler_destroy,
                                               &k_sampler_vtable,
                                               sampler_export,
                                               sampler_import,
                                               NULL,
                                               NULL,
                                               NULL};

static const loom_factory* const k_factories[] = {&k_schedule_factory, &k_sampler_factory};

static const loom_plugin_v1 k_plugin = {LOOM_PLUGIN_V1_SIZE,
                                        LOOM_ABI_MAJOR,
                                        LOOM_ABI_MINOR,
                                        "trainer_probe",
                                        "1.0.0",
                                        "Test plugin: a sequence-length schedule and a sampler",
                                        k_factories,
                                        2};

LOOM_EXPORT const loom_plugin_v1* loom_plugin_entry_v1(void) { return &k_plugin; }
