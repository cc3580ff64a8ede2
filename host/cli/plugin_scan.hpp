// Describing plugins out of process: `loom plugins` and `loom describe` load each plugin file
// in a child (`loom __scan-plugin FILE`), and `loom check` loads the plugins a manifest names
// there first, so a plugin whose loading crashes, hangs or exits is reported by name and the
// command goes on.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

namespace loom_scan {

// What one child made of one plugin file: the document loom_describe_plugins gives for it
// ("plugins" and "errors"), or, when the child did not finish, why (e.g. "the plugin crashed
// while loading (SIGSEGV)").
struct Scan {
  bool ok = false;
  nlohmann::json doc;
  std::string problem;
};
Scan scan_file(const std::string& file);

// loom_describe_plugins's document, the same bytes for plugins that load, with each file
// loaded in a child: a file whose child did not finish is in "errors" with the reason
// ("FILE: REASON; skipped" when listing every plugin). `rc`: LOOM_OK, or an error code when the
// named plugin could not be described.
nlohmann::json describe_isolated(const char* name, const std::string& plugin_path, int32_t* rc);

// `loom __scan-plugin FILE`: prints FILE's description document on stdout, exit 0.
int scan_plugin_main(const std::string& file);

// Loads, each in a child, the plugins the manifest names (searched as the host searches them:
// its [loom] plugin_path, then `plugin_path`, LOOM_PLUGIN_PATH and the bundled folder). False,
// with a line on stderr for each, when one of them crashed, hung or exited; a manifest that
// does not parse, or a plugin that cannot be found, is left to the check itself.
bool prescan_manifest(const std::string& manifest, const std::string& plugin_path);

// The same for the manifest a trainer config names in [manifest] path.
bool prescan_trainer_config(const std::string& config, const std::string& plugin_path);

// "NAME" for a file named loom_NAME.so, else "".
std::string plugin_name_of(const std::string& file);

// The plugin files on the search path (loom_list_plugin_files): every one, or `name`'s.
nlohmann::json list_files(const char* name, const std::string& plugin_path);

}  // namespace loom_scan
