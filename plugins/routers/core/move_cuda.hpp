// The CUDA half of gather/scatter (move_cuda.cu), behind a plain C++ interface so that
// move.cpp, compiled by the host compiler, dispatches to it. CUDA builds only.
#pragma once

#include <loom/sdk/router.hpp>

namespace loom::routers::cuda {

// gather (to_kept) or scatter (!to_kept) on m.stream, m.device made current for the call.
// CUDA failures throw loom::sdk::Error (UNAVAILABLE).
void move(const loom::sdk::RouterMove& m, bool to_kept);

}  // namespace loom::routers::cuda
