// Text helpers that libloom's diagnostics and the command-line programs share, so a
// suggestion or a number reads the same whichever of them wrote the message. Header-only,
// standard library only.
#pragma once

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace loom_text {

// Levenshtein distance: single-character insertions, deletions and substitutions.
inline size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0U : 1U)});
      diag = up;
    }
  }
  return row[b.size()];
}

// The candidate nearest to `word`, or "" when none is near enough to be a typo of it (a typo
// changes at most about a third of a word; farther candidates only confuse).
template <class Names>
std::string closest_match(std::string_view word, const Names& candidates) {
  const size_t limit = std::max<size_t>(2, word.size() / 3);
  std::string best;
  size_t best_distance = limit + 1;
  for (const auto& c : candidates) {
    // The length difference bounds the distance from below: a huge word (a 20 MB key) is
    // never near a name, and skipping it keeps this O(size) instead of O(size * names).
    const std::string_view cv(c);
    const size_t gap = word.size() > cv.size() ? word.size() - cv.size() : cv.size() - word.size();
    if (gap >= best_distance) continue;
    const size_t d = edit_distance(word, c);
    if (d < best_distance) {
      best_distance = d;
      best = c;
    }
  }
  return best;
}

// " (did you mean 'steps'?)" when one of `candidates` is close to `word`, else "".
template <class Names>
std::string did_you_mean(std::string_view word, const Names& candidates) {
  const std::string match = closest_match(word, candidates);
  return match.empty() ? std::string() : " (did you mean '" + match + "'?)";
}

namespace detail {
// The first `max` bytes of `s` (cut back to a UTF-8 character boundary), control characters
// escaped; `cut` says whether anything was left out.
inline std::string escaped_prefix(std::string_view s, size_t max, bool& cut) {
  size_t n = s.size();
  cut = n > max;
  if (cut) {
    n = max;
    while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0U) == 0x80U) --n;
  }
  std::string out;
  out.reserve(n + 2);
  for (const char c : s.substr(0, n)) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\r') {
      out += "\\r";
    } else if (u < 0x20U || u == 0x7FU) {
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\u00";
      out += kHex[u >> 4U];
      out += kHex[u & 0xFU];
    } else {
      out += c;
    }
  }
  return out;
}
}  // namespace detail

// Text a user wrote (a key, a value, a name) as a message shows it: control characters
// escaped, so that the message stays one line, and beyond `max` bytes cut, with its size
// after it, so that a 20 MB key is still recognisable while the message stays short.
//   shown("main") == "main"; shown(20 MB of 'k') == "kkk...k... (20971520 bytes)"
inline std::string shown(std::string_view s, size_t max = 64) {
  bool cut = false;
  std::string out = detail::escaped_prefix(s, max, cut);
  return cut ? out + "... (" + std::to_string(s.size()) + " bytes)" : out;
}

// shown(), in single quotes: "'main'", "'kkk...k...' (20971520 bytes)".
inline std::string quoted(std::string_view s, size_t max = 64) {
  bool cut = false;
  std::string out = "'" + detail::escaped_prefix(s, max, cut);
  return cut ? out + "...' (" + std::to_string(s.size()) + " bytes)" : out + "'";
}

// Shortest text that reads back as `v`: integers as integers ("1000000", not "1e+06"),
// others as std::to_chars writes them ("1e-06", "0.1", "3.5e+20").
inline std::string number(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  if (v == std::trunc(v) && std::fabs(v) < 1e15) {
    const auto r = std::to_chars(buf, buf + sizeof(buf), static_cast<long long>(v));
    return std::string(buf, r.ptr);
  }
  const auto r = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, r.ptr);
}

}  // namespace loom_text
