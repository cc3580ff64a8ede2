// The arrays an optimizer step writes, checked for aliasing before any plugin runs.
#pragma once

#include <loom/kinds/optimizer.h>

#include <string>

namespace loom::host {

// "" when every array the step updates in place (each tensor's param, and its master when
// it has one) is its own memory; otherwise a message naming the first two positions that
// share memory, e.g. "groups[0].tensors[3].param and groups[0].tensors[7].param are the
// same array (...)". Listed twice, an array would be updated twice in one step (and its
// optimizer state kept twice). Entries the plugin will refuse anyway (NULL tensors, short
// structs) are skipped here so that its own message stays the one the caller sees.
std::string find_aliased_arrays(const loom_optimizer_step_args& args);

}  // namespace loom::host
