// Host index dispatch (dispatch.hpp).
#include "dispatch.hpp"

#include <loom/sdk/parallel.hpp>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

namespace loom::moe {

int64_t build_slots(const int32_t* route, int64_t tokens, int k, int num_experts, int64_t* counts,
                    int64_t* slot) {
  const int64_t n = tokens * k;
  std::fill(counts, counts + num_experts, int64_t{0});
  for (int64_t i = 0; i < n; ++i) {
    const int32_t e = route[i];
    if (e < -1 || e >= num_experts) {
      throw std::invalid_argument("moe: route_experts[" + std::to_string(i / k) + ", " +
                                  std::to_string(i % k) + "] = " + std::to_string(e) +
                                  " is outside [-1, " + std::to_string(num_experts) + ")");
    }
    if (e >= 0) ++counts[e];
  }
  std::vector<int64_t> next(static_cast<size_t>(num_experts));
  int64_t total = 0;
  for (int e = 0; e < num_experts; ++e) {
    next[static_cast<size_t>(e)] = total;
    total += counts[e];
  }
  for (int64_t i = 0; i < n; ++i) {
    const int32_t e = route[i];
    slot[i] = e < 0 ? -1 : next[static_cast<size_t>(e)]++;
  }
  return total;
}

template <class T>
void gather_rows(const T* x, int64_t tokens, int64_t model_dim, int k, const int64_t* slot,
                 const T* weights, T* rows) {
  const int64_t M = model_dim;
  sdk::parallel_for(static_cast<size_t>(tokens), 32, [&](size_t lo, size_t hi) {
    for (size_t si = lo; si < hi; ++si) {
      const auto s = static_cast<int64_t>(si);
      const T* xs = x + s * M;
      for (int j = 0; j < k; ++j) {
        const int64_t r = slot[s * k + j];
        if (r < 0) continue;
        T* dst = rows + r * M;
        if (weights == nullptr) {
          std::copy(xs, xs + M, dst);
        } else {
          const T w = weights[s * k + j];
          for (int64_t m = 0; m < M; ++m) dst[m] = w * xs[m];
        }
      }
    }
  });
}

template <class T>
void combine_rows(const T* rows, int64_t tokens, int64_t model_dim, int k, const int64_t* slot,
                  const T* weights, T* y, bool accumulate) {
  const int64_t M = model_dim;
  sdk::parallel_for(static_cast<size_t>(tokens), 32, [&](size_t lo, size_t hi) {
    for (size_t si = lo; si < hi; ++si) {
      const auto s = static_cast<int64_t>(si);
      T* ys = y + s * M;
      if (!accumulate) std::fill(ys, ys + M, T(0));
      for (int j = 0; j < k; ++j) {
        const int64_t r = slot[s * k + j];
        if (r < 0) continue;
        const T* src = rows + r * M;
        const T w = weights == nullptr ? T(1) : weights[s * k + j];
        for (int64_t m = 0; m < M; ++m) ys[m] = ys[m] + w * src[m];
      }
    }
  });
}

template <class T>
void combine_weight_grad(const T* rows, const T* dy, int64_t tokens, int64_t model_dim, int k,
                         const int64_t* slot, T* dweights) {
  const int64_t M = model_dim;
  sdk::parallel_for(static_cast<size_t>(tokens), 32, [&](size_t lo, size_t hi) {
    for (size_t si = lo; si < hi; ++si) {
      const auto s = static_cast<int64_t>(si);
      const T* d = dy + s * M;
      for (int j = 0; j < k; ++j) {
        const int64_t r = slot[s * k + j];
        T acc = T(0);
        if (r >= 0) {
          const T* src = rows + r * M;
          for (int64_t m = 0; m < M; ++m) acc = acc + d[m] * src[m];
        }
        dweights[s * k + j] = acc;
      }
    }
  });
}

#define LOOM_MOE_DISPATCH_INSTANTIATE(T)                                                          \
  template void gather_rows<T>(const T*, int64_t, int64_t, int, const int64_t*, const T*, T*);    \
  template void combine_rows<T>(const T*, int64_t, int64_t, int, const int64_t*, const T*, T*,    \
                                bool);                                                            \
  template void combine_weight_grad<T>(const T*, const T*, int64_t, int64_t, int, const int64_t*, \
                                       T*);
LOOM_MOE_DISPATCH_INSTANTIATE(float)
LOOM_MOE_DISPATCH_INSTANTIATE(double)
#undef LOOM_MOE_DISPATCH_INSTANTIATE

}  // namespace loom::moe
