// gather/scatter: the dispatch by device and the host copies (rows over the host pool, one
// memcpy per row: a row is a token's channels, contiguous in both tensors).
#include <loom/sdk/parallel.hpp>
#include <loom/sdk/status.hpp>
#include <loom/sdk/tensor.hpp>

#include <algorithm>
#include <cstring>
#include <string>

#include "router_core.hpp"
#if LOOM_ROUTERS_HAVE_CUDA
#include "move_cuda.hpp"
#endif

namespace loom::routers {

bool have_cuda() { return LOOM_ROUTERS_HAVE_CUDA != 0; }

namespace {

// Rows per parallel block at least: about 64 KiB of copies, so small moves stay on the
// calling thread rather than paying for a wake-up of the pool.
constexpr std::size_t kMinBlockBytes = std::size_t{64} << 10;

void move_cpu(const loom::sdk::RouterMove& m, bool to_kept) {
  const int64_t rows = m.batch * m.kept_count;
  if (rows == 0 || m.channels == 0) return;
  const std::size_t e = m.full.element_bytes;
  const std::size_t row_bytes = static_cast<std::size_t>(m.channels) * e;
  const std::size_t grain = std::max<std::size_t>(1, kMinBlockBytes / row_bytes);
  auto* full = static_cast<char*>(m.full.data);
  auto* kept = static_cast<char*>(m.kept.data);
  const auto fb = static_cast<std::ptrdiff_t>(m.full.batch_stride * static_cast<int64_t>(e));
  const auto fp = static_cast<std::ptrdiff_t>(m.full.position_stride * static_cast<int64_t>(e));
  const auto kb = static_cast<std::ptrdiff_t>(m.kept.batch_stride * static_cast<int64_t>(e));
  const auto kp = static_cast<std::ptrdiff_t>(m.kept.position_stride * static_cast<int64_t>(e));
  const int32_t* idx = m.indices;
  const int64_t k = m.kept_count;
  loom::sdk::parallel_for(static_cast<std::size_t>(rows), grain,
                          [&](std::size_t lo, std::size_t hi) {
                            auto b = static_cast<int64_t>(lo) / k;
                            auto j = static_cast<int64_t>(lo) % k;
                            for (std::size_t r = lo; r < hi; ++r) {
                              char* f = full + b * fb + static_cast<std::ptrdiff_t>(idx[r]) * fp;
                              char* t = kept + b * kb + j * kp;
                              if (to_kept) {
                                std::memcpy(t, f, row_bytes);
                              } else {
                                std::memcpy(f, t, row_bytes);
                              }
                              if (++j == k) {
                                j = 0;
                                ++b;
                              }
                            }
                          });
}

void move(const loom::sdk::RouterMove& m, bool to_kept) {
  if (loom::sdk::is_cpu(m.device)) {
    move_cpu(m, to_kept);
    return;
  }
  if (m.device.device_type == kDLCUDA) {
#if LOOM_ROUTERS_HAVE_CUDA
    cuda::move(m, to_kept);
    return;
#else
    throw loom::sdk::Error(LOOM_ERR_UNIMPLEMENTED,
                           std::string(to_kept ? "gather" : "scatter") + ": the tensors are on " +
                               loom::sdk::device_string(m.device) +
                               " but this router was built without CUDA (LOOM_CUDA off)");
#endif
  }
  throw loom::sdk::Error(LOOM_ERR_INVALID_ARGUMENT, std::string(to_kept ? "gather" : "scatter") +
                                                        ": the tensors are on " +
                                                        loom::sdk::device_string(m.device) +
                                                        "; routers move host or CUDA memory");
}

}  // namespace

void gather(const loom::sdk::RouterMove& m) { move(m, true); }
void scatter(const loom::sdk::RouterMove& m) { move(m, false); }

}  // namespace loom::routers
