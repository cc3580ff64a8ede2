// The onebit codec (loom.codec/1): error-feedback sign compression of 1-bit Adam
// (as in the 1-bit Adam paper and DeepSpeed). Exact definitions in codec_kernels.hpp.
//
// Padding (layout): N = elements rounded up to a multiple of n * lcm(n, 8) for n chunks, so
// each chunk is a whole number of bytes of bits (and matches DeepSpeed's buffers).
// Chunk format: the encode call's scale as 4 bytes of little-endian fp32, then c / 8 bytes of
// sign bits, MSB-first (element 8k+j of the chunk -> bit 7-j of byte k; 1 = +scale).
// The scale is the RMS of (input + error) over the whole padded buffer of the call (padding
// included), written into every chunk's header.
#include <loom/kinds/codec.h>
#include <loom/sdk.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <numeric>
#include <string>

#include "codec_common.hpp"
#include "codec_kernels.hpp"
#include "common/parallel_for.hpp"
#ifdef LOOM_CODECS_CUDA
#include "onebit_cuda.h"
#endif

namespace {

using loom::sdk::Context;
using loom::sdk::Error;
namespace codecs = loom::codecs;

constexpr std::size_t kGrainGroups = 2048;  // 8-element groups per parallel_for grain
constexpr std::size_t kStreamingBytes = std::size_t{64} << 20;

class Onebit : public loom::sdk::Codec {
 public:
  explicit Onebit(Context& ctx) : ctx_(ctx) {
    ctx_.debug(std::string("onebit CPU kernels: ") + codecs::simd_target_name());
  }
  ~Onebit() {
#ifdef LOOM_CODECS_CUDA
    for (auto& [device, word] : faults_) codecs::cuda::fault_word_free(word);
#endif
  }
  Onebit(const Onebit&) = delete;
  Onebit& operator=(const Onebit&) = delete;

  void layout(loom_codec_layout& l) {
    const uint64_t n = codecs::layout_world(l);
    if (n > 65536) {
      throw Error(LOOM_ERR_OUT_OF_RANGE,
                  "onebit layout: world_size " + std::to_string(n) + " is above 65536");
    }
    const uint64_t unit = n * std::lcm(n, uint64_t{8});
    l.padded_elements = codecs::round_up(l.elements, unit);
    l.chunk_bytes = 4 + l.padded_elements / n / 8;
  }

  bool supports_device(DLDevice d) {
    if (loom::sdk::is_cpu(d)) return true;
#ifdef LOOM_CODECS_CUDA
    return loom::sdk::is_cuda(d) && codecs::cuda::device_available();
#else
    return false;
#endif
  }

  void encode(const loom_codec_encode_args& a) {
    const codecs::EncodeView v = codecs::check_encode(a, 8, "onebit");
    if (loom::sdk::is_cuda(v.device)) {
      encode_cuda(v, a.stream);
      return;
    }
    if (!loom::sdk::is_cpu(v.device)) unsupported(v.device);
    // Pass 1: the norm (nothing is written yet, so a bad input changes nothing).
    const double sum = codecs::onebit_sum_squares(v.x, v.e, v.n);
    if (!std::isfinite(sum))
      throw Error(LOOM_ERR_INVALID_ARGUMENT, non_finite_message("onebit encode"));
    const float scale = codecs::onebit_scale(sum, v.n);
    const std::size_t chunk_groups = v.chunk_elements / 8;
    const std::size_t chunk_bytes = 4 + chunk_groups;
    for (std::size_t j = 0; j < v.chunks; ++j) codecs::write_scale(v.out + j * chunk_bytes, scale);
    // Pass 2: sign, pack and error update, split at chunk boundaries.
    loom::plugins::parallel_for(v.n / 8, kGrainGroups, [&](std::size_t g0, std::size_t g1) {
      while (g0 < g1) {
        const std::size_t chunk = g0 / chunk_groups;
        const std::size_t end = std::min(g1, (chunk + 1) * chunk_groups);
        const std::size_t i = g0 * 8;
        codecs::onebit_sign_pack(v.x + i, v.e != nullptr ? v.e + i : nullptr, (end - g0) * 8, scale,
                                 v.out + chunk * chunk_bytes + 4 + (g0 - chunk * chunk_groups));
        g0 = end;
      }
    });
  }

