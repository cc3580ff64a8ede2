#include "plugin_info.hpp"

namespace loom::host {

const loom_param_spec* FactoryInfo::find_spec(std::string_view name) const {
  for (const auto& s : specs) {
    if (name == s.name) return &s;
  }
  return nullptr;
}

const FactoryInfo* PluginInfo::find_factory(std::string_view kind) const {
  for (const auto& f : factories) {
    if (f.kind == kind) return &f;
  }
  return nullptr;
}

std::string PluginInfo::label() const { return "plugin '" + name + "' (" + path.string() + ")"; }

}  // namespace loom::host
