// The host side binary.cpp and ternary.cpp share: the row split over the host pool, the
// first-bad reduction and the scalar reference matmul's loop. Host pointers only.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>

#include <loom/quantizers/binary.hpp>
#include "common/parallel_for.hpp"

namespace loom::quant::xtc_rows {

// Rows per task so that a task moves about this many weights.
inline constexpr int64_t kTaskElements = 1 << 15;

inline std::size_t row_grain(const GroupedShape& s, int64_t unit) {
  const int64_t per = std::max<int64_t>(1, kTaskElements / std::max<int64_t>(1, s.cols));
  return static_cast<std::size_t>((per + unit - 1) / unit);
}

inline void atomic_min(std::atomic<int64_t>& a, int64_t v) {
  int64_t cur = a.load();
  while ((cur < 0 || v < cur) && !a.compare_exchange_weak(cur, v)) {
  }
}

// fn(r0, r1) over rows [0, s.rows) in tasks of whole `unit`s of rows (a task's r0 is a
// multiple of unit); returns the smallest non-negative value fn returned, or -1.
template <class F>
int64_t first_bad_over_rows(const GroupedShape& s, int64_t unit, F fn) {
  std::atomic<int64_t> bad{-1};
  const int64_t units = (s.rows + unit - 1) / unit;
  loom::plugins::parallel_for(static_cast<std::size_t>(units), row_grain(s, unit),
                              [&](std::size_t b, std::size_t e) {
                                const int64_t r0 = static_cast<int64_t>(b) * unit;
                                const int64_t r1 = std::min(s.rows, static_cast<int64_t>(e) * unit);
                                const int64_t first = fn(r0, r1);
                                if (first >= 0) atomic_min(bad, first);
                              });
  return bad.load();
}

// y [m, rows] = x . W^T (+ bias) over the host pool: fn(n0, n1) computes W rows [n0, n1) and
// returns its first bad code index or -1; the smallest is returned. No work (m or rows 0):
// -1; no columns: y is the bias (or 0).
template <class F>
int64_t matmul_over_rows(int64_t m, const GroupedShape& s, const float* bias, float* y, F fn) {
  if (m == 0 || s.rows == 0) return -1;
  if (s.cols == 0) {
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t n = 0; n < s.rows; ++n) y[i * s.rows + n] = bias != nullptr ? bias[n] : 0.0f;
    }
    return -1;
  }
  std::atomic<int64_t> bad{-1};
  // Each task reads its rows' codes once per four activation rows.
  const int64_t work = std::max<int64_t>(1, s.cols * std::max<int64_t>(1, m / 4));
  const auto grain = static_cast<std::size_t>(std::max<int64_t>(1, kTaskElements / work));
  loom::plugins::parallel_for(
      static_cast<std::size_t>(s.rows), grain, [&](std::size_t b, std::size_t e) {
        const int64_t first = fn(static_cast<int64_t>(b), static_cast<int64_t>(e));
        if (first >= 0) atomic_min(bad, first);
      });
  return bad.load();
}

// The scalar reference's y = x . W^T (+ bias): per group alpha times the sum that
// add(part, e, v) builds from element e's code and the activation v, accumulated in float.
template <class Add>
void matmul_ref(const float* x, int64_t m, const float* scales, const GroupedShape& s,
                const float* bias, float* y, Add add) {
  const int64_t gpr = s.groups_per_row();
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t n = 0; n < s.rows; ++n) {
      float acc = 0.0f;
      for (int64_t g = 0; g < gpr; ++g) {
        const int64_t c0 = g * s.group_size;
        const int64_t len = std::min(s.group_size, s.cols - c0);
        float part = 0.0f;
        for (int64_t k = c0; k < c0 + len; ++k) {
          part = add(part, n * s.cols + k, x[i * s.cols + k]);
        }
        acc += scales[n * gpr + g] * part;
      }
      y[i * s.rows + n] = acc + (bias != nullptr ? bias[n] : 0.0f);
    }
  }
}

}  // namespace loom::quant::xtc_rows
