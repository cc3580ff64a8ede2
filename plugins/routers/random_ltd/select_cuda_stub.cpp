// select.hpp's cuda namespace without CUDA: every call UNIMPLEMENTED (select_cuda.cu is the
// real one).
#include <loom/sdk/no_cuda.hpp>
#include <loom/sdk/tensor.hpp>

#include <string>

#include "select.hpp"

namespace loom::routers::ltd::cuda {

namespace {
[[noreturn]] void refuse(const char* what, int device) {
  loom::sdk::throw_built_without_cuda(std::string("router select: ") + what + " is on " +
                                      loom::sdk::device_string(DLDevice{kDLCUDA, device}));
}
}  // namespace

void select(const SelectJob&, int32_t*, void*, int device, void*) { refuse("indices", device); }

void select_keys(const uint64_t*, int64_t, int64_t, int64_t, int32_t*, int device, void*) {
  refuse("keys", device);
}

}  // namespace loom::routers::ltd::cuda
