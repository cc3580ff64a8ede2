// libFuzzer target for the manifest reader: arbitrary bytes go through
// loom::host::parse_manifest and validate_manifest, against an in-memory plugin whose
// schema uses every parameter type (no library is loaded, nothing is created).
// Besides crashes and sanitizer reports, it checks two invariants:
//  - every diagnostic names the manifest: its str() starts with the origin;
//  - a manifest without diagnostics validates to one instance per declaration, each with
//    one parameter per schema entry.
#include <loom/kinds/comm.h>
#include <loom/kinds/optimizer.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>

#include "diagnostics.hpp"
#include "kinds.hpp"
#include "manifest.hpp"
#include "plugin_info.hpp"
#include "status.hpp"
#include "validate.hpp"

namespace {

using loom::host::FactoryInfo;
using loom::host::PluginInfo;

constexpr const char* kOrigin = "fuzz.toml";
volatile size_t g_sink = 0;  // keeps the reads of parameter values from being optimised out

[[noreturn]] void invariant_failed(const char* what, const std::string& detail) {
  std::fprintf(stderr, "manifest_fuzz: invariant violated: %s: %s\n", what, detail.c_str());
  std::abort();
}

loom_status* never_create(const loom_host_services* /*host*/, void** /*out*/) { return nullptr; }

loom_param_spec spec(int32_t type, const char* name, double min = -INFINITY,
                     double max = INFINITY) {
  loom_param_spec s{};
  s.struct_size = LOOM_PARAM_SPEC_SIZE;
  s.type = type;
  s.name = name;
  s.doc = "fuzz";
  s.default_value.struct_size = LOOM_VALUE_SIZE;
  s.default_value.type = type;
  s.min = min;
  s.max = max;
  return s;
}

const char* const kChoices[] = {"sgd", "signsgd", nullptr};
const double kPair[] = {0.0, 1.0};
const uint32_t kVtableSize = 1024;  // only struct_size is ever read, and not here

FactoryInfo factory(const char* kind, std::vector<loom_param_spec> specs) {
  FactoryInfo f;
  f.kind = kind;
  f.specs = std::move(specs);
  f.raw.struct_size = LOOM_FACTORY_SIZE;
  f.raw.kind = kind;
  f.raw.param_specs = f.specs.data();
  f.raw.param_count = f.specs.size();
  f.raw.create = never_create;
  f.raw.vtable = &kVtableSize;
  return f;
}

std::shared_ptr<const PluginInfo> make_plugin() {
  auto p = std::make_shared<PluginInfo>();
  p->name = "probe";
  p->version = "1.0.0";
  p->path = "/nonexistent/loom_probe.so";
  p->abi_major = LOOM_ABI_MAJOR;
  p->abi_minor = LOOM_ABI_MINOR;

  auto tag = spec(LOOM_PARAM_STRING, "tag");
  tag.required = 1;
  auto flag = spec(LOOM_PARAM_BOOL, "flag");
  auto steps = spec(LOOM_PARAM_INT, "steps", 0, 1000);
  auto rate = spec(LOOM_PARAM_FLOAT, "rate", 0, 1);
  rate.default_value.float_value = 0.5;
  auto mode = spec(LOOM_PARAM_STRING, "mode");
  mode.choices = kChoices;
  mode.default_value.string_value = "sgd";
  auto sizes = spec(LOOM_PARAM_INT_LIST, "sizes", -5, 5);
  auto betas = spec(LOOM_PARAM_FLOAT_LIST, "betas", 0, 1);
  betas.list_length = 2;
  betas.default_value.count = 2;
  betas.default_value.float_list = kPair;
  auto names = spec(LOOM_PARAM_STRING_LIST, "names");
  auto comm = spec(LOOM_PARAM_REF, "comm");
  comm.ref_kind = LOOM_KIND_COMM;
  p->factories.push_back(
      factory(LOOM_KIND_OPTIMIZER, {tag, flag, steps, rate, mode, sizes, betas, names, comm}));

  auto peer = spec(LOOM_PARAM_REF, "peer");
  peer.ref_kind = LOOM_KIND_COMM;
  auto opt = spec(LOOM_PARAM_REF, "opt");
  opt.ref_kind = LOOM_KIND_OPTIMIZER;
  auto ranks = spec(LOOM_PARAM_INT, "ranks", 1, 64);
  p->factories.push_back(factory(LOOM_KIND_COMM, {peer, opt, ranks}));
  // The specs vectors moved into place: point raw.param_specs at their final homes.
  for (auto& f : p->factories) f.raw.param_specs = f.specs.data();
  return p;
}

const std::shared_ptr<const PluginInfo>& plugin() {
  static const auto p = make_plugin();
  return p;
}

std::shared_ptr<const PluginInfo> resolve(const std::string& name) {
  if (name == "probe") return plugin();
  throw loom::host::Error(LOOM_ERR_NOT_FOUND, "unknown plugin '" + name + "'" +
                                                  loom::host::did_you_mean(name, {"probe"}));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);  // NOLINT
  loom::host::Diagnostics diags;
  const auto manifest = loom::host::parse_manifest(text, kOrigin, "/fuzz", diags);
  const auto validated = loom::host::validate_manifest(manifest, resolve, diags);

  const std::string origin(kOrigin);
  for (const auto& d : diags.items()) {
    const std::string s = d.str();
    if (s.compare(0, origin.size(), origin) != 0) invariant_failed("diagnostic without origin", s);
  }
  (void)diags.str();
  if (diags.empty()) {
    if (validated.instances.size() != manifest.instances.size()) {
      invariant_failed("instance count",
                       std::to_string(validated.instances.size()) + " validated of " +
                           std::to_string(manifest.instances.size()) + " declared");
    }
    for (const auto& inst : validated.instances) {
      if (inst.factory == nullptr || inst.params.params.size() != inst.factory->specs.size()) {
        invariant_failed("parameter count", inst.decl != nullptr ? inst.decl->label() : "?");
      }
      // Every value the plugin would read must be live memory (ASan checks the reads).
      size_t bytes = 0;
      for (const auto& prm : inst.params.params) {
        const loom_value& v = prm.value;
        if (v.string_value != nullptr) bytes += std::strlen(v.string_value);
        for (size_t k = 0; k < v.count; ++k) {
          if (v.type == LOOM_PARAM_INT_LIST && v.int_list != nullptr) bytes += v.int_list[k] != 0;
          if (v.type == LOOM_PARAM_FLOAT_LIST && v.float_list != nullptr)
            bytes += v.float_list[k] != 0;
          if (v.type == LOOM_PARAM_STRING_LIST && v.string_list != nullptr) {
            bytes += std::strlen(v.string_list[k]);
          }
        }
      }
      g_sink = g_sink + bytes;
      for (const auto& [param, target] : inst.params.refs) {
        if (param >= inst.params.params.size() || target >= validated.instances.size()) {
          invariant_failed("reference index", inst.decl->label());
        }
        // References point at instances created earlier.
        if (&validated.instances[target] >= &inst) {
          invariant_failed("reference order", inst.decl->label());
        }
      }
    }
  } else if (!validated.instances.empty()) {
    invariant_failed("instances from an invalid manifest", diags.str());
  }
  return 0;
}
