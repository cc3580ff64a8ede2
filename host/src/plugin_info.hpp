// What a loaded plugin provides, as the rest of the host sees it.
#pragma once

#include <loom/abi.h>

#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace loom::host {

// One kind a plugin provides, with every struct copied to this host's full size
// (fields a smaller, older struct lacks are zero).
struct FactoryInfo {
  std::string kind;
  std::vector<loom_param_spec> specs;
  loom_factory raw{};

  [[nodiscard]] const loom_param_spec* find_spec(std::string_view name) const;

  // The factory's entries, preferring the args-struct versions (1.2) when the plugin has
  // them and falling back to the positional ones of plugins built against 1.0 / 1.1.
  // Unguarded: callers wrap them in guarded_call.
  [[nodiscard]] loom_status* create(const loom_host_services* host, void** out_instance) const;
  [[nodiscard]] bool has_import_state() const;
  [[nodiscard]] loom_status* import_state(void* instance, const void* data, size_t bytes) const;
};

struct PluginInfo {
  std::string name;
  std::string version;
  std::string description;
  std::filesystem::path path;
  uint32_t abi_major = 0;
  uint32_t abi_minor = 0;
  std::vector<FactoryInfo> factories;

  [[nodiscard]] const FactoryInfo* find_factory(std::string_view kind) const;
  // "plugin 'name' (path)" for messages.
  [[nodiscard]] std::string label() const;
};

}  // namespace loom::host
