#include "session.hpp"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "bootstrap.hpp"
#include "device_memory.hpp"
#include "kinds.hpp"
#include "plugin_library.hpp"
#include "status.hpp"
#include "thread_pool.hpp"

namespace loom::host {
namespace {

spdlog::level::level_enum to_spdlog(int32_t level) {
  switch (level) {
    case LOOM_LOG_TRACE:
      return spdlog::level::trace;
    case LOOM_LOG_DEBUG:
      return spdlog::level::debug;
    case LOOM_LOG_INFO:
      return spdlog::level::info;
    case LOOM_LOG_WARN:
      return spdlog::level::warn;
    case LOOM_LOG_ERROR:
      return spdlog::level::err;
    default:
      return spdlog::level::off;
  }
}

Instance* instance_of(void* host_ctx) { return static_cast<Instance*>(host_ctx); }

// ---- the services table; every function is noexcept: it is called from plugin code.

void svc_log(void* ctx, int32_t level, const char* message) noexcept {
  try {
    instance_of(ctx)->logger->log(to_spdlog(level), "{}", message != nullptr ? message : "");
  } catch (...) {  // logging must never take the plugin down
  }
}

int32_t svc_log_enabled(void* ctx, int32_t level) noexcept {
  return instance_of(ctx)->logger->should_log(to_spdlog(level)) ? 1 : 0;
}

loom_status* svc_make_status(void* /*ctx*/, int32_t code, const char* message) noexcept {
  return make_status(code, message);
}

void* svc_host_alloc(void* /*ctx*/, size_t bytes, size_t align) noexcept {
  return host_alloc(bytes, align);
}

void svc_host_free(void* /*ctx*/, void* ptr) noexcept { host_free(ptr); }

loom_status* svc_device_alloc(void* /*ctx*/, DLDevice device, size_t bytes, void* stream,
                              void** out) noexcept {
  return device_alloc(device, bytes, stream, out);
}

loom_status* svc_device_free(void* /*ctx*/, DLDevice device, void* ptr, void* stream) noexcept {
  return device_free(device, ptr, stream);
}

// The process's pool, whichever instance asks: host_ctx is not used.
loom_status* svc_parallel_for(void* /*ctx*/, size_t n, size_t grain, ParallelBody body,
                              void* body_ctx) noexcept {
  if (body == nullptr && n > 0) {
    return make_status(LOOM_ERR_INVALID_ARGUMENT, "parallel_for: body is NULL");
  }
  ThreadPool::process().parallel_for(n, grain, body, body_ctx);
  return nullptr;
}

size_t svc_thread_count(void* /*ctx*/) noexcept { return ThreadPool::process().size(); }

std::string read_file(const std::filesystem::path& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {  // an ifstream opens it and reads nothing
    throw Error(LOOM_ERR_INVALID_ARGUMENT,
                path.string() + ": is a folder, not a manifest file (give the .toml file)");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw Error(LOOM_ERR_NOT_FOUND,
                path.string() + ": cannot open manifest: " + std::strerror(errno));
  }
  std::ostringstream os;
  os << in.rdbuf();
  if (in.bad()) throw Error(LOOM_ERR_DATA_LOSS, path.string() + ": cannot read manifest");
  return os.str();
}

}  // namespace

std::unique_ptr<Session> Session::open_file(const std::filesystem::path& path,
                                            const OpenOptions& options) {
  const std::string text = read_file(path);
  std::error_code ec;
  auto dir = std::filesystem::absolute(path, ec).parent_path();
  return open_text(text, path.string(), dir, options);
}

std::unique_ptr<Session> Session::open_text(std::string_view text, const std::string& origin,
                                            const std::filesystem::path& base_dir,
                                            const OpenOptions& options) {
  std::unique_ptr<Session> s(new Session());
  Diagnostics diags;
  s->manifest_ = parse_manifest(text, origin, base_dir, diags,
                                options.only_sections ? &options.sections : nullptr);
  s->setup_logging(options);
  std::string how = "the embedding program's";
  if (options.bootstrap != nullptr) {
    s->bootstrap_ = options.bootstrap;
  } else if (options.validate_only) {
    // Checking a manifest talks to no other rank: a launcher's variables in the environment
    // (RANK, MASTER_ADDR, MPI's) must not make `loom check` wait for a job.
    s->bootstrap_ = single_process_bootstrap();
    how = "none (validate only)";
  } else {
    s->bootstrap_ = default_bootstrap(&how);
  }
  s->log_->debug("bootstrap: {}", how);
  if (s->bootstrap_->struct_size < LOOM_BOOTSTRAP_SIZE || s->bootstrap_->allgather == nullptr ||
      s->bootstrap_->barrier == nullptr || s->bootstrap_->size < 1 || s->bootstrap_->rank < 0 ||
      s->bootstrap_->rank >= s->bootstrap_->size) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT,
                "the bootstrap passed to loom_open is incomplete or has an invalid rank/size");
  }

  const PluginCatalog catalog(
      PluginCatalog::search_path(s->manifest_.plugin_path, options.plugin_path));
  s->log_->debug("plugin search path: {}", [&] {
    std::string p;
    for (const auto& d : catalog.dirs()) p += (p.empty() ? "" : ":") + d.string();
    return p;
  }());
  s->validated_ = validate_manifest(
      s->manifest_, [&](const std::string& name) { return catalog.load(name); }, diags);
  if (!diags.empty()) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT, diags.str());
  }
  if (!options.validate_only) s->create_instances();
  return s;
}

