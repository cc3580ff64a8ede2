// Quantized tensors in a safetensors file, as `loom quantize` writes them (docs/quantization.md):
// a tensor NAME stored quantized is the entries NAME.qcodes (U8, the packed codes),
// NAME.qscale (the scales) and NAME.qzero (the zero points, asymmetric INT only), and the
// metadata key "loom.quant.NAME" holds its format as a small JSON object.
#pragma once

#include <loom/quant_format.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "../safetensors/safetensors.hpp"

namespace loom::host::quant {

inline constexpr const char* kMetadataPrefix = "loom.quant.";
inline constexpr const char* kCodesSuffix = ".qcodes";
inline constexpr const char* kScaleSuffix = ".qscale";
inline constexpr const char* kZeroSuffix = ".qzero";
inline constexpr const char* kToolKey = "loom.quantize";  // the version of the tool that wrote it
inline constexpr int kRecordVersion = 1;
// Scales are step sizes, so never negative, and no trained weight comes near this one: a
// larger scale (or a non-finite one) is a damaged file or a broken quantizer, and a matmul
// through it would overflow float32 and be blamed on the activations.
inline constexpr double kMaxScale = 1e30;

// What "loom.quant.NAME" records.
struct QuantRecord {
  int32_t scheme = LOOM_QUANT_INT;
  uint32_t bits = 8;
  uint32_t flags = 0;
  int32_t packing = LOOM_QUANT_PACK_LSB_FIRST;
  int32_t axis = 1;
  int64_t group_size = 0;
  std::vector<int64_t> shape;                          // the logical tensor's
  safetensors::Dtype dtype = safetensors::Dtype::F32;  // the logical tensor's (what it was)
  safetensors::Dtype scale_dtype = safetensors::Dtype::F32;
  bool has_zero_points = false;
  safetensors::Dtype zero_point_dtype = safetensors::Dtype::U8;
  std::string plugin;      // "zeroquant"
  std::string quantizer;   // the manifest's instance name
  std::string parameters;  // JSON object text: the instance's parameters

  // The byte count of the packed codes, the element counts of the scale and zero-point
  // tensors, and the scale tensor's shape (quant_format.h's rules).
  [[nodiscard]] uint64_t packed_bytes() const;
  [[nodiscard]] std::vector<int64_t> scale_shape() const;
  // The descriptor, its shape pointing into this record.
  [[nodiscard]] loom_quant_format format() const;
};

// The record of a descriptor the quantizer returned (shape, scheme, dtypes...); throws
// loom::host::Error naming `what` for a descriptor this format cannot store.
QuantRecord record_from_format(const loom_quant_format& f, safetensors::Dtype dtype,
                               const std::string& what);
std::string to_json(const QuantRecord& r);
// Parses and checks a record; throws loom::host::Error naming `file` and `name`.
QuantRecord parse_record(const std::string& text, const std::string& file, const std::string& name);

// A safetensors file read as logical tensors: a plain tensor, or a quantized one with its
// record and its codes, scale and zero-point entries (checked against the record).
struct LogicalTensor {
  std::string name;
  const safetensors::TensorEntry* plain = nullptr;  // plain tensors
  std::unique_ptr<QuantRecord> record;              // quantized tensors
  const safetensors::TensorEntry* codes = nullptr;
  const safetensors::TensorEntry* scales = nullptr;
  const safetensors::TensorEntry* zero_points = nullptr;
};

// The logical tensors of a parsed header, in data order of their first entry. Throws
// loom::host::Error (DATA_LOSS) naming the file and tensor for a record that does not
// match its entries, or a quantized NAME whose entries are missing.
std::vector<LogicalTensor> logical_tensors(const safetensors::Header& header,
                                           const std::string& file);

// Throws loom::host::Error (DATA_LOSS) naming `what` and the first bad entry unless every
// scale is finite, >= 0 and < kMaxScale, and every float zero point is finite. `scales` and
// `zero_points` hold the record's scale-shaped tensors (zero_points: none without them);
// `cause` ends the message.
inline constexpr const char* kBadScaleInFile =
    "the file is damaged, or the quantizer that wrote it is broken";
void check_scales(const QuantRecord& r, const uint8_t* scales, const uint8_t* zero_points,
                  const std::string& what, const char* cause = kBadScaleInFile);

// What a quantized file must be beyond the safetensors rules, checked at open: one `loom
// quantize` wrote (it has quantized tensors or the tool's key) carries "loom.checksum" (the
// mapped file verified it), and every quantized tensor's scales pass check_scales. Throws
// loom::host::Error (DATA_LOSS) naming the file, and the tensor where there is one.
void check_quantized_file(const safetensors::MappedFile& file,
                          const std::vector<LogicalTensor>& tensors);

}  // namespace loom::host::quant

namespace loom::host::quant {

// A plain float tensor's bytes (F32, F64, F16, BF16) as float32; false for another dtype.
bool to_float32(const uint8_t* data, safetensors::Dtype dtype, uint64_t numel, float* out);

// Decodes a quantized tensor by quant_format.h's rules into out[numel]. Throws
// loom::host::Error (DATA_LOSS) naming `what` and the element for an invalid code, or a
// scale check_scales refuses.
void decode(const QuantRecord& r, const uint8_t* codes, const uint8_t* scales,
            const uint8_t* zero_points, float* out, const std::string& what);

}  // namespace loom::host::quant
