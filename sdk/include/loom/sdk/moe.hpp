// Checked views of what a loom.moe/1 plugin receives (loom/kinds/moe.h). The SDK's MoeTable
// runs these before calling the class, so a class gets tensors whose shapes, dtypes and
// devices agree with its plan; a class (or a test) may call them too.
//
//   const loom::sdk::MoeLayerView w = loom::sdk::moe_weights(a.weights, plan, x.device, "weights");
//   const float* gate = static_cast<const float*>(w.gate_w);   // [E, M], contiguous
#ifndef LOOM_SDK_MOE_HPP
#define LOOM_SDK_MOE_HPP

#include <loom/kinds/moe.h>
#include <loom/sdk/tensor.hpp>

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>
#include <string_view>

namespace loom::sdk {

// The first element of a tensor (byte_offset applied).
inline void* first_element(const DLTensor& t) { return static_cast<char*>(t.data) + t.byte_offset; }

// "[4, 8]" for an expected shape.
inline std::string dims_string(std::initializer_list<int64_t> dims) {
  std::string s = "[";
  bool first = true;
  for (const int64_t d : dims) {
    if (!first) s += ", ";
    s += std::to_string(d);
    first = false;
  }
  return s + "]";
}

// Checks that `t` is a contiguous tensor of `dtype` with exactly `dims` on `device`, and
// returns its first element. `what` names it, `dims_text` explains the dims ("[E, M]").
inline void* expect_moe_tensor(const DLTensor* t, std::initializer_list<int64_t> dims,
                               DLDataType dtype, DLDevice device, std::string_view what,
                               std::string_view dims_text) {
  const DLTensor& d = expect_tensor(t, what);
  bool same = d.ndim == static_cast<int32_t>(dims.size());
  if (same) {
    int32_t i = 0;
    for (const int64_t n : dims) same = same && d.shape[i++] == n;
  }
  if (!same) {
    fail_argument(std::string(what) + " has shape " + shape_string(d) + ", expected " +
                  dims_string(dims) + " " + std::string(dims_text));
  }
  expect_dtype(d, dtype, what);
  expect_contiguous(d, what);
  expect_device(d, device, what);
  return first_element(d);
}

// The phase times of a layer call (loom_moe_stats.gate_ns .. combine_ns, since 1.7).
struct MoePhases {
  uint64_t gate_ns = 0;
  uint64_t dispatch_ns = 0;
  uint64_t exchange_ns = 0;
  uint64_t experts_ns = 0;
  uint64_t combine_ns = 0;
};

// Writes them into stats where the caller's struct has the fields (a 1.6 caller's does not);
// nothing for NULL.
inline void set_moe_phases(loom_moe_stats* stats, const MoePhases& t) {
  if (stats == nullptr || stats->struct_size < LOOM_MOE_STATS_SIZE) return;
  stats->gate_ns = t.gate_ns;
  stats->dispatch_ns = t.dispatch_ns;
  stats->exchange_ns = t.exchange_ns;
  stats->experts_ns = t.experts_ns;
  stats->combine_ns = t.combine_ns;
}

// The layer's weights (or their gradients) as checked pointers, in the plan's dtype and
// contiguous. The residual ones are NULL unless the plan has LOOM_MOE_RESIDUAL.
struct MoeLayerView {
  void* gate_w = nullptr;  // [E, M]
  void* w1 = nullptr;      // [E_l, H, M]
  void* b1 = nullptr;      // [E_l, H]
  void* w2 = nullptr;      // [E_l, M, H]
  void* b2 = nullptr;      // [E_l, M]
  void* res_w1 = nullptr;  // [H, M]
  void* res_b1 = nullptr;  // [H]
  void* res_w2 = nullptr;  // [M, H]
  void* res_b2 = nullptr;  // [M]
  void* coef_w = nullptr;  // [2, M]
  void* coef_b = nullptr;  // [2]
  DLDataType dtype{};      // of every tensor: the plan's, or float32 (gradients, see below)
};

// Checks a loom_moe_weights against a plan (experts, local_experts, model_dim, hidden_dim,
// dtype, flags) on `device`: every tensor's shape, dtype, contiguity and device, the residual
// ones present exactly when the plan has LOOM_MOE_RESIDUAL. `what` ("weights", "grads")
// prefixes the names in messages. With `float32_too` (gradients) a 16-bit plan's tensors may
// all be float32 instead, as gate_w's dtype says: 16-bit weights with float32 gradients.
inline MoeLayerView moe_weights(const loom_moe_weights* w, const loom_moe_plan_args& plan,
                                DLDevice device, std::string_view what, bool float32_too = false) {
  const std::string p(what);
  if (w == nullptr) fail_argument(p + " is NULL");
  if (w->struct_size < LOOM_MOE_WEIGHTS_SIZE) {
    fail_argument(p + " has struct_size " + std::to_string(w->struct_size) + ", expected " +
                  std::to_string(LOOM_MOE_WEIGHTS_SIZE));
  }
  const int64_t e = plan.experts, el = plan.local_experts, m = plan.model_dim, h = plan.hidden_dim;
  DLDataType t = plan.dtype;
  const DLDataType f32{kDLFloat, 32, 1};
  if (float32_too && w->gate_w != nullptr && plan.dtype.bits == 16 &&
      std::memcmp(&w->gate_w->dtype, &f32, sizeof f32) == 0) {
    t = f32;
  }
  MoeLayerView v;
  v.dtype = t;
  v.gate_w = expect_moe_tensor(w->gate_w, {e, m}, t, device, p + ".gate_w", "[experts, model_dim]");
  v.w1 = expect_moe_tensor(w->w1, {el, h, m}, t, device, p + ".w1",
                           "[local_experts, hidden_dim, model_dim]");
  v.b1 = expect_moe_tensor(w->b1, {el, h}, t, device, p + ".b1", "[local_experts, hidden_dim]");
  v.w2 = expect_moe_tensor(w->w2, {el, m, h}, t, device, p + ".w2",
                           "[local_experts, model_dim, hidden_dim]");
  v.b2 = expect_moe_tensor(w->b2, {el, m}, t, device, p + ".b2", "[local_experts, model_dim]");
  const DLTensor* residual[] = {w->res_w1, w->res_b1, w->res_w2, w->res_b2, w->coef_w, w->coef_b};
  const char* names[] = {"res_w1", "res_b1", "res_w2", "res_b2", "coef_w", "coef_b"};
  if ((plan.flags & LOOM_MOE_RESIDUAL) == 0) {
    for (int i = 0; i < 6; ++i) {
      if (residual[i] != nullptr) {
        fail_argument(p + "." + names[i] +
                      " is given but the layer has no residual MLP (use_residual is off): "
                      "pass NULL");
      }
    }
    return v;
  }
  v.res_w1 = expect_moe_tensor(w->res_w1, {h, m}, t, device, p + ".res_w1",
                               "[hidden_dim, model_dim] (use_residual is on)");
  v.res_b1 = expect_moe_tensor(w->res_b1, {h}, t, device, p + ".res_b1", "[hidden_dim]");
  v.res_w2 =
      expect_moe_tensor(w->res_w2, {m, h}, t, device, p + ".res_w2", "[model_dim, hidden_dim]");
  v.res_b2 = expect_moe_tensor(w->res_b2, {m}, t, device, p + ".res_b2", "[model_dim]");
  v.coef_w = expect_moe_tensor(w->coef_w, {2, m}, t, device, p + ".coef_w", "[2, model_dim]");
  v.coef_b = expect_moe_tensor(w->coef_b, {2}, t, device, p + ".coef_b", "[2]");
  return v;
}

// Checks a routing: route_experts int32 [tokens, k] and, when given, route_weights float32
// [tokens, k], contiguous, on `device`. On host memory also every expert index (-1 for none,
// else 0 .. experts - 1), naming the first bad one.
inline const int32_t* moe_routing(const DLTensor* route_experts, const DLTensor* route_weights,
                                  int64_t tokens, int64_t k, int64_t experts, DLDevice device) {
  auto* ex = static_cast<const int32_t*>(expect_moe_tensor(route_experts, {tokens, k},
                                                           DLDataType{kDLInt, 32, 1}, device,
                                                           "route_experts", "[tokens, top_k]"));
  if (route_weights != nullptr) {
    expect_moe_tensor(route_weights, {tokens, k}, DLDataType{kDLFloat, 32, 1}, device,
                      "route_weights", "[tokens, top_k]");
  }
  if (is_cpu(device)) {
    for (int64_t i = 0; i < tokens * k; ++i) {
      if (ex[i] < -1 || ex[i] >= experts) {
        fail_argument("route_experts[" + std::to_string(i / k) + ", " + std::to_string(i % k) +
                      "] = " + std::to_string(ex[i]) + " is not an expert (0 .. " +
                      std::to_string(experts - 1) + ") or -1");
      }
    }
  }
  return ex;
}

}  // namespace loom::sdk

#endif  // LOOM_SDK_MOE_HPP
