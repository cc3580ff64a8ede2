// int8_gemm.hpp on oneDNN (Debian's libdnnl-dev). Without it (LOOM_QUANT_HAVE_DNNL 0) the
// GEMM is absent and have_int8_gemm() says so; the matmul around it is the same.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "common/parallel_for.hpp"
#include "int8_gemm.hpp"

#if LOOM_QUANT_HAVE_DNNL
#include <dlfcn.h>

#include <oneapi/dnnl/dnnl.hpp>
#endif

namespace loom::quant {
namespace {

constexpr uint64_t align64(uint64_t v) { return (v + 63) / 64 * 64; }

}  // namespace

// 8-bit symmetric codes are two's complement bytes in either bit order.
bool codes_are_int8(const IntWeight& w) { return w.q.bits == 8 && w.q.symmetric; }

#if LOOM_QUANT_HAVE_DNNL

bool have_int8_gemm() { return true; }

namespace {

// One CPU engine for the process; a stream per thread (oneDNN streams are not for
// concurrent use), so matmuls on several threads at once do not share one.
struct Engine {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
};

struct Handles {
  dnnl::engine& engine;
  dnnl::stream& stream;
};

Handles cpu_engine() {
  static Engine e;
  thread_local dnnl::stream stream{e.engine};
  return {e.engine, stream};
}

// oneDNN's OpenMP threads keep spinning for a while after each parallel region; at the
// trainer's shapes (well under a millisecond of work) that spinning competes with the host
// pool's threads that quantize x and run the epilogue, and a call took 10-20 ms instead of
// 0.1-0.3. GEMMs below kSmallGemmMacs multiply-adds therefore run as blocks of rows on the
// host pool, each block's primitive on its pool thread alone: that thread's OpenMP thread
// count (a per-thread setting) is 1 while the primitive is built and run, then restored. The OpenMP
// entry points are looked up in the process (oneDNN's runtime), so nothing here links an OpenMP
// runtime of its own; without one this does nothing.
constexpr int64_t kSmallGemmMacs = int64_t{1} << 28;

struct OpenMp {
  int (*get_max_threads)() = nullptr;
  void (*set_num_threads)(int) = nullptr;
};

const OpenMp& openmp() {
  static const OpenMp omp = [] {
    OpenMp o;
    void* get = dlsym(RTLD_DEFAULT, "omp_get_max_threads");
    void* set = dlsym(RTLD_DEFAULT, "omp_set_num_threads");
    if (get != nullptr && set != nullptr) {
      o.get_max_threads = reinterpret_cast<int (*)()>(get);
      o.set_num_threads = reinterpret_cast<void (*)(int)>(set);
    }
    return o;
  }();
  return omp;
}

// While alive: the calling thread's OpenMP regions run on it alone (when `alone`).
class OneThread {
 public:
  explicit OneThread(bool alone) {
    const OpenMp& o = openmp();
    if (!alone || o.get_max_threads == nullptr) return;
    prev_ = o.get_max_threads();
    if (prev_ > 1) o.set_num_threads(1);
  }
  ~OneThread() {
    if (prev_ > 1) openmp().set_num_threads(prev_);
  }
  OneThread(const OneThread&) = delete;
  OneThread& operator=(const OneThread&) = delete;

