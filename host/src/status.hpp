// Statuses made by the host, and turning a plugin's status into a host error.
#pragma once

#include <loom/abi.h>
#include <loom/code_name.h>

#include <stdexcept>
#include <string>

namespace loom::host {

// An error inside the host, with the loom_code the C API returns for it.
class Error : public std::runtime_error {
 public:
  Error(loom_code code, const std::string& message) : std::runtime_error(message), code_(code) {}
  [[nodiscard]] loom_code code() const { return code_; }

 private:
  loom_code code_;
};

// A status whose destroy is the host's. Never returns NULL for a non-OK code.
loom_status* make_status(int32_t code, const char* message);

// Takes ownership of `status` (destroys it through its own destroy). Returns its message,
// prefixed with `context`, or "" for NULL (success).
struct TakenStatus {
  loom_code code = LOOM_OK;
  std::string message;
  [[nodiscard]] bool ok() const { return code == LOOM_OK; }
};
TakenStatus take_status(loom_status* status);

// The name of a loom_code, e.g. "INVALID_ARGUMENT": the ABI's one definition, which the
// SDK uses too.
inline const char* code_name(int32_t code) { return loom_code_name(code); }

// Calls `fn` (a call into a plugin), turning an escaped C++ exception into an error:
// the host stays alive whatever a plugin throws.
template <typename Fn>
loom_status* guarded_call(const std::string& what, Fn&& fn) noexcept {
  try {
    return fn();
  } catch (const std::exception& e) {
    return make_status(LOOM_ERR_INTERNAL, (what + " threw an exception: " + e.what()).c_str());
  } catch (...) {
    return make_status(LOOM_ERR_INTERNAL, (what + " threw an exception").c_str());
  }
}

}  // namespace loom::host
