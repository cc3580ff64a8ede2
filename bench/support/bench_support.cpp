#include "bench_support.hpp"

#include <loom/embed.h>
#include <loom/routers/router_core.hpp>

#include <cstdlib>
#include <cstring>
#include <string>

namespace loom::bench {
namespace {

loom_status* pool_run(void* program, std::size_t n, std::size_t grain, sdk::ParallelBody body,
                      void* ctx) {
  if (loom_parallel_for(n, grain, body, ctx) != 0) {
    std::fprintf(stderr, "%s: loom_parallel_for: %s\n", static_cast<const char*>(program),
                 loom_last_error());
    std::abort();  // a pool that cannot run is a broken install, not a user error
  }
  return nullptr;
}

std::size_t pool_threads(void*) { return loom_thread_count(); }

}  // namespace

sdk::Pool LibloomPool::make(const char* program) {
  sdk::Pool pool;
  pool.parallel_for = &pool_run;
  pool.thread_count = &pool_threads;
  pool.host_ctx = const_cast<char*>(program);  // NOLINT: read back as const char*
  return pool;
}

LibloomPool::LibloomPool(const char* program) : registration_(make(program)) {}

double copy_seconds(char* dst, const char* src, std::size_t bytes, bool pool, bool streaming) {
  struct Job {
    char* dst;
    const char* src;
    std::size_t bytes;
    bool streaming;
  } job{dst, src, bytes, streaming};
  auto body = [](void* ctx, std::size_t begin, std::size_t end) {
    const auto& j = *static_cast<const Job*>(ctx);
    const std::size_t lo = begin * kPoolBlock, hi = std::min(j.bytes, end * kPoolBlock);
    if (j.streaming && (reinterpret_cast<uintptr_t>(j.dst + lo) & 15u) == 0 &&
        loom::routers::stream_copy_bytes(j.dst + lo, j.src + lo, hi - lo)) {
      return;
    }
    std::memcpy(j.dst + lo, j.src + lo, hi - lo);
  };
  const std::size_t blocks = (bytes + kPoolBlock - 1) / kPoolBlock;
  const auto t0 = Clock::now();
  if (pool) {
    if (loom_parallel_for(blocks, 1, body, &job) != 0) {
      throw BenchError(std::string("loom_parallel_for: ") + loom_last_error());
    }
  } else {
    body(&job, 0, blocks);
  }
  return since(t0);
}

}  // namespace loom::bench
