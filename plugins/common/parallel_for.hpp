// The bundled plugins' kernels spell it loom::plugins::parallel_for: the SDK's, on the
// host's one thread pool (loom/sdk/parallel.hpp). This header starts no threads.
#pragma once

#include <loom/sdk/parallel.hpp>

namespace loom::plugins {

using loom::sdk::parallel_for;

}  // namespace loom::plugins
