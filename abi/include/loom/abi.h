/* Loom plugin ABI, version 1: the core contract between the host and plugins.
 *
 * Rules (see docs/abi.md):
 *  - C11 only; no includes but <stdint.h>, <stddef.h> and <dlpack/dlpack.h>.
 *  - Every struct that crosses the boundary starts with `uint32_t struct_size`,
 *    set to LOOM_<NAME>_SIZE (offset of the last field plus its size). Structs
 *    only grow at the end within a major version; a reader reads the prefix it
 *    knows and treats fields beyond struct_size as absent (zero / NULL).
 *  - Arrays of ABI structs (param specs, params, optimizer groups and tensors) are
 *    walked with the first element's struct_size as the stride, so a reader built
 *    against another minor walks them right (loom/sdk does this for plugins).
 *  - A struct may omit trailing fields documented as optional (NULL = absent); the
 *    reader fills them with zero. Mandatory fields never move.
 *  - loom_value is embedded by value in other structs and is frozen for major 1.
 *  - Errors are loom_status objects (NULL = success), destroyed by calling their
 *    own destroy pointer, which belongs to whoever created them.
 *  - Strings are NUL-terminated UTF-8. Borrowed pointers are valid for the call
 *    unless the comment beside them says otherwise.
 *  - Thread rules are written beside each function:
 *      [instance]  one call at a time per instance, from any thread (calls on different
 *                  instances may run concurrently); the caller orders them;
 *      [process]   one call at a time in the whole process, from any thread;
 *      [any]       any thread, concurrently.
 *    No function may rely on being called from the thread that created the instance:
 *    samplers run on loader threads and routers inside a model's forward.
 */
#ifndef LOOM_ABI_H
#define LOOM_ABI_H

#include <stddef.h>
#include <stdint.h>

#include <dlpack/dlpack.h>

