// The "loom.optimizer/1" kind in the SDK (loom/kinds/optimizer.h): the base class an optimizer
// derives from and the table the SDK builds from it.
#ifndef LOOM_SDK_KINDS_OPTIMIZER_HPP
#define LOOM_SDK_KINDS_OPTIMIZER_HPP

#include <loom/kinds/optimizer.h>
#include <loom/sdk/kinds/table.hpp>
#include <loom/sdk/plugin.hpp>

namespace loom::sdk {

// "loom.optimizer/1"
//   required: void step(const loom_optimizer_step_args&)
//   optional: void comm_info(loom_optimizer_comm_info&)
//             void grads_ready(const loom_optimizer_ready_args&)  (since 1.6; args.step is the
//             SDK's normalized copy, as step()'s)
struct Optimizer {
  static constexpr const char* kKind = LOOM_KIND_OPTIMIZER;
  using sdk_kind = Optimizer;
};

namespace detail {

template <class T>
struct OptimizerTable {
  using E = Entry<T>;

  static loom_status* step(void* instance, const loom_optimizer_step_args* args) noexcept {
    return E::forward(instance, args, "step args", [](T& obj, const auto& a) { obj.step(a); });
  }
  static loom_status* comm_info(void* instance, loom_optimizer_comm_info* out) noexcept {
    return E::filled(instance, out, "comm_info out",
                     [](T& obj, auto& full) { obj.comm_info(full); });
  }

  static loom_status* grads_ready(void* instance, const loom_optimizer_ready_args* args) noexcept {
    return E::forward(instance, args, "grads_ready args", [](T& obj, const auto& a) {
      if (a.step == nullptr) throw Error(LOOM_ERR_INVALID_ARGUMENT, "grads_ready: NULL step args");
      auto full = a;
      const auto step = normalized(a.step, "grads_ready step args");
      full.step = &step;
      obj.grads_ready(full);
    });
  }

  static const loom_optimizer_v1* get() {
    static_assert(
        requires(T & t, const loom_optimizer_step_args& a) { t.step(a); },
        "an Optimizer needs void step(const loom_optimizer_step_args&)");
    static const loom_optimizer_v1 table = [] {
      loom_optimizer_v1 v{};
      v.struct_size = LOOM_OPTIMIZER_V1_SIZE;
      v.step = &step;
      if constexpr (requires(T & t, loom_optimizer_comm_info & o) { t.comm_info(o); }) {
        v.comm_info = &comm_info;
      }
      if constexpr (requires(T & t, const loom_optimizer_ready_args& a) { t.grads_ready(a); }) {
        v.grads_ready = &grads_ready;
      }
      return v;
    }();
    return &table;
  }
};

template <>
struct KindTraits<Optimizer> {
  template <class T>
  static const void* table() {
    return OptimizerTable<T>::get();
  }
};

}  // namespace detail
}  // namespace loom::sdk

#endif  // LOOM_SDK_KINDS_OPTIMIZER_HPP
