/* The template's plugins do what sdk/template_metric/README.md says: distinct_tokens is a
 * metric (roles METRIC, no count, no at, no stats) whose score is the fraction of distinct
 * non-pad tokens, refusing a token outside the vocabulary; cosine_schedule is a schedule
 * (roles SCHEDULE, no score) that rises from min to max along half a cosine, in multiples of
 * difficulty_step, never below min, and stays at max. `loom check` of a max below min fails
 * at the max_difficulty key (checked by sdk_templates.sh, not here).
 *
 * Usage: curriculum_check PLUGIN_DIR   (the folder holding both .so files) */
#include <loom/embed.h>
#include <loom/kinds/curriculum.h>

#include <math.h>
#include <stdio.h>
#include <string.h>

static int failures = 0;

#define EXPECT(cond, ...)                          \
  do {                                             \
    if (!(cond)) {                                 \
      fprintf(stderr, "curriculum_check: FAIL: "); \
      fprintf(stderr, __VA_ARGS__);                \
      fprintf(stderr, " (line %d)\n", __LINE__);   \
      ++failures;                                  \
    }                                              \
  } while (0)

/* The status's code (0 for NULL), destroying it. */
static int code_of(loom_status* st) {
  if (st == NULL) return 0;
  const int code = st->code;
  st->destroy(st);
  return code;
}

static DLTensor vec(void* data, uint8_t code, uint8_t bits, int64_t* shape) {
  DLTensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.device.device_type = kDLCPU;
  t.ndim = 1;
  t.dtype.code = code;
  t.dtype.bits = bits;
  t.dtype.lanes = 1;
  t.shape = shape;
  return t;
}

static const loom_curriculum_v1* table_of(loom_session* s, const char* name, void** obj) {
  loom_instance* inst = NULL;
  const void* table = NULL;
  if (loom_find_instance(s, "curriculum", name, &inst) != LOOM_OK ||
      loom_instance_table(inst, LOOM_KIND_CURRICULUM, LOOM_CURRICULUM_V1_MIN_SIZE, obj, &table) !=
          LOOM_OK) {
    fprintf(stderr, "curriculum_check: %s\n", loom_last_error());
    return NULL;
  }
  return table;
}

static loom_curriculum_plan_args plan_of(const loom_curriculum_v1* t, void* obj) {
  loom_curriculum_plan_args p;
  memset(&p, 0, sizeof p);
  p.struct_size = LOOM_CURRICULUM_PLAN_ARGS_SIZE;
  p.vocab_size = 16;
  EXPECT(code_of(t->plan(obj, &p)) == 0, "plan failed");
  return p;
}

