// From a C++ class to the C tables: factory<T>(), the instance the host holds, LOOM_PLUGIN.
//
//   #include <loom/sdk/kinds/optimizer.hpp>  // the kind's header: its base class and table
//
//   class Sgd : public loom::sdk::Optimizer {
//    public:
//     explicit Sgd(loom::sdk::Context& ctx);
//     static loom::sdk::Schema schema();                             // optional
//     static void validate_params(loom::sdk::Context& params);       // optional
//     void step(const loom_optimizer_step_args& args);
//     void export_state(loom::sdk::StateWriter& out);                // optional, with
//     void import_state(std::span<const std::byte> blob);            //   import_state
//   };
//   LOOM_PLUGIN("sgd", "1.0.0", "SGD with momentum", loom::sdk::factory<Sgd>());
//
// Nothing here names a kind: each kind's base class, table and checks are in its own header,
// loom/sdk/kinds/NAME.hpp, which registers the kind with factory<T>() (kinds/table.hpp).
// Every generated C function is noexcept and reports exceptions as statuses (see guard()).
#ifndef LOOM_SDK_PLUGIN_HPP
#define LOOM_SDK_PLUGIN_HPP

#include <loom/abi.h>
#include <loom/sdk/context.hpp>
#include <loom/sdk/kinds/checks.hpp>
#include <loom/sdk/kinds/table.hpp>
#include <loom/sdk/parallel.hpp>
#include <loom/sdk/schema.hpp>
#include <loom/sdk/state.hpp>
#include <loom/sdk/status.hpp>
#include <loom/sdk/tensor.hpp>

#include <charconv>
#include <concepts>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

namespace loom::sdk {

// What LOOM_PLUGIN takes for each kind: a function that builds the factory on first call
// (inside the entry point, where a broken schema can be reported rather than crash).
using FactoryFn = const loom_factory* (*)();

namespace detail {

// An instance as the host sees it: the Context first, so it outlives the object that may
// hold a reference to it.
//
// `exported` keeps the framed blob of the last export_state until any other call on the
// instance: hosts ask for the size first and then for the bytes, and the second export is
// served from it instead of serialising the whole state again. The state can only change
// inside a call on the instance (calls are one at a time per instance), and every call but
// export_state goes through object<T>(), which drops the blob.
//
// `pool` registers the host's thread pool (1.2 hosts) for parallel_for() in this library
// before the object is built and drops it after the object is gone, so kernels the object
// runs in its constructor or destructor use it too.
template <class T>
struct Holder {
  explicit Holder(const loom_host_services* host) : pool(host), ctx(host), object(ctx) {}
  // A sub-instance (a comm's split): T(Context&, args...), sharing its parent's services.
  template <class... A>
  Holder(const loom_host_services* host, std::in_place_t /*tag*/, A&&... a)
      : pool(host), ctx(host), object(ctx, std::forward<A>(a)...) {}

  void forget_export() noexcept {
    if (has_exported) {
      std::vector<std::byte>().swap(exported);
      has_exported = false;
    }
  }

  PoolRegistration pool;
  Context ctx;
  T object;
  std::vector<std::byte> exported;
  bool has_exported = false;
};

template <class T>
Holder<T>& holder(void* instance) {
  if (instance == nullptr) throw Error(LOOM_ERR_INVALID_ARGUMENT, "instance is NULL");
  return *static_cast<Holder<T>*>(instance);
}

// The plugin object for a call on the instance; any call but export_state ends the
// export cache's validity.
template <class T>
T& object(void* instance) {
  Holder<T>& h = holder<T>(instance);
  h.forget_export();
  return h.object;
}

// The plugin object for an [any] call: it does not touch the export cache (concurrent calls
// may run on one instance, and these calls do not change the state).
template <class T>
T& shared_object(void* instance) {
  return holder<T>(instance).object;
}

// ---- the factory

template <class T>
constexpr bool kHasState = requires(T& t, StateWriter& w, std::span<const std::byte> b) {
  t.export_state(w);
  t.import_state(b);
};

// The ABI minor a plugin class needs its host to speak: T::kRequiredHostMinor when the class
// declares it (it uses something a later minor added), else 0 (any 1.x host).
template <class T>
constexpr uint16_t required_host_minor() {
  if constexpr (requires {
                  { T::kRequiredHostMinor } -> std::convertible_to<uint16_t>;
                }) {
    return static_cast<uint16_t>(T::kRequiredHostMinor);
  } else {
    return 0;
  }
}

// An older host reads only the prefix of the plugin's structs it knows and cannot tell what
// the plugin needs: the plugin refuses instead, naming both versions, before it reads a
// field the host does not have.
template <class T>
void check_host_version(const loom_host_services* host) {
  if (host == nullptr || host->struct_size < LOOM_STRUCT_SIZE(loom_host_services, abi_minor)) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT, "the host services table is missing or too short");
  }
  constexpr uint16_t need = required_host_minor<T>();
  if (host->abi_major != LOOM_ABI_MAJOR || host->abi_minor < need) {
    throw Error(LOOM_ERR_ABI_MISMATCH,
                "this plugin needs a Loom host that speaks ABI " + std::to_string(LOOM_ABI_MAJOR) +
                    "." + std::to_string(need) + " or newer; this host speaks ABI " +
                    std::to_string(host->abi_major) + "." + std::to_string(host->abi_minor) +
                    " (update Loom, or use a build of the plugin for this version)");
  }
}

