/* Loom's embedding API: what a trainer calls to open a manifest, find the instances
 * it declares and call them. Plain C types only, so any language's C FFI can use it
 * (Python's ctypes, Rust's bindgen, ...).
 *
 * Errors: functions return a loom_code (0 = LOOM_OK). The message of the last error
 * on the calling thread is loom_last_error(); it names the manifest position
 * (FILE:LINE:COL) or the plugin and its file.
 *
 * Threads: a session and its instances are used from one thread at a time. */
#ifndef LOOM_EMBED_H
#define LOOM_EMBED_H

#include <stddef.h>
#include <stdint.h>

#include <loom/abi.h>
#include <loom/kinds/codec.h>
#include <loom/kinds/comm.h>
#include <loom/kinds/curriculum.h>
#include <loom/kinds/moe.h>
#include <loom/kinds/optimizer.h>
#include <loom/kinds/quantizer.h>
#include <loom/kinds/router.h>
#include <loom/kinds/sampler.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define LOOM_API __declspec(dllimport)
#else
#define LOOM_API __attribute__((visibility("default")))
#endif

typedef struct loom_session loom_session;   /* an opened manifest and its instances */
typedef struct loom_instance loom_instance; /* one instance; owned by its session */

typedef struct loom_open_options {
  uint32_t struct_size;  /* LOOM_OPEN_OPTIONS_SIZE */
  int32_t validate_only; /* 1: parse, load plugins and validate; create no instance */
  /* Extra plugin folders, ':'-separated, searched after the manifest's plugin_path
   * and before LOOM_PLUGIN_PATH. NULL for none. */
  const char* plugin_path;
  /* The rank's bootstrap, or NULL: the host picks one (a world of one unless the
   * process was launched as part of a job). Must outlive the session. */
  const loom_bootstrap* bootstrap;
  /* Log level for this session: a loom_log_level, or -1 for the manifest's
   * [loom] log_level (LOOM_LOG_LEVEL in the environment overrides both). */
  int32_t log_level;
  int32_t reserved;
} loom_open_options;
#define LOOM_OPEN_OPTIONS_SIZE LOOM_STRUCT_SIZE(loom_open_options, reserved)
LOOM_CHECK_STRUCT_SIZE(loom_open_options, LOOM_OPEN_OPTIONS_SIZE);

/* The library's version string ("0.1.0") and the ABI it speaks. */
LOOM_API const char* loom_version(void);
LOOM_API uint32_t loom_abi_major(void);
LOOM_API uint32_t loom_abi_minor(void);

/* The message of the last failed call on this thread ("" when none). Valid until
 * the next Loom call on this thread. Lists every error when a manifest has several,
 * one "FILE:LINE:COL: message" per line. Every call that returns a status sets it
 * (a success clears it); the calls that return a count, a handle or a string set it
 * when they fail (0, NULL or "" for a NULL argument or an index out of range) and leave
 * it alone otherwise. */
LOOM_API const char* loom_last_error(void);
LOOM_API int32_t loom_last_error_code(void);

/* Opens a manifest. `options` may be NULL. On success *out is a new session. */
LOOM_API int32_t loom_open_file(const char* path, const loom_open_options* options,
                                loom_session** out);
/* The same from TOML text; `origin` names it in messages and is the folder that
 * relative plugin_path entries resolve against (NULL: "<string>" and the working
 * directory). */
LOOM_API int32_t loom_open_string(const char* toml, const char* origin,
                                  const loom_open_options* options, loom_session** out);
/* Destroys every instance, in reverse creation order. NULL is a no-op. */
LOOM_API void loom_close(loom_session* session);

/* Instances, in creation (dependency) order. */
LOOM_API size_t loom_instance_count(const loom_session* session);
LOOM_API loom_instance* loom_instance_at(loom_session* session, size_t index);
/* `kind` is a manifest section ("optimizer") or a kind ID ("loom.optimizer/1"). */
LOOM_API int32_t loom_find_instance(loom_session* session, const char* kind, const char* name,
                                    loom_instance** out);
LOOM_API const char* loom_instance_name(const loom_instance* instance);
LOOM_API const char* loom_instance_kind(const loom_instance* instance); /* "loom.optimizer/1" */
LOOM_API const char* loom_instance_plugin(const loom_instance* instance);

/* Full access: the plugin's object and its kind's table (e.g. const loom_optimizer_v1*).
 * Calls through these bypass the host's error capture; prefer the wrappers below. */
LOOM_API void* loom_instance_object(const loom_instance* instance);
LOOM_API const void* loom_instance_vtable(const loom_instance* instance);

/* The generic path to an instance of any kind, checked: its object and function table.
 * `kind` is a section ("codec") or a kind ID ("loom.codec/1"); `min_size` is the number of
 * table bytes the caller will use: the kind's LOOM_NAME_V1_MIN_SIZE, or the
 * LOOM_STRUCT_SIZE up to a later optional field. INVALID_ARGUMENT for an instance of
 * another kind; UNIMPLEMENTED when the plugin's table is shorter (a plugin built against an
 * older minor). Then call table->fn(object, ...) and hand what it returns to
 * loom_instance_take_status. */
LOOM_API int32_t loom_instance_table(const loom_instance* instance, const char* kind,
                                     uint32_t min_size, void** object, const void** table);
