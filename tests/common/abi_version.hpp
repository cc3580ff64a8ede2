// The ABI version of the headers a test is built with, as the host prints it ("1.5"): tests
// compare against this, never against a literal, so a new minor changes no test.
#pragma once

#include <loom/abi.h>

#include <string>

inline const std::string kHostAbi =
    std::to_string(LOOM_ABI_MAJOR) + "." + std::to_string(LOOM_ABI_MINOR);