// The cross-parameter hook: static void validate_params(Context&), given the same typed
// view of the parameters as the constructor. It throws Error(code, message, "key") to name
// the parameter to blame.
template <class T>
constexpr bool kHasValidate = requires(Context& c) {
  T::validate_params(c);
};

// The index of parameter `name` in an array the host passed (walked by its own stride), or -1.
inline int32_t param_index(const loom_param* params, std::size_t count, const std::string& name) {
  if (params == nullptr || count == 0 || params[0].struct_size < sizeof(loom_param)) return -1;
  const std::size_t stride = params[0].struct_size;
  const auto* bytes = reinterpret_cast<const unsigned char*>(params);  // NOLINT
  for (std::size_t i = 0; i < count && i < 0x7fffffff; ++i) {
    const auto* p = reinterpret_cast<const loom_param*>(bytes + i * stride);  // NOLINT
    if (p->name != nullptr && name == p->name) return static_cast<int32_t>(i);
  }
  return -1;
}

template <class T>
struct FactoryStorage;
template <class T>
const FactoryStorage<T>& factory_storage();

// Shortest text that reads back as `v` ("1e-08", "0.5"), for messages.
inline std::string number_text(double v) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return r.ec == std::errc() ? std::string(buf, r.ptr) : std::to_string(v);
}

// What a host before ABI 1.2 does not check: exclusive bounds and exact int64 ranges (it reads
// only the inclusive double bounds, which the SDK rounds outward). Run in create on such a
// host, so a value the schema refuses never reaches the constructor.
inline void check_12_bounds(const Context& params, const loom_param_spec* specs,
                            std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) {
    const loom_param_spec& spec = specs[i];
    if ((spec.flags &
         (LOOM_PARAM_MIN_EXCLUSIVE | LOOM_PARAM_MAX_EXCLUSIVE | LOOM_PARAM_INT_RANGE)) == 0 ||
        !params.has(spec.name)) {
      continue;
    }
    const bool lo_ex = (spec.flags & LOOM_PARAM_MIN_EXCLUSIVE) != 0;
    const bool hi_ex = (spec.flags & LOOM_PARAM_MAX_EXCLUSIVE) != 0;
    const bool exact = (spec.flags & LOOM_PARAM_INT_RANGE) != 0;
    const std::string range =
        std::string(lo_ex ? "(" : "[") +
        (exact ? std::to_string(spec.int_min) : number_text(spec.min)) + ", " +
        (exact ? std::to_string(spec.int_max) : number_text(spec.max)) + (hi_ex ? ")" : "]");
    auto refuse = [&](const std::string& value) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT, "parameter '" + std::string(spec.name) +
                                                 "' = " + value + " is out of range " + range);
    };
    auto check_double = [&](double x) {
      if (!((lo_ex ? x > spec.min : x >= spec.min) && (hi_ex ? x < spec.max : x <= spec.max))) {
        refuse(number_text(x));
      }
    };
    auto check_int = [&](int64_t x) {
      if (!exact) return check_double(static_cast<double>(x));
      if (!((lo_ex ? x > spec.int_min : x >= spec.int_min) &&
            (hi_ex ? x < spec.int_max : x <= spec.int_max))) {
        refuse(std::to_string(x));
      }
    };
    const loom_value& v = params.value(spec.name);
    switch (v.type) {
      case LOOM_PARAM_FLOAT:
        check_double(v.float_value);
        break;
      case LOOM_PARAM_INT:
        check_int(v.int_value);
        break;
      case LOOM_PARAM_FLOAT_LIST:
        for (std::size_t k = 0; k < v.count && v.float_list != nullptr; ++k) {
          check_double(v.float_list[k]);
        }
        break;
      case LOOM_PARAM_INT_LIST:
        for (std::size_t k = 0; k < v.count && v.int_list != nullptr; ++k) check_int(v.int_list[k]);
        break;
      default:
        break;
    }
  }
}