 private:
  int prev_ = 0;
};

// The thread count a primitive built now is made for (oneDNN splits the work at creation).
int64_t current_threads() {
  const OpenMp& o = openmp();
  return o.get_max_threads != nullptr ? o.get_max_threads() : 0;
}

// The s8 x s8 -> s32 matmul primitive of one GEMM shape: rows m, columns n, a K slice of kg
// codes out of rows of k (the leading dimension of x's and W's codes), for the current
// OpenMP thread count. Building one costs far
// more than running it at the trainer's shapes (a primitive descriptor walks oneDNN's kernel
// list and the primitive JIT-compiles its kernel), so they are kept, keyed by the shape, and
// one primitive runs on several threads at once (the row blocks of one GEMM have one shape).
// A primitive holds no data pointers (the memories are bound at execute), but in oneDNN's
// default scratchpad mode (library) it holds its scratchpad, where the brgemm s8 kernel
// copies W's block and its compensation for the s8 source: two threads running one
// primitive at once overwrite each other's copy and rows come out wrong (measured on
// avx512_core_vnni with Debian's 2.6: about 1 call in 100 per thread with two threads, 1 in
// 5 with four; oneDNN's documentation: "the same primitive cannot be run concurrently from
// two different threads"). So the primitives are built for a user scratchpad, and each
// thread passes its own (thread_scratchpad). The cache is bounded: past kMaxPrimitives shapes
// it starts again empty (the shapes of one model are a handful).
using PrimKey = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>;
constexpr std::size_t kMaxPrimitives = 64;

struct Matmul {
  dnnl::matmul prim;
  dnnl::memory::desc scratchpad;  // what execute needs as DNNL_ARG_SCRATCHPAD (size 0: none)
};

// The calling thread's scratchpad of at least `bytes` bytes, page aligned; grown, never
// shrunk. A thread runs one primitive at a time (rows waits on its stream), so one per
// thread is enough.
void* thread_scratchpad(std::size_t bytes) {
  constexpr std::size_t kAlign = 4096;
  thread_local std::vector<unsigned char> buf;
  if (buf.size() < bytes + kAlign) buf.assign(bytes + kAlign, 0);
  const auto at = reinterpret_cast<uintptr_t>(buf.data());
  return buf.data() + ((kAlign - at % kAlign) % kAlign);
}

std::shared_ptr<const Matmul> cached_matmul(const dnnl::engine& engine, int64_t m, int64_t n,
                                            int64_t kg, int64_t k) {
  using dnnl::memory;
  using dt = memory::data_type;
  static std::mutex mu;
  static std::map<PrimKey, std::shared_ptr<const Matmul>> cache;
  const PrimKey key{m, n, kg, k, current_threads()};
  {
    const std::lock_guard<std::mutex> lock(mu);
    const auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  // Built outside the lock (it is the slow part); two threads may both build one, and the
  // first stored wins.
  const memory::desc src_md({m, kg}, dt::s8, memory::dims{k, 1});
  const memory::desc wei_md({kg, n}, dt::s8, memory::dims{1, k});
  const memory::desc acc_md({m, n}, dt::s32, memory::dims{n, 1});
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src_md, wei_md, acc_md), attr, engine);
  auto prim = std::make_shared<const Matmul>(Matmul{dnnl::matmul(pd), pd.scratchpad_desc()});
  const std::lock_guard<std::mutex> lock(mu);
  if (cache.size() >= kMaxPrimitives) cache.clear();
  return cache.emplace(key, std::move(prim)).first->second;
}

// oneDNN's s8 x s8 kernels are exact only with VNNI (vpdpbusd accumulates the byte products
// in int32): without it they shift x to unsigned bytes and multiply-add pairs into int16
// lanes, which saturates at codes near +-127 ((127 + 128) * 127 * 2 > 32767). Elsewhere the
// GEMM runs on int8_dot_exact. Decided once, from the ISA oneDNN itself will use (which
// ONEDNN_MAX_CPU_ISA can lower).
bool onednn_is_exact() {
  static const bool exact = [] {
    const unsigned isa = static_cast<unsigned>(dnnl_get_effective_cpu_isa());
    const auto has = [isa](dnnl_cpu_isa_t want) {
      const unsigned w = static_cast<unsigned>(want);
      return (isa & w) == w;
    };
    return has(dnnl_cpu_isa_avx512_core_vnni) || has(dnnl_cpu_isa_avx2_vnni);
  }();
  return exact;
}

}  // namespace

bool int8_gemm_uses_onednn() { return onednn_is_exact(); }

