// parallel_for for plugin kernels, on the host's one thread pool (loom_host_services
// .parallel_for, ABI 1.2), so no plugin starts threads of its own:
//
//   loom::sdk::parallel_for(n, grain, [&](std::size_t begin, std::size_t end) { ... });
//
// Kernels need no Context: every instance a 1.2 host creates through loom::sdk::factory<T>()
// registers its host's pool with this library for the instance's lifetime, and
// parallel_for uses the pool of the oldest live registration. With none (no live instance,
// or only instances of a 1.0/1.1 host, which has no pool to offer) the range runs inline on
// the calling thread: a pool of the plugin's own would outlive the instances that started it
// and compete with the host's for the cores. Registrations are counted per library and are
// safe to add, use and drop from any thread, with several hosts or sessions alive at once.
#ifndef LOOM_SDK_PARALLEL_HPP
#define LOOM_SDK_PARALLEL_HPP

#include <loom/abi.h>
#include <loom/sdk/status.hpp>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <list>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <type_traits>
#include <utility>

namespace loom::sdk {

// The body a pool calls: the ABI's signature.
using ParallelBody = void (*)(void* ctx, std::size_t begin, std::size_t end);

// A thread pool as the ABI offers it: loom_host_services.parallel_for and .thread_count with
// the host_ctx they take. Empty (parallel_for NULL) for a host older than ABI 1.2.
struct Pool {
  loom_status* (*parallel_for)(void* host_ctx, std::size_t n, std::size_t grain, ParallelBody body,
                               void* body_ctx) = nullptr;
  std::size_t (*thread_count)(void* host_ctx) = nullptr;
  void* host_ctx = nullptr;

  explicit operator bool() const { return parallel_for != nullptr; }
};

// The pool a host's services offer; empty when its table predates the fields (1.0/1.1).
inline Pool host_pool(const loom_host_services* host) noexcept {
  Pool p;
  if (host == nullptr || host->struct_size < LOOM_STRUCT_SIZE(loom_host_services, thread_count)) {
    return p;
  }
  p.parallel_for = host->parallel_for;
  p.thread_count = host->thread_count;
  p.host_ctx = host->host_ctx;
  return p;
}

namespace detail {

// This library's registered pools, oldest first. Leaked on purpose: kernels may run from
// static destructors at exit.
struct PoolRegistry {
  std::shared_mutex mu;
  std::list<Pool> pools;

  static PoolRegistry& get() {
    static PoolRegistry* registry = new PoolRegistry();  // NOLINT(cppcoreguidelines-owning-memory)
    return *registry;
  }
};

// Depth of parallel_for bodies running on this thread: a nested call runs inline.
inline thread_local int t_body_depth = 0;

template <class Fn>
struct BodyCall {
  Fn* fn;
  std::mutex mu;
  std::exception_ptr error;

  // The trampoline the pool calls: runs fn, keeps the first exception for the caller.
  static void run(void* ctx, std::size_t begin, std::size_t end) noexcept {
    auto* self = static_cast<BodyCall*>(ctx);
    ++t_body_depth;
    try {
      (*self->fn)(begin, end);
    } catch (...) {
      const std::lock_guard<std::mutex> lock(self->mu);
      if (!self->error) self->error = std::current_exception();
    }
    --t_body_depth;
  }
};

// Calls fn(begin, end) inline for the whole range, as one block.
template <class Fn>
void run_inline(std::size_t n, Fn& fn) {
  ++t_body_depth;
  try {
    fn(std::size_t{0}, n);
  } catch (...) {
    --t_body_depth;
    throw;
  }
  --t_body_depth;
}

}  // namespace detail

// Registers `pool` with this library while the object lives (the SDK makes one for every
// instance it creates; a program that links plugin kernels directly can make its own).
// Movable, not copyable.
class PoolRegistration {
 public:
  PoolRegistration() = default;
  explicit PoolRegistration(const Pool& pool) {
    if (!pool) return;
    auto& r = detail::PoolRegistry::get();
    const std::unique_lock<std::shared_mutex> lock(r.mu);
    it_ = r.pools.insert(r.pools.end(), pool);
    active_ = true;
  }
  explicit PoolRegistration(const loom_host_services* host) : PoolRegistration(host_pool(host)) {}
  PoolRegistration(PoolRegistration&& other) noexcept
      : it_(other.it_), active_(std::exchange(other.active_, false)) {}
  PoolRegistration& operator=(PoolRegistration&& other) noexcept {
    if (this != &other) {
      reset();
      it_ = other.it_;
      active_ = std::exchange(other.active_, false);
    }
    return *this;
  }
  PoolRegistration(const PoolRegistration&) = delete;
  PoolRegistration& operator=(const PoolRegistration&) = delete;
  ~PoolRegistration() { reset(); }