template <class T>
struct FactoryThunks {
  // `host_validated`: the host ran the factory's validate (a 1.2 host does before create);
  // an older host never calls it, so the hook runs here and fails the create instead.
  static void make(const loom_host_services* host, void** out_instance, bool host_validated) {
    if (out_instance == nullptr) throw Error(LOOM_ERR_INVALID_ARGUMENT, "out_instance is NULL");
    *out_instance = nullptr;
    check_host_version<T>(host);
    if (!host_validated) {
      Context params(host);
      const auto& storage = factory_storage<T>();
      check_12_bounds(params, storage.schema.data(), storage.schema.size());
      if constexpr (kHasValidate<T>) {
        try {
          T::validate_params(params);
        } catch (const Error& e) {
          if (e.param().empty()) throw;
          throw Error(e.code(), "parameter '" + e.param() + "': " + e.what());
        }
      }
    }
    // bad_alloc is caught by guard() and reported as RESOURCE_EXHAUSTED.
    *out_instance = new Holder<T>(host);  // NOLINT(bugprone-unhandled-exception-at-new)
  }
  static loom_status* create(const loom_host_services* host, void** out_instance) noexcept {
    return guard([&] {
      const bool validated = host != nullptr &&
                             host->struct_size >= LOOM_STRUCT_SIZE(loom_host_services, abi_minor) &&
                             host->abi_minor >= 2;
      make(host, out_instance, validated);
    });
  }
  static loom_status* create_with_args(const loom_create_args* args, void** out_instance) noexcept {
    return guard([&] {
      if (out_instance != nullptr) *out_instance = nullptr;
      const loom_create_args in = normalized(args, "create args");
      make(in.host, out_instance, true);  // create_with_args is 1.2: the host validated
    });
  }
  // Runs T::validate_params on the parameters the host passes (no instance exists yet): a
  // Context over a services table that holds only them, the instance's name and the host's
  // make_status. An Error naming a parameter sets bad_param.
  static loom_status* validate(loom_validate_args* args) noexcept {
    if (args == nullptr || args->struct_size < LOOM_STRUCT_SIZE(loom_validate_args, bad_param)) {
      return make_status(LOOM_ERR_INVALID_ARGUMENT, "validate args are missing or too short");
    }
    try {
      const loom_validate_args in = normalized(args, "validate args");
      loom_host_services svc{};
      svc.struct_size = LOOM_HOST_SERVICES_SIZE;
      svc.abi_major = LOOM_ABI_MAJOR;
      svc.abi_minor = 2;  // validate exists since 1.2
      svc.host_ctx = in.host_ctx;
      svc.instance_name = in.instance_name;
      svc.make_status = in.make_status;
      svc.params = in.params;
      svc.param_count = in.params != nullptr ? in.param_count : 0;
      Context params(&svc);
      T::validate_params(params);
      return nullptr;
    } catch (const Error& e) {
      if (e.param().empty()) return make_status(e.code(), e.what());
      const int32_t index = param_index(args->params, args->param_count, e.param());
      if (index < 0) {
        return make_status(e.code(), std::string(e.what()) + " (parameter '" + e.param() +
                                         "', which is not in the schema)");
      }
      args->bad_param = index;
      return make_status(e.code(), e.what());
    } catch (...) {
      return status_from_current_exception();
    }
  }
  static void destroy(void* instance) noexcept {
    // A throwing destructor has nowhere to report to; the C signature returns nothing.
    try {
      delete static_cast<Holder<T>*>(instance);
    } catch (...) {
    }
  }
  // Serialises the state into a checksummed frame (state.hpp), hands it to the host's
  // writer in one piece and keeps it for a repeated export; the export after that one
  // serialises afresh, so at most one extra copy is held, and only until the next call.
  static loom_status* export_state(void* instance, const loom_state_writer* writer) noexcept {
    return guard([&] {
      StateWriter out(writer);
      Holder<T>& h = holder<T>(instance);
      if (h.has_exported) {
        const std::vector<std::byte> blob = std::move(h.exported);
        h.forget_export();
        out.write_bytes(blob);
        return;
      }
      std::vector<std::byte> blob;
      state_frame::begin(blob);
      loom_state_writer append{
          LOOM_STATE_WRITER_SIZE, 0, &blob,
          [](void* ctx, const void* data, std::size_t bytes) noexcept -> loom_status* {
            return guard([&] {
              if (data == nullptr) throw Error(LOOM_ERR_INVALID_ARGUMENT, "state write of NULL");
              auto* b = static_cast<std::vector<std::byte>*>(ctx);
              const auto* p = static_cast<const std::byte*>(data);
              b->insert(b->end(), p, p + bytes);
            });
          }};
      StateWriter payload(&append);
      h.object.export_state(payload);
      state_frame::finish(blob);
      out.write_bytes(blob);
      h.exported = std::move(blob);
      h.has_exported = true;
    });
  }
  // Checks the frame (DATA_LOSS naming what does not match) and gives the plugin the payload;
  // an unframed blob from before frames reaches the plugin whole, as it always did.
  static void import(void* instance, const void* data, std::size_t bytes) {
    if (data == nullptr && bytes != 0) throw Error(LOOM_ERR_INVALID_ARGUMENT, "state data is NULL");
    T& obj = object<T>(instance);
    obj.import_state(state_frame::open(
        std::span<const std::byte>(static_cast<const std::byte*>(data), data ? bytes : 0)));
  }
  static loom_status* import_state(void* instance, const void* data, std::size_t bytes) noexcept {
    return guard([&] { import(instance, data, bytes); });
  }
  static loom_status* import_state_with_args(void* instance,
                                             const loom_import_state_args* args) noexcept {
    return guard([&] {
      const loom_import_state_args in = normalized(args, "import_state args");
      import(instance, in.data, in.bytes);
    });
  }
};

