#include "validate_plugin.hpp"

#include <loom/embed.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <loom_cli_support.hpp>
#include <nlohmann/json.hpp>
#include <regex>
#include <vector>

#include "child_process.hpp"
#include "plugin_scan.hpp"
#include "validate_steps.hpp"

namespace loom_validate {
namespace {

namespace fs = std::filesystem;

constexpr int kExitError = 1;

std::string join(const std::vector<std::string>& items, const char* sep) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : sep) + s;
  return out;
}

// The child's side of the protocol: a marker before each stage, so that the parent knows
// which stage a crash ended, then one result line.
class Reporter {
 public:
  explicit Reporter(int fd) : fd_(fd) {}
  void start(const std::string& stage) const { loom_child::write_all(fd_, "@ " + stage + "\n"); }
  void ok(const std::string& stage, const std::string& note) const {
    line(stage + ": ok" + (note.empty() ? "" : " (" + note + ")"));
  }
  void failed(const std::string& stage, const std::string& why) {
    ++failures_;
    line(stage + ": failed: " + why);
  }
  void skipped(const std::string& stage, const std::string& why) const {
    line(stage + ": skipped: " + why);
  }
  void end() const { loom_child::write_all(fd_, "@end\n"); }
  [[nodiscard]] int failures() const { return failures_; }

 private:
  // One line per result: a message that lists several errors has one per line.
  void line(std::string text) const {
    for (size_t nl = text.find('\n'); nl != std::string::npos; nl = text.find('\n', nl)) {
      text.replace(nl, 1, "; ");
    }
    loom_child::write_all(fd_, text + "\n");
  }

  int fd_;
  int failures_ = 0;
};

// loom_last_error() without the positions in the generated manifest, which nobody can open.
std::string host_error() {
  static const std::regex position(R"(<string>:[0-9]+:[0-9]+: )");
  return std::regex_replace(std::string(loom_last_error()), position, "");
}

// "optimizer" for "loom.optimizer/1": the manifest section of a kind.
std::string section_of(const std::string& kind) {
  std::string s = kind.rfind("loom.", 0) == 0 ? kind.substr(5) : kind;
  return s.substr(0, s.find('/'));
}

bool export_blob(loom_instance* instance, std::vector<unsigned char>& out) {
  size_t size = 0;
  if (loom_instance_export_state(instance, nullptr, 0, &size) != LOOM_OK) return false;
  out.assign(size, 0);
  if (loom_instance_export_state(instance, out.data(), out.size(), &size) != LOOM_OK) return false;
  out.resize(size);
  return true;
}

StepResult state_round_trip(loom_instance* instance, bool has_state) {
  using Status = StepResult::Status;
  if (!has_state) return {Status::kSkipped, "the kind exports no state"};
  std::vector<unsigned char> a, b;
  if (!export_blob(instance, a)) return {Status::kFailed, std::string(loom_last_error())};
  if (loom_instance_import_state(instance, a.data(), a.size()) != LOOM_OK) {
    return {Status::kFailed, "importing its own exported state (" + std::to_string(a.size()) +
                                 " bytes): " + loom_last_error()};
  }
  if (!export_blob(instance, b)) {
    return {Status::kFailed, "exporting after the import: " + std::string(loom_last_error())};
  }
  if (a != b) {
    size_t at = 0;
    while (at < a.size() && at < b.size() && a[at] == b[at]) ++at;
    return {Status::kFailed,
            "the state exported after importing it differs from the one "
            "imported (" +
                std::to_string(a.size()) + " and " + std::to_string(b.size()) +
                " bytes, first difference at byte " + std::to_string(at) + ")"};
  }
  return {Status::kOk,
          std::to_string(a.size()) + " bytes exported, imported and exported again: identical"};
}

void report(Reporter& rep, const std::string& stage, const StepResult& r) {
  switch (r.status) {
    case StepResult::Status::kOk:
      rep.ok(stage, r.note);
      break;
    case StepResult::Status::kFailed:
      rep.failed(stage, r.note);
      break;
    case StepResult::Status::kSkipped:
      rep.skipped(stage, r.note);
      break;
  }
}

