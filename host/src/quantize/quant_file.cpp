#include "quant_file.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "../status.hpp"

namespace loom::host::quant {
namespace {

using safetensors::Dtype;
using Json = nlohmann::ordered_json;

// A record that does not describe its tensors: corrupt data.
[[noreturn]] void bad(const std::string& where, const std::string& message) {
  throw Error(LOOM_ERR_DATA_LOSS, where + ": " + message);
}

const char* scheme_name(int32_t s) {
  switch (s) {
    case LOOM_QUANT_INT:
      return "int";
    case LOOM_QUANT_BINARY:
      return "binary";
    case LOOM_QUANT_TERNARY:
      return "ternary";
    default:
      return nullptr;
  }
}

const char* packing_name(int32_t p) {
  switch (p) {
    case LOOM_QUANT_PACK_LSB_FIRST:
      return "lsb_first";
    case LOOM_QUANT_PACK_MSB_FIRST:
      return "msb_first";
    default:
      return nullptr;
  }
}

std::optional<Dtype> from_dlpack(DLDataType t) {
  if (t.lanes != 1) return std::nullopt;
  if (t.code == kDLFloat && t.bits == 32) return Dtype::F32;
  if (t.code == kDLFloat && t.bits == 16) return Dtype::F16;
  if (t.code == kDLBfloat && t.bits == 16) return Dtype::BF16;
  if (t.code == kDLUInt && t.bits == 8) return Dtype::U8;
  if (t.code == kDLInt && t.bits == 8) return Dtype::I8;
  return std::nullopt;
}

bool is_scale_dtype(Dtype d) { return d == Dtype::F32 || d == Dtype::F16 || d == Dtype::BF16; }

// The checks every record passes, written or read; `where` names it.
void check(const QuantRecord& r, const std::string& where) {
  const bool sym = (r.flags & LOOM_QUANT_SYMMETRIC) != 0;
  if (scheme_name(r.scheme) == nullptr) bad(where, "unknown scheme " + std::to_string(r.scheme));
  if ((r.flags & ~LOOM_QUANT_KNOWN_FLAGS) != 0) bad(where, "unknown flag bits");
  if (r.scheme == LOOM_QUANT_INT && (r.bits < (sym ? 2u : 1u) || r.bits > 8)) {
    bad(where, "bits " + std::to_string(r.bits) + " is out of range for " +
                   (sym ? "symmetric INT (2..8)" : "asymmetric INT (1..8)"));
  }
  if (r.scheme == LOOM_QUANT_BINARY && r.bits != 1) bad(where, "binary codes have 1 bit");
  if (r.scheme == LOOM_QUANT_TERNARY && r.bits != 2) bad(where, "ternary codes have 2 bits");
  if (r.scheme != LOOM_QUANT_INT && !sym) bad(where, "binary and ternary are symmetric");
  if (packing_name(r.packing) == nullptr) {
    bad(where, "unknown packing " + std::to_string(r.packing));
  }
  if (r.shape.size() > 32) bad(where, "more than 32 dimensions");
  uint64_t numel = 1;
  for (const int64_t d : r.shape) {
    if (d < 0) bad(where, "a negative dimension in the shape");
    if (d != 0 && numel > (std::numeric_limits<uint64_t>::max() / 8) / static_cast<uint64_t>(d)) {
      bad(where, "the shape is too large to address");
    }
    numel *= static_cast<uint64_t>(d);
  }
  if (r.group_size < 0) bad(where, "group_size is negative");
  if (r.group_size > 0 && (r.axis < 0 || r.axis >= static_cast<int32_t>(r.shape.size()))) {
    bad(where, "axis " + std::to_string(r.axis) + " is not a dimension of the shape");
  }
  if (!is_scale_dtype(r.scale_dtype)) bad(where, "the scale dtype must be F32, F16 or BF16");
  const bool wants_zero = r.scheme == LOOM_QUANT_INT && !sym;
  if (wants_zero != r.has_zero_points) {
    bad(where,
        wants_zero ? "asymmetric INT needs zero points" : "only asymmetric INT has zero points");
  }
  if (r.has_zero_points && r.zero_point_dtype != Dtype::U8 && r.zero_point_dtype != Dtype::I8 &&
      r.zero_point_dtype != r.scale_dtype) {
    bad(where, "the zero-point dtype must be U8, I8 or the scale dtype");
  }
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

}  // namespace

uint64_t QuantRecord::packed_bytes() const {
  uint64_t numel = 1;
  for (const int64_t d : shape) numel *= static_cast<uint64_t>(d);
  return (numel * bits + 7) / 8;
}

std::vector<int64_t> QuantRecord::scale_shape() const {
  if (group_size == 0) return {1};
  std::vector<int64_t> s = shape;
  const auto a = static_cast<size_t>(axis);
  // ceil(s[a] / group_size) without forming s[a] + group_size, which overflows for a
  // group_size near INT64_MAX (a file's metadata may hold any non-negative int64).
  s[a] = s[a] == 0 ? 0 : 1 + (s[a] - 1) / group_size;
  return s;
}

loom_quant_format QuantRecord::format() const {
  loom_quant_format f{};
  f.struct_size = LOOM_QUANT_FORMAT_SIZE;
  f.scheme = scheme;
  f.bits = bits;
  f.flags = flags;
  f.packing = packing;
  f.axis = axis;
  f.group_size = group_size;
  f.ndim = static_cast<int32_t>(shape.size());
  f.shape = shape.data();
  f.scale_dtype = safetensors::to_dlpack(scale_dtype);
  if (has_zero_points) f.zero_point_dtype = safetensors::to_dlpack(zero_point_dtype);
  return f;
}

QuantRecord record_from_format(const loom_quant_format& f, Dtype dtype, const std::string& what) {
  if (f.struct_size < LOOM_QUANT_FORMAT_SIZE) bad(what, "the quantizer's format is too short");
  QuantRecord r;
  r.scheme = f.scheme;
  r.bits = f.bits;
  r.flags = f.flags;
  r.packing = f.packing;
  r.axis = f.axis;
  r.group_size = f.group_size;
  if (f.ndim < 0 || f.ndim > 32 || (f.ndim > 0 && f.shape == nullptr)) {
    bad(what, "the quantizer's format has a bad shape");
  }
  r.shape.assign(f.shape, f.shape + f.ndim);
  r.dtype = dtype;
  const auto sd = from_dlpack(f.scale_dtype);
  if (!sd || !is_scale_dtype(*sd)) bad(what, "the quantizer's scale dtype cannot be stored");
  r.scale_dtype = *sd;
  const DLDataType z = f.zero_point_dtype;
  r.has_zero_points = !(z.code == 0 && z.bits == 0 && z.lanes == 0);
  if (r.has_zero_points) {
    const auto zd = from_dlpack(z);
    if (!zd) bad(what, "the quantizer's zero-point dtype cannot be stored");
    r.zero_point_dtype = *zd;
  }
  try {
    check(r, what + ": the quantizer's format");
  } catch (const Error& e) {
    throw Error(LOOM_ERR_INTERNAL, e.what());
  }
  return r;
}

std::string to_json(const QuantRecord& r) {
  Json j;
  j["version"] = kRecordVersion;
  j["scheme"] = scheme_name(r.scheme);
  j["bits"] = r.bits;
  j["flags"] = Json::array();
  if ((r.flags & LOOM_QUANT_SYMMETRIC) != 0) j["flags"].push_back("symmetric");
  j["packing"] = packing_name(r.packing);
  j["axis"] = r.axis;
  j["group_size"] = r.group_size;
  j["shape"] = r.shape;
  j["dtype"] = std::string(safetensors::dtype_name(r.dtype));
  j["scale_dtype"] = std::string(safetensors::dtype_name(r.scale_dtype));
  if (r.has_zero_points) {
    j["zero_point_dtype"] = std::string(safetensors::dtype_name(r.zero_point_dtype));
  }
  j["plugin"] = r.plugin;
  j["quantizer"] = r.quantizer;
  j["parameters"] = r.parameters.empty() ? Json::object() : Json::parse(r.parameters);
  return j.dump();
}

QuantRecord parse_record(const std::string& text, const std::string& file,
                         const std::string& name) {
  const std::string where = file + ": metadata " + std::string(kMetadataPrefix) + name;
  const Json j = Json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) bad(where, "is not a JSON object");
  const std::set<std::string> known{
      "version",    "scheme",    "bits",  "flags",       "packing",          "axis",
      "group_size", "shape",     "dtype", "scale_dtype", "zero_point_dtype", "plugin",
      "quantizer",  "parameters"};
  for (const auto& [k, v] : j.items()) {
    if (known.count(k) == 0) bad(where, "has unknown key '" + k + "'");
  }
  auto need = [&](const char* k) -> const Json& {
    if (!j.contains(k)) bad(where, std::string("has no '") + k + "'");
    return j[k];
  };
  auto int_of = [&](const char* k, int64_t lo, int64_t hi) {
    const Json& v = need(k);
    if (!v.is_number_integer() || v.get<int64_t>() < lo || v.get<int64_t>() > hi) {
      bad(where, std::string("'") + k + "' must be an integer in [" + std::to_string(lo) + ", " +
                     std::to_string(hi) + "], not " + v.dump());
    }
    return v.get<int64_t>();
  };
  auto string_of = [&](const char* k) {
    const Json& v = need(k);
    if (!v.is_string()) bad(where, std::string("'") + k + "' must be a string");
    return v.get<std::string>();
  };
  auto dtype_of = [&](const char* k) {
    const std::string s = string_of(k);
    const auto d = safetensors::parse_dtype(s);
    if (!d) bad(where, std::string("'") + k + "' names an unknown dtype '" + s + "'");
    return *d;
  };
  if (int_of("version", 0, 1000) != kRecordVersion) {
    bad(where, "is version " + j["version"].dump() + "; this reader knows version " +
                   std::to_string(kRecordVersion));
  }
  QuantRecord r;
  const std::string scheme = string_of("scheme");
  r.scheme = 0;
  for (const int32_t s : {LOOM_QUANT_INT, LOOM_QUANT_BINARY, LOOM_QUANT_TERNARY}) {
    if (scheme == scheme_name(s)) r.scheme = s;
  }
  if (r.scheme == 0) bad(where, "has unknown scheme '" + scheme + "' (int, binary, ternary)");
  r.bits = static_cast<uint32_t>(int_of("bits", 1, 8));
  const Json& flags = need("flags");
  if (!flags.is_array()) bad(where, "'flags' must be an array of flag names");
  for (const auto& f : flags) {
    if (!f.is_string() || f.get<std::string>() != "symmetric") {
      bad(where, "has unknown flag " + f.dump() + " (known: \"symmetric\")");
    }
    r.flags |= LOOM_QUANT_SYMMETRIC;
  }
  const std::string packing = string_of("packing");
  r.packing = packing == "lsb_first"   ? LOOM_QUANT_PACK_LSB_FIRST
              : packing == "msb_first" ? LOOM_QUANT_PACK_MSB_FIRST
                                       : 0;
  if (r.packing == 0) bad(where, "has unknown packing '" + packing + "'");
  r.axis = static_cast<int32_t>(int_of("axis", 0, 31));
  r.group_size = int_of("group_size", 0, std::numeric_limits<int64_t>::max());
  const Json& shape = need("shape");
  if (!shape.is_array()) bad(where, "'shape' must be an array");
  for (const auto& d : shape) {
    if (!d.is_number_integer() || d.get<int64_t>() < 0) {
      bad(where, "'shape' must hold non-negative integers");
    }
    r.shape.push_back(d.get<int64_t>());
    if (r.shape.size() > 32) bad(where, "'shape' has more than 32 dimensions");
  }
  r.dtype = dtype_of("dtype");
  r.scale_dtype = dtype_of("scale_dtype");
  r.has_zero_points = j.contains("zero_point_dtype");
  if (r.has_zero_points) r.zero_point_dtype = dtype_of("zero_point_dtype");
  r.plugin = string_of("plugin");
  r.quantizer = string_of("quantizer");
  const Json& params = need("parameters");
  if (!params.is_object()) bad(where, "'parameters' must be an object");
  r.parameters = params.dump();
  check(r, where);
  return r;
}

std::vector<LogicalTensor> logical_tensors(const safetensors::Header& header,
                                           const std::string& file) {
  std::map<std::string, const safetensors::TensorEntry*> by_name;
  for (const auto& t : header.tensors) by_name.emplace(t.name, &t);
  std::set<const safetensors::TensorEntry*> taken;
  std::map<const safetensors::TensorEntry*, LogicalTensor> quantized;  // keyed by codes entry
  const std::string prefix = kMetadataPrefix;
  for (const auto& [key, value] : header.metadata) {
    if (key.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string name = key.substr(prefix.size());
    const std::string what = file + ": quantized tensor '" + name + "'";
    if (name.empty()) bad(file, "metadata key '" + key + "' names no tensor");
    if (by_name.count(name) != 0) {
      bad(what, "is recorded as quantized but the file also has a plain tensor of that name");
    }
    LogicalTensor lt;
    lt.name = name;
    lt.record = std::make_unique<QuantRecord>(parse_record(value, file, name));
    const QuantRecord& r = *lt.record;
    auto entry = [&](const char* suffix, Dtype dtype, const std::vector<int64_t>& shape,
                     const char* role) {
      const auto it = by_name.find(name + suffix);
      if (it == by_name.end())
        bad(what, std::string("has no ") + role + " tensor '" + name + suffix + "'");
      const auto* t = it->second;
      if (t->dtype != dtype || t->shape != shape) {
        bad(what, std::string("its ") + role + " tensor '" + t->name + "' is " +
                      std::string(safetensors::dtype_name(t->dtype)) + " " + shape_text(t->shape) +
                      "; the format needs " + std::string(safetensors::dtype_name(dtype)) + " " +
                      shape_text(shape));
      }
      taken.insert(t);
      return t;
    };
    lt.codes = entry(kCodesSuffix, Dtype::U8, {static_cast<int64_t>(r.packed_bytes())}, "codes");
    lt.scales = entry(kScaleSuffix, r.scale_dtype, r.scale_shape(), "scale");
    if (r.has_zero_points) {
      lt.zero_points = entry(kZeroSuffix, r.zero_point_dtype, r.scale_shape(), "zero-point");
    }
    quantized.emplace(lt.codes, std::move(lt));
  }
  std::vector<LogicalTensor> out;
  // In data order of each tensor's first entry.
  std::vector<std::pair<uint64_t, LogicalTensor>> items;
  for (const auto& t : header.tensors) {
    if (taken.count(&t) != 0) continue;
    LogicalTensor lt;
    lt.name = t.name;
    lt.plain = &t;
    items.emplace_back(t.begin, std::move(lt));
  }
  for (auto& [codes, lt] : quantized) {
    const uint64_t first = std::min({lt.codes->begin, lt.scales->begin,
                                     lt.zero_points ? lt.zero_points->begin : lt.codes->begin});
    items.emplace_back(first, std::move(lt));
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  out.reserve(items.size());
  for (auto& [off, lt] : items) out.push_back(std::move(lt));
  return out;
}

namespace {

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  uint32_t bits = 0;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      uint32_t e = 0;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        ++e;
      }
      bits = sign | (113u - e) << 23 | (mant & 0x3FFu) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | mant << 13;
  } else {
    bits = sign | (exp + 112u) << 23 | mant << 13;
  }
  float f = 0;
  std::memcpy(&f, &bits, 4);
  return f;
}

float load_float(const uint8_t* p, Dtype d, uint64_t i) {
  switch (d) {
    case Dtype::F32: {
      float f = 0;
      std::memcpy(&f, p + 4 * i, 4);
      return f;
    }
    case Dtype::F64: {
      double v = 0;
      std::memcpy(&v, p + 8 * i, 8);
      return static_cast<float>(v);
    }
    case Dtype::F16: {
      uint16_t h = 0;
      std::memcpy(&h, p + 2 * i, 2);
      return half_to_float(h);
    }
    case Dtype::BF16: {
      uint16_t h = 0;
      std::memcpy(&h, p + 2 * i, 2);
      const uint32_t bits = static_cast<uint32_t>(h) << 16;
      float f = 0;
      std::memcpy(&f, &bits, 4);
      return f;
    }
    case Dtype::U8:
      return static_cast<float>(p[i]);
    case Dtype::I8:
      return static_cast<float>(static_cast<int8_t>(p[i]));
    default:
      return 0.0f;
  }
}

// "[1, 0]": the coordinates of element i of a row-major tensor of `shape`.
std::string index_text(uint64_t i, const std::vector<int64_t>& shape) {
  std::vector<uint64_t> at(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    const auto n = static_cast<uint64_t>(shape[d]);
    at[d] = n != 0 ? i % n : 0;
    i = n != 0 ? i / n : 0;
  }
  std::string out = "[";
  for (size_t d = 0; d < at.size(); ++d) out += (d ? ", " : "") + std::to_string(at[d]);
  return out + "]";
}

std::string value_text(float v) {
  if (std::isnan(v)) return "nan";
  char s[32];
  std::snprintf(s, sizeof s, "%g", static_cast<double>(v));
  return s;
}

}  // namespace

