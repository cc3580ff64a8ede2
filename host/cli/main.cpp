// `loom`: list and describe plugins, check manifests. Everything goes through libloom's
// public C API, exactly as a third-party tool would use it.
#include <loom/embed.h>

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

namespace {

// Exit codes: 0 fine; 1 an operational error; 2 an invalid manifest (loom check).
constexpr int kExitError = 1;
constexpr int kExitInvalid = 2;

struct Described {
  int32_t rc = LOOM_OK;
  nlohmann::json doc;
};

Described describe(const char* name, const std::string& plugin_path) {
  char* raw = nullptr;
  Described out;
  out.rc = loom_describe_plugins(name, plugin_path.empty() ? nullptr : plugin_path.c_str(), &raw);
  if (raw == nullptr) {
    out.doc = {{"plugins", nlohmann::json::array()}, {"errors", nlohmann::json::array()}};
    return out;
  }
  out.doc = nlohmann::json::parse(raw);
  loom_free_string(raw);
  return out;
}

std::string join(const std::vector<std::string>& items, const char* sep) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : sep) + s;
  return out;
}

std::string value_text(const nlohmann::json& v) {
  if (v.is_null()) return "";
  if (v.is_string()) return "\"" + v.get<std::string>() + "\"";
  return v.dump();
}

void print_errors(const nlohmann::json& doc) {
  for (const auto& e : doc["errors"]) {
    std::cerr << "loom: " << e["error"].get<std::string>() << "\n";
  }
}

int cmd_plugins(bool json, const std::string& plugin_path) {
  const auto d = describe(nullptr, plugin_path);
  if (json) {
    std::cout << d.doc.dump(2) << "\n";
    return d.doc["errors"].empty() ? 0 : kExitError;
  }
  const auto& plugins = d.doc["plugins"];
  if (plugins.empty()) {
    std::cout << "no plugins found; searched: "
              << join(d.doc["search_path"].get<std::vector<std::string>>(), ":") << "\n";
  } else {
    size_t w_name = 4;
    size_t w_ver = 7;
    size_t w_kinds = 5;
    std::vector<std::string> kinds_text;
    for (const auto& p : plugins) {
      std::vector<std::string> kinds;
      for (const auto& k : p["kinds"]) kinds.push_back(k["kind"].get<std::string>());
      kinds_text.push_back(join(kinds, ","));
      w_name = std::max(w_name, p["name"].get<std::string>().size());
      w_ver = std::max(w_ver, p["version"].get<std::string>().size());
      w_kinds = std::max(w_kinds, kinds_text.back().size());
    }
    auto row = [&](const std::string& a, const std::string& b, const std::string& c,
                   const std::string& e, const std::string& f) {
      std::printf("%-*s  %-*s  %-4s  %-*s  %s\n", static_cast<int>(w_name), a.c_str(),
                  static_cast<int>(w_ver), b.c_str(), c.c_str(), static_cast<int>(w_kinds),
                  e.c_str(), f.c_str());
    };
    row("NAME", "VERSION", "ABI", "KINDS", "PATH");
    for (size_t i = 0; i < plugins.size(); ++i) {
      const auto& p = plugins[i];
      row(p["name"], p["version"], p["abi"], kinds_text[i], p["path"]);
    }
  }
  print_errors(d.doc);
  return d.doc["errors"].empty() ? 0 : kExitError;
}

int cmd_describe(const std::string& name, bool json, const std::string& plugin_path) {
  const auto d = describe(name.c_str(), plugin_path);
  if (d.rc != LOOM_OK || d.doc["plugins"].empty()) {
    print_errors(d.doc);
    return kExitError;
  }
  if (json) {
    std::cout << d.doc["plugins"][0].dump(2) << "\n";
    return 0;
  }
  const auto& p = d.doc["plugins"][0];
  std::cout << p["name"].get<std::string>() << " " << p["version"].get<std::string>();
  if (!p["description"].get<std::string>().empty()) {
    std::cout << ": " << p["description"].get<std::string>();
  }
  std::cout << "\n  file: " << p["path"].get<std::string>()
            << "\n  ABI:  " << p["abi"].get<std::string>() << "\n";
  for (const auto& k : p["kinds"]) {
    std::cout << "\n"
              << k["kind"].get<std::string>()
              << (k["has_state"].get<bool>() ? " (exports state)" : "") << "\n";
    if (k["params"].empty()) {
      std::cout << "  (no parameters)\n";
      continue;
    }
    for (const auto& prm : k["params"]) {
      std::string line = "  " + prm["name"].get<std::string>() + " (" +
                         prm["type_phrase"].get<std::string>() + ")";
      if (prm["required"].get<bool>()) {
        line += ", required";
      } else if (prm["default"].is_null()) {
        line += ", optional";
      } else {
        line += ", default " + value_text(prm["default"]);
      }
      if (prm.contains("min") && (!prm["min"].is_null() || !prm["max"].is_null())) {
        line += ", range [" + (prm["min"].is_null() ? std::string("-inf") : prm["min"].dump()) +
                ", " + (prm["max"].is_null() ? std::string("inf") : prm["max"].dump()) + "]";
      }
      if (prm.contains("choices")) {
        line += ", one of " + join(prm["choices"].get<std::vector<std::string>>(), "|");
      }
      std::cout << line << "\n      " << prm["doc"].get<std::string>() << "\n";
    }
  }
  return 0;
}

