// CUDA emulation (tests/cuda_emulation, LOOM_CUDA_EMULATION=ON): the device side of CUDA for
// .cu files compiled as C++ on the CPU. A verification tool, not NVIDIA's header: only what
// Loom's kernels use. rewrite_launches.py turns k<<<grid, block, smem, stream>>>(args) into
// emu::launch(coop, "k", k, grid, block, smem, stream, args). The kernel is queued on its
// stream and runs when the stream is drained (a synchronization point, see cudart.cpp).
// Plain kernels (coop == false) run their threads one after another on one OS thread;
// cooperative ones (the rewriter found __syncthreads, warp shuffles or __shared__ in them or
// in what they call) run one fiber (ucontext, its own stack) per CUDA thread of a block on
// the launching OS thread, blocks one after another: each round resumes every unfinished
// thread in threadIdx order until its next __syncthreads or its end, so a round is one
// barrier phase (a thread that has returned no longer takes part, as on the GPU). Fibers,
// not OS threads: a barrier phase costs a switch per thread in user space instead of waking
// every thread of the block through the kernel. Launch checks: pointer arguments must be
// device memory of the current device; 1-D launches without dynamic shared memory only.
// EMU_CUDA_BLOCK_ORDER=reverse (read at every launch, so a test may set it between launches)
// runs the blocks last to first, and a cooperative block's threads last to first within
// each barrier phase: results that depend on block order (float atomics, a reduction racing
// across blocks) or on the order of a block's threads (a missing __syncthreads) then change,
// as they could on a GPU.
#pragma once
#include <math.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cuda_runtime_api.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

inline thread_local dim3 threadIdx{0, 0, 0};
inline thread_local dim3 blockIdx{0, 0, 0};
inline dim3 blockDim;
inline dim3 gridDim;

// AddressSanitizer's fiber annotations (weak: null without ASan), so it knows which stack
// runs after each switch.
extern "C" void __sanitizer_start_switch_fiber(void** fake_stack_save, const void* bottom,
                                               size_t size) __attribute__((weak));
extern "C" void __sanitizer_finish_switch_fiber(void* fake_stack_save, const void** bottom_old,
                                                size_t* size_old) __attribute__((weak));

namespace emu {

// One CUDA thread of a cooperative block.
struct Fiber {
  ucontext_t ctx;
  void* fake = nullptr;  // ASan's fake stack of this fiber while it is switched out
  bool done = false;
};

// The cooperative launch running on this OS thread (kernels run one at a time: the runtime
// drains streams under its lock).
struct Coop {
  // Per CUDA thread, a guard page below. Small on purpose: ASan clears the shadow of the
  // whole stack at every switch into a fiber, so its size is paid per thread and barrier.
  static constexpr size_t kStack = 64 * 1024;
  ucontext_t main;
  void* main_fake = nullptr;
  const void* main_bottom = nullptr;
  size_t main_size = 0;
  std::vector<Fiber> fibers;
  std::vector<char*> stacks;  // kept across launches (mmap'd, reused)
  unsigned current = 0;
  void (*body)(void*) = nullptr;
  void* arg = nullptr;
  bool active = false;
};
inline thread_local Coop g_coop;
inline std::vector<uint64_t> g_slots;  // warp-shuffle exchange, one slot per thread of a block
inline const char* g_kernel = "";

inline void to_main(Fiber& f, bool finished) {
  Coop& c = g_coop;
  if (__sanitizer_start_switch_fiber != nullptr) {
    __sanitizer_start_switch_fiber(finished ? nullptr : &f.fake, c.main_bottom, c.main_size);
  }
  swapcontext(&f.ctx, &c.main);
  if (__sanitizer_finish_switch_fiber != nullptr) {
    __sanitizer_finish_switch_fiber(f.fake, &c.main_bottom, &c.main_size);
  }
}

inline void fiber_entry() {
  Coop& c = g_coop;
  if (__sanitizer_finish_switch_fiber != nullptr) {
    __sanitizer_finish_switch_fiber(nullptr, &c.main_bottom, &c.main_size);
  }
  c.body(c.arg);
  Fiber& f = c.fibers[c.current];
  f.done = true;
  to_main(f, true);  // never resumed
}

// Runs body(arg) as `threads` cooperating CUDA threads (threadIdx set per fiber) to the end;
// `reverse`: each round resumes them last to first.
inline void run_block(unsigned threads, bool reverse, void (*body)(void*), void* arg);

}  // namespace emu

