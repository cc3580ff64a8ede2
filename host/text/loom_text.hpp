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
