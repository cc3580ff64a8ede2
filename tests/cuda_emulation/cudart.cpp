// CUDA emulation (tests/cuda_emulation, LOOM_CUDA_EMULATION=ON): a CPU stand-in for libcudart
// (include/cuda_runtime_api.h), built as libloom_cuda_emulation.so. A verification tool for CI
// without a GPU; see docs/gpu.md for what it checks and what it cannot.
// Devices: EMU_CUDA_DEVICES (default 1). Device memory: host heap, poisoned (0xFF: NaN).
// Streams: per-stream FIFO queues of kernels / device-side copies / memsets, run when the
// stream (or device) is synchronized, so results read without synchronization are stale.
// Pageable host<->device copies behave as CUDA documents them for pageable memory: the
// stream is drained first and the copy is done before the call returns.
// Problems (kind/pointer mismatch, out-of-allocation copies, cross-device launches, unknown
// streams) are printed as "EMU-CUDA:" lines and counted; EMU_CUDA_ABORT=1 aborts on them.
#include "cuda_runtime_api.h"

#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <string>

extern "C" void __sanitizer_print_stack_trace() __attribute__((weak));

namespace {

struct Op {
  std::function<void()> fn;
  std::string what;
};

}  // namespace

struct CUstream_st {
  int device;
  unsigned flags;
  bool legacy;
  std::deque<Op> q;
  uint64_t enqueued = 0;  // ops ever enqueued
  uint64_t done = 0;      // ops ever run
};
struct CUevent_st {
  CUstream_st* stream = nullptr;
  uint64_t seq = 0;
  bool recorded = false;
  int device = 0;
};

namespace {

std::recursive_mutex g_mu;
thread_local int t_device = 0;
thread_local cudaError_t t_last = cudaSuccess;
std::map<uintptr_t, std::pair<size_t, int>> g_allocs;  // base -> (bytes, device)
std::set<CUstream_st*> g_streams;
std::set<CUevent_st*> g_events;
std::map<int, CUstream_st*> g_legacy;
std::atomic<int> g_problems{0};
std::mutex g_print_mu;

int ndev() {
  static int n = [] {
    const char* e = std::getenv("EMU_CUDA_DEVICES");
    return e != nullptr ? std::atoi(e) : 1;
  }();
  return n;
}

bool sync_mode() {
  static bool s = std::getenv("EMU_CUDA_SYNC") != nullptr;
  return s;
}

void vreport(const char* fmt, va_list ap) {
  std::lock_guard plk(g_print_mu);
  std::fprintf(stderr, "EMU-CUDA: ");
  std::vfprintf(stderr, fmt, ap);
  std::fprintf(stderr, "\n");
  ++g_problems;
  if (__sanitizer_print_stack_trace != nullptr) __sanitizer_print_stack_trace();
  if (std::getenv("EMU_CUDA_ABORT") != nullptr) std::abort();
}

void rep(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vreport(fmt, ap);
  va_end(ap);
}

cudaError_t fail(cudaError_t e) {
  t_last = e;
  return e;
}

// Allocation containing [p, p + bytes) -> device; -1 host; -2 partially inside (overrun).
int lookup(const void* p, size_t bytes, size_t* avail = nullptr) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  auto it = g_allocs.upper_bound(a);
  if (it == g_allocs.begin()) return -1;
  --it;
  const uintptr_t base = it->first;
  const size_t size = it->second.first;
  if (a >= base + (size == 0 ? 1 : size)) return -1;
  if (avail) *avail = base + size - a;
  if (a + bytes > base + size) return -2;
  return it->second.second;
}

CUstream_st* legacy(int dev) {
  auto& s = g_legacy[dev];
  if (s == nullptr) s = new CUstream_st{dev, 0, true, {}, 0, 0};
  return s;
}

// Resolves a handle; nullptr = the current device's legacy default stream.
CUstream_st* resolve(cudaStream_t s, const char* what) {
  if (s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread) return legacy(t_device);
  if (g_streams.count(s) == 0) {
    rep("%s: unknown or destroyed stream %p", what, static_cast<void*>(s));
    return nullptr;
  }
  return s;
}

void run_one(CUstream_st* s) {
  Op op = std::move(s->q.front());
  s->q.pop_front();
  ++s->done;
  op.fn();
}

void drain(CUstream_st* s, uint64_t upto = UINT64_MAX) {
  while (!s->q.empty() && s->done < upto) run_one(s);
}

