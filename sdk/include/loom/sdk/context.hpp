// Context: an instance's typed view of the host services (parameters, logging, job,
// memory), and InstanceRef: a borrowed handle to another instance named by a REF parameter.
#ifndef LOOM_SDK_CONTEXT_HPP
#define LOOM_SDK_CONTEXT_HPP

#include <loom/abi.h>
#include <loom/sdk/status.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

// True when the struct at `ptr` (which starts with struct_size) is large enough to hold
// `field`. Fields beyond struct_size come from a newer ABI minor than the sender's and
// must be treated as absent. `sizeof` does not evaluate its operand, so nothing is read.
#define LOOM_SDK_HAS_FIELD(ptr, field)                                                 \
  ::loom::sdk::detail::covers(                                                         \
      (ptr), offsetof(std::remove_cv_t<std::remove_pointer_t<decltype(ptr)>>, field) + \
                 sizeof(decltype((ptr)->field)))

// `ptr->field` when present, else `fallback`.
#define LOOM_SDK_FIELD_OR(ptr, field, fallback) \
  (LOOM_SDK_HAS_FIELD(ptr, field) ? (ptr)->field : (fallback))

namespace loom::sdk {
namespace detail {

template <class Struct>
constexpr bool covers(const Struct* s, std::size_t end) noexcept {
  return s != nullptr && static_cast<std::size_t>(s->struct_size) >= end;
}

inline const char* type_name(int32_t type) noexcept {
  switch (type) {
    case LOOM_PARAM_BOOL:
      return "bool";
    case LOOM_PARAM_INT:
      return "int";
    case LOOM_PARAM_FLOAT:
      return "float";
    case LOOM_PARAM_STRING:
      return "string";
    case LOOM_PARAM_INT_LIST:
      return "int list";
    case LOOM_PARAM_FLOAT_LIST:
      return "float list";
    case LOOM_PARAM_STRING_LIST:
      return "string list";
    case LOOM_PARAM_REF:
      return "reference";
    default:
      return "unknown type";
  }
}

}  // namespace detail

// Another instance, as a REF parameter delivered it: borrowed from the host for the lifetime
// of the instance that holds the reference. VTable is the kind's table, e.g. loom_comm_v1.
template <class VTable>
class InstanceRef {
 public:
  InstanceRef() = default;
  InstanceRef(std::string name, void* instance, const VTable* vtable)
      : name_(std::move(name)), instance_(instance), vtable_(vtable) {}

  explicit operator bool() const { return instance_ != nullptr && vtable_ != nullptr; }
  const std::string& name() const { return name_; }
  void* instance() const { return instance_; }
  const VTable* vtable() const { return vtable_; }

  // True when the referenced plugin's table has `fn` (within its struct_size) and sets it.
  template <class Fn>
  bool provides(Fn VTable::*fn) const {
    if (vtable_ == nullptr) return false;
    const auto* base = reinterpret_cast<const char*>(vtable_);
    const auto* member = reinterpret_cast<const char*>(&(vtable_->*fn));
    const std::size_t end = static_cast<std::size_t>(member - base) + sizeof(Fn);
    return detail::covers(vtable_, end) && vtable_->*fn != nullptr;
  }

  // Calls `fn(instance, args...)`. A returned status is checked (thrown as Error, message
  // prefixed with the instance's name); any other return value is passed through. A
  // function the referenced plugin lacks throws Error(UNIMPLEMENTED).
  template <class R, class... Params, class... Args>
  std::conditional_t<std::is_same_v<R, loom_status*>, void, R> call(R (*VTable::*fn)(void*,
                                                                                     Params...),
                                                                    Args&&... args) const {
    if (!*this) throw Error(LOOM_ERR_FAILED_PRECONDITION, "reference is not set");
    if (!provides(fn)) {
      throw Error(LOOM_ERR_UNIMPLEMENTED,
                  "instance '" + name_ + "' does not provide the requested function");
    }
    if constexpr (std::is_same_v<R, loom_status*>) {
      check((vtable_->*fn)(instance_, std::forward<Args>(args)...), "instance '" + name_ + "'");
    } else {
      return (vtable_->*fn)(instance_, std::forward<Args>(args)...);
    }
  }

