// kernels.hpp's CUDA half without CUDA: no devices, and every kernel UNIMPLEMENTED
// (kernels_cuda.cu is the real one; check_samples refuses CUDA tensors before these).
#include <loom/sdk/no_cuda.hpp>
#include <loom/sdk/tensor.hpp>

#include <string>

#include "kernels.hpp"

namespace loom::data::curriculum {

bool have_cuda() { return false; }

namespace cuda {
namespace {
[[noreturn]] void refuse(int device) {
  loom::sdk::throw_built_without_cuda("samples.tokens is on " +
                                      loom::sdk::device_string(DLDevice{kDLCUDA, device}));
}
}  // namespace

int device_count() { return 0; }
Problem seqlen(const SampleData&, int64_t, double*, int device, void*) { refuse(device); }
Problem count(const SampleData&, int64_t*, int device, void*) { refuse(device); }
Problem rarity(const SampleData&, const RarityTable&, double*, int device, void*) {
  refuse(device);
}
void copy_to_host(void*, const void*, std::size_t, int device, void*) { refuse(device); }

}  // namespace cuda
}  // namespace loom::data::curriculum
