// The embedding C API (loom/embed.h): thin, exception-free wrappers over Session.
#include <loom/embed.h>

#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "bootstrap.hpp"
#include "kinds.hpp"
#include "last_error.hpp"
#include "session.hpp"
#include "status.hpp"
#include "step_aliasing.hpp"
#include "thread_pool.hpp"

using loom::host::Error;
using loom::host::Instance;
using loom::host::Session;

// The opaque C handles are the host's objects.
struct loom_session {
  std::unique_ptr<Session> session;
};

// For the C API's other files (quantize/capi.cpp).
namespace loom::host {
Session* session_of(loom_session* s);
Session* session_of(loom_session* s) { return s->session.get(); }
}  // namespace loom::host

namespace {
thread_local std::string g_last_error;
thread_local int32_t g_last_code = LOOM_OK;
}  // namespace

int32_t loom::host::set_last_error(int32_t code, std::string message) {
  g_last_error = std::move(message);
  g_last_code = code;
  return code;
}

int32_t loom::host::clear_last_error() {
  g_last_error.clear();
  g_last_code = LOOM_OK;
  return LOOM_OK;
}

namespace {

int32_t succeed() { return loom::host::clear_last_error(); }

int32_t fail(int32_t code, std::string message) {
  return loom::host::set_last_error(code, std::move(message));
}

// Runs `fn`, mapping every exception to an error code and message.
template <typename Fn>
int32_t api_call(Fn&& fn) noexcept {
  try {
    return fn();
  } catch (const Error& e) {
    return fail(e.code(), e.what());
  } catch (const std::bad_alloc&) {
    return fail(LOOM_ERR_RESOURCE_EXHAUSTED, "out of memory");
  } catch (const std::exception& e) {
    return fail(LOOM_ERR_INTERNAL, e.what());
  } catch (...) {
    return fail(LOOM_ERR_INTERNAL, "unknown exception");
  }
}

// Calls into the plugin behind `inst`, turning its status (or exception) into our error.
template <typename Fn>
int32_t plugin_call(Instance* inst, const char* what, Fn&& fn) {
  auto taken = loom::host::take_status(
      loom::host::guarded_call(inst->label + " " + what, std::forward<Fn>(fn)));
  if (!taken.ok()) return fail(taken.code, inst->label + ": " + what + ": " + taken.message);
  return succeed();
}

loom::host::OpenOptions to_options(const loom_open_options* o) {
  loom::host::OpenOptions out;
  if (o == nullptr) return out;
  // Read only the fields the caller's struct has.
  auto has = [&](size_t end) { return o->struct_size >= end; };
  if (has(offsetof(loom_open_options, validate_only) + sizeof(int32_t))) {
    out.validate_only = o->validate_only != 0;
  }
  if (has(offsetof(loom_open_options, plugin_path) + sizeof(char*)) && o->plugin_path) {
    out.plugin_path = o->plugin_path;
  }
  if (has(offsetof(loom_open_options, bootstrap) + sizeof(void*))) out.bootstrap = o->bootstrap;
  if (has(offsetof(loom_open_options, log_level) + sizeof(int32_t))) out.log_level = o->log_level;
  if (has(offsetof(loom_open_options, sections) + sizeof(char*)) && o->sections != nullptr) {
    std::string_view rest = o->sections;
    while (!rest.empty()) {
      const size_t comma = rest.find(',');
      std::string_view one = rest.substr(0, comma);
      while (!one.empty() && one.front() == ' ') one.remove_prefix(1);
      while (!one.empty() && one.back() == ' ') one.remove_suffix(1);
      if (!one.empty()) out.sections.emplace_back(one);
      rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    }
    out.only_sections = true;
  }
  return out;
}

// loom_instance is an incomplete type for callers; the handle is the Instance itself.
Instance* impl(const loom_instance* h) {
  return reinterpret_cast<Instance*>(const_cast<loom_instance*>(h));  // NOLINT
}
loom_instance* handle(Instance* inst) { return reinterpret_cast<loom_instance*>(inst); }  // NOLINT

// Records that `fn` got a NULL argument (for the calls that return no status).
void null_argument(const char* fn, const char* what) noexcept {
  api_call(
      [&] { return fail(LOOM_ERR_INVALID_ARGUMENT, std::string(fn) + ": " + what + " is NULL"); });
}
void null_instance(const char* fn) noexcept { null_argument(fn, "instance"); }

}  // namespace

