// A small persistent thread pool for plugin kernels: parallel_for over [0, n) in
// contiguous blocks. Plugin-internal (not part of the SDK): each plugin library gets its
// own pool, started on first use and joined when the library's statics are destroyed.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace loom::plugins {

class ThreadPool {
 public:
  // LOOM_NUM_THREADS overrides the hardware concurrency.
  static ThreadPool& instance() {
    static ThreadPool pool(default_threads());
    return pool;
  }

  explicit ThreadPool(size_t threads) : size_(std::max<size_t>(1, threads)) {
    for (size_t i = 1; i < size_; ++i) workers_.emplace_back([this, i] { worker(i); });
  }
  ~ThreadPool() {
    {
      const std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    start_cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  [[nodiscard]] size_t size() const { return size_; }

  // Calls fn(begin, end) on disjoint blocks covering [0, n), blocks aligned to `grain`
  // elements, using up to size() threads (the caller is one of them). Runs inline when the
  // work is small. fn must not throw. Not reentrant: one parallel_for at a time per pool.
  void parallel_for(size_t n, size_t grain, const std::function<void(size_t, size_t)>& fn) {
    grain = std::max<size_t>(1, grain);
    const size_t blocks = (n + grain - 1) / grain;
    const size_t parts = std::min(size_, blocks);
    if (parts <= 1) {
      if (n > 0) fn(0, n);
      return;
    }
    const std::lock_guard<std::mutex> call_lock(call_mu_);
    const size_t per = (blocks + parts - 1) / parts * grain;
    {
      const std::lock_guard<std::mutex> lock(mu_);
      job_ = &fn;
      job_n_ = n;
      job_per_ = per;
      job_parts_ = parts;
      pending_ = parts - 1;
      ++generation_;
    }
    start_cv_.notify_all();
    fn(0, std::min(n, per));  // the caller takes part 0
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [this] { return pending_ == 0; });
    job_ = nullptr;
  }

 private:
  static size_t default_threads() {
    if (const char* env = std::getenv("LOOM_NUM_THREADS"); env != nullptr && *env != '\0') {
      const long v = std::strtol(env, nullptr, 10);
      if (v > 0) return static_cast<size_t>(v);
    }
    return std::max<unsigned>(1, std::thread::hardware_concurrency());
  }

  void worker(size_t index) {
    size_t seen = 0;
    for (;;) {
      const std::function<void(size_t, size_t)>* job = nullptr;
      size_t begin = 0;
      size_t end = 0;
      {
        std::unique_lock<std::mutex> lock(mu_);
        start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        if (index >= job_parts_) continue;  // this call needs fewer threads
        job = job_;
        begin = std::min(job_n_, index * job_per_);
        end = std::min(job_n_, begin + job_per_);
      }
      if (begin < end) (*job)(begin, end);
      {
        const std::lock_guard<std::mutex> lock(mu_);
        if (--pending_ == 0) done_cv_.notify_one();
      }
    }
  }

  size_t size_;
  std::vector<std::thread> workers_;
  std::mutex call_mu_;
  std::mutex mu_;
  std::condition_variable start_cv_;
  std::condition_variable done_cv_;
  const std::function<void(size_t, size_t)>* job_ = nullptr;
  size_t job_n_ = 0;
  size_t job_per_ = 0;
  size_t job_parts_ = 0;
  size_t pending_ = 0;
  size_t generation_ = 0;
  bool stop_ = false;
};

// parallel_for on the library's pool.
inline void parallel_for(size_t n, size_t grain, const std::function<void(size_t, size_t)>& fn) {
  ThreadPool::instance().parallel_for(n, grain, fn);
}

}  // namespace loom::plugins
