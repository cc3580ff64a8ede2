// Walking arrays of ABI structs. The sender's struct may be larger (a newer minor) or
// smaller (an older one) than ours, so the stride is the first element's struct_size,
// never our sizeof.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include <loom/sdk/status.hpp>

namespace loom::sdk {

// Element `i` of an ABI array, copied into a zeroed struct of our size: fields the sender
// did not have read as zero.
template <class T>
T element(const T* base, std::size_t i) {
  T out{};
  if (base == nullptr) throw Error(LOOM_ERR_INVALID_ARGUMENT, "NULL array");
  const std::size_t stride = base->struct_size;
  if (stride < sizeof(uint32_t))
    throw Error(LOOM_ERR_INVALID_ARGUMENT, "array element has struct_size 0");
  const auto* bytes = reinterpret_cast<const unsigned char*>(base) + i * stride;  // NOLINT
  std::memcpy(&out, bytes, stride < sizeof(T) ? stride : sizeof(T));
  return out;
}

// Whether a struct the sender filled in (e.g. one element() returned: it keeps the sender's
// struct_size) has the field that ends at `field_end`, written LOOM_STRUCT_SIZE(type, field).
// False for a sender built against a minor from before the field: read it as absent.
//   if (loom::sdk::has_field(group, LOOM_STRUCT_SIZE(loom_optimizer_group, flags))) ...
template <class T>
bool has_field(const T& s, uint32_t field_end) {
  return s.struct_size >= field_end;
}

}  // namespace loom::sdk