// Everything one factory points to, built once on first use and kept in static storage.
template <class T>
struct FactoryStorage {
  FactoryStorage() : schema(make_schema()) {
    factory.struct_size = LOOM_FACTORY_SIZE;
    factory.param_specs = schema.data();
    factory.param_count = schema.size();
    // Both create entries: create_with_args for hosts from 1.2 on, create for older ones.
    factory.create = &FactoryThunks<T>::create;
    factory.create_with_args = &FactoryThunks<T>::create_with_args;
    factory.destroy = &FactoryThunks<T>::destroy;
    // The kind ID and table from the one kind base class T derives from (T::sdk_kind).
    using Kind = typename T::sdk_kind;
    factory.kind = Kind::kKind;
    factory.vtable = KindTraits<Kind>::template table<T>();
    if constexpr (kHasState<T>) {
      factory.export_state = &FactoryThunks<T>::export_state;
      factory.import_state = &FactoryThunks<T>::import_state;
      factory.import_state_with_args = &FactoryThunks<T>::import_state_with_args;
    }
    if constexpr (kHasValidate<T>) factory.validate = &FactoryThunks<T>::validate;
  }

  static Schema make_schema() {
    if constexpr (requires {
                    { T::schema() } -> std::convertible_to<Schema>;
                  }) {
      return T::schema();
    } else {
      return Schema{};
    }
  }

  SchemaStorage schema;
  loom_factory factory{};
};

// Built on the entry point's first call (a broken schema is reported there), kept while the
// library is loaded.
template <class T>
const FactoryStorage<T>& factory_storage() {
  static const FactoryStorage<T> storage;
  return storage;
}

// Reports a broken plugin declaration where a developer will see it: there is no status to
// return from the entry point, and the host reports the NULL it gets.
inline void report_declaration_error(const char* plugin, const char* message) noexcept {
  std::fprintf(stderr, "loom plugin '%s': %s\n", plugin != nullptr ? plugin : "?", message);
}

