// CUDA gather/scatter: one kernel over the rows (a row is one kept token's channels).
// A row gets 1 .. 256 threads (a power of two, about its length in copy units), so a block
// of 256 threads copies 256 / threads rows at once and short rows still fill the block.
// The copy unit is the widest of 16, 8, 4, 2, 1 bytes that divides both base addresses,
// every stride and the row length, so aligned rows move as 16-byte vectors.
#include <cuda_runtime.h>
#include <loom/sdk/cuda.hpp>
#include <loom/sdk/status.hpp>

#include <cstdint>
#include <string>

#include "move_cuda.hpp"

namespace loom::routers {

bool have_cuda() { return true; }

namespace cuda {
namespace {

constexpr int kThreads = 256;

struct alignas(16) Unit16 {
  uint32_t v[4];
};
struct alignas(8) Unit8 {
  uint32_t v[2];
};

template <class U, bool kToKept>
__global__ void move_kernel(char* full, char* kept, const int32_t* idx, int64_t rows, int64_t k,
                            int64_t seq_len, int64_t fb, int64_t fp, int64_t kb, int64_t kp,
                            int64_t units, int row_shift) {
  const int t = static_cast<int>(threadIdx.x);
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kThreads >> row_shift) + (t >> row_shift);
  if (row >= rows) return;
  const int64_t lane = t & ((1 << row_shift) - 1);
  const int64_t b = row / k;
  const int64_t j = row - b * k;
  const int64_t p = idx[row];
  if (p < 0 || p >= seq_len) return;  // device indices are not checked beforehand
  U* f = reinterpret_cast<U*>(full + b * fb + p * fp);
  U* q = reinterpret_cast<U*>(kept + b * kb + j * kp);
  const int64_t step = int64_t{1} << row_shift;
  for (int64_t u = lane; u < units; u += step) {
    if (kToKept) {
      q[u] = f[u];
    } else {
      f[u] = q[u];
    }
  }
}

template <class U>
void launch(const loom::sdk::RouterMove& m, bool to_kept, int64_t unit_bytes, int64_t fb,
            int64_t fp, int64_t kb, int64_t kp, int64_t row_bytes) {
  const int64_t rows = m.batch * m.kept_count;
  const int64_t units = row_bytes / unit_bytes;
  int row_shift = 0;  // log2 of the threads per row
  while (row_shift < 8 && (int64_t{1} << row_shift) < units) ++row_shift;
  const int64_t rows_per_block = kThreads >> row_shift;
  const int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
  if (blocks > INT32_MAX) {
    throw loom::sdk::Error(LOOM_ERR_OUT_OF_RANGE, "router move: " + std::to_string(rows) +
                                                      " rows need " + std::to_string(blocks) +
                                                      " CUDA blocks, more than a grid holds");
  }
  auto* stream = static_cast<cudaStream_t>(m.stream);
  auto* full = static_cast<char*>(m.full.data);
  auto* kept = static_cast<char*>(m.kept.data);
  const auto grid = static_cast<unsigned>(blocks);
  if (to_kept) {
    move_kernel<U, true><<<grid, kThreads, 0, stream>>>(
        full, kept, m.indices, rows, m.kept_count, m.seq_len, fb, fp, kb, kp, units, row_shift);
  } else {
    move_kernel<U, false><<<grid, kThreads, 0, stream>>>(
        full, kept, m.indices, rows, m.kept_count, m.seq_len, fb, fp, kb, kp, units, row_shift);
  }
  LOOM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void move(const loom::sdk::RouterMove& m, bool to_kept) {
  if (m.batch * m.kept_count == 0 || m.channels == 0) return;
  const loom::sdk::CudaDeviceGuard guard(m.device.device_id);
  const auto e = static_cast<int64_t>(m.full.element_bytes);
  const int64_t fb = m.full.batch_stride * e;
  const int64_t fp = m.full.position_stride * e;
  const int64_t kb = m.kept.batch_stride * e;
  const int64_t kp = m.kept.position_stride * e;
  const int64_t row_bytes = m.channels * e;
  // The widest unit dividing every address a row starts at and its length.
  const auto bits = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(m.full.data)) |
                    static_cast<uint64_t>(reinterpret_cast<uintptr_t>(m.kept.data)) |
                    static_cast<uint64_t>(fb) | static_cast<uint64_t>(fp) |
                    static_cast<uint64_t>(kb) | static_cast<uint64_t>(kp) |
                    static_cast<uint64_t>(row_bytes);
  // A stride of 0 (a single sequence or position) constrains nothing.
  if ((bits & 15u) == 0) {
    launch<Unit16>(m, to_kept, 16, fb, fp, kb, kp, row_bytes);
  } else if ((bits & 7u) == 0) {
    launch<Unit8>(m, to_kept, 8, fb, fp, kb, kp, row_bytes);
  } else if ((bits & 3u) == 0) {
    launch<uint32_t>(m, to_kept, 4, fb, fp, kb, kp, row_bytes);
  } else if ((bits & 1u) == 0) {
    launch<uint16_t>(m, to_kept, 2, fb, fp, kb, kp, row_bytes);
  } else {
    launch<uint8_t>(m, to_kept, 1, fb, fp, kb, kp, row_bytes);
  }
}

}  // namespace cuda
}  // namespace loom::routers
