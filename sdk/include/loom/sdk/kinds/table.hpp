// What every kind's SDK header (loom/sdk/kinds/NAME.hpp) builds its function table from: the
// one registration point (KindTraits) and the one shape of a table entry (Entry).
//
// A kind registers itself next to its base class, with no list to edit (tests/kinds/example
// has a whole kind written this way):
//
//   struct Name {                                     // what a plugin class derives from
//     static constexpr const char* kKind = LOOM_KIND_NAME;
//     using sdk_kind = Name;                          // how factory<T>() finds the kind
//   };
//   template <class T> struct NameTable { static const loom_name_v1* get(); ... };
//   template <> struct detail::KindTraits<Name> {
//     template <class T> static const void* table() { return NameTable<T>::get(); }
//   };
//
// Every C entry of a table is written with Entry<T>: the body runs under guard(), so no
// exception crosses the C boundary, and the instance is looked up (and checked for NULL)
// only when the body asks for it, after the argument checks that come first.
#ifndef LOOM_SDK_KINDS_TABLE_HPP
#define LOOM_SDK_KINDS_TABLE_HPP

#include <loom/abi.h>
#include <loom/sdk/kinds/checks.hpp>
#include <loom/sdk/status.hpp>

#include <type_traits>
#include <utility>

namespace loom::sdk::detail {

// Specialised by each kind header for its base class; the primary is never defined.
template <class Base>
struct KindTraits;

// The kind base class T derives from (T::sdk_kind names it; two bases make it ambiguous).
template <class T>
concept HasOneKind = requires {
  typename T::sdk_kind;
}
&&std::is_base_of_v<typename T::sdk_kind, T>;

// The instance as the host holds it (loom/sdk/plugin.hpp defines these).
template <class T>
struct Holder;
template <class T>
Holder<T>& holder(void* instance);
template <class T>
T& object(void* instance);
template <class T>
T& shared_object(void* instance);

// The instance a table entry was called on, resolved on first use.
template <class T>
struct Instance {
  void* raw;
  // For an [instance] call: ends the export cache's validity (see Holder).
  T& object() const { return detail::object<T>(raw); }
  // For an [any] call: concurrent calls may run, and they do not change the state.
  T& shared() const { return shared_object<T>(raw); }
  Holder<T>& holder() const { return detail::holder<T>(raw); }
};

// The entries of T's table, one shape each.
template <class T>
struct Entry {
  // The common entry: `body(args, self)` once the caller's args struct is present and reaches
  // `end` bytes (expect_args), `what` naming it in the messages.
  template <class Args, class Body>
  static loom_status* checked(void* instance, Args* args, uint32_t end, const char* what,
                              Body&& body) noexcept {
    return guard([&] { body(expect_args(args, end, what), Instance<T>{instance}); });
  }

  // An [instance] call whose args reach the class copied into a zeroed full-size struct
  // (normalized): `body(object, args)`.
  template <class Args, class Body>
  static loom_status* forward(void* instance, const Args* args, const char* what,
                              Body&& body) noexcept {
    return guard([&] {
      T& obj = object<T>(instance);
      body(obj, normalized(args, what));
    });
  }

  // An [instance] call that fills an out struct the caller sized (fill): `body(object, full)`.
  template <class Out, class Body>
  static loom_status* filled(void* instance, Out* out, const char* what, Body&& body) noexcept {
    return guard([&] { fill(out, what, [&](Out& full) { body(object<T>(instance), full); }); });
  }

  // Anything else that reports a status: `body(self)`.
  template <class Body>
  static loom_status* plain(void* instance, Body&& body) noexcept {
    return guard([&] { body(Instance<T>{instance}); });
  }

  // An [instance] call that returns a value: `fallback` on any exception.
  template <class R, class Body>
  static R value(R fallback, void* instance, Body&& body) noexcept {
    return guard_value<R>(fallback, [&] { return body(object<T>(instance)); });
  }
};

}  // namespace loom::sdk::detail

#endif  // LOOM_SDK_KINDS_TABLE_HPP
