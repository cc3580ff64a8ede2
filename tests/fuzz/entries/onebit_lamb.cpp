// onebit_lamb, with its entry function renamed so that several plugins link into one fuzz
// target (plugin_host.hpp makes their instances without dlopen).
#define LOOM_ONEBIT_VARIANT 2
#define loom_plugin_entry_v1 loom_fuzz_entry_onebit_lamb
#include "plugins/optimizers/onebit_plugin.cpp"