static double at(const loom_curriculum_v1* t, void* obj, int64_t step) {
  loom_curriculum_at_args a;
  memset(&a, 0, sizeof a);
  a.struct_size = LOOM_CURRICULUM_AT_ARGS_SIZE;
  a.step = step;
  EXPECT(code_of(t->at(obj, &a)) == 0, "at(%lld) failed", (long long)step);
  EXPECT(a.seq_len == 0, "at(%lld): seq_len %lld", (long long)step, (long long)a.seq_len);
  return a.difficulty;
}

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: curriculum_check PLUGIN_DIR\n");
    return 2;
  }
  loom_open_options opts;
  memset(&opts, 0, sizeof opts);
  opts.struct_size = LOOM_OPEN_OPTIONS_SIZE;
  opts.plugin_path = argv[1];
  opts.log_level = -1;
  loom_session* s = NULL;
  if (loom_open_string("[curriculum.d]\nplugin = \"distinct_tokens\"\npad_token = 0\n"
                       "[curriculum.c]\nplugin = \"cosine_schedule\"\nmin_difficulty = 10\n"
                       "max_difficulty = 100\ntotal_curriculum_step = 2000\n"
                       "difficulty_step = 5\n"
                       "[curriculum.c2]\nplugin = \"cosine_schedule\"\nmin_difficulty = 10\n"
                       "max_difficulty = 103\ntotal_curriculum_step = 2000\n"
                       "difficulty_step = 5\n",
                       "check.toml", &opts, &s) != LOOM_OK) {
    fprintf(stderr, "curriculum_check: %s\n", loom_last_error());
    return 1;
  }
  void* dobj = NULL;
  void* cobj = NULL;
  const loom_curriculum_v1* d = table_of(s, "d", &dobj);
  void* c2obj = NULL;
  const loom_curriculum_v1* c = table_of(s, "c", &cobj);
  const loom_curriculum_v1* c2 = table_of(s, "c2", &c2obj);
  if (d == NULL || c == NULL || c2 == NULL) return 1;

  /* The metric. */
  const loom_curriculum_plan_args dp = plan_of(d, dobj);
  EXPECT(dp.roles == LOOM_CURRICULUM_METRIC, "distinct_tokens roles %u", dp.roles);
  EXPECT(dp.stats_count == 0 && dp.seq_len_mode == LOOM_SEQ_LEN_NONE, "distinct_tokens plan");
  EXPECT(d->score != NULL && d->count == NULL && d->at == NULL, "distinct_tokens table");
  /* Samples: 1 2 3 1 | 5 5 5 5 | 0 0 (padding only) | 7 | 4 0 4 (one pad). */
  uint16_t tokens[] = {1, 2, 3, 1, 5, 5, 5, 5, 0, 0, 7, 4, 0, 4};
  int64_t offsets[] = {0, 4, 8, 10, 11, 14};
  double scores[5] = {-1, -1, -1, -1, -1};
  int64_t nt = 14, no = 6, ns = 5;
  DLTensor tt = vec(tokens, kDLUInt, 16, &nt);
  DLTensor ot = vec(offsets, kDLInt, 64, &no);
  DLTensor st = vec(scores, kDLFloat, 64, &ns);
  loom_curriculum_score_args sa;
  memset(&sa, 0, sizeof sa);
  sa.struct_size = LOOM_CURRICULUM_SCORE_ARGS_SIZE;
  sa.samples.struct_size = LOOM_CURRICULUM_SAMPLES_SIZE;
  sa.samples.tokens = &tt;
  sa.samples.offsets = &ot;
  sa.vocab_size = 16;
  sa.scores = &st;
  EXPECT(code_of(d->score(dobj, &sa)) == 0, "score failed");
  const double want[5] = {0.75, 0.25, 0.0, 1.0, 0.5};
  for (int i = 0; i < 5; ++i) {
    EXPECT(scores[i] == want[i], "sample %d scored %g, expected %g", i, scores[i], want[i]);
  }
  /* A token outside the vocabulary: INVALID_ARGUMENT, nothing written. */
  tokens[6] = 16;
  scores[0] = -1;
  EXPECT(code_of(d->score(dobj, &sa)) == LOOM_ERR_INVALID_ARGUMENT, "token 16 of 16 accepted");
  EXPECT(scores[0] == -1, "scores written before the vocabulary check");
  /* A scores tensor of the wrong size: the SDK refuses it. */
  ns = 4;
  EXPECT(code_of(d->score(dobj, &sa)) == LOOM_ERR_INVALID_ARGUMENT, "4 scores for 5 samples");

  /* The schedule. */
  const loom_curriculum_plan_args cp = plan_of(c, cobj);
  EXPECT(cp.roles == LOOM_CURRICULUM_SCHEDULE, "cosine_schedule roles %u", cp.roles);
  EXPECT(cp.stats_count == 0 && cp.seq_len_mode == LOOM_SEQ_LEN_NONE, "cosine_schedule plan");
  EXPECT(c->at != NULL && c->score == NULL && c->count == NULL, "cosine_schedule table");
  EXPECT(at(c, cobj, 1) == 10.0, "step 1: %g, expected min 10", at(c, cobj, 1));
  /* Half way: the documented formula, f = (1 - cos(pi s / T)) / 2, floor, multiple of 5. */
  for (int64_t step = 500; step <= 1500; step += 250) {
    double v =
        floor(10.0 + (1.0 - cos(3.14159265358979323846 * (double)step / 2000.0)) / 2.0 * 90.0);
    v -= fmod(v, 5.0);
    EXPECT(at(c, cobj, step) == v, "step %lld: %g, expected %g", (long long)step, at(c, cobj, step),
           v);
  }
  EXPECT(at(c, cobj, 2000) == 100.0, "step 2000: %g", at(c, cobj, 2000));
  EXPECT(at(c, cobj, 50000) == 100.0, "step 50000: %g", at(c, cobj, 50000));
  double last = 0;
  for (int64_t step = 1; step <= 2100; ++step) {
    const double v = at(c, cobj, step);
    EXPECT(v >= last && v >= 10.0 && v <= 100.0 && v == 5.0 * (double)(int64_t)(v / 5.0),
           "step %lld: %g after %g", (long long)step, v, last);
    last = v;
    if (failures > 10) break;
  }
  /* A max that is not a multiple of difficulty_step: rounded below it before T, max itself
   * from T on (not 100, max rounded down). */
  EXPECT(at(c2, c2obj, 1999) == 100.0, "c2 step 1999: %g, expected 100", at(c2, c2obj, 1999));
  EXPECT(at(c2, c2obj, 2000) == 103.0, "c2 step 2000: %g, expected 103", at(c2, c2obj, 2000));
  EXPECT(at(c2, c2obj, 50000) == 103.0, "c2 step 50000: %g, expected 103", at(c2, c2obj, 50000));
  loom_curriculum_at_args zero;
  memset(&zero, 0, sizeof zero);
  zero.struct_size = LOOM_CURRICULUM_AT_ARGS_SIZE;
  EXPECT(code_of(c->at(cobj, &zero)) == LOOM_ERR_INVALID_ARGUMENT, "step 0 accepted");

  loom_close(s);
  if (failures == 0) printf("curriculum_check: ok\n");
  return failures == 0 ? 0 : 1;
}
