/* kinds13: the two kinds of ABI 1.3 from plain C11 (no SDK), for the host's tests
 * (tests/host/kinds13_test.cpp).
 *
 * - loom.curriculum/1 "both halves": a metric (score = the sample's token count, no stats)
 *   and a schedule (difficulty rises linearly from `min_difficulty` at step 1 to
 *   `max_difficulty` at `total_steps`, then stays; seq_len_mode NONE).
 * - loom.sampler/1 with a REF `schedule` to a curriculum: global batch of step s is the ids
 *   ((s - 1) * B + j) mod N, j = 0 .. B - 1; rank r takes slots [r B / W, (r + 1) B / W);
 *   the difficulty is the schedule's at step s.
 *
 * Built twice: KINDS13_SHORT_TABLE makes "kinds13short", whose curriculum table is 8 bytes
 * short of LOOM_CURRICULUM_V1_MIN_SIZE, which the host refuses. */
#include <loom/abi.h>
#include <loom/kinds/curriculum.h>
#include <loom/kinds/sampler.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef KINDS13_SHORT_TABLE
#define KINDS13_NAME "kinds13short"
#define KINDS13_CURRICULUM_TABLE_SIZE (LOOM_CURRICULUM_V1_MIN_SIZE - 8)
#else
#define KINDS13_NAME "kinds13"
#define KINDS13_CURRICULUM_TABLE_SIZE LOOM_CURRICULUM_V1_SIZE
#endif

static const loom_param* find_param(const loom_host_services* host, const char* name) {
  if (host->param_count == 0 || host->params == NULL) return NULL;
  const uint32_t stride = host->params[0].struct_size;
  const unsigned char* base = (const unsigned char*)host->params;
  for (size_t i = 0; i < host->param_count; ++i) {
    const loom_param* p = (const loom_param*)(const void*)(base + i * stride);
    if (p->name != NULL && strcmp(p->name, name) == 0) return p;
  }
  return NULL;
}

static loom_status* fail(const loom_host_services* host, int32_t code, const char* message) {
  return host->make_status(host->host_ctx, code, message);
}

/* For a call without host services, which has no make_status to borrow. */
static void static_destroy(loom_status* self) { (void)self; }
static loom_status k_no_host = {LOOM_STATUS_SIZE, LOOM_ERR_INVALID_ARGUMENT,
                                "kinds13: no host services", static_destroy};

/* ---------------------------------------------------------------- curriculum */

typedef struct curriculum {
  const loom_host_services* host;
  double lo;
  double hi;
  int64_t total;
} curriculum;

static loom_status* cur_plan(void* instance, loom_curriculum_plan_args* args) {
  const curriculum* c = instance;
  if (args == NULL || args->struct_size < LOOM_CURRICULUM_PLAN_ARGS_SIZE) {
    return fail(c->host, LOOM_ERR_INVALID_ARGUMENT, "kinds13: plan args too short");
  }
  args->roles = LOOM_CURRICULUM_METRIC | LOOM_CURRICULUM_SCHEDULE;
  args->seq_len_mode = LOOM_SEQ_LEN_NONE;
  args->stats_count = 0;
  return NULL;
}

static loom_status* cur_score(void* instance, const loom_curriculum_score_args* args) {
  const curriculum* c = instance;
  if (args == NULL || args->struct_size < LOOM_CURRICULUM_SCORE_ARGS_SIZE ||
      args->samples.offsets == NULL || args->scores == NULL || args->samples.offsets->ndim != 1 ||
      args->scores->ndim != 1 || args->scores->shape[0] + 1 != args->samples.offsets->shape[0]) {
    return fail(c->host, LOOM_ERR_INVALID_ARGUMENT, "kinds13: bad score args");
  }
  const int64_t* off = (const int64_t*)args->samples.offsets->data;
  double* out = (double*)args->scores->data;
  for (int64_t i = 0; i < args->scores->shape[0]; ++i) out[i] = (double)(off[i + 1] - off[i]);
  return NULL;
}

static loom_status* cur_at(void* instance, loom_curriculum_at_args* args) {
  const curriculum* c = instance;
  if (args == NULL || args->struct_size < LOOM_CURRICULUM_AT_ARGS_SIZE || args->step < 1) {
    return fail(c->host, LOOM_ERR_INVALID_ARGUMENT, "kinds13: bad at args");
  }
  const int64_t s = args->step < c->total ? args->step : c->total;
  const double f = c->total > 1 ? (double)(s - 1) / (double)(c->total - 1) : 1.0;
  args->difficulty = c->lo + (c->hi - c->lo) * f;
  args->seq_len = 0;
  return NULL;
}

