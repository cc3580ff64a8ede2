// loom_describe_plugins: what `loom plugins` and `loom describe` print, as JSON.
#include <loom/embed.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <nlohmann/json.hpp>
#include <string>

#include "kinds.hpp"
#include "last_error.hpp"
#include "plugin_library.hpp"
#include "session.hpp"
#include "status.hpp"
#include "validate.hpp"

namespace loom::host {
namespace {

const char* type_name(int32_t type) {
  switch (type) {
    case LOOM_PARAM_BOOL:
      return "bool";
    case LOOM_PARAM_INT:
      return "int";
    case LOOM_PARAM_FLOAT:
      return "float";
    case LOOM_PARAM_STRING:
      return "string";
    case LOOM_PARAM_INT_LIST:
      return "int_list";
    case LOOM_PARAM_FLOAT_LIST:
      return "float_list";
    case LOOM_PARAM_STRING_LIST:
      return "string_list";
    case LOOM_PARAM_REF:
      return "ref";
    default:
      return "unknown";
  }
}

nlohmann::json bound(double v, bool integral) {
  if (std::isinf(v)) return nullptr;  // unbounded
  if (integral && std::abs(v) < 9.2e18) return static_cast<int64_t>(v);
  return v;
}

nlohmann::json default_json(const loom_param_spec& spec) {
  if (spec.required != 0) return nullptr;
  const loom_value& v = spec.default_value;
  auto list = [&](auto get) {
    nlohmann::json arr = nlohmann::json::array();
    for (size_t i = 0; i < v.count; ++i) arr.push_back(get(i));
    return arr;
  };
  switch (spec.type) {
    case LOOM_PARAM_BOOL:
      return v.int_value != 0;
    case LOOM_PARAM_INT:
      return v.int_value;
    case LOOM_PARAM_FLOAT:
      return v.float_value;
    case LOOM_PARAM_STRING:
    case LOOM_PARAM_REF:
      return v.string_value != nullptr ? nlohmann::json(v.string_value) : nlohmann::json(nullptr);
    case LOOM_PARAM_INT_LIST:
      if (v.int_list == nullptr) return nlohmann::json::array();
      return list([&](size_t i) { return nlohmann::json(v.int_list[i]); });
    case LOOM_PARAM_FLOAT_LIST:
      if (v.float_list == nullptr) return nlohmann::json::array();
      return list([&](size_t i) { return nlohmann::json(v.float_list[i]); });
    case LOOM_PARAM_STRING_LIST:
      if (v.string_list == nullptr) return nlohmann::json::array();
      return list([&](size_t i) {
        return nlohmann::json(v.string_list[i] != nullptr ? v.string_list[i] : "");
      });
    default:
      return nullptr;
  }
}

nlohmann::json plugin_json(const PluginInfo& p) {
  nlohmann::json kinds = nlohmann::json::array();
  for (const auto& f : p.factories) {
    nlohmann::json params = nlohmann::json::array();
    for (const auto& s : f.specs) {
      nlohmann::json j{{"name", s.name},
                       {"type", type_name(s.type)},
                       {"type_phrase", param_type_phrase(s)},
                       {"required", s.required != 0},
                       {"default", default_json(s)},
                       {"doc", s.doc != nullptr ? s.doc : ""}};
      if (s.type == LOOM_PARAM_INT || s.type == LOOM_PARAM_FLOAT || s.type == LOOM_PARAM_INT_LIST ||
          s.type == LOOM_PARAM_FLOAT_LIST) {
        const bool integral = s.type == LOOM_PARAM_INT || s.type == LOOM_PARAM_INT_LIST;
        if (integral && (s.flags & LOOM_PARAM_INT_RANGE) != 0) {
          // Exact int64 bounds (ABI 1.2); the limits mean unbounded.
          j["min"] = s.int_min != INT64_MIN ? nlohmann::json(s.int_min) : nlohmann::json(nullptr);
          j["max"] = s.int_max != INT64_MAX ? nlohmann::json(s.int_max) : nlohmann::json(nullptr);
        } else {
          j["min"] = bound(s.min, integral);
          j["max"] = bound(s.max, integral);
        }
        j["min_exclusive"] = (s.flags & LOOM_PARAM_MIN_EXCLUSIVE) != 0;
        j["max_exclusive"] = (s.flags & LOOM_PARAM_MAX_EXCLUSIVE) != 0;
      }
      if (s.list_length > 0) j["list_length"] = s.list_length;
      if (s.choices != nullptr) {
        nlohmann::json c = nlohmann::json::array();
        for (const char* const* x = s.choices; *x != nullptr; ++x) c.push_back(*x);
        j["choices"] = c;
      }
      if (s.type == LOOM_PARAM_REF) j["ref_kind"] = s.ref_kind;
      params.push_back(j);
    }
    kinds.push_back({{"kind", f.kind},
                     // false: a kind from a newer kind list; it loads, but has no section here
                     {"known", find_kind(f.kind) != nullptr},
                     {"has_state", f.raw.export_state != nullptr},
                     {"has_validate", f.raw.validate != nullptr},
                     {"params", params}});
  }
  return {{"name", p.name},
          {"version", p.version},
          {"description", p.description},
          {"abi", std::to_string(p.abi_major) + "." + std::to_string(p.abi_minor)},
          {"path", p.path.string()},
          {"kinds", kinds}};
}

// The document as a string the caller frees with loom_free_string.
int32_t hand_out(const nlohmann::json& doc, const char* fn, char** json_out) {
  const std::string text = doc.dump(2);
  *json_out = static_cast<char*>(std::malloc(text.size() + 1));
  if (*json_out == nullptr) {
    return set_last_error(LOOM_ERR_RESOURCE_EXHAUSTED, std::string(fn) + ": out of memory");
  }
  std::memcpy(*json_out, text.c_str(), text.size() + 1);
  return LOOM_OK;
}

}  // namespace
}  // namespace loom::host

