/* probe: a small but real test plugin, written against the raw C ABI (no SDK).
 *
 * loom.optimizer/1: plain SGD on contiguous fp32 CPU tensors,
 *     p -= lr * lr_scale * (g / grad_scale + weight_decay * p)
 *   (g clipped to `clip`, sign(g) in mode "signsgd", -g when `maximize`), with a schema
 *   that uses every parameter type, and a step counter exported as state.
 * loom.comm/1: a world of one. Collectives copy, barrier does nothing, stats count
 *   bytes and rounds. An optional `peer` reference lets tests build reference graphs
 *   (and cycles); native_handle hands out the process-wide create/destroy event log.
 */
#include <loom/abi.h>
#include <loom/kinds/comm.h>
#include <loom/kinds/optimizer.h>

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "probe_layout.h"

/* ------------------------------------------------------------------ statuses */

/* Statuses this plugin allocates itself, freed by its own destroy. */
typedef struct probe_status {
  loom_status base;
  char text[512];
} probe_status;

static void probe_status_destroy(loom_status* self) { free(self); }

__attribute__((format(printf, 2, 3))) static loom_status* probe_error(int32_t code, const char* fmt,
                                                                      ...) {
  probe_status* s = calloc(1, sizeof *s);
  if (s == NULL) {
    static loom_status oom = {LOOM_STATUS_SIZE, LOOM_ERR_RESOURCE_EXHAUSTED, "probe: out of memory",
                              NULL};
    return &oom; /* destroy NULL: the host leaves it alone */
  }
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(s->text, sizeof s->text, fmt, ap);
  va_end(ap);
  s->base.struct_size = LOOM_STATUS_SIZE;
  s->base.code = code;
  s->base.message = s->text;
  s->base.destroy = probe_status_destroy;
  return &s->base;
}

/* ------------------------------------------------------------------ events */

static probe_events g_events;

static void record_event(char sign, const char* name) {
  const size_t room = sizeof g_events.text - g_events.len;
  const int n = snprintf(g_events.text + g_events.len, room, "%c%s ", sign, name);
  if (n > 0 && (size_t)n < room) g_events.len += (size_t)n;
}

/* ------------------------------------------------------------------ helpers */

static const loom_param* find_param(const loom_host_services* host, const char* name) {
  for (size_t i = 0; i < host->param_count; ++i) {
    if (strcmp(host->params[i].name, name) == 0) return &host->params[i];
  }
  return NULL;
}

static void log_line(const loom_host_services* host, int32_t level, const char* text) {
  if (host->log != NULL) host->log(host->host_ctx, level, text);
}

static int is_cpu_contiguous(const DLTensor* t) {
  if (t->device.device_type != kDLCPU || (t->ndim > 0 && t->shape == NULL)) return 0;
  if (t->strides == NULL) return 1;
  int64_t expect = 1;
  for (int32_t i = t->ndim - 1; i >= 0; --i) {
    if (t->shape[i] != 1 && t->strides[i] != expect) return 0;
    expect *= t->shape[i];
  }
  return 1;
}

static int64_t numel_of(const DLTensor* t) {
  int64_t n = 1;
  for (int32_t i = 0; i < t->ndim; ++i) n *= t->shape[i];
  return n;
}

static size_t element_bytes(const DLTensor* t) {
  return ((size_t)t->dtype.bits * t->dtype.lanes + 7u) / 8u;
}

static int is_f32(const DLTensor* t) {
  return t->dtype.code == kDLFloat && t->dtype.bits == 32 && t->dtype.lanes == 1;
}

static void* data_of(const DLTensor* t) { return (char*)t->data + t->byte_offset; }

/* ------------------------------------------------------------------ optimizer */

