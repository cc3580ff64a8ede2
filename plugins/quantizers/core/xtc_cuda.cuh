// Device code the binary and ternary CUDA kernels share (binary.cu, ternary.cu): the
// fixed-order group sum of binary.hpp, the first-bad reduction and the read-back.
#pragma once

#include <cuda_runtime.h>
#include <loom/sdk/cuda.hpp>
#include <loom/sdk/status.hpp>

#include <cstdint>
#include <string>

#include <loom/quantizers/binary.hpp>

namespace loom::quant::cuda::detail {

constexpr int kThreads = 256;
constexpr int64_t kNone = INT64_MAX;  // "no bad element" in the per-group slots

inline unsigned blocks_for(int64_t n, const char* what) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  if (b > INT32_MAX) {
    throw loom::sdk::Error(LOOM_ERR_OUT_OF_RANGE, std::string(what) + ": " + std::to_string(n) +
                                                      " threads need more CUDA blocks than a "
                                                      "grid holds");
  }
  return static_cast<unsigned>(b);
}

// The workspace's parts (binary.hpp xtc_cuda_workspace_bytes).
struct Workspace {
  int64_t* bad;
  float* delta;
  int64_t* result;
};

inline Workspace split(void* ws, const GroupedShape& s) {
  auto up = [](uint64_t b) { return (b + 255) / 256 * 256; };
  const auto groups = static_cast<uint64_t>(s.groups());
  const auto rows = static_cast<uint64_t>(s.rows);
  auto* base = static_cast<char*>(ws);
  Workspace w;
  w.bad = reinterpret_cast<int64_t*>(base);
  w.delta = reinterpret_cast<float*>(base + up(8 * (groups > rows ? groups : rows)));
  w.result =
      reinterpret_cast<int64_t*>(base + up(8 * (groups > rows ? groups : rows)) + up(4 * groups));
  return w;
}

// Sum of |w_i| in the fixed order (16 partials, folded 8, 4, 2, 1); above >= 0: only of
// those > above, counted in *kept. *first: the first non-finite i (kNone if none).
__device__ inline float group_abs_sum(const float* w, int64_t n, float above, int64_t* kept,
                                      int64_t* first) {
  float partial[kSumLanes];
  for (int j = 0; j < kSumLanes; ++j) partial[j] = 0.0f;
  int64_t k = 0;
  int64_t bad = kNone;
  for (int64_t i = 0; i < n; ++i) {
    float a = fabsf(w[i]);
    if (!(a <= 3.40282347e38f) && bad == kNone) bad = i;
    if (above >= 0.0f) {
      if (a > above) {
        ++k;
      } else {
        a = 0.0f;
      }
    }
    partial[i % kSumLanes] = __fadd_rn(partial[i % kSumLanes], a);
  }
  for (int h = kSumLanes / 2; h >= 1; h /= 2) {
    for (int j = 0; j < h; ++j) partial[j] = __fadd_rn(partial[j], partial[j + h]);
  }
  *kept = above >= 0.0f ? k : n;
  *first = bad;
  return partial[0];
}

// The smallest of bad[0, n) (-1 for none): read back to the host, which synchronizes the
// stream; or, with `out` (device int64 [1]), written there on the stream and -1 returned at
// once. (binary.cu)
int64_t first_bad(const Workspace& ws, int64_t n, cudaStream_t stream, int64_t* out = nullptr);

// An empty tensor's outcome: -1, also into `out` (device int64 [1]) when given. (binary.cu)
int64_t no_bad(int64_t* out, int device, void* stream);

}  // namespace loom::quant::cuda::detail
