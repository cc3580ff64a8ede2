// The CUDA selection both routers share (random_ltd's Philox keys, topk_router's rank keys):
// one block of kSelectThreads threads per sequence picks the `kept` positions with the
// smallest 64-bit keys, ties by smaller position, and emits them in increasing position order.
// Nothing is limited by shared memory: keys come from a caller's functor (global memory).
//  1. radix_threshold: a radix select, 8 bits per pass from the top. A shared histogram of the
//     next digit among the keys that match the digits chosen so far, then a block scan over
//     the 256 digits (thread d owns digit d) finds the digit whose bucket holds the rank-take
//     key. It stops as soon as the chosen bucket is taken whole (a few passes for random keys;
//     eight only when many keys tie). The result: `prefix` (the top `bits` bits of the
//     threshold) and `take` (how many keys with that prefix are kept, the first by position).
//  2. ordered_compaction: tiles of kSelectThreads * kPerThread positions through shared
//     memory; each thread counts the keys of its consecutive positions below and equal to the
//     prefix, a block scan turns the counts into output offsets, and each thread emits its kept
//     positions in order.
// Every thread of the block must call both (they synchronise the block).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace loom::routers::block_select {

constexpr int kSelectThreads = 256;
constexpr int kWarps = kSelectThreads / 32;
constexpr int kDigits = 256;
constexpr int kPerThread = 8;
constexpr int kTile = kSelectThreads * kPerThread;
// A thread's run of 64-bit keys is padded to 9 words, so the threads of a warp reading their
// i-th keys hit different banks.
constexpr int kRunStride = kPerThread + 1;
static_assert(kSelectThreads == kDigits, "the radix select gives each thread one digit");

// The block's shared state (declare one `__shared__ Shared` in the kernel).
struct Shared {
  unsigned hist[kDigits];
  uint64_t warp_totals[kWarps];
  uint64_t tile[kSelectThreads * kRunStride];
  uint64_t prefix;
  uint64_t take;
  uint64_t base;  // packed (below | equal << 32) counts of the tiles before
  int bits;
  int done;
};

struct Threshold {
  uint64_t prefix = 0;
  int bits = 0;
  uint64_t take = 0;
};

// The exclusive prefix sum of v over the block (every thread calls it), and the block's
// total. A warp's suffix sums by __shfl_down_sync, then the warps' totals through shared
// memory.
__device__ inline uint64_t block_exclusive_scan(uint64_t v, uint64_t* warp_totals,
                                                uint64_t* total) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  uint64_t suffix = v;  // the sum over lanes >= lane of this warp
  for (int d = 1; d < 32; d *= 2) {
    const uint64_t other = __shfl_down_sync(0xffffffffu, suffix, d);
    if (lane + d < 32) suffix += other;
  }
  if (lane == 0) warp_totals[warp] = suffix;
  __syncthreads();
  uint64_t before = warp_totals[warp] - suffix;  // lanes < lane of this warp
  uint64_t all = 0;
  for (int w = 0; w < kWarps; ++w) {
    if (w < warp) before += warp_totals[w];
    all += warp_totals[w];
  }
  __syncthreads();  // warp_totals is reused by the next call
  *total = all;
  return before;
}

// The threshold of the `kept` (1 .. n) smallest of key_at(0 .. n - 1).
template <class KeyAt>
__device__ Threshold radix_threshold(const KeyAt& key_at, int64_t n, int64_t kept, Shared& sh) {
  const int tid = static_cast<int>(threadIdx.x);
  if (tid == 0) {
    sh.prefix = 0;
    sh.take = static_cast<uint64_t>(kept);
    sh.bits = 0;
    sh.done = 0;
  }
  __syncthreads();
  for (;;) {
    sh.hist[tid] = 0;
    __syncthreads();
    const int bits = sh.bits;
    const uint64_t prefix = sh.prefix;
    const uint64_t take = sh.take;
    const int shift = 56 - bits;  // of the next digit
    for (int64_t p = tid; p < n; p += kSelectThreads) {
      const uint64_t k = key_at(p);
      if (bits == 0 || (k >> (64 - bits)) == prefix) {
        atomicAdd(&sh.hist[(k >> shift) & 0xffu], 1u);  // lint: integer atomic
      }
    }
    __syncthreads();
    const uint64_t count = sh.hist[tid];
    uint64_t all = 0;
    const uint64_t below = block_exclusive_scan(count, sh.warp_totals, &all);
    if (below < take && take <= below + count) {  // exactly one thread: count >= 1
      sh.prefix = (prefix << 8) | static_cast<uint64_t>(tid);
      sh.bits = bits + 8;
      sh.take = take - below;
      sh.done = (take - below == count || bits + 8 == 64) ? 1 : 0;
    }
    __syncthreads();
    if (sh.done != 0) break;
  }
  Threshold t;
  t.prefix = sh.prefix;
  t.bits = sh.bits;
  t.take = sh.take;
  __syncthreads();  // every thread has read the result before sh is reused
  return t;
}

// emit(j, p): position p is the j-th kept one (j = 0 .. kept - 1 in increasing p).
template <class KeyAt, class Emit>
__device__ void ordered_compaction(const KeyAt& key_at, int64_t n, const Threshold& th, Shared& sh,
                                   const Emit& emit) {
  const int tid = static_cast<int>(threadIdx.x);
  const int rest = 64 - th.bits;  // the bits below the chosen prefix: 0 .. 56
  if (tid == 0) sh.base = 0;
  __syncthreads();
  uint64_t* mine = sh.tile + tid * kRunStride;
  for (int64_t base = 0; base < n; base += kTile) {
    for (int i = tid; i < kTile; i += kSelectThreads) {
      const int64_t p = base + i;
      sh.tile[(i / kPerThread) * kRunStride + i % kPerThread] = p < n ? key_at(p) : ~uint64_t{0};
    }
    __syncthreads();
    uint64_t count = 0;  // below | equal << 32, over this thread's positions
    for (int i = 0; i < kPerThread; ++i) {
      const int64_t p = base + tid * kPerThread + i;
      if (p >= n) break;
      const uint64_t top = mine[i] >> rest;
      count += top < th.prefix ? 1u : (top == th.prefix ? (uint64_t{1} << 32) : 0u);
    }
    uint64_t total = 0;
    const uint64_t before = sh.base + block_exclusive_scan(count, sh.warp_totals, &total);
    uint64_t below = before & 0xffffffffu;
    uint64_t equal = before >> 32;
    for (int i = 0; i < kPerThread; ++i) {
      const int64_t p = base + tid * kPerThread + i;
      if (p >= n) break;
      const uint64_t top = mine[i] >> rest;
      if (top < th.prefix) {
        emit(static_cast<int64_t>(below + (equal < th.take ? equal : th.take)), p);
        ++below;
      } else if (top == th.prefix) {
        if (equal < th.take) emit(static_cast<int64_t>(below + equal), p);
        ++equal;
      }
    }
    __syncthreads();  // every thread has read sh.base and the tile
    if (tid == 0) sh.base += total;
    __syncthreads();
  }
}

}  // namespace loom::routers::block_select
