// A minimal host for fuzz targets: makes instances of SDK plugins whose sources are compiled
// into the target (plugin_entries.cpp renames each entry function), without libloom and
// without dlopen, so the plugin code runs instrumented. Parameters are the schema's defaults
// with overrides; references point at other instances made here. One rank, no thread pool
// (parallel_for runs inline), host memory only.
#pragma once

#include <loom/abi.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace loom_fuzz {

// A status's message ("" for success), destroying it.
inline std::string take(loom_status* st) {
  if (st == nullptr) return "";
  std::string m = st->message != nullptr ? st->message : "(no message)";
  st->destroy(st);
  return m.empty() ? "(empty message)" : m;
}

// One parameter override: the value replaces the schema's default for `name`.
struct Override {
  std::string name;
  loom_value value;
};

inline loom_value int_value(int64_t v) {
  loom_value x{};
  x.struct_size = LOOM_VALUE_SIZE;
  x.type = LOOM_PARAM_INT;
  x.int_value = v;
  return x;
}
inline loom_value float_value(double v) {
  loom_value x{};
  x.struct_size = LOOM_VALUE_SIZE;
  x.type = LOOM_PARAM_FLOAT;
  x.float_value = v;
  return x;
}
inline loom_value bool_value(bool v) {
  loom_value x{};
  x.struct_size = LOOM_VALUE_SIZE;
  x.type = LOOM_PARAM_BOOL;
  x.int_value = v ? 1 : 0;  // BOOL travels as int_value
  return x;
}
inline loom_value string_value(const char* s) {
  loom_value x{};
  x.struct_size = LOOM_VALUE_SIZE;
  x.type = LOOM_PARAM_STRING;
  x.string_value = s;
  return x;
}

class Instance {
 public:
  Instance() = default;
  // An instance of the plugin's factory of `kind`; aborts when it cannot be made (the
  // fuzz target's setup is wrong, not the input).
  Instance(const loom_plugin_v1* plugin, const char* kind, const char* name,
           const std::vector<Override>& overrides)
      : name_(name) {
    if (plugin == nullptr) fail("no plugin", "");
    for (size_t i = 0; i < plugin->factory_count; ++i) {
      if (std::strcmp(plugin->factories[i]->kind, kind) == 0) factory_ = plugin->factories[i];
    }
    if (factory_ == nullptr) fail("no factory of kind", kind);
    params_.resize(factory_->param_count);
    for (size_t i = 0; i < factory_->param_count; ++i) {
      const loom_param_spec& s = factory_->param_specs[i];
      params_[i].struct_size = LOOM_PARAM_SIZE;
      params_[i].name = s.name;
      params_[i].value = s.default_value;
      params_[i].value.struct_size = LOOM_VALUE_SIZE;
      params_[i].value.type = s.type;
      bool set = false;
      for (const Override& o : overrides) {
        if (o.name == s.name) {
          params_[i].value = o.value;
          set = true;
        }
      }
      if (s.required != 0 && !set) fail("required parameter not given", s.name);
    }
    services_.struct_size = LOOM_HOST_SERVICES_SIZE;
    services_.abi_major = LOOM_ABI_MAJOR;
    services_.abi_minor = LOOM_ABI_MINOR;
    services_.host_ctx = this;
    services_.instance_name = name_.c_str();
    services_.log = [](void*, int32_t, const char*) {};
    services_.log_enabled = [](void*, int32_t) -> int32_t { return 0; };
    services_.host_alloc = [](void*, size_t bytes, size_t align) -> void* {
      if (align == 0) align = 64;
      return std::aligned_alloc(align, (bytes + align - 1) / align * align + align);
    };
    services_.host_free = [](void*, void* p) { std::free(p); };
    services_.device_alloc = [](void* ctx, DLDevice device, size_t bytes, void*,
                                void** out) -> loom_status* {
      if (device.device_type != kDLCPU) {
        fail("device memory asked of the fuzz host", static_cast<Instance*>(ctx)->name_.c_str());
      }
      *out = std::aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
      return nullptr;
    };
    services_.device_free = [](void*, DLDevice, void* p, void*) -> loom_status* {
      std::free(p);
      return nullptr;
    };
    bootstrap_.struct_size = LOOM_BOOTSTRAP_SIZE;
    bootstrap_.rank = 0;
    bootstrap_.size = 1;
    bootstrap_.local_rank = 0;
    bootstrap_.allgather = [](void*, const void* send, size_t bytes, void* recv) -> loom_status* {
      if (bytes != 0) std::memmove(recv, send, bytes);
      return nullptr;
    };
    bootstrap_.barrier = [](void*) -> loom_status* { return nullptr; };
    services_.bootstrap = &bootstrap_;
    services_.params = params_.data();
    services_.param_count = params_.size();
    if (factory_->validate != nullptr) {
      loom_validate_args v{};
      v.struct_size = LOOM_VALIDATE_ARGS_SIZE;
      v.params = params_.data();
      v.param_count = params_.size();
      v.instance_name = name_.c_str();
      v.bad_param = -1;
      const std::string e = take(factory_->validate(&v));
      if (!e.empty()) fail("validate", e.c_str());
    }
    loom_create_args a{};
    a.struct_size = LOOM_CREATE_ARGS_SIZE;
    a.host = &services_;
    const std::string e = take(factory_->create_with_args(&a, &object_));
    if (!e.empty()) fail("create", e.c_str());
  }
  ~Instance() {
    if (object_ != nullptr) factory_->destroy(object_);
  }
  // Kept in place: the services table and parameters are borrowed by the instance.
  Instance(const Instance&) = delete;
  Instance& operator=(const Instance&) = delete;

  void* object() const { return object_; }
  const void* vtable() const { return factory_->vtable; }
  template <class Table>
  const Table* table() const {
    return static_cast<const Table*>(factory_->vtable);
  }
  // A reference to this instance, for another's parameter.
  loom_value ref() const {
    loom_value v{};
    v.struct_size = LOOM_VALUE_SIZE;
    v.type = LOOM_PARAM_REF;
    v.string_value = name_.c_str();
    v.ref_instance = object_;
    v.ref_vtable = factory_->vtable;
    return v;
  }

  // "" on success, else the error message.
  std::string import_state(const void* data, size_t bytes) {
    loom_import_state_args a{};
    a.struct_size = LOOM_IMPORT_STATE_ARGS_SIZE;
    a.data = data;
    a.bytes = bytes;
    return take(factory_->import_state_with_args(object_, &a));
  }
  // The exported blob; aborts on an export error (nothing in the input makes one).
  std::vector<uint8_t> export_state() {
    std::vector<uint8_t> out;
    loom_state_writer w{};
    w.struct_size = LOOM_STATE_WRITER_SIZE;
    w.ctx = &out;
    w.write = [](void* ctx, const void* data, size_t bytes) -> loom_status* {
      auto* v = static_cast<std::vector<uint8_t>*>(ctx);
      const auto* b = static_cast<const uint8_t*>(data);
      v->insert(v->end(), b, b + bytes);
      return nullptr;
    };
    const std::string e = take(factory_->export_state(object_, &w));
    if (!e.empty()) fail("export_state", e.c_str());
    return out;
  }

  [[noreturn]] static void fail(const char* what, const char* detail) {
    std::fprintf(stderr, "fuzz host: %s: %s\n", what, detail);
    std::abort();
  }

 private:
  std::string name_;
  const loom_factory* factory_ = nullptr;
  std::vector<loom_param> params_;
  loom_host_services services_{};
  loom_bootstrap bootstrap_{};
  void* object_ = nullptr;
};

}  // namespace loom_fuzz
