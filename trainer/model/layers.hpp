// The model's layers, llm.c style: each layer's forward and backward side by side, on flat
// row-major arrays. Templates over the scalar type so the tests can run every layer (and the
// whole model) in double precision against finite differences; the trainer uses float.
//
// Conventions: N rows (tokens) of C features; B sequences of T positions (N = B*T); NH heads.
// Every backward ADDS into its input gradient and parameter gradients (the caller zeroes
// them), except crossentropy_backward, which writes dlogits.
//
// Threading: matmuls call OpenBLAS single-threaded on disjoint blocks of the output, one per
// thread of libloom's pool (so OpenBLAS and the pool never compete for cores); the
// elementwise kernels split rows over the same pool.
#pragma once

#include <loom/sdk/blas.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace loom::trainer::layers {

// libloom's process-wide pool (defined in model.cpp over loom_parallel_for): fn over
// disjoint blocks covering [0, n), each beginning at a multiple of `grain`. fn must not throw.
void parallel_for(size_t n, size_t grain, const std::function<void(size_t, size_t)>& fn);
int pool_threads();

// ---- scalar helpers --------------------------------------------------------------------------

// exp for float: range reduction to [-ln2/2, ln2/2] and a degree-6 polynomial (about 1 ulp),
// branch-free so loops over it vectorise; inputs are clamped to the finite range.
inline float fast_exp(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  const float t = x * 1.44269504088896341f;
  const int k = static_cast<int>(t + 128.5f) - 128;  // round(t), t in (-126, 127)
  const float kf = static_cast<float>(k);
  const float r = (x - kf * 0.693359375f) + kf * 2.12194440e-4f;
  const float z = r * r;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * z + r + 1.0f;
  return p * std::bit_cast<float>((k + 127) << 23);
}
inline double fast_exp(double x) { return std::exp(x); }

template <typename T>
inline T fast_tanh(T x) {
  return T(1) - T(2) / (fast_exp(T(2) * x) + T(1));
}

// ---- elementwise spans -----------------------------------------------------------------------
// Generic loops: used for double, and for the tails of the float kernels in kernels.cpp,
// which are written with Highway and dispatched at run time to the CPU's best target.

template <typename T>
constexpr T kGeluScale = static_cast<T>(0.79788456080286535588);  // sqrt(2/pi)

template <typename T>
inline void gelu_forward_span(T* out, const T* inp, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const T x = inp[i];
    const T u = kGeluScale<T> * (x + T(0.044715) * x * x * x);
    out[i] = T(0.5) * x * (T(1) + fast_tanh(u));
  }
}

template <typename T>
inline void gelu_backward_span(T* dinp, const T* inp, const T* dout, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const T x = inp[i];
    const T u = kGeluScale<T> * (x + T(0.044715) * x * x * x);
    const T th = fast_tanh(u);
    const T du = kGeluScale<T> * (T(1) + T(3) * T(0.044715) * x * x);
    const T g = T(0.5) * (T(1) + th) + T(0.5) * x * (T(1) - th * th) * du;
    dinp[i] += g * dout[i];
  }
}

// x[i] = exp(x[i] - shift) for i < n; returns the sum (16 partial sums, then combined).
template <typename T>
inline T exp_sum_span(T* x, size_t n, T shift) {
  for (size_t i = 0; i < n; ++i) x[i] = fast_exp(x[i] - shift);
  T acc[16] = {};
  size_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (size_t j = 0; j < 16; ++j) acc[j] += x[i + j];
  T sum = 0;
  for (; i < n; ++i) sum += x[i];
  for (size_t j = 0; j < 16; ++j) sum += acc[j];
  return sum;
}

