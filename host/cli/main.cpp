// `loom`: list and describe plugins, check manifests, quantize checkpoints. Everything goes through
// libloom's public C API, exactly as a third-party tool would use it.
#include <loom/embed.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <loom_cli_support.hpp>
#include <loom_toml.hpp>  // toml++, patched for bad input
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "plugin_scan.hpp"
#include "validate_plugin.hpp"

namespace {

// Exit codes: 0 fine; 1 an operational error; 2 a usage error or an invalid manifest or
// config (loom check).
constexpr int kExitError = 1;
constexpr int kExitInvalid = 2;

struct Described {
  int32_t rc = LOOM_OK;
  nlohmann::json doc;
};

// Each plugin file is loaded in a child process: one that crashes is an error, not our crash.
Described describe(const char* name, const std::string& plugin_path) {
  Described out;
  out.doc = loom_scan::describe_isolated(name, plugin_path, &out.rc);
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
              << (k["has_state"].get<bool>() ? " (exports state)" : "")
              << (k.value("has_validate", false) ? " (checks its parameters together)" : "")
              << "\n";
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
        // "(" / ")" for an exclusive bound (ABI 1.2), as in the validation messages.
        const bool lo_ex = prm.value("min_exclusive", false);
        const bool hi_ex = prm.value("max_exclusive", false);
        line += std::string(", range ") + (lo_ex ? "(" : "[") +
                (prm["min"].is_null() ? std::string("-inf") : prm["min"].dump()) + ", " +
                (prm["max"].is_null() ? std::string("inf") : prm["max"].dump()) +
                (hi_ex ? ")" : "]");
      }
      if (prm.contains("choices")) {
        line += ", one of " + join(prm["choices"].get<std::vector<std::string>>(), "|");
      }
      std::cout << line << "\n      " << prm["doc"].get<std::string>() << "\n";
    }
  }
  return 0;
}

// A trainer config (the reference trainer's TOML) has a [manifest] table naming its manifest,
// and [model] and [train] tables; a Loom manifest has none of them. Any one of them makes the
// file a trainer config, so a config with a misspelt or missing `path` still gets the
// trainer's own messages. Unreadable or unparsable files are left to libloom, which reports
// them as manifests.
bool is_trainer_config(const std::string& file) {
  auto parsed = toml::parse_file(file);
  if (!parsed) return false;
  for (const char* section : {"manifest", "model", "train"}) {
    if (parsed.table()[section].as_table() != nullptr) return true;
  }
  return false;
}

int cmd_check(const std::string& manifest, const std::string& plugin_path) {
  // The check loads the plugins in process: a plugin that crashes while loading is found in a
  // child first, and named.
  if (!loom_scan::prescan_manifest(manifest, plugin_path)) return kExitError;
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

std::string bytes_text(uint64_t b) {
  char buf[32];
  if (b < uint64_t{10} * 1024) {
    std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(b));
  } else if (b < 10ull * 1024 * 1024) {
    std::snprintf(buf, sizeof buf, "%.1f KiB", static_cast<double>(b) / 1024);
  } else {
    std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(b) / (1024.0 * 1024));
  }
  return buf;
}

// One line per tensor as it is done, warnings on stderr.
void print_quantize_report(void* /*ctx*/, const loom_quantize_report* r) {
  if (r->tensor == nullptr) {
    std::cerr << r->note << "\n";
    return;
  }
  const int width = static_cast<int>(std::to_string(r->count).size());
  std::printf("[%*llu/%llu] %s: ", width, static_cast<unsigned long long>(r->index) + 1,
              static_cast<unsigned long long>(r->count), r->tensor);
  if (r->quantizer == nullptr) {
    std::printf("copied, %s (%s)\n", bytes_text(r->bytes_in).c_str(), r->note);
  } else {
    std::printf("%s, %s -> %s (%.2fx), mse %.3g, max abs error %.3g\n", r->quantizer,
                bytes_text(r->bytes_in).c_str(), bytes_text(r->bytes_out).c_str(),
                r->bytes_out > 0
                    ? static_cast<double>(r->bytes_in) / static_cast<double>(r->bytes_out)
                    : 0.0,
                r->mse, r->max_abs_error);
  }
  std::fflush(stdout);
}