int cmd_check(const std::string& manifest, const std::string& plugin_path) {
  loom_open_options opts{};
  opts.struct_size = LOOM_OPEN_OPTIONS_SIZE;
  opts.validate_only = 1;
  opts.plugin_path = plugin_path.empty() ? nullptr : plugin_path.c_str();
  opts.log_level = LOOM_LOG_WARN;
  loom_session* session = nullptr;
  if (loom_open_file(manifest.c_str(), &opts, &session) != LOOM_OK) {
    std::cerr << loom_last_error() << "\n";
    return kExitInvalid;
  }
  loom_close(session);
  std::cout << manifest << ": ok\n";
  return 0;
}

}  // namespace

// Runs the program `name` installed beside `loom`, with `args`. Benchmarks and the reference
// trainer link what they need (MPI, BLAS) and the CLI need not: it stays a client of
// libloom only. `what` names the command in messages.
int exec_beside(const std::string& name, const std::vector<std::string>& args,
                const std::string& what) {
  std::error_code ec;
  const auto self = std::filesystem::canonical("/proc/self/exe", ec);
  const auto dir = ec ? std::filesystem::path(".") : self.parent_path();
  const auto program = dir / name;
  if (!std::filesystem::exists(program, ec)) {
    std::vector<std::string> known;
    for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
      const std::string f = e.path().filename().string();
      if (f.rfind("loom-", 0) == 0) known.push_back(f);
    }
    std::sort(known.begin(), known.end());
    std::cerr << "loom " << what << ": " << program.string() << " is not installed"
              << "; programs beside loom: " << (known.empty() ? "none" : join(known, ", ")) << "\n";
    return kExitError;
  }
  std::vector<std::string> storage{program.string()};
  storage.insert(storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  argv.reserve(storage.size() + 1);
  for (auto& a : storage) argv.push_back(a.data());
  argv.push_back(nullptr);
  ::execv(program.c_str(), argv.data());
  std::cerr << "loom " << what << ": cannot run " << program.string() << ": "
            << std::strerror(errno) << "\n";
  return kExitError;
}

int main(int argc, char** argv) {
  CLI::App app{"loom: a plugin host for training-efficiency techniques"};
  app.require_subcommand(0, 1);
  bool version = false;
  app.add_flag("--version", version, "Print the version and the plugin ABI it speaks");
  std::string plugin_path;

  auto* plugins = app.add_subcommand("plugins", "List the plugins on the search path");
  bool plugins_json = false;
  plugins->add_flag("--json", plugins_json, "Print JSON");
  plugins->add_option("--plugin-path", plugin_path,
                      "Extra plugin folders (':'-separated), searched first");

  auto* desc = app.add_subcommand("describe", "Print a plugin's kinds and parameters");
  std::string desc_name;
  bool desc_json = false;
  desc->add_option("PLUGIN", desc_name, "Plugin name")->required();
  desc->add_flag("--json", desc_json, "Print JSON");
  desc->add_option("--plugin-path", plugin_path,
                   "Extra plugin folders (':'-separated), searched first");

  auto* check = app.add_subcommand("check", "Validate a manifest without running anything");
  std::string check_manifest;
  check->add_option("MANIFEST", check_manifest, "Manifest file (TOML)")->required();
  check->add_option("--plugin-path", plugin_path,
                    "Extra plugin folders (':'-separated), searched after the manifest's");

  // Handled before parsing: their arguments belong to the program they run, untouched.
  app.add_subcommand("bench", "Run a benchmark: loom bench NAME [ARGS...] (comm, optim, ...)");
  app.add_subcommand("train", "Train with the reference trainer: loom train MANIFEST [ARGS...]");
  app.add_subcommand("data", "Prepare datasets: loom data prepare [ARGS...]");
  app.add_subcommand("plot", "Plot runs: loom plot RUN_DIR... -o FILE.png");
  if (argc >= 2) {
    const std::string cmd = argv[1];
    const std::vector<std::string> rest(argv + 2, argv + argc);
    if (cmd == "bench") {
      if (rest.empty()) {
        std::cerr << "usage: loom bench NAME [ARGS...]\n";
        return kExitError;
      }
      return exec_beside("loom-bench-" + rest[0], {rest.begin() + 1, rest.end()}, "bench");
    }
    if (cmd == "train" || cmd == "data" || cmd == "plot") {
      return exec_beside("loom-" + cmd, rest, cmd);
    }
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    if (version) {
      std::cout << "loom " << loom_version() << " (plugin ABI " << loom_abi_major() << "."
                << loom_abi_minor() << ")\n";
      return 0;
    }
    if (plugins->parsed()) return cmd_plugins(plugins_json, plugin_path);
    if (desc->parsed()) return cmd_describe(desc_name, desc_json, plugin_path);
    if (check->parsed()) return cmd_check(check_manifest, plugin_path);

    std::cout << app.help();
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "loom: " << e.what() << "\n";
    return kExitError;
  }
}