// Float versions (kernels.cpp): Highway, every target, the best one chosen at run time.
void gelu_forward_span(float* out, const float* inp, size_t n);
void gelu_backward_span(float* dinp, const float* inp, const float* dout, size_t n);
float exp_sum_span(float* x, size_t n, float shift);
// The Highway target the float spans run on (for logs and tests), e.g. "AVX2".
const char* kernel_target();
// Applies LOOM_SIMD_MAX (avx512, avx2, sse4, ssse3, baseline): no Highway target better than
// it is used, here and in every plugin (they share libhwy), so an AVX-512 machine can run the
// code path of an AVX2 one. Returns the cap, or "" when unset; throws on an unknown value.
std::string cap_simd_from_env();

// ---- GEMM ------------------------------------------------------------------------------------

// loom/sdk/blas.hpp: OpenBLAS single-threaded per call, concurrent calls only where the loaded
// build allows them (the pthread one, which the trainer links).
inline void gemm(bool ta, bool tb, int m, int n, int k, float alpha, const float* a, int lda,
                 const float* b, int ldb, float beta, float* c, int ldc) {
  ::loom::sdk::blas::gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
inline void gemm(bool ta, bool tb, int m, int n, int k, double alpha, const double* a, int lda,
                 const double* b, int ldb, double beta, double* c, int ldc) {
  ::loom::sdk::blas::gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// C[m,n] = alpha * op(A)[m,k] * op(B)[k,n] + beta * C, row-major, split over the pool along
// the larger of m and n into blocks of 64 rows/columns, one sgemm call per block whatever the
// thread count: OpenBLAS may pick another kernel (and so another rounding) for another block
// shape (its Haswell/Zen kernels do), so the blocks, not the threads, fix the bits.
template <typename T>
void par_gemm(bool ta, bool tb, int m, int n, int k, T alpha, const T* a, int lda, const T* b,
              int ldb, T beta, T* c, int ldc) {
  constexpr size_t kGrain = 64;
  if (m >= n) {
    parallel_for(static_cast<size_t>(m), kGrain, [&](size_t lo, size_t hi) {
      for (size_t r = lo; r < hi; r += kGrain) {
        const size_t e = std::min(hi, r + kGrain);
        const T* ab = ta ? a + r : a + r * static_cast<size_t>(lda);
        gemm(ta, tb, static_cast<int>(e - r), n, k, alpha, ab, lda, b, ldb, beta,
             c + r * static_cast<size_t>(ldc), ldc);
      }
    });
  } else {
    parallel_for(static_cast<size_t>(n), kGrain, [&](size_t lo, size_t hi) {
      for (size_t q = lo; q < hi; q += kGrain) {
        const size_t e = std::min(hi, q + kGrain);
        const T* bb = tb ? b + q * static_cast<size_t>(ldb) : b + q;
        gemm(ta, tb, m, static_cast<int>(e - q), k, alpha, a, lda, bb, ldb, beta, c + q, ldc);
      }
    });
  }
}

// ---- token + position embedding --------------------------------------------------------------

// out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:]
template <typename T>
void encoder_forward(T* out, const int32_t* tokens, const T* wte, const T* wpe, int B, int Tn,
                     int C) {
  parallel_for(static_cast<size_t>(B) * Tn, 16, [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) {
      const T* e = wte + static_cast<size_t>(tokens[i]) * C;
      const T* p = wpe + (i % static_cast<size_t>(Tn)) * C;
      T* o = out + i * C;
      for (int c = 0; c < C; ++c) o[c] = e[c] + p[c];
    }
  });
}

// Serial: several positions may share a token row (a scatter-add).
template <typename T>
void encoder_backward(T* dwte, T* dwpe, const T* dout, const int32_t* tokens, int B, int Tn,
                      int C) {
  for (size_t i = 0; i < static_cast<size_t>(B) * Tn; ++i) {
    const T* d = dout + i * C;
    T* e = dwte + static_cast<size_t>(tokens[i]) * C;
    T* p = dwpe + (i % static_cast<size_t>(Tn)) * C;
    for (int c = 0; c < C; ++c) {
      e[c] += d[c];
      p[c] += d[c];
    }
  }
}

// ---- LayerNorm -------------------------------------------------------------------------------

template <typename T>
void layernorm_forward(T* out, T* mean, T* rstd, const T* inp, const T* w, const T* b, int N,
                       int C) {
  parallel_for(static_cast<size_t>(N), 8, [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) {
      const T* x = inp + i * C;
      T m = 0;
      for (int c = 0; c < C; ++c) m += x[c];
      m /= static_cast<T>(C);
      T v = 0;
      for (int c = 0; c < C; ++c) v += (x[c] - m) * (x[c] - m);
      v /= static_cast<T>(C);
      const T s = T(1) / std::sqrt(v + T(1e-5));
      T* o = out + i * C;
      for (int c = 0; c < C; ++c) o[c] = (x[c] - m) * s * w[c] + b[c];
      mean[i] = m;
      rstd[i] = s;
    }
  });
}

