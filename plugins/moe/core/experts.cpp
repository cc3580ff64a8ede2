// Host grouped GEMMs (experts.hpp): one cblas GEMM per expert segment.
#include "experts.hpp"

#include <cblas.h>
#include <loom/sdk/parallel.hpp>

#include <climits>
#include <stdexcept>

namespace loom::moe {

namespace {

int blas_int(int64_t v) {
  if (v > INT_MAX) throw std::invalid_argument("moe: a GEMM dimension exceeds the BLAS range");
  return static_cast<int>(v);
}

// C[m, n] = alpha * op(A) op(B) + beta * C, row-major.
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              blas_int(m), blas_int(n), blas_int(k), alpha, a, blas_int(lda), b, blas_int(ldb),
              beta, c, blas_int(ldc));
}
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
          int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              blas_int(m), blas_int(n), blas_int(k), alpha, a, blas_int(lda), b, blas_int(ldb),
              beta, c, blas_int(ldc));
}

template <class T>
void add_bias(T* y, const T* b, int64_t n, int64_t width) {
  for (int64_t r = 0; r < n; ++r) {
    T* yr = y + r * width;
    for (int64_t c = 0; c < width; ++c) yr[c] += b[c];
  }
}

template <class T>
void add_colsum(T* g, const T* d, int64_t n, int64_t width) {
  for (int64_t r = 0; r < n; ++r) {
    const T* dr = d + r * width;
    for (int64_t c = 0; c < width; ++c) g[c] += dr[c];
  }
}

}  // namespace

template <class T>
void experts_forward(Activation act, int local_experts, const int64_t* rows, int64_t model_dim,
                     int64_t hidden_dim, const T* in, const ExpertWeights<T>& w, T* pre, T* h,
                     T* out) {
  const int64_t M = model_dim;
  const int64_t H = hidden_dim;
  int64_t off = 0;
  for (int e = 0; e < local_experts; ++e) {
    const int64_t n = rows[e];
    if (n <= 0) continue;
    const T* a = in + off * M;
    T* p = pre + off * H;
    T* hh = h + off * H;
    T* o = out + off * M;
    gemm(false, true, n, H, M, T(1), a, M, w.w1 + e * H * M, M, T(0), p, H);
    add_bias(p, w.b1 + e * H, n, H);
    const int64_t count = n * H;
    sdk::parallel_for(static_cast<size_t>(count), 4096, [&](size_t lo, size_t hi) {
      for (size_t i = lo; i < hi; ++i) hh[i] = act_forward(act, p[i]);
    });
    gemm(false, true, n, M, H, T(1), hh, H, w.w2 + e * M * H, H, T(0), o, M);
    add_bias(o, w.b2 + e * M, n, M);
    off += n;
  }
}

template <class T>
void experts_backward(Activation act, int local_experts, const int64_t* rows, int64_t model_dim,
                      int64_t hidden_dim, const T* in, const T* pre, const T* dout,
                      const ExpertWeights<T>& w, const ExpertGrads<T>& g, T* h, T* dh, T* din) {
  const int64_t M = model_dim;
  const int64_t H = hidden_dim;
  int64_t off = 0;
  for (int e = 0; e < local_experts; ++e) {
    const int64_t n = rows[e];
    if (n <= 0) continue;
    const T* a = in + off * M;
    const T* p = pre + off * H;
    const T* d = dout + off * M;
    T* hh = h + off * H;
    T* dhh = dh + off * H;
    const int64_t count = n * H;
    sdk::parallel_for(static_cast<size_t>(count), 4096, [&](size_t lo, size_t hi) {
      for (size_t i = lo; i < hi; ++i) hh[i] = act_forward(act, p[i]);
    });
    // dh = dout . w2_e; dW2 += dout^T h; db2 += colsum(dout)
    gemm(false, false, n, H, M, T(1), d, M, w.w2 + e * M * H, H, T(0), dhh, H);
    gemm(true, false, M, H, n, T(1), d, M, hh, H, T(1), g.w2 + e * M * H, H);
    add_colsum(g.b2 + e * M, d, n, M);
    sdk::parallel_for(static_cast<size_t>(count), 4096, [&](size_t lo, size_t hi) {
      for (size_t i = lo; i < hi; ++i) dhh[i] *= act_grad(act, p[i]);
    });
    // dW1 += dpre^T in; db1 += colsum(dpre); din = dpre . w1_e
    gemm(true, false, H, M, n, T(1), dhh, H, a, M, T(1), g.w1 + e * H * M, M);
    add_colsum(g.b1 + e * H, dhh, n, H);
    if (din != nullptr) {
      gemm(false, false, n, M, H, T(1), dhh, H, w.w1 + e * H * M, M, T(0), din + off * M, M);
    }
    off += n;
  }
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
