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
#include <loom/kinds/kinds.def> /* every kind's header */

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
  /* NULL, or a comma-separated list of manifest sections ("curriculum,sampler"): only these
   * and [loom] are read, every other table is left out as if the manifest lacked it (the
   * lines of what is read keep their numbers in messages). A program that needs some of the
   * instances (a check that creates the curriculum's without the job's comm) opens the
   * manifest this way rather than editing its text. Appended after the first release. */
  const char* sections LOOM_APPENDED_FIELD;
} loom_open_options;
#define LOOM_OPEN_OPTIONS_SIZE LOOM_STRUCT_SIZE(loom_open_options, sections)
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

/* Ends this process, and the job it belongs to, after an error it cannot recover from:
 * stdio is flushed, exit handlers are not run (MPI's would wait for the other
 * ranks). Under an MPI launcher, MPI_Abort: the launcher ends every rank, a stopped one too.
 * Under the env bootstrap (RANK, WORLD_SIZE...), the job's other processes on this host are
 * sent SIGKILL; ranks on other hosts fail their next collective within their timeout and, if
 * they call this too, end theirs. Then _exit(status). A process that opened no session
 * only exits. Never returns. */
LOOM_API void loom_abort_job(int32_t status);

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
/* Since 1.6: loom_optimizer_v1.grads_ready (overlap with the backward); LOOM_ERR_UNIMPLEMENTED
 * when the optimizer has none (its step() then does everything, as it always may). */
LOOM_API int32_t loom_optimizer_grads_ready(loom_instance* instance,
                                            const loom_optimizer_ready_args* args);

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
/* The plugin files loom_describe_plugins would load, without loading any (so without
 * running plugin code): {"search_path": [...], "files": ["/dir/loom_NAME.so", ...]}, in the
 * same order. `name` NULL: every loom_*.so on the search path; otherwise that plugin's file,
 * or no file when there is none. For tools that load each file in a child process, so that
 * a plugin that crashes cannot take the tool down (`loom plugins` does). Free *json_out
 * with loom_free_string. */
LOOM_API int32_t loom_list_plugin_files(const char* name, const char* plugin_path, char** json_out);
LOOM_API void loom_free_string(char* s);

/* The parameters of the manifest's instance KIND.NAME (KIND: a section name or a kind ID) as
 * the host validated them, also in a session opened validate_only, as one JSON document:
 *   {"kind": "loom.moe/1", "name": "...", "plugin": "...", "at": "FILE:LINE:COL",
 *    "params": {"NAME": {"value": V, "at": "FILE:LINE:COL"}, ...}}
 * with every parameter of the plugin's schema in schema order; one the manifest leaves out
 * has its default and "at" "". V is a bool, number, string or list; a reference's V is the
 * name of the instance it names. A trainer reads its instances' settings here instead of
 * parsing the manifest itself. *json_out is freed with loom_free_string. */
LOOM_API int32_t loom_instance_params(loom_session* session, const char* kind, const char* name,
                                      char** json_out);
/* The instances the manifest declares, of one kind (a section name or kind ID) or of every
 * kind (kind NULL), in file order, as a JSON array of {"kind", "section", "name", "plugin",
 * "at"}; also on a validate_only session. Free with loom_free_string. */
LOOM_API int32_t loom_declared_instances(loom_session* session, const char* kind, char** json_out);

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

/* ---- safetensors files, plain or quantized by `loom quantize` (since 1.5) */

/* An opened safetensors file (docs/quantization.md has the quantized layout). Opening
 * checks the whole header strictly (header length, JSON, dtypes, offsets inside the data
 * area, no overlaps or gaps, sizes matching shapes, quantization records matching their
 * tensors): a file that opens can be read without further checks. The data is mapped
 * copy-on-write, so a caller may write through a tensor's data pointer without touching the
 * file. Used from one thread at a time. */
typedef struct loom_tensor_file loom_tensor_file;

/* NOT_FOUND when the file cannot be opened; DATA_LOSS, naming the file, the tensor and what
 * is wrong, when it is not a valid file. */
LOOM_API int32_t loom_tensor_file_open(const char* path, loom_tensor_file** out);
/* NULL is a no-op. Every pointer the file handed out is invalid afterwards. */
LOOM_API void loom_tensor_file_close(loom_tensor_file* file);

/* The logical tensors, in data order: a quantized tensor NAME counts once (its NAME.qcodes,
 * NAME.qscale and NAME.qzero entries are not listed on their own). */
LOOM_API size_t loom_tensor_file_count(const loom_tensor_file* file);
/* NULL for an index out of range. Valid until the file is closed. */
LOOM_API const char* loom_tensor_file_name(const loom_tensor_file* file, size_t index);
/* NOT_FOUND when the file has no tensor of that name. */
LOOM_API int32_t loom_tensor_file_find(const loom_tensor_file* file, const char* name,
                                       size_t* index);
/* A __metadata__ value, or NULL when the file has no such key. */
LOOM_API const char* loom_tensor_file_metadata(const loom_tensor_file* file, const char* key);