template <typename T>
void layernorm_backward(T* dinp, T* dw, T* db, const T* dout, const T* inp, const T* w,
                        const T* mean, const T* rstd, int N, int C) {
  // dinp = rstd * (dnorm - mean(dnorm) - norm * mean(dnorm * norm)), dnorm = dout * w.
  parallel_for(static_cast<size_t>(N), 8, [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) {
      const T* x = inp + i * C;
      const T* d = dout + i * C;
      const T m = mean[i];
      const T s = rstd[i];
      T dmean = 0;
      T dnorm_norm = 0;
      for (int c = 0; c < C; ++c) {
        const T dn = d[c] * w[c];
        dmean += dn;
        dnorm_norm += dn * (x[c] - m) * s;
      }
      dmean /= static_cast<T>(C);
      dnorm_norm /= static_cast<T>(C);
      T* dx = dinp + i * C;
      for (int c = 0; c < C; ++c) {
        const T norm = (x[c] - m) * s;
        dx[c] += (d[c] * w[c] - dmean - norm * dnorm_norm) * s;
      }
    }
  });
  // dw, db: column blocks, each thread walking all rows (no reduction across threads).
  parallel_for(static_cast<size_t>(C), 16, [&](size_t lo, size_t hi) {
    for (size_t i = 0; i < static_cast<size_t>(N); ++i) {
      const T* x = inp + i * C;
      const T* d = dout + i * C;
      const T m = mean[i];
      const T s = rstd[i];
      for (size_t c = lo; c < hi; ++c) {
        dw[c] += d[c] * (x[c] - m) * s;
        db[c] += d[c];
      }
    }
  });
}

// ---- Linear: out[N,OC] = inp[N,IC] * w[OC,IC]^T + bias ----------------------------------------

template <typename T>
void matmul_forward(T* out, const T* inp, const T* w, const T* bias, int N, int IC, int OC) {
  par_gemm<T>(false, true, N, OC, IC, T(1), inp, IC, w, IC, T(0), out, OC);
  if (bias != nullptr) {
    parallel_for(static_cast<size_t>(N), 16, [&](size_t lo, size_t hi) {
      for (size_t i = lo; i < hi; ++i) {
        T* o = out + i * OC;
        for (int c = 0; c < OC; ++c) o[c] += bias[c];
      }
    });
  }
}

template <typename T>
void matmul_backward(T* dinp, T* dw, T* dbias, const T* dout, const T* inp, const T* w, int N,
                     int IC, int OC) {
  // dinp[N,IC] += dout[N,OC] * w[OC,IC];  dw[OC,IC] += dout^T * inp;  dbias += colsum(dout)
  if (dinp != nullptr) par_gemm<T>(false, false, N, IC, OC, T(1), dout, OC, w, IC, T(1), dinp, IC);
  par_gemm<T>(true, false, OC, IC, N, T(1), dout, OC, inp, IC, T(1), dw, IC);
  if (dbias != nullptr) {
    parallel_for(static_cast<size_t>(OC), 16, [&](size_t lo, size_t hi) {
      for (size_t i = 0; i < static_cast<size_t>(N); ++i) {
        const T* d = dout + i * OC;
        for (size_t c = lo; c < hi; ++c) dbias[c] += d[c];
      }
    });
  }
}

