// Helpers for writers and callers of "loom.comm/1" transports.
#pragma once

#include <loom/kinds/comm.h>

#include <cstdint>

namespace loom::sdk {

// "sum", "avg", "max", "min" for a loom_reduce_op value; "?" for any other value (for error
// messages, which must not fail themselves).
inline const char* reduce_op_string(int32_t op) {
  switch (op) {
    case LOOM_REDUCE_SUM:
      return "sum";
    case LOOM_REDUCE_AVG:
      return "avg";
    case LOOM_REDUCE_MAX:
      return "max";
    case LOOM_REDUCE_MIN:
      return "min";
    default:
      return "?";
  }
}

}  // namespace loom::sdk
