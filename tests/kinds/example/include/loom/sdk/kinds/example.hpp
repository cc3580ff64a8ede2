// The SDK side of loom.example/1 (loom/kinds/example.h): its base class, its table and the
// KindTraits that let factory<T>() build a factory for a class derived from Example.
#pragma once

#include <loom/kinds/example.h>
#include <loom/sdk/kinds/table.hpp>

namespace loom::sdk {

// "loom.example/1": required void run(loom_example_args&) [instance]; the SDK checks the
// args' size and that steps >= 1 before the class sees them.
struct Example {
  static constexpr const char* kKind = LOOM_KIND_EXAMPLE;
  using sdk_kind = Example;
};

namespace detail {

template <class T>
struct ExampleTable {
  static loom_status* run(void* instance, loom_example_args* args) noexcept {
    return Entry<T>::checked(instance, args, LOOM_EXAMPLE_ARGS_SIZE, "example args",
                             [](loom_example_args& a, const Instance<T>& self) {
                               at_least(a.steps, 1, "steps", "example run");
                               self.object().run(a);
                             });
  }
  static const loom_example_v1* get() {
    static const loom_example_v1 table{LOOM_EXAMPLE_V1_SIZE, 0, &run};
    return &table;
  }
};

template <>
struct KindTraits<Example> {
  template <class T>
  static const void* table() {
    return ExampleTable<T>::get();
  }
};

}  // namespace detail
}  // namespace loom::sdk