/* Takes the status a call through the table returned, and destroys it: NULL is LOOM_OK.
 * Otherwise returns its code, records it as loom_last_error ("codec.c: MESSAGE"), and, when
 * `message` is not NULL, copies that text into message[capacity] (truncated,
 * NUL-terminated). */
LOOM_API int32_t loom_instance_take_status(const loom_instance* instance, loom_status* status,
                                           char* message, size_t capacity);

/* State for checkpoints. Call with buffer NULL to learn the size; *size gets the
 * number of bytes the state needs (or wrote). A buffer too small is LOOM_ERR_OUT_OF_RANGE;
 * after any failure the buffer's contents are unspecified. An SDK plugin serialises once
 * for a size query followed by the copy call (it keeps the blob until its next call). */
LOOM_API int32_t loom_instance_export_state(loom_instance* instance, void* buffer, size_t capacity,
                                            size_t* size);
LOOM_API int32_t loom_instance_import_state(loom_instance* instance, const void* data, size_t size);

/* ---- loom.optimizer/1: one-liners over loom_instance_table and loom_instance_take_status */
LOOM_API int32_t loom_optimizer_step(loom_instance* instance, const loom_optimizer_step_args* args);
/* The simple path: one group of contiguous fp32 CPU tensors. */
LOOM_API int32_t loom_optimizer_step_f32(loom_instance* instance, float* const* params,
                                         const float* const* grads, const int64_t* numels,
                                         size_t count, double lr);
LOOM_API int32_t loom_optimizer_get_comm_info(loom_instance* instance,
                                              loom_optimizer_comm_info* out);

/* ---- loom.comm/1: process groups (since 1.2) */

/* Splits a comm instance into groups: collective over `comm` (every rank of it calls this,
 * in the same order as its other collectives). The ranks that pass the same color >= 0 form
 * one sub-communicator, ordered by (key, rank in `comm`); *out is this rank's, a new
 * instance of the same plugin and table, named "NAME/COLOR" ("world/1"; not listed by
 * loom_instance_count or found by loom_find_instance). Use it as any comm instance
 * (loom_instance_table, ...) and split it further. A negative color (LOOM_COMM_SPLIT_NONE)
 * sets *out to NULL. UNIMPLEMENTED, naming the instance, when its plugin has no split (one
 * built for ABI 1.1 or older). The session owns the sub-communicator: loom_close destroys
 * it before its parent. */
LOOM_API int32_t loom_comm_split(loom_instance* comm, int32_t color, int32_t key,
                                 loom_instance** out);
/* Destroys a sub-communicator from loom_comm_split now, and first every one split from
 * it; not collective. NULL is a no-op; INVALID_ARGUMENT for an instance declared in the
 * manifest. The handle is invalid afterwards. */
LOOM_API int32_t loom_comm_destroy_split(loom_instance* sub);

/* ---- plugin discovery */

/* Describes plugins as one JSON document: {"search_path": [...], "plugins": [{"name",
 * "version", "description", "abi", "path", "kinds": [{"kind", "params": [...]}]}],
 * "errors": [{"path", "error"}]}. `name` NULL: every loom_*.so on the search path
 * (`plugin_path` first, then LOOM_PLUGIN_PATH, then the bundled folder); otherwise only
 * that plugin, and a missing or broken one is an error (its status, its message in
 * loom_last_error and in "errors"). Free *json_out with
 * loom_free_string. Loading a plugin runs its code: only configured folders are used. */
LOOM_API int32_t loom_describe_plugins(const char* name, const char* plugin_path, char** json_out);
LOOM_API void loom_free_string(char* s);

/* ---- the process's thread pool: the one every plugin instance reaches through
 * loom_host_services.parallel_for (docs/abi.md), for the embedding program's own loops, so
 * the trainer's kernels and the plugins' never start a second set of threads. Unlike the
 * rest of this API, these are [any]: any thread, concurrently. */

/* Calls body(ctx, begin, end) on disjoint blocks covering [0, n), each beginning at a
 * multiple of `grain` (0 = 1), the calling thread running one of them; returns when all
 * have. A call from inside a body, or while another thread's call is using the pool, runs
 * the whole range inline (one block (0, n)), so nothing deadlocks. `body` must not throw.
 * LOOM_ERR_INVALID_ARGUMENT for a NULL body with n > 0. */
LOOM_API int32_t loom_parallel_for(size_t n, size_t grain,
                                   void (*body)(void* ctx, size_t begin, size_t end), void* ctx);
/* Threads a parallel_for may use, the caller's included: LOOM_NUM_THREADS (1..1024) when
 * set, else the cores this process may use divided by the ranks on this machine
 * (OMPI_COMM_WORLD_LOCAL_SIZE, MPI_LOCALNRANKS or LOCAL_WORLD_SIZE). */
LOOM_API size_t loom_thread_count(void);
/* Resizes the pool to `threads` (0: the default above, re-read from the environment; more
 * than 1024 is 1024), for every session and plugin in the process; waits for a call in
 * progress. LOOM_ERR_FAILED_PRECONDITION from inside a parallel_for body. */
LOOM_API int32_t loom_set_thread_count(size_t threads);

#ifdef __cplusplus
}
#endif

#endif /* LOOM_EMBED_H */
