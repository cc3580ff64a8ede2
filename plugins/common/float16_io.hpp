// The float side of a bundled plugin's call in float32, bfloat16 or float16: kernels compute
// in float32, so a 16-bit tensor is widened into float32 on the way in (exact) and rounded
// back on the way out (to nearest, ties to even: common/half.hpp's rule, the same bits on the
// host and on CUDA). One pattern for the quantizer and moe families (docs/sdk.md, "16-bit
// tensors"): float16_stage.hpp carves the float32 copies from the call's workspace, which
// layout / plan size for the dtype, so a 16-bit call allocates nothing. The CUDA kernels are
// in float16_io_cuda.cuh.
#pragma once

#include <loom/sdk/tensor.hpp>

#include <cstddef>
#include <cstdint>

#include "half.hpp"
#include "parallel_for.hpp"

namespace loom::plugins::float16 {

// How a float tensor is stored.
enum class Storage : uint8_t { kF32, kBF16, kF16 };

// The storage of `t`, or false when it is none of the three (one lane).
inline bool storage_of(DLDataType t, Storage* out) {
  if (t.lanes != 1) return false;
  if (t.code == kDLFloat && t.bits == 32) {
    *out = Storage::kF32;
  } else if (t.code == kDLBfloat && t.bits == 16) {
    *out = Storage::kBF16;
  } else if (t.code == kDLFloat && t.bits == 16) {
    *out = Storage::kF16;
  } else {
    return false;
  }
  return true;
}

// Bytes of a float32 staging region of n elements, 256-byte aligned like every workspace
// region.
inline uint64_t staging_bytes(int64_t n) {
  return (static_cast<uint64_t>(n < 0 ? 0 : n) * 4u + 255u) / 256u * 256u;
}

namespace detail {
// Elements per parallel block: 64 K (256 KiB of float32), so a small tensor stays on the
// calling thread and a large one spreads over the pool.
constexpr std::size_t kGrain = std::size_t{1} << 16;

template <class Fn>
void blocks(int64_t n, Fn&& fn) {
  if (n <= 0) return;
  loom::plugins::parallel_for(static_cast<std::size_t>(n), kGrain, fn);
}
}  // namespace detail

// dst[0 .. n) = src's n elements as float32 (exact for every pattern).
inline void widen(const void* src, Storage s, float* dst, int64_t n) {
  const auto* h = static_cast<const uint16_t*>(src);
  switch (s) {
    case Storage::kF32:
      if (static_cast<const void*>(dst) != src) {
        detail::blocks(n, [&](std::size_t b, std::size_t e) {
          for (std::size_t i = b; i < e; ++i) dst[i] = static_cast<const float*>(src)[i];
        });
      }
      return;
    case Storage::kBF16:
      detail::blocks(n, [&](std::size_t b, std::size_t e) {
        for (std::size_t i = b; i < e; ++i) dst[i] = half::bf16_to_f32(h[i]);
      });
      return;
    case Storage::kF16:
      detail::blocks(n, [&](std::size_t b, std::size_t e) {
        for (std::size_t i = b; i < e; ++i) dst[i] = half::f16_to_f32(h[i]);
      });
      return;
  }
}

// dst's n elements = src rounded to dst's storage.
inline void narrow(const float* src, Storage s, void* dst, int64_t n) {
  if (s == Storage::kF32) {
    auto* f = static_cast<float*>(dst);
    detail::blocks(n, [&](std::size_t b, std::size_t e) {
      for (std::size_t i = b; i < e; ++i) f[i] = src[i];
    });
    return;
  }
  auto* h = static_cast<uint16_t*>(dst);
  if (s == Storage::kBF16) {
    detail::blocks(n, [&](std::size_t b, std::size_t e) {
      for (std::size_t i = b; i < e; ++i) h[i] = half::f32_to_bf16(src[i]);
    });
    return;
  }
  detail::blocks(n, [&](std::size_t b, std::size_t e) {
    for (std::size_t i = b; i < e; ++i) h[i] = half::f32_to_f16(src[i]);
  });
}

}  // namespace loom::plugins::float16
