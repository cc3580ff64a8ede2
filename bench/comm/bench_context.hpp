// What the comm benchmark hands to the codec benchmarks (codec_bench.hpp, when present):
// an opened Loom session with a `[comm.world]` instance, this rank's place in the job,
// the message sizes to sweep and the timed iterations per size.
#ifndef LOOM_BENCH_COMM_BENCH_CONTEXT_HPP
#define LOOM_BENCH_COMM_BENCH_CONTEXT_HPP

#include <loom/embed.h>

#include <cstddef>
#include <vector>

namespace loom_bench {

struct CommBenchContext {
  loom_session* session;            // holds the transport instance "world" (kind comm)
  int rank;                         // this rank
  int size;                         // number of ranks
  std::vector<size_t> sizes_bytes;  // message sizes to sweep, in bytes (fp32 payloads)
  int iters;                        // timed iterations per size (after one warm-up)
};

}  // namespace loom_bench

#endif  // LOOM_BENCH_COMM_BENCH_CONTEXT_HPP
