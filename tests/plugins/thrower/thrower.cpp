// thrower: a misbehaving plugin, in C++ without the SDK. Its entry is fine, but
//  - creating its loom.comm/1 kind throws std::runtime_error straight through the C
//    function pointer (what the SDK's noexcept trampolines exist to prevent);
//  - its loom.optimizer/1 step returns an error status it allocates itself, or throws
//    when the instance was created with throw_in_step = true.
// The host must turn both into errors that name the plugin and its file, and live on.
#include <loom/abi.h>
#include <loom/kinds/comm.h>
#include <loom/kinds/optimizer.h>

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

namespace {

struct ThrowerStatus {
  loom_status base{};
  std::string text;
};

loom_status* make_error(int32_t code, std::string text) {
  auto* s = new ThrowerStatus{};
  s->text = std::move(text);
  s->base.struct_size = LOOM_STATUS_SIZE;
  s->base.code = code;
  s->base.message = s->text.c_str();
  s->base.destroy = [](loom_status* self) {
    delete reinterpret_cast<ThrowerStatus*>(self);  // NOLINT: base is the first member
  };
  return &s->base;
}

struct Optimizer {
  bool throw_in_step = false;
  int calls = 0;
};

loom_status* opt_create(const loom_host_services* host, void** out) {
  auto* o = new Optimizer{};
  for (size_t i = 0; i < host->param_count; ++i) {
    if (std::strcmp(host->params[i].name, "throw_in_step") == 0) {
      o->throw_in_step = host->params[i].value.int_value != 0;
    }
  }
  *out = o;
  return nullptr;
}

void opt_destroy(void* instance) { delete static_cast<Optimizer*>(instance); }

loom_status* opt_step(void* instance, const loom_optimizer_step_args* /*args*/) {
  auto* o = static_cast<Optimizer*>(instance);
  ++o->calls;
  if (o->throw_in_step) {
    throw std::runtime_error("thrower: step " + std::to_string(o->calls) + " exploded");
  }
  return make_error(LOOM_ERR_FAILED_PRECONDITION,
                    "thrower: step " + std::to_string(o->calls) + " refused");
}

loom_status* comm_create(const loom_host_services* /*host*/, void** /*out*/) {
  throw std::runtime_error("thrower: comm create exploded");
}

void comm_destroy(void* /*instance*/) {}

int32_t comm_rank(void*) { return 0; }
int32_t comm_size(void*) { return 1; }
int32_t comm_supports(void*, DLDevice) { return 0; }
loom_status* comm_allreduce(void*, const loom_allreduce_args*) { return nullptr; }
loom_status* comm_allgather(void*, const loom_allgather_args*) { return nullptr; }
loom_status* comm_all_to_all(void*, const loom_all_to_all_args*) { return nullptr; }
loom_status* comm_broadcast(void*, const loom_broadcast_args*) { return nullptr; }
loom_status* comm_barrier(void*, void*) { return nullptr; }
loom_status* comm_stats(void*, loom_comm_stats*) { return nullptr; }

loom_param_spec opt_spec() {
  loom_param_spec s{};
  s.struct_size = LOOM_PARAM_SPEC_SIZE;
  s.type = LOOM_PARAM_BOOL;
  s.name = "throw_in_step";
  s.doc = "Throw from step instead of returning an error status.";
  s.default_value.struct_size = LOOM_VALUE_SIZE;
  s.default_value.type = LOOM_PARAM_BOOL;
  s.min = -INFINITY;
  s.max = INFINITY;
  return s;
}

const loom_param_spec k_opt_specs[] = {opt_spec()};
const loom_optimizer_v1 k_opt_vtable{LOOM_OPTIMIZER_V1_SIZE, 0, opt_step, nullptr};
const loom_factory k_opt_factory{
    LOOM_FACTORY_SIZE, 0,           LOOM_KIND_OPTIMIZER, k_opt_specs, 1,
    opt_create,        opt_destroy, &k_opt_vtable,       nullptr,     nullptr};

const loom_comm_v1 k_comm_vtable{LOOM_COMM_V1_SIZE, 0,
                                 comm_rank,         comm_size,
                                 comm_supports,     comm_allreduce,
                                 comm_allgather,    comm_all_to_all,
                                 comm_broadcast,    comm_barrier,
                                 comm_stats,        nullptr};
const loom_factory k_comm_factory{
    LOOM_FACTORY_SIZE, 0,       LOOM_KIND_COMM, nullptr, 0, comm_create, comm_destroy,
    &k_comm_vtable,    nullptr, nullptr};

const loom_factory* const k_factories[] = {&k_opt_factory, &k_comm_factory};
const loom_plugin_v1 k_plugin{LOOM_PLUGIN_V1_SIZE,
                              LOOM_ABI_MAJOR,
                              LOOM_ABI_MINOR,
                              "thrower",
                              "0.0.1",
                              "Test plugin that throws and fails",
                              k_factories,
                              2};

}  // namespace

extern "C" LOOM_EXPORT const loom_plugin_v1* loom_plugin_entry_v1(void) { return &k_plugin; }
