// The "loom.router/1" kind in the SDK (loom/kinds/router.h): the base class a token router
// derives from and the table the SDK builds from it. The checked views a router receives
// (RouterMove, token_tensor, router_indices) are in loom/sdk/router.hpp, included here; they
// stay a header of their own because CUDA sources and callers use them without a table.
#ifndef LOOM_SDK_KINDS_ROUTER_HPP
#define LOOM_SDK_KINDS_ROUTER_HPP

#include <loom/kinds/router.h>
#include <loom/sdk/kinds/table.hpp>
#include <loom/sdk/plugin.hpp>
#include <loom/sdk/router.hpp>
#include <loom/sdk/tensor.hpp>

#include <cstdint>
#include <string>

namespace loom::sdk {

// "loom.router/1" (since 1.4)
//   required: void plan(loom_router_plan_args&)                   [any]: kept, buffer sizes
//             void select(const loom_router_select_args&)         [any]
//             void gather(const loom::sdk::RouterMove&)            [any]
//             void scatter(const loom::sdk::RouterMove&)           [any]
//             void advance(loom_router_advance_args&)              [instance]
//   optional: void backward(const loom_router_backward_args&)     [any]: a learned router
//   The table sets `flags` itself: ROUTED when the class's plan keeps fewer than seq_len
//   positions, LEARNED when the class has backward; a kept outside 1 .. seq_len from the
//   class is a plugin bug (INTERNAL). Before plan, select and advance the SDK checks the
//   scalars (batch, seq_len, channels, step, num_layers >= 1; seq_len <= 2^31 - 1;
//   0 <= layer < num_layers). Before select it plans the same arguments and checks every
//   tensor against that plan: indices int32 [batch, kept], x [batch, seq_len, channels]
//   (required for a learned router, and weight [channels] of x's dtype with it), gates
//   [batch, kept] of x's dtype (a learned router), saved and workspace present, as large
//   as planned and 256-byte aligned when their sizes are not 0, one device. backward's
//   arguments name no step or layer, so it cannot plan: kept is indices' second extent
//   (1 .. seq_len), and x, weight, dgates [batch, kept], dx [batch, seq_len, channels] and
//   dweight [channels] must agree with it, of x's dtype, on one device; that saved holds
//   what select wrote is the class's to trust. The values of device index rows are the
//   class's to trust too. gather and scatter receive a RouterMove (loom/sdk/router.hpp),
//   whose host index rows are already checked. The tensor a call writes (gather's kept,
//   scatter's full, backward's dx) must have rows that do not overlap
//   (expect_disjoint_rows); the tensors it only reads may (a zero batch stride broadcasts).
struct Router {
  static constexpr const char* kKind = LOOM_KIND_ROUTER;
  using sdk_kind = Router;
};

namespace detail {

template <class T>
constexpr bool kRouterLearns = requires(T& t, const loom_router_backward_args& a) {
  t.backward(a);
};

template <class T>
struct RouterTable {
  using E = Entry<T>;

  static void check_scalars(int64_t batch, int64_t seq_len, int64_t channels, int64_t step,
                            int32_t layer, int32_t num_layers, const char* call) {
    const std::string c(call);
    at_least(batch, 1, "batch", c);
    at_least(seq_len, 1, "seq_len", c);
    at_least(channels, 1, "channels", c);
    at_least(step, 1, "step", c);
    at_least(num_layers, 1, "num_layers", c);
    if (seq_len > INT32_MAX) {
      fail_argument(c + ": seq_len " + std::to_string(seq_len) +
                    " is above 2^31 - 1, the most int32 indices address");
    }
    check_layer(layer, num_layers, c);
  }

  // The class's plan, then the flags the table owns and the check of kept.
  static void plan_into(T& obj, loom_router_plan_args& full) {
    full.flags = 0;
    full.kept = 0;
    full.saved_bytes = 0;
    full.workspace_bytes = 0;
    obj.plan(full);
    if (full.kept < 1 || full.kept > full.seq_len) {
      plugin_bug("plan", "kept " + std::to_string(full.kept) + " of " +
                             std::to_string(full.seq_len) +
                             " positions; kept must be 1 .. seq_len");
    }
    full.flags = (full.kept < full.seq_len ? LOOM_ROUTER_ROUTED : 0u) |
                 (kRouterLearns<T> ? LOOM_ROUTER_LEARNED : 0u);
  }