typedef struct probe_optimizer {
  probe_object_head head; /* ref_instance/ref_vtable: the `comm` reference */
  char name[64];
  char tag[64];
  int maximize;
  int signsgd;
  int64_t steps;
  double weight_decay;
  int64_t expect[16];
  size_t expect_count;
  double clip_lo, clip_hi;
  size_t label_count;
  const loom_host_services* host;
} probe_optimizer;

static const char* const k_mode_choices[] = {"sgd", "signsgd", NULL};
static const double k_clip_default[2] = {-1e30, 1e30};
static const char* const k_labels_default[] = {"probe"};

static const loom_param_spec k_opt_specs[] = {
    {.struct_size = LOOM_PARAM_SPEC_SIZE,
     .type = LOOM_PARAM_STRING,
     .name = "tag",
     .doc = "A label for this instance (required).",
     .required = 1,
     .min = -INFINITY,
     .max = INFINITY},
    {.struct_size = LOOM_PARAM_SPEC_SIZE,
     .type = LOOM_PARAM_BOOL,
     .name = "maximize",
     .doc = "Ascend instead of descend.",
     .default_value = {.struct_size = LOOM_VALUE_SIZE, .type = LOOM_PARAM_BOOL, .int_value = 0},
     .min = -INFINITY,
     .max = INFINITY},
    {.struct_size = LOOM_PARAM_SPEC_SIZE,
     .type = LOOM_PARAM_INT,
     .name = "start_step",
     .doc = "Initial value of the step counter.",
     .default_value = {.struct_size = LOOM_VALUE_SIZE, .type = LOOM_PARAM_INT, .int_value = 0},
     .min = 0,
     .max = 1000000},
    {.struct_size = LOOM_PARAM_SPEC_SIZE,
     .type = LOOM_PARAM_FLOAT,
     .name = "weight_decay",
     .doc = "L2 penalty added to the gradient.",
     .default_value = {.struct_size = LOOM_VALUE_SIZE,
                       .type = LOOM_PARAM_FLOAT,
                       .float_value = 0.0},
     .min = 0,
     .max = 1},
    {.struct_size = LOOM_PARAM_SPEC_SIZE,
     .type = LOOM_PARAM_STRING,
     .name = "mode",
     .doc = "Update rule.",
     .default_value = {.struct_size = LOOM_VALUE_SIZE,
                       .type = LOOM_PARAM_STRING,
                       .string_value = "sgd"},
     .min = -INFINITY,
     .max = INFINITY,
     .choices = k_mode_choices},
    {.struct_size = LOOM_PARAM_SPEC_SIZE,
     .type = LOOM_PARAM_INT_LIST,
     .name = "expect_numels",
     .doc = "When not empty, the element count of every tensor a step must get.",
     .default_value = {.struct_size = LOOM_VALUE_SIZE, .type = LOOM_PARAM_INT_LIST, .count = 0},
     .min = 0,
     .max = 1000000000},
    {.struct_size = LOOM_PARAM_SPEC_SIZE,
     .type = LOOM_PARAM_FLOAT_LIST,
     .name = "clip",
     .doc = "Gradients are clipped to [lo, hi].",
     .list_length = 2,
     .default_value = {.struct_size = LOOM_VALUE_SIZE,
                       .type = LOOM_PARAM_FLOAT_LIST,
                       .count = 2,
                       .float_list = k_clip_default},
     .min = -1e30,
     .max = 1e30},
    {.struct_size = LOOM_PARAM_SPEC_SIZE,
     .type = LOOM_PARAM_STRING_LIST,
     .name = "labels",
     .doc = "Free-form labels.",
     .default_value = {.struct_size = LOOM_VALUE_SIZE,
                       .type = LOOM_PARAM_STRING_LIST,
                       .count = 1,
                       .string_list = k_labels_default},
     .min = -INFINITY,
     .max = INFINITY},
    {.struct_size = LOOM_PARAM_SPEC_SIZE,
     .type = LOOM_PARAM_REF,
     .name = "comm",
     .doc = "Averages gradients over this communicator first (optional).",
     .default_value = {.struct_size = LOOM_VALUE_SIZE, .type = LOOM_PARAM_REF},
     .min = -INFINITY,
     .max = INFINITY,
     .ref_kind = LOOM_KIND_COMM},
};

