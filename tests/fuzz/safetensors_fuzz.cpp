// libFuzzer target for the safetensors reader: arbitrary bytes go through
// loom::host::safetensors::parse, and a file it accepts through quant::logical_tensors and
// every read the C API makes of it (float conversion of plain tensors, decoding of quantized
// ones), all under AddressSanitizer. Besides crashes and sanitizer reports, it checks:
//  - every error names the file: its message starts with the origin;
//  - an accepted header's tensors lie inside the data area, in order, covering it exactly,
//    each spanning numel * element size bytes.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "quantize/quant_file.hpp"
#include "safetensors/safetensors.hpp"
#include "status.hpp"

namespace {

constexpr const char* kOrigin = "fuzz.safetensors";
volatile float g_sink = 0;  // keeps the decoded values from being optimised out

[[noreturn]] void invariant_failed(const char* what, const std::string& detail) {
  std::fprintf(stderr, "safetensors_fuzz: invariant violated: %s: %s\n", what, detail.c_str());
  std::abort();
}

void check_error(const loom::host::Error& e) {
  const std::string m = e.what();
  if (m.compare(0, std::string(kOrigin).size(), kOrigin) != 0) {
    invariant_failed("error without the file name", m);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace st = loom::host::safetensors;
  namespace quant = loom::host::quant;
  st::Header h;
  try {
    h = st::parse(data, size, kOrigin);
  } catch (const loom::host::Error& e) {
    check_error(e);
    return 0;
  }
  if (h.data_offset + h.data_bytes != size) invariant_failed("data area", "size");
  uint64_t covered = 0;
  for (const auto& t : h.tensors) {
    if (t.begin < covered && t.end > t.begin) invariant_failed("overlap", t.name);
    if (t.end > h.data_bytes) invariant_failed("out of the data area", t.name);
    if (t.bytes() != t.numel * st::dtype_size(t.dtype)) invariant_failed("size", t.name);
    covered = t.end > covered ? t.end : covered;
  }
  if (covered != h.data_bytes) invariant_failed("coverage", std::to_string(covered));

  std::vector<quant::LogicalTensor> tensors;
  try {
    tensors = quant::logical_tensors(h, kOrigin);
  } catch (const loom::host::Error& e) {
    check_error(e);
    return 0;
  }
  const uint8_t* area = data + h.data_offset;
  std::vector<float> out;
  for (const auto& lt : tensors) {
    try {
      if (lt.plain != nullptr) {
        out.resize(lt.plain->numel);
        quant::to_float32(area + lt.plain->begin, lt.plain->dtype, lt.plain->numel, out.data());
      } else {
        uint64_t numel = 1;
        for (const int64_t d : lt.record->shape) numel *= static_cast<uint64_t>(d);
        if (numel > (uint64_t{1} << 24)) continue;  // a valid but huge 1-bit tensor: skip
        out.resize(numel);
        quant::decode(*lt.record, area + lt.codes->begin, area + lt.scales->begin,
                      lt.zero_points != nullptr ? area + lt.zero_points->begin : nullptr,
                      out.data(), kOrigin);
      }
    } catch (const loom::host::Error& e) {
      check_error(e);
    }
    for (const float v : out) g_sink = g_sink + v;
  }
  return 0;
}
