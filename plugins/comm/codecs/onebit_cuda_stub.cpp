// onebit_cuda.h without CUDA: no device is available (supports_device says no), freeing is
// nothing, and every kernel or copy is UNIMPLEMENTED (onebit_cuda.cu is the real one).
#include <loom/sdk/no_cuda.hpp>

#include "onebit_cuda.h"

namespace loom::codecs::cuda {

namespace {
[[noreturn]] void refuse() { loom::sdk::throw_built_without_cuda("onebit: a CUDA tensor"); }
}  // namespace

bool device_available() { return false; }
void* fault_word_alloc(int) { refuse(); }
void fault_word_free(void*) {}
FaultReport read_fault(void*, void*) { refuse(); }
std::size_t onebit_encode_workspace_bytes(std::size_t) { refuse(); }
void onebit_encode(const float*, float*, std::size_t, uint32_t, uint8_t*, void*, void*, void*) {
  refuse();
}
void onebit_decode(const uint8_t*, uint32_t, std::size_t, float, bool, float*, void*, void*) {
  refuse();
}
void onebit_decode_sum(const uint8_t*, uint32_t, std::size_t, float, bool, float*, void*, void*) {
  refuse();
}
void copy_to_device(void*, const void*, std::size_t) { refuse(); }
void copy_to_host(void*, const void*, std::size_t) { refuse(); }

}  // namespace loom::codecs::cuda
