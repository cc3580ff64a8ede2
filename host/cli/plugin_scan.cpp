#include "plugin_scan.hpp"

#include <loom/embed.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <loom_cli_support.hpp>
#include <loom_toml.hpp>  // toml++, patched for bad input
#include <set>

#include "child_process.hpp"

namespace loom_scan {
namespace {

namespace fs = std::filesystem;

constexpr int kExitError = 1;

nlohmann::json empty_doc() {
  return {{"plugins", nlohmann::json::array()}, {"errors", nlohmann::json::array()}};
}

// What `loom plugins` did before plugins were loaded out of process; still the way when there
// is nothing to load or no way to start a child.
nlohmann::json describe_in_process(const char* name, const std::string& plugin_path, int32_t* rc) {
  char* raw = nullptr;
  *rc = loom_describe_plugins(name, plugin_path.empty() ? nullptr : plugin_path.c_str(), &raw);
  if (raw == nullptr) return empty_doc();
  auto doc = nlohmann::json::parse(raw);
  loom_free_string(raw);
  return doc;
}

// `plugin_path` with `more` after it, ':'-separated.
void append_path(std::string& path, const std::string& more) {
  if (!more.empty()) path += (path.empty() ? "" : ":") + more;
}

}  // namespace

std::string plugin_name_of(const std::string& file) {
  const std::string f = fs::path(file).filename().string();
  if (f.size() <= 8 || f.rfind("loom_", 0) != 0 || f.compare(f.size() - 3, 3, ".so") != 0) {
    return {};
  }
  return f.substr(5, f.size() - 8);
}

nlohmann::json list_files(const char* name, const std::string& plugin_path) {
  char* raw = nullptr;
  if (loom_list_plugin_files(name, plugin_path.empty() ? nullptr : plugin_path.c_str(), &raw) !=
          LOOM_OK ||
      raw == nullptr) {
    return nullptr;
  }
  auto doc = nlohmann::json::parse(raw);
  loom_free_string(raw);
  return doc;
}

Scan scan_file(const std::string& file) {
  using End = loom_child::Run::End;
  Scan s;
  const double limit = loom_child::time_limit_s();
  const auto run = loom_child::run_self({"__scan-plugin", file}, limit);
  switch (run.end) {
    case End::kNotStarted:
      s.problem = "cannot load it in a child process: " + run.why;
      return s;
    case End::kSignaled:
      s.problem = "the plugin crashed while loading (" + loom_child::signal_name(run.code) + ")";
      return s;
    case End::kTimedOut:
      s.problem = "the plugin did not finish loading within " + loom_cli::number(limit) +
                  " s (LOOM_SCAN_TIMEOUT sets the limit) and was stopped";
      return s;
    case End::kExited:
      break;
  }
  if (run.code == 0) {
    auto doc = nlohmann::json::parse(run.out, nullptr, false);
    if (doc.is_object() && doc.contains("plugins") && doc["plugins"].is_array() &&
        doc.contains("errors") && doc["errors"].is_array()) {
      s.ok = true;
      s.doc = std::move(doc);
      return s;
    }
  }
  // The child prints its document last, and a plain failure of its own prints a message on
  // stderr and exits 1: anything else ended it from inside the plugin.
  s.problem = "the process exited with status " + std::to_string(run.code) +
              " while loading the plugin" + (run.code == 0 ? ", before describing it" : "") +
              " (the plugin called exit?)";
  return s;
}

nlohmann::json describe_isolated(const char* name, const std::string& plugin_path, int32_t* rc) {
  *rc = LOOM_OK;
  const auto listed = list_files(name, plugin_path);
  // Nothing to load (an unknown name: the library's message says what was searched), or no
  // child to load it in.
  if (!listed.is_object() || (name != nullptr && listed["files"].empty()) ||
      loom_child::self_path().empty()) {
    return describe_in_process(name, plugin_path, rc);
  }
  nlohmann::json doc{{"search_path", listed["search_path"]},
                     {"plugins", nlohmann::json::array()},
                     {"errors", nlohmann::json::array()}};
  for (const auto& f : listed["files"]) {
    const std::string file = f.get<std::string>();
    const Scan s = scan_file(file);
    if (s.ok) {
      for (const auto& p : s.doc["plugins"]) doc["plugins"].push_back(p);
      for (const auto& e : s.doc["errors"]) doc["errors"].push_back(e);
    } else {
      doc["errors"].push_back(
          {{"path", file},
           {"error", file + ": " + s.problem + (name == nullptr ? "; skipped" : "")}});
    }
  }
  if (name != nullptr && doc["plugins"].empty()) *rc = LOOM_ERR_UNAVAILABLE;
  return doc;
}

int scan_plugin_main(const std::string& file) {
  const int results = loom_child::take_stdout();
  const fs::path path = fs::absolute(file);
  const std::string name = plugin_name_of(path.string());
  if (name.empty()) {
    std::cerr << "loom __scan-plugin: " << file << " is not named loom_NAME.so\n";
    return kExitError;
  }
  // Looked up by name, its folder first on the search path: the lookup and the messages of
  // `loom plugins` in process. The folder is the working directory, so a ':' in its path
  // cannot split it.
  if (::chdir(path.parent_path().c_str()) != 0) {
    std::cerr << "loom __scan-plugin: " << path.parent_path().string() << ": "
              << std::strerror(errno) << "\n";
    return kExitError;
  }
  char* raw = nullptr;
  (void)loom_describe_plugins(name.c_str(), ".", &raw);
  if (raw == nullptr) {
    std::cerr << "loom __scan-plugin: " << loom_last_error() << "\n";
    return kExitError;
  }
  auto doc = nlohmann::json::parse(raw);
  loom_free_string(raw);
  doc.erase("search_path");
  for (auto& e : doc["errors"]) e["path"] = path.string();  // as listed, not through "./"
  loom_child::write_all(results, doc.dump() + "\n");
  return 0;
}

bool prescan_manifest(const std::string& manifest, const std::string& plugin_path) {
  auto parsed = toml::parse_file(manifest);
  if (!parsed) return true;
  const toml::table& root = parsed.table();
  std::error_code ec;
  const fs::path dir = fs::absolute(manifest, ec).parent_path();
  // The search path as the host builds it for this manifest.
  std::string path;
  if (const auto* entries = root["loom"]["plugin_path"].as_array(); entries != nullptr) {
    for (const auto& e : *entries) {
      if (const auto s = e.value<std::string>(); s) {
        const fs::path p(*s);
        append_path(path, (p.is_absolute() ? p : (dir / p).lexically_normal()).string());
      }
    }
  }
  append_path(path, plugin_path);
  std::set<std::string> names;
  for (const auto& [section, node] : root) {
    const auto* instances = node.as_table();
    if (section.str() == "loom" || instances == nullptr) continue;
    for (const auto& [instance, decl] : *instances) {
      const auto* t = decl.as_table();
      if (t == nullptr) continue;
      if (const auto plugin = (*t)["plugin"].value<std::string>(); plugin) names.insert(*plugin);
    }
  }
  bool ok = true;
  for (const auto& name : names) {
    const auto listed = list_files(name.c_str(), path);
    if (!listed.is_object() || listed["files"].empty()) continue;
    const std::string file = listed["files"][0].get<std::string>();
    if (const Scan s = scan_file(file); !s.ok) {
      std::cerr << "loom check: " << manifest << ": plugin '" << name << "' (" << file
                << "): " << s.problem << "\n";
      ok = false;
    }
  }
  return ok;
}

bool prescan_trainer_config(const std::string& config, const std::string& plugin_path) {
  auto parsed = toml::parse_file(config);
  if (!parsed) return true;
  const auto manifest = parsed.table()["manifest"]["path"].value<std::string>();
  if (!manifest || manifest->empty()) return true;  // the trainer's check says what is wrong
  fs::path p(*manifest);
  std::error_code ec;
  if (!p.is_absolute()) p = (fs::absolute(config, ec).parent_path() / p).lexically_normal();
  return prescan_manifest(p.string(), plugin_path);
}

}  // namespace loom_scan
