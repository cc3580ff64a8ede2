#include "diagnostics.hpp"

#include <loom_text.hpp>

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

std::string closest_match(std::string_view word, const std::vector<std::string>& candidates) {
  return loom_text::closest_match(word, candidates);
}

std::string did_you_mean(std::string_view word, const std::vector<std::string>& candidates) {
  return loom_text::did_you_mean(word, candidates);
}

}  // namespace loom::host