void int8_gemm(const Int8Gemm& g, int32_t* acc, float* sw_col) {
  using dnnl::memory;
  using dt = memory::data_type;
  if (g.m == 0 || g.n == 0) return;
  const int64_t groups = g.k == 0 ? 0 : (g.k + g.group - 1) / g.group;
  if (groups == 0) {
    for (int64_t i = 0; i < g.m; ++i) {
      for (int64_t j = 0; j < g.n; ++j) g.y[i * g.n + j] = g.bias != nullptr ? g.bias[j] : 0.0f;
    }
    return;
  }
  try {
    if (!onednn_is_exact()) {
      for (int64_t gi = 0; gi < groups; ++gi) {
        const int64_t k0 = gi * g.group;
        const int64_t kg = std::min(g.k, k0 + g.group) - k0;
        int8_dot_exact(g.xq, g.wq, g.m, g.n, g.k, k0, kg, acc);
        const float* sw = g.sw;
        if (groups > 1) {
          for (int64_t j = 0; j < g.n; ++j) sw_col[j] = g.sw[j * groups + gi];
          sw = sw_col;
        }
        int8_epilogue(acc, g.m, g.n, g.sx, sw, g.bias, gi == 0, g.y);
      }
      return;
    }
    const bool small = g.m * g.n * g.k < kSmallGemmMacs;
    // Rows [i0, i1) of one K group's s32 products, on the calling thread's stream.
    const auto rows = [&](int64_t i0, int64_t i1, int64_t k0, int64_t kg) {
      const Handles e = cpu_engine();
      const int64_t mb = i1 - i0;
      const memory::desc acc_md({mb, g.n}, dt::s32, memory::dims{g.n, 1});
      const memory::desc src_md({mb, kg}, dt::s8, memory::dims{g.k, 1});
      const memory::desc wei_md({kg, g.n}, dt::s8, memory::dims{1, g.k});
      const std::shared_ptr<const Matmul> mm = cached_matmul(e.engine, mb, g.n, kg, g.k);
      memory acc_mem(acc_md, e.engine, acc + i0 * g.n);
      memory src_mem(src_md, e.engine, const_cast<int8_t*>(g.xq + i0 * g.k + k0));
      memory wei_mem(wei_md, e.engine, const_cast<int8_t*>(g.wq + k0));
      memory pad_mem(mm->scratchpad, e.engine, thread_scratchpad(mm->scratchpad.get_size()));
      mm->prim.execute(e.stream, {{DNNL_ARG_SRC, src_mem},
                                  {DNNL_ARG_WEIGHTS, wei_mem},
                                  {DNNL_ARG_DST, acc_mem},
                                  {DNNL_ARG_SCRATCHPAD, pad_mem}});
      e.stream.wait();
    };
    for (int64_t gi = 0; gi < groups; ++gi) {
      const int64_t k0 = gi * g.group;
      const int64_t kg = std::min(g.k, k0 + g.group) - k0;
      if (!small) {
        rows(0, g.m, k0, kg);
      } else {
        // Small GEMMs: blocks of rows on the host pool, each block's GEMM on its pool thread
        // alone (no OpenMP threads woken), so all cores work without oneDNN's spinning.
        // At least 2^23 multiply-adds per block (tens of microseconds): fewer, larger
        // primitives run per call.
        const int64_t block =
            std::max<int64_t>(16, (int64_t{1} << 23) / std::max<int64_t>(g.n * kg, 1));
        const int64_t blocks = (g.m + block - 1) / block;
        std::mutex err_mu;
        std::string err;
        loom::plugins::parallel_for(static_cast<std::size_t>(blocks), 1,
                                    [&](std::size_t b, std::size_t e) {
                                      try {
                                        const OneThread alone(true);
                                        for (std::size_t bi = b; bi < e; ++bi) {
                                          const int64_t i0 = static_cast<int64_t>(bi) * block;
                                          rows(i0, std::min(g.m, i0 + block), k0, kg);
                                        }
                                      } catch (const dnnl::error& ex) {
                                        const std::lock_guard<std::mutex> lock(err_mu);
                                        if (err.empty()) err = ex.what();
                                      }
                                    });
        if (!err.empty()) {
          throw std::runtime_error(std::string("oneDNN INT8 matmul failed: ") + err);
        }
      }
      const float* sw = g.sw;
      if (groups > 1) {
        for (int64_t j = 0; j < g.n; ++j) sw_col[j] = g.sw[j * groups + gi];
        sw = sw_col;
      }
      int8_epilogue(acc, g.m, g.n, g.sx, sw, g.bias, gi == 0, g.y);
    }
  } catch (const dnnl::error& err) {
    throw std::runtime_error(std::string("oneDNN INT8 matmul failed: ") + err.what());
  }
}

