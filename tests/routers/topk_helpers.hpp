// Helpers of the topk_router tests: a session over a manifest, the router's table through
// the host, DLTensor views over caller-owned buffers, and select/backward calls.
#pragma once

#include <gtest/gtest.h>
#include <loom/embed.h>
#include <loom/kinds/router.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace topk_test {

constexpr DLDataType kF32{kDLFloat, 32, 1};
constexpr DLDataType kF64{kDLFloat, 64, 1};
constexpr DLDataType kI32{kDLInt, 32, 1};

struct Session {
  loom_session* s = nullptr;
  std::string error;
  explicit Session(const std::string& toml) {
    loom_open_options o{};
    o.struct_size = LOOM_OPEN_OPTIONS_SIZE;
    o.log_level = -1;
    if (loom_open_string(toml.c_str(), "test.toml", &o, &s) != 0) error = loom_last_error();
  }
  ~Session() { loom_close(s); }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
};

// A tensor view that owns its shape and strides (strides empty: contiguous).
struct View {
  DLTensor t{};
  int64_t shape[3] = {0, 0, 0};
  int64_t strides[3] = {0, 0, 0};
  View(void* data, std::vector<int64_t> dims, DLDataType dtype, std::vector<int64_t> st = {},
       DLDevice dev = DLDevice{kDLCPU, 0}) {
    for (std::size_t i = 0; i < dims.size(); ++i) shape[i] = dims[i];
    for (std::size_t i = 0; i < st.size(); ++i) strides[i] = st[i];
    t.data = data;
    t.device = dev;
    t.ndim = static_cast<int32_t>(dims.size());
    t.dtype = dtype;
    t.shape = shape;
    t.strides = st.empty() ? nullptr : strides;
  }
  View(const View&) = delete;
  View& operator=(const View&) = delete;
  DLTensor* get() { return &t; }
};

// A 256-byte aligned buffer.
struct Aligned {
  std::vector<unsigned char> bytes;
  void* p = nullptr;
  explicit Aligned(std::size_t n) : bytes(n + 256) {
    auto a = reinterpret_cast<uintptr_t>(bytes.data());
    p = reinterpret_cast<void*>((a + 255) / 256 * 256);
  }
};

struct Router {
  loom_instance* inst = nullptr;
  void* obj = nullptr;
  const loom_router_v1* t = nullptr;
  std::string error;
  Router(Session& s, const char* name) {
    if (loom_find_instance(s.s, LOOM_KIND_ROUTER, name, &inst) != 0) {
      ADD_FAILURE() << "find " << name << ": " << loom_last_error();
      return;
    }
    const void* table = nullptr;
    if (loom_instance_table(inst, LOOM_KIND_ROUTER, LOOM_ROUTER_V1_MIN_SIZE, &obj, &table) != 0) {
      ADD_FAILURE() << "table " << name << ": " << loom_last_error();
    }
    t = static_cast<const loom_router_v1*>(table);
  }
  // 0, or the status's code with its text in `error`.
  int32_t take(loom_status* st) {
    std::array<char, 2048> msg{};
    const int32_t rc = loom_instance_take_status(inst, st, msg.data(), msg.size());
    error = msg.data();
    return rc;
  }
  int32_t plan(loom_router_plan_args& a) { return take(t->plan(obj, &a)); }
};

inline loom_router_plan_args plan_args(int64_t batch, int64_t seq_len, int64_t channels,
                                       int32_t layer, int32_t num_layers, DLDataType dtype = kF64,
                                       int64_t step = 1) {
  loom_router_plan_args a{};
  a.struct_size = LOOM_ROUTER_PLAN_ARGS_SIZE;
  a.batch = batch;
  a.seq_len = seq_len;
  a.channels = channels;
  a.step = step;
  a.layer = layer;
  a.num_layers = num_layers;
  a.training = 1;
  a.dtype = dtype;
  return a;
}

// The inputs of one select + backward, in host memory, of element type T.
template <class T>
struct Problem {
  int64_t batch = 0, seq_len = 0, channels = 0;
  int32_t layer = 1, num_layers = 3;
  std::vector<T> x;  // [batch, seq_len, channels] contiguous
  std::vector<T> w;  // [channels]
  static DLDataType dtype() { return sizeof(T) == 8 ? kF64 : kF32; }
  T& at(int64_t b, int64_t p, int64_t c) {
    return x[static_cast<std::size_t>((b * seq_len + p) * channels + c)];
  }
};

