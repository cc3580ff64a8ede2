// The ef8 codec (loom.codec/1): scaled 8-bit error-feedback compression, 4x smaller than
// fp32 on the wire. Exact definitions in codec_kernels.hpp.
//
// Padding (layout): N = elements rounded up to a multiple of n (c = N / n elements a chunk).
// Chunk format: 4 bytes of little-endian fp32 scale (max |x + e| over the chunk / 127), then
// c int8 values; value k decodes to scale * q[k]. Each chunk has its own scale.
#include <loom/kinds/codec.h>
#include <loom/sdk.hpp>
#include <loom/sdk/kinds/codec.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "codec_common.hpp"
#include "codec_kernels.hpp"
#include "common/parallel_for.hpp"

namespace {

using loom::sdk::Context;
using loom::sdk::Error;
namespace codecs = loom::codecs;

constexpr std::size_t kGrain = 16384;

class Ef8 : public loom::sdk::Codec {
 public:
  explicit Ef8(Context& /*ctx*/) {}

  void layout(loom_codec_layout& l) {
    const uint64_t n = codecs::layout_world(l);
    l.padded_elements = codecs::round_up(std::max<uint64_t>(l.elements, 1), n);
    l.chunk_bytes = 4 + l.padded_elements / n;
  }

  bool supports_device(DLDevice d) { return loom::sdk::is_cpu(d); }

  void encode(const loom_codec_encode_args& a) {
    const codecs::EncodeView v = codecs::check_encode(a, 1, "ef8");
    if (!loom::sdk::is_cpu(v.device)) unsupported(v.device);
    const std::size_t c = v.chunk_elements;
    const std::size_t chunk_bytes = 4 + c;
    // Pass 1: every chunk's max |x + e| (max is exact, so the split does not matter).
    const std::size_t parts_per_chunk = (c + kGrain - 1) / kGrain;
    std::vector<float> part_max(v.chunks * parts_per_chunk);
    std::vector<unsigned char> part_ok(part_max.size());
    loom::plugins::parallel_for(part_max.size(), 1, [&](std::size_t p0, std::size_t p1) {
      for (std::size_t p = p0; p < p1; ++p) {
        const std::size_t chunk = p / parts_per_chunk;
        const std::size_t begin = chunk * c + (p % parts_per_chunk) * kGrain;
        const std::size_t len = std::min(kGrain, (chunk + 1) * c - begin);
        part_ok[p] = codecs::ef8_max_abs(v.x + begin, v.e != nullptr ? v.e + begin : nullptr, len,
                                         &part_max[p])
                         ? 1
                         : 0;
      }
    });
    std::vector<float> max_abs(v.chunks, 0.0f);
    for (std::size_t p = 0; p < part_max.size(); ++p) {
      if (part_ok[p] == 0) {
        throw Error(LOOM_ERR_INVALID_ARGUMENT, "ef8 encode: input + error has non-finite values");
      }
      max_abs[p / parts_per_chunk] = std::max(max_abs[p / parts_per_chunk], part_max[p]);
    }
    // Pass 2: quantize and update the error.
    for (std::size_t j = 0; j < v.chunks; ++j) {
      codecs::write_scale(v.out + j * chunk_bytes, max_abs[j] / 127.0f);
    }
    loom::plugins::parallel_for(part_max.size(), 1, [&](std::size_t p0, std::size_t p1) {
      for (std::size_t p = p0; p < p1; ++p) {
        const std::size_t chunk = p / parts_per_chunk;
        const std::size_t offset = (p % parts_per_chunk) * kGrain;
        const std::size_t begin = chunk * c + offset;
        const std::size_t len = std::min(kGrain, (chunk + 1) * c - begin);
        codecs::ef8_quantize(v.x + begin, v.e != nullptr ? v.e + begin : nullptr, len,
                             max_abs[chunk],
                             reinterpret_cast<int8_t*>(v.out + chunk * chunk_bytes + 4 + offset));
      }
    });
  }

  void decode(const loom_codec_decode_args& a) {
    const codecs::DecodeView v = codecs::check_decode(a, 1, "ef8");
    if (!loom::sdk::is_cpu(v.device)) unsupported(v.device);
    const std::size_t c = v.chunk_elements;
    const std::size_t chunk_bytes = 4 + c;
    std::vector<float> values(v.chunks);
    for (std::size_t j = 0; j < v.chunks; ++j) {
      const float s = codecs::read_scale(v.in + j * chunk_bytes);
      if (!codecs::finite(s) || s < 0.0f) {
        throw Error(LOOM_ERR_DATA_LOSS, "ef8 decode: chunk " + std::to_string(j) +
                                            " has an invalid scale; the input is not ef8 chunks "
                                            "of this size");
      }
      values[j] = v.alpha * s;
    }
    const std::size_t parts_per_chunk = (c + kGrain - 1) / kGrain;
    loom::plugins::parallel_for(v.chunks * parts_per_chunk, 1, [&](std::size_t p0, std::size_t p1) {
      for (std::size_t p = p0; p < p1; ++p) {
        const std::size_t chunk = p / parts_per_chunk;
        const std::size_t offset = (p % parts_per_chunk) * kGrain;
        const std::size_t len = std::min(kGrain, c - offset);
        codecs::ef8_dequantize(
            reinterpret_cast<const int8_t*>(v.in + chunk * chunk_bytes + 4 + offset), len,
            values[chunk], v.accumulate, v.out + chunk * c + offset);
      }
    });
  }

 private:
  [[noreturn]] static void unsupported(DLDevice d) {
    throw Error(LOOM_ERR_UNIMPLEMENTED,
                "ef8: tensors on " + loom::sdk::device_string(d) + " are not supported (CPU only)");
  }
};

}  // namespace

LOOM_PLUGIN("ef8", "1.0.0", "Scaled 8-bit error-feedback compression (per-chunk max-abs scale)",
            loom::sdk::factory<Ef8>());