static loom_status* cur_create(const loom_host_services* host, void** out_instance) {
  if (host == NULL || out_instance == NULL || host->struct_size < LOOM_HOST_SERVICES_SIZE) {
    return host == NULL ? &k_no_host : fail(host, LOOM_ERR_ABI_MISMATCH, "kinds13: old host");
  }
  const loom_param* lo = find_param(host, "min_difficulty");
  const loom_param* hi = find_param(host, "max_difficulty");
  const loom_param* total = find_param(host, "total_steps");
  if (lo == NULL || hi == NULL || total == NULL) {
    return fail(host, LOOM_ERR_INVALID_ARGUMENT, "kinds13: incomplete parameters");
  }
  curriculum* c = calloc(1, sizeof *c);
  if (c == NULL) return fail(host, LOOM_ERR_RESOURCE_EXHAUSTED, "kinds13: out of memory");
  c->host = host;
  c->lo = lo->value.float_value;
  c->hi = hi->value.float_value;
  c->total = total->value.int_value;
  *out_instance = c;
  return NULL;
}

static void any_destroy(void* instance) { free(instance); }

static const loom_param_spec k_cur_specs[] = {
    {.struct_size = LOOM_PARAM_SPEC_SIZE,
     .type = LOOM_PARAM_FLOAT,
     .name = "min_difficulty",
     .doc = "Difficulty at step 1.",
     .default_value = {.struct_size = LOOM_VALUE_SIZE,
                       .type = LOOM_PARAM_FLOAT,
                       .float_value = 1.0},
     .min = -INFINITY,
     .max = INFINITY},
    {.struct_size = LOOM_PARAM_SPEC_SIZE,
     .type = LOOM_PARAM_FLOAT,
     .name = "max_difficulty",
     .doc = "Difficulty from total_steps on.",
     .default_value = {.struct_size = LOOM_VALUE_SIZE,
                       .type = LOOM_PARAM_FLOAT,
                       .float_value = 100.0},
     .min = -INFINITY,
     .max = INFINITY},
    {.struct_size = LOOM_PARAM_SPEC_SIZE,
     .type = LOOM_PARAM_INT,
     .name = "total_steps",
     .doc = "Steps the difficulty takes to rise.",
     .default_value = {.struct_size = LOOM_VALUE_SIZE, .type = LOOM_PARAM_INT, .int_value = 10},
     .min = 1,
     .max = 1e9},
};

static const loom_curriculum_v1 k_cur_table = {
    .struct_size = KINDS13_CURRICULUM_TABLE_SIZE,
    .plan = cur_plan,
    .count = NULL, /* a metric without a first pass */
    .score = cur_score,
    .at = cur_at,
};

static const loom_factory k_cur_factory = {
    .struct_size = LOOM_FACTORY_SIZE,
    .kind = LOOM_KIND_CURRICULUM,
    .param_specs = k_cur_specs,
    .param_count = sizeof k_cur_specs / sizeof k_cur_specs[0],
    .create = cur_create,
    .destroy = any_destroy,
    .vtable = &k_cur_table,
};

/* ---------------------------------------------------------------- sampler */

typedef struct sampler {
  const loom_host_services* host;
  void* schedule;
  const loom_curriculum_v1* schedule_table;
  uint64_t n;
  int64_t batch;
  int32_t world;
} sampler;

static loom_status* smp_plan(void* instance, loom_sampler_plan_args* args) {
  sampler* s = instance;
  if (args == NULL || args->struct_size < LOOM_SAMPLER_PLAN_ARGS_SIZE || args->dataset_size == 0 ||
      args->global_batch < 1 || args->world_size < 1) {
    return fail(s->host, LOOM_ERR_INVALID_ARGUMENT, "kinds13: bad sampler plan args");
  }
  s->n = args->dataset_size;
  s->batch = args->global_batch;
  s->world = args->world_size;
  args->capacity = (args->global_batch + args->world_size - 1) / args->world_size;
  return NULL;
}