void check_scales(const QuantRecord& r, const uint8_t* scales, const uint8_t* zero_points,
                  const std::string& what, const char* cause) {
  const auto shape = r.scale_shape();
  uint64_t count = 1;
  for (const int64_t d : shape) count *= static_cast<uint64_t>(d);
  for (uint64_t g = 0; g < count; ++g) {
    const float s = load_float(scales, r.scale_dtype, g);
    if (!(s >= 0.0f && static_cast<double>(s) < kMaxScale)) {  // NaN fails both
      char limit[32];
      std::snprintf(limit, sizeof limit, "%g", kMaxScale);
      throw Error(LOOM_ERR_DATA_LOSS, what + ": scale " + index_text(g, shape) + " is " +
                                          value_text(s) +
                                          ": a scale must be finite, at least 0 and below " +
                                          limit + " (" + cause + ")");
    }
  }
  if (zero_points == nullptr || !r.has_zero_points || !is_scale_dtype(r.zero_point_dtype)) return;
  for (uint64_t g = 0; g < count; ++g) {
    const float z = load_float(zero_points, r.zero_point_dtype, g);
    if (!std::isfinite(z)) {
      throw Error(LOOM_ERR_DATA_LOSS, what + ": zero point " + index_text(g, shape) + " is " +
                                          value_text(z) + ": a zero point must be finite (" +
                                          cause + ")");
    }
  }
}

