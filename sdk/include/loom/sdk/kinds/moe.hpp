// The "loom.moe/1" kind in the SDK (loom/kinds/moe.h): the base class a Mixture-of-Experts
// layer derives from and the table the SDK builds from it. The checked views a layer receives
// (moe_weights, moe_routing, expect_moe_tensor) are in loom/sdk/moe.hpp, included here.
#ifndef LOOM_SDK_KINDS_MOE_HPP
#define LOOM_SDK_KINDS_MOE_HPP

#include <loom/kinds/moe.h>
#include <loom/sdk/kinds/table.hpp>
#include <loom/sdk/moe.hpp>
#include <loom/sdk/plugin.hpp>
#include <loom/sdk/tensor.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace loom::sdk {

// "loom.moe/1" (since 1.5): a whole Mixture-of-Experts layer.
//   required: void plan(loom_moe_plan_args&)                                 [any]
//             void forward(const loom_moe_forward_args&, const loom_moe_plan_args&)
//             void backward(const loom_moe_backward_args&, const loom_moe_plan_args&)
//   optional: void dispatch(const loom_moe_dispatch_args&)
//             void combine(const loom_moe_dispatch_args&)
//             void reduce_gradients(const loom_moe_reduce_args&)
//   forward, backward, dispatch, combine and reduce_gradients are [instance] (collective).
//   What the class lacks stays NULL in the table. Before plan the SDK checks the scalars
//   (tokens, model_dim, hidden_dim, num_layers >= 1; num_experts >= 0; 0 <= layer <
//   num_layers) and zeroes the outputs; after it, that the outputs make sense (experts =
//   local_experts * ep_size, num_experts honoured, 0 <= ep_rank < ep_size, 1 <= top_k <=
//   experts, a known activation, known flags, capacity 0 exactly when DROPLESS): a plan that
//   breaks them is the plugin's bug (INTERNAL). The table sets LOOM_MOE_EXPERT_PARALLEL itself
//   from ep_size. Before forward and backward it checks the same scalars (tokens >= 0 there,
//   step >= 1 in training, first_token >= 0), plans the call's scalars (tokens = the call's,
//   at least 1; dtype = x's) and hands that plan to the class, after checking against it:
//   x, y, dy, dx [tokens, M]; every weight and gradient (loom/sdk/moe.hpp moe_weights: gate_w
//   [E, M], w1 [E_l, H, M], b1 [E_l, H], w2 [E_l, M, H], b2 [E_l, M], the residual MLP's
//   exactly when RESIDUAL); expert_bias float32 [E] exactly when EXPERT_BIAS; the optional
//   routing outputs int32 / float32 [tokens, k]; stats (struct size at least 1.5's, load_count
//   = E), whose outputs it zeroes (the phase times where the caller's struct has them; a
//   backward's stats, since 1.7, must be the full size); saved and workspace present, 256-byte
//   aligned and at least that plan's sizes; every tensor of x's dtype (the gradients may
//   all be float32 instead when x is 16-bit), contiguous and on x's device. A 1.6 caller's
//   backward args reach the class as a full struct, stats NULL. The plan's buffer sizes are
//   for the call's tokens: under expert parallelism the rows other ranks send are the
//   class's to fit in the saved_bytes it is given. Before dispatch and
//   combine: x [tokens, M], rows [R, M] of x's dtype, the routing (host expert indices -1 ..
//   E-1), top_k and counts_count equal to the plan's top_k and local_experts; that rows holds
//   every row the routing sends is the class's to check. Before reduce_gradients: every
//   tensor float32, contiguous, on one device.
struct Moe {
  static constexpr const char* kKind = LOOM_KIND_MOE;
  using sdk_kind = Moe;
};

namespace detail {

template <class T>
constexpr bool kMoeDispatches = requires(T& t, const loom_moe_dispatch_args& a) {
  t.dispatch(a);
};
template <class T>
constexpr bool kMoeCombines = requires(T& t, const loom_moe_dispatch_args& a) {
  t.combine(a);
};
template <class T>
constexpr bool kMoeReduces = requires(T& t, const loom_moe_reduce_args& a) {
  t.reduce_gradients(a);
};

template <class T>
struct MoeTable {
  using E = Entry<T>;

