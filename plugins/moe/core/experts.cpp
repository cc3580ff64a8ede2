// Host grouped GEMMs (experts.hpp): one cblas GEMM per expert segment, the experts spread over
// the host's pool (each expert writes only its own rows and its own gradients, so the result
// does not depend on the thread count) and OpenBLAS single-threaded inside them, as the
// trainer runs it, so BLAS never starts threads of its own beside the pool's.
#include <loom/moe/experts.hpp>

#include "simd.hpp"

#include <loom/sdk/blas.hpp>
#include <loom/sdk/parallel.hpp>

#include <algorithm>
#include <stdexcept>
#include <type_traits>
#include <vector>

namespace loom::moe {

namespace {

// Row offsets of the experts' segments.
std::vector<int64_t> offsets(int local_experts, const int64_t* rows) {
  std::vector<int64_t> off(static_cast<size_t>(local_experts) + 1, 0);
  for (int e = 0; e < local_experts; ++e) {
    off[static_cast<size_t>(e) + 1] = off[static_cast<size_t>(e)] + std::max<int64_t>(rows[e], 0);
  }
  return off;
}

// C[m, n] = alpha * op(A) op(B) + beta * C, row-major. loom/sdk/blas.hpp: the plugin links
// OpenBLAS's serial build (the pthread one starts threads when it loads), which has no locking,
// so there the pool's blocks take turns in the GEMM itself (the gathers, activations and
// scatters around it still run on every thread); in a process with the pthread build (the
// trainer) the calls run at once.
template <class T>
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
          const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  sdk::blas::gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// h = act(pre) and dh *= act'(pre) over n values; GELU in fp32 through the vector kernel
// (within a few ulp of the libm formula, which the other cases use).
template <class T>
void act_rows(Activation act, const T* pre, T* h, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    if (act == Activation::Gelu) {
      simd::gelu_forward(pre, h, n);
      return;
    }
  }
  for (int64_t i = 0; i < n; ++i) h[i] = act_forward(act, pre[i]);
}
template <class T>
void act_grad_rows(Activation act, const T* pre, T* dh, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    if (act == Activation::Gelu) {
      simd::gelu_grad_mul(pre, dh, n);
      return;
    }
  }
  for (int64_t i = 0; i < n; ++i) dh[i] *= act_grad(act, pre[i]);
}

template <class T>
void add_bias(T* y, const T* b, int64_t n, int64_t width) {
  for (int64_t r = 0; r < n; ++r) {
    T* yr = y + r * width;
    for (int64_t c = 0; c < width; ++c) yr[c] += b[c];
  }
}

// g[c] += sum over rows r (ascending) of d[r, c], for the columns c in [c0, c1).
template <class T>
void add_colsum_cols(T* g, const T* d, int64_t n, int64_t width, int64_t c0, int64_t c1) {
  for (int64_t r = 0; r < n; ++r) {
    const T* dr = d + r * width;
    for (int64_t c = c0; c < c1; ++c) g[c] += dr[c];
  }
}

// Work items of a fixed size (never dependent on the thread count, so neither is the result):
// a block of rows of one expert, or a block of one expert's weight-gradient rows.
constexpr int64_t kRowBlock = 64;

struct Block {
  int64_t expert, begin, end;  // rows [begin, end) of the expert's segment (or of its gradient)
};

template <class Size>
std::vector<Block> blocks(int local_experts, Size&& size_of) {
  std::vector<Block> out;
  for (int64_t e = 0; e < local_experts; ++e) {
    const int64_t n = size_of(e);
    for (int64_t b = 0; b < n; b += kRowBlock) out.push_back({e, b, std::min(n, b + kRowBlock)});
  }
  return out;
}

template <class Fn>
void for_blocks(const std::vector<Block>& work, Fn&& fn) {
  sdk::parallel_for(work.size(), 1, [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) fn(work[i]);
  });
}

}  // namespace

