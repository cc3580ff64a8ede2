// Argument checks and chunk arithmetic shared by the bundled codecs.
#pragma once

#include <loom/kinds/codec.h>
#include <loom/sdk.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace loom::codecs {

// Checks the layout request; returns the world size.
inline uint64_t layout_world(const loom_codec_layout& l) {
  if (l.world_size <= 0) {
    throw sdk::Error(LOOM_ERR_INVALID_ARGUMENT,
                     "layout: world_size must be positive, got " + std::to_string(l.world_size));
  }
  if (l.elements > (uint64_t{1} << 48)) {
    throw sdk::Error(LOOM_ERR_OUT_OF_RANGE,
                     "layout: " + std::to_string(l.elements) + " elements is too many");
  }
  return static_cast<uint64_t>(l.world_size);
}

inline uint64_t round_up(uint64_t v, uint64_t unit) { return (v + unit - 1) / unit * unit; }

// An encode call's tensors, checked. `unit`: each chunk's element count must be a multiple.
struct EncodeView {
  const float* x = nullptr;
  float* e = nullptr;
  std::size_t n = 0;
  std::size_t chunks = 0;
  std::size_t chunk_elements = 0;
  uint8_t* out = nullptr;
  DLDevice device{kDLCPU, 0};
};

inline EncodeView check_encode(const loom_codec_encode_args& a, std::size_t unit,
                               const char* codec) {
  const std::string who = std::string(codec) + " encode: ";
  const DLTensor& in = sdk::expect_tensor(a.input, who + "input");
  sdk::expect_fp32(in, who + "input");
  sdk::expect_contiguous(in, who + "input");
  if (a.chunk_count == 0) sdk::fail_argument(who + "chunk_count is 0");
  if (a.output == nullptr) sdk::fail_argument(who + "output is NULL");
  EncodeView v;
  v.n = static_cast<std::size_t>(sdk::numel(in));
  v.chunks = a.chunk_count;
  if (v.n % v.chunks != 0 || (v.n / v.chunks) % unit != 0) {
    sdk::fail_argument(who + "input has " + std::to_string(v.n) + " elements, not " +
                       std::to_string(v.chunks) + " chunks of a multiple of " +
                       std::to_string(unit) + " (pad it to the layout's padded_elements)");
  }
  v.chunk_elements = v.n / v.chunks;
  v.x = sdk::data_as<const float>(in);
  v.device = in.device;
  if (a.error != nullptr) {
    const DLTensor& err = sdk::expect_tensor(a.error, who + "error");
    sdk::expect_fp32(err, who + "error");
    sdk::expect_contiguous(err, who + "error");
    sdk::expect_numel(err, static_cast<int64_t>(v.n), who + "error");
    sdk::expect_same_device(err, who + "error", in, who + "input");
    v.e = sdk::data_as<float>(err);
  }
  v.out = static_cast<uint8_t*>(a.output);
  return v;
}

struct DecodeView {
  const uint8_t* in = nullptr;
  float* out = nullptr;
  std::size_t chunks = 0;
  std::size_t chunk_elements = 0;
  float alpha = 1.0f;
  bool accumulate = false;
  DLDevice device{kDLCPU, 0};
};

// sum: the args of decode_sum, whose output holds one chunk (the chunks' sum).
inline DecodeView check_decode(const loom_codec_decode_args& a, std::size_t unit, const char* codec,
                               bool sum = false) {
  const std::string who = std::string(codec) + (sum ? " decode_sum: " : " decode: ");
  if (a.input == nullptr) sdk::fail_argument(who + "input is NULL");
  if (a.chunk_count == 0) sdk::fail_argument(who + "chunk_count is 0");
  const DLTensor& out = sdk::expect_tensor(a.output, who + "output");
  sdk::expect_fp32(out, who + "output");
  sdk::expect_contiguous(out, who + "output");
  if (!(a.alpha <= 3.402823466e38f && a.alpha >= -3.402823466e38f)) {
    sdk::fail_argument(who + "alpha is not finite");
  }
  if (a.accumulate != 0 && a.accumulate != 1) sdk::fail_argument(who + "accumulate must be 0 or 1");
  DecodeView v;
  const auto n = static_cast<std::size_t>(sdk::numel(out));
  v.chunks = a.chunk_count;
  if (sum) {
    if (n % unit != 0) {
      sdk::fail_argument(who + "output has " + std::to_string(n) +
                         " elements, not one chunk of a multiple of " + std::to_string(unit));
    }
    v.chunk_elements = n;
  } else if (n % v.chunks != 0 || (n / v.chunks) % unit != 0) {
    sdk::fail_argument(who + "output has " + std::to_string(n) + " elements, not " +
                       std::to_string(v.chunks) + " chunks of a multiple of " +
                       std::to_string(unit));
  } else {
    v.chunk_elements = n / v.chunks;
  }
  v.in = static_cast<const uint8_t*>(a.input);
  v.out = sdk::data_as<float>(out);
  v.alpha = a.alpha;
  v.accumulate = a.accumulate != 0;
  v.device = out.device;
  return v;
}

inline float read_scale(const uint8_t* p) {
  float s;
  std::memcpy(&s, p, sizeof s);
  return s;
}
inline void write_scale(uint8_t* p, float s) { std::memcpy(p, &s, sizeof s); }
inline bool finite(float v) { return v <= 3.402823466e38f && v >= -3.402823466e38f; }

}  // namespace loom::codecs