typedef struct loom_tensor_info {
  uint32_t struct_size; /* LOOM_TENSOR_INFO_SIZE */
  int32_t quantized;    /* 1: stored quantized; format, codes, scales (, zero_points) are set */
  const char* name;
  /* The logical tensor on the CPU: its dtype (what it was before quantization) and shape;
   * data: its values for a plain tensor, NULL for a quantized one. BOOL reads as uint8. */
  DLTensor tensor;
  loom_quant_format format; /* its shape points at tensor.shape */
  DLTensor codes;           /* uint8 [packed bytes] */
  DLTensor scales;          /* the format's scale dtype and scale shape */
  DLTensor zero_points;     /* asymmetric INT only; all zero otherwise */
  const char* plugin;       /* quantized: the plugin and manifest instance that wrote it, */
  const char* quantizer;
  const char* parameters; /* and its parameters as a JSON object; NULL for a plain tensor */
} loom_tensor_info;
#define LOOM_TENSOR_INFO_SIZE LOOM_STRUCT_SIZE(loom_tensor_info, parameters)

/* Fills *out (whose struct_size the caller sets). Data pointers are aligned to their
 * element size (a misaligned tensor is copied once) and stay valid until the file is
 * closed. */
LOOM_API int32_t loom_tensor_file_info(loom_tensor_file* file, size_t index, loom_tensor_info* out);
/* The tensor's values as float32 into out[count] (count = its element count): a plain float
 * tensor (F32, F64, F16, BF16) converted, a quantized one decoded by its format's rules
 * (loom/quant_format.h) with no plugin involved. INVALID_ARGUMENT for another dtype or a
 * count that does not match; DATA_LOSS, naming the element, for an invalid ternary code (3). */
LOOM_API int32_t loom_tensor_file_read_f32(loom_tensor_file* file, size_t index, float* out,
                                           size_t count);

/* One tensor for loom_tensor_file_write: `data` holds numel * element size bytes, numel the
 * product of the shape (1 for ndim 0). */
typedef struct loom_tensor_out {
  uint32_t struct_size; /* LOOM_TENSOR_OUT_SIZE */
  int32_t ndim;
  const char* name;
  const char* dtype; /* as the file spells it: "F32", "F16", "BF16", "I64", "U8", ... */
  const int64_t* shape;
  const void* data;
} loom_tensor_out;
#define LOOM_TENSOR_OUT_SIZE LOOM_STRUCT_SIZE(loom_tensor_out, data)

/* Writes a safetensors file that loom_tensor_file_open reads back: to a temporary file beside
 * PATH, fsynced, renamed over PATH, its folder fsynced, so PATH is either the old file or the
 * whole new one. It carries "loom.checksum" over the whole file (verified on open) besides
 * `metadata`: metadata_count key/value pairs, metadata[2i] the key and metadata[2i+1] its value.
 * Tensors are laid out by element size, largest first, then in the order given. An error
 * names the file and, for a bad tensor, the tensor; PATH is then untouched. */
LOOM_API int32_t loom_tensor_file_write(const char* path, const loom_tensor_out* tensors,
                                        size_t count, const char* const* metadata,
                                        size_t metadata_count);

/* ---- `loom quantize` (since 1.5) */

/* One progress report: a tensor done (tensor set), or a warning (tensor NULL, note set). */
typedef struct loom_quantize_report {
  uint32_t struct_size; /* LOOM_QUANTIZE_REPORT_SIZE */
  uint32_t reserved;
  const char* tensor;    /* the input tensor, or NULL for a warning */
  const char* quantizer; /* the instance that quantized it; NULL: copied unchanged */
  const char* note;      /* why it was copied, or the warning; "" when none */
  uint64_t index;        /* 0-based, of count (a warning: the rule's index, of the rules) */
  uint64_t count;
  double mse;           /* quantized: the mean squared error of the dequantized tensor */
  double max_abs_error; /* and its largest absolute error, against the float32 input */
  uint64_t bytes_in;    /* the tensor's bytes in the input */
  uint64_t bytes_out;   /* in the output (codes + scales + zero points) */
} loom_quantize_report;
#define LOOM_QUANTIZE_REPORT_SIZE LOOM_STRUCT_SIZE(loom_quantize_report, bytes_out)

typedef void (*loom_quantize_progress_fn)(void* ctx, const loom_quantize_report* report);

typedef struct loom_quantize_summary {
  uint32_t struct_size; /* LOOM_QUANTIZE_SUMMARY_SIZE */
  uint32_t reserved;
  uint64_t tensors;   /* in the input */
  uint64_t quantized; /* of them */
  uint64_t in_file_bytes;
  uint64_t out_file_bytes;
} loom_quantize_summary;
#define LOOM_QUANTIZE_SUMMARY_SIZE LOOM_STRUCT_SIZE(loom_quantize_summary, out_file_bytes)

/* Quantizes the safetensors file `in_path` into `out_path` per the session's [[quantize]]
 * rules (the session opened without validate_only): each tensor goes to the first rule whose
 * pattern matches its name; 2-D float tensors are quantized by the rule's quantizer, the
 * rest copied. `progress` (or NULL) is called after each tensor and for each warning.
 * `summary` may be NULL. The output is written to a temporary file beside `out_path` and
 * renamed at the end: on error `out_path` is untouched. */
LOOM_API int32_t loom_quantize_file(loom_session* session, const char* in_path,
                                    const char* out_path, loom_quantize_progress_fn progress,
                                    void* ctx, loom_quantize_summary* summary);

#ifdef __cplusplus
}
#endif

#endif /* LOOM_EMBED_H */
