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
#include <loom/sdk/kinds/codec.hpp>

#include <cstdint>
#include <numeric>
#include <string>

#include "codec_common.hpp"
#include "codec_kernels.hpp"
#include "onebit_backend.hpp"

namespace {

using loom::sdk::Context;
using loom::sdk::Error;
namespace codecs = loom::codecs;

class Onebit : public loom::sdk::Codec {
 public:
  explicit Onebit(Context& ctx) : ctx_(ctx), cuda_(ctx_) {
    ctx_.debug(std::string("onebit CPU kernels: ") + codecs::simd_target_name());
  }

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
    return loom::sdk::is_cuda(d) && codecs::cuda::device_available();
  }

  void encode(const loom_codec_encode_args& a) {
    const codecs::EncodeView v = codecs::check_encode(a, 8, "onebit");
    backend(v.device).encode(v, a.stream);
  }

  void decode(const loom_codec_decode_args& a) {
    const codecs::DecodeView v = codecs::check_decode(a, 8, "onebit");
    backend(v.device).decode(v, /*sum=*/false, a.stream);
  }

  // The server step of the compressed allreduce: the chunks' sum into one chunk.
  void decode_sum(const loom_codec_decode_args& a) {
    const codecs::DecodeView v = codecs::check_decode(a, 8, "onebit", /*sum=*/true);
    backend(v.device).decode(v, /*sum=*/true, a.stream);
  }

 private:
  codecs::onebit::Backend& backend(DLDevice d) {
    if (loom::sdk::is_cpu(d)) return cpu_;
    if (loom::sdk::is_cuda(d)) return cuda_;
    throw Error(LOOM_ERR_UNIMPLEMENTED,
                "onebit: tensors on " + loom::sdk::device_string(d) + " are not supported");
  }

  Context ctx_;
  codecs::onebit::CpuBackend cpu_;
  codecs::onebit::CudaBackend cuda_;
};

}  // namespace

LOOM_PLUGIN("onebit", "1.0.0",
            "Error-feedback 1-bit sign compression (1-bit Adam's codec), SIMD + CUDA",
            loom::sdk::factory<Onebit>());