  explicit operator bool() const { return active_; }

  // Drops the registration; waits for parallel_for calls using it to return.
  void reset() noexcept {
    if (!active_) return;
    auto& r = detail::PoolRegistry::get();
    const std::unique_lock<std::shared_mutex> lock(r.mu);
    r.pools.erase(it_);
    active_ = false;
  }

 private:
  std::list<Pool>::iterator it_{};
  bool active_ = false;
};

// Calls fn(begin, end) on disjoint blocks covering [0, n), each beginning at a multiple of
// `grain` (0 = 1), on the host's pool; the calling thread runs one block. Returns when all
// have. The whole range may come as one block (0, n): always when nested inside another
// parallel_for body, when another thread's call is using the pool, and when no 1.2 host's
// pool is registered. The first exception a block throws is rethrown here once every block
// has returned; a pool error is thrown as Error.
template <class Fn>
void parallel_for(std::size_t n, std::size_t grain, Fn&& fn) {
  static_assert(std::is_invocable_v<Fn&, std::size_t, std::size_t>,
                "parallel_for needs a callable taking (std::size_t begin, std::size_t end)");
  if (n == 0) return;
  if (detail::t_body_depth > 0) {
    detail::run_inline(n, fn);
    return;
  }
  auto& r = detail::PoolRegistry::get();
  std::shared_lock<std::shared_mutex> lock(r.mu);
  if (r.pools.empty()) {
    lock.unlock();
    detail::run_inline(n, fn);
    return;
  }
  // The registration, and so its host_ctx, stays valid while the shared lock is held.
  const Pool& pool = r.pools.front();
  using F = std::remove_reference_t<Fn>;
  detail::BodyCall<F> call{&fn, {}, {}};
  loom_status* status =
      pool.parallel_for(pool.host_ctx, n, grain, &detail::BodyCall<F>::run, &call);
  lock.unlock();
  if (call.error) {
    if (status != nullptr && status->destroy != nullptr) status->destroy(status);
    std::rethrow_exception(call.error);
  }
  check(status, "host parallel_for");
}

// fn over [0, n) through a parallel_for of the embedding API's shape, for a program that
// embeds libloom and runs its own loops on the process's pool:
//   loom::sdk::parallel_for_on(loom_parallel_for, n, grain, fn);   // <loom/embed.h>
// Exceptions as in parallel_for; a non-zero code from `c_parallel_for` is thrown as Error.
template <class Fn>
void parallel_for_on(int32_t (*c_parallel_for)(std::size_t n, std::size_t grain, ParallelBody body,
                                               void* ctx),
                     std::size_t n, std::size_t grain, Fn&& fn) {
  static_assert(std::is_invocable_v<Fn&, std::size_t, std::size_t>,
                "parallel_for_on needs a callable taking (std::size_t begin, std::size_t end)");
  if (c_parallel_for == nullptr) throw Error(LOOM_ERR_INVALID_ARGUMENT, "parallel_for_on: NULL");
  if (n == 0) return;
  using F = std::remove_reference_t<Fn>;
  detail::BodyCall<F> call{&fn, {}, {}};
  const int32_t code = c_parallel_for(n, grain, &detail::BodyCall<F>::run, &call);
  if (call.error) std::rethrow_exception(call.error);
  if (code != LOOM_OK) {
    throw Error(code > LOOM_OK && code <= LOOM_ERR_INTERNAL ? static_cast<loom_code>(code)
                                                            : LOOM_ERR_INTERNAL,
                "parallel_for_on: the pool returned code " + std::to_string(code));
  }
}

// The threads parallel_for may use, the caller's included: the registered pool's, else 1.
inline std::size_t thread_count() {
  auto& r = detail::PoolRegistry::get();
  const std::shared_lock<std::shared_mutex> lock(r.mu);
  if (r.pools.empty() || r.pools.front().thread_count == nullptr) return 1;
  const Pool& pool = r.pools.front();
  const std::size_t n = pool.thread_count(pool.host_ctx);
  return n > 0 ? n : 1;
}

}  // namespace loom::sdk

#endif  // LOOM_SDK_PARALLEL_HPP