  static constexpr uint32_t kKnownFlags =
      LOOM_MOE_RESIDUAL | LOOM_MOE_DROPLESS | LOOM_MOE_EXPERT_BIAS | LOOM_MOE_EXPERT_PARALLEL;

  // The scalars every planned call carries. `least_tokens`: 1 for plan, 0 for the calls.
  static void check_scalars(int64_t tokens, int64_t least_tokens, int64_t model_dim,
                            int64_t hidden_dim, int32_t num_experts, int32_t layer,
                            int32_t num_layers, const std::string& call) {
    at_least(tokens, least_tokens, "tokens", call);
    at_least(model_dim, 1, "model_dim", call);
    at_least(hidden_dim, 1, "hidden_dim", call);
    at_least(num_experts, 0, "num_experts", call);
    at_least(num_layers, 1, "num_layers", call);
    check_layer(layer, num_layers, call);
  }

  // The class's plan on zeroed outputs, then the checks of what it returned and the flag the
  // table owns.
  static void plan_into(T& obj, loom_moe_plan_args& full) {
    const int32_t asked = full.num_experts;
    full.flags = 0;
    full.experts = 0;
    full.local_experts = 0;
    full.ep_size = 0;
    full.ep_rank = 0;
    full.top_k = 0;
    full.activation = 0;
    full.reserved2 = 0;
    full.capacity = 0;
    full.max_expert_rows = 0;
    full.saved_bytes = 0;
    full.workspace_bytes = 0;
    obj.plan(full);
    if (full.experts < 1)
      plugin_bug("plan", "resolved " + std::to_string(full.experts) + " experts");
    if (asked != 0 && full.experts != asked) {
      plugin_bug("plan", "resolved " + std::to_string(full.experts) +
                             " experts, but the caller asked for " + std::to_string(asked));
    }
    if (full.ep_size < 1 || full.local_experts < 1 ||
        static_cast<int64_t>(full.local_experts) * full.ep_size != full.experts) {
      plugin_bug("plan", "gave local_experts " + std::to_string(full.local_experts) +
                             " and ep_size " + std::to_string(full.ep_size) + " for " +
                             std::to_string(full.experts) +
                             " experts (experts must be local_experts * ep_size, both >= 1)");
    }
    if (full.ep_rank < 0 || full.ep_rank >= full.ep_size) {
      plugin_bug("plan", "gave ep_rank " + std::to_string(full.ep_rank) + " outside 0 .. " +
                             std::to_string(full.ep_size - 1));
    }
    if (full.top_k < 1 || full.top_k > full.experts) {
      plugin_bug("plan", "gave top_k " + std::to_string(full.top_k) + " for " +
                             std::to_string(full.experts) + " experts");
    }
    if (full.activation != LOOM_MOE_GELU && full.activation != LOOM_MOE_RELU &&
        full.activation != LOOM_MOE_SILU) {
      plugin_bug("plan", "gave activation " + std::to_string(full.activation) +
                             ", not a loom_moe_activation");
    }
    check_known_flags(full.flags, kKnownFlags, "plan");
    const bool dropless = (full.flags & LOOM_MOE_DROPLESS) != 0;
    if (dropless ? full.capacity != 0 : full.capacity < 1) {
      plugin_bug("plan", "gave capacity " + std::to_string(full.capacity) +
                             (dropless ? " for a dropless layer (must be 0)" : " (must be >= 1)"));
    }
    if (full.max_expert_rows < 0) {
      plugin_bug("plan", "gave max_expert_rows " + std::to_string(full.max_expert_rows));
    }
    full.flags = (full.flags & ~LOOM_MOE_EXPERT_PARALLEL) |
                 (full.ep_size > 1 ? LOOM_MOE_EXPERT_PARALLEL : 0u);
  }

