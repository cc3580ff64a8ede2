// the onebit codec, with its entry function renamed so that several plugins link into one fuzz
// target (plugin_host.hpp makes their instances without dlopen).
#define loom_plugin_entry_v1 loom_fuzz_entry_onebit_codec
#include "plugins/comm/codecs/onebit.cpp"