  void decode(const loom_codec_decode_args& a) {
    const codecs::DecodeView v = codecs::check_decode(a, 8, "onebit");
    const std::size_t chunk_groups = v.chunk_elements / 8;
    const std::size_t chunk_bytes = 4 + chunk_groups;
    if (loom::sdk::is_cuda(v.device)) {
      decode_cuda(v, a.stream, /*sum=*/false);
      return;
    }
    if (!loom::sdk::is_cpu(v.device)) unsupported(v.device);
    const std::vector<float> values = chunk_values(v, "decode");
    // Outputs far larger than the last-level cache are written with streaming stores.
    const bool nontemporal =
        !v.accumulate && v.chunks * v.chunk_elements * sizeof(float) >= kStreamingBytes;
    loom::plugins::parallel_for(
        v.chunks * chunk_groups, kGrainGroups, [&](std::size_t g0, std::size_t g1) {
          while (g0 < g1) {
            const std::size_t chunk = g0 / chunk_groups;
            const std::size_t end = std::min(g1, (chunk + 1) * chunk_groups);
            codecs::onebit_unpack(v.in + chunk * chunk_bytes + 4 + (g0 - chunk * chunk_groups),
                                  (end - g0) * 8, values[chunk], v.accumulate, v.out + g0 * 8,
                                  nontemporal);
            g0 = end;
          }
        });
  }

  // The server step of the compressed allreduce: the chunks' sum in one pass over the
  // output (instead of one read-modify-write pass per chunk).
  void decode_sum(const loom_codec_decode_args& a) {
    const codecs::DecodeView v = codecs::check_decode(a, 8, "onebit", /*sum=*/true);
    const std::size_t groups = v.chunk_elements / 8;
    const std::size_t chunk_bytes = 4 + groups;
    if (loom::sdk::is_cuda(v.device)) {
      decode_cuda(v, a.stream, /*sum=*/true);
      return;
    }
    if (!loom::sdk::is_cpu(v.device)) unsupported(v.device);
    const std::vector<float> values = chunk_values(v, "decode_sum");
    const bool nontemporal = !v.accumulate && v.chunk_elements * sizeof(float) >= kStreamingBytes;
    loom::plugins::parallel_for(groups, kGrainGroups, [&](std::size_t g0, std::size_t g1) {
      std::vector<const uint8_t*> bits(v.chunks);
      for (std::size_t j = 0; j < v.chunks; ++j) bits[j] = v.in + j * chunk_bytes + 4 + g0;
      codecs::onebit_unpack_sum(bits.data(), values.data(), v.chunks, (g1 - g0) * 8, v.accumulate,
                                v.out + g0 * 8, nontemporal);
    });
  }

 private:
  // The CPU and CUDA paths fail bad data with the same codes and messages (the CUDA one
  // adds where it was found).
  static std::string non_finite_message(const std::string& op) {
    return op + ": input + error has non-finite values (or overflows fp32 when squared)";
  }
  static std::string bad_scale_message(const std::string& op, std::size_t chunk, float s) {
    return op + ": chunk " + std::to_string(chunk) + " has an invalid scale (" + std::to_string(s) +
           "); the input is not onebit chunks of this size";
  }

  // alpha * scale of each chunk, after checking the scales.
  static std::vector<float> chunk_values(const codecs::DecodeView& v, const char* op) {
    const std::size_t chunk_bytes = 4 + v.chunk_elements / 8;
    std::vector<float> values(v.chunks);
    for (std::size_t j = 0; j < v.chunks; ++j) {
      const float s = codecs::read_scale(v.in + j * chunk_bytes);
      if (!codecs::finite(s) || s < 0.0f) {
        throw Error(LOOM_ERR_DATA_LOSS, bad_scale_message(std::string("onebit ") + op, j, s));
      }
      values[j] = v.alpha * s;
    }
    return values;
  }