extern "C" {

LOOM_API const char* loom_version(void) { return LOOM_VERSION_STRING; }
LOOM_API uint32_t loom_abi_major(void) { return LOOM_ABI_MAJOR; }
LOOM_API uint32_t loom_abi_minor(void) { return LOOM_ABI_MINOR; }
LOOM_API const char* loom_last_error(void) { return g_last_error.c_str(); }
LOOM_API int32_t loom_last_error_code(void) { return g_last_code; }

LOOM_API void loom_abort_job(int32_t status) { loom::host::abort_job(status); }

LOOM_API int32_t loom_open_file(const char* path, const loom_open_options* options,
                                loom_session** out) {
  return api_call([&] {
    if (path == nullptr || out == nullptr) {
      return fail(LOOM_ERR_INVALID_ARGUMENT, "loom_open_file: path and out must not be NULL");
    }
    *out = nullptr;
    auto s = std::make_unique<loom_session>();
    s->session = Session::open_file(path, to_options(options));
    *out = s.release();
    return succeed();
  });
}

LOOM_API int32_t loom_open_string(const char* toml, const char* origin,
                                  const loom_open_options* options, loom_session** out) {
  return api_call([&] {
    if (toml == nullptr || out == nullptr) {
      return fail(LOOM_ERR_INVALID_ARGUMENT, "loom_open_string: toml and out must not be NULL");
    }
    *out = nullptr;
    std::filesystem::path base = std::filesystem::current_path();
    std::string name = "<string>";
    if (origin != nullptr && *origin != '\0') {
      name = origin;
      base = std::filesystem::absolute(origin).parent_path();
    }
    auto s = std::make_unique<loom_session>();
    s->session = Session::open_text(toml, name, base, to_options(options));
    *out = s.release();
    return succeed();
  });
}

LOOM_API void loom_close(loom_session* session) {
  try {
    delete session;
  } catch (...) {  // destroy errors were logged by the session; nothing to return
  }
}

LOOM_API size_t loom_instance_count(const loom_session* session) {
  if (session == nullptr) {
    null_argument("loom_instance_count", "session");
    return 0;
  }
  return session->session->instances().size();
}

LOOM_API loom_instance* loom_instance_at(loom_session* session, size_t index) {
  if (session == nullptr) {
    null_argument("loom_instance_at", "session");
    return nullptr;
  }
  const size_t count = session->session->instances().size();
  if (index >= count) {
    api_call([&] {
      return fail(LOOM_ERR_OUT_OF_RANGE, "loom_instance_at: index " + std::to_string(index) +
                                             " is out of range; the session has " +
                                             std::to_string(count) + " instances");
    });
    return nullptr;
  }
  return handle(session->session->instances()[index].get());
}

LOOM_API int32_t loom_find_instance(loom_session* session, const char* kind, const char* name,
                                    loom_instance** out) {
  return api_call([&] {
    if (session == nullptr || name == nullptr || out == nullptr) {
      return fail(LOOM_ERR_INVALID_ARGUMENT, "loom_find_instance: NULL argument");
    }
    *out = nullptr;
    std::string_view kind_id;
    if (kind != nullptr && *kind != '\0') {
      kind_id = loom::host::normalize_kind(kind);
      if (kind_id.empty()) {
        return fail(LOOM_ERR_INVALID_ARGUMENT, std::string("unknown kind '") + kind +
                                                   "'; this host knows the kinds " +
                                                   loom::host::known_kind_ids());
      }
    }
    Instance* inst = session->session->find(kind_id, name);
    if (inst == nullptr) {
      return fail(LOOM_ERR_NOT_FOUND,
                  "no " + (kind_id.empty() ? std::string("") : std::string(kind_id) + " ") +
                      "instance named '" + name + "' in " + session->session->manifest().origin);
    }
    *out = handle(inst);
    return succeed();
  });
}

// The getters below fail only on a NULL handle: they record it and return "" or NULL.
LOOM_API const char* loom_instance_name(const loom_instance* instance) {
  if (instance == nullptr) {
    null_instance("loom_instance_name");
    return "";
  }
  return impl(instance)->name.c_str();
}
LOOM_API const char* loom_instance_kind(const loom_instance* instance) {
  if (instance == nullptr) {
    null_instance("loom_instance_kind");
    return "";
  }
  return impl(instance)->kind.c_str();
}
LOOM_API const char* loom_instance_plugin(const loom_instance* instance) {
  if (instance == nullptr) {
    null_instance("loom_instance_plugin");
    return "";
  }
  return impl(instance)->plugin_name().c_str();
}
LOOM_API void* loom_instance_object(const loom_instance* instance) {
  if (instance == nullptr) {
    null_instance("loom_instance_object");
    return nullptr;
  }
  return impl(instance)->object;
}
LOOM_API const void* loom_instance_vtable(const loom_instance* instance) {
  if (instance == nullptr) {
    null_instance("loom_instance_vtable");
    return nullptr;
  }
  return impl(instance)->factory().vtable;
}

LOOM_API int32_t loom_instance_export_state(loom_instance* instance, void* buffer, size_t capacity,
                                            size_t* size) {
  return api_call([&] {
    if (instance == nullptr || size == nullptr) {
      return fail(LOOM_ERR_INVALID_ARGUMENT, "loom_instance_export_state: NULL argument");
    }
    Instance* inst = impl(instance);
    *size = 0;
    const auto exporter = inst->factory().export_state;
    if (exporter == nullptr) return succeed();  // stateless: an empty blob
    // The plugin writes in pieces. A size query only counts them; a copy call writes them
    // straight into the caller's buffer while they fit and keeps counting past its end, so
    // no copy of the state is held here either way.
    struct Sink {
      unsigned char* buffer;
      size_t capacity;
      size_t size;
    } sink{static_cast<unsigned char*>(buffer), buffer == nullptr ? 0 : capacity, 0};
    loom_state_writer writer{
        LOOM_STATE_WRITER_SIZE, 0, &sink,
        [](void* ctx, const void* data, size_t bytes) noexcept -> loom_status* {
          auto* s = static_cast<Sink*>(ctx);
          if (bytes > 0 && data == nullptr) {
            return loom::host::make_status(LOOM_ERR_INVALID_ARGUMENT, "state write of NULL data");
          }
          if (bytes > std::numeric_limits<size_t>::max() - s->size) {
            return loom::host::make_status(LOOM_ERR_RESOURCE_EXHAUSTED,
                                           "state is larger than the address space");
          }
          if (bytes > 0 && s->buffer != nullptr && s->size <= s->capacity &&
              bytes <= s->capacity - s->size) {
            std::memcpy(s->buffer + s->size, data, bytes);
          }
          s->size += bytes;
          return nullptr;
        }};
    const int32_t rc =
        plugin_call(inst, "export_state", [&] { return exporter(inst->object, &writer); });
    if (rc != LOOM_OK) return rc;
    *size = sink.size;
    if (buffer == nullptr) return succeed();
    if (capacity < sink.size) {
      return fail(LOOM_ERR_OUT_OF_RANGE, inst->label + ": export_state needs " +
                                             std::to_string(sink.size) + " bytes, buffer has " +
                                             std::to_string(capacity));
    }
    return succeed();
  });
}

LOOM_API int32_t loom_instance_import_state(loom_instance* instance, const void* data,
                                            size_t size) {
  return api_call([&] {
    if (instance == nullptr || (data == nullptr && size > 0)) {
      return fail(LOOM_ERR_INVALID_ARGUMENT, "loom_instance_import_state: NULL argument");
    }
    Instance* inst = impl(instance);
    const auto& factory = *inst->validated->factory;
    if (!factory.has_import_state()) {
      if (size == 0) return succeed();
      return fail(LOOM_ERR_INVALID_ARGUMENT, inst->label + " has no state, but a state of " +
                                                 std::to_string(size) + " bytes was given");
    }
    return plugin_call(inst, "import_state",
                       [&] { return factory.import_state(inst->object, data, size); });
  });
}

LOOM_API int32_t loom_instance_table(const loom_instance* instance, const char* kind,
                                     uint32_t min_size, void** object, const void** table) {
  return api_call([&] {
    if (instance == nullptr || kind == nullptr || object == nullptr || table == nullptr) {
      return fail(LOOM_ERR_INVALID_ARGUMENT, "loom_instance_table: NULL argument");
    }
    const Instance* inst = impl(instance);
    const std::string_view id = loom::host::normalize_kind(kind);
    // A view: this runs on every optimizer step, and a kind ID is longer than the short-string
    // buffer.
    const std::string_view wanted = id.empty() ? std::string_view(kind) : id;
    if (inst->kind != wanted) {
      return fail(LOOM_ERR_INVALID_ARGUMENT,
                  inst->label + " is a " + inst->kind + " instance, not " + std::string(wanted));
    }
    const void* vt = inst->factory().vtable;
    uint32_t have = 0;
    std::memcpy(&have, vt, sizeof have);  // every table starts with its struct_size
    if (have < min_size) {
      return fail(LOOM_ERR_UNIMPLEMENTED, inst->label + ": its " + inst->kind + " table has " +
                                              std::to_string(have) + " bytes, the caller needs " +
                                              std::to_string(min_size) +
                                              " (a plugin built against an older ABI minor)");
    }
    *object = inst->object;
    *table = vt;
    return succeed();
  });
}

LOOM_API int32_t loom_instance_take_status(const loom_instance* instance, loom_status* status,
                                           char* message, size_t capacity) {
  return api_call([&] {
    auto taken = loom::host::take_status(status);
    std::string text;
    int32_t rc = LOOM_OK;
    if (taken.ok()) {
      rc = succeed();
    } else {
      text = (instance != nullptr ? impl(instance)->label + ": " : std::string()) + taken.message;
      rc = fail(taken.code, text);
    }
    if (message != nullptr && capacity > 0) {
      const size_t n = std::min(capacity - 1, text.size());
      std::memcpy(message, text.data(), n);
      message[n] = '\0';
    }
    return rc;
  });
}

namespace {

// An optimizer instance's object and table (LOOM_OPTIMIZER_V1_MIN_SIZE at least), or the status
// of looking them up.
int32_t optimizer_table(loom_instance* instance, void** obj, const loom_optimizer_v1** table) {
  const void* vt = nullptr;
  const int32_t rc =
      loom_instance_table(instance, LOOM_KIND_OPTIMIZER, LOOM_OPTIMIZER_V1_MIN_SIZE, obj, &vt);
  *table = static_cast<const loom_optimizer_v1*>(vt);
  return rc;
}

}  // namespace

LOOM_API int32_t loom_optimizer_step(loom_instance* instance,
                                     const loom_optimizer_step_args* args) {
  void* obj = nullptr;
  const loom_optimizer_v1* table = nullptr;
  if (const int32_t rc = optimizer_table(instance, &obj, &table)) return rc;
  return api_call([&] {
    if (args == nullptr) return fail(LOOM_ERR_INVALID_ARGUMENT, "loom_optimizer_step: NULL args");
    // Checked here, before the plugin runs, so that every optimizer refuses an array listed
    // twice (which it would update twice) without changing anything.
    if (const std::string alias = loom::host::find_aliased_arrays(*args); !alias.empty()) {
      return fail(LOOM_ERR_INVALID_ARGUMENT, impl(instance)->label + ": step: " + alias);
    }
    return loom_instance_take_status(
        instance,
        loom::host::guarded_call(impl(instance)->label + " step",
                                 [&] { return table->step(obj, args); }),
        nullptr, 0);
  });
}

LOOM_API int32_t loom_optimizer_step_f32(loom_instance* instance, float* const* params,
                                         const float* const* grads, const int64_t* numels,
                                         size_t count, double lr) {
  return api_call([&] {
    if (instance == nullptr ||
        (count > 0 && (params == nullptr || grads == nullptr || numels == nullptr))) {
      return fail(LOOM_ERR_INVALID_ARGUMENT, "loom_optimizer_step_f32: NULL argument");
    }
    // Wrap the plain arrays as 1-D fp32 CPU DLTensors with explicit strides.
    std::vector<DLTensor> p(count), g(count);
    std::vector<loom_optimizer_tensor> tensors(count);
    static const int64_t kUnitStride = 1;
    for (size_t i = 0; i < count; ++i) {
      if (params[i] == nullptr || grads[i] == nullptr || numels[i] < 0) {
        return fail(LOOM_ERR_INVALID_ARGUMENT, "loom_optimizer_step_f32: tensor " +
                                                   std::to_string(i) +
                                                   " has a NULL pointer or a negative size");
      }
      const DLDataType f32{kDLFloat, 32, 1};
      p[i] = DLTensor{params[i],
                      DLDevice{kDLCPU, 0},
                      1,
                      f32,
                      const_cast<int64_t*>(&numels[i]),
                      const_cast<int64_t*>(&kUnitStride),
                      0};
      g[i] = DLTensor{const_cast<float*>(grads[i]),
                      DLDevice{kDLCPU, 0},
                      1,
                      f32,
                      const_cast<int64_t*>(&numels[i]),
                      const_cast<int64_t*>(&kUnitStride),
                      0};
      tensors[i] = loom_optimizer_tensor{LOOM_OPTIMIZER_TENSOR_SIZE, 0, &p[i], &g[i], nullptr};
    }
    const loom_optimizer_group group{LOOM_OPTIMIZER_GROUP_SIZE,
                                     0,
                                     tensors.data(),
                                     count,
                                     1.0,
                                     std::numeric_limits<double>::quiet_NaN()};
    const loom_optimizer_step_args args{
        LOOM_OPTIMIZER_STEP_ARGS_SIZE, 0, &group, 1, lr, 1.0, 0, nullptr};
    return loom_optimizer_step(instance, &args);
  });
}

LOOM_API int32_t loom_optimizer_get_comm_info(loom_instance* instance,
                                              loom_optimizer_comm_info* out) {
  return api_call([&] {
    if (instance == nullptr || out == nullptr) {
      return fail(LOOM_ERR_INVALID_ARGUMENT, "loom_optimizer_get_comm_info: NULL argument");
    }
    void* obj = nullptr;
    const void* table = nullptr;
    if (const int32_t rc = loom_instance_table(instance, LOOM_KIND_OPTIMIZER,
                                               LOOM_OPTIMIZER_V1_MIN_SIZE, &obj, &table)) {
      return rc;
    }
    Instance* inst = impl(instance);
    const uint32_t size = out->struct_size;
    if (size < LOOM_STRUCT_SIZE(loom_optimizer_comm_info, owns_communication)) {
      return fail(
          LOOM_ERR_INVALID_ARGUMENT,
          "loom_optimizer_get_comm_info: set out->struct_size to LOOM_OPTIMIZER_COMM_INFO_SIZE");
    }
    const auto* vt = static_cast<const loom_optimizer_v1*>(table);
    const bool has_fn = vt->struct_size >= LOOM_STRUCT_SIZE(loom_optimizer_v1, comm_info) &&
                        vt->comm_info != nullptr;
    // Hand the plugin a full-size struct, then copy back what the caller's size holds.
    loom_optimizer_comm_info full{};
    full.struct_size = LOOM_OPTIMIZER_COMM_INFO_SIZE;
    if (has_fn) {
      const int32_t rc = plugin_call(inst, "comm_info", [&] { return vt->comm_info(obj, &full); });
      if (rc != LOOM_OK) return rc;
    }
    full.struct_size = size < LOOM_OPTIMIZER_COMM_INFO_SIZE ? size : LOOM_OPTIMIZER_COMM_INFO_SIZE;
    std::memcpy(out, &full, full.struct_size);
    return succeed();
  });
}

LOOM_API int32_t loom_optimizer_grads_ready(loom_instance* instance,
                                            const loom_optimizer_ready_args* args) {
  void* obj = nullptr;
  const loom_optimizer_v1* table = nullptr;
  if (const int32_t rc = optimizer_table(instance, &obj, &table)) return rc;
  return api_call([&] {
    if (args == nullptr || args->step == nullptr) {
      return fail(LOOM_ERR_INVALID_ARGUMENT, "loom_optimizer_grads_ready: NULL args");
    }
    if (table->struct_size < LOOM_STRUCT_SIZE(loom_optimizer_v1, grads_ready) ||
        table->grads_ready == nullptr) {
      return fail(LOOM_ERR_UNIMPLEMENTED,
                  impl(instance)->label + ": grads_ready: the optimizer starts nothing early");
    }
    return loom_instance_take_status(
        instance,
        loom::host::guarded_call(impl(instance)->label + " grads_ready",
                                 [&] { return table->grads_ready(obj, args); }),
        nullptr, 0);
  });
}

// ---- loom.comm/1: process groups (since 1.2)

LOOM_API int32_t loom_comm_split(loom_instance* comm, int32_t color, int32_t key,
                                 loom_instance** out) {
  return api_call([&] {
    if (comm == nullptr || out == nullptr) {
      return fail(LOOM_ERR_INVALID_ARGUMENT, "loom_comm_split: NULL argument");
    }
    *out = nullptr;
    void* obj = nullptr;
    const void* table = nullptr;
    if (const int32_t rc =
            loom_instance_table(comm, LOOM_KIND_COMM, LOOM_COMM_V1_MIN_SIZE, &obj, &table)) {
      return rc;
    }
    Instance* inst = impl(comm);
    const auto* vt = static_cast<const loom_comm_v1*>(table);
    const bool has_split =
        vt->struct_size >= LOOM_STRUCT_SIZE(loom_comm_v1, split) && vt->split != nullptr;
    const bool has_destroy = vt->struct_size >= LOOM_STRUCT_SIZE(loom_comm_v1, destroy_split) &&
                             vt->destroy_split != nullptr;
    if (!has_split) {
      return fail(LOOM_ERR_UNIMPLEMENTED,
                  inst->label +
                      ": split: its plugin has no process groups (loom_comm_v1.split, "
                      "ABI 1.2; its table has " +
                      std::to_string(vt->struct_size) + " bytes)");
    }
    if (!has_destroy) {
      return fail(LOOM_ERR_UNIMPLEMENTED,
                  inst->label +
                      ": split: its plugin sets split but not destroy_split, so a "
                      "sub-communicator could not be destroyed; refusing to split");
    }
    loom_comm_split_args args{};
    args.struct_size = LOOM_COMM_SPLIT_ARGS_SIZE;
    args.color = color;
    args.key = key;
    args.result = nullptr;
    const int32_t rc = plugin_call(inst, "split", [&] { return vt->split(obj, &args); });
    if (rc != LOOM_OK || (color < 0) != (args.result == nullptr)) {
      if (args.result != nullptr) {  // a misbehaving plugin's: not handed out, so destroyed
        (void)loom::host::take_status(
            loom::host::guarded_call(inst->label + " destroy_split", [&]() -> loom_status* {
              vt->destroy_split(args.result);
              return nullptr;
            }));
      }
      if (rc != LOOM_OK) return rc;
      return fail(LOOM_ERR_INTERNAL,
                  inst->label + ": split (color " + std::to_string(color) + "): the plugin " +
                      (color < 0 ? "returned a sub-communicator for a negative color, which "
                                   "means no group"
                                 : "returned success but no sub-communicator"));
    }
    if (color < 0) return succeed();
    auto child = std::make_unique<Instance>();
    child->session = inst->session;
    child->validated = inst->validated;
    child->name = inst->name + "/" + std::to_string(color);
    child->kind = inst->kind;
    // "comm.world (plugin ...)" -> "comm.world/1 (plugin ...)"
    const std::size_t paren = inst->label.find(" (");
    child->label = paren == std::string::npos
                       ? inst->label + "/" + std::to_string(color)
                       : inst->label.substr(0, paren) + "/" + std::to_string(color) +
                             inst->label.substr(paren);
    child->logger = inst->logger;
    child->object = args.result;
    *out = handle(inst->session->add_derived(std::move(child), inst, vt->destroy_split));
    return succeed();
  });
}

LOOM_API int32_t loom_comm_destroy_split(loom_instance* sub) {
  return api_call([&] {
    if (sub == nullptr) return succeed();
    Instance* inst = impl(sub);
    if (!inst->session->destroy_derived(inst)) {
      return fail(LOOM_ERR_INVALID_ARGUMENT,
                  "loom_comm_destroy_split: " + inst->label +
                      " is not a sub-communicator from loom_comm_split (its session owns it)");
    }
    return succeed();
  });
}

// ---- the process's thread pool

LOOM_API int32_t loom_parallel_for(size_t n, size_t grain,
                                   void (*body)(void* ctx, size_t begin, size_t end), void* ctx) {
  if (body == nullptr && n > 0) {
    return fail(LOOM_ERR_INVALID_ARGUMENT, "loom_parallel_for: body is NULL");
  }
  loom::host::ThreadPool::process().parallel_for(n, grain, body, ctx);
  return succeed();
}

LOOM_API size_t loom_thread_count(void) { return loom::host::ThreadPool::process().size(); }

LOOM_API int32_t loom_set_thread_count(size_t threads) {
  return api_call([&] {
    if (!loom::host::ThreadPool::process().resize(threads)) {
      return fail(LOOM_ERR_FAILED_PRECONDITION,
                  "loom_set_thread_count: called from inside a parallel_for body");
    }
    return succeed();
  });
}

}  // extern "C"
