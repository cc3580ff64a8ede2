// scaled_sign: a loom.codec/1 codec that sends one sign bit per element and one fp32 scale
// per chunk, with error feedback. A starting point for your own codec: the structure (a
// layout that depends only on its inputs, every argument checked before anything is
// written, self-contained chunks, an error buffer updated only on success) is what matters,
// not the arithmetic.
//
// For a buffer of N padded elements split into n chunks of c = N / n elements:
//
//   b     = input + error                          (error: 0 when the caller passes none)
//   scale = mean(|b|) over the chunk               (0 for an empty chunk)
//   bit   = b >= 0                                 (so 0 and -0 both send +scale)
//   error = b - (bit ? scale : -scale)             (only when the caller passes an error)
//
// mean(|b|) is the scale that minimises the squared error once the signs are fixed.
//
// Layout: N = elements rounded up to a multiple of 8 * n, so every chunk is a whole number
// of bytes of bits. Chunk format: the chunk's scale as 4 bytes of fp32 (native byte order,
// little-endian on every platform Loom runs on), then c / 8 bytes of bits, MSB first
// (element 8k + j of the chunk is bit 7 - j of byte k).
//
// CPU tensors only; on other devices encode and decode fail with UNIMPLEMENTED and
// supports_device says 0, so a compressed allreduce on a GPU refuses this codec up front.
#include <loom/kinds/codec.h>
#include <loom/sdk.hpp>
#include <loom/sdk/kinds/codec.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

using loom::sdk::Context;
using loom::sdk::Error;

constexpr uint64_t kMaxElements = uint64_t{1} << 48;

// Whether the byte ranges [a, a + a_bytes) and [b, b + b_bytes) share a byte.
bool overlap(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) {
  if (a_bytes == 0 || b_bytes == 0) return false;
  const auto a0 = reinterpret_cast<std::uintptr_t>(a);
  const auto b0 = reinterpret_cast<std::uintptr_t>(b);
  return a0 < b0 + b_bytes && b0 < a0 + a_bytes;
}

class ScaledSign : public loom::sdk::Codec {
 public:
  // No parameters, so no schema(); add one as in sdk/template/sgd.cpp if yours has some.
  explicit ScaledSign(Context& /*ctx*/) {}

  // [any] Must depend on nothing but `elements` and `world_size`: every rank calls it and
  // they must agree on the sizes.
  void layout(loom_codec_layout& l) {
    if (l.world_size <= 0) {
      throw Error(
          LOOM_ERR_INVALID_ARGUMENT,
          "scaled_sign layout: world_size must be positive, got " + std::to_string(l.world_size));
    }
    if (l.elements > kMaxElements) {
      throw Error(LOOM_ERR_OUT_OF_RANGE, "scaled_sign layout: " + std::to_string(l.elements) +
                                             " elements is more than this codec handles");
    }
    const auto n = static_cast<uint64_t>(l.world_size);
    const uint64_t unit = 8 * n;
    l.padded_elements = (l.elements + unit - 1) / unit * unit;  // 0 stays 0
    l.chunk_bytes = chunk_bytes(l.padded_elements / n);
  }

  bool supports_device(DLDevice d) { return loom::sdk::is_cpu(d); }

  void encode(const loom_codec_encode_args& a) {
    // 1. Check everything before writing anything.
    const DLTensor& in = loom::sdk::expect_tensor(a.input, "scaled_sign encode: input");
    expect_host_fp32(in, "scaled_sign encode: input");
    const Split s = split(loom::sdk::numel(in), a.chunk_count, "scaled_sign encode: input");
    const float* x = loom::sdk::data_as<const float>(in);
    const std::size_t in_bytes = s.n * sizeof(float);
    const std::size_t out_bytes = s.chunks * chunk_bytes(s.chunk_elements);
    if (a.output == nullptr) fail("scaled_sign encode: output is NULL");
    float* e = nullptr;
    if (a.error != nullptr) {
      const DLTensor& err = loom::sdk::expect_tensor(a.error, "scaled_sign encode: error");
      expect_host_fp32(err, "scaled_sign encode: error");
      loom::sdk::expect_numel(err, static_cast<int64_t>(s.n), "scaled_sign encode: error");
      e = loom::sdk::data_as<float>(err);
      // The error is read and written in the same pass as the input is read: a buffer that
      // is both would be half updated when it is read.
      if (overlap(e, in_bytes, x, in_bytes)) fail("scaled_sign encode: error overlaps input");
      if (overlap(e, in_bytes, a.output, out_bytes)) {
        fail("scaled_sign encode: error overlaps output");
      }
    }
    if (overlap(x, in_bytes, a.output, out_bytes))
      fail("scaled_sign encode: output overlaps input");

    // 2. Pass 1: every chunk's scale. Nothing is written yet, so a non-finite input leaves
    // the error buffer as it was.
    std::vector<float> scales(s.chunks, 0.0f);
    for (std::size_t j = 0; j < s.chunks; ++j) {
      double sum = 0.0;
      for (std::size_t i = j * s.chunk_elements; i < (j + 1) * s.chunk_elements; ++i) {
        sum += std::fabs(static_cast<double>(x[i]) + (e != nullptr ? e[i] : 0.0f));
      }
      if (!std::isfinite(sum)) {
        fail("scaled_sign encode: chunk " + std::to_string(j) +
             " of input + error has non-finite values");
      }
      if (s.chunk_elements > 0) {
        scales[j] = static_cast<float>(sum / static_cast<double>(s.chunk_elements));
      }
    }

    // 3. Pass 2: scale, bits, and the new error.
    auto* out = static_cast<unsigned char*>(a.output);
    for (std::size_t j = 0; j < s.chunks; ++j) {
      unsigned char* chunk = out + j * chunk_bytes(s.chunk_elements);
      const float scale = scales[j];
      std::memcpy(chunk, &scale, sizeof scale);
      unsigned char* bits = chunk + sizeof scale;
      for (std::size_t k = 0; k < s.chunk_elements / 8; ++k) {
        unsigned byte = 0;
        for (std::size_t b = 0; b < 8; ++b) {
          const std::size_t i = j * s.chunk_elements + 8 * k + b;
          const float v = x[i] + (e != nullptr ? e[i] : 0.0f);
          const bool positive = v >= 0.0f;
          byte |= (positive ? 1u : 0u) << (7 - b);
          if (e != nullptr) e[i] = v - (positive ? scale : -scale);
        }
        bits[k] = static_cast<unsigned char>(byte);
      }
    }
  }