inline const char* current_exception_message() noexcept {
  try {
    throw;
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

// The loom_plugin_v1 behind the entry symbol. Never throws; get() is NULL when the
// declaration is invalid (bad name, duplicate kind, invalid schema).
class PluginStorage {
 public:
  PluginStorage(const char* name, const char* version, const char* description,
                std::initializer_list<FactoryFn> factories) noexcept {
    try {
      if (!valid_name(name)) {
        report_declaration_error(name, "plugin name must match [a-z0-9_]+");
        return;
      }
      for (auto make : factories) {
        const loom_factory* f = make();
        for (const loom_factory* g : factories_) {
          if (std::strcmp(g->kind, f->kind) == 0) {
            report_declaration_error(name,
                                     (std::string("two factories for kind ") + f->kind).c_str());
            return;
          }
        }
        factories_.push_back(f);
      }
      plugin_.struct_size = LOOM_PLUGIN_V1_SIZE;
      plugin_.abi_major = LOOM_ABI_MAJOR;
      plugin_.abi_minor = LOOM_ABI_MINOR;
      plugin_.name = name;
      plugin_.version = version != nullptr ? version : "";
      plugin_.description = description != nullptr ? description : "";
      plugin_.factories = factories_.data();
      plugin_.factory_count = factories_.size();
      ok_ = true;
    } catch (...) {
      report_declaration_error(name, current_exception_message());
    }
  }

  const loom_plugin_v1* get() const noexcept { return ok_ ? &plugin_ : nullptr; }

 private:
  static bool valid_name(const char* name) {
    if (name == nullptr || *name == '\0') return false;
    for (const char* c = name; *c != '\0'; ++c) {
      if (!((*c >= 'a' && *c <= 'z') || (*c >= '0' && *c <= '9') || *c == '_')) return false;
    }
    return true;
  }

  std::vector<const loom_factory*> factories_;
  loom_plugin_v1 plugin_{};
  bool ok_ = false;
};

}  // namespace detail

// The factory for class T, which derives from exactly one kind base class (loom::sdk::Optimizer,
// Comm, Codec, Curriculum, Sampler, Router, Moe, Quantizer, or any kind whose
// loom/sdk/kinds/NAME.hpp is included).
template <class T>
FactoryFn factory() {
  static_assert(detail::HasOneKind<T>,
                "derive the plugin class from exactly one kind base class (loom::sdk::Optimizer, "
                "Comm, Codec, Curriculum, Sampler, Router, Moe, Quantizer, ...: each declared "
                "in its loom/sdk/kinds/NAME.hpp)");
  static_assert(std::is_constructible_v<T, Context&>,
                "the plugin class needs a constructor taking loom::sdk::Context&");
  return [] { return static_cast<const loom_factory*>(&detail::factory_storage<T>().factory); };
}

}  // namespace loom::sdk

// Defines the plugin's one exported symbol. The arguments after the description are
// loom::sdk::factory<T>() for each kind the plugin provides. Use once per plugin, at
// namespace scope in one source file, followed by a semicolon.
#define LOOM_PLUGIN(name, version, description, ...)                                 \
  extern "C" LOOM_EXPORT const loom_plugin_v1* loom_plugin_entry_v1(void) noexcept { \
    static const ::loom::sdk::detail::PluginStorage loom_sdk_plugin_storage(         \
        name, version, description, {__VA_ARGS__});                                  \
    return loom_sdk_plugin_storage.get();                                            \
  }                                                                                  \
  static_assert(true, "LOOM_PLUGIN(...) is followed by a semicolon")

// The kinds of SDK 1.5, frozen: a plugin written against 1.5 reached every kind through this
// header and still does. A new kind is included by its own header only, never added here.
#include <loom/sdk/kinds/codec.hpp>       // IWYU pragma: export
#include <loom/sdk/kinds/comm.hpp>        // IWYU pragma: export
#include <loom/sdk/kinds/curriculum.hpp>  // IWYU pragma: export
#include <loom/sdk/kinds/moe.hpp>         // IWYU pragma: export
#include <loom/sdk/kinds/optimizer.hpp>   // IWYU pragma: export
#include <loom/sdk/kinds/quantizer.hpp>   // IWYU pragma: export
#include <loom/sdk/kinds/router.hpp>      // IWYU pragma: export
#include <loom/sdk/kinds/sampler.hpp>     // IWYU pragma: export

#endif  // LOOM_SDK_PLUGIN_HPP
