#include "quantize.hpp"

#include <loom/kinds/quantizer.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <vector>

#include "../safetensors/safetensors.hpp"
#include "../session.hpp"
#include "../status.hpp"
#include "quant_file.hpp"

namespace loom::host {
namespace {

using safetensors::Dtype;

bool is_float(Dtype d) {
  return d == Dtype::F32 || d == Dtype::F64 || d == Dtype::F16 || d == Dtype::BF16;
}

struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<uint8_t, AlignedFree>;

Buffer aligned_buffer(uint64_t bytes) {
  if (bytes == 0) return Buffer(nullptr);
  const uint64_t rounded = (bytes + 255) / 256 * 256;
  void* p = std::aligned_alloc(256, rounded);
  if (p == nullptr) throw Error(LOOM_ERR_RESOURCE_EXHAUSTED, "out of memory");
  std::memset(p, 0, rounded);
  return Buffer(static_cast<uint8_t*>(p));
}

DLTensor cpu_tensor(void* data, DLDataType dtype, int32_t ndim, int64_t* shape) {
  DLTensor t{};
  t.data = data;
  t.device = {kDLCPU, 0};
  t.ndim = ndim;
  t.dtype = dtype;
  t.shape = shape;
  t.strides = nullptr;
  t.byte_offset = 0;
  return t;
}

nlohmann::ordered_json params_json(const ParamSet& params) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  for (const auto& p : params.params) {
    const loom_value& v = p.value;
    switch (v.type) {
      case LOOM_PARAM_BOOL:
        j[p.name] = v.int_value != 0;
        break;
      case LOOM_PARAM_INT:
        j[p.name] = v.int_value;
        break;
      case LOOM_PARAM_FLOAT:
        if (std::isfinite(v.float_value)) j[p.name] = v.float_value;
        break;
      case LOOM_PARAM_STRING:
      case LOOM_PARAM_REF:
        if (v.string_value != nullptr) j[p.name] = v.string_value;
        break;
      case LOOM_PARAM_INT_LIST:
        j[p.name] = std::vector<int64_t>(v.int_list, v.int_list + v.count);
        break;
      case LOOM_PARAM_FLOAT_LIST:
        j[p.name] = std::vector<double>(v.float_list, v.float_list + v.count);
        break;
      case LOOM_PARAM_STRING_LIST: {
        auto& a = j[p.name] = nlohmann::ordered_json::array();
        for (size_t k = 0; k < v.count; ++k) a.push_back(v.string_list[k]);
        break;
      }
      default:
        break;
    }
  }
  return j;
}

struct Plan {
  const safetensors::TensorEntry* in = nullptr;
  Instance* inst = nullptr;  // nullptr: copied
  std::string note;
  const loom_quantizer_v1* table = nullptr;
  loom_quantizer_layout_args layout{};
  loom_quant_format format{};
  std::vector<int64_t> shape;
  quant::QuantRecord record;
  size_t out_codes = 0, out_scales = 0, out_zeros = 0, out_plain = 0;  // Writer indices
};

void call(Instance* inst, const char* what, const std::string& tensor, loom_status* st) {
  auto taken = take_status(st);
  if (!taken.ok()) {
    throw Error(taken.code,
                "tensor '" + tensor + "': " + inst->label + ": " + what + ": " + taken.message);
  }
}

}  // namespace