  void decode(const loom_codec_decode_args& a) {
    if (a.input == nullptr) fail("scaled_sign decode: input is NULL");
    const DLTensor& out_t = loom::sdk::expect_tensor(a.output, "scaled_sign decode: output");
    expect_host_fp32(out_t, "scaled_sign decode: output");
    const Split s = split(loom::sdk::numel(out_t), a.chunk_count, "scaled_sign decode: output");
    if (!std::isfinite(a.alpha)) fail("scaled_sign decode: alpha is not finite");
    if (a.accumulate != 0 && a.accumulate != 1) {
      fail("scaled_sign decode: accumulate must be 0 or 1, got " + std::to_string(a.accumulate));
    }
    float* out = loom::sdk::data_as<float>(out_t);
    const std::size_t cb = chunk_bytes(s.chunk_elements);
    const auto* in = static_cast<const unsigned char*>(a.input);
    if (overlap(in, s.chunks * cb, out, s.n * sizeof(float))) {
      fail("scaled_sign decode: output overlaps input");
    }
    // Every chunk's scale first: bytes that are not this codec's chunks of this size are
    // DATA_LOSS, and the output is left as it was.
    std::vector<float> values(s.chunks);
    for (std::size_t j = 0; j < s.chunks; ++j) {
      float scale;
      std::memcpy(&scale, in + j * cb, sizeof scale);
      if (!std::isfinite(scale) || scale < 0.0f) {
        throw Error(LOOM_ERR_DATA_LOSS, "scaled_sign decode: chunk " + std::to_string(j) +
                                            " has an invalid scale; the input is not "
                                            "scaled_sign chunks of " +
                                            std::to_string(s.chunk_elements) + " elements");
      }
      values[j] = a.alpha * scale;
    }
    for (std::size_t j = 0; j < s.chunks; ++j) {
      const unsigned char* bits = in + j * cb + sizeof(float);
      for (std::size_t i = 0; i < s.chunk_elements; ++i) {
        const bool positive = ((bits[i / 8] >> (7 - i % 8)) & 1u) != 0;
        const float v = positive ? values[j] : -values[j];
        float& o = out[j * s.chunk_elements + i];
        o = a.accumulate != 0 ? o + v : v;
      }
    }
  }

  // decode_sum is optional and left out: the compressed allreduce then decodes its n
  // chunks one by one with `accumulate`. Add it when one pass over the output is faster;
  // its result must be bit-identical to that fallback.

 private:
  struct Split {
    std::size_t n = 0;               // elements in all
    std::size_t chunks = 0;          // chunk_count
    std::size_t chunk_elements = 0;  // c
  };

  static uint64_t chunk_bytes(uint64_t chunk_elements) { return 4 + chunk_elements / 8; }

  [[noreturn]] static void fail(const std::string& message) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT, message);
  }

  static void expect_host_fp32(const DLTensor& t, const std::string& what) {
    loom::sdk::expect_fp32(t, what);
    loom::sdk::expect_contiguous(t, what);
    if (!loom::sdk::is_cpu(t)) {
      throw Error(LOOM_ERR_UNIMPLEMENTED, what + " is on " + loom::sdk::device_string(t.device) +
                                              "; scaled_sign runs on the CPU only");
    }
  }

  // n elements in `chunks` chunks, each a multiple of 8 elements (the layout's padding).
  static Split split(int64_t numel, uint32_t chunks, const std::string& what) {
    if (chunks == 0) fail(what + ": chunk_count is 0");
    const auto n = static_cast<std::size_t>(numel);
    if (n % chunks != 0 || (n / chunks) % 8 != 0) {
      fail(what + " has " + std::to_string(n) + " elements, not " + std::to_string(chunks) +
           " chunks of a multiple of 8 (pad it to the layout's padded_elements)");
    }
    return Split{n, chunks, n / chunks};
  }
};

}  // namespace

LOOM_PLUGIN("scaled_sign", "1.0.0",
            "Template codec: one sign bit per element, one mean-|x| scale per chunk",
            loom::sdk::factory<ScaledSign>());
