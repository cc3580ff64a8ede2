// The onebit codec's work on one kind of device, behind one declaration (the pattern of
// plugins/optimizers/onebit_backend.hpp): onebit.cpp checks the arguments (codec_common.hpp),
// picks the backend of the tensors' device and calls it. Both backends follow the definitions
// of codec_kernels.hpp bit for bit and fail bad data with the same codes and messages:
//   - input + error with a non-finite value (or a square overflowing fp32): INVALID_ARGUMENT
//     (non_finite_message), nothing written;
//   - a chunk scale that is not finite and >= 0: DATA_LOSS (bad_scale_message), nothing
//     written.
// CPU: Highway kernels (codec_kernels.hpp) threaded with parallel_for; errors throw at once.
// CUDA: the kernels of onebit_cuda.h, ordered on the call's stream; encode does not
// synchronize, so its fault is thrown by the next decode / decode_sum on that device, which
// synchronizes the stream at its end (see onebit_cuda.h). CUDA failures throw UNAVAILABLE.
#pragma once

#include <loom/sdk.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "codec_common.hpp"
#include "codec_kernels.hpp"
#include "common/parallel_for.hpp"
#include "onebit_cuda.h"

namespace loom::codecs::onebit {

inline std::string non_finite_message(const std::string& op) {
  return op + ": input + error has non-finite values (or overflows fp32 when squared)";
}
inline std::string bad_scale_message(const std::string& op, std::size_t chunk, float s) {
  return op + ": chunk " + std::to_string(chunk) + " has an invalid scale (" + std::to_string(s) +
         "); the input is not onebit chunks of this size";
}

class Backend {
 public:
  virtual ~Backend() = default;
  // Encodes v.x + v.e into v.chunks chunks at v.out and stores the new error in v.e.
  virtual void encode(const EncodeView& v, void* stream) = 0;
  // Decodes v.chunks chunks into v.out (sum: their sum into one chunk, decode_sum).
  virtual void decode(const DecodeView& v, bool sum, void* stream) = 0;
};

class CpuBackend final : public Backend {
 public:
  void encode(const EncodeView& v, void*) override {
    // Pass 1: the norm (nothing is written yet, so a bad input changes nothing).
    const double sum = onebit_sum_squares(v.x, v.e, v.n);
    if (!std::isfinite(sum)) {
      throw sdk::Error(LOOM_ERR_INVALID_ARGUMENT, non_finite_message("onebit encode"));
    }
    const float scale = onebit_scale(sum, v.n);
    const std::size_t chunk_groups = v.chunk_elements / 8;
    const std::size_t chunk_bytes = 4 + chunk_groups;
    for (std::size_t j = 0; j < v.chunks; ++j) write_scale(v.out + j * chunk_bytes, scale);
    // Pass 2: sign, pack and error update, split at chunk boundaries.
    loom::plugins::parallel_for(v.n / 8, kGrainGroups, [&](std::size_t g0, std::size_t g1) {
      while (g0 < g1) {
        const std::size_t chunk = g0 / chunk_groups;
        const std::size_t end = std::min(g1, (chunk + 1) * chunk_groups);
        const std::size_t i = g0 * 8;
        onebit_sign_pack(v.x + i, v.e != nullptr ? v.e + i : nullptr, (end - g0) * 8, scale,
                         v.out + chunk * chunk_bytes + 4 + (g0 - chunk * chunk_groups));
        g0 = end;
      }
    });
  }

  void decode(const DecodeView& v, bool sum, void*) override {
    if (sum) {
      decode_sum(v);
      return;
    }
    const std::size_t chunk_groups = v.chunk_elements / 8;
    const std::size_t chunk_bytes = 4 + chunk_groups;
    const std::vector<float> values = chunk_values(v, "decode");
    // Outputs far larger than the last-level cache are written with streaming stores.
    const bool nontemporal =
        !v.accumulate && v.chunks * v.chunk_elements * sizeof(float) >= kStreamingBytes;
    loom::plugins::parallel_for(
        v.chunks * chunk_groups, kGrainGroups, [&](std::size_t g0, std::size_t g1) {
          while (g0 < g1) {
            const std::size_t chunk = g0 / chunk_groups;
            const std::size_t end = std::min(g1, (chunk + 1) * chunk_groups);
            onebit_unpack(v.in + chunk * chunk_bytes + 4 + (g0 - chunk * chunk_groups),
                          (end - g0) * 8, values[chunk], v.accumulate, v.out + g0 * 8, nontemporal);
            g0 = end;
          }
        });
  }

