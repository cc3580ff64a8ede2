// The argument checks the host-memory transports (ucx, mpi) share: a contiguous host tensor,
// a dtype they reduce, a dtype they move as whole bytes. `transport` names the plugin in the
// messages; `host_only` ends the message for a device tensor.
#pragma once

#include <loom/sdk.hpp>

#include <cstddef>
#include <string>

#include "reduce.hpp"

namespace loom::plugins {

inline const DLTensor& host_comm_tensor(const DLTensor* t, const char* what, const char* transport,
                                        const char* host_only) {
  const DLTensor& x = loom::sdk::expect_tensor(t, what);
  if (!loom::sdk::is_cpu(x)) {
    throw loom::sdk::Error(LOOM_ERR_UNIMPLEMENTED,
                           std::string(what) + " is on " + loom::sdk::device_string(x.device) +
                               ": the " + transport + " transport moves host memory only (" +
                               host_only + ")");
  }
  loom::sdk::expect_contiguous(x, what);
  return x;
}

inline reduce_ops::Dtype host_comm_reduce_dtype(const DLTensor& t, const char* what,
                                                const char* transport) {
  if (loom::sdk::is_fp32(t)) return reduce_ops::Dtype::kF32;
  if (loom::sdk::is_fp16(t)) return reduce_ops::Dtype::kF16;
  if (loom::sdk::is_bf16(t)) return reduce_ops::Dtype::kBF16;
  throw loom::sdk::Error(LOOM_ERR_UNIMPLEMENTED,
                         std::string(what) + " has dtype " + loom::sdk::dtype_string(t.dtype) +
                             ": " + transport + " reduces float32, float16 and bfloat16");
}

inline std::size_t host_comm_byte_dtype(const DLTensor& t, const char* what,
                                        const char* transport) {
  const std::size_t es = loom::sdk::element_bytes(t.dtype);
  if (es == 0 || t.dtype.bits % 8 != 0) {
    throw loom::sdk::Error(LOOM_ERR_UNIMPLEMENTED,
                           std::string(what) + " has dtype " + loom::sdk::dtype_string(t.dtype) +
                               ": " + transport + " moves whole-byte element types only");
  }
  return es;
}

}  // namespace loom::plugins
