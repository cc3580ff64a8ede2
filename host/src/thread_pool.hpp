// The process's thread pool: one for libloom and every plugin it loads (plugins reach it
// through loom_host_services.parallel_for, embedding programs through loom_parallel_for).
// Its workers are named "loom-pool".
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace loom::host {

using ParallelBody = void (*)(void* ctx, size_t begin, size_t end);

class ThreadPool {
 public:
  // The process's pool. Created on first use and never destroyed (kernels may still run
  // from static destructors at exit); its threads start on the first parallel_for and are
  // joined at exit (an atexit handler calls close()).
  static ThreadPool& process();

  // Joins the workers for good: later calls run inline. Does nothing from inside a body or
  // while another thread's call is in flight (those threads are left to the process's end).
  void close();

  explicit ThreadPool(size_t threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Threads a call may use, the caller's included.
  [[nodiscard]] size_t size() const;

  // body(ctx, begin, end) over disjoint blocks covering [0, n), each beginning at a multiple
  // of grain (0 = 1); the caller runs block 0 and the workers the rest. Runs the whole range
  // inline on the caller when it is one block, when called from inside a body (nesting),
  // and when another thread's call holds the pool (concurrent callers never wait on each
  // other, so nothing can deadlock). body must not throw.
  void parallel_for(size_t n, size_t grain, ParallelBody body, void* ctx);

  // Joins the workers and sizes the pool to `threads` (0: the default, re-read from the
  // environment); waits for a call in progress. Returns false, changing nothing, when
  // called from inside a body.
  bool resize(size_t threads);

  // True on a pool worker, and on a caller while it runs its block.
  static bool inside_body();

  // LOOM_NUM_THREADS when it is a number in 1..kMaxThreads; else the cores this process may
  // run on divided by the ranks on this machine (OMPI_COMM_WORLD_LOCAL_SIZE, MPI_LOCALNRANKS,
  // LOCAL_WORLD_SIZE). `warning` (when not NULL) gets a message for an unusable value.
  static size_t default_threads(std::string* warning = nullptr);
  static constexpr size_t kMaxThreads = 1024;

 private:
  void start_locked();  // call_mu_ held
  void stop_locked();   // call_mu_ held
  void worker(size_t index, uint64_t generation);

  std::mutex call_mu_;  // held by the call using the workers, and by resize
  size_t size_;         // written under call_mu_ and mu_
  std::vector<std::thread> workers_;

  mutable std::mutex mu_;
  std::condition_variable start_cv_;
  std::condition_variable done_cv_;
  ParallelBody body_ = nullptr;
  void* ctx_ = nullptr;
  size_t n_ = 0;
  size_t per_ = 0;    // elements per block (a multiple of the grain)
  size_t parts_ = 0;  // blocks of this call; worker i runs block i
  size_t pending_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
  bool closed_ = false;  // under call_mu_
};

}  // namespace loom::host