  static loom_moe_plan_args plan_for(T& obj, int64_t tokens, int64_t model_dim, int64_t hidden_dim,
                                     int32_t num_experts, int32_t layer, int32_t num_layers,
                                     uint32_t training, DLDataType dtype) {
    loom_moe_plan_args p{};
    p.struct_size = LOOM_MOE_PLAN_ARGS_SIZE;
    p.tokens = tokens < 1 ? 1 : tokens;
    p.model_dim = model_dim;
    p.hidden_dim = hidden_dim;
    p.num_experts = num_experts;
    p.layer = layer;
    p.num_layers = num_layers;
    p.training = training;
    p.dtype = dtype;
    plan_into(obj, p);
    return p;
  }

  static void check_tokens(const DLTensor* t, const loom_moe_plan_args& p, int64_t tokens,
                           DLDevice device, const char* what) {
    expect_moe_tensor(t, {tokens, p.model_dim}, p.dtype, device, what, "[tokens, model_dim]");
  }

  static void check_bias(const DLTensor* bias, const loom_moe_plan_args& p, DLDevice device) {
    if ((p.flags & LOOM_MOE_EXPERT_BIAS) == 0) {
      if (bias != nullptr) {
        fail_argument(
            "expert_bias is given but the layer does not balance by bias "
            "(bias_update_rate is 0): pass NULL");
      }
      return;
    }
    if (bias == nullptr) {
      fail_argument(
          "expert_bias is NULL but the layer balances by bias (bias_update_rate > 0): "
          "pass its float32 [experts] state");
    }
    expect_moe_tensor(bias, {p.experts}, DLDataType{kDLFloat, 32, 1}, device, "expert_bias",
                      "[experts]");
  }

  static const DLTensor& x_of(const DLTensor* x) { return expect_tensor(x, "x"); }

  static loom_status* plan(void* instance, loom_moe_plan_args* args) noexcept {
    return E::checked(instance, args, LOOM_MOE_PLAN_ARGS_SIZE, "moe plan args",
                      [](loom_moe_plan_args& a, const Instance<T>& self) {
                        check_scalars(a.tokens, 1, a.model_dim, a.hidden_dim, a.num_experts,
                                      a.layer, a.num_layers, "moe plan");
                        fill(&a, "moe plan args",
                             [&](loom_moe_plan_args& full) { plan_into(self.shared(), full); });
                      });
  }

  static loom_status* forward(void* instance, const loom_moe_forward_args* args) noexcept {
    return E::checked(
        instance, args, LOOM_MOE_FORWARD_ARGS_SIZE, "moe forward args",
        [](const loom_moe_forward_args& a, const Instance<T>& self) {
          const std::string call = "moe forward";
          check_scalars(a.tokens, 0, a.model_dim, a.hidden_dim, a.num_experts, a.layer,
                        a.num_layers, call);
          at_least(a.step, a.training != 0 ? 1 : 0, "step", call);
          at_least(a.first_token, 0, "first_token", call);
          T& obj = self.object();
          const DLTensor& x = x_of(a.x);
          const loom_moe_plan_args p =
              plan_for(obj, a.tokens, a.model_dim, a.hidden_dim, a.num_experts, a.layer,
                       a.num_layers, a.training, x.dtype);
          check_tokens(a.x, p, a.tokens, x.device, "x");
          moe_weights(a.weights, p, x.device, "weights");
          check_bias(a.expert_bias, p, x.device);
          check_tokens(a.y, p, a.tokens, x.device, "y");
          if (a.route_experts != nullptr) {
            expect_moe_tensor(a.route_experts, {a.tokens, p.top_k}, DLDataType{kDLInt, 32, 1},
                              x.device, "route_experts", "[tokens, top_k]");
          }
          if (a.route_weights != nullptr) {
            expect_moe_tensor(a.route_weights, {a.tokens, p.top_k}, DLDataType{kDLFloat, 32, 1},
                              x.device, "route_weights", "[tokens, top_k]");
          }
          if (a.stats != nullptr) {
            check_struct_size(a.stats->struct_size, LOOM_MOE_STATS_SIZE_1_5, "stats");
            if (a.stats->load != nullptr && a.stats->load_count != p.experts) {
              fail_argument("stats.load_count is " + std::to_string(a.stats->load_count) +
                            ", expected the " + std::to_string(p.experts) + " experts");
            }
            a.stats->aux_loss = 0;
            a.stats->dropped = 0;
            a.stats->expert_rows = 0;
            if (a.stats->load != nullptr) {
              std::memset(a.stats->load, 0, sizeof(int64_t) * static_cast<std::size_t>(p.experts));
            }
            set_moe_phases(a.stats, MoePhases{});
          }
          check_buffer(a.saved, a.saved_bytes, p.saved_bytes, "saved");
          check_buffer(a.workspace, a.workspace_bytes, p.workspace_bytes, "workspace");
          obj.forward(a, p);
        });
  }

