// CUDA kernels of the onebit codec: the same definitions as the CPU kernels
// (codec_kernels.hpp), so results agree bit for bit. Plain C++ interface (the .cu file is
// the only one that sees CUDA). Everything is ordered on `stream` (a cudaStream_t); nothing
// synchronizes. Functions return an empty string on success, else the CUDA error.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace loom::codecs::cuda {

// True when the CUDA runtime sees at least one device.
bool device_available();

// Device workspace one encode of n elements needs.
std::size_t onebit_encode_workspace_bytes(std::size_t n);

// x, e (may be NULL): n fp32 on the device; n % (8 * chunk_count) == 0. out: chunk_count
// chunks of 4 + n / chunk_count / 8 bytes. Two fused passes: the norm reduction, then
// sign + pack + error update.
std::string onebit_encode(const float* x, float* e, std::size_t n, uint32_t chunk_count,
                          uint8_t* out, void* workspace, void* stream);

// in: chunk_count chunks of chunk_elements / 8 + 4 bytes; out: chunk_count * chunk_elements.
std::string onebit_decode(const uint8_t* in, uint32_t chunk_count, std::size_t chunk_elements,
                          float alpha, bool accumulate, float* out, void* stream);

// in: chunk_count chunks as above; out: chunk_elements, the chunks' sum in chunk order
// (bit-identical to chunk_count onebit_decode calls, the first with `accumulate`).
std::string onebit_decode_sum(const uint8_t* in, uint32_t chunk_count, std::size_t chunk_elements,
                              float alpha, bool accumulate, float* out, void* stream);

// Copies for tests: host <-> device, synchronous.
std::string copy_to_device(void* dst, const void* src, std::size_t bytes);
std::string copy_to_host(void* dst, const void* src, std::size_t bytes);

}  // namespace loom::codecs::cuda