  [[noreturn]] static void unsupported(DLDevice d) {
    throw Error(LOOM_ERR_UNIMPLEMENTED,
                "onebit: tensors on " + loom::sdk::device_string(d) + " are not supported");
  }

  // CUDA: kernels record bad data in the device's fault word (onebit_cuda.h); decode and
  // decode_sum read it after their own kernels (synchronizing the stream) and turn a fault,
  // theirs or an earlier encode's, into the status the CPU path returns.
  void encode_cuda([[maybe_unused]] const codecs::EncodeView& v, [[maybe_unused]] void* stream) {
#ifdef LOOM_CODECS_CUDA
    void* fault = fault_word(v.device);
    const std::size_t ws_bytes = codecs::cuda::onebit_encode_workspace_bytes(v.n);
    void* ws = ctx_.device_alloc(v.device, ws_bytes, stream);
    try {
      codecs::cuda::onebit_encode(v.x, v.e, v.n, static_cast<uint32_t>(v.chunks), v.out, ws, fault,
                                  stream);
    } catch (...) {
      ctx_.device_free(v.device, ws, stream);
      throw;
    }
    ctx_.device_free(v.device, ws, stream);
#else
    unsupported(v.device);
#endif
  }

  void decode_cuda([[maybe_unused]] const codecs::DecodeView& v, [[maybe_unused]] void* stream,
                   [[maybe_unused]] bool sum) {
#ifdef LOOM_CODECS_CUDA
    void* fault = fault_word(v.device);
    const auto chunks = static_cast<uint32_t>(v.chunks);
    if (sum) {
      codecs::cuda::onebit_decode_sum(v.in, chunks, v.chunk_elements, v.alpha, v.accumulate, v.out,
                                      fault, stream);
    } else {
      codecs::cuda::onebit_decode(v.in, chunks, v.chunk_elements, v.alpha, v.accumulate, v.out,
                                  fault, stream);
    }
    const codecs::cuda::FaultReport r = codecs::cuda::read_fault(fault, stream);
    using codecs::cuda::Fault;
    switch (r.fault) {
      case Fault::kNone:
        return;
      case Fault::kEncodeNonFinite:
        throw Error(LOOM_ERR_INVALID_ARGUMENT,
                    non_finite_message("onebit encode") +
                        " (found on the CUDA device; reported by the next decode, which is the "
                        "first call that synchronizes)");
      case Fault::kDecodeBadScale:
      case Fault::kDecodeSumBadScale:
        throw Error(LOOM_ERR_DATA_LOSS,
                    bad_scale_message(r.fault == Fault::kDecodeSumBadScale ? "onebit decode_sum"
                                                                           : "onebit decode",
                                      r.chunk, r.value) +
                        " (found on the CUDA device)");
    }
    throw Error(LOOM_ERR_INTERNAL,
                "onebit: unknown CUDA fault code " + std::to_string(static_cast<int>(r.fault)));
#else
    unsupported(v.device);
#endif
  }

#ifdef LOOM_CODECS_CUDA
  // This instance's fault word on the tensor's device, made on first use.
  void* fault_word(DLDevice d) {
    auto it = faults_.find(d.device_id);
    if (it == faults_.end()) {
      it = faults_.emplace(d.device_id, codecs::cuda::fault_word_alloc(d.device_id)).first;
    }
    return it->second;
  }
  std::map<int32_t, void*> faults_;
#endif

  Context ctx_;
};

}  // namespace

LOOM_PLUGIN("onebit", "1.0.0",
            "Error-feedback 1-bit sign compression (1-bit Adam's codec), SIMD + CUDA",
            loom::sdk::factory<Onebit>());
