/* nosymbol: a valid shared library that exports something, but no Loom entry symbol. */
#include <loom/abi.h>

LOOM_EXPORT int loom_not_an_entry(void) { return 42; }