#ifdef __cplusplus
extern "C" {
#endif

#define LOOM_ABI_MAJOR 1
#define LOOM_ABI_MINOR 7

/* Size of a struct up to and including its last field (trailing padding excluded). */
#define LOOM_STRUCT_SIZE(type, last_field) \
  ((uint32_t)(offsetof(type, last_field) + \
              sizeof(((type*)0)->last_field))) /* NOLINT(bugprone-sizeof-expression) */

/* Every struct's LOOM_<NAME>_SIZE must equal its sizeof: a field appended without
 * updating the size macro breaks the build instead of the ABI. */
#ifdef __cplusplus
#define LOOM_STATIC_ASSERT(cond, msg) static_assert(cond, msg)
#else
#define LOOM_STATIC_ASSERT(cond, msg) _Static_assert(cond, msg)
#endif
#define LOOM_CHECK_STRUCT_SIZE(type, size_macro) \
  LOOM_STATIC_ASSERT(sizeof(type) == (size_macro), #size_macro " is out of date for " #type)

/* Follows a field appended in a later minor. In C++ it is a default member initializer
 * (zero / NULL; the struct stays a standard-layout aggregate with the same layout), so C++
 * code written against the older minor that lists every field it knew, as in
 * {SIZE, 0, a, b}, still compiles under -Wmissing-field-initializers and leaves the new
 * field absent. In C it is empty. */
#ifdef __cplusplus
#define LOOM_APPENDED_FIELD = {}
#else
#define LOOM_APPENDED_FIELD
#endif

#if defined(_WIN32)
#define LOOM_EXPORT __declspec(dllexport)
#else
#define LOOM_EXPORT __attribute__((visibility("default")))
#endif

/* ------------------------------------------------------------------ status */

typedef enum loom_code {
  LOOM_OK = 0,
  LOOM_ERR_INVALID_ARGUMENT = 1, /* the caller passed something wrong */
  LOOM_ERR_NOT_FOUND = 2,
  LOOM_ERR_OUT_OF_RANGE = 3,
  LOOM_ERR_UNIMPLEMENTED = 4, /* valid request this build or device cannot serve */
  LOOM_ERR_FAILED_PRECONDITION = 5,
  LOOM_ERR_UNAVAILABLE = 6, /* a peer, device or library is not there */
  LOOM_ERR_DEADLINE_EXCEEDED = 7,
  LOOM_ERR_RESOURCE_EXHAUSTED = 8,
  LOOM_ERR_DATA_LOSS = 9, /* corrupt or truncated data */
  LOOM_ERR_ABI_MISMATCH = 10,
  LOOM_ERR_INTERNAL = 11 /* a bug, or an exception caught at the boundary */
} loom_code;

/* An error. Whoever receives one owns it and must call status->destroy(status)
 * exactly once; destroy runs the creator's code, so allocators always match. */
typedef struct loom_status {
  uint32_t struct_size;
  int32_t code;        /* loom_code */
  const char* message; /* valid until destroy */
  void (*destroy)(struct loom_status* self);
} loom_status;
#define LOOM_STATUS_SIZE LOOM_STRUCT_SIZE(loom_status, destroy)
LOOM_CHECK_STRUCT_SIZE(loom_status, LOOM_STATUS_SIZE);

/* ------------------------------------------------------------- parameters */

typedef enum loom_param_type {
  LOOM_PARAM_BOOL = 1,
  LOOM_PARAM_INT = 2,   /* int64 */
  LOOM_PARAM_FLOAT = 3, /* double; an integer literal is accepted */
  LOOM_PARAM_STRING = 4,
  LOOM_PARAM_INT_LIST = 5,
  LOOM_PARAM_FLOAT_LIST = 6,
  LOOM_PARAM_STRING_LIST = 7,
  LOOM_PARAM_REF = 8 /* the name of another instance of kind `ref_kind` */
} loom_param_type;

/* One value. Which fields are meaningful depends on `type`; the others are zero.
 * All pointers are owned by whoever filled the value and outlive its use. */
typedef struct loom_value {
  uint32_t struct_size;
  int32_t type;             /* loom_param_type */
  int64_t int_value;        /* INT; BOOL as 0/1 */
  double float_value;       /* FLOAT */
  const char* string_value; /* STRING; REF: the referenced instance's name */
  size_t count;             /* *_LIST: number of elements */
  const int64_t* int_list;
  const double* float_list;
  const char* const* string_list;
  /* REF only, filled by the host when it passes parameters to an instance:
   * the referenced instance and its kind's function table (e.g. loom_comm_v1*). */
  void* ref_instance;
  const void* ref_vtable;
} loom_value;
#define LOOM_VALUE_SIZE LOOM_STRUCT_SIZE(loom_value, ref_vtable)
LOOM_CHECK_STRUCT_SIZE(loom_value, LOOM_VALUE_SIZE);

/* loom_param_spec.flags (since 1.2). A host refuses a spec with a bit it does not know
 * (loading the plugin fails naming the parameter), so a bit added later never passes
 * unchecked. */
#define LOOM_PARAM_MIN_EXCLUSIVE (1u << 0) /* the lower bound is excluded: value > min */
#define LOOM_PARAM_MAX_EXCLUSIVE (1u << 1) /* the upper bound is excluded: value < max */
/* INT / INT_LIST only: the bounds are int_min / int_max, compared exactly as int64
 * (min / max still hold them as doubles, rounded outward, for hosts before 1.2). */
#define LOOM_PARAM_INT_RANGE (1u << 2)
#define LOOM_PARAM_KNOWN_FLAGS \
  (LOOM_PARAM_MIN_EXCLUSIVE | LOOM_PARAM_MAX_EXCLUSIVE | LOOM_PARAM_INT_RANGE)

/* One entry of a plugin's parameter schema. */
typedef struct loom_param_spec {
  uint32_t struct_size;
  int32_t type;             /* loom_param_type */
  const char* name;         /* manifest key, [a-z0-9_]+ */
  const char* doc;          /* one sentence for `loom describe` and the docs */
  int32_t required;         /* 1: no default, the manifest must set it */
  int32_t list_length;      /* *_LIST: exact number of elements, 0 = any */
  loom_value default_value; /* ignored when required */
  /* Numeric range for INT/FLOAT and each element of their lists: inclusive, unless
   * `flags` (since 1.2) makes a bound exclusive; for INT/INT_LIST with LOOM_PARAM_INT_RANGE
   * the exact int_min / int_max apply instead. Use -INFINITY / INFINITY (or +-9.2e18 for
   * ints) for no bound. */
  double min;
  double max;
  /* STRING / STRING_LIST: NULL, or a NULL-terminated list of allowed values. */
  const char* const* choices;
  /* REF: the kind ID the referenced instance must provide, e.g. "loom.comm/1". */
  const char* ref_kind;
  /* Since 1.2. LOOM_PARAM_* bits: which bounds are exclusive, whether int_min / int_max
   * apply. 0 (and a spec that ends before it): inclusive double bounds, as in 1.1. */
  uint32_t flags LOOM_APPENDED_FIELD;
  uint32_t reserved2 LOOM_APPENDED_FIELD; /* 0 */
  /* Since 1.2, with LOOM_PARAM_INT_RANGE: exact bounds of an INT and of each element of an
   * INT_LIST (INT64_MIN / INT64_MAX for none); exclusive per the flags. */
  int64_t int_min LOOM_APPENDED_FIELD;
  int64_t int_max LOOM_APPENDED_FIELD;
} loom_param_spec;
#define LOOM_PARAM_SPEC_SIZE LOOM_STRUCT_SIZE(loom_param_spec, int_max)
LOOM_CHECK_STRUCT_SIZE(loom_param_spec, LOOM_PARAM_SPEC_SIZE);

/* A validated parameter as the host hands it to an instance. */
typedef struct loom_param {
  uint32_t struct_size;
  uint32_t reserved;
  const char* name;
  loom_value value;
} loom_param;
#define LOOM_PARAM_SIZE LOOM_STRUCT_SIZE(loom_param, value)
LOOM_CHECK_STRUCT_SIZE(loom_param, LOOM_PARAM_SIZE);

/* ------------------------------------------------------------- bootstrap */

/* What every rank knows about the job, and the one collective transports need to
 * exchange addresses. A world of one has rank 0, size 1 and an allgather that copies. */
typedef struct loom_bootstrap {
  uint32_t struct_size;
  int32_t rank;
  int32_t size;
  int32_t local_rank; /* rank among the processes on this machine */
  void* ctx;          /* passed back to the functions below */
  /* [process] Every rank contributes `bytes` bytes from `send`; `recv` receives
   * size * bytes, rank i's contribution at offset i * bytes. Collective: all
   * ranks call it in the same order. */
  loom_status* (*allgather)(void* ctx, const void* send, size_t bytes, void* recv);
  /* [process] Returns when every rank has entered. Collective. */
  loom_status* (*barrier)(void* ctx);
} loom_bootstrap;
#define LOOM_BOOTSTRAP_SIZE LOOM_STRUCT_SIZE(loom_bootstrap, barrier)
LOOM_CHECK_STRUCT_SIZE(loom_bootstrap, LOOM_BOOTSTRAP_SIZE);

/* ------------------------------------------------------------ host services */

typedef enum loom_log_level {
  LOOM_LOG_TRACE = 0,
  LOOM_LOG_DEBUG = 1,
  LOOM_LOG_INFO = 2,
  LOOM_LOG_WARN = 3,
  LOOM_LOG_ERROR = 4
} loom_log_level;

/* The host's services for one instance. Valid from create until destroy returns.
 * Every function takes `host_ctx` first. */
typedef struct loom_host_services {
  uint32_t struct_size;
  uint16_t abi_major; /* the host's ABI version */
  uint16_t abi_minor;
  void* host_ctx;
  const char* instance_name; /* the manifest's name for this instance */

  /* [any] Writes one line to this instance's logger ("kind.name"). */
  void (*log)(void* host_ctx, int32_t level, const char* message);
  /* [any] 1 when a message at `level` would be written. */
  int32_t (*log_enabled)(void* host_ctx, int32_t level);

  /* [any] A status the host owns (its destroy is the host's); for plugins that
   * want to forward an error without an allocator of their own. */
  loom_status* (*make_status)(void* host_ctx, int32_t code, const char* message);

  /* [any] Host memory aligned to `align` (a power of two, 0 = 64). NULL on failure. */
  void* (*host_alloc)(void* host_ctx, size_t bytes, size_t align);
  void (*host_free)(void* host_ctx, void* ptr);
  /* [any] Device memory on `device`, ordered on `stream` (a cudaStream_t, or NULL for
   * the legacy default stream). kDLCPU falls back to host_alloc. */
  loom_status* (*device_alloc)(void* host_ctx, DLDevice device, size_t bytes, void* stream,
                               void** out);
  loom_status* (*device_free)(void* host_ctx, DLDevice device, void* ptr, void* stream);

  /* This rank's bootstrap (never NULL; a world of one when not launched as a job). */
  const loom_bootstrap* bootstrap;

  /* The instance's parameters, validated against its schema, defaults filled in,
   * in schema order: params[i] corresponds to the factory's param_specs[i]. */
  const loom_param* params;
  size_t param_count;

  /* Since 1.2: the process's thread pool, one for the host and every plugin (a plugin
   * starts no pool of its own). Absent (beyond struct_size) from a 1.0/1.1 host.
   *
   * [any] Calls body(body_ctx, begin, end) on disjoint blocks that together cover [0, n)
   * exactly once; every block begins at a multiple of `grain` (0 is taken as 1), and the
   * calling thread runs one of them. Returns once every block has returned. n = 0 calls
   * nothing. The host may run the whole range as one block (0, n) on the calling thread:
   * a call made from inside a body (nested or reentrant) always does, and so does a call
   * made while another thread's call is using the pool, so concurrent calls from any
   * number of threads are safe and never deadlock. `body` must return normally (no
   * exception, longjmp or thread exit). NULL on success; INVALID_ARGUMENT for a NULL body
   * with n > 0. */
  loom_status* (*parallel_for)(void* host_ctx, size_t n, size_t grain,
                               void (*body)(void* body_ctx, size_t begin, size_t end),
                               void* body_ctx)LOOM_APPENDED_FIELD;
  /* [any] The number of threads a parallel_for may use, the caller's included (>= 1):
   * LOOM_NUM_THREADS when set, else the cores divided among this machine's ranks. */
  size_t (*thread_count)(void* host_ctx) LOOM_APPENDED_FIELD;
} loom_host_services;
#define LOOM_HOST_SERVICES_SIZE LOOM_STRUCT_SIZE(loom_host_services, thread_count)
LOOM_CHECK_STRUCT_SIZE(loom_host_services, LOOM_HOST_SERVICES_SIZE);

/* --------------------------------------------------------------- state */

/* A sink for exported state. The plugin calls write as many times as it likes. */
typedef struct loom_state_writer {
  uint32_t struct_size;
  uint32_t reserved;
  void* ctx;
  loom_status* (*write)(void* ctx, const void* data, size_t bytes);
} loom_state_writer;
#define LOOM_STATE_WRITER_SIZE LOOM_STRUCT_SIZE(loom_state_writer, write)
LOOM_CHECK_STRUCT_SIZE(loom_state_writer, LOOM_STATE_WRITER_SIZE);

/* ------------------------------------------------------------- factory */

/* What loom_factory.validate receives (since 1.2). */
typedef struct loom_validate_args {
  uint32_t struct_size;
  uint32_t reserved;
  /* The instance's parameters as create will get them: validated against the schema
   * (types, ranges, choices), defaults filled in, params[i] for param_specs[i]. A REF holds
   * the referenced instance's name only (ref_instance and ref_vtable are NULL): nothing is
   * created yet. */
  const loom_param* params;
  size_t param_count;
  const char* instance_name; /* the manifest's name for the instance */
  /* [any] A status the host owns, for plugins without an allocator of their own. */
  void* host_ctx;
  loom_status* (*make_status)(void* host_ctx, int32_t code, const char* message);
  /* out: with an error, the index into params of the parameter to blame (the host reports
   * the error at that key in the manifest, or at the instance's table when the key was not
   * set); the host sets -1 before the call, which blames the instance as a whole. */
  int32_t bad_param;
  uint32_t reserved2;
} loom_validate_args;
#define LOOM_VALIDATE_ARGS_SIZE LOOM_STRUCT_SIZE(loom_validate_args, reserved2)
LOOM_CHECK_STRUCT_SIZE(loom_validate_args, LOOM_VALIDATE_ARGS_SIZE);

/* What loom_factory.create_with_args receives (since 1.2); grows at the end. */
typedef struct loom_create_args {
  uint32_t struct_size;
  uint32_t reserved;
  /* The host's services for the new instance; valid until destroy returns. */
  const loom_host_services* host;
} loom_create_args;
#define LOOM_CREATE_ARGS_SIZE LOOM_STRUCT_SIZE(loom_create_args, host)
LOOM_CHECK_STRUCT_SIZE(loom_create_args, LOOM_CREATE_ARGS_SIZE);

/* What loom_factory.import_state_with_args receives (since 1.2); grows at the end. */
typedef struct loom_import_state_args {
  uint32_t struct_size;
  uint32_t reserved;
  const void* data; /* the blob export_state wrote; borrowed for the call */
  size_t bytes;
} loom_import_state_args;
#define LOOM_IMPORT_STATE_ARGS_SIZE LOOM_STRUCT_SIZE(loom_import_state_args, bytes)
LOOM_CHECK_STRUCT_SIZE(loom_import_state_args, LOOM_IMPORT_STATE_ARGS_SIZE);

/* One kind a plugin provides. The kind ID names the function table `vtable` points to,
 * e.g. "loom.optimizer/1" -> const loom_optimizer_v1*. */
typedef struct loom_factory {
  uint32_t struct_size;
  uint32_t reserved;
  const char* kind;                   /* "loom.optimizer/1" */
  const loom_param_spec* param_specs; /* the schema; may be NULL when param_count is 0 */
  size_t param_count;
  /* [process] Makes an instance. `host` stays valid until destroy returns. May be NULL
   * when create_with_args (below, since 1.2) is set. */
  loom_status* (*create)(const loom_host_services* host, void** out_instance /* out */);
  /* [instance] Frees the instance; joins any thread it started. NULL is a no-op. */
  void (*destroy)(void* instance);
  const void* vtable; /* the kind's function table */
  /* [instance] Optional (NULL: the instance has no state). Writes everything a restart
   * needs; the format is the plugin's, versioned by the plugin. */
  loom_status* (*export_state)(void* instance, const loom_state_writer* writer);
  /* [instance] Optional. Restores exported state; rejects foreign or corrupt blobs with
   * LOOM_ERR_DATA_LOSS or LOOM_ERR_INVALID_ARGUMENT and leaves the instance unchanged. */
  loom_status* (*import_state)(void* instance, const void* data, size_t bytes);
  /* [process] Since 1.2, optional (NULL: no checks beyond the schema). Cross-parameter
   * checks: returns NULL when the parameter set is acceptable, else an error whose message
   * says what is wrong, with args->bad_param naming the parameter to blame. Called by
   * `loom check` and before any instance of the manifest is created; it must not keep
   * the pointers, create anything or depend on other instances. */
  loom_status* (*validate)(loom_validate_args* args)LOOM_APPENDED_FIELD;
  /* [process] Since 1.2, optional: create with its inputs in a struct that can grow. A host
   * that speaks 1.2 calls it instead of create when it is set; a factory must set create
   * too to load on hosts before 1.2. One of the two must be set. */
  loom_status* (*create_with_args)(const loom_create_args* args,
                                   void** out_instance /* out */)LOOM_APPENDED_FIELD;
  /* [instance] Since 1.2, optional: import_state with its inputs in a struct that can grow,
   * same contract; preferred over import_state when set. */
  loom_status* (*import_state_with_args)(void* instance,
                                         const loom_import_state_args* args)LOOM_APPENDED_FIELD;
} loom_factory;
#define LOOM_FACTORY_SIZE LOOM_STRUCT_SIZE(loom_factory, import_state_with_args)
LOOM_CHECK_STRUCT_SIZE(loom_factory, LOOM_FACTORY_SIZE);

/* ------------------------------------------------------------- plugin entry */

/* What the entry symbol returns. Static data: valid while the library is loaded. */
typedef struct loom_plugin_v1 {
  uint32_t struct_size;
  uint16_t abi_major;                   /* LOOM_ABI_MAJOR the plugin was built with */
  uint16_t abi_minor;                   /* LOOM_ABI_MINOR the plugin was built with */
  const char* name;                     /* [a-z0-9_]+; the manifest's `plugin = "name"` */
  const char* version;                  /* the plugin's own version, e.g. "1.2.0" */
  const char* description;              /* one line */
  const loom_factory* const* factories; /* the kinds it provides */
  size_t factory_count;
} loom_plugin_v1;
#define LOOM_PLUGIN_V1_SIZE LOOM_STRUCT_SIZE(loom_plugin_v1, factory_count)
LOOM_CHECK_STRUCT_SIZE(loom_plugin_v1, LOOM_PLUGIN_V1_SIZE);

/* The one symbol a plugin exports for ABI major 1. A later major exports
 * loom_plugin_entry_v2 (possibly beside this one). [instance] Called once per load. */
#define LOOM_PLUGIN_ENTRY_V1_NAME "loom_plugin_entry_v1"
typedef const loom_plugin_v1* (*loom_plugin_entry_v1_fn)(void);

/* Kinds: each kind's header (loom/kinds/NAME.h) defines its ID (LOOM_KIND_NAME, the
 * string in loom_factory.kind) and the smallest function table a host accepts for it
 * (LOOM_NAME_V1_MIN_SIZE). New kinds arrive with a minor version, as a new header; this
 * file lists none of them (docs/abi.md, "Adding a kind"). */

#ifdef __cplusplus
}
#endif

#endif /* LOOM_ABI_H */