void Session::setup_logging(const OpenOptions& options) {
  level_ = LOOM_LOG_INFO;
  if (manifest_.log_level) level_ = *parse_log_level(*manifest_.log_level);
  if (options.log_level >= 0) level_ = options.log_level;
  if (const char* env = std::getenv("LOOM_LOG_LEVEL"); env != nullptr && *env != '\0') {
    if (auto lv = parse_log_level(env)) level_ = *lv;
  }
  // One sink per session, loggers not registered globally: several sessions (or
  // embedding programs with their own spdlog setup) never collide on names.
  sink_ = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  log_ = std::make_shared<spdlog::logger>("loom", sink_);
  log_->set_level(to_spdlog(level_));
  log_->set_pattern("[%H:%M:%S.%e] [%n] [%^%l%$] %v");
}

void Session::create_instances() {
  instances_.reserve(validated_.instances.size());
  for (auto& v : validated_.instances) {
    auto inst = std::make_unique<Instance>();
    inst->session = this;
    inst->validated = &v;
    inst->name = v.decl->name;
    inst->kind = v.decl->kind;
    inst->label = v.decl->label() + " (" + v.plugin->label() + ")";
    inst->logger = std::make_shared<spdlog::logger>(v.decl->label(), sink_);
    inst->logger->set_level(to_spdlog(level_));
    inst->logger->set_pattern("[%H:%M:%S.%e] [%n] [%^%l%$] %v");
    // References point at instances created earlier (validation ordered them).
    for (const auto& [param, target] : v.params.refs) {
      auto& value = v.params.params[param].value;
      value.ref_instance = instances_[target]->object;
      value.ref_vtable = instances_[target]->factory().vtable;
    }
    auto& svc = inst->services;
    svc.struct_size = LOOM_HOST_SERVICES_SIZE;
    svc.abi_major = LOOM_ABI_MAJOR;
    svc.abi_minor = LOOM_ABI_MINOR;
    svc.host_ctx = inst.get();
    svc.instance_name = inst->name.c_str();
    svc.log = svc_log;
    svc.log_enabled = svc_log_enabled;
    svc.make_status = svc_make_status;
    svc.host_alloc = svc_host_alloc;
    svc.host_free = svc_host_free;
    svc.device_alloc = svc_device_alloc;
    svc.device_free = svc_device_free;
    svc.bootstrap = bootstrap_;
    svc.params = v.params.params.data();
    svc.param_count = v.params.params.size();
    svc.parallel_for = svc_parallel_for;
    svc.thread_count = svc_thread_count;

    void* object = nullptr;
    auto taken = take_status(guarded_call(
        inst->label + " create", [&] { return v.factory->create(&inst->services, &object); }));
    if (taken.ok() && object == nullptr) {
      taken = {LOOM_ERR_INTERNAL, "create returned success but no instance"};
    }
    if (!taken.ok()) {
      const auto& pos = v.decl->pos;
      throw Error(taken.code, pos.file + ":" + std::to_string(pos.line) + ":" +
                                  std::to_string(pos.column) + ": " + inst->label +
                                  ": create failed: " + taken.message);
    }
    inst->object = object;
    log_->debug("created {}", inst->label);
    instances_.push_back(std::move(inst));
  }
}

Instance* Session::add_derived(std::unique_ptr<Instance> inst, const Instance* parent,
                               void (*destroy)(void*)) {
  derived_.push_back(Derived{std::move(inst), parent, destroy});
  return derived_.back().inst.get();
}

void Session::destroy_one(Derived& d) {
  if (d.destroy == nullptr || d.inst->object == nullptr) return;
  auto taken = take_status(guarded_call(d.inst->label + " destroy", [&]() -> loom_status* {
    d.destroy(d.inst->object);
    return nullptr;
  }));
  d.inst->object = nullptr;
  if (!taken.ok()) log_->error("{}", taken.message);
}

bool Session::destroy_derived(const Instance* inst) {
  auto is = [&](const Derived& d) { return d.inst.get() == inst; };
  if (std::find_if(derived_.begin(), derived_.end(), is) == derived_.end()) return false;
  for (;;) {  // its children first, newest first
    auto child = std::find_if(derived_.rbegin(), derived_.rend(),
                              [&](const Derived& d) { return d.parent == inst; });
    if (child == derived_.rend()) break;
    destroy_derived(child->inst.get());
  }
  auto it = std::find_if(derived_.begin(), derived_.end(), is);
  destroy_one(*it);
  derived_.erase(it);
  return true;
}

Session::~Session() {
  // Derived instances first, newest first: a child was made after its parent.
  while (!derived_.empty()) {
    destroy_one(derived_.back());
    derived_.pop_back();
  }
  // Reverse creation order: nothing is destroyed while something that references it lives.
  for (auto it = instances_.rbegin(); it != instances_.rend(); ++it) {
    Instance& inst = **it;
    const auto destroy = inst.factory().destroy;
    if (destroy == nullptr || inst.object == nullptr) continue;
    auto taken = take_status(guarded_call(inst.label + " destroy", [&]() -> loom_status* {
      destroy(inst.object);
      return nullptr;
    }));
    if (!taken.ok()) log_->error("{}", taken.message);
  }
}

Instance* Session::find(std::string_view kind_id, std::string_view name) const {
  for (const auto& inst : instances_) {
    if (inst->name == name && (kind_id.empty() || inst->kind == kind_id)) return inst.get();
  }
  return nullptr;
}

}  // namespace loom::host