static loom_status* opt_create(const loom_host_services* host, void** out_instance) {
  if (host == NULL || out_instance == NULL || host->struct_size < LOOM_HOST_SERVICES_SIZE) {
    return probe_error(LOOM_ERR_ABI_MISMATCH, "probe: host services too old or missing");
  }
  const loom_param* tag = find_param(host, "tag");
  const loom_param* maximize = find_param(host, "maximize");
  const loom_param* start = find_param(host, "start_step");
  const loom_param* wd = find_param(host, "weight_decay");
  const loom_param* mode = find_param(host, "mode");
  const loom_param* expect = find_param(host, "expect_numels");
  const loom_param* clip = find_param(host, "clip");
  const loom_param* labels = find_param(host, "labels");
  const loom_param* comm = find_param(host, "comm");
  if (!tag || !maximize || !start || !wd || !mode || !expect || !clip || !labels || !comm ||
      tag->value.string_value == NULL || mode->value.string_value == NULL ||
      clip->value.count != 2 || clip->value.float_list == NULL) {
    return probe_error(LOOM_ERR_INVALID_ARGUMENT, "probe: the host passed incomplete parameters");
  }
  if (expect->value.count > 16) {
    return probe_error(LOOM_ERR_OUT_OF_RANGE, "probe: expect_numels holds at most 16 entries");
  }
  if (comm->value.string_value != NULL &&
      (comm->value.ref_instance == NULL || comm->value.ref_vtable == NULL)) {
    return probe_error(LOOM_ERR_FAILED_PRECONDITION,
                       "probe: comm '%s' was not created before optimizer '%s'",
                       comm->value.string_value, host->instance_name);
  }
  probe_optimizer* o = calloc(1, sizeof *o);
  if (o == NULL) return probe_error(LOOM_ERR_RESOURCE_EXHAUSTED, "probe: out of memory");
  o->head.magic = PROBE_OBJECT_MAGIC;
  o->head.is_comm = 0;
  o->head.ref_instance = comm->value.ref_instance;
  o->head.ref_vtable = comm->value.ref_vtable;
  snprintf(o->name, sizeof o->name, "%s", host->instance_name);
  snprintf(o->tag, sizeof o->tag, "%s", tag->value.string_value);
  o->maximize = maximize->value.int_value != 0;
  o->signsgd = strcmp(mode->value.string_value, "signsgd") == 0;
  o->steps = start->value.int_value;
  o->weight_decay = wd->value.float_value;
  o->expect_count = expect->value.count;
  for (size_t i = 0; i < o->expect_count; ++i) o->expect[i] = expect->value.int_list[i];
  o->clip_lo = clip->value.float_list[0];
  o->clip_hi = clip->value.float_list[1];
  o->label_count = labels->value.count;
  o->host = host;
  record_event('+', o->name);
  char line[160];
  snprintf(line, sizeof line, "probe optimizer '%s' created (tag %s)", o->name, o->tag);
  log_line(host, LOOM_LOG_DEBUG, line);
  *out_instance = o;
  return NULL;
}

static void opt_destroy(void* instance) {
  probe_optimizer* o = instance;
  if (o == NULL) return;
  record_event('-', o->name);
  free(o);
}