  static loom_router_plan_args plan_for(T& obj, int64_t batch, int64_t seq_len, int64_t channels,
                                        int64_t step, int32_t layer, int32_t num_layers,
                                        uint32_t training, DLDataType dtype) {
    loom_router_plan_args p{};
    p.struct_size = LOOM_ROUTER_PLAN_ARGS_SIZE;
    p.batch = batch;
    p.seq_len = seq_len;
    p.channels = channels;
    p.step = step;
    p.layer = layer;
    p.num_layers = num_layers;
    p.training = training;
    p.dtype = dtype;
    plan_into(obj, p);
    return p;
  }

  // x [batch, seq_len, channels] and weight [channels] of one dtype on `device`.
  static void check_x_weight(const DLTensor* x, const DLTensor* weight, int64_t batch,
                             int64_t seq_len, int64_t channels, DLDevice device) {
    const TokenTensor xv = token_tensor(x, "x");
    if (xv.batch != batch || xv.positions != seq_len || xv.channels != channels) {
      fail_argument("x has shape " + shape_string(*x) + ", expected [" + std::to_string(batch) +
                    ", " + std::to_string(seq_len) + ", " + std::to_string(channels) + "]");
    }
    expect_device(*x, device, "x");
    if (weight != nullptr) {
      const DLTensor& w = expect_tensor(weight, "weight");
      expect_dtype(w, x->dtype, "weight");
      expect_contiguous(w, "weight");
      if (w.ndim != 1 || w.shape[0] != channels) {
        fail_argument("weight has shape " + shape_string(w) + ", expected [" +
                      std::to_string(channels) + "]");
      }
      expect_device(w, device, "weight");
    }
  }

  static void check_per_kept(const DLTensor* t, DLDataType dtype, int64_t batch, int64_t kept,
                             DLDevice device, const char* what) {
    const DLTensor& d = expect_tensor(t, what);
    expect_dtype(d, dtype, what);
    expect_contiguous(d, what);
    if (d.ndim != 2 || d.shape[0] != batch || d.shape[1] != kept) {
      fail_argument(std::string(what) + " has shape " + shape_string(d) + ", expected [" +
                    std::to_string(batch) + ", " + std::to_string(kept) + "] (batch, kept)");
    }
    expect_device(d, device, what);
  }

  static loom_status* plan(void* instance, loom_router_plan_args* args) noexcept {
    return E::checked(instance, args, LOOM_ROUTER_PLAN_ARGS_SIZE, "router plan args",
                      [](loom_router_plan_args& a, const Instance<T>& self) {
                        check_scalars(a.batch, a.seq_len, a.channels, a.step, a.layer, a.num_layers,
                                      "router plan");
                        fill(&a, "router plan args",
                             [&](loom_router_plan_args& full) { plan_into(self.shared(), full); });
                      });
  }

  static loom_status* select(void* instance, const loom_router_select_args* args) noexcept {
    return E::checked(
        instance, args, LOOM_ROUTER_SELECT_ARGS_SIZE, "router select args",
        [](const loom_router_select_args& a, const Instance<T>& self) {
          check_scalars(a.batch, a.seq_len, a.channels, a.step, a.layer, a.num_layers,
                        "router select");
          T& obj = self.shared();
          const DLTensor& idx = expect_tensor(a.indices, "indices");
          if constexpr (kRouterLearns<T>) {
            // Before the plan, which a learned router makes for x's dtype.
            if (a.x == nullptr) {
              fail_argument("x is NULL; a learned router scores the layer's input");
            }
            if (a.weight == nullptr) {
              fail_argument("weight is NULL; a learned router needs its weight");
            }
          }
          const DLDataType dtype = a.x != nullptr ? a.x->dtype : DLDataType{kDLFloat, 32, 1};
          const loom_router_plan_args p = plan_for(obj, a.batch, a.seq_len, a.channels, a.step,
                                                   a.layer, a.num_layers, a.training, dtype);
          router_indices(&idx, a.batch, p.kept, "indices");
          if constexpr (kRouterLearns<T>) {
            check_x_weight(a.x, a.weight, a.batch, a.seq_len, a.channels, idx.device);
            check_per_kept(a.gates, a.x->dtype, a.batch, p.kept, idx.device, "gates");
          } else if (a.x != nullptr) {
            check_x_weight(a.x, a.weight, a.batch, a.seq_len, a.channels, idx.device);
          }
          check_buffer(a.saved, a.saved_bytes, p.saved_bytes, "saved");
          check_buffer(a.workspace, a.workspace_bytes, p.workspace_bytes, "workspace");
          obj.select(a);
        });
  }

  static loom_status* gather(void* instance, const loom_router_move_args* args) noexcept {
    return E::checked(instance, args, LOOM_ROUTER_MOVE_ARGS_SIZE, "router gather args",
                      [](const loom_router_move_args& a, const Instance<T>& self) {
                        const RouterMove m = router_move(a, RouterMoveKind::kGather);
                        self.shared().gather(m);
                      });
  }

