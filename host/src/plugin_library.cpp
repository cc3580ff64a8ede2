#include "plugin_library.hpp"

#include <dlfcn.h>
#include <loom/kinds/codec.h>
#include <loom/kinds/comm.h>
#include <loom/kinds/optimizer.h>
#include <loom_text.hpp>

#include <algorithm>
#include <boost/dll/shared_library.hpp>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <set>
#include <sstream>

#include "diagnostics.hpp"
#include "elf_check.hpp"
#include "kinds.hpp"
#include "status.hpp"

namespace loom::host {
namespace {

constexpr uint32_t kMinPluginSize = LOOM_PLUGIN_V1_SIZE;
constexpr uint32_t kMinFactorySize = LOOM_STRUCT_SIZE(loom_factory, vtable);
constexpr uint32_t kMinSpecSize = LOOM_STRUCT_SIZE(loom_param_spec, max);

// Copies a struct the plugin made into a zeroed full-size one, reading only the prefix
// its struct_size declares.
template <typename T>
T copy_prefix(const void* src, uint32_t declared) {
  T out{};
  std::memcpy(&out, src, std::min<size_t>(declared, sizeof(T)));
  out.struct_size = static_cast<uint32_t>(sizeof(T));
  return out;
}

bool valid_identifier(const char* s) {
  if (s == nullptr || *s == '\0') return false;
  for (const char* p = s; *p != '\0'; ++p) {
    const char c = *p;
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_')) return false;
  }
  return true;
}

std::string str_or(const char* s, const char* fallback) { return s != nullptr ? s : fallback; }

bool valid_param_type(int32_t t) { return t >= LOOM_PARAM_BOOL && t <= LOOM_PARAM_REF; }

// False for a NaN bound or a range no value can meet: min > max, or an exclusive bound
// equal to the other one (or, for exact int64 bounds, no integer strictly inside).
bool range_allows_some(const loom_param_spec& spec) {
  const bool lo_ex = (spec.flags & LOOM_PARAM_MIN_EXCLUSIVE) != 0;
  const bool hi_ex = (spec.flags & LOOM_PARAM_MAX_EXCLUSIVE) != 0;
  if ((spec.flags & LOOM_PARAM_INT_RANGE) != 0) {
    // Widened, so that the int64 limits cannot overflow.
    const auto lo = static_cast<long double>(spec.int_min) + (lo_ex ? 1 : 0);
    const auto hi = static_cast<long double>(spec.int_max) - (hi_ex ? 1 : 0);
    return lo <= hi;
  }
  if (std::isnan(spec.min) || std::isnan(spec.max) || spec.min > spec.max) return false;
  return !(spec.min == spec.max && (lo_ex || hi_ex));
}

struct LoadedLibrary {
  boost::dll::shared_library library;
  std::shared_ptr<const PluginInfo> info;
};

// Libraries are never unloaded: an instance, a status or an exception from a plugin
// must never outlive its code.
std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::map<std::filesystem::path, LoadedLibrary>& registry() {
  static auto* r = new std::map<std::filesystem::path, LoadedLibrary>();  // never destroyed
  return *r;
}

[[noreturn]] void fail(const std::filesystem::path& path, const std::string& what,
                       loom_code code = LOOM_ERR_INVALID_ARGUMENT) {
  throw Error(code, "plugin file " + path.string() + ": " + what);
}

FactoryInfo read_factory(const std::filesystem::path& path, const std::string& plugin_name,
                         const loom_factory* f, size_t index) {
  const std::string where = "plugin '" + plugin_name + "' factory " + std::to_string(index);
  if (f == nullptr) fail(path, where + " is NULL");
  if (f->struct_size < kMinFactorySize) {
    fail(path,
         where + " has struct_size " + std::to_string(f->struct_size) +
             ", smaller than the minimum " + std::to_string(kMinFactorySize),
         LOOM_ERR_ABI_MISMATCH);
  }
  FactoryInfo info;
  info.raw = copy_prefix<loom_factory>(f, f->struct_size);
  if (info.raw.kind == nullptr || *info.raw.kind == '\0') fail(path, where + " has no kind");
  info.kind = info.raw.kind;
  // Fields past the factory's struct_size read as NULL (copy_prefix), so a factory from
  // before 1.2 needs create, and one from 1.2 on either create or create_with_args.
  if ((info.raw.create == nullptr && info.raw.create_with_args == nullptr) ||
      info.raw.vtable == nullptr) {
    fail(path, where + " (" + info.kind + ") lacks create (or create_with_args) or vtable");
  }
  const uint32_t vt_size = *static_cast<const uint32_t*>(info.raw.vtable);
  if (vt_size < min_vtable_size(info.kind)) {
    fail(path,
         where + " (" + info.kind + ") has a function table of " + std::to_string(vt_size) +
             " bytes, smaller than the minimum " + std::to_string(min_vtable_size(info.kind)),
         LOOM_ERR_ABI_MISMATCH);
  }
  if (info.raw.param_count > 0 && info.raw.param_specs == nullptr) {
    fail(path, where + " declares parameters but no param_specs");
  }
  // Arrays of ABI structs are laid out with the element's own struct_size as stride.
  const auto* bytes = reinterpret_cast<const unsigned char*>(info.raw.param_specs);  // NOLINT
  const uint32_t stride = info.raw.param_count > 0 ? info.raw.param_specs[0].struct_size : 0;
  if (info.raw.param_count > 0 && stride < kMinSpecSize) {
    fail(path,
         where + " has param specs of " + std::to_string(stride) +
             " bytes, smaller than the minimum " + std::to_string(kMinSpecSize),
         LOOM_ERR_ABI_MISMATCH);
  }
  std::set<std::string> names;
  for (size_t i = 0; i < info.raw.param_count; ++i) {
    auto spec = copy_prefix<loom_param_spec>(bytes + i * stride, stride);
    const std::string pwhere = where + " (" + info.kind + ") parameter " + std::to_string(i);
    if (!valid_identifier(spec.name) || std::strcmp(spec.name, "plugin") == 0) {
      fail(path, pwhere + " has an invalid name '" + str_or(spec.name, "(null)") +
                     "' (use [a-z0-9_]+, not 'plugin')");
    }
    if (!names.insert(spec.name).second) {
      fail(path, pwhere + ": duplicate parameter name '" + std::string(spec.name) + "'");
    }
    if (!valid_param_type(spec.type)) {
      fail(path, pwhere + " ('" + spec.name + "') has unknown type " + std::to_string(spec.type));
    }
    if (spec.type == LOOM_PARAM_REF && (spec.ref_kind == nullptr || *spec.ref_kind == '\0')) {
      fail(path, pwhere + " ('" + spec.name + "') is a reference without ref_kind");
    }
    if ((spec.flags & ~LOOM_PARAM_KNOWN_FLAGS) != 0) {
      std::ostringstream hex;
      hex << std::hex << (spec.flags & ~LOOM_PARAM_KNOWN_FLAGS);
      fail(path,
           pwhere + " ('" + spec.name + "') has unknown flags 0x" + hex.str() +
               " (from a newer ABI minor than this host's " + std::to_string(LOOM_ABI_MAJOR) + "." +
               std::to_string(LOOM_ABI_MINOR) + ")",
           LOOM_ERR_ABI_MISMATCH);
    }
    const bool numeric = spec.type == LOOM_PARAM_INT || spec.type == LOOM_PARAM_FLOAT ||
                         spec.type == LOOM_PARAM_INT_LIST || spec.type == LOOM_PARAM_FLOAT_LIST;
    const bool integral = spec.type == LOOM_PARAM_INT || spec.type == LOOM_PARAM_INT_LIST;
    if (!numeric && (spec.flags & (LOOM_PARAM_MIN_EXCLUSIVE | LOOM_PARAM_MAX_EXCLUSIVE)) != 0) {
      fail(path, pwhere + " ('" + spec.name + "') has exclusive bounds but is not a number");
    }
    if (!integral && (spec.flags & LOOM_PARAM_INT_RANGE) != 0) {
      fail(path, pwhere + " ('" + spec.name + "') has LOOM_PARAM_INT_RANGE but is not an integer");
    }
    if (!range_allows_some(spec)) {
      fail(path, pwhere + " ('" + spec.name + "') has an invalid range");
    }
    info.specs.push_back(spec);
  }
  return info;
}

std::shared_ptr<const PluginInfo> read_plugin(const std::filesystem::path& path,
                                              const loom_plugin_v1* p) {
  if (p == nullptr) fail(path, "loom_plugin_entry_v1 returned NULL");
  if (p->struct_size < kMinPluginSize) {
    fail(path,
         "its plugin descriptor has struct_size " + std::to_string(p->struct_size) +
             ", smaller than the minimum " + std::to_string(kMinPluginSize),
         LOOM_ERR_ABI_MISMATCH);
  }
  const auto desc = copy_prefix<loom_plugin_v1>(p, p->struct_size);
  if (desc.abi_major != LOOM_ABI_MAJOR) {
    fail(path,
         "it was built for Loom ABI " + std::to_string(desc.abi_major) + "." +
             std::to_string(desc.abi_minor) +
             " but exports loom_plugin_entry_v1; this host speaks ABI " +
             std::to_string(LOOM_ABI_MAJOR) + "." + std::to_string(LOOM_ABI_MINOR),
         LOOM_ERR_ABI_MISMATCH);
  }
  if (!valid_identifier(desc.name)) {
    fail(path, "its name '" + str_or(desc.name, "(null)") + "' is not [a-z0-9_]+");
  }
  auto info = std::make_shared<PluginInfo>();
  info->name = desc.name;
  info->version = str_or(desc.version, "");
  info->description = str_or(desc.description, "");
  info->path = path;
  info->abi_major = desc.abi_major;
  info->abi_minor = desc.abi_minor;
  const std::string expected = plugin_file_name(info->name);
  if (path.filename() != expected) {
    fail(path, "it declares the name '" + info->name + "', so its file must be named " + expected);
  }
  if (desc.factory_count > 0 && desc.factories == nullptr) fail(path, "factories is NULL");
  std::set<std::string> kinds;
  for (size_t i = 0; i < desc.factory_count; ++i) {
    FactoryInfo f = read_factory(path, info->name, desc.factories[i], i);
    if (!kinds.insert(f.kind).second) fail(path, "it provides kind " + f.kind + " twice");
    info->factories.push_back(std::move(f));
  }
  return info;
}

// The highest ABI major whose entry symbol the library exports, other than ours.
int other_major(const boost::dll::shared_library& lib) {
  for (int major = 16; major >= 0; --major) {
    if (major == LOOM_ABI_MAJOR) continue;
    if (lib.has("loom_plugin_entry_v" + std::to_string(major))) return major;
  }
  return -1;
}

std::shared_ptr<const PluginInfo> load_uncached(const std::filesystem::path& path,
                                                boost::dll::shared_library* out_lib) {
  if (const auto why = check_plugin_permissions(path); !why.empty()) {
    throw Error(LOOM_ERR_FAILED_PRECONDITION, "refusing to load plugin: " + why);
  }
  if (const auto why = check_elf_file(path); !why.empty()) fail(path, why, LOOM_ERR_DATA_LOSS);

  std::error_code ec;
  boost::dll::shared_library lib;
  lib.load(path, boost::dll::load_mode::rtld_now | boost::dll::load_mode::rtld_local, ec);
  if (ec || !lib.is_loaded()) {
    // Boost.DLL drops dlerror()'s text; a second raw attempt recovers it for the message.
    std::string why = ec ? ec.message() : "unknown error";
    if (void* h = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL); h == nullptr) {
      if (const char* e = ::dlerror(); e != nullptr) why = e;
    } else {
      ::dlclose(h);
    }
    fail(path, "the dynamic loader refused it: " + why, LOOM_ERR_UNAVAILABLE);
  }
  if (!lib.has(LOOM_PLUGIN_ENTRY_V1_NAME)) {
    if (const int major = other_major(lib); major >= 0) {
      fail(path,
           "it was built for Loom ABI " + std::to_string(major) +
               " (it exports loom_plugin_entry_v" + std::to_string(major) +
               "); this host speaks ABI " + std::to_string(LOOM_ABI_MAJOR) + "." +
               std::to_string(LOOM_ABI_MINOR),
           LOOM_ERR_ABI_MISMATCH);
    }
    fail(path,
         "it has no entry symbol " LOOM_PLUGIN_ENTRY_V1_NAME
         ", so it is not a Loom plugin (plugins export it with LOOM_PLUGIN from loom/sdk.hpp)",
         LOOM_ERR_NOT_FOUND);
  }
  auto entry = lib.get<const loom_plugin_v1*()>(LOOM_PLUGIN_ENTRY_V1_NAME);
  const loom_plugin_v1* desc = nullptr;
  try {
    desc = entry();
  } catch (const std::exception& e) {
    fail(path, std::string("loom_plugin_entry_v1 threw an exception: ") + e.what(),
         LOOM_ERR_INTERNAL);
  } catch (...) {
    fail(path, "loom_plugin_entry_v1 threw an exception", LOOM_ERR_INTERNAL);
  }
  auto info = read_plugin(path, desc);
  *out_lib = std::move(lib);
  return info;
}

}  // namespace

