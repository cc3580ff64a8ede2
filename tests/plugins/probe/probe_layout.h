/* What the tests may know about the probe plugin's insides: the layout of its state
 * blob and the event log its comm instances hand out through native_handle. C11. */
#ifndef LOOM_TESTS_PROBE_LAYOUT_H
#define LOOM_TESTS_PROBE_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

/* State blob of a probe optimizer: magic, format version, step counter. */
#define PROBE_STATE_MAGIC "PROBEST1"
#define PROBE_STATE_MAGIC_BYTES 8
#define PROBE_STATE_VERSION 1u
typedef struct probe_state_blob {
  char magic[PROBE_STATE_MAGIC_BYTES];
  uint32_t version;
  uint32_t reserved;
  int64_t steps; /* optimizer steps taken (start_step included) */
} probe_state_blob;

/* Every create and destroy of a probe instance appends "+name " or "-name " here.
 * A probe comm's native_handle returns kind PROBE_EVENTS_KIND and a pointer to the
 * process-wide log, which tests may clear (len = 0, text[0] = 0). */
#define PROBE_EVENTS_KIND "probe.events"
typedef struct probe_events {
  size_t len;
  char text[8192];
} probe_events;

/* The first fields of every probe instance (optimizer and comm alike). */
#define PROBE_OBJECT_MAGIC 0x50524f42u /* "PROB" */
typedef struct probe_object_head {
  uint32_t magic;
  uint32_t is_comm;
  void* ref_instance; /* optimizer: its `comm`; comm: its `peer` (NULL when unset) */
  const void* ref_vtable;
} probe_object_head;

#endif /* LOOM_TESTS_PROBE_LAYOUT_H */
