// What every loom-bench-NAME shares: the clock and the timing loop, the one-JSON-object-per-
// line output, the error a benchmark throws, libloom's pool registered with the SDK for
// programs that link plugin cores directly, and the memory roof's copy on that pool. The
// output a benchmark prints is its own; these only keep the mechanics in one place.
#pragma once

#include <loom/sdk/parallel.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <utility>

namespace loom::bench {

using Clock = std::chrono::steady_clock;
// Keys in insertion order, as the benchmarks document their lines.
using Json = nlohmann::ordered_json;

// Seconds since t0.
inline double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The fastest of `reps` runs of fn(), in seconds: the timing loop of every benchmark (the
// minimum is the run least disturbed by the rest of the machine).
template <class Fn>
double best_seconds(int64_t reps, Fn&& fn) {
  double best = 1e30;
  for (int64_t r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    fn();
    best = std::min(best, since(t0));
  }
  return best;
}

// A failure a benchmark reports as "loom bench NAME: error: ..." and exit status 2.
struct BenchError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// One result line on stdout: the JSON object, compact, and a newline, flushed so that a
// reader of a long run sees each result as it is measured.
template <class J>
void emit(const J& line) {
  std::printf("%s\n", line.dump().c_str());
  std::fflush(stdout);
}

// libloom's process-wide pool (the one plugins get) registered with the SDK while this lives,
// for a benchmark that calls a plugin core directly: the core splits its work over the SDK's
// registered pool. `program` ("loom bench moe") names the program if the pool fails.
class LibloomPool {
 public:
  explicit LibloomPool(const char* program);

 private:
  static sdk::Pool make(const char* program);
  sdk::PoolRegistration registration_;
};

// The copy roof: copies `bytes` from src to dst in 64 KiB blocks, on libloom's pool (`pool`)
// or on the calling thread, with memcpy or (`streaming`, where dst is 16-byte aligned and the
// build has them) the router core's non-temporal stores, the very copy its moves stream with.
// Returns the seconds it took; throws BenchError if the pool fails.
double copy_seconds(char* dst, const char* src, std::size_t bytes, bool pool, bool streaming);

// Bytes per block of copy_seconds, as the cores split their rows over the pool.
inline constexpr std::size_t kPoolBlock = std::size_t{64} << 10;

}  // namespace loom::bench