// ---- GELU, tanh approximation ----------------------------------------------------------------

template <typename T>
void gelu_forward(T* out, const T* inp, size_t n) {
  parallel_for(n, 1024,
               [&](size_t lo, size_t hi) { gelu_forward_span(out + lo, inp + lo, hi - lo); });
}

template <typename T>
void gelu_backward(T* dinp, const T* inp, const T* dout, size_t n) {
  parallel_for(n, 1024, [&](size_t lo, size_t hi) {
    gelu_backward_span(dinp + lo, inp + lo, dout + lo, hi - lo);
  });
}

// ---- causal multi-head self-attention --------------------------------------------------------
// qkv[B,T,3C] holds q, k, v for each position (head h uses columns h*hs..(h+1)*hs of each);
// out[B,T,C]; att[B,NH,T,T] keeps the softmax probabilities for backward (0 above the
// diagonal). Per (b, h) and per block of kAttRows query rows [r0, r1): scores against the keys
// [0, r1) only (the causal mask makes later keys irrelevant), scaled by 1/sqrt(hs) (sgemm),
// causal softmax, then out = att v over the same keys (sgemm). The (b, h) pairs are split over
// the pool; each runs single-threaded sgemm.

constexpr int kAttRows = 32;

template <typename T>
void attention_forward(T* out, T* att, const T* qkv, int B, int Tn, int C, int NH) {
  const int hs = C / NH;
  const T scale = T(1) / std::sqrt(static_cast<T>(hs));
  const size_t tt = static_cast<size_t>(Tn) * Tn;
  parallel_for(static_cast<size_t>(B) * NH, 1, [&](size_t lo, size_t hi) {
    for (size_t bh = lo; bh < hi; ++bh) {
      const size_t b = bh / NH;
      const size_t h = bh % NH;
      const T* q = qkv + b * Tn * 3 * C + h * hs;
      const T* k = q + C;
      const T* v = q + 2 * C;
      T* a = att + bh * tt;
      T* y = out + b * Tn * C + h * hs;
      for (int r0 = 0; r0 < Tn; r0 += kAttRows) {
        const int r1 = std::min(Tn, r0 + kAttRows);
        T* ab = a + static_cast<size_t>(r0) * Tn;
        gemm(false, true, r1 - r0, r1, hs, scale, q + static_cast<size_t>(r0) * 3 * C, 3 * C, k,
             3 * C, T(0), ab, Tn);
        for (int i = r0; i < r1; ++i) {
          T* row = a + static_cast<size_t>(i) * Tn;
          T mx = row[0];
          for (int j = 1; j <= i; ++j) mx = std::max(mx, row[j]);
          const T sum = exp_sum_span(row, static_cast<size_t>(i) + 1, mx);
          const T inv = T(1) / sum;
          for (int j = 0; j <= i; ++j) row[j] *= inv;
          for (int j = i + 1; j < Tn; ++j) row[j] = T(0);
        }
        gemm(false, false, r1 - r0, hs, r1, T(1), ab, Tn, v, 3 * C, T(0),
             y + static_cast<size_t>(r0) * C, C);
      }
    }
  });
}