uint32_t min_vtable_size(std::string_view kind) {
  const KindInfo* k = find_kind(kind);
  return k != nullptr ? k->min_table_size : sizeof(uint32_t);  // unknown: only the size field
}

std::string plugin_file_name(std::string_view name) { return "loom_" + std::string(name) + ".so"; }

std::shared_ptr<const PluginInfo> load_plugin(const std::filesystem::path& path) {
  std::error_code ec;
  auto key = std::filesystem::weakly_canonical(path, ec);
  if (ec) key = std::filesystem::absolute(path);
  const std::lock_guard<std::mutex> lock(registry_mutex());
  if (auto it = registry().find(key); it != registry().end()) return it->second.info;
  if (!std::filesystem::is_regular_file(key, ec)) {
    fail(key, "no such file", LOOM_ERR_NOT_FOUND);
  }
  LoadedLibrary loaded;
  loaded.info = load_uncached(key, &loaded.library);
  auto info = loaded.info;
  registry().emplace(key, std::move(loaded));
  return info;
}

std::filesystem::path PluginCatalog::bundled_dir() {
  Dl_info dl{};
  if (::dladdr(reinterpret_cast<const void*>(&PluginCatalog::bundled_dir), &dl) == 0 ||  // NOLINT
      dl.dli_fname == nullptr) {
    return {};
  }
  std::error_code ec;
  auto lib = std::filesystem::canonical(dl.dli_fname, ec);
  if (ec) return {};
  return lib.parent_path() / "loom" / "plugins";
}

