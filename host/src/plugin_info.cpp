#include "plugin_info.hpp"

namespace loom::host {

const loom_param_spec* FactoryInfo::find_spec(std::string_view name) const {
  for (const auto& s : specs) {
    if (name == s.name) return &s;
  }
  return nullptr;
}

loom_status* FactoryInfo::create(const loom_host_services* host, void** out_instance) const {
  if (raw.create_with_args != nullptr) {
    loom_create_args args{};
    args.struct_size = LOOM_CREATE_ARGS_SIZE;
    args.host = host;
    return raw.create_with_args(&args, out_instance);
  }
  return raw.create(host, out_instance);
}

bool FactoryInfo::has_import_state() const {
  return raw.import_state_with_args != nullptr || raw.import_state != nullptr;
}

loom_status* FactoryInfo::import_state(void* instance, const void* data, size_t bytes) const {
  if (raw.import_state_with_args != nullptr) {
    loom_import_state_args args{};
    args.struct_size = LOOM_IMPORT_STATE_ARGS_SIZE;
    args.data = data;
    args.bytes = bytes;
    return raw.import_state_with_args(instance, &args);
  }
  return raw.import_state(instance, data, bytes);
}

const FactoryInfo* PluginInfo::find_factory(std::string_view kind) const {
  for (const auto& f : factories) {
    if (f.kind == kind) return &f;
  }
  return nullptr;
}

std::string PluginInfo::label() const { return "plugin '" + name + "' (" + path.string() + ")"; }

}  // namespace loom::host