inline void __syncthreads() {
  emu::Coop& c = emu::g_coop;
  if (!c.active) {
    emu::report("kernel %s called __syncthreads but was launched sequentially (emulation)",
                emu::g_kernel);
    std::abort();
  }
  emu::to_main(c.fibers[c.current], false);
}

inline void emu::run_block(unsigned threads, bool reverse, void (*body)(void*), void* arg) {
  Coop& c = g_coop;
  const size_t page = 4096;
  while (c.stacks.size() < threads) {
    void* m = mmap(nullptr, Coop::kStack + page, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) {
      report("kernel %s: no memory for the stack of emulated thread %zu", g_kernel,
             c.stacks.size());
      std::abort();
    }
    mprotect(m, page, PROT_NONE);  // an overflow faults instead of corrupting a neighbour
    c.stacks.push_back(static_cast<char*>(m) + page);
  }
  c.fibers.assign(threads, Fiber{});
  c.body = body;
  c.arg = arg;
  c.active = true;
  for (unsigned t = 0; t < threads; ++t) {
    Fiber& f = c.fibers[t];
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = c.stacks[t];
    f.ctx.uc_stack.ss_size = Coop::kStack;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_entry, 0);
  }
  bool more = true;
  while (more) {  // one round = one barrier phase
    more = false;
    for (unsigned i = 0; i < threads; ++i) {
      const unsigned t = reverse ? threads - 1 - i : i;
      Fiber& f = c.fibers[t];
      if (f.done) continue;
      c.current = t;
      threadIdx = dim3(t, 0, 0);
      if (__sanitizer_start_switch_fiber != nullptr) {
        __sanitizer_start_switch_fiber(&c.main_fake, c.stacks[t], Coop::kStack);
      }
      swapcontext(&c.main, &f.ctx);
      if (__sanitizer_finish_switch_fiber != nullptr) {
        __sanitizer_finish_switch_fiber(c.main_fake, nullptr, nullptr);
      }
      if (!f.done) more = true;
    }
  }
  c.active = false;
  threadIdx = dim3(0, 0, 0);
}

template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  static_assert(sizeof(T) <= 8);
  if (mask != 0xffffffffu) {
    emu::report("kernel %s: __shfl_down_sync with a partial mask (not emulated)", emu::g_kernel);
    std::abort();
  }
  const unsigned tid = threadIdx.x;
  std::memcpy(&emu::g_slots[tid], &v, sizeof(T));
  __syncthreads();
  const unsigned lane = tid % 32u;
  const unsigned w = static_cast<unsigned>(width);
  unsigned src = tid;
  if ((lane % w) + delta < w && tid + delta < blockDim.x) src = tid + delta;
  T r;
  std::memcpy(&r, &emu::g_slots[src], sizeof(T));
  __syncthreads();
  return r;
}

// The flags of the calling thread's warp (the threads of the block that exist), as a bit mask.
// Emulated with two block barriers, so here it is a block-wide barrier (on a GPU only the
// warp's lanes meet): call it where every thread of the block does, as Loom's kernels do.
inline unsigned __ballot_sync(unsigned mask, int predicate) {
  if (mask != 0xffffffffu) {
    emu::report("kernel %s: __ballot_sync with a partial mask (not emulated)", emu::g_kernel);
    std::abort();
  }
  const unsigned tid = threadIdx.x;
  emu::g_slots[tid] = predicate != 0 ? 1u : 0u;
  __syncthreads();
  const unsigned first = tid - tid % 32u;
  unsigned bits = 0;
  for (unsigned t = first; t < first + 32u && t < blockDim.x; ++t) {
    if (emu::g_slots[t] != 0) bits |= 1u << (t - first);
  }
  __syncthreads();
  return bits;
}
inline int __popc(unsigned v) { return __builtin_popcount(v); }