int cmd_quantize(const std::string& manifest, const std::string& in, const std::string& out,
                 const std::string& plugin_path) {
  loom_open_options opts{};
  opts.struct_size = LOOM_OPEN_OPTIONS_SIZE;
  opts.plugin_path = plugin_path.empty() ? nullptr : plugin_path.c_str();
  opts.log_level = LOOM_LOG_WARN;
  loom_session* session = nullptr;
  if (loom_open_file(manifest.c_str(), &opts, &session) != LOOM_OK) {
    std::cerr << loom_last_error() << "\n";
    return kExitInvalid;
  }
  std::cout << "loom quantize: " << in << " -> " << out << " (rules from " << manifest << ")\n";
  loom_quantize_summary summary{};
  summary.struct_size = LOOM_QUANTIZE_SUMMARY_SIZE;
  const int32_t rc = loom_quantize_file(session, in.c_str(), out.c_str(), print_quantize_report,
                                        nullptr, &summary);
  if (rc != LOOM_OK) {
    std::cerr << "loom quantize: " << loom_last_error() << "\n";
    loom_close(session);
    return kExitError;
  }
  loom_close(session);
  const double ratio = summary.out_file_bytes > 0 ? static_cast<double>(summary.in_file_bytes) /
                                                        static_cast<double>(summary.out_file_bytes)
                                                  : 0.0;
  std::printf("%llu tensors, %llu quantized; %s: %s -> %s: %s (%.2fx %s)\n",
              static_cast<unsigned long long>(summary.tensors),
              static_cast<unsigned long long>(summary.quantized), in.c_str(),
              bytes_text(summary.in_file_bytes).c_str(), out.c_str(),
              bytes_text(summary.out_file_bytes).c_str(), ratio >= 1 ? ratio : 1 / ratio,
              ratio >= 1 ? "smaller" : "larger");
  return 0;
}

// The folder of the `loom` executable, where the programs it runs are installed.
std::filesystem::path programs_dir() {
  std::error_code ec;
  const auto self = std::filesystem::canonical("/proc/self/exe", ec);
  return ec ? std::filesystem::path() : self.parent_path();  // empty: unknown, never "."
}

// The NAMEs of the loom-bench-NAME programs beside `loom`, sorted.
std::vector<std::string> installed_benchmarks() {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(programs_dir(), ec)) {
    const std::string f = e.path().filename().string();
    if (f.rfind("loom-bench-", 0) == 0 && f.size() > 11) out.push_back(f.substr(11));
  }
  std::sort(out.begin(), out.end());
  return out;
}

void print_bench_help(std::ostream& os) {
  const auto names = installed_benchmarks();
  os << "Run a benchmark: the program loom-bench-NAME installed beside loom, with ARGS.\n"
        "Usage: loom bench NAME [ARGS...]\n"
        "       loom bench NAME --help    a benchmark's options and their defaults\n\n"
        "Benchmarks installed: "
     << (names.empty() ? "none" : join(names, ", ")) << "\n";
}