/* Checks every argument before anything changes. */
static loom_status* opt_validate(const probe_optimizer* o, const loom_optimizer_step_args* args) {
  if (args == NULL || args->struct_size < LOOM_OPTIMIZER_STEP_ARGS_SIZE) {
    return probe_error(LOOM_ERR_INVALID_ARGUMENT, "probe: step args missing or too small");
  }
  if (args->group_count > 0 && args->groups == NULL) {
    return probe_error(LOOM_ERR_INVALID_ARGUMENT, "probe: groups is NULL");
  }
  if (!(args->grad_scale > 0) || !isfinite(args->lr)) {
    return probe_error(LOOM_ERR_INVALID_ARGUMENT, "probe: grad_scale must be > 0 and lr finite");
  }
  size_t seen = 0;
  for (size_t gi = 0; gi < args->group_count; ++gi) {
    const loom_optimizer_group* g = &args->groups[gi];
    if (g->struct_size < LOOM_OPTIMIZER_GROUP_SIZE || (g->tensor_count > 0 && g->tensors == NULL)) {
      return probe_error(LOOM_ERR_INVALID_ARGUMENT, "probe: group %zu is malformed", gi);
    }
    for (size_t ti = 0; ti < g->tensor_count; ++ti) {
      const loom_optimizer_tensor* t = &g->tensors[ti];
      if (t->struct_size < LOOM_OPTIMIZER_TENSOR_SIZE || t->param == NULL || t->grad == NULL) {
        return probe_error(LOOM_ERR_INVALID_ARGUMENT, "probe: group %zu tensor %zu is malformed",
                           gi, ti);
      }
      if (t->master != NULL) {
        return probe_error(LOOM_ERR_UNIMPLEMENTED,
                           "probe: group %zu tensor %zu: master copies are not supported", gi, ti);
      }
      if (!is_f32(t->param) || !is_f32(t->grad)) {
        return probe_error(LOOM_ERR_INVALID_ARGUMENT,
                           "probe: group %zu tensor %zu: param and grad must be fp32", gi, ti);
      }
      if (!is_cpu_contiguous(t->param) || !is_cpu_contiguous(t->grad)) {
        return probe_error(LOOM_ERR_INVALID_ARGUMENT,
                           "probe: group %zu tensor %zu: tensors must be contiguous on the CPU", gi,
                           ti);
      }
      int same = t->param->ndim == t->grad->ndim;
      for (int32_t d = 0; same && d < t->param->ndim; ++d) {
        same = t->param->shape[d] == t->grad->shape[d];
      }
      if (!same) {
        return probe_error(LOOM_ERR_INVALID_ARGUMENT,
                           "probe: group %zu tensor %zu: param and grad shapes differ", gi, ti);
      }
      if (o->expect_count > 0) {
        const int64_t n = numel_of(t->param);
        if (seen >= o->expect_count || n != o->expect[seen]) {
          return probe_error(LOOM_ERR_INVALID_ARGUMENT,
                             "probe: tensor %zu has %lld elements, expect_numels says otherwise",
                             seen, (long long)n);
        }
      }
      ++seen;
    }
  }
  if (o->expect_count > 0 && seen != o->expect_count) {
    return probe_error(LOOM_ERR_INVALID_ARGUMENT, "probe: got %zu tensors, expected %zu", seen,
                       o->expect_count);
  }
  return NULL;
}