void check_quantized_file(const safetensors::MappedFile& file,
                          const std::vector<LogicalTensor>& tensors) {
  const auto& h = file.header();
  bool quantized = h.metadata.count(kToolKey) != 0;
  for (const auto& lt : tensors) quantized = quantized || lt.record != nullptr;
  // The checksum is what catches a flipped code byte or an edited record, so a quantized
  // file without one is refused: dropping or renaming the key must not switch the check off.
  if (quantized && !file.checksums().file) {
    bad(file.path(), "has no checksum (__metadata__ '" + std::string(safetensors::kChecksumKey) +
                         "'), which every file loom quantize writes carries: it was written by "
                         "an older loom quantize, or its header was damaged or edited; re-run "
                         "loom quantize on the original checkpoint");
  }
  for (const auto& lt : tensors) {
    if (lt.record == nullptr) continue;
    check_scales(*lt.record, file.data(*lt.scales),
                 lt.zero_points != nullptr ? file.data(*lt.zero_points) : nullptr,
                 file.path() + ": quantized tensor '" + lt.name + "'");
  }
}

bool to_float32(const uint8_t* data, Dtype dtype, uint64_t numel, float* out) {
  if (dtype != Dtype::F32 && dtype != Dtype::F64 && dtype != Dtype::F16 && dtype != Dtype::BF16) {
    return false;
  }
  for (uint64_t i = 0; i < numel; ++i) out[i] = load_float(data, dtype, i);
  return true;
}