  static loom_status* scatter(void* instance, const loom_router_move_args* args) noexcept {
    return E::checked(instance, args, LOOM_ROUTER_MOVE_ARGS_SIZE, "router scatter args",
                      [](const loom_router_move_args& a, const Instance<T>& self) {
                        const RouterMove m = router_move(a, RouterMoveKind::kScatter);
                        self.shared().scatter(m);
                      });
  }

  static loom_status* advance(void* instance, loom_router_advance_args* args) noexcept {
    return E::checked(instance, args, LOOM_ROUTER_ADVANCE_ARGS_SIZE, "router advance args",
                      [](loom_router_advance_args& a, const Instance<T>& self) {
                        check_scalars(a.batch, a.seq_len, 1, a.step, 0, a.num_layers,
                                      "router advance");
                        fill(&a, "router advance args", [&](loom_router_advance_args& full) {
                          full.layer_tokens = 0;
                          full.consumed_layer_tokens = 0;
                          self.object().advance(full);
                        });
                      });
  }

  static loom_status* backward(void* instance, const loom_router_backward_args* args) noexcept {
    return E::checked(
        instance, args, LOOM_ROUTER_BACKWARD_ARGS_SIZE, "router backward args",
        [](const loom_router_backward_args& a, const Instance<T>& self) {
          const std::string call = "router backward";
          at_least(a.batch, 1, "batch", call);
          at_least(a.seq_len, 1, "seq_len", call);
          at_least(a.channels, 1, "channels", call);
          if (a.x == nullptr || a.weight == nullptr) {
            fail_argument(std::string(a.x == nullptr ? "x" : "weight") +
                          " is NULL; backward needs x and weight as given to select");
          }
          const DLTensor& idx = expect_tensor(a.indices, "indices");
          const int64_t kept = idx.ndim == 2 ? idx.shape[1] : -1;
          if (kept < 1 || kept > a.seq_len) {
            fail_argument("indices has shape " + shape_string(idx) +
                          ", expected [batch, kept] with " + "1 <= kept <= seq_len " +
                          std::to_string(a.seq_len));
          }
          router_indices(&idx, a.batch, kept, "indices");
          check_x_weight(a.x, a.weight, a.batch, a.seq_len, a.channels, idx.device);
          check_per_kept(a.dgates, a.x->dtype, a.batch, kept, idx.device, "dgates");
          const TokenTensor dx = token_tensor(a.dx, "dx");
          if (dx.batch != a.batch || dx.positions != a.seq_len || dx.channels != a.channels) {
            fail_argument("dx has shape " + shape_string(*a.dx) + " but x has " +
                          shape_string(*a.x));
          }
          expect_dtype(*a.dx, a.x->dtype, "dx");
          expect_device(*a.dx, idx.device, "dx");
          expect_disjoint_rows(dx, "dx");
          const DLTensor& dw = expect_tensor(a.dweight, "dweight");
          expect_same_shape(dw, "dweight", *a.weight, "weight");
          expect_dtype(dw, a.x->dtype, "dweight");
          expect_contiguous(dw, "dweight");
          expect_device(dw, idx.device, "dweight");
          if constexpr (kRouterLearns<T>) self.shared().backward(a);
        });
  }

  static const loom_router_v1* get() {
    static_assert(
        requires(T & t, loom_router_plan_args & p, const loom_router_select_args& s,
                 const RouterMove& m, loom_router_advance_args& adv) {
          t.plan(p);
          t.select(s);
          t.gather(m);
          t.scatter(m);
          t.advance(adv);
        },
        "a Router needs void plan(loom_router_plan_args&), void select(const "
        "loom_router_select_args&), void gather(const loom::sdk::RouterMove&), void "
        "scatter(const loom::sdk::RouterMove&) and void advance(loom_router_advance_args&)");
    static const loom_router_v1 table = [] {
      loom_router_v1 v{};
      v.struct_size = LOOM_ROUTER_V1_SIZE;
      v.plan = &plan;
      v.select = &select;
      v.gather = &gather;
      v.scatter = &scatter;
      v.advance = &advance;
      if constexpr (kRouterLearns<T>) v.backward = &backward;
      return v;
    }();
    return &table;
  }
};

template <>
struct KindTraits<Router> {
  template <class T>
  static const void* table() {
    return RouterTable<T>::get();
  }
};

}  // namespace detail
}  // namespace loom::sdk

#endif  // LOOM_SDK_KINDS_ROUTER_HPP
