#include "diagnostics.hpp"

#include <algorithm>
#include <tuple>

namespace loom::host {

std::string Diagnostic::str() const {
  std::string out = pos.file;
  if (pos.line > 0) {
    out += ":" + std::to_string(pos.line) + ":" + std::to_string(pos.column);
  }
  out += ": ";
  out += message;
  return out;
}

void Diagnostics::error(SourcePos pos, std::string message) {
  items_.push_back(Diagnostic{std::move(pos), std::move(message)});
}

std::string Diagnostics::str() const {
  std::vector<const Diagnostic*> sorted;
  sorted.reserve(items_.size());
  for (const auto& d : items_) sorted.push_back(&d);
  std::stable_sort(sorted.begin(), sorted.end(), [](const Diagnostic* a, const Diagnostic* b) {
    return std::tie(a->pos.file, a->pos.line, a->pos.column) <
           std::tie(b->pos.file, b->pos.line, b->pos.column);
  });
  std::string out;
  for (const auto* d : sorted) {
    if (!out.empty()) out += '\n';
    out += d->str();
  }
  return out;
}

namespace {

size_t edit_distance(std::string_view a, std::string_view b) {
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

}  // namespace

std::string closest_match(std::string_view word, const std::vector<std::string>& candidates) {
  // A typo changes at most about a third of a word; farther candidates only confuse.
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

std::string did_you_mean(std::string_view word, const std::vector<std::string>& candidates) {
  const std::string match = closest_match(word, candidates);
  return match.empty() ? std::string() : " (did you mean '" + match + "'?)";
}

}  // namespace loom::host
