/* toy_metric: a loom.curriculum/1 metric written against the raw C ABI (no SDK), for the
 * analyzer's tests. Parameter `mode`:
 *  - "sum": score = the sum of the sample's tokens; no first pass;
 *  - "freq": stats = vocab_size token counts; score = (sum over the sample's tokens of
 *    count(token)) / tokens, so it depends on the whole dataset's counts;
 *  - "nan": as "sum", but NaN for a sample whose first token is 7;
 *  - "fail": score fails with an error;
 *  - "schedule": plans as a schedule (no METRIC role), so the analyzer must refuse it. */
#include <loom/abi.h>
#include <loom/kinds/curriculum.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct toy {
  const loom_host_services* host;
  int mode; /* 0 sum, 1 freq, 2 nan, 3 fail, 4 schedule */
} toy;

static const char* const k_modes[] = {"sum", "freq", "nan", "fail", "schedule", NULL};

static loom_status* fail(const toy* t, const char* msg) {
  return t->host->make_status(t->host->host_ctx, LOOM_ERR_INVALID_ARGUMENT, msg);
}

static loom_status* toy_create(const loom_host_services* host, void** out) {
  toy* t = calloc(1, sizeof *t);
  if (t == NULL) return host->make_status(host->host_ctx, LOOM_ERR_INTERNAL, "toy: no memory");
  t->host = host;
  const char* mode = host->params[0].value.string_value;
  for (int i = 0; k_modes[i] != NULL; ++i) {
    if (strcmp(mode, k_modes[i]) == 0) t->mode = i;
  }
  *out = t;
  return NULL;
}

static void toy_destroy(void* instance) { free(instance); }

static loom_status* toy_plan(void* instance, loom_curriculum_plan_args* a) {
  const toy* t = instance;
  a->roles = t->mode == 4 ? LOOM_CURRICULUM_SCHEDULE : LOOM_CURRICULUM_METRIC;
  a->seq_len_mode = LOOM_SEQ_LEN_NONE;
  a->stats_count = t->mode == 1 ? a->vocab_size : 0;
  return NULL;
}

static loom_status* check_samples(const toy* t, const loom_curriculum_samples* s) {
  if (s->tokens == NULL || s->offsets == NULL || s->tokens->dtype.code != kDLUInt ||
      s->tokens->dtype.bits != 16 || s->offsets->dtype.code != kDLInt ||
      s->offsets->dtype.bits != 64 || s->tokens->ndim != 1 || s->offsets->ndim != 1) {
    return fail(t, "toy: expected uint16 tokens and int64 offsets");
  }
  return NULL;
}

static loom_status* toy_count(void* instance, const loom_curriculum_count_args* a) {
  const toy* t = instance;
  loom_status* st = check_samples(t, &a->samples);
  if (st != NULL) return st;
  const uint16_t* tok = a->samples.tokens->data;
  const int64_t* off = a->samples.offsets->data;
  const int64_t n = a->samples.offsets->shape[0] - 1;
  int64_t* stats = a->stats->data;
  if (a->stats->shape[0] != (int64_t)a->vocab_size) return fail(t, "toy: stats size");
  for (int64_t i = off[0]; i < off[n]; ++i) stats[tok[i]] += 1;
  return NULL;
}

static loom_status* toy_score(void* instance, const loom_curriculum_score_args* a) {
  const toy* t = instance;
  loom_status* st = check_samples(t, &a->samples);
  if (st != NULL) return st;
  if (t->mode == 3) return fail(t, "toy: refused to score");
  const uint16_t* tok = a->samples.tokens->data;
  const int64_t* off = a->samples.offsets->data;
  const int64_t n = a->samples.offsets->shape[0] - 1;
  double* out = a->scores->data;
  if (a->scores->shape[0] != n) return fail(t, "toy: scores size");
  if (t->mode == 1 && a->stats == NULL) return fail(t, "toy: no stats");
  const int64_t* stats = t->mode == 1 ? a->stats->data : NULL;
  for (int64_t s = 0; s < n; ++s) {
    int64_t sum = 0;
    for (int64_t i = off[s]; i < off[s + 1]; ++i) sum += stats != NULL ? stats[tok[i]] : tok[i];
    out[s] = t->mode == 1 ? (double)sum / (double)(off[s + 1] - off[s]) : (double)sum;
    if (t->mode == 2 && off[s + 1] > off[s] && tok[off[s]] == 7) out[s] = NAN;
  }
  return NULL;
}

#define VALUE(type, i, f, s) \
  { LOOM_VALUE_SIZE, type, i, f, s, 0, NULL, NULL, NULL, NULL, NULL }

static const loom_param_spec k_specs[] = {
    {LOOM_PARAM_SPEC_SIZE, LOOM_PARAM_STRING, "mode", "What the metric computes.", 0, 0,
     VALUE(LOOM_PARAM_STRING, 0, 0.0, "sum"), -INFINITY, INFINITY, k_modes, NULL, 0, 0, 0, 0},
};

static const loom_curriculum_v1 k_vtable = {.struct_size = LOOM_CURRICULUM_V1_SIZE,
                                            .plan = toy_plan,
                                            .count = toy_count,
                                            .score = toy_score};

static const loom_factory k_factory = {.struct_size = LOOM_FACTORY_SIZE,
                                       .kind = LOOM_KIND_CURRICULUM,
                                       .param_specs = k_specs,
                                       .param_count = 1,
                                       .create = toy_create,
                                       .destroy = toy_destroy,
                                       .vtable = &k_vtable};

static const loom_factory* const k_factories[] = {&k_factory};

static const loom_plugin_v1 k_plugin = {LOOM_PLUGIN_V1_SIZE,
                                        LOOM_ABI_MAJOR,
                                        LOOM_ABI_MINOR,
                                        "toy_metric",
                                        "1.0.0",
                                        "Test metric for loom data analyze",
                                        k_factories,
                                        1};

LOOM_EXPORT const loom_plugin_v1* loom_plugin_entry_v1(void) { return &k_plugin; }