// Runs the program `name` installed beside `loom`, with `args`. Benchmarks and the reference
// trainer link what they need (MPI, BLAS) and the CLI need not: it stays a client of
// libloom only. `what` names the command in messages.
int exec_beside(const std::string& name, const std::vector<std::string>& args,
                const std::string& what) {
  if (programs_dir().empty()) {
    std::cerr << "loom " << what << ": cannot tell which folder loom runs from (/proc/self/exe "
              << "is unreadable), so " << name << " cannot be found beside it\n";
    return kExitError;
  }
  const auto program = programs_dir() / name;
  std::error_code ec;
  if (!std::filesystem::exists(program, ec)) {
    if (what == "bench") {  // a benchmark name the user mistyped: a usage error
      const auto names = installed_benchmarks();
      return loom_cli::usage_error(
          "loom bench", "no benchmark '" + name.substr(11) +
                            "'; installed: " + (names.empty() ? "none" : join(names, ", ")));
    }
    std::cerr << "loom " << what << ": " << name << " is not installed beside loom (in "
              << programs_dir().string() << ")\n";
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

}  // namespace

// What this build is and speaks: the version, the plugin ABI, and the DLPack headers the
// ABI's tensors come from (abi.h includes <dlpack/dlpack.h>: an embedder or plugin author
// builds against the same DLPack, Debian's libdlpack-dev).
nlohmann::json version_document() {
#if defined(DLPACK_MAJOR_VERSION)
  const std::string dlpack =
      std::to_string(DLPACK_MAJOR_VERSION) + "." + std::to_string(DLPACK_MINOR_VERSION);
#else
  const std::string dlpack =
      std::to_string(DLPACK_VERSION / 100) + "." + std::to_string(DLPACK_VERSION / 10 % 10);
#endif
  return {{"version", loom_version()},
          {"abi", {{"major", loom_abi_major()}, {"minor", loom_abi_minor()}}},
          {"dlpack", {{"version", dlpack}, {"header", "dlpack/dlpack.h"}}}};
}

int main(int argc, char** argv) {
  CLI::App app{"loom: a plugin host for training-efficiency techniques"};
  loom_cli::configure(app, "loom");
  app.require_subcommand(0, 1);
  app.footer("Run 'loom help COMMAND' or 'loom COMMAND --help' for a command's options.");
  bool version = false;
  bool version_json = false;
  app.add_flag("--version", version, "Print the version and the plugin ABI it speaks");
  app.add_flag("--json", version_json, "With --version: print JSON (version, ABI, DLPack)");
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

  auto* check = app.add_subcommand(
      "check", "Validate a manifest, or a trainer config and its manifest, without running");
  std::string check_file;
  check->add_option("FILE", check_file, "Manifest or trainer config (TOML)")->required();
  check->add_option("--plugin-path", plugin_path,
                    "Extra plugin folders (':'-separated), searched after the manifest's");

  auto* quantize = app.add_subcommand(
      "quantize", "Quantize a safetensors checkpoint per a manifest's [[quantize]] rules");
  std::string q_manifest, q_in, q_out;
  quantize->add_option("MANIFEST", q_manifest, "Manifest with [quantizer.NAME] and [[quantize]]")
      ->required();
  quantize->add_option("IN", q_in, "The safetensors file to quantize")->required();
  quantize->add_option("OUT", q_out, "The quantized safetensors file to write")->required();
  quantize->add_option("--plugin-path", plugin_path,
                       "Extra plugin folders (':'-separated), searched after the manifest's");

  auto* validate = app.add_subcommand(
      "validate-plugin",
      "Run a plugin through load, schema, create, step, state and destroy in a child process");
  std::string validate_plugin;
  validate->add_option("PLUGIN", validate_plugin, "Plugin file (loom_NAME.so) or name")->required();
  validate->add_option("--plugin-path", plugin_path,
                       "Extra plugin folders (':'-separated), searched first");

  // Handled before parsing: their arguments belong to the program they run, untouched.
  app.add_subcommand("bench", "Run a benchmark: loom bench NAME [ARGS...] (comm, optim, ...)");
  app.add_subcommand("train", "Train with the reference trainer: loom train CONFIG [ARGS...]");
  app.add_subcommand("data", "Prepare datasets: loom data prepare [ARGS...]");
  app.add_subcommand("plot", "Plot runs: loom plot RUN_DIR... -o FILE.png|FILE.svg");
  app.add_subcommand("help", "Print this help, or a command's: loom help COMMAND");
  const std::vector<std::string> beside{"bench", "train", "data", "plot"};
  auto is_beside = [&](const std::string& c) {
    return std::find(beside.begin(), beside.end(), c) != beside.end();
  };
  if (argc >= 2) {
    const std::string cmd = argv[1];
    std::vector<std::string> rest(argv + 2, argv + argc);
    // The children `loom` runs itself to load plugin code (plugin_scan.hpp); not for users.
    if (cmd == "__scan-plugin" && rest.size() == 1) return loom_scan::scan_plugin_main(rest[0]);
    if (cmd == "__validate-plugin" && rest.size() == 1) {
      return loom_validate::validate_plugin_child(rest[0]);
    }
    if (cmd == "help") {
      if (rest.empty() || rest[0] == "help") {
        std::cout << app.help();
        return 0;
      }
      if (is_beside(rest[0])) {  // `loom help bench optim` = `loom bench optim --help`
        std::vector<std::string> args(rest.begin() + 1, rest.end());
        if (rest[0] == "bench" && args.empty()) {
          print_bench_help(std::cout);
          return 0;
        }
        if (rest[0] == "bench") {
          const std::string name = args[0];
          return exec_beside("loom-bench-" + name, {"--help"}, "bench");
        }
        args.emplace_back("--help");
        return exec_beside("loom-" + rest[0], args, rest[0]);
      }
      for (CLI::App* sub : {plugins, desc, check, quantize, validate}) {
        if (sub->get_name() == rest[0]) {  // as `loom CMD --help`
          std::string a0 = "loom", a1 = rest[0], a2 = "--help";
          char* help_argv[] = {a0.data(), a1.data(), a2.data()};
          return loom_cli::parse(app, 3, help_argv, false);
        }
      }
      return loom_cli::usage_error("loom help", "unknown command '" + rest[0] + "'");
    }
    if (cmd == "bench") {
      if (rest.empty()) {
        print_bench_help(std::cerr);
        return loom_cli::kExitUsage;
      }
      if (rest[0] == "--help" || rest[0] == "-h") {
        print_bench_help(std::cout);
        return 0;
      }
      if (rest[0].rfind('-', 0) == 0) {
        return loom_cli::usage_error("loom bench",
                                     "expected a benchmark NAME before '" + rest[0] + "'");
      }
      return exec_beside("loom-bench-" + rest[0], {rest.begin() + 1, rest.end()}, "bench");
    }
    if (is_beside(cmd)) return exec_beside("loom-" + cmd, rest, cmd);
    const auto subs = app.get_subcommands({});
    if (cmd.rfind('-', 0) != 0 && std::none_of(subs.begin(), subs.end(), [&](const CLI::App* a) {
          return a->get_name() == cmd;
        })) {
      std::string problem = "unknown command '" + cmd + "'";
      for (const CLI::App* sub : subs) {
        if (loom_text::edit_distance(cmd, sub->get_name()) <= 2) {
          problem += " (did you mean '" + sub->get_name() + "'?)";
          break;
        }
      }
      return loom_cli::usage_error("loom", problem);
    }
  }

  if (const int rc = loom_cli::parse(app, argc, argv, true); rc >= 0) return rc;
  try {
    if (version_json && !version) {
      return loom_cli::usage_error("loom", "--json without a command goes with --version");
    }
    if (version && version_json) {
      std::cout << version_document().dump(2) << "\n";
      return 0;
    }
    if (version) {
      std::cout << "loom " << loom_version() << " (plugin ABI " << loom_abi_major() << "."
                << loom_abi_minor() << ")\n";
      return 0;
    }
    if (plugins->parsed()) return cmd_plugins(plugins_json, plugin_path);
    if (desc->parsed()) return cmd_describe(desc_name, desc_json, plugin_path);
    if (quantize->parsed()) return cmd_quantize(q_manifest, q_in, q_out, plugin_path);
    if (validate->parsed()) {
      return loom_validate::validate_plugin_main(validate_plugin, plugin_path);
    }
    if (check->parsed()) {
      if (!is_trainer_config(check_file)) return cmd_check(check_file, plugin_path);
      // The trainer validates its own config (and the manifest it names): loom-train links
      // what the trainer needs, the CLI need not.
      if (!loom_scan::prescan_trainer_config(check_file, plugin_path)) return kExitError;
      std::vector<std::string> args{"--check", check_file};
      if (!plugin_path.empty()) args.insert(args.end(), {"--plugin-path", plugin_path});
      return exec_beside("loom-train", args, "check");
    }
    std::cerr << app.help();
    return loom_cli::kExitUsage;
  } catch (const std::exception& e) {
    std::cerr << "loom: " << e.what() << "\n";
    return kExitError;
  }
}
