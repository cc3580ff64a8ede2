/* major2: a plugin for a future ABI major. It exports only loom_plugin_entry_v2, so a
 * host that speaks ABI 1 must refuse it and say which versions are involved. */
#include <loom/abi.h>

typedef struct loom_plugin_v2 {
  uint32_t struct_size;
  uint16_t abi_major;
  uint16_t abi_minor;
  const char* name;
} loom_plugin_v2;

static const loom_plugin_v2 k_plugin = {sizeof(loom_plugin_v2), 2, 0, "major2"};

LOOM_EXPORT const loom_plugin_v2* loom_plugin_entry_v2(void) { return &k_plugin; }