extern "C" LOOM_API int32_t loom_describe_plugins(const char* name, const char* plugin_path,
                                                  char** json_out) {
  using loom::host::PluginCatalog;
  using loom::host::set_last_error;
  if (json_out == nullptr) {
    return set_last_error(LOOM_ERR_INVALID_ARGUMENT,
                          "loom_describe_plugins: json_out must not be NULL");
  }
  *json_out = nullptr;
  try {
    const PluginCatalog catalog(
        PluginCatalog::search_path({}, plugin_path != nullptr ? plugin_path : ""));
    nlohmann::json doc{{"search_path", nlohmann::json::array()},
                       {"plugins", nlohmann::json::array()},
                       {"errors", nlohmann::json::array()}};
    for (const auto& d : catalog.dirs()) doc["search_path"].push_back(d.string());
    int32_t rc = LOOM_OK;
    std::string error;  // the named plugin's, also in doc["errors"]
    if (name != nullptr) {
      try {
        doc["plugins"].push_back(loom::host::plugin_json(*catalog.load(name)));
      } catch (const loom::host::Error& e) {
        doc["errors"].push_back({{"path", catalog.locate(name).string()}, {"error", e.what()}});
        rc = e.code();
        error = e.what();
      }
    } else {
      // Every file: a broken one is listed in "errors" and the call still succeeds.
      for (const auto& file : catalog.available_files()) {
        try {
          doc["plugins"].push_back(loom::host::plugin_json(*loom::host::load_plugin(file)));
        } catch (const loom::host::Error& e) {
          doc["errors"].push_back({{"path", file.string()}, {"error", e.what()}});
        }
      }
    }
    if (const int32_t out = loom::host::hand_out(doc, "loom_describe_plugins", json_out);
        out != LOOM_OK) {
      return out;
    }
    if (rc != LOOM_OK) return set_last_error(rc, error);
    return loom::host::clear_last_error();
  } catch (const loom::host::Error& e) {
    return set_last_error(e.code(), std::string("loom_describe_plugins: ") + e.what());
  } catch (const std::bad_alloc&) {
    return set_last_error(LOOM_ERR_RESOURCE_EXHAUSTED, "loom_describe_plugins: out of memory");
  } catch (const std::exception& e) {
    return set_last_error(LOOM_ERR_INTERNAL, std::string("loom_describe_plugins: ") + e.what());
  } catch (...) {
    return set_last_error(LOOM_ERR_INTERNAL, "loom_describe_plugins: unknown exception");
  }
}

extern "C" LOOM_API int32_t loom_list_plugin_files(const char* name, const char* plugin_path,
                                                   char** json_out) {
  using loom::host::PluginCatalog;
  using loom::host::set_last_error;
  if (json_out == nullptr) {
    return set_last_error(LOOM_ERR_INVALID_ARGUMENT,
                          "loom_list_plugin_files: json_out must not be NULL");
  }
  *json_out = nullptr;
  try {
    const PluginCatalog catalog(
        PluginCatalog::search_path({}, plugin_path != nullptr ? plugin_path : ""));
    nlohmann::json doc{{"search_path", nlohmann::json::array()},
                       {"files", nlohmann::json::array()}};
    for (const auto& d : catalog.dirs()) doc["search_path"].push_back(d.string());
    if (name != nullptr) {
      // The catalog's own lookup, so the file is the one loom_describe_plugins would load.
      if (const auto file = catalog.locate(name); !file.empty()) {
        doc["files"].push_back(file.string());
      }
    } else {
      for (const auto& file : catalog.available_files()) doc["files"].push_back(file.string());
    }
    if (const int32_t out = loom::host::hand_out(doc, "loom_list_plugin_files", json_out);
        out != LOOM_OK) {
      return out;
    }
    return loom::host::clear_last_error();
  } catch (const loom::host::Error& e) {
    return set_last_error(e.code(), std::string("loom_list_plugin_files: ") + e.what());
  } catch (const std::bad_alloc&) {
    return set_last_error(LOOM_ERR_RESOURCE_EXHAUSTED, "loom_list_plugin_files: out of memory");
  } catch (const std::exception& e) {
    return set_last_error(LOOM_ERR_INTERNAL, std::string("loom_list_plugin_files: ") + e.what());
  } catch (...) {
    return set_last_error(LOOM_ERR_INTERNAL, "loom_list_plugin_files: unknown exception");
  }
}