bool glob_match(std::string_view pattern, std::string_view name) {
  size_t p = 0, n = 0, star = std::string_view::npos, mark = 0;
  while (n < name.size()) {
    if (p < pattern.size() && (pattern[p] == '?' || pattern[p] == name[n])) {
      ++p;
      ++n;
    } else if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      mark = n;
    } else if (star != std::string_view::npos) {
      p = star + 1;
      n = ++mark;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

QuantizeSummary quantize_file(Session& session, const std::string& in, const std::string& out,
                              const std::function<void(const QuantizeReport&)>& progress) {
  const auto& rules = session.manifest().quantize_rules;
  if (rules.empty()) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT,
                session.manifest().origin +
                    ": the manifest has no [[quantize]] rules: nothing says which tensors to "
                    "quantize (docs/quantization.md)");
  }
  if (session.declared_instances() != 0 && session.instances().empty()) {
    throw Error(LOOM_ERR_FAILED_PRECONDITION, "the session was opened with validate_only");
  }
  // Mapping verifies the input's checksums (the trainer's "fnv1a64" of its data, or a
  // "loom.checksum"): a mismatch or an unknown algorithm stops the run here.
  const safetensors::MappedFile file(in);
  const auto& header = file.header();
  for (const auto& [k, v] : header.metadata) {
    if (k.rfind(quant::kMetadataPrefix, 0) == 0) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  in + ": is already quantized (metadata " + k + "); quantize the original");
    }
  }
  std::set<std::string> names;
  for (const auto& t : header.tensors) names.insert(t.name);

  // Which rule takes each tensor; a rule that takes none is a warning.
  std::vector<Plan> plans(header.tensors.size());
  std::vector<size_t> hits(rules.size(), 0);
  for (size_t i = 0; i < header.tensors.size(); ++i) {
    const auto& t = header.tensors[i];
    Plan& p = plans[i];
    p.in = &t;
    const QuantizeRule* rule = nullptr;
    for (size_t r = 0; r < rules.size() && rule == nullptr; ++r) {
      for (const auto& pat : rules[r].patterns) {
        if (glob_match(pat, t.name)) {
          rule = &rules[r];
          ++hits[r];
          break;
        }
      }
    }
    if (rule == nullptr) {
      p.note = "no rule matches";
      continue;
    }
    if (rule->copy) {
      p.note = "copy = true";
      continue;
    }
    if (t.shape.size() != 2) {
      p.note = std::to_string(t.shape.size()) + "-D: only 2-D [N, K] weights are quantized";
      continue;
    }
    if (!is_float(t.dtype)) {
      p.note = std::string(safetensors::dtype_name(t.dtype)) + ": only float tensors are quantized";
      continue;
    }
    if (t.numel == 0) {
      p.note = "empty: copied unchanged";  // nothing to quantize, and no buffers to hand over
      continue;
    }
    for (const char* suffix : {quant::kCodesSuffix, quant::kScaleSuffix, quant::kZeroSuffix}) {
      if (names.count(t.name + suffix) != 0) {
        throw Error(LOOM_ERR_INVALID_ARGUMENT,
                    in + ": tensor '" + t.name + "' cannot be quantized: the file already has a " +
                        "tensor named '" + t.name + suffix + "'");
      }
    }
    p.inst = session.find(LOOM_KIND_QUANTIZER, rule->quantizer);
    if (p.inst == nullptr) {
      throw Error(LOOM_ERR_NOT_FOUND, "no quantizer instance '" + rule->quantizer + "'");
    }
  }
  if (!file.checksums().file && !file.checksums().data && progress) {
    // Third-party data: accepted, but nothing vouches for its bytes.
    QuantizeReport n;
    n.note = in + ": note: no checksum in its __metadata__ (neither loom train's \"" +
             std::string(safetensors::kDataChecksumKey) + "\" nor \"" +
             std::string(safetensors::kChecksumKey) +
             "\"), so its data cannot be verified; quantizing it as it is";
    progress(n);
  }
  for (size_t r = 0; r < rules.size(); ++r) {
    if (hits[r] != 0) continue;
    QuantizeReport w;
    const auto& pos = rules[r].pos;
    w.note = pos.file + ":" + std::to_string(pos.line) + ":" + std::to_string(pos.column) +
             ": warning: [[quantize]] rule " + std::to_string(r + 1) + " matches no tensor of " +
             in;
    w.index = r;
    w.count = rules.size();
    if (progress) progress(w);
  }

  // Layouts first: every output size is known before anything is quantized.
  std::vector<safetensors::OutTensor> outs;
  std::map<std::string, std::string> metadata;
  for (const auto& [k, v] : header.metadata) {
    // The input's checksums covered the old bytes; the writer adds the output's own.
    if (k != safetensors::kDataChecksumKey && k != safetensors::kChecksumKey) {
      metadata.emplace(k, v);
    }
  }
  metadata[quant::kToolKey] = std::string("loom ") + LOOM_VERSION_STRING;
  for (auto& p : plans) {
    const auto& t = *p.in;
    if (p.inst == nullptr) {
      p.out_plain = outs.size();
      outs.push_back({t.name, t.dtype, t.shape, file.data(t)});
      continue;
    }
    uint32_t have = 0;
    std::memcpy(&have, p.inst->factory().vtable, sizeof have);
    if (have < LOOM_QUANTIZER_V1_MIN_SIZE) {
      throw Error(LOOM_ERR_UNIMPLEMENTED, p.inst->label + ": its quantizer table is too short");
    }
    p.table = static_cast<const loom_quantizer_v1*>(p.inst->factory().vtable);
    p.shape = t.shape;
    p.format.struct_size = LOOM_QUANT_FORMAT_SIZE;
    p.layout.struct_size = LOOM_QUANTIZER_LAYOUT_ARGS_SIZE;
    p.layout.role = LOOM_QUANTIZER_WEIGHT;
    p.layout.ndim = 2;
    p.layout.shape = p.shape.data();
    p.layout.dtype = {kDLFloat, 32, 1};
    p.layout.format = &p.format;
    call(p.inst, "layout", t.name, guarded_call(p.inst->label + " layout", [&] {
           return p.table->layout(p.inst->object, &p.layout);
         }));
    p.record = quant::record_from_format(p.format, t.dtype,
                                         in + ": tensor '" + t.name + "' (" + p.inst->label + ")");
    if (p.record.shape != t.shape) {
      throw Error(LOOM_ERR_INTERNAL,
                  p.inst->label + ": layout returned another shape for '" + t.name + "'");
    }
    if (p.layout.packed_bytes != p.record.packed_bytes()) {
      throw Error(LOOM_ERR_INTERNAL, p.inst->label + ": layout of '" + t.name + "' says " +
                                         std::to_string(p.layout.packed_bytes) +
                                         " packed bytes, the format " +
                                         std::to_string(p.record.packed_bytes()));
    }
    const auto scale_shape = p.record.scale_shape();
    int64_t scale_count = 1;
    for (const int64_t d : scale_shape) scale_count *= d;
    if (p.layout.scale_count != scale_count ||
        p.layout.zero_point_count != (p.record.has_zero_points ? scale_count : 0)) {
      throw Error(LOOM_ERR_INTERNAL, p.inst->label + ": layout of '" + t.name +
                                         "' gives scale or zero-point counts its format does "
                                         "not have");
    }
    p.record.plugin = p.inst->plugin_name();
    p.record.quantizer = p.inst->name;
    p.record.parameters = params_json(p.inst->validated->params).dump();
    metadata[quant::kMetadataPrefix + t.name] = quant::to_json(p.record);
    p.out_codes = outs.size();
    outs.push_back({t.name + quant::kCodesSuffix,
                    Dtype::U8,
                    {static_cast<int64_t>(p.layout.packed_bytes)},
                    nullptr});
    p.out_scales = outs.size();
    outs.push_back({t.name + quant::kScaleSuffix, p.record.scale_dtype, scale_shape, nullptr});
    if (p.record.has_zero_points) {
      p.out_zeros = outs.size();
      outs.push_back(
          {t.name + quant::kZeroSuffix, p.record.zero_point_dtype, scale_shape, nullptr});
    }
  }

  safetensors::Writer writer(out, outs, metadata);
  QuantizeSummary summary;
  summary.tensors = plans.size();
  summary.in_file_bytes = file.file_bytes();
  for (size_t i = 0; i < plans.size(); ++i) {
    Plan& p = plans[i];
    const auto& t = *p.in;
    QuantizeReport rep;
    rep.tensor = &t.name;
    rep.index = i;
    rep.count = plans.size();
    rep.bytes_in = t.bytes();
    rep.note = p.note;
    if (p.inst == nullptr) {
      rep.bytes_out = t.bytes();
      if (progress) progress(rep);
      continue;
    }
    std::vector<float> x(t.numel);
    quant::to_float32(file.data(t), t.dtype, t.numel, x.data());
    if (t.dtype == Dtype::F64) {
      // A finite double beyond float32's range would become inf and be reported as such.
      for (uint64_t e = 0; e < t.numel; ++e) {
        if (std::isinf(x[e])) {
          double v = 0;
          std::memcpy(&v, file.data(t) + e * sizeof v, sizeof v);
          if (std::isfinite(v)) {
            const auto cols = static_cast<uint64_t>(t.shape[1]);
            char text[32];
            std::snprintf(text, sizeof text, "%.17g", v);
            throw Error(LOOM_ERR_INVALID_ARGUMENT,
                        in + ": tensor '" + t.name + "': element (" + std::to_string(e / cols) +
                            ", " + std::to_string(e % cols) + ") = " + text +
                            " is out of float32 range; quantizers take float32 values");
          }
        }
      }
    }
    const uint64_t scale_bytes = writer.tensor_bytes(p.out_scales);
    const uint64_t zero_bytes = p.record.has_zero_points ? writer.tensor_bytes(p.out_zeros) : 0;
    Buffer packed = aligned_buffer(p.layout.packed_bytes);
    Buffer scales = aligned_buffer(scale_bytes);
    Buffer zeros = aligned_buffer(zero_bytes);
    Buffer work = aligned_buffer(p.layout.workspace_bytes);
    int64_t x_shape[2] = {t.shape[0], t.shape[1]};
    int64_t packed_shape[1] = {static_cast<int64_t>(p.layout.packed_bytes)};
    int64_t scale_shape[1] = {p.layout.scale_count};
    int64_t zero_shape[1] = {p.layout.zero_point_count};
    DLTensor xt = cpu_tensor(x.data(), {kDLFloat, 32, 1}, 2, x_shape);
    DLTensor pt = cpu_tensor(packed.get(), {kDLUInt, 8, 1}, 1, packed_shape);
    DLTensor st = cpu_tensor(scales.get(), p.format.scale_dtype, 1, scale_shape);
    DLTensor zt = cpu_tensor(zeros.get(), p.format.zero_point_dtype, 1, zero_shape);
    loom_quantizer_quantize_args qa{};
    qa.struct_size = LOOM_QUANTIZER_QUANTIZE_ARGS_SIZE;
    qa.role = LOOM_QUANTIZER_WEIGHT;
    qa.format = &p.format;
    qa.x = &xt;
    qa.packed = &pt;
    qa.scales = &st;
    qa.zero_points = p.record.has_zero_points ? &zt : nullptr;
    qa.workspace = work.get();
    qa.workspace_bytes = p.layout.workspace_bytes;
    call(p.inst, "quantize", t.name, guarded_call(p.inst->label + " quantize", [&] {
           return p.table->quantize(p.inst->object, &qa);
         }));
    // The error: dequantize and compare.
    std::vector<float> back(x.size());
    DLTensor bt = cpu_tensor(back.data(), {kDLFloat, 32, 1}, 2, x_shape);
    qa.x = &bt;
    call(p.inst, "dequantize", t.name, guarded_call(p.inst->label + " dequantize", [&] {
           return p.table->dequantize(p.inst->object, &qa);
         }));
    double sum = 0, worst = 0;
    for (size_t k = 0; k < x.size(); ++k) {
      const double d = static_cast<double>(back[k]) - static_cast<double>(x[k]);
      sum += d * d;
      worst = std::max(worst, std::fabs(d));
    }
    // What the reader would refuse is not written: a NaN or absurd scale (a broken
    // quantizer, or weights beyond any model's) is named here, at its source.
    quant::check_scales(p.record, scales.get(), zeros.get(),
                        "tensor '" + t.name + "': " + p.inst->label,
                        "the reader refuses such a file, so nothing is written");
    writer.write(p.out_codes, packed.get(), p.layout.packed_bytes);
    writer.write(p.out_scales, scales.get(), scale_bytes);
    if (p.record.has_zero_points) writer.write(p.out_zeros, zeros.get(), zero_bytes);
    rep.quantizer = &p.inst->name;
    rep.mse = x.empty() ? 0.0 : sum / static_cast<double>(x.size());
    rep.max_abs_error = worst;
    rep.bytes_out = p.layout.packed_bytes + scale_bytes + zero_bytes;
    ++summary.quantized;
    if (progress) progress(rep);
  }
  writer.commit();
  summary.out_file_bytes = writer.file_bytes();
  return summary;
}

}  // namespace loom::host
