// GEMM through OpenBLAS from the host pool's threads, whichever OpenBLAS build the process
// loaded. Link the `loom_blas` CMake target (cmake/LoomBlas.cmake): it resolves one build by
// its directory, not by Debian's alternatives link, and puts that directory in the RUNPATH.
//
//   loom::sdk::blas::gemm(ta, tb, m, n, k, 1.0f, a, lda, b, ldb, 0.0f, c, ldc);   // row-major
//
// Why a wrapper: callers split one GEMM into blocks and run them on several pool threads at
// once, each with OpenBLAS single-threaded inside. Only OpenBLAS's pthread build is safe to
// call like that; its serial build has no locking (two calls at once share its buffers and
// corrupt each other's results) and its OpenMP build shares per-process buffers between
// non-OpenMP threads. A process has one libopenblas.so.0 whatever each library linked (the
// dynamic loader shares it by soname), so the build is asked at run time: with the pthread
// build calls run concurrently, with any other they take turns under a lock. Results are the
// same bits either way; only the speed differs.
#ifndef LOOM_SDK_BLAS_HPP
#define LOOM_SDK_BLAS_HPP

#include <cblas.h>

#include <climits>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace loom::sdk::blas {

// OpenBLAS's openblas_get_parallel(): 0 serial, 1 pthreads, 2 OpenMP.
inline constexpr int kPthreadBuild = 1;

// Whether the loaded OpenBLAS may be called from several threads at once.
inline bool concurrent_calls_safe() {
  static const bool safe = openblas_get_parallel() == kPthreadBuild;
  return safe;
}

// OpenBLAS's own threads stay idle: the callers split the work over the host's pool.
inline void use_one_thread_per_call() {
  static std::once_flag once;
  std::call_once(once, [] { openblas_set_num_threads(1); });
}

namespace detail {
inline std::mutex& turn() {
  static std::mutex m;
  return m;
}
inline int dim(int64_t v, const char* what) {
  if (v < 0 || v > INT_MAX)
    throw std::invalid_argument(std::string("blas: ") + what + " out of range");
  return static_cast<int>(v);
}
template <class Call>
void run(Call&& call) {
  use_one_thread_per_call();
  if (concurrent_calls_safe()) {
    call();
  } else {
    const std::lock_guard<std::mutex> lock(turn());
    call();
  }
}
}  // namespace detail

// C[m, n] = alpha * op(A)[m, k] op(B)[k, n] + beta * C, row-major; T is float or double.
template <class T>
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
          const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "sgemm or dgemm");
  const int im = detail::dim(m, "m"), in = detail::dim(n, "n"), ik = detail::dim(k, "k");
  const int ia = detail::dim(lda, "lda"), ib = detail::dim(ldb, "ldb");
  const int ic = detail::dim(ldc, "ldc");
  const CBLAS_TRANSPOSE opa = ta ? CblasTrans : CblasNoTrans;
  const CBLAS_TRANSPOSE opb = tb ? CblasTrans : CblasNoTrans;
  detail::run([&] {
    if constexpr (std::is_same_v<T, float>) {
      cblas_sgemm(CblasRowMajor, opa, opb, im, in, ik, alpha, a, ia, b, ib, beta, c, ic);
    } else {
      cblas_dgemm(CblasRowMajor, opa, opb, im, in, ik, alpha, a, ia, b, ib, beta, c, ic);
    }
  });
}

}  // namespace loom::sdk::blas

#endif  // LOOM_SDK_BLAS_HPP