extern "C" LOOM_API void loom_free_string(char* s) { std::free(s); }

namespace loom::host {
Session* session_of(loom_session* s);  // embed.cpp
namespace {

std::string where(const SourcePos& p) {
  return p.file + ":" + std::to_string(p.line) + ":" + std::to_string(p.column);
}

nlohmann::json value_json(const loom_param& p) {
  const loom_value& v = p.value;
  switch (v.type) {
    case LOOM_PARAM_BOOL:
      return v.int_value != 0;
    case LOOM_PARAM_INT:
      return v.int_value;
    case LOOM_PARAM_FLOAT:
      return v.float_value;
    case LOOM_PARAM_STRING:
    case LOOM_PARAM_REF:
      return v.string_value != nullptr ? v.string_value : "";
    case LOOM_PARAM_INT_LIST:
      return std::vector<int64_t>(v.int_list, v.int_list + v.count);
    case LOOM_PARAM_FLOAT_LIST:
      return std::vector<double>(v.float_list, v.float_list + v.count);
    case LOOM_PARAM_STRING_LIST: {
      nlohmann::json out = nlohmann::json::array();
      for (size_t i = 0; i < v.count; ++i) out.push_back(v.string_list[i]);
      return out;
    }
    default:
      return nullptr;
  }
}

}  // namespace
}  // namespace loom::host

extern "C" LOOM_API int32_t loom_declared_instances(loom_session* session, const char* kind,
                                                    char** json_out) {
  using loom::host::set_last_error;
  if (json_out != nullptr) *json_out = nullptr;
  if (session == nullptr || json_out == nullptr) {
    return set_last_error(LOOM_ERR_INVALID_ARGUMENT, "loom_declared_instances: NULL argument");
  }
  try {
    std::string_view id;
    if (kind != nullptr) {
      id = loom::host::normalize_kind(kind);
      if (id.empty()) {
        return set_last_error(LOOM_ERR_INVALID_ARGUMENT,
                              std::string("loom_declared_instances: unknown kind '") + kind +
                                  "'; this host knows the kinds " + loom::host::known_kind_ids());
      }
    }
    nlohmann::json doc = nlohmann::json::array();
    for (const auto& decl : loom::host::session_of(session)->manifest().instances) {
      if (!id.empty() && decl.kind != id) continue;
      doc.push_back({{"kind", decl.kind},
                     {"section", decl.section},
                     {"name", decl.name},
                     {"plugin", decl.plugin},
                     {"at", loom::host::where(decl.pos)}});
    }
    return loom::host::hand_out(doc, "loom_declared_instances", json_out);
  } catch (const std::exception& e) {
    return set_last_error(LOOM_ERR_INTERNAL, std::string("loom_declared_instances: ") + e.what());
  }
}

extern "C" LOOM_API int32_t loom_instance_params(loom_session* session, const char* kind,
                                                 const char* name, char** json_out) {
  using loom::host::set_last_error;
  if (json_out != nullptr) *json_out = nullptr;
  if (session == nullptr || kind == nullptr || name == nullptr || json_out == nullptr) {
    return set_last_error(LOOM_ERR_INVALID_ARGUMENT, "loom_instance_params: NULL argument");
  }
  try {
    const std::string_view id = loom::host::normalize_kind(kind);
    if (id.empty()) {
      return set_last_error(LOOM_ERR_INVALID_ARGUMENT,
                            std::string("loom_instance_params: unknown kind '") + kind +
                                "'; this host knows the kinds " + loom::host::known_kind_ids());
    }
    for (const auto& vi : loom::host::session_of(session)->validated().instances) {
      const auto& decl = *vi.decl;
      if (decl.kind != id || decl.name != name) continue;
      nlohmann::json params = nlohmann::json::object();
      for (const loom_param& p : vi.params.params) {
        std::string at;
        for (const auto& e : decl.entries) {
          if (p.name != nullptr && e.key == p.name) at = loom::host::where(e.key_pos);
        }
        params[p.name != nullptr ? p.name : ""] = {{"value", loom::host::value_json(p)},
                                                   {"at", at}};
      }
      const nlohmann::json doc{{"kind", decl.kind},
                               {"name", decl.name},
                               {"plugin", decl.plugin},
                               {"at", loom::host::where(decl.pos)},
                               {"params", std::move(params)}};
      return loom::host::hand_out(doc, "loom_instance_params", json_out);
    }
    return set_last_error(LOOM_ERR_NOT_FOUND, "loom_instance_params: the manifest declares no [" +
                                                  std::string(kind) + "." + name + "]");
  } catch (const std::exception& e) {
    return set_last_error(LOOM_ERR_INTERNAL, std::string("loom_instance_params: ") + e.what());
  }
}
