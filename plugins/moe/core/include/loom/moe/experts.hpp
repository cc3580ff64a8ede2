// Declared public interface of loom_moe_core: bench/, the trainer and tests may include this
// header (as <loom/moe/experts.hpp>); the core's other headers are private to it.
//
// The experts' two-layer MLPs as grouped GEMMs over variable row counts (host: one OpenBLAS
// GEMM per expert segment; experts_cuda.cu: cuBLAS). Expert e's rows are
// [offset_e, offset_e + rows[e]) of the input, offset the exclusive prefix sum of rows.
//   pre = in . w1_e^T + b1_e   [n, H]   (w1 [E_l, H, M], b1 [E_l, H])
//   h   = act(pre)
//   out = h . w2_e^T + b2_e    [n, M]   (w2 [E_l, M, H], b2 [E_l, M])
#pragma once

#include <cstdint>

#include <loom/moe/moe_math.hpp>

namespace loom::moe {

template <class T>
struct ExpertWeights {
  const T* w1 = nullptr;
  const T* b1 = nullptr;
  const T* w2 = nullptr;
  const T* b2 = nullptr;
};

template <class T>
struct ExpertGrads {
  T* w1 = nullptr;
  T* b1 = nullptr;
  T* w2 = nullptr;
  T* b2 = nullptr;
};

// pre [R, H] (kept for backward), h [R, H] (scratch), out [R, M] (written).
template <class T>
void experts_forward(Activation act, int local_experts, const int64_t* rows, int64_t model_dim,
                     int64_t hidden_dim, const T* in, const ExpertWeights<T>& w, T* pre, T* h,
                     T* out);

// Grads ADDED; din [R, M] written (may be null: not computed). h, dh [R, H] scratch.
template <class T>
void experts_backward(Activation act, int local_experts, const int64_t* rows, int64_t model_dim,
                      int64_t hidden_dim, const T* in, const T* pre, const T* dout,
                      const ExpertWeights<T>& w, const ExpertGrads<T>& g, T* h, T* dh, T* din);

}  // namespace loom::moe