// scratch: B*NH*T*T elements.
template <typename T>
void attention_backward(T* dqkv, T* scratch, const T* dout, const T* qkv, const T* att, int B,
                        int Tn, int C, int NH) {
  const int hs = C / NH;
  const T scale = T(1) / std::sqrt(static_cast<T>(hs));
  const size_t tt = static_cast<size_t>(Tn) * Tn;
  parallel_for(static_cast<size_t>(B) * NH, 1, [&](size_t lo, size_t hi) {
    for (size_t bh = lo; bh < hi; ++bh) {
      const size_t b = bh / NH;
      const size_t h = bh % NH;
      const size_t off = b * Tn * 3 * C + h * hs;
      const T* q = qkv + off;
      const T* k = q + C;
      const T* v = q + 2 * C;
      T* dq = dqkv + off;
      T* dk = dq + C;
      T* dv = dq + 2 * C;
      const T* a = att + bh * tt;
      const T* dy = dout + b * Tn * C + h * hs;
      T* da = scratch + bh * tt;
      for (int r0 = 0; r0 < Tn; r0 += kAttRows) {
        const int r1 = std::min(Tn, r0 + kAttRows);
        const int rb = r1 - r0;
        const T* ab = a + static_cast<size_t>(r0) * Tn;
        T* dab = da + static_cast<size_t>(r0) * Tn;
        const T* dyb = dy + static_cast<size_t>(r0) * C;
        // datt = dy v^T ; dv += att^T dy   (keys [0, r1))
        gemm(false, true, rb, r1, hs, T(1), dyb, C, v, 3 * C, T(0), dab, Tn);
        gemm(true, false, r1, hs, rb, T(1), ab, Tn, dyb, C, T(1), dv, 3 * C);
        // softmax backward, in place: dpre = att * (datt - sum_j att * datt); 0 above diagonal
        for (int i = r0; i < r1; ++i) {
          const T* ar = a + static_cast<size_t>(i) * Tn;
          T* dr = da + static_cast<size_t>(i) * Tn;
          T dot = 0;
          for (int j = 0; j <= i; ++j) dot += ar[j] * dr[j];
          for (int j = 0; j <= i; ++j) dr[j] = ar[j] * (dr[j] - dot);
          for (int j = i + 1; j < r1; ++j) dr[j] = T(0);
        }
        // dq += scale * dpre k ; dk += scale * dpre^T q
        gemm(false, false, rb, hs, r1, scale, dab, Tn, k, 3 * C, T(1),
             dq + static_cast<size_t>(r0) * 3 * C, 3 * C);
        gemm(true, false, r1, hs, rb, scale, dab, Tn, q + static_cast<size_t>(r0) * 3 * C, 3 * C,
             T(1), dk, 3 * C);
      }
    }
  });
}

// ---- residual --------------------------------------------------------------------------------

template <typename T>
void residual_forward(T* out, const T* a, const T* b, size_t n) {
  parallel_for(n, 4096, [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) out[i] = a[i] + b[i];
  });
}

// ---- softmax + cross-entropy -----------------------------------------------------------------
// probs[N,V] = softmax(logits); returns the mean over rows of -log probs[target] (computed as
// logsumexp - logit[target], so it never takes the log of an underflowed probability).

template <typename T>
double crossentropy_forward(T* probs, const T* logits, const int32_t* targets, int N, int V) {
  std::vector<double> row_loss(static_cast<size_t>(N));
  parallel_for(static_cast<size_t>(N), 8, [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) {
      const T* l = logits + i * V;
      T* p = probs + i * V;
      T mx = l[0];
      for (int v = 1; v < V; ++v) mx = std::max(mx, l[v]);
      std::copy(l, l + V, p);
      const T sum = exp_sum_span(p, static_cast<size_t>(V), mx);
      const T inv = T(1) / sum;
      for (int v = 0; v < V; ++v) p[v] *= inv;
      row_loss[i] = static_cast<double>(mx) + std::log(static_cast<double>(sum)) -
                    static_cast<double>(l[targets[i]]);
    }
  });
  double total = 0;
  for (const double v : row_loss) total += v;
  return total / N;
}

// dlogits = (probs - onehot(target)) * dloss / N   (writes)
template <typename T>
void crossentropy_backward(T* dlogits, const T* probs, const int32_t* targets, int N, int V,
                           T dloss = T(1)) {
  const T scale = dloss / static_cast<T>(N);
  parallel_for(static_cast<size_t>(N), 8, [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) {
      const T* p = probs + i * V;
      T* d = dlogits + i * V;
      for (int v = 0; v < V; ++v) d[v] = p[v] * scale;
      d[targets[i]] -= scale;
    }
  });
}

}  // namespace loom::trainer::layers