 private:
  std::string name_;
  void* instance_ = nullptr;
  const VTable* vtable_ = nullptr;
};

// What an instance gets from the host. Cheap to copy (one pointer); valid while the
// instance lives, because the host keeps `host` valid until destroy returns.
class Context {
 public:
  explicit Context(const loom_host_services* host) : host_(host) {
    if (host_ == nullptr) throw Error(LOOM_ERR_INVALID_ARGUMENT, "host services are NULL");
    if (host_->abi_major != LOOM_ABI_MAJOR) {
      throw Error(LOOM_ERR_ABI_MISMATCH, "host speaks ABI major " +
                                             std::to_string(host_->abi_major) + ", plugin " +
                                             std::to_string(LOOM_ABI_MAJOR));
    }
  }

  const loom_host_services* raw() const { return host_; }
  uint16_t host_abi_minor() const { return host_->abi_minor; }
  std::string instance_name() const {
    const char* name = LOOM_SDK_FIELD_OR(host_, instance_name, nullptr);
    return name != nullptr ? name : "";
  }

  // ---- parameters: by name; throw Error(INVALID_ARGUMENT) naming the parameter when it
  // is missing or of another type.

  bool has(std::string_view name) const { return find(name) != nullptr; }

  // The raw value, for what the typed getters do not cover.
  const loom_value& value(std::string_view name) const { return lookup(name, 0); }

  bool get_bool(std::string_view name) const {
    return lookup(name, LOOM_PARAM_BOOL).int_value != 0;
  }
  int64_t get_int(std::string_view name) const { return lookup(name, LOOM_PARAM_INT).int_value; }
  double get_float(std::string_view name) const {
    return lookup(name, LOOM_PARAM_FLOAT).float_value;
  }
  std::string get_string(std::string_view name) const {
    const loom_value& v = lookup(name, LOOM_PARAM_STRING);
    return v.string_value != nullptr ? v.string_value : "";
  }
  std::vector<int64_t> get_int_list(std::string_view name) const {
    const loom_value& v = lookup(name, LOOM_PARAM_INT_LIST);
    if (v.count == 0) return {};
    return std::vector<int64_t>(v.int_list, v.int_list + v.count);
  }
  std::vector<double> get_float_list(std::string_view name) const {
    const loom_value& v = lookup(name, LOOM_PARAM_FLOAT_LIST);
    if (v.count == 0) return {};
    return std::vector<double>(v.float_list, v.float_list + v.count);
  }
  std::vector<std::string> get_string_list(std::string_view name) const {
    const loom_value& v = lookup(name, LOOM_PARAM_STRING_LIST);
    std::vector<std::string> out;
    out.reserve(v.count);
    for (std::size_t i = 0; i < v.count; ++i) {
      out.emplace_back(v.string_list[i] != nullptr ? v.string_list[i] : "");
    }
    return out;
  }