void drain_device(int dev) {
  bool more = true;
  while (more) {
    more = false;
    for (auto* s : g_streams)
      if (s->device == dev && !s->q.empty()) {
        drain(s);
        more = true;
      }
    if (auto it = g_legacy.find(dev); it != g_legacy.end() && !it->second->q.empty()) {
      drain(it->second);
      more = true;
    }
  }
}

// Implicit synchronization of the legacy default stream with blocking streams.
void before_enqueue(CUstream_st* s) {
  if (s->legacy) {
    for (auto* o : g_streams)
      if (o->device == s->device && (o->flags & cudaStreamNonBlocking) == 0) drain(o);
  } else if ((s->flags & cudaStreamNonBlocking) == 0) {
    drain(legacy(s->device));
  }
}

void enqueue(CUstream_st* s, std::function<void()> fn, const char* what) {
  before_enqueue(s);
  s->q.push_back(Op{std::move(fn), what});
  ++s->enqueued;
  if (sync_mode()) drain(s);
}

bool check_range(const void* p, size_t bytes, bool want_device, const char* what) {
  if (bytes == 0) return true;
  size_t avail = 0;
  const int d = lookup(p, bytes, &avail);
  if (want_device) {
    if (d == -1) {
      rep("%s: %p is not device memory (expected a device pointer)", what, p);
      return false;
    }
    if (d == -2) {
      rep("%s: %zu bytes at %p overrun the device allocation (%zu bytes left)", what, bytes, p,
          avail);
      return false;
    }
  } else if (d != -1) {
    rep("%s: %p is device memory (expected a host pointer)", what, p);
    return false;
  }
  return true;
}

bool is_dev(const void* p) { return lookup(p, 0) != -1; }

cudaError_t do_alloc(void** p, size_t bytes, int dev) {
  if (p == nullptr) return fail(cudaErrorInvalidValue);
  void* m = std::malloc(bytes == 0 ? 1 : bytes);
  if (m == nullptr) return fail(cudaErrorMemoryAllocation);
  std::memset(m, 0xFF, bytes);
  g_allocs[reinterpret_cast<uintptr_t>(m)] = {bytes, dev};
  *p = m;
  return cudaSuccess;
}

cudaError_t do_free_now(void* p, const char* what) {
  auto it = g_allocs.find(reinterpret_cast<uintptr_t>(p));
  if (it == g_allocs.end()) {
    rep("%s: %p is not the start of a live device allocation", what, p);
    return fail(cudaErrorInvalidValue);
  }
  std::memset(p, 0xEE, it->second.first);
  g_allocs.erase(it);
  std::free(p);
  return cudaSuccess;
}

