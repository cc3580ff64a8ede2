// Walking arrays of ABI structs. The sender's struct may be larger (a newer minor) or
// smaller (an older one) than ours, so the stride is the first element's struct_size,
// never our sizeof.
#pragma once

#include <cstddef>
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

}  // namespace loom::sdk
