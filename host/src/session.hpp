// A session: one opened manifest, its loaded plugins and live instances.
#pragma once

#include <loom/abi.h>
#include <spdlog/logger.h>

#include <memory>
#include <string>
#include <vector>

#include "manifest.hpp"
#include "status.hpp"
#include "validate.hpp"

namespace loom::host {

class Session;

// One live instance, and the services table its plugin sees (host_ctx points here).
struct Instance {
  Session* session = nullptr;
  const ValidatedInstance* validated = nullptr;
  std::string name;
  std::string kind;
  std::string label;  // "optimizer.main (plugin 'adam', /path/loom_adam.so)"
  std::shared_ptr<spdlog::logger> logger;
  loom_host_services services{};
  void* object = nullptr;

  [[nodiscard]] const loom_factory& factory() const { return validated->factory->raw; }
  [[nodiscard]] const std::string& plugin_name() const { return validated->plugin->name; }
};

struct OpenOptions {
  bool validate_only = false;
  std::string plugin_path;  // ':'-separated, searched after the manifest's
  const loom_bootstrap* bootstrap = nullptr;
  int32_t log_level = -1;
  bool only_sections = false;         // read only `sections` and [loom]
  std::vector<std::string> sections;  // loom_open_options.sections, split
};

class Session {
 public:
  // Parses, validates and (unless validate_only) creates every instance. Throws
  // loom::host::Error listing every problem, one "FILE:LINE:COL: message" per line.
  static std::unique_ptr<Session> open_text(std::string_view text, const std::string& origin,
                                            const std::filesystem::path& base_dir,
                                            const OpenOptions& options);
  static std::unique_ptr<Session> open_file(const std::filesystem::path& path,
                                            const OpenOptions& options);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  [[nodiscard]] const std::vector<std::unique_ptr<Instance>>& instances() const {
    return instances_;
  }
  [[nodiscard]] Instance* find(std::string_view kind_id, std::string_view name) const;
  [[nodiscard]] const Manifest& manifest() const { return manifest_; }
  // Every declared instance as validated (schema checked, defaults filled), also when the
  // session was opened validate_only and created none.
  [[nodiscard]] const ValidatedManifest& validated() const { return validated_; }
  [[nodiscard]] size_t declared_instances() const { return manifest_.instances.size(); }
  [[nodiscard]] const loom_bootstrap& bootstrap() const { return *bootstrap_; }

  // Instances made at run time from a live one (a comm's split, loom_comm_split): owned
  // here, not among instances(), each destroyed by its own `destroy`, newest first and
  // before any declared instance, so a child always goes before its parent.
  Instance* add_derived(std::unique_ptr<Instance> inst, const Instance* parent,
                        void (*destroy)(void*));
  // Destroys a derived instance, after everything derived from it; false when `inst` is not
  // a derived instance of this session.
  bool destroy_derived(const Instance* inst);

 private:
  Session() = default;
  void setup_logging(const OpenOptions& options);
  void create_instances();
  struct Derived {
    std::unique_ptr<Instance> inst;
    const Instance* parent = nullptr;
    void (*destroy)(void*) = nullptr;
  };
  void destroy_one(Derived& d);

  Manifest manifest_;
  ValidatedManifest validated_;
  std::vector<std::unique_ptr<Instance>> instances_;
  std::vector<Derived> derived_;
  std::shared_ptr<spdlog::logger> log_;
  spdlog::sink_ptr sink_;
  int level_ = LOOM_LOG_INFO;
  const loom_bootstrap* bootstrap_ = nullptr;
};

}  // namespace loom::host
