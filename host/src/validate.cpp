#include "validate.hpp"

#include <loom/kinds/optimizer.h>
#include <loom_text.hpp>

#include <cmath>
#include <map>
#include <sstream>
#include <string>
#include <utility>

#include "status.hpp"

namespace loom::host {
namespace {

// DeepSpeed optimizer keys that people carry into a manifest, and what Loom does instead
// (python -m loom.deepspeed gives the same reasons when it converts a config).
std::string deepspeed_hint(const std::string& kind, const std::string& key) {
  if (kind != LOOM_KIND_OPTIMIZER) return "";
  static const std::pair<const char*, const char*> kHints[] = {
      {"lr",
       "Loom takes the learning rate per step from the trainer or its scheduler, not from the "
       "manifest"},
      {"amsgrad", "Loom's optimizers have no AMSGrad variant (false is what they do)"},
      {"torch_adam", "Loom's adam already follows torch.optim's arithmetic"},
      {"max_grad_norm", "gradient clipping is the trainer's (clip before the step)"},
      {"eps_inside_sqrt", "Loom adds eps outside the square root only (torch.optim's placement)"},
      {"cuda_aware",
       "the transport is the [comm] instance the optimizer's comm parameter names (ucx and mpi "
       "work on host memory, nccl on device memory)"},
      {"comm_backend_name",
       "the transport is the [comm] instance the optimizer's comm parameter names (plugin "
       "ucx, mpi or nccl)"},
      {"fused", "Loom's kernels are always fused"},
      {"foreach", "Loom's kernels are always multi-tensor"},
      {"capturable", "not a Loom setting"},
      {"maximize", "Loom's optimizers minimise; negate the loss instead"},
  };
  for (const auto& [name, why] : kHints) {
    if (key == name) return "; '" + key + "' is a DeepSpeed key: " + why;
  }
  return "";
}

using Type = ManifestValue::Type;

bool min_exclusive(const loom_param_spec& spec) {
  return (spec.flags & LOOM_PARAM_MIN_EXCLUSIVE) != 0;
}
bool max_exclusive(const loom_param_spec& spec) {
  return (spec.flags & LOOM_PARAM_MAX_EXCLUSIVE) != 0;
}
bool exact_ints(const loom_param_spec& spec, int32_t type) {
  return type == LOOM_PARAM_INT && (spec.flags & LOOM_PARAM_INT_RANGE) != 0;
}

// What a value outside the spec's range is told, after "NAME = VALUE ": "is out of range
// [0, 1]" ("(0, 1]" with an exclusive bound), or "must be > 0" when only one side is bounded.
// Exact int64 bounds print as integers.
std::string range_error(const loom_param_spec& spec, int32_t type) {
  std::string lo;
  std::string hi;
  if (exact_ints(spec, type)) {
    if (spec.int_min != INT64_MIN || min_exclusive(spec)) lo = std::to_string(spec.int_min);
    if (spec.int_max != INT64_MAX || max_exclusive(spec)) hi = std::to_string(spec.int_max);
  } else {
    // Integers without exact bounds use +-9.2e18 for "none", as the ABI suggests.
    const double none = type == LOOM_PARAM_INT ? 9.2e18 : INFINITY;
    if (std::abs(spec.min) < none) lo = loom_text::number(spec.min);
    if (std::abs(spec.max) < none) hi = loom_text::number(spec.max);
  }
  if (!lo.empty() && !hi.empty()) {
    return std::string("is out of range ") + (min_exclusive(spec) ? "(" : "[") + lo + ", " + hi +
           (max_exclusive(spec) ? ")" : "]");
  }
  if (!lo.empty()) return std::string("must be ") + (min_exclusive(spec) ? "> " : ">= ") + lo;
  if (!hi.empty()) return std::string("must be ") + (max_exclusive(spec) ? "< " : "<= ") + hi;
  return "is out of range";  // only NaN gets here
}

bool int_in_range(int64_t x, const loom_param_spec& spec) {
  if ((spec.flags & LOOM_PARAM_INT_RANGE) != 0) {
    return (min_exclusive(spec) ? x > spec.int_min : x >= spec.int_min) &&
           (max_exclusive(spec) ? x < spec.int_max : x <= spec.int_max);
  }
  const auto d = static_cast<double>(x);
  return (min_exclusive(spec) ? d > spec.min : d >= spec.min) &&
         (max_exclusive(spec) ? d < spec.max : d <= spec.max);
}

bool float_in_range(double x, const loom_param_spec& spec) {
  return !std::isnan(x) && (min_exclusive(spec) ? x > spec.min : x >= spec.min) &&
         (max_exclusive(spec) ? x < spec.max : x <= spec.max);
}

bool is_list(int32_t type) {
  return type == LOOM_PARAM_INT_LIST || type == LOOM_PARAM_FLOAT_LIST ||
         type == LOOM_PARAM_STRING_LIST;
}

int32_t element_type(int32_t list_type) {
  switch (list_type) {
    case LOOM_PARAM_INT_LIST:
      return LOOM_PARAM_INT;
    case LOOM_PARAM_FLOAT_LIST:
      return LOOM_PARAM_FLOAT;
    default:
      return LOOM_PARAM_STRING;
  }
}

const char* scalar_phrase(int32_t type) {
  switch (type) {
    case LOOM_PARAM_BOOL:
      return "a boolean";
    case LOOM_PARAM_INT:
      return "an integer";
    case LOOM_PARAM_FLOAT:
      return "a number";
    default:
      return "a string";
  }
}

// Checks one scalar against its spec's type, range and choices. `what` names it.
bool check_scalar(const ManifestValue& v, int32_t type, const loom_param_spec& spec,
                  const std::string& what, Diagnostics& diags) {
  switch (type) {
    case LOOM_PARAM_BOOL:
      if (v.type == Type::kBool) return true;
      break;
    case LOOM_PARAM_INT:
      if (v.type == Type::kInt) {
        if (!int_in_range(v.int_value, spec)) {
          diags.error(v.pos,
                      what + " = " + std::to_string(v.int_value) + " " + range_error(spec, type));
          return false;
        }
        return true;
      }
      break;
    case LOOM_PARAM_FLOAT:
      if (v.type == Type::kInt || v.type == Type::kFloat) {
        const double x = v.type == Type::kInt ? static_cast<double>(v.int_value) : v.float_value;
        if (!float_in_range(x, spec)) {
          diags.error(v.pos, what + " = " + loom_text::number(x) + " " + range_error(spec, type));
          return false;
        }
        return true;
      }
      break;
    default:  // STRING, REF
      if (v.type == Type::kString) {
        if (type == LOOM_PARAM_STRING && spec.choices != nullptr) {
          std::vector<std::string> choices;
          for (const char* const* c = spec.choices; *c != nullptr; ++c) choices.emplace_back(*c);
          for (const auto& c : choices) {
            if (c == v.string_value) return true;
          }
          std::string list;
          for (const auto& c : choices) list += (list.empty() ? "'" : ", '") + c + "'";
          diags.error(v.pos, what + " = " + loom_text::quoted(v.string_value) + " is not one of " +
                                 list + did_you_mean(v.string_value, choices));
          return false;
        }
        return true;
      }
      break;
  }
  diags.error(v.pos, what + " must be " + scalar_phrase(type) + ", not " + type_phrase(v.type));
  return false;
}

// Fills a loom_value from a manifest value that passed its checks.
loom_value to_value(const ManifestValue& v, const loom_param_spec& spec, ParamSet& set) {
  loom_value out{};
  out.struct_size = LOOM_VALUE_SIZE;
  out.type = spec.type;
  switch (spec.type) {
    case LOOM_PARAM_BOOL:
      out.int_value = v.bool_value ? 1 : 0;
      break;
    case LOOM_PARAM_INT:
      out.int_value = v.int_value;
      break;
    case LOOM_PARAM_FLOAT:
      out.float_value = v.type == Type::kInt ? static_cast<double>(v.int_value) : v.float_value;
      break;
    case LOOM_PARAM_STRING:
    case LOOM_PARAM_REF:
      out.string_value = set.strings.emplace_back(v.string_value).c_str();
      break;
    case LOOM_PARAM_INT_LIST: {
      auto& list = set.int_lists.emplace_back();
      for (const auto& item : v.items) list.push_back(item.int_value);
      out.count = list.size();
      out.int_list = list.data();
      break;
    }
    case LOOM_PARAM_FLOAT_LIST: {
      auto& list = set.float_lists.emplace_back();
      for (const auto& item : v.items) {
        list.push_back(item.type == Type::kInt ? static_cast<double>(item.int_value)
                                               : item.float_value);
      }
      out.count = list.size();
      out.float_list = list.data();
      break;
    }
    case LOOM_PARAM_STRING_LIST: {
      auto& ptrs = set.string_lists.emplace_back();
      for (const auto& item : v.items)
        ptrs.push_back(set.strings.emplace_back(item.string_value).c_str());
      out.count = ptrs.size();
      out.string_list = ptrs.data();
      break;
    }
    default:
      break;
  }
  return out;
}

// The default as the plugin declared it, with this host's struct size and the spec's type.
loom_value default_value(const loom_param_spec& spec) {
  loom_value out = spec.default_value;
  out.struct_size = LOOM_VALUE_SIZE;
  out.type = spec.type;
  return out;
}

bool check_value(const ManifestValue& v, const loom_param_spec& spec, const std::string& what,
                 Diagnostics& diags) {
  if (!is_list(spec.type)) return check_scalar(v, spec.type, spec, what, diags);
  if (v.type != Type::kArray) {
    diags.error(v.pos,
                what + " must be " + param_type_phrase(spec) + ", not " + type_phrase(v.type));
    return false;
  }
  if (spec.list_length > 0 && v.items.size() != static_cast<size_t>(spec.list_length)) {
    diags.error(v.pos, what + " must have " + std::to_string(spec.list_length) + " elements, not " +
                           std::to_string(v.items.size()));
    return false;
  }
  bool ok = true;
  for (size_t i = 0; i < v.items.size(); ++i) {
    ok &= check_scalar(v.items[i], element_type(spec.type), spec,
                       "element " + std::to_string(i) + " of " + what, diags);
  }
  return ok;
}

loom_status* hook_make_status(void* /*host_ctx*/, int32_t code, const char* message) noexcept {
  return make_status(code, message);
}

// The factory's cross-parameter check (ABI 1.2), on an instance whose parameters passed the
// schema. Its error goes to the key it blames (the instance's table when that key was not set,
// or when it blames none); an exception escaping it is reported, never propagated. False when
// it refused the parameters.
bool run_validate_hook(const ValidatedInstance& inst,
                       const std::map<std::string, const ManifestEntry*>& given,
                       Diagnostics& diags) {
  const auto hook = inst.factory->raw.validate;
  if (hook == nullptr) return true;
  const InstanceDecl& decl = *inst.decl;
  const auto& params = inst.params.params;
  loom_validate_args args{};
  args.struct_size = LOOM_VALIDATE_ARGS_SIZE;
  args.params = params.empty() ? nullptr : params.data();
  args.param_count = params.size();
  args.instance_name = decl.name.c_str();
  args.make_status = hook_make_status;
  args.bad_param = -1;
  const std::string who = decl.label() + " (" + inst.plugin->label() + ")";
  bool returned = false;
  loom_status* raw = guarded_call(who + ": validate", [&] {
    loom_status* st = hook(&args);
    returned = true;
    return st;
  });
  if (!returned) args.bad_param = -1;  // it threw: blame the instance, not a key
  if (raw == nullptr) return true;
  const std::string message = take_status(raw).message;  // a status is an error, whatever its code
  if (args.bad_param >= 0 && static_cast<size_t>(args.bad_param) < params.size()) {
    const std::string name = params[static_cast<size_t>(args.bad_param)].name;
    const auto it = given.find(name);
    if (it != given.end()) {
      diags.error(it->second->key_pos,
                  "parameter '" + name + "' of " + decl.label() + ": " + message);
    } else {
      diags.error(decl.pos, "parameter '" + name + "' of " + decl.label() +
                                " (not set, so its default): " + message);
    }
  } else {
    diags.error(decl.pos,
                decl.label() + " (plugin " + loom_text::quoted(decl.plugin) + "): " + message);
  }
  return false;
}

}  // namespace

std::string param_type_phrase(const loom_param_spec& spec) {
  const std::string n = spec.list_length > 0 ? std::to_string(spec.list_length) + " " : "";
  switch (spec.type) {
    case LOOM_PARAM_BOOL:
    case LOOM_PARAM_INT:
    case LOOM_PARAM_FLOAT:
    case LOOM_PARAM_STRING:
      return scalar_phrase(spec.type);
    case LOOM_PARAM_INT_LIST:
      return "an array of " + n + "integers";
    case LOOM_PARAM_FLOAT_LIST:
      return "an array of " + n + "numbers";
    case LOOM_PARAM_STRING_LIST:
      return "an array of " + n + "strings";
    case LOOM_PARAM_REF:
      return std::string("the name of a ") + (spec.ref_kind ? spec.ref_kind : "?") + " instance";
    default:
      return "a value";
  }
}

ValidatedManifest validate_manifest(const Manifest& manifest, const PluginResolver& resolve,
                                    Diagnostics& diags) {
  // Names are global across kinds, since references name instances without their kind.
  std::map<std::string, size_t> by_name;
  std::vector<std::string> all_names;
  std::vector<bool> usable(manifest.instances.size(), false);
  for (size_t i = 0; i < manifest.instances.size(); ++i) {
    const auto& decl = manifest.instances[i];
    auto [it, inserted] = by_name.emplace(decl.name, i);
    if (!inserted) {
      const auto& first = manifest.instances[it->second];
      diags.error(decl.pos, "duplicate instance name " + loom_text::quoted(decl.name) + ": " +
                                decl.label() + " and " + first.label() + " (declared at " +
                                std::to_string(first.pos.line) + ":" +
                                std::to_string(first.pos.column) +
                                "); names must be unique across all kinds");
      continue;
    }
    all_names.push_back(decl.name);
    usable[i] = true;
  }

  // Per-declaration results, indexed like manifest.instances.
  std::vector<ValidatedInstance> checked(manifest.instances.size());
  std::vector<std::vector<std::pair<size_t, size_t>>> edges(manifest.instances.size());
  std::map<std::pair<size_t, size_t>, SourcePos> edge_pos;

  for (size_t i = 0; i < manifest.instances.size(); ++i) {
    const auto& decl = manifest.instances[i];
    auto& out = checked[i];
    out.decl = &decl;
    if (!usable[i] || decl.plugin.empty()) {
      usable[i] = false;
      continue;
    }
    try {
      out.plugin = resolve(decl.plugin);
    } catch (const Error& e) {
      diags.error(decl.plugin_pos, decl.label() + ": " + e.what());
      usable[i] = false;
      continue;
    }
    out.factory = out.plugin->find_factory(decl.kind);
    if (out.factory == nullptr) {
      std::string kinds;
      for (const auto& f : out.plugin->factories) kinds += (kinds.empty() ? "" : ", ") + f.kind;
      diags.error(decl.plugin_pos, decl.label() + ": " + out.plugin->label() +
                                       " does not provide " + decl.kind + " (it provides " +
                                       (kinds.empty() ? "nothing" : kinds) + ")");
      usable[i] = false;
      continue;
    }
    const auto& specs = out.factory->specs;
    std::vector<std::string> spec_names{"plugin"};
    for (const auto& s : specs) spec_names.emplace_back(s.name);
    std::map<std::string, const ManifestEntry*> given;
    for (const auto& entry : decl.entries) {
      if (out.factory->find_spec(entry.key) == nullptr) {
        std::string known;
        for (const auto& s : specs) known += (known.empty() ? "" : ", ") + std::string(s.name);
        diags.error(entry.key_pos,
                    "unknown parameter " + loom_text::quoted(entry.key) + " for " + decl.label() +
                        " (plugin " + loom_text::quoted(decl.plugin) + ")" +
                        did_you_mean(entry.key, spec_names) +
                        (known.empty() ? "; it takes no parameters" : "; it takes: " + known) +
                        deepspeed_hint(decl.kind, entry.key));
        usable[i] = false;
        continue;
      }
      given[entry.key] = &entry;
    }
    auto& set = out.params;
    for (size_t s = 0; s < specs.size(); ++s) {
      const auto& spec = specs[s];
      loom_param p{};
      p.struct_size = LOOM_PARAM_SIZE;
      p.name = spec.name;
      const auto it = given.find(spec.name);
      if (it == given.end()) {
        if (spec.required != 0) {
          diags.error(decl.pos, decl.label() + " is missing required parameter '" +
                                    std::string(spec.name) + "' (" + param_type_phrase(spec) + ")");
          usable[i] = false;
        }
        p.value = default_value(spec);
        set.params.push_back(p);
        // A reference with a default names an instance too; resolve it like a given one.
        if (spec.type == LOOM_PARAM_REF && spec.required == 0 && p.value.string_value != nullptr &&
            *p.value.string_value != '\0') {
          const std::string target = p.value.string_value;
          const auto t = by_name.find(target);
          const std::string what = "parameter '" + std::string(spec.name) + "' of " + decl.label();
          if (t == by_name.end()) {
            diags.error(decl.pos,
                        what + " defaults to instance '" + target +
                            "', which the manifest does not declare; declare it or set '" +
                            spec.name + "'");
            usable[i] = false;
          } else if (manifest.instances[t->second].kind != spec.ref_kind) {
            diags.error(decl.pos, what + " defaults to '" + target + "', which is " +
                                      manifest.instances[t->second].label() + ", not a " +
                                      spec.ref_kind + " instance");
            usable[i] = false;
          } else {
            set.params.back().value.string_value = set.strings.emplace_back(target).c_str();
            edges[i].emplace_back(s, t->second);
            edge_pos[{i, t->second}] = decl.pos;
          }
        }
        continue;
      }
      const ManifestEntry& entry = *it->second;
      const std::string what = "parameter " + loom_text::quoted(entry.key) + " of " + decl.label();
      if (!check_value(entry.value, spec, what, diags)) {
        usable[i] = false;
        set.params.push_back(p);
        continue;
      }
      p.value = to_value(entry.value, spec, set);
      set.params.push_back(p);
      if (spec.type != LOOM_PARAM_REF) continue;
      const std::string& target = entry.value.string_value;
      const auto t = by_name.find(target);
      if (t == by_name.end()) {
        diags.error(entry.value.pos, what + " references unknown instance " +
                                         loom_text::quoted(target) +
                                         did_you_mean(target, all_names));
        usable[i] = false;
        continue;
      }
      const auto& target_decl = manifest.instances[t->second];
      if (target_decl.kind != spec.ref_kind) {
        diags.error(entry.value.pos, what + " must name a " + std::string(spec.ref_kind) +
                                         " instance, but " + loom_text::quoted(target) + " is " +
                                         target_decl.label() + " (" + target_decl.kind + ")");
        usable[i] = false;
        continue;
      }
      edges[i].emplace_back(s, t->second);
      edge_pos[{i, t->second}] = entry.value.pos;
    }
    // Every parameter passed the schema: the plugin's own cross-parameter check.
    if (usable[i] && !run_validate_hook(out, given, diags)) usable[i] = false;
  }

  // Depth-first order so that every instance comes after what it references; a back edge
  // is a cycle, reported once at the reference that closes it.
  enum class Mark { kNone, kActive, kDone };
  std::vector<Mark> mark(manifest.instances.size(), Mark::kNone);
  std::vector<size_t> order;
  std::vector<size_t> stack;
  std::function<void(size_t)> visit = [&](size_t i) {
    mark[i] = Mark::kActive;
    stack.push_back(i);
    for (const auto& [param, target] : edges[i]) {
      if (mark[target] == Mark::kActive) {
        std::string path;
        bool on = false;
        for (const size_t s : stack) {
          on = on || s == target;
          if (on) {
            path += manifest.instances[s].label() + " -> ";
          }
        }
        path += manifest.instances[target].label();
        diags.error(edge_pos[{i, target}], "reference cycle: " + path);
      } else if (mark[target] == Mark::kNone) {
        visit(target);
      }
    }
    stack.pop_back();
    mark[i] = Mark::kDone;
    order.push_back(i);
  };
  for (size_t i = 0; i < manifest.instances.size(); ++i) {
    if (mark[i] == Mark::kNone) visit(i);
  }

  ValidatedManifest result;
  if (!diags.empty()) return result;  // nothing is created from a manifest with errors
  std::vector<size_t> position(manifest.instances.size());
  for (size_t k = 0; k < order.size(); ++k) position[order[k]] = k;
  result.instances.reserve(order.size());
  for (const size_t i : order) {
    for (const auto& [param, target] : edges[i]) {
      checked[i].params.refs.emplace_back(param, position[target]);
    }
    result.instances.push_back(std::move(checked[i]));
  }
  return result;
}

}  // namespace loom::host