struct alignas(16) float4 {
  float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline uint32_t __float_as_uint(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline long long __double_as_longlong(double d) {
  long long v;
  std::memcpy(&v, &d, 8);
  return v;
}
inline float __uint_as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline int min(int a, int b) { return a < b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned long min(unsigned long a, unsigned long b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long max(unsigned long a, unsigned long b) { return a > b ? a : b; }

inline double atomicAdd(double* p, double v) { return std::atomic_ref<double>(*p).fetch_add(v); }
inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }
inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  return std::atomic_ref<unsigned>(*p).fetch_add(v);
}
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return std::atomic_ref<unsigned long long>(*p).fetch_add(v);
}

inline unsigned long long atomicMin(unsigned long long* p, unsigned long long v) {
  std::atomic_ref<unsigned long long> a(*p);
  unsigned long long old = a.load();
  while (v < old && !a.compare_exchange_weak(old, v)) {
  }
  return old;
}

namespace emu {

// Pointer arguments (not pointers inside struct arguments) must be device memory of the
// current device.
template <class T>
void check_ptr_arg(const char* kernel, int index, const T& v) {
  if constexpr (std::is_pointer_v<T>) {
    if (v == nullptr) return;
    const int d = device_of(static_cast<const void*>(v));
    if (d < 0) {
      report("kernel %s: pointer argument %d (%p) is not device memory", kernel, index,
             static_cast<const void*>(v));
    } else if (d != current_device()) {
      report("kernel %s: pointer argument %d lives on device %d, launched on device %d", kernel,
             index, d, current_device());
    }
  }
}

// grid / block as written in <<<...>>>: a dim3 or any integer (converted as nvcc does).
inline dim3 to_dim3(const char*, dim3 d) { return d; }
// A negative or too large integer (which nvcc would truncate) is reported and becomes 0, an
// invalid configuration.
template <class T>
requires std::is_integral_v<T> dim3 to_dim3(const char* kernel, T n) {
  bool fits = static_cast<unsigned long long>(n) <= 0xffffffffull;
  if constexpr (std::is_signed_v<T>) fits = n >= 0 && fits;
  if (!fits) {
    report("kernel %s: grid or block size %lld does not fit a dim3", kernel,
           static_cast<long long>(n));
    return dim3(0);
  }
  return dim3(static_cast<unsigned>(n));
}

template <class Tuple, std::size_t... I>
void check_args(const char* kernel, const Tuple& t, std::index_sequence<I...>) {
  (check_ptr_arg(kernel, static_cast<int>(I), std::get<I>(t)), ...);
}

template <class G, class B, class... P, class... A>
void launch(bool coop, const char* name, void (*k)(P...), G grid_arg, B block_arg, size_t smem,
            cudaStream_t s, A&&... a) {
  const dim3 grid = to_dim3(name, grid_arg);
  const dim3 block = to_dim3(name, block_arg);
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || block.x == 0 || block.x > 1024 || grid.y != 1 ||
      grid.z != 1 || block.y != 1 || block.z != 1 || grid.x > 0x7fffffffu || smem != 0) {
    report("kernel %s: launch configuration <<<%u, %u, %zu>>> invalid or not emulated", name,
           grid.x, block.x, smem);
    set_last_error(cudaErrorInvalidConfiguration);
    return;
  }
  std::tuple<std::decay_t<P>...> args(std::forward<A>(a)...);
  check_args(name, args, std::index_sequence_for<P...>{});
  const char* order = std::getenv("EMU_CUDA_BLOCK_ORDER");
  const bool reverse = order != nullptr && std::strcmp(order, "reverse") == 0;
  enqueue_kernel(s, name, [=]() {
    g_kernel = name;
    gridDim = grid;
    blockDim = block;
    if (!coop) {
      for (unsigned b = 0; b < grid.x; ++b) {
        blockIdx = dim3(reverse ? grid.x - 1 - b : b, 0, 0);
        for (unsigned t = 0; t < block.x; ++t) {
          threadIdx = dim3(t, 0, 0);
          std::apply(k, args);
        }
      }
      blockIdx = dim3(0, 0, 0);
      threadIdx = dim3(0, 0, 0);
      return;
    }
    g_slots.assign(block.x, 0);
    auto body = [&]() { std::apply(k, args); };
    for (unsigned b = 0; b < grid.x; ++b) {
      // The block is done before the next one starts (shared memory).
      blockIdx = dim3(reverse ? grid.x - 1 - b : b, 0, 0);
      run_block(
          block.x, reverse, [](void* p) { (*static_cast<decltype(body)*>(p))(); }, &body);
    }
    blockIdx = dim3(0, 0, 0);
  });
}

}  // namespace emu

// The C++ overloads of cuda_runtime.h.
template <class T>
inline cudaError_t cudaMalloc(T** p, size_t bytes) {
  return ::cudaMalloc(reinterpret_cast<void**>(p), bytes);
}
template <class T>
inline cudaError_t cudaMallocAsync(T** p, size_t bytes, cudaStream_t s) {
  return ::cudaMallocAsync(reinterpret_cast<void**>(p), bytes, s);
}