static loom_status* opt_step(void* instance, const loom_optimizer_step_args* args) {
  probe_optimizer* o = instance;
  loom_status* bad = opt_validate(o, args);
  if (bad != NULL) return bad;
  const loom_comm_v1* comm = o->head.ref_vtable;
  for (size_t gi = 0; gi < args->group_count; ++gi) {
    const loom_optimizer_group* g = &args->groups[gi];
    const double lr = args->lr * g->lr_scale;
    const double wd = isnan(g->weight_decay) ? o->weight_decay : g->weight_decay;
    for (size_t ti = 0; ti < g->tensor_count; ++ti) {
      const loom_optimizer_tensor* t = &g->tensors[ti];
      const int64_t n = numel_of(t->param);
      float* p = data_of(t->param);
      const float* grad = data_of(t->grad);
      float* averaged = NULL;
      if (comm != NULL) {
        /* Average the gradient over the communicator into scratch memory. */
        averaged = malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
        if (averaged == NULL) return probe_error(LOOM_ERR_RESOURCE_EXHAUSTED, "probe: no memory");
        DLTensor recv = *t->grad;
        recv.data = averaged;
        recv.byte_offset = 0;
        recv.strides = NULL;
        const loom_allreduce_args ar = {LOOM_ALLREDUCE_ARGS_SIZE, LOOM_REDUCE_AVG, t->grad, &recv,
                                        NULL};
        loom_status* s = comm->allreduce(o->head.ref_instance, &ar);
        if (s != NULL) {
          free(averaged);
          return s;
        }
        grad = averaged;
      }
      for (int64_t i = 0; i < n; ++i) {
        double gv = (double)grad[i] / args->grad_scale;
        if (gv < o->clip_lo) gv = o->clip_lo;
        if (gv > o->clip_hi) gv = o->clip_hi;
        if (o->signsgd) gv = gv > 0 ? 1.0 : (gv < 0 ? -1.0 : 0.0);
        if (o->maximize) gv = -gv;
        const double pv = (double)p[i];
        p[i] = (float)(pv - lr * (gv + wd * pv));
      }
      free(averaged);
    }
  }
  ++o->steps;
  return NULL;
}

static loom_status* opt_comm_info(void* instance, loom_optimizer_comm_info* out) {
  probe_optimizer* o = instance;
  if (out == NULL || out->struct_size < LOOM_OPTIMIZER_COMM_INFO_SIZE) {
    return probe_error(LOOM_ERR_INVALID_ARGUMENT, "probe: comm_info struct too small");
  }
  const loom_comm_v1* comm = o->head.ref_vtable;
  out->owns_communication = comm != NULL;
  out->bytes_sent = out->bytes_received = out->rounds = out->uncompressed_bytes_sent = 0;
  if (comm == NULL) return NULL;
  loom_comm_stats stats = {LOOM_COMM_STATS_SIZE, 0, 0, 0, 0};
  loom_status* s = comm->stats(o->head.ref_instance, &stats);
  if (s != NULL) return s;
  out->bytes_sent = stats.bytes_sent;
  out->bytes_received = stats.bytes_received;
  out->rounds = stats.rounds;
  out->uncompressed_bytes_sent = stats.bytes_sent;
  return NULL;
}

static loom_status* opt_export(void* instance, const loom_state_writer* writer) {
  const probe_optimizer* o = instance;
  if (writer == NULL || writer->struct_size < LOOM_STATE_WRITER_SIZE || writer->write == NULL) {
    return probe_error(LOOM_ERR_INVALID_ARGUMENT, "probe: bad state writer");
  }
  probe_state_blob blob;
  memset(&blob, 0, sizeof blob);
  memcpy(blob.magic, PROBE_STATE_MAGIC, PROBE_STATE_MAGIC_BYTES);
  blob.version = PROBE_STATE_VERSION;
  blob.steps = o->steps;
  /* Two writes: the host must concatenate them. */
  const size_t head = offsetof(probe_state_blob, steps);
  loom_status* s = writer->write(writer->ctx, &blob, head);
  if (s != NULL) return s;
  return writer->write(writer->ctx, (const char*)&blob + head, sizeof blob - head);
}

static loom_status* opt_import(void* instance, const void* data, size_t bytes) {
  probe_optimizer* o = instance;
  probe_state_blob blob;
  if (data == NULL || bytes != sizeof blob) {
    return probe_error(LOOM_ERR_DATA_LOSS, "probe: state of %zu bytes is not a probe state (%zu)",
                       bytes, sizeof blob);
  }
  memcpy(&blob, data, sizeof blob);
  if (memcmp(blob.magic, PROBE_STATE_MAGIC, PROBE_STATE_MAGIC_BYTES) != 0) {
    return probe_error(LOOM_ERR_DATA_LOSS, "probe: foreign state (bad magic)");
  }
  if (blob.version != PROBE_STATE_VERSION || blob.steps < 0) {
    return probe_error(LOOM_ERR_DATA_LOSS, "probe: state version %u or step counter is corrupt",
                       blob.version);
  }
  o->steps = blob.steps;
  return NULL;
}

