// topk_kernels.hpp's cuda namespace without CUDA: every call UNIMPLEMENTED (topk_cuda.cu is
// the real one).
#include <loom/sdk/no_cuda.hpp>
#include <loom/sdk/tensor.hpp>

#include "topk_kernels.hpp"

namespace loom::routers::topk::cuda {

namespace {
[[noreturn]] void refuse(int device) {
  loom::sdk::throw_built_without_cuda("x is on " +
                                      loom::sdk::device_string(DLDevice{kDLCUDA, device}));
}
}  // namespace

void select(const SelectData&, int device, void*) { refuse(device); }
void backward(const BackwardData&, int device, void*) { refuse(device); }

}  // namespace loom::routers::topk::cuda
