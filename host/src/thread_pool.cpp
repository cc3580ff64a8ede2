#include "thread_pool.hpp"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <exception>

namespace loom::host {
namespace {

// Set on pool workers for their whole life, and on a caller while it runs its block.
thread_local bool t_inside_body = false;

class InsideBody {
 public:
  InsideBody() : saved_(t_inside_body) { t_inside_body = true; }
  ~InsideBody() { t_inside_body = saved_; }
  InsideBody(const InsideBody&) = delete;
  InsideBody& operator=(const InsideBody&) = delete;

 private:
  bool saved_;
};

// A positive decimal integer, the whole string; 0 when it is not one.
long parse_count(const char* text) {
  if (text == nullptr || *text < '0' || *text > '9') return 0;
  errno = 0;
  char* end = nullptr;
  const long v = std::strtol(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0') return 0;
  return v;
}

size_t available_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return static_cast<size_t>(n);
  }
  return std::max(1U, std::thread::hardware_concurrency());
}

}  // namespace

size_t ThreadPool::default_threads(std::string* warning) {
  if (const char* env = std::getenv("LOOM_NUM_THREADS"); env != nullptr && *env != '\0') {
    const long v = parse_count(env);
    if (v >= 1 && static_cast<size_t>(v) <= kMaxThreads) return static_cast<size_t>(v);
    if (warning != nullptr) {
      *warning = "LOOM_NUM_THREADS='" + std::string(env) + "' is not a thread count in 1.." +
                 std::to_string(kMaxThreads) + "; using the default";
    }
  }
  // Under a launcher, the ranks on this machine share its cores (Open MPI, MPICH, torchrun).
  long local_ranks = 1;
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "LOCAL_WORLD_SIZE"}) {
    const long v = parse_count(std::getenv(name));
    if (v > 0) {
      local_ranks = v;
      break;
    }
  }
  const size_t cores = available_cores();
  return std::clamp<size_t>(cores / static_cast<size_t>(local_ranks), 1, kMaxThreads);
}

ThreadPool& ThreadPool::process() {
  // Never destroyed: a plugin's static destructor may still run a kernel at exit. Its workers
  // are joined at exit (close), after which calls run inline.
  static ThreadPool* pool = [] {
    std::string warning;
    const size_t n = default_threads(&warning);
    if (!warning.empty()) std::fprintf(stderr, "loom: %s: %zu\n", warning.c_str(), n);
    auto* p = new ThreadPool(n);  // NOLINT(cppcoreguidelines-owning-memory)
    std::atexit([] { ThreadPool::process().close(); });
    return p;
  }();
  return *pool;
}

void ThreadPool::close() {
  // From inside a body (exit called by a kernel) the call in flight is this thread's own.
  if (t_inside_body) return;
  const std::unique_lock<std::mutex> call(call_mu_, std::try_to_lock);
  if (!call.owns_lock()) return;  // another thread's call is in flight: leave its threads be
  stop_locked();
  closed_ = true;
}

ThreadPool::ThreadPool(size_t threads) : size_(std::clamp<size_t>(threads, 1, kMaxThreads)) {}

ThreadPool::~ThreadPool() {
  const std::lock_guard<std::mutex> call(call_mu_);
  stop_locked();
}

size_t ThreadPool::size() const {
  const std::lock_guard<std::mutex> lock(mu_);
  return size_;
}

bool ThreadPool::inside_body() { return t_inside_body; }

void ThreadPool::start_locked() {
  if (workers_.size() + 1 >= size_) return;
  uint64_t generation = 0;
  {
    const std::lock_guard<std::mutex> lock(mu_);
    stop_ = false;
    generation = generation_;
  }
  try {
    workers_.reserve(size_ - 1);
    for (size_t i = workers_.size() + 1; i < size_; ++i) {
      workers_.emplace_back([this, i, generation] { worker(i, generation); });
    }
  } catch (const std::exception& e) {
    // No more threads (a process limit): the pool keeps the ones it has.
    std::fprintf(stderr, "loom: the thread pool could start only %zu of %zu threads: %s\n",
                 workers_.size() + 1, size_, e.what());
    const std::lock_guard<std::mutex> lock(mu_);
    size_ = workers_.size() + 1;
  }
}

void ThreadPool::stop_locked() {
  {
    const std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (auto& t : workers_) t.join();
  workers_.clear();
}

bool ThreadPool::resize(size_t threads) {
  if (t_inside_body) return false;
  if (threads == 0) {
    std::string warning;
    threads = default_threads(&warning);
    if (!warning.empty()) {
      std::fprintf(stderr, "loom: %s: %zu\n", warning.c_str(), threads);
    }
  }
  threads = std::clamp<size_t>(threads, 1, kMaxThreads);
  const std::lock_guard<std::mutex> call(call_mu_);
  stop_locked();
  const std::lock_guard<std::mutex> lock(mu_);
  size_ = threads;
  return true;
}

void ThreadPool::parallel_for(size_t n, size_t grain, ParallelBody body, void* ctx) {
  if (n == 0 || body == nullptr) return;
  grain = std::max<size_t>(1, grain);
  const size_t blocks = n / grain + (n % grain != 0 ? 1 : 0);
  if (t_inside_body || blocks <= 1) {
    body(ctx, 0, n);  // nested, or one block: inline
    return;
  }
  std::unique_lock<std::mutex> call(call_mu_, std::try_to_lock);
  if (!call.owns_lock() || size_ <= 1 || closed_) {
    // Another thread's call holds the workers (or there are none): run it here, marked as
    // inside a body so that what it nests runs inline too.
    const InsideBody mark;
    body(ctx, 0, n);
    return;
  }
  start_locked();
  const size_t threads = std::min(size_, blocks);
  const size_t per_blocks = blocks / threads + (blocks % threads != 0 ? 1 : 0);
  const size_t parts = blocks / per_blocks + (blocks % per_blocks != 0 ? 1 : 0);
  const size_t per = per_blocks * grain;  // <= n: per_blocks < blocks when parts > 1
  {
    const std::lock_guard<std::mutex> lock(mu_);
    body_ = body;
    ctx_ = ctx;
    n_ = n;
    per_ = per;
    parts_ = parts;
    pending_ = parts - 1;
    ++generation_;
  }
  start_cv_.notify_all();
  {
    const InsideBody mark;
    body(ctx, 0, per);  // the caller runs block 0
  }
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [this] { return pending_ == 0; });
  body_ = nullptr;
  ctx_ = nullptr;
}

void ThreadPool::worker(size_t index, uint64_t generation) {
  t_inside_body = true;
  pthread_setname_np(pthread_self(), "loom-pool");  // what `top -H` and /proc/*/task show
  // The generation before the first call this worker takes part in: it is started (under
  // call_mu_) before that call publishes its job.
  uint64_t seen = generation;
  for (;;) {
    ParallelBody body = nullptr;
    void* ctx = nullptr;
    size_t begin = 0;
    size_t end = 0;
    {
      std::unique_lock<std::mutex> lock(mu_);
      start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      if (index >= parts_) continue;  // this call has fewer blocks than threads
      body = body_;
      ctx = ctx_;
      // index < parts_, so index * per_ < n_ (see parallel_for).
      begin = index * per_;
      end = n_ - begin > per_ ? begin + per_ : n_;
    }
    body(ctx, begin, end);
    {
      const std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }
}

}  // namespace loom::host