static const loom_optimizer_v1 k_opt_vtable = {LOOM_OPTIMIZER_V1_SIZE, 0, opt_step, opt_comm_info,
                                               NULL};

static const loom_factory k_opt_factory = {
    .struct_size = LOOM_FACTORY_SIZE,
    .kind = LOOM_KIND_OPTIMIZER,
    .param_specs = k_opt_specs,
    .param_count = sizeof k_opt_specs / sizeof k_opt_specs[0],
    .create = opt_create,
    .destroy = opt_destroy,
    .vtable = &k_opt_vtable,
    .export_state = opt_export,
    .import_state = opt_import,
};

/* ------------------------------------------------------------------ comm */

typedef struct probe_comm {
  probe_object_head head; /* ref_instance/ref_vtable: the `peer` reference */
  char name[64];
  loom_comm_stats stats;
} probe_comm;

static const loom_param_spec k_comm_specs[] = {
    {.struct_size = LOOM_PARAM_SPEC_SIZE,
     .type = LOOM_PARAM_REF,
     .name = "peer",
     .doc = "Another communicator this one is chained to (optional).",
     .default_value = {.struct_size = LOOM_VALUE_SIZE, .type = LOOM_PARAM_REF},
     .min = -INFINITY,
     .max = INFINITY,
     .ref_kind = LOOM_KIND_COMM},
    {.struct_size = LOOM_PARAM_SPEC_SIZE,
     .type = LOOM_PARAM_BOOL,
     .name = "fail_create",
     .doc = "Make create fail (for tests of partial creation).",
     .default_value = {.struct_size = LOOM_VALUE_SIZE, .type = LOOM_PARAM_BOOL, .int_value = 0},
     .min = -INFINITY,
     .max = INFINITY},
};

static loom_status* comm_create(const loom_host_services* host, void** out_instance) {
  if (host == NULL || out_instance == NULL || host->struct_size < LOOM_HOST_SERVICES_SIZE) {
    return probe_error(LOOM_ERR_ABI_MISMATCH, "probe: host services too old or missing");
  }
  const loom_param* peer = find_param(host, "peer");
  const loom_param* fail = find_param(host, "fail_create");
  if (peer == NULL || fail == NULL) {
    return probe_error(LOOM_ERR_INVALID_ARGUMENT, "probe: the host passed incomplete parameters");
  }
  if (fail->value.int_value != 0) {
    return probe_error(LOOM_ERR_FAILED_PRECONDITION, "probe: comm '%s' fails as asked",
                       host->instance_name);
  }
  if (peer->value.string_value != NULL) {
    const probe_object_head* p = peer->value.ref_instance;
    if (p == NULL || peer->value.ref_vtable == NULL) {
      return probe_error(LOOM_ERR_FAILED_PRECONDITION,
                         "probe: peer '%s' was not created before comm '%s'",
                         peer->value.string_value, host->instance_name);
    }
    if (p->magic == PROBE_OBJECT_MAGIC && !p->is_comm) {
      return probe_error(LOOM_ERR_INVALID_ARGUMENT, "probe: peer '%s' is not a communicator",
                         peer->value.string_value);
    }
  }
  probe_comm* c = calloc(1, sizeof *c);
  if (c == NULL) return probe_error(LOOM_ERR_RESOURCE_EXHAUSTED, "probe: out of memory");
  c->head.magic = PROBE_OBJECT_MAGIC;
  c->head.is_comm = 1;
  c->head.ref_instance = peer->value.ref_instance;
  c->head.ref_vtable = peer->value.ref_vtable;
  snprintf(c->name, sizeof c->name, "%s", host->instance_name);
  c->stats.struct_size = LOOM_COMM_STATS_SIZE;
  record_event('+', c->name);
  *out_instance = c;
  return NULL;
}

