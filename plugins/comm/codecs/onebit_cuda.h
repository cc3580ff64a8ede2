// CUDA kernels of the onebit codec: the same definitions as the CPU kernels
// (codec_kernels.hpp), so results agree bit for bit. Plain C++ interface (the .cu file is
// the only one that sees CUDA). Everything is ordered on `stream` (a cudaStream_t); only
// read_fault and the test copies synchronize. A CUDA failure throws loom::sdk::Error
// (UNAVAILABLE) naming the call, file and line (LOOM_CUDA_CHECK).
//
// Bad data is found by the kernels: encode's norm pass rejects a non-finite sum of squares
// and decode's scale check rejects a chunk whose scale is not finite and >= 0, as the CPU
// codec does. A kernel cannot throw, so it records the first fault in a FaultWord (device
// memory, one per device per codec instance); every later kernel of the codec that sees a
// fault recorded writes nothing (so a bad input changes no output or error buffer, as on
// the CPU), until read_fault copies the word to the host and clears it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace loom::codecs::cuda {

// True when the CUDA runtime sees at least one device.
bool device_available();

enum class Fault : int32_t {
  kNone = 0,
  kEncodeNonFinite = 1,  // encode: sum of squares of input + error is not finite
  kDecodeBadScale = 2,   // decode: a chunk's scale is not finite and >= 0
  kDecodeSumBadScale = 3,
};

struct FaultReport {
  Fault fault = Fault::kNone;
  uint32_t chunk = 0;  // the bad chunk (decode)
  float value = 0.0f;  // its scale (decode)
};

// The device word kernels record faults in: allocated on `device`, zeroed; free with
// fault_word_free. Synchronous.
void* fault_word_alloc(int device);
void fault_word_free(void* word);
// Copies the word to the host after everything queued on `stream`, clears it, and returns
// what it held. Synchronizes the stream.
FaultReport read_fault(void* word, void* stream);

// Device workspace one encode of n elements needs.
std::size_t onebit_encode_workspace_bytes(std::size_t n);

// x, e (may be NULL): n fp32 on the device; n % (8 * chunk_count) == 0. out: chunk_count
// chunks of 4 + n / chunk_count / 8 bytes. Two fused passes: the norm reduction, then
// sign + pack + error update (skipped, like everything, once `fault` holds a fault).
void onebit_encode(const float* x, float* e, std::size_t n, uint32_t chunk_count, uint8_t* out,
                   void* workspace, void* fault, void* stream);

// in: chunk_count chunks of chunk_elements / 8 + 4 bytes; out: chunk_count * chunk_elements.
// The chunks' scales are checked first (Fault::kDecodeBadScale).
void onebit_decode(const uint8_t* in, uint32_t chunk_count, std::size_t chunk_elements, float alpha,
                   bool accumulate, float* out, void* fault, void* stream);

// in: chunk_count chunks as above; out: chunk_elements, the chunks' sum in chunk order
// (bit-identical to chunk_count onebit_decode calls, the first with `accumulate`).
void onebit_decode_sum(const uint8_t* in, uint32_t chunk_count, std::size_t chunk_elements,
                       float alpha, bool accumulate, float* out, void* fault, void* stream);

// Copies for tests: host <-> device, synchronous.
void copy_to_device(void* dst, const void* src, std::size_t bytes);
void copy_to_host(void* dst, const void* src, std::size_t bytes);

}  // namespace loom::codecs::cuda
