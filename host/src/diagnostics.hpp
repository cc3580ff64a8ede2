// Errors that point at a place in a manifest, collected so one run reports them all.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace loom::host {

struct SourcePos {
  std::string file;
  uint32_t line = 0;
  uint32_t column = 0;
};

struct Diagnostic {
  SourcePos pos;
  std::string message;
  // "FILE:LINE:COL: message" (or "FILE: message" when the place has no line).
  [[nodiscard]] std::string str() const;
};

class Diagnostics {
 public:
  void error(SourcePos pos, std::string message);
  [[nodiscard]] bool empty() const { return items_.empty(); }
  [[nodiscard]] size_t size() const { return items_.size(); }
  [[nodiscard]] const std::vector<Diagnostic>& items() const { return items_; }
  // One diagnostic per line, in source order.
  [[nodiscard]] std::string str() const;

 private:
  std::vector<Diagnostic> items_;
};

// The candidate closest to `word` by edit distance, or "" when none is close enough
// to be a plausible typo.
std::string closest_match(std::string_view word, const std::vector<std::string>& candidates);

// " (did you mean 'x'?)" or "".
std::string did_you_mean(std::string_view word, const std::vector<std::string>& candidates);

}  // namespace loom::host