  // The instance a REF parameter names; throws when the manifest left it unset.
  template <class VTable>
  InstanceRef<VTable> get_ref(std::string_view name) const {
    InstanceRef<VTable> ref = find_ref<VTable>(name);
    if (!ref) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  "parameter '" + std::string(name) + "' does not name an instance");
    }
    return ref;
  }
  // Like get_ref, but an unset optional reference gives an empty InstanceRef.
  template <class VTable>
  InstanceRef<VTable> find_ref(std::string_view name) const {
    const loom_value& v = lookup(name, LOOM_PARAM_REF);
    return InstanceRef<VTable>(v.string_value != nullptr ? v.string_value : "", v.ref_instance,
                               static_cast<const VTable*>(v.ref_vtable));
  }

  // ---- logging: never throws; a host without a logger drops the message.

  bool log_enabled(loom_log_level level) const noexcept {
    auto enabled = LOOM_SDK_FIELD_OR(host_, log_enabled, nullptr);
    if (enabled == nullptr) return LOOM_SDK_FIELD_OR(host_, log, nullptr) != nullptr;
    return enabled(host_->host_ctx, level) != 0;
  }
  void log(loom_log_level level, const std::string& message) const noexcept {
    auto write = LOOM_SDK_FIELD_OR(host_, log, nullptr);
    if (write != nullptr) write(host_->host_ctx, level, message.c_str());
  }
  void trace(const std::string& message) const noexcept { log(LOOM_LOG_TRACE, message); }
  void debug(const std::string& message) const noexcept { log(LOOM_LOG_DEBUG, message); }
  void info(const std::string& message) const noexcept { log(LOOM_LOG_INFO, message); }
  void warn(const std::string& message) const noexcept { log(LOOM_LOG_WARN, message); }
  void error(const std::string& message) const noexcept { log(LOOM_LOG_ERROR, message); }

  // ---- the job (a world of one when the host has no bootstrap).

  const loom_bootstrap* bootstrap() const { return LOOM_SDK_FIELD_OR(host_, bootstrap, nullptr); }
  int32_t rank() const { return LOOM_SDK_FIELD_OR(bootstrap(), rank, 0); }
  int32_t world_size() const { return LOOM_SDK_FIELD_OR(bootstrap(), size, 1); }
  int32_t local_rank() const { return LOOM_SDK_FIELD_OR(bootstrap(), local_rank, 0); }

  // Collective over all ranks: `recv` gets world_size() * bytes.
  void bootstrap_allgather(const void* send, std::size_t bytes, void* recv) const {
    const loom_bootstrap* b = bootstrap();
    auto fn = LOOM_SDK_FIELD_OR(b, allgather, nullptr);
    if (fn == nullptr) throw Error(LOOM_ERR_UNAVAILABLE, "the host has no bootstrap allgather");
    check(fn(b->ctx, send, bytes, recv), "bootstrap allgather");
  }
  void bootstrap_barrier() const {
    const loom_bootstrap* b = bootstrap();
    auto fn = LOOM_SDK_FIELD_OR(b, barrier, nullptr);
    if (fn == nullptr) throw Error(LOOM_ERR_UNAVAILABLE, "the host has no bootstrap barrier");
    check(fn(b->ctx), "bootstrap barrier");
  }

  // ---- memory from the host's allocators (pooled, accounted for by the host).

  // Throws Error(RESOURCE_EXHAUSTED) instead of returning NULL.
  void* host_alloc(std::size_t bytes, std::size_t align = 0) const {
    auto fn = LOOM_SDK_FIELD_OR(host_, host_alloc, nullptr);
    if (fn == nullptr) throw Error(LOOM_ERR_UNAVAILABLE, "the host has no host_alloc");
    void* p = fn(host_->host_ctx, bytes, align);
    if (p == nullptr && bytes != 0) {
      throw Error(LOOM_ERR_RESOURCE_EXHAUSTED,
                  "host_alloc of " + std::to_string(bytes) + " bytes failed");
    }
    return p;
  }
  void host_free(void* ptr) const noexcept {
    auto fn = LOOM_SDK_FIELD_OR(host_, host_free, nullptr);
    if (fn != nullptr && ptr != nullptr) fn(host_->host_ctx, ptr);
  }
  void* device_alloc(DLDevice device, std::size_t bytes, void* stream = nullptr) const {
    auto fn = LOOM_SDK_FIELD_OR(host_, device_alloc, nullptr);
    if (fn == nullptr) throw Error(LOOM_ERR_UNAVAILABLE, "the host has no device_alloc");
    void* out = nullptr;
    check(fn(host_->host_ctx, device, bytes, stream, &out), "device_alloc");
    return out;
  }
  void device_free(DLDevice device, void* ptr, void* stream = nullptr) const {
    auto fn = LOOM_SDK_FIELD_OR(host_, device_free, nullptr);
    if (fn == nullptr) throw Error(LOOM_ERR_UNAVAILABLE, "the host has no device_free");
    if (ptr != nullptr) check(fn(host_->host_ctx, device, ptr, stream), "device_free");
  }

 private:
  const loom_param* find(std::string_view name) const {
    const loom_param* params = LOOM_SDK_FIELD_OR(host_, params, nullptr);
    const std::size_t count = LOOM_SDK_FIELD_OR(host_, param_count, std::size_t{0});
    if (params == nullptr) return nullptr;
    // Stride by the host's struct_size: a newer host's loom_param may be larger than ours.
    const std::size_t stride = params[0].struct_size;
    if (stride < sizeof(loom_param)) return nullptr;  // every v1 field is mandatory
    const auto* bytes = reinterpret_cast<const unsigned char*>(params);  // NOLINT
    for (std::size_t i = 0; i < count; ++i) {
      const auto* p = reinterpret_cast<const loom_param*>(bytes + i * stride);  // NOLINT
      if (p->name != nullptr && name == p->name) return p;
    }
    return nullptr;
  }

  // type 0: any type.
  const loom_value& lookup(std::string_view name, int32_t type) const {
    const loom_param* p = find(name);
    if (p == nullptr) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT, "parameter '" + std::string(name) +
                                                 "' was not passed by the host (is it in "
                                                 "the schema?)");
    }
    if (type != 0 && p->value.type != type) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT, "parameter '" + std::string(name) + "' has type " +
                                                 detail::type_name(p->value.type) + ", not " +
                                                 detail::type_name(type));
    }
    return p->value;
  }

  const loom_host_services* host_;
};

}  // namespace loom::sdk

#endif  // LOOM_SDK_CONTEXT_HPP