template <class T>
void experts_forward(Activation act, int local_experts, const int64_t* rows, int64_t model_dim,
                     int64_t hidden_dim, const T* in, const ExpertWeights<T>& w, T* pre, T* h,
                     T* out) {
  sdk::blas::use_one_thread_per_call();
  const int64_t M = model_dim;
  const int64_t H = hidden_dim;
  const std::vector<int64_t> offs = offsets(local_experts, rows);
  const auto work = blocks(local_experts, [&](int64_t e) { return std::max<int64_t>(rows[e], 0); });
  for_blocks(work, [&](const Block& b) {
    const int64_t e = b.expert, n = b.end - b.begin;
    const int64_t off = offs[static_cast<size_t>(e)] + b.begin;
    const T* a = in + off * M;
    T* p = pre + off * H;
    T* hh = h + off * H;
    T* o = out + off * M;
    gemm(false, true, n, H, M, T(1), a, M, w.w1 + e * H * M, M, T(0), p, H);
    add_bias(p, w.b1 + e * H, n, H);
    act_rows(act, p, hh, n * H);
    gemm(false, true, n, M, H, T(1), hh, H, w.w2 + e * M * H, H, T(0), o, M);
    add_bias(o, w.b2 + e * M, n, M);
  });
}

template <class T>
void experts_backward(Activation act, int local_experts, const int64_t* rows, int64_t model_dim,
                      int64_t hidden_dim, const T* in, const T* pre, const T* dout,
                      const ExpertWeights<T>& w, const ExpertGrads<T>& g, T* h, T* dh, T* din) {
  sdk::blas::use_one_thread_per_call();
  const int64_t M = model_dim;
  const int64_t H = hidden_dim;
  const std::vector<int64_t> offs = offsets(local_experts, rows);
  auto count = [&](int64_t e) { return std::max<int64_t>(rows[e], 0); };
  // by rows: h = act(pre); dpre = (dout . w2_e) * act'(pre); din = dpre . w1_e
  for_blocks(blocks(local_experts, count), [&](const Block& b) {
    const int64_t e = b.expert, n = b.end - b.begin;
    const int64_t off = offs[static_cast<size_t>(e)] + b.begin;
    const T* p = pre + off * H;
    T* hh = h + off * H;
    T* dhh = dh + off * H;
    act_rows(act, p, hh, n * H);
    gemm(false, false, n, H, M, T(1), dout + off * M, M, w.w2 + e * M * H, H, T(0), dhh, H);
    act_grad_rows(act, p, dhh, n * H);
    if (din != nullptr) {
      gemm(false, false, n, M, H, T(1), dhh, H, w.w1 + e * H * M, M, T(0), din + off * M, M);
    }
  });
  // by gradient rows, over all of the expert's rows: dW2 += dout^T h, db2; dW1 += dpre^T in, db1
  for_blocks(blocks(local_experts, [&](int64_t e) { return count(e) > 0 ? M : 0; }),
             [&](const Block& b) {
               const int64_t e = b.expert, n = count(e), off = offs[static_cast<size_t>(e)];
               const int64_t r = b.end - b.begin;
               gemm(true, false, r, H, n, T(1), dout + off * M + b.begin, M, h + off * H, H, T(1),
                    g.w2 + e * M * H + b.begin * H, H);
               add_colsum_cols(g.b2 + e * M, dout + off * M, n, M, b.begin, b.end);
             });
  for_blocks(blocks(local_experts, [&](int64_t e) { return count(e) > 0 ? H : 0; }),
             [&](const Block& b) {
               const int64_t e = b.expert, n = count(e), off = offs[static_cast<size_t>(e)];
               const int64_t r = b.end - b.begin;
               gemm(true, false, r, M, n, T(1), dh + off * H + b.begin, H, in + off * M, M, T(1),
                    g.w1 + e * H * M + b.begin * M, M);
               add_colsum_cols(g.b1 + e * H, dh + off * H, n, H, b.begin, b.end);
             });
}

#define LOOM_MOE_EXPERTS_INSTANTIATE(T)                                                          \
  template void experts_forward<T>(Activation, int, const int64_t*, int64_t, int64_t, const T*,  \
                                   const ExpertWeights<T>&, T*, T*, T*);                         \
  template void experts_backward<T>(Activation, int, const int64_t*, int64_t, int64_t, const T*, \
                                    const T*, const T*, const ExpertWeights<T>&,                 \
                                    const ExpertGrads<T>&, T*, T*, T*);
LOOM_MOE_EXPERTS_INSTANTIATE(float)
LOOM_MOE_EXPERTS_INSTANTIATE(double)
#undef LOOM_MOE_EXPERTS_INSTANTIATE

}  // namespace loom::moe
