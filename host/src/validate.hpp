// Checking a parsed manifest against the schemas its plugins publish, resolving
// references between instances and ordering instances so dependencies come first.
#pragma once

#include <loom/abi.h>

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "diagnostics.hpp"
#include "manifest.hpp"
#include "plugin_info.hpp"

namespace loom::host {

// Owns everything the loom_param array of one instance points at.
struct ParamSet {
  // Values point into the deques below, so a ParamSet moves (deques keep their elements in
  // place) but never copies: a copy would leave the values pointing into the original.
  ParamSet() = default;
  ParamSet(const ParamSet&) = delete;
  ParamSet& operator=(const ParamSet&) = delete;
  ParamSet(ParamSet&&) = default;
  ParamSet& operator=(ParamSet&&) = default;
  ~ParamSet() = default;

  std::vector<loom_param> params;  // in schema order
  std::deque<std::string> strings;
  std::deque<std::vector<int64_t>> int_lists;
  std::deque<std::vector<double>> float_lists;
  std::deque<std::vector<const char*>> string_lists;
  // For each REF parameter: its index in params and the referenced instance's index in
  // ValidatedManifest::instances.
  std::vector<std::pair<size_t, size_t>> refs;
};

struct ValidatedInstance {
  const InstanceDecl* decl = nullptr;
  std::shared_ptr<const PluginInfo> plugin;
  const FactoryInfo* factory = nullptr;
  ParamSet params;
};

struct ValidatedManifest {
  std::vector<ValidatedInstance> instances;  // creation order: references first
};

// Finds a plugin by name; throws loom::host::Error whose message says why not.
using PluginResolver = std::function<std::shared_ptr<const PluginInfo>(const std::string& name)>;

// Validates every instance; errors go to `diags` (all of them, not only the first).
// `manifest` must outlive the result.
ValidatedManifest validate_manifest(const Manifest& manifest, const PluginResolver& resolve,
                                    Diagnostics& diags);

// "a float", "a list of 2 floats", "a reference to a loom.comm/1 instance", ...
std::string param_type_phrase(const loom_param_spec& spec);

}  // namespace loom::host