static void comm_destroy(void* instance) {
  probe_comm* c = instance;
  if (c == NULL) return;
  record_event('-', c->name);
  free(c);
}

static int32_t comm_rank(void* instance) {
  (void)instance;
  return 0;
}

static int32_t comm_size(void* instance) {
  (void)instance;
  return 1;
}

static int32_t comm_supports_device(void* instance, DLDevice device) {
  (void)instance;
  return device.device_type == kDLCPU;
}

static loom_status* check_buffer(const DLTensor* t, const char* what) {
  if (t == NULL || t->data == NULL || !is_cpu_contiguous(t)) {
    return probe_error(LOOM_ERR_INVALID_ARGUMENT, "probe comm: %s must be a contiguous CPU tensor",
                       what);
  }
  return NULL;
}

static void count(probe_comm* c, size_t bytes) {
  c->stats.bytes_sent += bytes;
  c->stats.bytes_received += bytes;
  c->stats.rounds += 1;
}

static loom_status* comm_allreduce(void* instance, const loom_allreduce_args* args) {
  probe_comm* c = instance;
  if (args == NULL || args->struct_size < LOOM_ALLREDUCE_ARGS_SIZE) {
    return probe_error(LOOM_ERR_INVALID_ARGUMENT, "probe comm: allreduce args missing");
  }
  if (args->op < LOOM_REDUCE_SUM || args->op > LOOM_REDUCE_MIN) {
    return probe_error(LOOM_ERR_INVALID_ARGUMENT, "probe comm: unknown reduce op %d", args->op);
  }
  loom_status* s = check_buffer(args->recv, "recv");
  if (s != NULL) return s;
  const size_t bytes = (size_t)numel_of(args->recv) * element_bytes(args->recv);
  if (args->send != NULL && args->send != args->recv) {
    if ((s = check_buffer(args->send, "send")) != NULL) return s;
    if ((size_t)numel_of(args->send) * element_bytes(args->send) != bytes) {
      return probe_error(LOOM_ERR_INVALID_ARGUMENT, "probe comm: send and recv sizes differ");
    }
    memmove(data_of(args->recv), data_of(args->send), bytes);
  }
  count(c, bytes);
  return NULL;
}

static loom_status* comm_allgather(void* instance, const loom_allgather_args* args) {
  probe_comm* c = instance;
  if (args == NULL || args->struct_size < LOOM_ALLGATHER_ARGS_SIZE) {
    return probe_error(LOOM_ERR_INVALID_ARGUMENT, "probe comm: allgather args missing");
  }
  loom_status* s = check_buffer(args->send, "send");
  if (s == NULL) s = check_buffer(args->recv, "recv");
  if (s != NULL) return s;
  const size_t bytes = (size_t)numel_of(args->send) * element_bytes(args->send);
  if ((size_t)numel_of(args->recv) * element_bytes(args->recv) < bytes) {
    return probe_error(LOOM_ERR_INVALID_ARGUMENT, "probe comm: allgather recv too small");
  }
  memmove(data_of(args->recv), data_of(args->send), bytes);
  count(c, bytes);
  return NULL;
}