#else

bool have_int8_gemm() { return false; }

bool int8_gemm_uses_onednn() { return false; }

void int8_gemm(const Int8Gemm&, int32_t*, float*) {
  throw std::runtime_error(
      "this build has no INT8 GEMM: oneDNN (libdnnl-dev) was not found when it was configured");
}

#endif

bool int8_matmul_supports(const IntScheme& q, std::string* why) {
  if (q.symmetric || q.bits <= 7) return true;
  if (why != nullptr) {
    *why =
        "asymmetric 8-bit weight codes minus their zero points span -255 .. 255 and do not fit "
        "the int8 GEMM; use symmetric codes, bits <= 7, or weight-only matmul";
  }
  return false;
}

Int8Workspace carve_int8_workspace(void* base, int64_t m, const IntWeight& w) {
  auto* p = static_cast<uint8_t*>(base);
  const auto mu = static_cast<uint64_t>(m);
  const auto n = static_cast<uint64_t>(w.gs.rows);
  const auto k = static_cast<uint64_t>(w.gs.cols);
  Int8Workspace ws;
  ws.xq = reinterpret_cast<int8_t*>(p);
  p += align64(mu * k);
  ws.sx = reinterpret_cast<float*>(p);
  p += align64(mu * sizeof(float));
  if (!codes_are_int8(w)) {
    ws.wide = reinterpret_cast<int8_t*>(p);
    p += align64(n * k);
  }
  ws.sw_col = reinterpret_cast<float*>(p);
  p += align64(n * sizeof(float));
  ws.acc = reinterpret_cast<int32_t*>(p);
  return ws;
}

uint64_t int8_matmul_workspace_bytes(int64_t m, const IntWeight& w) {
  const auto mu = static_cast<uint64_t>(m);
  const auto n = static_cast<uint64_t>(w.gs.rows);
  const auto k = static_cast<uint64_t>(w.gs.cols);
  uint64_t bytes = align64(mu * k) + align64(mu * sizeof(float));
  if (!codes_are_int8(w)) bytes += align64(n * k);
  return bytes + align64(n * sizeof(float)) + align64(mu * n * sizeof(int32_t));
}

int64_t int8_matmul(const float* x, int64_t m, const IntWeight& w, const float* bias, float* y,
                    void* workspace) {
  const Int8Workspace ws = carve_int8_workspace(workspace, m, w);
  const int64_t bad = quantize_rows_int8(x, m, w.gs.cols, ws.xq, ws.sx);
  if (bad >= 0) return bad;
  const int8_t* wq = reinterpret_cast<const int8_t*>(w.packed);
  if (ws.wide != nullptr) {
    widen_to_int8(w, ws.wide);
    wq = ws.wide;
  }
  Int8Gemm g;
  g.xq = ws.xq;
  g.sx = ws.sx;
  g.wq = wq;
  g.sw = w.scales;
  g.bias = bias;
  g.y = y;
  g.m = m;
  g.n = w.gs.rows;
  g.k = w.gs.cols;
  g.group = w.gs.group;
  int8_gemm(g, ws.acc, ws.sw_col);
  return -1;
}

}  // namespace loom::quant