std::vector<std::filesystem::path> PluginCatalog::search_path(
    const std::vector<std::filesystem::path>& first, std::string_view extra) {
  std::vector<std::filesystem::path> dirs = first;
  auto split = [&](std::string_view list) {
    size_t start = 0;
    while (start <= list.size()) {
      const size_t end = std::min(list.find(':', start), list.size());
      if (end > start)
        dirs.emplace_back(std::filesystem::absolute(list.substr(start, end - start)));
      start = end + 1;
    }
  };
  split(extra);
  if (const char* env = std::getenv("LOOM_PLUGIN_PATH"); env != nullptr) split(env);
  if (auto bundled = bundled_dir(); !bundled.empty()) dirs.push_back(bundled);
  return dirs;
}

std::filesystem::path PluginCatalog::locate(std::string_view name) const {
  const std::string file = plugin_file_name(name);
  for (const auto& dir : dirs_) {
    std::error_code ec;
    auto candidate = dir / file;
    if (std::filesystem::exists(candidate, ec)) return candidate;
  }
  return {};
}

std::vector<std::filesystem::path> PluginCatalog::available_files() const {
  std::vector<std::filesystem::path> files;
  std::set<std::string> seen;
  for (const auto& dir : dirs_) {
    std::error_code ec;
    std::vector<std::filesystem::path> here;
    for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
      const std::string fname = entry.path().filename().string();
      if (fname.size() > 8 && fname.rfind("loom_", 0) == 0 &&
          fname.compare(fname.size() - 3, 3, ".so") == 0) {
        here.push_back(entry.path());
      }
    }
    std::sort(here.begin(), here.end());
    for (auto& p : here) {
      if (seen.insert(p.filename().string()).second) files.push_back(std::move(p));
    }
  }
  return files;
}

std::vector<std::string> PluginCatalog::available_names() const {
  std::vector<std::string> names;
  for (const auto& f : available_files()) {
    const std::string fname = f.filename().string();
    names.push_back(fname.substr(5, fname.size() - 8));
  }
  return names;
}

std::shared_ptr<const PluginInfo> PluginCatalog::load(std::string_view name) const {
  const auto path = locate(name);
  if (path.empty()) {
    std::string searched;
    for (const auto& d : dirs_) searched += (searched.empty() ? "" : ":") + d.string();
    throw Error(LOOM_ERR_NOT_FOUND, "unknown plugin " + loom_text::quoted(name) +
                                        did_you_mean(name, available_names()) + "; no " +
                                        loom_text::shown(plugin_file_name(name)) + " in " +
                                        (searched.empty() ? "(no plugin folders)" : searched));
  }
  return load_plugin(path);
}

}  // namespace loom::host
