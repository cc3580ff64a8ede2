// The CUDA half of gather/scatter, behind a plain C++ interface so that move.cpp, compiled by
// the host compiler, dispatches to it. Built twice (docs/sdk.md "CPU and CUDA"): by
// move_cuda.cu with CUDA, by move_cuda_stub.cpp without (every call UNIMPLEMENTED).
#pragma once

#include <loom/sdk/router.hpp>

namespace loom::routers {

// True where move_cuda.cu is built (router_core.hpp declares it for the plugins).
bool have_cuda();

namespace cuda {

// gather (to_kept) or scatter (!to_kept) on m.stream, m.device made current for the call.
// CUDA failures throw loom::sdk::Error (UNAVAILABLE).
void move(const loom::sdk::RouterMove& m, bool to_kept);

}  // namespace cuda
}  // namespace loom::routers