cudaError_t memcpy_checked(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                           const char* what) {
  bool ok = true;
  switch (kind) {
    case cudaMemcpyHostToDevice:
      ok = check_range(dst, bytes, true, what) && check_range(src, bytes, false, what);
      break;
    case cudaMemcpyDeviceToHost:
      ok = check_range(dst, bytes, false, what) && check_range(src, bytes, true, what);
      break;
    case cudaMemcpyDeviceToDevice:
      ok = check_range(dst, bytes, true, what) && check_range(src, bytes, true, what);
      break;
    case cudaMemcpyHostToHost:
      ok = check_range(dst, bytes, false, what) && check_range(src, bytes, false, what);
      break;
    case cudaMemcpyDefault:
      ok = (!is_dev(dst) || check_range(dst, bytes, true, what)) &&
           (!is_dev(src) || check_range(src, bytes, true, what));
      break;
  }
  return ok ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace

namespace emu {
cudaError_t enqueue_kernel(cudaStream_t st, const char* name, std::function<void()> fn) {
  std::lock_guard lk(g_mu);
  CUstream_st* s = resolve(st, name);
  if (s == nullptr) return fail(cudaErrorInvalidResourceHandle);
  if (s->device != t_device) {
    rep("kernel %s launched on a stream of device %d while device %d is current", name, s->device,
        t_device);
    return fail(cudaErrorInvalidResourceHandle);
  }
  enqueue(s, std::move(fn), name);
  return cudaSuccess;
}
int device_of(const void* p) {
  std::lock_guard lk(g_mu);
  const int d = lookup(p, 0);
  return d < 0 ? -1 : d;
}
size_t device_bytes_from(const void* p, int* device) {
  std::lock_guard lk(g_mu);
  size_t avail = 0;
  const int d = lookup(p, 0, &avail);
  if (device != nullptr) *device = d < 0 ? -1 : d;
  return d < 0 ? 0 : avail;
}
void report(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vreport(fmt, ap);
  va_end(ap);
}
void set_last_error(cudaError_t e) { t_last = e; }
int current_device() { return t_device; }
int problems() { return g_problems.load(); }
}  // namespace emu

extern "C" {

cudaError_t cudaGetDeviceCount(int* count) {
  if (count == nullptr) return fail(cudaErrorInvalidValue);
  *count = ndev();
  if (ndev() == 0) return fail(cudaErrorNoDevice);
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= ndev()) return fail(cudaErrorInvalidDevice);
  t_device = device;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  if (device == nullptr) return fail(cudaErrorInvalidValue);
  *device = t_device;
  return cudaSuccess;
}
cudaError_t cudaMalloc(void** p, size_t bytes) {
  std::lock_guard lk(g_mu);
  return do_alloc(p, bytes, t_device);
}
cudaError_t cudaFree(void* p) {
  std::lock_guard lk(g_mu);
  if (p == nullptr) return cudaSuccess;
  const int d = lookup(p, 0);
  if (d >= 0) drain_device(d);  // cudaFree synchronizes
  return do_free_now(p, "cudaFree");
}
cudaError_t cudaMallocAsync(void** p, size_t bytes, cudaStream_t st) {
  std::lock_guard lk(g_mu);
  CUstream_st* s = resolve(st, "cudaMallocAsync");
  if (s == nullptr) return fail(cudaErrorInvalidResourceHandle);
  // The pool of the stream's device.
  return do_alloc(p, bytes, s->device);
}
cudaError_t cudaFreeAsync(void* p, cudaStream_t st) {
  std::lock_guard lk(g_mu);
  CUstream_st* s = resolve(st, "cudaFreeAsync");
  if (s == nullptr) return fail(cudaErrorInvalidResourceHandle);
  if (p == nullptr) return cudaSuccess;
  if (g_allocs.count(reinterpret_cast<uintptr_t>(p)) == 0) {
    rep("cudaFreeAsync: %p is not the start of a live device allocation", p);
    return fail(cudaErrorInvalidValue);
  }
  enqueue(
      s, [p] { do_free_now(p, "cudaFreeAsync (stream-ordered)"); }, "cudaFreeAsync");
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  std::lock_guard lk(g_mu);
  if (bytes == 0) return cudaSuccess;
  if (memcpy_checked(dst, src, bytes, kind, "cudaMemcpy") != cudaSuccess)
    return fail(cudaErrorInvalidValue);
  // A legacy-stream operation: after every blocking stream of the device, then waits.
  CUstream_st* s = legacy(t_device);
  before_enqueue(s);
  drain(s);
  std::memcpy(dst, src, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t st) {
  std::lock_guard lk(g_mu);
  CUstream_st* s = resolve(st, "cudaMemcpyAsync");
  if (s == nullptr) return fail(cudaErrorInvalidResourceHandle);
  if (bytes == 0) return cudaSuccess;
  if (memcpy_checked(dst, src, bytes, kind, "cudaMemcpyAsync") != cudaSuccess)
    return fail(cudaErrorInvalidValue);
  const bool ddev = is_dev(dst), sdev = is_dev(src);
  if (ddev && sdev) {
    enqueue(
        s, [=] { std::memcpy(dst, src, bytes); }, "cudaMemcpyAsync D2D");
    return cudaSuccess;
  }
  // Pageable host memory: the stream's earlier work first, then the copy, before returning.
  before_enqueue(s);
  drain(s);
  std::memcpy(dst, src, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemset(void* p, int v, size_t bytes) {
  std::lock_guard lk(g_mu);
  if (!check_range(p, bytes, true, "cudaMemset")) return fail(cudaErrorInvalidValue);
  CUstream_st* s = legacy(t_device);
  before_enqueue(s);
  drain(s);
  std::memset(p, v, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* p, int v, size_t bytes, cudaStream_t st) {
  std::lock_guard lk(g_mu);
  CUstream_st* s = resolve(st, "cudaMemsetAsync");
  if (s == nullptr) return fail(cudaErrorInvalidResourceHandle);
  if (!check_range(p, bytes, true, "cudaMemsetAsync")) return fail(cudaErrorInvalidValue);
  if (bytes == 0) return cudaSuccess;
  enqueue(
      s, [=] { std::memset(p, v, bytes); }, "cudaMemsetAsync");
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* out, unsigned flags) {
  std::lock_guard lk(g_mu);
  if (out == nullptr) return fail(cudaErrorInvalidValue);
  auto* s = new CUstream_st{t_device, flags, false, {}, 0, 0};
  g_streams.insert(s);
  *out = s;
  return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t* out) { return cudaStreamCreateWithFlags(out, 0); }
cudaError_t cudaStreamDestroy(cudaStream_t st) {
  std::lock_guard lk(g_mu);
  if (st == nullptr || g_streams.count(st) == 0) {
    rep("cudaStreamDestroy: unknown stream %p", static_cast<void*>(st));
    return fail(cudaErrorInvalidResourceHandle);
  }
  drain(st);  // pending work still completes
  g_streams.erase(st);
  delete st;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t st) {
  std::lock_guard lk(g_mu);
  CUstream_st* s = resolve(st, "cudaStreamSynchronize");
  if (s == nullptr) return fail(cudaErrorInvalidResourceHandle);
  if (s->legacy) before_enqueue(s);
  drain(s);
  return cudaSuccess;
}
cudaError_t cudaStreamQuery(cudaStream_t st) { return cudaStreamSynchronize(st); }
cudaError_t cudaStreamWaitEvent(cudaStream_t st, cudaEvent_t e, unsigned) {
  std::lock_guard lk(g_mu);
  CUstream_st* s = resolve(st, "cudaStreamWaitEvent");
  if (s == nullptr || g_events.count(e) == 0) return fail(cudaErrorInvalidResourceHandle);
  // Stronger than needed: the event's work runs now, so s's later work follows it.
  if (e->recorded && e->stream != nullptr) drain(e->stream, e->seq);
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void) {
  std::lock_guard lk(g_mu);
  drain_device(t_device);
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) {
  std::lock_guard lk(g_mu);
  if (e == nullptr) return fail(cudaErrorInvalidValue);
  *e = new CUevent_st{};
  (*e)->device = t_device;
  g_events.insert(*e);
  return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, 0); }
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t st) {
  std::lock_guard lk(g_mu);
  CUstream_st* s = resolve(st, "cudaEventRecord");
  if (s == nullptr || g_events.count(e) == 0) return fail(cudaErrorInvalidResourceHandle);
  if (s->device != e->device) {
    rep("cudaEventRecord: event of device %d on a stream of device %d", e->device, s->device);
    return fail(cudaErrorInvalidResourceHandle);
  }
  if (s->legacy) before_enqueue(s);
  e->stream = s;
  e->seq = s->enqueued;
  e->recorded = true;
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  std::lock_guard lk(g_mu);
  if (g_events.count(e) == 0) return fail(cudaErrorInvalidResourceHandle);
  if (e->recorded && e->stream != nullptr) drain(e->stream, e->seq);
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t e) { return cudaEventSynchronize(e); }
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t a, cudaEvent_t b) {
  std::lock_guard lk(g_mu);
  if (ms == nullptr || g_events.count(a) == 0 || g_events.count(b) == 0)
    return fail(cudaErrorInvalidResourceHandle);
  *ms = 1.0f;
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  std::lock_guard lk(g_mu);
  if (g_events.erase(e) == 0) return fail(cudaErrorInvalidResourceHandle);
  delete e;
  return cudaSuccess;
}
const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorNoDevice:
      return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle:
      return "invalid resource handle";
    default:
      return "unknown error";
  }
}
const char* cudaGetErrorName(cudaError_t e) { return cudaGetErrorString(e); }
cudaError_t cudaGetLastError(void) {
  const cudaError_t e = t_last;
  t_last = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError(void) { return t_last; }
cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* a, const void* p) {
  std::lock_guard lk(g_mu);
  if (a == nullptr) return fail(cudaErrorInvalidValue);
  const int d = lookup(p, 0);
  if (d >= 0)
    *a = {cudaMemoryTypeDevice, d, const_cast<void*>(p), nullptr};
  else
    *a = {cudaMemoryTypeUnregistered, -1, nullptr, const_cast<void*>(p)};
  return cudaSuccess;
}

}  // extern "C"

namespace {
struct AtExit {
  ~AtExit() {
    if (g_problems > 0)
      std::fprintf(stderr, "EMU-CUDA: %d problem(s) reported\n", g_problems.load());
    // Device memory still allocated at exit (leaks on a real device too).
    size_t n = 0, bytes = 0;
    for (auto& [k, v] : g_allocs) {
      ++n;
      bytes += v.first;
    }
    if (n > 0 && std::getenv("EMU_CUDA_LEAKS") != nullptr)
      std::fprintf(stderr, "EMU-CUDA: %zu device allocations (%zu bytes) never freed\n", n, bytes);
  }
} g_at_exit;
}  // namespace