// One kind of the plugin, in a session of its own: one instance with every parameter at its
// default.
void validate_kind(Reporter& rep, const std::string& plugin, const fs::path& dir,
                   const nlohmann::json& kind) {
  const std::string id = kind["kind"].get<std::string>();
  const std::string section = section_of(id);
  auto stage = [&](const char* s) { return id + " " + s; };
  // The stages from `first` on; `detail`, when given, follows the reason on the first.
  auto skip_from = [&](size_t first, const std::string& why, const std::string& detail = "") {
    const char* later[] = {"create", "step", "state", "destroy"};
    for (size_t i = first; i < std::size(later); ++i) {
      rep.skipped(stage(later[i]), why + (i == first && !detail.empty() ? ": " + detail : ""));
    }
  };
  std::vector<std::string> required;
  bool names_instance = false;  // a reference whose default names an instance
  for (const auto& p : kind["params"]) {
    if (p["required"].get<bool>()) required.push_back(p["name"].get<std::string>());
    names_instance = names_instance || (p["type"] == "ref" && p["default"].is_string() &&
                                        !p["default"].get<std::string>().empty());
  }
  const size_t params = kind["params"].size();
  const std::string count_text =
      std::to_string(params) + (params == 1 ? " parameter" : " parameters");
  // JSON string syntax is valid TOML basic string syntax.
  const std::string toml = "[loom]\nabi = 1\nplugin_path = [" +
                           nlohmann::json(dir.string()).dump() + "]\n\n[" + section +
                           ".validate]\nplugin = " + nlohmann::json(plugin).dump() + "\n";
  loom_open_options opts{};
  opts.struct_size = LOOM_OPEN_OPTIONS_SIZE;
  opts.log_level = LOOM_LOG_WARN;

  rep.start(stage("schema"));
  if (!kind.value("known", true)) {
    rep.failed(stage("schema"), "this host (Loom ABI " + std::to_string(loom_abi_major()) + "." +
                                    std::to_string(loom_abi_minor()) + ") does not know the kind " +
                                    id +
                                    ", so it cannot create its instances: a host whose kind "
                                    "list has it can (docs/abi.md, \"Adding a kind\")");
    skip_from(0, "the host does not know the kind");
    return;
  }
  if (!required.empty()) {
    rep.ok(stage("schema"), count_text + "; " + join(required, ", ") +
                                (required.size() == 1 ? " has" : " have") +
                                " no default, so the defaults were not checked together");
    skip_from(0, "needs parameters " + join(required, ", "));
    return;
  }
  opts.validate_only = 1;
  loom_session* session = nullptr;
  if (loom_open_string(toml.c_str(), nullptr, &opts, &session) != LOOM_OK) {
    // Defaults meet only two checks: the plugin's own cross-parameter check (run once every
    // parameter passed the schema), and a reference's default must name an instance, which a
    // manifest of one instance lacks. A kind failing either needs parameters set, which no
    // generic run can choose.
    if (kind.value("has_validate", false) || names_instance) {
      rep.ok(stage("schema"), count_text + "; the defaults alone do not make an instance");
      skip_from(0, "needs parameters set", host_error());
    } else {
      rep.failed(stage("schema"), host_error());
      skip_from(0, "its defaults do not validate");
    }
    return;
  }
  loom_close(session);
  session = nullptr;
  rep.ok(stage("schema"), count_text + "; the defaults validate");

  rep.start(stage("create"));
  opts.validate_only = 0;
  loom_instance* instance = nullptr;
  if (loom_open_string(toml.c_str(), nullptr, &opts, &session) != LOOM_OK ||
      loom_find_instance(session, section.c_str(), "validate", &instance) != LOOM_OK) {
    // LOOM_ERR_UNAVAILABLE: a device, peer or library this machine lacks, not a fault.
    const bool unavailable = loom_last_error_code() == LOOM_ERR_UNAVAILABLE;
    const std::string why = host_error();
    loom_close(session);
    if (unavailable) {
      rep.skipped(stage("create"), "unavailable here: " + why);
    } else {
      rep.failed(stage("create"), why);
    }
    skip_from(1, "not created");
    return;
  }
  rep.ok(stage("create"), "with every parameter at its default");

  rep.start(stage("step"));
  report(rep, stage("step"), generic_step(section, instance));

  rep.start(stage("state"));
  report(rep, stage("state"), state_round_trip(instance, kind["has_state"].get<bool>()));

  rep.start(stage("destroy"));
  loom_close(session);
  rep.ok(stage("destroy"), "");
}

}  // namespace