void decode(const QuantRecord& r, const uint8_t* codes, const uint8_t* scales,
            const uint8_t* zero_points, float* out, const std::string& what) {
  const size_t nd = r.shape.size();
  uint64_t numel = 1;
  for (const int64_t d : r.shape) numel *= static_cast<uint64_t>(d);
  if (numel == 0) return;
  check_scales(r, scales, zero_points, what);  // a bad scale is the file's fault, said here
  if (r.bits < 1 || r.bits > 8 ||
      (r.bits < 2 && r.scheme == LOOM_QUANT_INT && (r.flags & LOOM_QUANT_SYMMETRIC) != 0)) {
    throw Error(LOOM_ERR_DATA_LOSS, what + ": " + std::to_string(r.bits) + "-bit codes");
  }
  // quant_format.h: the bits after the last code in its byte are 0 (LSB first: the high
  // bits; MSB first: the low bits).
  const uint64_t used = (numel * r.bits) % 8;
  if (used != 0) {
    const uint8_t last = codes[(numel * r.bits) / 8];
    const uint32_t pad =
        r.packing == LOOM_QUANT_PACK_LSB_FIRST ? last >> used : last & ((1u << (8 - used)) - 1u);
    if (pad != 0) {
      throw Error(LOOM_ERR_DATA_LOSS, what + ": the " + std::to_string(8 - used) +
                                          " unused bits of its last code byte are not 0");
    }
  }
  // Element i's group: its coordinates with the axis coordinate divided by group_size,
  // row-major over the scale shape. Without groups (one scale) the axis is not read: the
  // record's check covers it only when group_size > 0, so it may name no dimension.
  const auto sshape = r.scale_shape();
  uint64_t inner = 1;     // elements per step of the axis coordinate
  uint64_t axis_len = 1;  // the axis's length
  uint64_t groups_along = 1;
  if (r.group_size > 0) {
    const auto axis = static_cast<size_t>(r.axis);
    for (size_t d = axis + 1; d < nd; ++d) inner *= static_cast<uint64_t>(r.shape[d]);
    axis_len = static_cast<uint64_t>(r.shape[axis]);
    groups_along = static_cast<uint64_t>(sshape[axis]);
  }
  const bool sym = (r.flags & LOOM_QUANT_SYMMETRIC) != 0;
  const bool lsb = r.packing == LOOM_QUANT_PACK_LSB_FIRST;
  for (uint64_t i = 0; i < numel; ++i) {
    uint32_t q = 0;
    for (uint32_t b = 0; b < r.bits; ++b) {
      const uint64_t k = i * r.bits + b;
      const uint32_t bit =
          lsb ? (codes[k / 8] >> (k % 8)) & 1u : (codes[k / 8] >> (7 - k % 8)) & 1u;
      if (lsb) {
        q |= bit << b;
      } else {
        q = (q << 1) | bit;
      }
    }
    uint64_t g = 0;
    if (r.group_size > 0) {
      const uint64_t outer = i / (axis_len * inner);
      const uint64_t a = (i / inner) % axis_len;
      const uint64_t in = i % inner;
      g = (outer * groups_along + a / static_cast<uint64_t>(r.group_size)) * inner + in;
    }
    const float s = load_float(scales, r.scale_dtype, g);
    float v = 0;
    switch (r.scheme) {
      case LOOM_QUANT_INT:
        if (sym) {
          const int32_t sq = (q & (1u << (r.bits - 1))) != 0
                                 ? static_cast<int32_t>(q) - (1 << r.bits)
                                 : static_cast<int32_t>(q);
          v = s * static_cast<float>(sq);
        } else {
          const float z = load_float(zero_points, r.zero_point_dtype, g);
          v = s * (static_cast<float>(q) - z);
        }
        break;
      case LOOM_QUANT_BINARY:
        v = q != 0 ? s : -s;
        break;
      default:  // TERNARY
        if (q == 3) {
          throw Error(LOOM_ERR_DATA_LOSS, what + ": element " + std::to_string(i) +
                                              " has ternary code 3, which is invalid");
        }
        v = q == 0 ? 0.0f : (q == 1 ? s : -s);
        break;
    }
    out[i] = v;
  }
}

}  // namespace loom::host::quant
