// The argument checks every kind's table shares (loom/sdk/kinds/NAME.hpp): the caller's args
// struct (present, long enough, copied into a zeroed full-size one), the scalars a planned
// call carries, the caller's buffers against a plan, and what a class's plan may not return.
// Written once here so that every kind reports the same fault in the same words.
#ifndef LOOM_SDK_KINDS_CHECKS_HPP
#define LOOM_SDK_KINDS_CHECKS_HPP

#include <loom/abi.h>
#include <loom/sdk/status.hpp>
#include <loom/sdk/tensor.hpp>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>

namespace loom::sdk::detail {

// Copies an args struct from the caller into a zeroed full-size one, so plugin code can
// read every field it knows: fields an older caller did not send read as zero. The
// caller's struct_size is kept, so a plugin can still tell.
template <class Args>
Args normalized(const Args* in, const char* what) {
  if (in == nullptr) throw Error(LOOM_ERR_INVALID_ARGUMENT, std::string(what) + " is NULL");
  if (in->struct_size < sizeof(uint32_t)) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT, std::string(what) + " has no struct_size");
  }
  Args out;
  std::memset(static_cast<void*>(&out), 0,
              sizeof(Args));  // Args may have default member initializers
  std::memcpy(&out, in, in->struct_size < sizeof(Args) ? in->struct_size : sizeof(Args));
  return out;
}

// For in/out structs whose struct_size the caller sets: the plugin fills a full-size copy,
// and only the prefix the caller knows is written back.
template <class Out, class Fn>
void fill(Out* out, const char* what, Fn&& fn) {
  Out full = normalized(out, what);
  const uint32_t caller_size = out->struct_size;
  std::forward<Fn>(fn)(full);
  full.struct_size = caller_size;
  std::memcpy(out, &full, caller_size < sizeof(Out) ? caller_size : sizeof(Out));
}

// An args struct from a caller must reach `end` (its last field this SDK reads or writes).
template <class Args>
Args& expect_args(Args* args, uint32_t end, const char* what) {
  if (args == nullptr) throw Error(LOOM_ERR_INVALID_ARGUMENT, std::string(what) + " is NULL");
  if (args->struct_size < end) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT, std::string(what) + " has struct_size " +
                                               std::to_string(args->struct_size) +
                                               ", smaller than the " + std::to_string(end) +
                                               " bytes of the fields this plugin reads");
  }
  return *args;
}

// A struct nested in a call's args (the samples, stats, a format) must be at least `want` bytes.
inline void check_struct_size(uint32_t size, uint32_t want, const std::string& what) {
  if (size < want) {
    fail_argument(what + " has struct_size " + std::to_string(size) + ", expected " +
                  std::to_string(want));
  }
}

// A scalar of a call (`call`: "router plan") below its least value.
inline void at_least(int64_t v, int64_t least, const char* name, const std::string& call) {
  if (v < least) {
    fail_argument(call + ": " + name + " is " + std::to_string(v) +
                  "; must be >= " + std::to_string(least));
  }
}

// The layer a call names must be one of the model's num_layers (already checked >= 1).
inline void check_layer(int32_t layer, int32_t num_layers, const std::string& call) {
  if (layer < 0 || layer >= num_layers) {
    fail_argument(call + ": layer " + std::to_string(layer) + " is outside 0 .. " +
                  std::to_string(num_layers - 1) + " (num_layers " + std::to_string(num_layers) +
                  ")");
  }
}

// A caller's buffer (saved, workspace) against the bytes `source` ("plan", "layout") asks
// for: present, large enough and 256-byte aligned when the size is not 0.
inline void check_buffer(const void* ptr, uint64_t given, uint64_t want, const char* what,
                         const char* source = "plan") {
  if (want == 0) return;
  if (ptr == nullptr || given < want) {
    fail_argument(std::string(what) + " is " +
                  (ptr == nullptr ? std::string("NULL") : std::to_string(given) + " bytes") +
                  " but the " + source + " asks for " + std::to_string(want) + " bytes");
  }
  if (reinterpret_cast<uintptr_t>(ptr) % 256 != 0) {
    fail_argument(std::string(what) + " is not 256-byte aligned");
  }
}

// What a class's own call (`call`: "plan", "layout", "at") returned breaks the ABI's
// promise: the plugin's bug, INTERNAL, never the caller's.
[[noreturn]] inline void plugin_bug(const char* call, const std::string& message) {
  throw Error(LOOM_ERR_INTERNAL, std::string("the plugin's ") + call + " " + message);
}

// Flags outside `known` that a class's `call` set are a plugin bug ("set unknown flags 0x8").
inline void check_known_flags(uint32_t flags, uint32_t known, const char* call) {
  if ((flags & ~known) == 0) return;
  char buf[16];
  std::snprintf(buf, sizeof buf, "%x", flags & ~known);
  plugin_bug(call, "set unknown flags 0x" + std::string(buf));
}

}  // namespace loom::sdk::detail

#endif  // LOOM_SDK_KINDS_CHECKS_HPP