static loom_status* comm_all_to_all(void* instance, const loom_all_to_all_args* args) {
  probe_comm* c = instance;
  if (args == NULL || args->struct_size < LOOM_ALL_TO_ALL_ARGS_SIZE) {
    return probe_error(LOOM_ERR_INVALID_ARGUMENT, "probe comm: all_to_all args missing");
  }
  loom_status* s = check_buffer(args->send, "send");
  if (s == NULL) s = check_buffer(args->recv, "recv");
  if (s != NULL) return s;
  const int64_t n = args->send_counts != NULL ? args->send_counts[0] : numel_of(args->send);
  const int64_t m = args->recv_counts != NULL ? args->recv_counts[0] : n;
  if (n != m || n < 0 || n > numel_of(args->send) || n > numel_of(args->recv)) {
    return probe_error(LOOM_ERR_INVALID_ARGUMENT, "probe comm: all_to_all counts disagree");
  }
  const size_t bytes = (size_t)n * element_bytes(args->send);
  memmove(data_of(args->recv), data_of(args->send), bytes);
  count(c, bytes);
  return NULL;
}

static loom_status* comm_broadcast(void* instance, const loom_broadcast_args* args) {
  probe_comm* c = instance;
  if (args == NULL || args->struct_size < LOOM_BROADCAST_ARGS_SIZE) {
    return probe_error(LOOM_ERR_INVALID_ARGUMENT, "probe comm: broadcast args missing");
  }
  if (args->root != 0) {
    return probe_error(LOOM_ERR_OUT_OF_RANGE, "probe comm: root %d in a world of one", args->root);
  }
  loom_status* s = check_buffer(args->tensor, "tensor");
  if (s != NULL) return s;
  count(c, 0);
  return NULL;
}

static loom_status* comm_barrier(void* instance, void* stream) {
  probe_comm* c = instance;
  (void)stream;
  count(c, 0);
  return NULL;
}

static loom_status* comm_stats(void* instance, loom_comm_stats* out) {
  const probe_comm* c = instance;
  if (out == NULL || out->struct_size < LOOM_COMM_STATS_SIZE) {
    return probe_error(LOOM_ERR_INVALID_ARGUMENT, "probe comm: stats struct too small");
  }
  out->bytes_sent = c->stats.bytes_sent;
  out->bytes_received = c->stats.bytes_received;
  out->rounds = c->stats.rounds;
  return NULL;
}

static loom_status* comm_native_handle(void* instance, const char** kind, void** handle) {
  (void)instance;
  if (kind == NULL || handle == NULL) {
    return probe_error(LOOM_ERR_INVALID_ARGUMENT, "probe comm: native_handle needs outputs");
  }
  *kind = PROBE_EVENTS_KIND;
  *handle = &g_events;
  return NULL;
}

/* The table of a 1.1 plugin: it ends at native_handle (no split, no args-struct calls). */
static const loom_comm_v1 k_comm_vtable = {
    .struct_size = LOOM_STRUCT_SIZE(loom_comm_v1, native_handle),
    .rank = comm_rank,
    .size = comm_size,
    .supports_device = comm_supports_device,
    .allreduce = comm_allreduce,
    .allgather = comm_allgather,
    .all_to_all = comm_all_to_all,
    .broadcast = comm_broadcast,
    .barrier = comm_barrier,
    .stats = comm_stats,
    .native_handle = comm_native_handle,
};

static const loom_factory k_comm_factory = {
    .struct_size = LOOM_FACTORY_SIZE,
    .kind = LOOM_KIND_COMM,
    .param_specs = k_comm_specs,
    .param_count = sizeof k_comm_specs / sizeof k_comm_specs[0],
    .create = comm_create,
    .destroy = comm_destroy,
    .vtable = &k_comm_vtable,
};

/* ------------------------------------------------------------------ entry */

static const loom_factory* const k_factories[] = {&k_opt_factory, &k_comm_factory};

static const loom_plugin_v1 k_plugin = {
    LOOM_PLUGIN_V1_SIZE,
    LOOM_ABI_MAJOR,
    LOOM_ABI_MINOR,
    "probe",
    "1.2.3",
    "Test plugin: SGD optimizer and a world-of-one communicator",
    k_factories,
    sizeof k_factories / sizeof k_factories[0],
};

LOOM_EXPORT const loom_plugin_v1* loom_plugin_entry_v1(void) { return &k_plugin; }
