/* The short name of a loom_code ("INVALID_ARGUMENT"), for messages. One definition for the
 * host and the SDK (neither may include the other), so it sits beside the codes in the ABI
 * as a static inline function: no symbol is exported, nothing is added to abi.h's contract.
 * C11 and C++. */
#ifndef LOOM_CODE_NAME_H
#define LOOM_CODE_NAME_H

#include <loom/abi.h>

#ifdef __cplusplus
extern "C" {
#endif

/* static inline, marked unused for GCC and Clang: a file that includes the header without
 * calling the function (or compiles the header alone) gets no -Wunused-function. */
#ifndef LOOM_STATIC_INLINE
#if defined(__GNUC__) || defined(__clang__)
#define LOOM_STATIC_INLINE static inline __attribute__((unused))
#else
#define LOOM_STATIC_INLINE static inline
#endif
#endif

/* "UNKNOWN" for a code this header does not know (a newer peer's). */
LOOM_STATIC_INLINE const char* loom_code_name(int32_t code) {
  switch (code) {
    case LOOM_OK:
      return "OK";
    case LOOM_ERR_INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case LOOM_ERR_NOT_FOUND:
      return "NOT_FOUND";
    case LOOM_ERR_OUT_OF_RANGE:
      return "OUT_OF_RANGE";
    case LOOM_ERR_UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case LOOM_ERR_FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case LOOM_ERR_UNAVAILABLE:
      return "UNAVAILABLE";
    case LOOM_ERR_DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case LOOM_ERR_RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case LOOM_ERR_DATA_LOSS:
      return "DATA_LOSS";
    case LOOM_ERR_ABI_MISMATCH:
      return "ABI_MISMATCH";
    case LOOM_ERR_INTERNAL:
      return "INTERNAL";
    default:
      return "UNKNOWN";
  }
}

#ifdef __cplusplus
}
#endif

#endif /* LOOM_CODE_NAME_H */