 private:
  static constexpr std::size_t kGrainGroups = 2048;  // 8-element groups per parallel_for grain
  static constexpr std::size_t kStreamingBytes = std::size_t{64} << 20;

  // The server step of the compressed allreduce: the chunks' sum in one pass over the
  // output (instead of one read-modify-write pass per chunk).
  static void decode_sum(const DecodeView& v) {
    const std::size_t groups = v.chunk_elements / 8;
    const std::size_t chunk_bytes = 4 + groups;
    const std::vector<float> values = chunk_values(v, "decode_sum");
    const bool nontemporal = !v.accumulate && v.chunk_elements * sizeof(float) >= kStreamingBytes;
    loom::plugins::parallel_for(groups, kGrainGroups, [&](std::size_t g0, std::size_t g1) {
      std::vector<const uint8_t*> bits(v.chunks);
      for (std::size_t j = 0; j < v.chunks; ++j) bits[j] = v.in + j * chunk_bytes + 4 + g0;
      onebit_unpack_sum(bits.data(), values.data(), v.chunks, (g1 - g0) * 8, v.accumulate,
                        v.out + g0 * 8, nontemporal);
    });
  }

  // alpha * scale of each chunk, after checking the scales.
  static std::vector<float> chunk_values(const DecodeView& v, const char* op) {
    const std::size_t chunk_bytes = 4 + v.chunk_elements / 8;
    std::vector<float> values(v.chunks);
    for (std::size_t j = 0; j < v.chunks; ++j) {
      const float s = read_scale(v.in + j * chunk_bytes);
      if (!finite(s) || s < 0.0f) {
        throw sdk::Error(LOOM_ERR_DATA_LOSS, bad_scale_message(std::string("onebit ") + op, j, s));
      }
      values[j] = v.alpha * s;
    }
    return values;
  }
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(sdk::Context& ctx) : ctx_(ctx) {}
  ~CudaBackend() override {
    for (auto& [device, word] : faults_) cuda::fault_word_free(word);
  }
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  void encode(const EncodeView& v, void* stream) override {
    void* fault = fault_word(v.device);
    const std::size_t ws_bytes = cuda::onebit_encode_workspace_bytes(v.n);
    void* ws = ctx_.device_alloc(v.device, ws_bytes, stream);
    try {
      cuda::onebit_encode(v.x, v.e, v.n, static_cast<uint32_t>(v.chunks), v.out, ws, fault, stream);
    } catch (...) {
      ctx_.device_free(v.device, ws, stream);
      throw;
    }
    ctx_.device_free(v.device, ws, stream);
  }

  // Reads the fault word after the kernels (synchronizing the stream) and turns a fault,
  // this call's or an earlier encode's, into the status the CPU backend throws.
  void decode(const DecodeView& v, bool sum, void* stream) override {
    void* fault = fault_word(v.device);
    const auto chunks = static_cast<uint32_t>(v.chunks);
    if (sum) {
      cuda::onebit_decode_sum(v.in, chunks, v.chunk_elements, v.alpha, v.accumulate, v.out, fault,
                              stream);
    } else {
      cuda::onebit_decode(v.in, chunks, v.chunk_elements, v.alpha, v.accumulate, v.out, fault,
                          stream);
    }
    const cuda::FaultReport r = cuda::read_fault(fault, stream);
    switch (r.fault) {
      case cuda::Fault::kNone:
        return;
      case cuda::Fault::kEncodeNonFinite:
        throw sdk::Error(LOOM_ERR_INVALID_ARGUMENT,
                         non_finite_message("onebit encode") +
                             " (found on the CUDA device; reported by the next decode, which is "
                             "the first call that synchronizes)");
      case cuda::Fault::kDecodeBadScale:
      case cuda::Fault::kDecodeSumBadScale:
        throw sdk::Error(
            LOOM_ERR_DATA_LOSS,
            bad_scale_message(
                r.fault == cuda::Fault::kDecodeSumBadScale ? "onebit decode_sum" : "onebit decode",
                r.chunk, r.value) +
                " (found on the CUDA device)");
    }
    throw sdk::Error(LOOM_ERR_INTERNAL, "onebit: unknown CUDA fault code " +
                                            std::to_string(static_cast<int>(r.fault)));
  }

 private:
  // The fault word on the tensor's device, made on first use.
  void* fault_word(DLDevice d) {
    auto it = faults_.find(d.device_id);
    if (it == faults_.end()) {
      it = faults_.emplace(d.device_id, cuda::fault_word_alloc(d.device_id)).first;
    }
    return it->second;
  }

  sdk::Context& ctx_;
  std::map<int32_t, void*> faults_;
};

}  // namespace loom::codecs::onebit
