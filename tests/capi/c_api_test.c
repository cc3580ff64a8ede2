/* The embedding API from plain C11: open a manifest from a string, find the optimizer,
 * step it, check the numbers and an error path, close. Exits non-zero on any failure.
 * Usage: c_api_test PLUGIN_DIR */
#include <loom/embed.h>

#include <math.h>
#include <stdio.h>
#include <string.h>

static int g_failures = 0;

#define CHECK(cond)                                                                            \
  do {                                                                                         \
    if (!(cond)) {                                                                             \
      fprintf(stderr, "%s:%d: check failed: %s (last error: %s)\n", __FILE__, __LINE__, #cond, \
              loom_last_error());                                                              \
      ++g_failures;                                                                            \
    }                                                                                          \
  } while (0)

static const char k_manifest[] =
    "[comm.world]\n"
    "plugin = \"probe\"\n"
    "\n"
    "[optimizer.main]\n"
    "plugin = \"probe\"\n"
    "tag = \"from C\"\n"
    "weight_decay = 0.25\n"
    "comm = \"world\"\n";

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s PLUGIN_DIR\n", argv[0]);
    return 2;
  }
  CHECK(loom_abi_major() == LOOM_ABI_MAJOR);
  CHECK(strlen(loom_version()) > 0);

  loom_open_options opts;
  memset(&opts, 0, sizeof opts);
  opts.struct_size = LOOM_OPEN_OPTIONS_SIZE;
  opts.plugin_path = argv[1];
  opts.log_level = LOOM_LOG_ERROR;

  loom_session* session = NULL;
  int32_t rc = loom_open_string(k_manifest, "c_api_test.toml", &opts, &session);
  CHECK(rc == LOOM_OK);
  if (rc != LOOM_OK) return 1;
  CHECK(loom_instance_count(session) == 2);

  loom_instance* opt = NULL;
  CHECK(loom_find_instance(session, "optimizer", "main", &opt) == LOOM_OK);
  CHECK(opt != NULL);
  if (opt == NULL) return 1;
  CHECK(strcmp(loom_instance_kind(opt), LOOM_KIND_OPTIMIZER) == 0);

  /* Two steps of p -= lr * (g + 0.25 * p), computed here in double as well. */
  float p0[4] = {1.0f, -1.0f, 0.5f, 2.0f};
  float p1[2] = {10.0f, -10.0f};
  const float g0[4] = {0.1f, 0.2f, -0.3f, 0.0f};
  const float g1[2] = {1.0f, 1.0f};
  float* params[2] = {p0, p1};
  const float* grads[2] = {g0, g1};
  const int64_t numels[2] = {4, 2};
  double ref0[4], ref1[2];
  for (int i = 0; i < 4; ++i) ref0[i] = p0[i];
  for (int i = 0; i < 2; ++i) ref1[i] = p1[i];
  const double lr = 0.1;
  for (int step = 0; step < 2; ++step) {
    CHECK(loom_optimizer_step_f32(opt, params, grads, numels, 2, lr) == LOOM_OK);
    for (int i = 0; i < 4; ++i) ref0[i] = (float)(ref0[i] - lr * ((double)g0[i] + 0.25 * ref0[i]));
    for (int i = 0; i < 2; ++i) ref1[i] = (float)(ref1[i] - lr * ((double)g1[i] + 0.25 * ref1[i]));
  }
  for (int i = 0; i < 4; ++i) CHECK(fabs(p0[i] - ref0[i]) <= 1e-6 * fabs(ref0[i]) + 1e-7);
  for (int i = 0; i < 2; ++i) CHECK(fabs(p1[i] - ref1[i]) <= 1e-6 * fabs(ref1[i]) + 1e-7);
  CHECK(fabs(p1[0] - 9.30875) < 1e-5); /* 10 -> 9.65 -> 9.30875, by hand */

  loom_optimizer_comm_info info;
  memset(&info, 0, sizeof info);
  info.struct_size = LOOM_OPTIMIZER_COMM_INFO_SIZE;
  CHECK(loom_optimizer_get_comm_info(opt, &info) == LOOM_OK);
  CHECK(info.owns_communication == 1);
  CHECK(info.rounds == 4);
  CHECK(info.bytes_sent == 2 * 6 * sizeof(float));

  /* Process groups from C: probe's comm table is a 1.1 one, so split is UNIMPLEMENTED and the
   * message names the instance; an optimizer is not a comm. */
  loom_instance* probe_comm = NULL;
  loom_instance* sub = NULL;
  CHECK(loom_find_instance(session, "comm", "world", &probe_comm) == LOOM_OK);
  CHECK(loom_comm_split(probe_comm, 0, 0, &sub) == LOOM_ERR_UNIMPLEMENTED);
  CHECK(sub == NULL);
  CHECK(strstr(loom_last_error(), "comm.world") != NULL);
  CHECK(loom_comm_split(opt, LOOM_COMM_SPLIT_NONE, 0, &sub) == LOOM_ERR_INVALID_ARGUMENT);
  CHECK(loom_comm_destroy_split(NULL) == LOOM_OK);

  /* An error path: a missing instance is NOT_FOUND and the message names it. */
  loom_instance* missing = NULL;
  CHECK(loom_find_instance(session, "optimizer", "nobody", &missing) == LOOM_ERR_NOT_FOUND);
  CHECK(missing == NULL);
  CHECK(strstr(loom_last_error(), "'nobody'") != NULL);
  CHECK(loom_last_error_code() == LOOM_ERR_NOT_FOUND);

  /* Calls that return no status record their failures too; a success clears them. */
  CHECK(loom_instance_at(session, 2) == NULL);
  CHECK(loom_last_error_code() == LOOM_ERR_OUT_OF_RANGE);
  CHECK(strcmp(loom_last_error(),
               "loom_instance_at: index 2 is out of range; the session has 2 instances") == 0);
  CHECK(loom_find_instance(session, "optimizer", "main", &opt) == LOOM_OK);
  CHECK(loom_last_error_code() == LOOM_OK && loom_last_error()[0] == '\0');
  CHECK(strcmp(loom_instance_name(NULL), "") == 0);
  CHECK(loom_last_error_code() == LOOM_ERR_INVALID_ARGUMENT);
  CHECK(strcmp(loom_last_error(), "loom_instance_name: instance is NULL") == 0);
  CHECK(loom_instance_vtable(NULL) == NULL);
  CHECK(strcmp(loom_last_error(), "loom_instance_vtable: instance is NULL") == 0);
  CHECK(loom_instance_count(NULL) == 0);
  CHECK(strcmp(loom_last_error(), "loom_instance_count: session is NULL") == 0);
  char* described = NULL;
  CHECK(loom_describe_plugins("no_such_plugin", argv[1], &described) != LOOM_OK);
  CHECK(loom_last_error_code() != LOOM_OK);
  CHECK(strstr(loom_last_error(), "no_such_plugin") != NULL);
  loom_free_string(described);

  /* The generic path, here to the comm: its checked table, a call through it, the status
   * taken into a buffer. */
  loom_instance* world = NULL;
  CHECK(loom_find_instance(session, "comm", "world", &world) == LOOM_OK);
  void* object = NULL;
  const void* table = NULL;
  CHECK(loom_instance_table(world, "comm", LOOM_COMM_V1_MIN_SIZE, &object, &table) == LOOM_OK);
  CHECK(object != NULL && table != NULL);
  if (table != NULL) {
    const loom_comm_v1* comm = (const loom_comm_v1*)table;
    loom_comm_stats stats;
    memset(&stats, 0, sizeof stats);
    stats.struct_size = LOOM_COMM_STATS_SIZE;
    char message[256] = "untouched";
    CHECK(loom_instance_take_status(world, comm->stats(object, &stats), message, sizeof message) ==
          LOOM_OK);
    CHECK(message[0] == '\0');
    CHECK(stats.rounds == 4); /* the optimizer's two steps, two allreduces each */
    /* A failing call: its code, its message prefixed with the instance, truncated to fit. */
    stats.struct_size = 4;
    char small[16];
    CHECK(loom_instance_take_status(world, comm->stats(object, &stats), small, sizeof small) ==
          LOOM_ERR_INVALID_ARGUMENT);
    CHECK(strlen(small) == sizeof small - 1);
    CHECK(strncmp(small, "comm.world", 10) == 0);
    CHECK(strstr(loom_last_error(), "probe comm: stats struct too small") != NULL);
    CHECK(loom_last_error_code() == LOOM_ERR_INVALID_ARGUMENT);
    CHECK(loom_instance_take_status(world, NULL, NULL, 0) == LOOM_OK);
  }
  /* The wrong kind, and a table shorter than the caller needs. */
  CHECK(loom_instance_table(world, LOOM_KIND_OPTIMIZER, LOOM_OPTIMIZER_V1_MIN_SIZE, &object,
                            &table) == LOOM_ERR_INVALID_ARGUMENT);
  CHECK(strstr(loom_last_error(), "is a loom.comm/1 instance, not loom.optimizer/1") != NULL);
  CHECK(loom_instance_table(world, "comm", 4096, &object, &table) == LOOM_ERR_UNIMPLEMENTED);
  CHECK(strstr(loom_last_error(), "the caller needs 4096") != NULL);
  CHECK(loom_instance_table(world, "comm", LOOM_COMM_V1_MIN_SIZE, NULL, &table) ==
        LOOM_ERR_INVALID_ARGUMENT);

  /* A bad manifest: FILE:LINE:COL in the message, no session. */
  loom_session* bad = NULL;
  CHECK(loom_open_string("[optimizer.x]\nplugin = \"probe\"\ntag = 5\n", "bad.toml", &opts, &bad) ==
        LOOM_ERR_INVALID_ARGUMENT);
  CHECK(bad == NULL);
  CHECK(strcmp(loom_last_error(),
               "bad.toml:3:7: parameter 'tag' of optimizer.x must be a string, not an integer") ==
        0);

  loom_close(session);
  loom_close(NULL);
  if (g_failures != 0) {
    fprintf(stderr, "%d check(s) failed\n", g_failures);
    return 1;
  }
  printf("c_api_test: ok\n");
  return 0;
}