  // A 1.6 caller's args end at `stream`: the class gets them copied into a zeroed full-size
  // struct (stats NULL).
  static loom_status* backward(void* instance, const loom_moe_backward_args* args) noexcept {
    return E::checked(
        instance, args, LOOM_MOE_BACKWARD_ARGS_SIZE_1_5, "moe backward args",
        [](const loom_moe_backward_args& in, const Instance<T>& self) {
          const loom_moe_backward_args a = normalized(&in, "moe backward args");
          const std::string call = "moe backward";
          check_scalars(a.tokens, 0, a.model_dim, a.hidden_dim, a.num_experts, a.layer,
                        a.num_layers, call);
          at_least(a.step, a.training != 0 ? 1 : 0, "step", call);
          at_least(a.first_token, 0, "first_token", call);
          if (!std::isfinite(a.aux_loss_coef)) {
            fail_argument(call + ": aux_loss_coef is not finite");
          }
          T& obj = self.object();
          const DLTensor& x = x_of(a.x);
          const loom_moe_plan_args p =
              plan_for(obj, a.tokens, a.model_dim, a.hidden_dim, a.num_experts, a.layer,
                       a.num_layers, a.training, x.dtype);
          check_tokens(a.x, p, a.tokens, x.device, "x");
          moe_weights(a.weights, p, x.device, "weights");
          check_tokens(a.dy, p, a.tokens, x.device, "dy");
          check_tokens(a.dx, p, a.tokens, x.device, "dx");
          moe_weights(a.grads, p, x.device, "grads", true);
          check_buffer(a.saved, a.saved_bytes, p.saved_bytes, "saved");
          check_buffer(a.workspace, a.workspace_bytes, p.workspace_bytes, "workspace");
          if (a.stats != nullptr) {
            check_struct_size(a.stats->struct_size, LOOM_MOE_STATS_SIZE, "backward stats");
            set_moe_phases(a.stats, MoePhases{});
          }
          obj.backward(a, p);
        });
  }

  // dispatch and combine carry no hidden_dim, layer or training: the plan made here (hidden_dim
  // 1, layer 0 of 1, eval) resolves only what the routing's shape needs (experts, top_k,
  // local_experts).
  static void check_dispatch(T& obj, const loom_moe_dispatch_args& a, const char* call_name) {
    const std::string call(call_name);
    at_least(a.tokens, 0, "tokens", call);
    at_least(a.model_dim, 1, "model_dim", call);
    at_least(a.num_experts, 0, "num_experts", call);
    at_least(a.top_k, 1, "top_k", call);
    const DLTensor& x = x_of(a.x);
    const loom_moe_plan_args p =
        plan_for(obj, a.tokens, a.model_dim, 1, a.num_experts, 0, 1, 0, x.dtype);
    if (a.top_k != p.top_k) {
      fail_argument(call + ": top_k is " + std::to_string(a.top_k) + " but the layer chooses " +
                    std::to_string(p.top_k) + " experts per token");
    }
    expect_moe_tensor(a.x, {a.tokens, a.model_dim}, x.dtype, x.device, "x", "[tokens, model_dim]");
    const DLTensor& rows = expect_tensor(a.rows, "rows");
    if (rows.ndim != 2 || rows.shape[1] != a.model_dim) {
      fail_argument("rows has shape " + shape_string(rows) + ", expected [rows, " +
                    std::to_string(a.model_dim) + "] (rows, model_dim)");
    }
    expect_dtype(rows, x.dtype, "rows");
    expect_contiguous(rows, "rows");
    expect_device(rows, x.device, "rows");
    moe_routing(a.route_experts, a.route_weights, a.tokens, a.top_k, p.experts, x.device);
    if (a.counts != nullptr && a.counts_count != p.local_experts) {
      fail_argument("counts_count is " + std::to_string(a.counts_count) + ", expected the " +
                    std::to_string(p.local_experts) + " local experts");
    }
  }

