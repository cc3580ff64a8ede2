// Statuses and exceptions at the ABI boundary: plugin code throws, the SDK's trampolines
// turn whatever was thrown into a loom_status, and check() turns a status received from
// someone else back into an exception.
#ifndef LOOM_SDK_STATUS_HPP
#define LOOM_SDK_STATUS_HPP

#include <loom/abi.h>
#include <loom/code_name.h>

#include <cstddef>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace loom::sdk {

// The exception plugin code throws to fail a call with a specific code. `param`, when
// given, names the parameter to blame: a plugin's validate_params hook throws
// Error(LOOM_ERR_INVALID_ARGUMENT, "needs momentum > 0", "nesterov"), and the host reports
// the message at that key in the manifest.
class Error : public std::runtime_error {
 public:
  Error(loom_code code, const std::string& message, std::string param = {})
      : std::runtime_error(message),
        code_(code == LOOM_OK ? LOOM_ERR_INTERNAL : code),
        param_(std::move(param)) {}

  loom_code code() const noexcept { return code_; }
  const std::string& param() const noexcept { return param_; }

 private:
  loom_code code_;
  std::string param_;
};

// A short name for a code, for messages ("INVALID_ARGUMENT"): the ABI's one definition,
// which the host uses too.
inline const char* code_name(int32_t code) noexcept { return loom_code_name(code); }

namespace detail {

// The status and its message live in one allocation, so destroy is a single delete and
// needs no C++ object layout that the C side could trip over.
inline void destroy_status(loom_status* self) noexcept {
  if (self != nullptr) {
    self->~loom_status();
    ::operator delete(static_cast<void*>(self));
  }
}

inline void destroy_static_status(loom_status*) noexcept {}

// Returned when even the status cannot be allocated; its destroy does nothing.
inline loom_status* out_of_memory_status() noexcept {
  static loom_status oom{LOOM_STATUS_SIZE, LOOM_ERR_RESOURCE_EXHAUSTED,
                         "out of memory (while reporting an error)", &destroy_static_status};
  return &oom;
}

}  // namespace detail

// A new status owned by the receiver; its destroy frees it with this plugin's allocator.
// Never fails: without memory it returns a static RESOURCE_EXHAUSTED status.
inline loom_status* make_status(loom_code code, std::string_view message) noexcept {
  const std::size_t bytes = sizeof(loom_status) + message.size() + 1;
  void* memory = ::operator new(bytes, std::nothrow);
  if (memory == nullptr) return detail::out_of_memory_status();
  char* text = static_cast<char*>(memory) + sizeof(loom_status);
  if (!message.empty()) std::memcpy(text, message.data(), message.size());
  text[message.size()] = '\0';
  return new (memory) loom_status{LOOM_STATUS_SIZE, code == LOOM_OK ? LOOM_ERR_INTERNAL : code,
                                  text, &detail::destroy_status};
}

// Takes ownership of `status` (from the host or another instance): NULL returns, anything
// else is destroyed and rethrown as Error with the same code and message. `context`, when
// given, prefixes the message ("comm 'world' allreduce: ...").
inline void check(loom_status* status, std::string_view context = {}) {
  if (status == nullptr) return;
  loom_code code = LOOM_ERR_INTERNAL;
  std::string message;
  try {
    if (status->code > LOOM_OK && status->code <= LOOM_ERR_INTERNAL) {
      code = static_cast<loom_code>(status->code);
    }
    if (!context.empty()) {
      message.append(context);
      message.append(": ");
    }
    message.append(status->message != nullptr ? status->message : "(no message)");
  } catch (...) {
    if (status->destroy != nullptr) status->destroy(status);
    throw;
  }
  if (status->destroy != nullptr) status->destroy(status);
  throw Error(code, message);
}

// Maps the exception being handled to a status. Call only inside a catch block.
inline loom_status* status_from_current_exception() noexcept {
  try {
    throw;
  } catch (const Error& e) {
    return make_status(e.code(), e.what());
  } catch (const std::invalid_argument& e) {
    return make_status(LOOM_ERR_INVALID_ARGUMENT, e.what());
  } catch (const std::out_of_range& e) {
    return make_status(LOOM_ERR_OUT_OF_RANGE, e.what());
  } catch (const std::bad_alloc&) {
    return make_status(LOOM_ERR_RESOURCE_EXHAUSTED, "out of memory");
  } catch (const std::exception& e) {
    return make_status(LOOM_ERR_INTERNAL, e.what());
  } catch (...) {
    return make_status(LOOM_ERR_INTERNAL, "unknown exception");
  }
}

// Runs `fn` and reports its outcome as a status: the body of every trampoline.
template <class Fn>
loom_status* guard(Fn&& fn) noexcept {
  try {
    std::forward<Fn>(fn)();
    return nullptr;
  } catch (...) {
    return status_from_current_exception();
  }
}

// For functions that return a value instead of a status: `fallback` on any exception.
template <class R, class Fn>
R guard_value(R fallback, Fn&& fn) noexcept {
  try {
    return static_cast<R>(std::forward<Fn>(fn)());
  } catch (...) {
    return fallback;
  }
}

}  // namespace loom::sdk

#endif  // LOOM_SDK_STATUS_HPP
