// int8_gemm.hpp on oneDNN (Debian's libdnnl-dev). Without it (LOOM_QUANT_HAVE_DNNL 0) the
// GEMM is absent and have_int8_gemm() says so; the matmul around it is the same.
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <unordered_map>
#include <vector>

#include "int8_gemm.hpp"

#if LOOM_QUANT_HAVE_DNNL
#include <oneapi/dnnl/dnnl.hpp>
#endif

namespace loom::quant {
namespace {

constexpr uint64_t align64(uint64_t v) { return (v + 63) / 64 * 64; }

// Whether W's packed bytes already are the int8 [N, K] matrix the GEMM takes: 8-bit
// symmetric codes are two's complement bytes in either bit order.
bool codes_are_int8(const IntWeight& w) { return w.q.bits == 8 && w.q.symmetric; }

}  // namespace

#if LOOM_QUANT_HAVE_DNNL

bool have_int8_gemm() { return true; }

namespace {

struct Engine {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
};

Engine& cpu_engine() {
  static Engine e;
  return e;
}

}  // namespace

void int8_gemm(const Int8Gemm& g, float* scratch) {
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
    Engine& e = cpu_engine();
    const memory::desc sx_md({g.m, 1}, dt::f32, memory::dims{1, 1});
    const memory::desc bias_md({1, g.n}, dt::f32, memory::dims{g.n, 1});
    const memory::desc dst_md({g.m, g.n}, dt::f32, memory::dims{g.n, 1});
    memory sx_mem(sx_md, e.engine, const_cast<float*>(g.sx));
    memory dst_mem(dst_md, e.engine, g.y);
    memory bias_mem;
    if (g.bias != nullptr) bias_mem = memory(bias_md, e.engine, const_cast<float*>(g.bias));
    for (int64_t gi = 0; gi < groups; ++gi) {
      const int64_t k0 = gi * g.group;
      const int64_t kg = std::min(g.k, k0 + g.group) - k0;
      const bool first = gi == 0;
      // The group's N weight scales, contiguous.
      float* sw = scratch;
      if (groups == 1) {
        sw = const_cast<float*>(g.sw);
      } else {
        for (int64_t j = 0; j < g.n; ++j) sw[j] = g.sw[j * groups + gi];
      }
      const memory::desc src_md({g.m, kg}, dt::s8, memory::dims{g.k, 1});
      const memory::desc wei_md({kg, g.n}, dt::s8, memory::dims{1, g.k});
      dnnl::primitive_attr attr;
      attr.set_output_scales(1 << 1, {DNNL_RUNTIME_F32_VAL});
      dnnl::post_ops po;
      po.append_binary(dnnl::algorithm::binary_mul, sx_md);
      if (first && g.bias != nullptr) po.append_binary(dnnl::algorithm::binary_add, bias_md);
      if (!first) po.append_sum(1.0f);
      attr.set_post_ops(po);
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src_md, wei_md, dst_md), attr,
                                            e.engine);
      const dnnl::matmul prim(pd);
      memory src_mem(src_md, e.engine, const_cast<int8_t*>(g.xq + k0));
      memory wei_mem(wei_md, e.engine, const_cast<int8_t*>(g.wq + k0));
      memory scale_mem({{g.n}, dt::f32, memory::format_tag::x}, e.engine, sw);
      std::unordered_map<int, memory> args = {
          {DNNL_ARG_SRC, src_mem},
          {DNNL_ARG_WEIGHTS, wei_mem},
          {DNNL_ARG_DST, dst_mem},
          {DNNL_ARG_ATTR_OUTPUT_SCALES, scale_mem},
          {DNNL_ARG_ATTR_MULTIPLE_POST_OP(0) | DNNL_ARG_SRC_1, sx_mem}};
      if (first && g.bias != nullptr) {
        args.emplace(DNNL_ARG_ATTR_MULTIPLE_POST_OP(1) | DNNL_ARG_SRC_1, bias_mem);
      }
      prim.execute(e.stream, args);
    }
    e.stream.wait();
  } catch (const dnnl::error& err) {
    throw std::runtime_error(std::string("oneDNN INT8 matmul failed: ") + err.what());
  }
}

#else

bool have_int8_gemm() { return false; }

void int8_gemm(const Int8Gemm&, float*) {
  throw std::runtime_error(
      "this build has no INT8 GEMM: oneDNN (libdnnl-dev) was not found when it was configured");
}

#endif

int64_t int8_gemm_scratch_floats(int64_t n, int64_t groups) { return groups > 1 ? n : 0; }

bool int8_matmul_supports(const IntScheme& q, std::string* why) {
  if (q.symmetric || q.bits <= 7) return true;
  if (why != nullptr) {
    *why =
        "asymmetric 8-bit weight codes minus their zero points span -255 .. 255 and do not fit "
        "the int8 GEMM; use symmetric codes, bits <= 7, or weight-only matmul";
  }
  return false;
}

uint64_t int8_matmul_workspace_bytes(int64_t m, const IntWeight& w) {
  const auto mu = static_cast<uint64_t>(m);
  const auto n = static_cast<uint64_t>(w.gs.rows);
  const auto k = static_cast<uint64_t>(w.gs.cols);
  uint64_t bytes = align64(mu * k) + align64(mu * sizeof(float));
  if (!codes_are_int8(w)) bytes += align64(n * k);
  bytes += align64(static_cast<uint64_t>(int8_gemm_scratch_floats(w.gs.rows, w.gs.groups_per_row)) *
                   sizeof(float));
  return bytes;
}

int64_t int8_matmul(const float* x, int64_t m, const IntWeight& w, const float* bias, float* y,
                    void* workspace) {
  auto* base = static_cast<uint8_t*>(workspace);
  const int64_t n = w.gs.rows;
  const int64_t k = w.gs.cols;
  auto* xq = reinterpret_cast<int8_t*>(base);
  base += align64(static_cast<uint64_t>(m * k));
  auto* sx = reinterpret_cast<float*>(base);
  base += align64(static_cast<uint64_t>(m) * sizeof(float));
  const int8_t* wq = reinterpret_cast<const int8_t*>(w.packed);
  if (!codes_are_int8(w)) {
    auto* wide = reinterpret_cast<int8_t*>(base);
    base += align64(static_cast<uint64_t>(n * k));
    widen_to_int8(w, wide);
    wq = wide;
  }
  auto* scratch = reinterpret_cast<float*>(base);
  const int64_t bad = quantize_rows_int8(x, m, k, xq, sx);
  if (bad >= 0) return bad;
  Int8Gemm g;
  g.xq = xq;
  g.sx = sx;
  g.wq = wq;
  g.sw = w.scales;
  g.bias = bias;
  g.y = y;
  g.m = m;
  g.n = n;
  g.k = k;
  g.group = w.gs.group;
  int8_gemm(g, scratch);
  return -1;
}

}  // namespace loom::quant
