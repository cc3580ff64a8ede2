// The model's token-routing seam: a router decides, per layer and per forward, which
// positions of each sequence a Block processes. Gpt<T> consults the hook for every layer:
//
//   plan -> kept (and whether the layer is routed now, and whether it is gated);
//   routed: select (indices, and gates for a learned router) on the layer's input x,
//           gather x -> x_kept [B, K, C], y_kept = Block(x_kept) (causal attention among the
//           kept positions, in order), out = copy of x, scatter over out of
//           y_kept (ungated) or x_kept + gate * (y_kept - x_kept) (gated);
//   backward: dy_kept = gather(dout); gated: dgate = <dy_kept, y_kept - x_kept> per token,
//           the block gets gate * dy_kept and (1 - gate) * dy_kept adds to dx_kept;
//           dx = copy of dout, scatter dx_kept over it; gated: the hook's backward adds the
//           gates' terms into dx and into the layer's router weight gradient.
//
// A gated layer owns a learned router weight "h.L.router.w" [C], a parameter of the model
// (Gpt::parameters()), initialised to 0 (a sigmoid gate starts at 0.5). The trainer's hook
// calls a loom.router/1 plugin; the tests implement hooks of their own.
#pragma once

#include <cstdint>

namespace loom::trainer {

// What the hook decides for one layer of one forward.
struct RoutePlan {
  int kept = 0;         // positions of each sequence the layer processes, 1 .. seq
  bool routed = false;  // kept < seq: select, gather, run the block on the kept rows, scatter
  bool gated = false;   // learned: select writes gates, the update is scaled by them (the
                        // select/gather path runs even when kept == seq)
};

template <typename T>
class RouterHookT {
 public:
  virtual ~RouterHookT() = default;
  // Whether layer `layer` of `num_layers` holds a learned router weight [channels] (asked
  // once per layer when the hook is installed). Only such a layer may be gated.
  virtual bool has_weight(int layer, int num_layers) = 0;
  // The plan of layer `layer` for a forward of `batch` sequences of `seq` positions.
  virtual RoutePlan plan(int layer, int num_layers, int batch, int seq, bool training) = 0;
  // x: [batch, seq, channels], the layer's input; weight: the layer's router weight (NULL when
  // it has none). Writes indices [batch, kept] (each row strictly increasing, in [0, seq))
  // and, when gated, gates [batch, kept] (NULL otherwise).
  virtual void select(int layer, int num_layers, int batch, int seq, int channels, bool training,
                      const T* x, const T* weight, int32_t* indices, T* gates) = 0;
  // kept[b, j, :] = full[b, indices[b, j], :], for layer `layer` (named in errors).
  virtual void gather(int layer, const T* full, T* kept, const int32_t* indices, int batch, int seq,
                      int kept_count, int channels) = 0;
  // full[b, indices[b, j], :] = kept[b, j, :]; the other positions of full unchanged.
  virtual void scatter(int layer, T* full, const T* kept, const int32_t* indices, int batch,
                       int seq, int kept_count, int channels) = 0;
  // A gated layer: ADDS the gates' contribution (from dgates [batch, kept]) into dx
  // [batch, seq, channels] and into dweight [channels].
  virtual void backward(int layer, int num_layers, int batch, int seq, int channels, const T* x,
                        const T* weight, const int32_t* indices, const T* dgates, T* dx,
                        T* dweight) = 0;
};

using RouterHook = RouterHookT<float>;

}  // namespace loom::trainer
