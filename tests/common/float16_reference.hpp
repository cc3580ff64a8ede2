// A plain reference for 16-bit floats in tests: each pattern decoded from its definition
// (sign, exponent, significand), and float32 -> bfloat16 / float16 rounding as "the nearest
// finite pattern, the even one on a tie", found by search over all 65536 patterns. It shares
// no code with plugins/common/half.hpp, which the tests check against it.
#pragma once

#include <gtest/gtest.h>
#include <loom/abi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace loom_test {

inline bool is_bf16(DLDataType t) { return t.code == kDLBfloat; }

inline double decode(uint16_t h, bool bf) {
  const int sign = (h >> 15) != 0 ? -1 : 1;
  const int ebits = bf ? 8 : 5, mbits = bf ? 7 : 10, bias = bf ? 127 : 15;
  const int e = (h >> mbits) & ((1 << ebits) - 1);
  const int m = h & ((1 << mbits) - 1);
  if (e == (1 << ebits) - 1)
    return m != 0 ? std::nan("") : sign * std::numeric_limits<double>::infinity();
  if (e == 0) return sign * std::ldexp(m, 1 - bias - mbits);
  return sign * std::ldexp(m + (1 << mbits), e - bias - mbits);
}

struct Table {
  std::vector<std::pair<double, uint16_t>> finite;  // sorted by value, -0 dropped
  explicit Table(bool bf) {
    for (uint32_t h = 0; h < 65536; ++h) {
      const double v = decode(static_cast<uint16_t>(h), bf);
      if (std::isfinite(v) && h != 0x8000u) finite.emplace_back(v, static_cast<uint16_t>(h));
    }
    std::sort(finite.begin(), finite.end());
  }
  uint16_t round(float f) const {
    const double v = f;
    auto hi = std::lower_bound(finite.begin(), finite.end(), std::make_pair(v, uint16_t{0}));
    if (hi == finite.end() || hi == finite.begin()) {
      ADD_FAILURE() << v << " is out of the test's range";
      return 0;
    }
    const auto lo = hi - 1;
    const double dl = v - lo->first, dh = hi->first - v;
    if (dh == 0) return hi->second;
    if (dl < dh) return lo->second;
    if (dh < dl) return hi->second;
    return (lo->second & 1u) == 0 ? lo->second : hi->second;
  }
};

inline const Table& table(bool bf) {
  static const Table b(true), h(false);
  return bf ? b : h;
}

inline std::vector<uint16_t> to16(const std::vector<float>& v, bool bf) {
  std::vector<uint16_t> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = table(bf).round(v[i]);
  return out;
}

inline std::vector<float> to32(const std::vector<uint16_t>& v, bool bf) {
  std::vector<float> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = static_cast<float>(decode(v[i], bf));
  return out;
}

}  // namespace loom_test
