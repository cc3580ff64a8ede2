/* A plugin that ends the process loading it, one way per build (BROKEN_HOW, set by
 * CMakeLists.txt): what `loom plugins`, `loom describe`, `loom check` and
 * `loom validate-plugin` must survive by loading plugins in a child process. */
#define _POSIX_C_SOURCE 200809L

#include <loom/abi.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#define BROKEN_SEGV_ENTRY 1 /* the entry function dereferences NULL */
#define BROKEN_SEGV_CTOR 2  /* a static constructor does, while the library loads */
#define BROKEN_GARBAGE 3    /* the entry returns a pointer to no descriptor */
#define BROKEN_ABORT 4      /* the entry calls abort() */
#define BROKEN_EXIT 5       /* the entry calls _exit(3) */
#define BROKEN_HANG 6       /* the entry never returns */

#if BROKEN_HOW == BROKEN_SEGV_ENTRY || BROKEN_HOW == BROKEN_SEGV_CTOR
/* volatile: the compiler cannot tell that the store faults, so it emits it as written */
static int* volatile nowhere = NULL;
#endif

#if BROKEN_HOW == BROKEN_SEGV_CTOR
__attribute__((constructor)) static void crash_while_loading(void) { *nowhere = 1; }
#endif

LOOM_EXPORT const loom_plugin_v1* loom_plugin_entry_v1(void) {
#if BROKEN_HOW == BROKEN_SEGV_ENTRY
  *nowhere = 1;
#elif BROKEN_HOW == BROKEN_GARBAGE
  return (const loom_plugin_v1*)(uintptr_t)0xdeadbeef0ull; /* unmapped */
#elif BROKEN_HOW == BROKEN_ABORT
  abort();
#elif BROKEN_HOW == BROKEN_EXIT
  _exit(3);
#elif BROKEN_HOW == BROKEN_HANG
  for (;;) pause();
#endif
  return NULL;
}
