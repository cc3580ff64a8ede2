// Codec benchmarks, run by the comm benchmark (loom bench comm) after its transport figures:
// codec kernel throughput beside the memory bandwidth measured in the same run, and the
// compressed allreduce over the session's `comm` instance. One JSON object per line, rank 0.
#ifndef LOOM_BENCH_COMM_CODEC_BENCH_HPP
#define LOOM_BENCH_COMM_CODEC_BENCH_HPP

#include "bench_context.hpp"

namespace loom_bench {

void run_codec_benchmarks(const CommBenchContext& ctx);

}  // namespace loom_bench

#endif  // LOOM_BENCH_COMM_CODEC_BENCH_HPP
