// gather/scatter: the dispatch by device and the host copies (rows over the host pool, one
// memcpy per row: a row is a token's channels, contiguous in both tensors).
#include <loom/sdk/parallel.hpp>
#include <loom/sdk/status.hpp>
#include <loom/sdk/tensor.hpp>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>

#if defined(__x86_64__) || defined(__SSE2__)
#include <emmintrin.h>
#define LOOM_ROUTERS_STREAM_STORES 1
#else
#define LOOM_ROUTERS_STREAM_STORES 0
#endif

#include <loom/routers/router_core.hpp>
#include "move_cuda.hpp"

namespace loom::routers {

namespace {

// Rows per parallel block at least: about 64 KiB of copies, so small moves stay on the
// calling thread rather than paying for a wake-up of the pool.
constexpr std::size_t kMinBlockBytes = std::size_t{64} << 10;

// Moves that write at least this many bytes bypass the caches (non-temporal stores): a
// destination this large would mostly leave the caches before it is read again, and a cached
// store first reads the line it overwrites, a third of a copy's memory traffic. 8 MiB: the
// size of a per-core share of a last-level cache or more (a virtual machine may report the
// host's whole cache, so the size is not read from the system); 0 in g_threshold means it.
constexpr std::size_t kDefaultThreshold = std::size_t{8} << 20;
std::atomic<std::size_t> g_threshold{0};

[[maybe_unused]] std::size_t streaming_threshold() {
  const std::size_t t = g_threshold.load(std::memory_order_relaxed);
  return t != 0 ? t : kDefaultThreshold;
}

#if LOOM_ROUTERS_STREAM_STORES
// dst 16-byte aligned, bytes a multiple of 16.
inline void stream_copy(char* dst, const char* src, std::size_t bytes) {
  auto* d = reinterpret_cast<__m128i*>(dst);
  const auto* s = reinterpret_cast<const __m128i*>(src);
  const std::size_t n = bytes / 16;
  std::size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m128i a = _mm_loadu_si128(s + i);
    const __m128i b = _mm_loadu_si128(s + i + 1);
    const __m128i c = _mm_loadu_si128(s + i + 2);
    const __m128i e = _mm_loadu_si128(s + i + 3);
    _mm_stream_si128(d + i, a);
    _mm_stream_si128(d + i + 1, b);
    _mm_stream_si128(d + i + 2, c);
    _mm_stream_si128(d + i + 3, e);
  }
  for (; i < n; ++i) _mm_stream_si128(d + i, _mm_loadu_si128(s + i));
}

#endif

bool stream_copy_bytes_impl(char* dst, const char* src, std::size_t bytes) {
#if LOOM_ROUTERS_STREAM_STORES
  const std::size_t body = bytes / 16 * 16;
  stream_copy(dst, src, body);
  std::memcpy(dst + body, src + body, bytes - body);
  _mm_sfence();
  return true;
#else
  (void)dst;
  (void)src;
  (void)bytes;
  return false;
#endif
}

#if LOOM_ROUTERS_STREAM_STORES
// Rows a gather copies at once when it streams (see stream_rows).
constexpr std::size_t kGatherWays = 8;

// Copies kGatherWays rows of row_bytes (a multiple of 64, destinations 16-byte aligned) one
// cache line of each in turn. A gather reads rows at scattered positions, and each row starts
// a new stream for the hardware prefetchers; with several rows in flight their misses overlap
// instead of each row waiting for its first lines (1.1x to 1.6x on a 2-core EPYC at 1 to 4 KiB
// rows, where a software prefetch of the next rows did not help).
inline void stream_rows(char* const* dst, const char* const* src, std::size_t row_bytes) {
  for (std::size_t o = 0; o < row_bytes; o += 64) {
    for (std::size_t w = 0; w < kGatherWays; ++w) {
      const auto* s = reinterpret_cast<const __m128i*>(src[w] + o);
      auto* d = reinterpret_cast<__m128i*>(dst[w] + o);
      const __m128i a = _mm_loadu_si128(s);
      const __m128i b = _mm_loadu_si128(s + 1);
      const __m128i c = _mm_loadu_si128(s + 2);
      const __m128i e = _mm_loadu_si128(s + 3);
      _mm_stream_si128(d, a);
      _mm_stream_si128(d + 1, b);
      _mm_stream_si128(d + 2, c);
      _mm_stream_si128(d + 3, e);
    }
  }
}
#endif

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
  // Streaming stores need every destination row 16-byte aligned and a multiple of 16 long.
  bool stream = false;
#if LOOM_ROUTERS_STREAM_STORES
  const auto dst_bits = reinterpret_cast<uintptr_t>(to_kept ? kept : full) |
                        static_cast<uintptr_t>(to_kept ? (kb | kp) : (fb | fp)) |
                        static_cast<uintptr_t>(row_bytes);
  stream =
      (dst_bits & 15u) == 0 && static_cast<std::size_t>(rows) * row_bytes >= streaming_threshold();
#endif
  auto body = [&](std::size_t lo, std::size_t hi) {
    auto b = static_cast<int64_t>(lo) / k;
    auto j = static_cast<int64_t>(lo) % k;
    std::size_t r = lo;
#if LOOM_ROUTERS_STREAM_STORES
    if (stream && to_kept && row_bytes % 64 == 0) {
      char* dst[kGatherWays];
      const char* src[kGatherWays];
      for (; r + kGatherWays <= hi; r += kGatherWays) {
        for (std::size_t w = 0; w < kGatherWays; ++w) {
          src[w] = full + b * fb + static_cast<std::ptrdiff_t>(idx[r + w]) * fp;
          dst[w] = kept + b * kb + j * kp;
          if (++j == k) {
            j = 0;
            ++b;
          }
        }
        // Rows adjacent in both tensors (a dense run of kept positions) are one contiguous
        // copy, which the prefetchers follow best.
        bool adjacent = true;
        for (std::size_t w = 1; w < kGatherWays && adjacent; ++w) {
          adjacent = src[w] == src[0] + w * row_bytes && dst[w] == dst[0] + w * row_bytes;
        }
        if (adjacent) {
          stream_copy(dst[0], src[0], kGatherWays * row_bytes);
        } else {
          stream_rows(dst, src, row_bytes);
        }
      }
    }
#endif
    for (; r < hi; ++r) {
      char* f = full + b * fb + static_cast<std::ptrdiff_t>(idx[r]) * fp;
      char* t = kept + b * kb + j * kp;
      char* dst = to_kept ? t : f;
      const char* src = to_kept ? f : t;
#if LOOM_ROUTERS_STREAM_STORES
      if (stream) {
        stream_copy(dst, src, row_bytes);
      } else {
        std::memcpy(dst, src, row_bytes);
      }
#else
      std::memcpy(dst, src, row_bytes);
#endif
      if (++j == k) {
        j = 0;
        ++b;
      }
    }
#if LOOM_ROUTERS_STREAM_STORES
    // The streamed lines are visible to other threads before the block reports done.
    if (stream) _mm_sfence();
#endif
  };
  (void)stream;
  loom::sdk::parallel_for(static_cast<std::size_t>(rows), grain, body);
}

void move(const loom::sdk::RouterMove& m, bool to_kept) {
  if (loom::sdk::is_cpu(m.device)) {
    move_cpu(m, to_kept);
    return;
  }
  if (loom::sdk::is_cuda(m.device)) {
    cuda::move(m, to_kept);  // move_cuda_stub.cpp without CUDA: UNIMPLEMENTED
    return;
  }
  throw loom::sdk::Error(LOOM_ERR_INVALID_ARGUMENT, std::string(to_kept ? "gather" : "scatter") +
                                                        ": the tensors are on " +
                                                        loom::sdk::device_string(m.device) +
                                                        "; routers move host or CUDA memory");
}

}  // namespace

void set_streaming_threshold(std::size_t bytes) {
  g_threshold.store(bytes, std::memory_order_relaxed);
}

void gather(const loom::sdk::RouterMove& m) { move(m, true); }
void scatter(const loom::sdk::RouterMove& m) { move(m, false); }

bool stream_copy_bytes(char* dst, const char* src, std::size_t bytes) {
  return stream_copy_bytes_impl(dst, src, bytes);
}

}  // namespace loom::routers