int validate_plugin_child(const std::string& file) {
  Reporter rep(loom_child::take_stdout());
  const fs::path path = fs::absolute(file);
  const std::string name = loom_scan::plugin_name_of(path.string());
  rep.start("load");
  if (name.empty() || ::chdir(path.parent_path().c_str()) != 0) {
    rep.failed("load", name.empty() ? path.string() + " is not named loom_NAME.so"
                                    : path.parent_path().string() + ": " + std::strerror(errno));
    rep.end();
    return kExitError;
  }
  // As `loom __scan-plugin` does: by name, with its folder (the working directory) first.
  char* raw = nullptr;
  (void)loom_describe_plugins(name.c_str(), ".", &raw);
  nlohmann::json doc = raw != nullptr ? nlohmann::json::parse(raw) : nlohmann::json();
  loom_free_string(raw);
  if (!doc.is_object() || doc["plugins"].empty()) {
    rep.failed("load", doc.is_object() && !doc["errors"].empty()
                           ? doc["errors"][0]["error"].get<std::string>()
                           : std::string(loom_last_error()));
    rep.end();
    return kExitError;
  }
  const auto& plugin = doc["plugins"][0];
  std::vector<std::string> kinds;
  for (const auto& k : plugin["kinds"]) kinds.push_back(k["kind"].get<std::string>());
  rep.ok("load", plugin["name"].get<std::string>() + " " + plugin["version"].get<std::string>() +
                     ", ABI " + plugin["abi"].get<std::string>() +
                     "; kinds: " + (kinds.empty() ? std::string("none") : join(kinds, ", ")));
  for (const auto& k : plugin["kinds"]) validate_kind(rep, name, path.parent_path(), k);
  rep.end();
  return rep.failures() > 0 ? kExitError : 0;
}

int validate_plugin_main(const std::string& plugin, const std::string& plugin_path) {
  std::string file;
  const bool is_file = plugin.find('/') != std::string::npos ||
                       (plugin.size() > 3 && plugin.compare(plugin.size() - 3, 3, ".so") == 0);
  if (is_file) {
    std::error_code ec;
    const fs::path p = fs::absolute(plugin, ec).lexically_normal();
    if (ec || !fs::is_regular_file(p, ec)) {
      std::cerr << "loom validate-plugin: " << plugin << ": no such file\n";
      return kExitError;
    }
    file = p.string();
  } else {
    const auto listed = loom_scan::list_files(plugin.c_str(), plugin_path);
    if (!listed.is_object() || listed["files"].empty()) {
      // No file, so nothing is loaded: the library's message says what was searched.
      char* raw = nullptr;
      (void)loom_describe_plugins(plugin.c_str(),
                                  plugin_path.empty() ? nullptr : plugin_path.c_str(), &raw);
      loom_free_string(raw);
      std::cerr << "loom validate-plugin: " << loom_last_error() << "\n";
      return kExitError;
    }
    file = listed["files"][0].get<std::string>();
  }
  if (loom_scan::plugin_name_of(file).empty()) {
    std::cerr << "loom validate-plugin: " << file
              << ": a plugin file is named loom_NAME.so, NAME being the name it declares\n";
    return kExitError;
  }

  std::cout << "validating " << file << " in a child process\n" << std::flush;
  int ok = 0, failed = 0, skipped = 0;
  std::string stage;  // the last stage begun
  bool open = false;  // it has no result yet
  bool ended = false;
  const double limit = loom_child::time_limit_s();
  const auto run =
      loom_child::run_self({"__validate-plugin", file}, limit, [&](const std::string& line) {
        if (line == "@end") {
          ended = true;
        } else if (line.rfind("@ ", 0) == 0) {
          stage = line.substr(2);
          open = true;
        } else {
          std::cout << "  " << line << "\n" << std::flush;
          const size_t colon = line.find(": ");
          const std::string result = colon == std::string::npos ? "" : line.substr(colon + 2);
          if (result.rfind("ok", 0) == 0) ++ok;
          if (result.rfind("failed", 0) == 0) ++failed;
          if (result.rfind("skipped", 0) == 0) ++skipped;
          if (open && line.compare(0, stage.size() + 1, stage + ":") == 0) open = false;
        }
      });
  using End = loom_child::Run::End;
  // Where the child ended when it ended early: in a stage, or between stages (at exit).
  const std::string where = open ? stage : "exit";
  const std::string during = open ? " in this stage" : ended ? " after the last stage" : "";
  std::string problem;
  switch (run.end) {
    case End::kNotStarted:
      std::cerr << "loom validate-plugin: cannot run a child process: " << run.why << "\n";
      return kExitError;
    case End::kSignaled:
      problem = "the plugin crashed" + during + " (" + loom_child::signal_name(run.code) + ")";
      break;
    case End::kTimedOut:
      problem = "no result within " + loom_cli::number(limit) +
                " s (LOOM_SCAN_TIMEOUT sets the limit); the process was stopped";
      break;
    case End::kExited:
      if (!ended || open || (run.code != 0 && failed == 0)) {
        problem = "the process exited with status " + std::to_string(run.code) + during +
                  " (the plugin called exit?)";
      }
      break;
  }
  if (!problem.empty()) {
    std::cout << "  " << where << ": failed: " << problem << "\n";
    ++failed;
  }
  std::cout << (failed > 0 ? "FAILED" : "ok") << ": " << ok << " ok, " << skipped << " skipped, "
            << failed << " failed\n";
  return failed > 0 ? kExitError : 0;
}

}  // namespace loom_validate
