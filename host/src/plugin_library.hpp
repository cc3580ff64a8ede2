// Loading plugin libraries and reading what they provide, normalised to this host's
// view of ABI v1 (one adapter here, so the rest of the host never branches on versions).
#pragma once

#include <loom/abi.h>

#include "plugin_info.hpp"

#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace loom::host {

// Loads `path` (once per process; libraries stay loaded until exit so no instance or
// exception can outlive its code) and returns what it provides. Throws loom::host::Error
// with a message naming the file when the file is not a usable plugin.
std::shared_ptr<const PluginInfo> load_plugin(const std::filesystem::path& path);

// The file name a plugin called `name` has: loom_<name>.so.
std::string plugin_file_name(std::string_view name);

// Where plugins are looked for, in order, and finding them by name.
class PluginCatalog {
 public:
  explicit PluginCatalog(std::vector<std::filesystem::path> dirs) : dirs_(std::move(dirs)) {}

  // The search path: `first` (already absolute), then `extra` (':'-separated), then
  // LOOM_PLUGIN_PATH, then the install's plugin folder beside libloom.
  static std::vector<std::filesystem::path> search_path(
      const std::vector<std::filesystem::path>& first, std::string_view extra);
  // <dir of libloom>/loom/plugins.
  static std::filesystem::path bundled_dir();

  [[nodiscard]] const std::vector<std::filesystem::path>& dirs() const { return dirs_; }
  // The first loom_<name>.so on the search path, or an empty path.
  [[nodiscard]] std::filesystem::path locate(std::string_view name) const;
  // Names of every loom_*.so on the search path (without loading them).
  [[nodiscard]] std::vector<std::string> available_names() const;
  // Every loom_*.so on the search path, first occurrence of each name.
  [[nodiscard]] std::vector<std::filesystem::path> available_files() const;
  // Loads the named plugin; throws loom::host::Error (NOT_FOUND with a did-you-mean when
  // it is not on the search path).
  [[nodiscard]] std::shared_ptr<const PluginInfo> load(std::string_view name) const;

 private:
  std::vector<std::filesystem::path> dirs_;
};

// Minimum sizes: a struct may omit trailing optional fields; these are the smallest
// sizes that still hold every mandatory field.
uint32_t min_vtable_size(std::string_view kind);

}  // namespace loom::host
