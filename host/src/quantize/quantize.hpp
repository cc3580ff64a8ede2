// `loom quantize`: a safetensors checkpoint quantized tensor by tensor, per the manifest's
// [[quantize]] rules, through the loom.quantizer/1 instances the rules name.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

namespace loom::host {

class Session;

// '*' matches any run of characters (dots included), '?' any one character; everything else
// matches itself.
bool glob_match(std::string_view pattern, std::string_view name);

struct QuantizeReport {
  const std::string* tensor = nullptr;     // nullptr: a warning (note)
  const std::string* quantizer = nullptr;  // nullptr: copied unchanged
  std::string note;
  uint64_t index = 0;
  uint64_t count = 0;
  double mse = 0;
  double max_abs_error = 0;
  uint64_t bytes_in = 0;
  uint64_t bytes_out = 0;
};

struct QuantizeSummary {
  uint64_t tensors = 0;
  uint64_t quantized = 0;
  uint64_t in_file_bytes = 0;
  uint64_t out_file_bytes = 0;
};

// Reads `in`, writes `out` (through a temporary file renamed at the end: on error `out` is
// untouched); calls `progress` once per warning and once per tensor, after it is done.
// Throws loom::host::Error naming the file, tensor or instance.
QuantizeSummary quantize_file(Session& session, const std::string& in, const std::string& out,
                              const std::function<void(const QuantizeReport&)>& progress);

}  // namespace loom::host
