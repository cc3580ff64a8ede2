// CUDA emulation (tests/cuda_emulation, LOOM_CUDA_EMULATION=ON): the device side of CUDA for
// .cu files compiled as C++ on the CPU. A verification tool, not NVIDIA's header: only what
// Loom's kernels use. rewrite_launches.py turns k<<<grid, block, smem, stream>>>(args) into
// emu::launch(coop, "k", k, grid, block, smem, stream, args). The kernel is queued on its
// stream and runs when the stream is drained (a synchronization point, see cudart.cpp).
// Plain kernels (coop == false) run their threads one after another on one OS thread;
// cooperative ones (the rewriter found __syncthreads, warp shuffles or __shared__ in them or
// in what they call) run one OS thread per CUDA thread of a block, a std::barrier for
// __syncthreads, blocks one after another. Launch checks: pointer arguments must be device
// memory of the current device; 1-D launches without dynamic shared memory only.
// EMU_CUDA_BLOCK_ORDER=reverse (read at every launch, so a test may set it between launches)
// runs the blocks last to first: results that depend on block order (float atomics, a
// reduction racing across blocks) then change, as they could on a GPU.
#pragma once
#include <math.h>
#include <atomic>
#include <barrier>
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

namespace emu {
inline std::barrier<>* g_bar = nullptr;
inline std::vector<uint64_t> g_slots;  // warp-shuffle exchange, one slot per thread of a block
inline const char* g_kernel = "";
}  // namespace emu

inline void __syncthreads() {
  if (emu::g_bar == nullptr) {
    emu::report("kernel %s called __syncthreads but was launched sequentially (emulation)",
                emu::g_kernel);
    std::abort();
  }
  emu::g_bar->arrive_and_wait();
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
      g_bar = nullptr;
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
    std::barrier<> bar(static_cast<std::ptrdiff_t>(block.x));
    g_bar = &bar;
    g_slots.assign(block.x, 0);
    std::vector<std::thread> ts;
    ts.reserve(block.x);
    for (unsigned t = 0; t < block.x; ++t) {
      ts.emplace_back([&, t] {
        threadIdx = dim3(t, 0, 0);
        for (unsigned b = 0; b < grid.x; ++b) {
          blockIdx = dim3(reverse ? grid.x - 1 - b : b, 0, 0);
          std::apply(k, args);
          bar.arrive_and_wait();  // the block is done before the next one starts (shared memory)
        }
      });
    }
    for (auto& th : ts) th.join();
    g_bar = nullptr;
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