template <class T>
Problem<T> random_problem(int64_t batch, int64_t seq_len, int64_t channels, uint64_t seed) {
  Problem<T> pr;
  pr.batch = batch;
  pr.seq_len = seq_len;
  pr.channels = channels;
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> n(0.0, 1.0);
  pr.x.resize(static_cast<std::size_t>(batch * seq_len * channels));
  for (T& v : pr.x) v = static_cast<T>(n(rng));
  pr.w.resize(static_cast<std::size_t>(channels));
  for (T& v : pr.w) v = static_cast<T>(n(rng) * 0.5);
  return pr;
}

// What select wrote.
template <class T>
struct Selection {
  int64_t kept = 0;
  std::vector<int32_t> indices;
  std::vector<T> gates;
  std::vector<double> saved;
  int32_t rc = 0;
};

// plan + select on host memory (rc and router.error on failure).
template <class T>
Selection<T> select_host(Router& r, Problem<T>& pr) {
  Selection<T> out;
  loom_router_plan_args p =
      plan_args(pr.batch, pr.seq_len, pr.channels, pr.layer, pr.num_layers, Problem<T>::dtype());
  out.rc = r.plan(p);
  if (out.rc != 0) return out;
  out.kept = p.kept;
  out.indices.assign(static_cast<std::size_t>(pr.batch * p.kept), -1);
  out.gates.assign(static_cast<std::size_t>(pr.batch * p.kept), T(0));
  out.saved.assign(static_cast<std::size_t>(p.saved_bytes / sizeof(double)), 0.0);
  Aligned saved(p.saved_bytes), ws(p.workspace_bytes);
  View x(pr.x.data(), {pr.batch, pr.seq_len, pr.channels}, Problem<T>::dtype());
  View w(pr.w.data(), {pr.channels}, Problem<T>::dtype());
  View idx(out.indices.data(), {pr.batch, p.kept}, kI32);
  View g(out.gates.data(), {pr.batch, p.kept}, Problem<T>::dtype());
  loom_router_select_args a{};
  a.struct_size = LOOM_ROUTER_SELECT_ARGS_SIZE;
  a.seed = 7;
  a.step = 1;
  a.batch = pr.batch;
  a.seq_len = pr.seq_len;
  a.channels = pr.channels;
  a.layer = pr.layer;
  a.num_layers = pr.num_layers;
  a.training = 1;
  a.x = x.get();
  a.weight = w.get();
  a.indices = idx.get();
  a.gates = g.get();
  a.saved = saved.p;
  a.saved_bytes = p.saved_bytes;
  a.workspace = ws.p;
  a.workspace_bytes = p.workspace_bytes;
  out.rc = r.take(r.t->select(r.obj, &a));
  std::memcpy(out.saved.data(), saved.p, p.saved_bytes);
  return out;
}

// backward on host memory: adds into dx and dw.
template <class T>
int32_t backward_host(Router& r, Problem<T>& pr, Selection<T>& sel, std::vector<T>& dgates,
                      std::vector<T>& dx, std::vector<T>& dw) {
  loom_router_plan_args p =
      plan_args(pr.batch, pr.seq_len, pr.channels, pr.layer, pr.num_layers, Problem<T>::dtype());
  if (r.plan(p) != 0) return -1;
  Aligned saved(p.saved_bytes), ws(p.workspace_bytes);
  std::memcpy(saved.p, sel.saved.data(), p.saved_bytes);
  View x(pr.x.data(), {pr.batch, pr.seq_len, pr.channels}, Problem<T>::dtype());
  View w(pr.w.data(), {pr.channels}, Problem<T>::dtype());
  View idx(sel.indices.data(), {pr.batch, sel.kept}, kI32);
  View dg(dgates.data(), {pr.batch, sel.kept}, Problem<T>::dtype());
  View dxv(dx.data(), {pr.batch, pr.seq_len, pr.channels}, Problem<T>::dtype());
  View dwv(dw.data(), {pr.channels}, Problem<T>::dtype());
  loom_router_backward_args a{};
  a.struct_size = LOOM_ROUTER_BACKWARD_ARGS_SIZE;
  a.batch = pr.batch;
  a.seq_len = pr.seq_len;
  a.channels = pr.channels;
  a.x = x.get();
  a.weight = w.get();
  a.indices = idx.get();
  a.dgates = dg.get();
  a.dx = dxv.get();
  a.dweight = dwv.get();
  a.saved = saved.p;
  a.saved_bytes = p.saved_bytes;
  a.workspace = ws.p;
  a.workspace_bytes = p.workspace_bytes;
  return r.take(r.t->backward(r.obj, &a));
}

}  // namespace topk_test
