// The thread's last-error slot behind loom_last_error / loom_last_error_code, shared by
// every translation unit that defines a C API entry point (embed.cpp, describe.cpp).
#pragma once

#include <cstdint>
#include <string>

namespace loom::host {

// Records a failure (code != LOOM_OK) and returns `code`.
int32_t set_last_error(int32_t code, std::string message);
// Records a success (empty message, LOOM_OK) and returns LOOM_OK.
int32_t clear_last_error();

}  // namespace loom::host
