// The plugin entry of the 1-bit family: this file is built once per plugin, and
// LOOM_ONEBIT_VARIANT (0: onebit_adam, 1: zero_one_adam, 2: onebit_lamb) selects which of the
// three optimizers (onebit.hpp) the library registers.
#include "onebit.hpp"

#ifndef LOOM_ONEBIT_VARIANT
#error "define LOOM_ONEBIT_VARIANT (0: onebit_adam, 1: zero_one_adam, 2: onebit_lamb)"
#endif

namespace onebit = loom::optim::onebit;

#if LOOM_ONEBIT_VARIANT == 0
LOOM_PLUGIN(onebit::plugin_name(onebit::Variant::kOnebitAdam), "1.0.0",
            "1-bit Adam: Adam warmup, then frozen variance and 1-bit compressed momentum "
            "averaging over a loom.comm transport and a loom.codec codec",
            loom::sdk::factory<onebit::OnebitAdam>());
#elif LOOM_ONEBIT_VARIANT == 1
LOOM_PLUGIN(onebit::plugin_name(onebit::Variant::kZeroOneAdam), "1.0.0",
            "0/1 Adam: adaptive variance freezing, 1-bit gradient averaging, then local steps "
            "synced by 1-bit compressed averaging",
            loom::sdk::factory<onebit::ZeroOneAdam>());
#elif LOOM_ONEBIT_VARIANT == 2
LOOM_PLUGIN(onebit::plugin_name(onebit::Variant::kOnebitLamb), "1.0.0",
            "1-bit LAMB: LAMB warmup, then frozen variance and trust ratio, fused 1-bit "
            "compressed momentum averaging",
            loom::sdk::factory<onebit::OnebitLamb>());
#else
#error "LOOM_ONEBIT_VARIANT must be 0, 1 or 2"
#endif
