// The one error of a plugin built without CUDA that is handed CUDA memory. A family's CUDA
// entry points are built twice (docs/sdk.md "CPU and CUDA"): from its .cu files with CUDA,
// from one stub .cpp without; every stub function throws this, so the message is the same
// in every family.
#pragma once

#include <loom/sdk/status.hpp>

#include <string>
#include <string_view>

namespace loom::sdk {

// "<what>, but this plugin was built without CUDA (LOOM_CUDA=OFF or no CUDA toolkit)".
inline std::string built_without_cuda_message(std::string_view what) {
  return std::string(what) +
         ", but this plugin was built without CUDA (LOOM_CUDA=OFF or no CUDA toolkit)";
}

// Throws Error(LOOM_ERR_UNIMPLEMENTED, built_without_cuda_message(what)).
[[noreturn]] inline void throw_built_without_cuda(std::string_view what) {
  throw Error(LOOM_ERR_UNIMPLEMENTED, built_without_cuda_message(what));
}

}  // namespace loom::sdk