  static loom_status* dispatch(void* instance, const loom_moe_dispatch_args* args) noexcept {
    return E::checked(instance, args, LOOM_MOE_DISPATCH_ARGS_SIZE, "moe dispatch args",
                      [](const loom_moe_dispatch_args& a, const Instance<T>& self) {
                        T& obj = self.object();
                        check_dispatch(obj, a, "moe dispatch");
                        if (a.counts == nullptr) fail_argument("moe dispatch: counts is NULL");
                        if constexpr (kMoeDispatches<T>) obj.dispatch(a);
                      });
  }

  static loom_status* combine(void* instance, const loom_moe_dispatch_args* args) noexcept {
    return E::checked(instance, args, LOOM_MOE_DISPATCH_ARGS_SIZE, "moe combine args",
                      [](const loom_moe_dispatch_args& a, const Instance<T>& self) {
                        T& obj = self.object();
                        check_dispatch(obj, a, "moe combine");
                        if constexpr (kMoeCombines<T>) obj.combine(a);
                      });
  }

  static loom_status* reduce_gradients(void* instance, const loom_moe_reduce_args* args) noexcept {
    return E::checked(
        instance, args, LOOM_MOE_REDUCE_ARGS_SIZE, "moe reduce_gradients args",
        [](const loom_moe_reduce_args& a, const Instance<T>& self) {
          if (a.count < 0)
            fail_argument("moe reduce_gradients: count is " + std::to_string(a.count));
          if (a.count > 0 && a.tensors == nullptr) {
            fail_argument("moe reduce_gradients: tensors is NULL for " + std::to_string(a.count) +
                          " tensors");
          }
          for (int64_t i = 0; i < a.count; ++i) {
            const std::string what = "tensors[" + std::to_string(i) + "]";
            const DLTensor& t = expect_tensor(a.tensors[i], what);
            expect_fp32(t, what);
            expect_contiguous(t, what);
            if (i > 0) expect_same_device(t, what, *a.tensors[0], "tensors[0]");
          }
          if constexpr (kMoeReduces<T>) self.object().reduce_gradients(a);
        });
  }

  static const loom_moe_v1* get() {
    static_assert(
        requires(T & t, loom_moe_plan_args & p, const loom_moe_forward_args& f,
                 const loom_moe_backward_args& b) {
          t.plan(p);
          t.forward(f, p);
          t.backward(b, p);
        },
        "a Moe needs void plan(loom_moe_plan_args&), void forward(const loom_moe_forward_args&, "
        "const loom_moe_plan_args&) and void backward(const loom_moe_backward_args&, const "
        "loom_moe_plan_args&)");
    static const loom_moe_v1 table = [] {
      loom_moe_v1 v{};
      v.struct_size = LOOM_MOE_V1_SIZE;
      v.plan = &plan;
      v.forward = &forward;
      v.backward = &backward;
      if constexpr (kMoeDispatches<T>) v.dispatch = &dispatch;
      if constexpr (kMoeCombines<T>) v.combine = &combine;
      if constexpr (kMoeReduces<T>) v.reduce_gradients = &reduce_gradients;
      return v;
    }();
    return &table;
  }
};

template <>
struct KindTraits<Moe> {
  template <class T>
  static const void* table() {
    return MoeTable<T>::get();
  }
};

}  // namespace detail
}  // namespace loom::sdk

#endif  // LOOM_SDK_KINDS_MOE_HPP