static loom_status* smp_next(void* instance, loom_sampler_next_args* args) {
  sampler* s = instance;
  if (args == NULL || args->struct_size < LOOM_SAMPLER_NEXT_ARGS_SIZE || args->step < 1 ||
      args->world_size != s->world || args->rank < 0 || args->rank >= s->world ||
      args->indices == NULL || args->indices->ndim != 1) {
    return fail(s->host, LOOM_ERR_INVALID_ARGUMENT, "kinds13: bad sampler next args");
  }
  const int64_t lo = args->rank * s->batch / s->world;
  const int64_t hi = (args->rank + 1) * s->batch / s->world;
  if (args->indices->shape[0] < hi - lo) {
    return fail(s->host, LOOM_ERR_INVALID_ARGUMENT, "kinds13: indices below capacity");
  }
  loom_curriculum_at_args at = {LOOM_CURRICULUM_AT_ARGS_SIZE, 0, args->step, 0.0, 0};
  loom_status* st = s->schedule_table->at(s->schedule, &at);
  if (st != NULL) return st;
  int64_t* ids = (int64_t*)args->indices->data;
  for (int64_t j = lo; j < hi; ++j) {
    ids[j - lo] = (int64_t)((uint64_t)((args->step - 1) * s->batch + j) % s->n);
  }
  args->count = hi - lo;
  args->difficulty = at.difficulty;
  args->consumed = (uint64_t)(args->step * s->batch);
  args->epoch = (uint64_t)((args->step - 1) * s->batch) / s->n;
  return NULL;
}

static loom_status* smp_create(const loom_host_services* host, void** out_instance) {
  if (host == NULL || out_instance == NULL || host->struct_size < LOOM_HOST_SERVICES_SIZE) {
    return host == NULL ? &k_no_host : fail(host, LOOM_ERR_ABI_MISMATCH, "kinds13: old host");
  }
  const loom_param* ref = find_param(host, "schedule");
  if (ref == NULL || ref->value.ref_instance == NULL || ref->value.ref_vtable == NULL) {
    return fail(host, LOOM_ERR_FAILED_PRECONDITION,
                "kinds13: parameter 'schedule' names no curriculum");
  }
  const loom_curriculum_v1* t = ref->value.ref_vtable;
  if (t->struct_size < LOOM_CURRICULUM_V1_MIN_SIZE || t->at == NULL) {
    return fail(host, LOOM_ERR_INVALID_ARGUMENT, "kinds13: the schedule has no at");
  }
  sampler* s = calloc(1, sizeof *s);
  if (s == NULL) return fail(host, LOOM_ERR_RESOURCE_EXHAUSTED, "kinds13: out of memory");
  s->host = host;
  s->schedule = ref->value.ref_instance;
  s->schedule_table = t;
  s->n = 1;
  s->batch = 1;
  s->world = 1;
  *out_instance = s;
  return NULL;
}

static const loom_param_spec k_smp_specs[] = {
    {.struct_size = LOOM_PARAM_SPEC_SIZE,
     .type = LOOM_PARAM_REF,
     .name = "schedule",
     .doc = "The curriculum whose at() gives each step's difficulty.",
     .default_value = {.struct_size = LOOM_VALUE_SIZE, .type = LOOM_PARAM_REF},
     .min = -INFINITY,
     .max = INFINITY,
     .ref_kind = LOOM_KIND_CURRICULUM},
};

static const loom_sampler_v1 k_smp_table = {
    .struct_size = LOOM_SAMPLER_V1_SIZE,
    .plan = smp_plan,
    .next = smp_next,
};

static const loom_factory k_smp_factory = {
    .struct_size = LOOM_FACTORY_SIZE,
    .kind = LOOM_KIND_SAMPLER,
    .param_specs = k_smp_specs,
    .param_count = sizeof k_smp_specs / sizeof k_smp_specs[0],
    .create = smp_create,
    .destroy = any_destroy,
    .vtable = &k_smp_table,
};

/* ---------------------------------------------------------------- entry */

static const loom_factory* const k_factories[] = {&k_cur_factory, &k_smp_factory};

static const loom_plugin_v1 k_plugin = {
    LOOM_PLUGIN_V1_SIZE,
    LOOM_ABI_MAJOR,
    LOOM_ABI_MINOR,
    KINDS13_NAME,
    "1.3.0",
    "Test plugin: a curriculum (metric and schedule) and a sampler that REFs one",
    k_factories,
    sizeof k_factories / sizeof k_factories[0],
};

LOOM_EXPORT const loom_plugin_v1* loom_plugin_entry_v1(void) { return &k_plugin; }
