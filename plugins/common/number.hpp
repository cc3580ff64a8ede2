// A double as text for error messages: the shortest form that reads back as the same
// double (1e-07, 2.5, 3, 1e+308), so two values that differ never print alike (as
// std::to_string's six fixed decimals make 1e-7 and 0 both "0.000000").
#pragma once

#include <charconv>
#include <string>
#include <system_error>

namespace loom::common {

inline std::string number(double v) {
  char buf[32];  // the longest shortest form, "-2.2250738585072014e-308", is 24 characters
  const std::to_chars_result r = std::to_chars(buf, buf + sizeof buf, v);
  if (r.ec != std::errc()) return "?";
  return std::string(buf, r.ptr);
}

}  // namespace loom::common
