// move_cuda.hpp without CUDA: every CUDA move is UNIMPLEMENTED (move_cuda.cu is the real one).
#include <loom/sdk/no_cuda.hpp>
#include <loom/sdk/tensor.hpp>

#include <string>

#include "move_cuda.hpp"

namespace loom::routers {

bool have_cuda() { return false; }

void cuda::move(const loom::sdk::RouterMove& m, bool to_kept) {
  loom::sdk::throw_built_without_cuda(std::string(to_kept ? "gather" : "scatter") +
                                      ": the tensors are on " + loom::sdk::device_string(m.device));
}

}  // namespace loom::routers
