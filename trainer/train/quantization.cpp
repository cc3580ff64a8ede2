#include "quantization.hpp"

#include <loom/embed.h>
#include <loom/kinds/quantizer.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <vector>

#include "bf16.hpp"

namespace loom::trainer {

namespace {

// 256-byte aligned scratch that grows on demand (a quantizer's workspace).
class Scratch {
 public:
  ~Scratch() { std::free(p_); }
  void* get(uint64_t bytes) {
    if (bytes == 0) return nullptr;
    if (bytes > size_) {
      std::free(p_);
      const uint64_t rounded = (bytes + 255) / 256 * 256;
      p_ = std::aligned_alloc(256, rounded);
      if (p_ == nullptr) throw std::bad_alloc();
      size_ = rounded;
    }
    return p_;
  }

 private:
  void* p_ = nullptr;
  uint64_t size_ = 0;
};

DLTensor tensor(void* data, DLDataType dtype, int32_t ndim, int64_t* shape) {
  DLTensor t{};
  t.data = data;
  t.device = {kDLCPU, 0};
  t.ndim = ndim;
  t.dtype = dtype;
  t.shape = shape;
  return t;
}

constexpr DLDataType kF32{kDLFloat, 32, 1};
constexpr DLDataType kBf16{kDLBfloat, 16, 1};
constexpr DLDataType kU8{kDLUInt, 8, 1};

// bf16 mode: n floats as bf16 in `out` (its storage); NULL stays NULL.
const void* bf16_copy(const float* v, size_t n, std::vector<uint16_t>& out) {
  if (v == nullptr) return nullptr;
  out.resize(n);
  for (size_t i = 0; i < n; ++i) out[i] = to_bf16(v[i]);
  return out.data();
}

void widen_bf16(const std::vector<uint16_t>& h, float* out) {
  for (size_t i = 0; i < h.size(); ++i) out[i] = from_bf16(h[i]);
}

uint64_t dtype_bytes(DLDataType d) { return (static_cast<uint64_t>(d.bits) * d.lanes + 7) / 8; }

struct PluginPacked final : PackedWeight {
  int64_t shape[2] = {0, 0};
  loom_quant_format format{};
  uint32_t flags = 0;
  std::vector<uint8_t> packed, scales, zeros;
  int64_t packed_len = 0, scale_count = 0, zero_count = 0;
};

class PluginQuantizer final : public WeightQuantizer {
 public:
  PluginQuantizer(loom_instance* inst, std::string who, bool bf16)
      : inst_(inst), who_(std::move(who)), bf16_(bf16) {
    void* obj = nullptr;
    const void* table = nullptr;
    if (loom_instance_table(inst, LOOM_KIND_QUANTIZER, LOOM_QUANTIZER_V1_MIN_SIZE, &obj, &table) !=
        LOOM_OK) {
      throw std::runtime_error(who_ + ": " + loom_last_error());
    }
    obj_ = obj;
    vt_ = static_cast<const loom_quantizer_v1*>(table);
  }

  // A packed weight as a file holds it: its format and buffers, copied.
  std::unique_ptr<PackedWeight> adopt(const loom_tensor_info& t) {
    auto p = std::make_unique<PluginPacked>();
    if (t.tensor.ndim != 2) throw std::runtime_error(who_ + ": " + t.name + " is not a matrix");
    p->rows = p->shape[0] = t.tensor.shape[0];
    p->cols = p->shape[1] = t.tensor.shape[1];
    const loom_quantizer_layout_args la = layout(*p, 1, t.name);
    if ((la.flags & LOOM_QUANTIZER_HAS_MATMUL) == 0) {
      throw std::runtime_error(who_ + ": plugin '" + loom_instance_plugin(inst_) +
                               "' has no matmul for the weight " + t.name);
    }
    p->flags = la.flags;
    p->format = t.format;
    p->format.shape = p->shape;
    auto count = [](const DLTensor& d) {
      uint64_t n = d.data == nullptr ? 0 : 1;
      for (int32_t i = 0; i < d.ndim; ++i) n *= static_cast<uint64_t>(d.shape[i]);
      return n;
    };
    const uint64_t nc = count(t.codes), ns = count(t.scales), nz = count(t.zero_points);
    const auto* c = static_cast<const uint8_t*>(t.codes.data);
    const auto* sc = static_cast<const uint8_t*>(t.scales.data);
    const auto* z = static_cast<const uint8_t*>(t.zero_points.data);
    p->packed.assign(c, c + nc);
    p->scales.assign(sc, sc + ns * dtype_bytes(t.scales.dtype));
    if (nz > 0) p->zeros.assign(z, z + nz * dtype_bytes(t.zero_points.dtype));
    p->packed_len = static_cast<int64_t>(nc);
    p->scale_count = static_cast<int64_t>(ns);
    p->zero_count = static_cast<int64_t>(nz);
    p->bytes = p->packed.size() + p->scales.size() + p->zeros.size();
    return p;
  }

  std::unique_ptr<PackedWeight> pack(const std::string& name, const float* w, int64_t rows,
                                     int64_t cols) override {
    auto p = std::make_unique<PluginPacked>();
    p->rows = rows;
    p->cols = cols;
    p->shape[0] = rows;
    p->shape[1] = cols;
    loom_quantizer_layout_args la = layout(*p, 1, name);
    p->format = laid_;
    if ((la.flags & LOOM_QUANTIZER_HAS_MATMUL) == 0) {
      throw std::runtime_error(who_ + ": plugin '" + loom_instance_plugin(inst_) +
                               "' has no matmul for the weight " + name +
                               ": the trainer's quantized evaluation multiplies with the packed "
                               "weights (choose a scheme with a matmul)");
    }
    p->flags = la.flags;
    p->packed_len = static_cast<int64_t>(la.packed_bytes);
    p->scale_count = la.scale_count;
    p->zero_count = la.zero_point_count;
    p->packed.resize(la.packed_bytes);
    p->scales.resize(static_cast<size_t>(la.scale_count) * dtype_bytes(p->format.scale_dtype));
    p->zeros.resize(static_cast<size_t>(la.zero_point_count) *
                    dtype_bytes(p->format.zero_point_dtype));
    p->bytes = p->packed.size() + p->scales.size() + p->zeros.size();
    // bf16 mode: the plugin quantizes the weights' bf16 rounding, as the model reads them.
    const size_t n = static_cast<size_t>(rows * cols);
    DLTensor x = bf16_ ? tensor(const_cast<void*>(bf16_copy(w, n, x16_)), kBf16, 2, p->shape)
                       : tensor(const_cast<float*>(w), kF32, 2, p->shape);
    DLTensor pk = tensor(p->packed.data(), kU8, 1, &p->packed_len);
    DLTensor sc = tensor(p->scales.data(), p->format.scale_dtype, 1, &p->scale_count);
    DLTensor zp = tensor(p->zeros.data(), p->format.zero_point_dtype, 1, &p->zero_count);
    loom_quantizer_quantize_args qa{};
    qa.struct_size = LOOM_QUANTIZER_QUANTIZE_ARGS_SIZE;
    qa.role = LOOM_QUANTIZER_WEIGHT;
    qa.format = &p->format;
    qa.x = &x;
    qa.packed = &pk;
    qa.scales = &sc;
    qa.zero_points = p->zero_count > 0 ? &zp : nullptr;
    qa.workspace = ws_.get(la.workspace_bytes);
    qa.workspace_bytes = la.workspace_bytes;
    check(vt_->quantize(obj_, &qa), "quantize " + name);
    return p;
  }

  void unpack(const PackedWeight& base, float* w) override {
    auto& p = const_cast<PluginPacked&>(static_cast<const PluginPacked&>(base));
    loom_quantizer_layout_args la = layout(p, 0, "");
    if (bf16_) y16_.resize(static_cast<size_t>(p.rows * p.cols));
    DLTensor x = bf16_ ? tensor(y16_.data(), kBf16, 2, p.shape) : tensor(w, kF32, 2, p.shape);
    DLTensor pk = tensor(p.packed.data(), kU8, 1, &p.packed_len);
    DLTensor sc = tensor(p.scales.data(), p.format.scale_dtype, 1, &p.scale_count);
    DLTensor zp = tensor(p.zeros.data(), p.format.zero_point_dtype, 1, &p.zero_count);
    loom_quantizer_quantize_args qa{};
    qa.struct_size = LOOM_QUANTIZER_QUANTIZE_ARGS_SIZE;
    qa.role = LOOM_QUANTIZER_WEIGHT;
    qa.format = &p.format;
    qa.x = &x;
    qa.packed = &pk;
    qa.scales = &sc;
    qa.zero_points = p.zero_count > 0 ? &zp : nullptr;
    qa.workspace = ws_.get(la.workspace_bytes);
    qa.workspace_bytes = la.workspace_bytes;
    check(vt_->dequantize(obj_, &qa), "dequantize");
    if (bf16_) widen_bf16(y16_, w);
  }

  void matmul(const PackedWeight& base, const float* x, float* y, int m,
              const float* bias) override {
    auto& p = const_cast<PluginPacked&>(static_cast<const PluginPacked&>(base));
    loom_quantizer_layout_args la = layout(p, m, "");
    int64_t xs[2] = {m, p.cols};
    int64_t ys[2] = {m, p.rows};
    int64_t bs[1] = {p.rows};
    const DLDataType dt = bf16_ ? kBf16 : kF32;
    const size_t nx = static_cast<size_t>(m) * static_cast<size_t>(p.cols);
    const size_t ny = static_cast<size_t>(m) * static_cast<size_t>(p.rows);
    if (bf16_) y16_.resize(ny);
    DLTensor xt = tensor(const_cast<void*>(bf16_ ? bf16_copy(x, nx, x16_) : x), dt, 2, xs);
    DLTensor yt = tensor(bf16_ ? static_cast<void*>(y16_.data()) : y, dt, 2, ys);
    DLTensor bt =
        tensor(const_cast<void*>(bf16_ ? bf16_copy(bias, static_cast<size_t>(p.rows), b16_) : bias),
               dt, 1, bs);
    DLTensor pk = tensor(p.packed.data(), kU8, 1, &p.packed_len);
    DLTensor sc = tensor(p.scales.data(), p.format.scale_dtype, 1, &p.scale_count);
    DLTensor zp = tensor(p.zeros.data(), p.format.zero_point_dtype, 1, &p.zero_count);
    loom_quantizer_matmul_args ma{};
    ma.struct_size = LOOM_QUANTIZER_MATMUL_ARGS_SIZE;
    ma.format = &p.format;
    ma.x = &xt;
    ma.packed = &pk;
    ma.scales = &sc;
    ma.zero_points = p.zero_count > 0 ? &zp : nullptr;
    ma.bias = bias != nullptr ? &bt : nullptr;
    ma.y = &yt;
    ma.workspace = mws_.get(la.matmul_workspace_bytes);
    ma.workspace_bytes = la.matmul_workspace_bytes;
    check(vt_->matmul(obj_, &ma), "matmul");
    if (bf16_) widen_bf16(y16_, y);
  }

 private:
  loom_quantizer_layout_args layout(PluginPacked& p, int64_t rows, const std::string& name) {
    loom_quantizer_layout_args la{};
    la.struct_size = LOOM_QUANTIZER_LAYOUT_ARGS_SIZE;
    la.role = LOOM_QUANTIZER_WEIGHT;
    la.ndim = 2;
    la.shape = p.shape;
    la.dtype = bf16_ ? kBf16 : kF32;
    la.matmul_rows = rows;
    // The format this instance gives the shape (pack keeps it; a weight read from a file
    // keeps the file's, which the plugin checks against this one).
    laid_ = loom_quant_format{};
    laid_.struct_size = LOOM_QUANT_FORMAT_SIZE;
    la.format = &laid_;
    check(vt_->layout(obj_, &la), "layout" + (name.empty() ? std::string() : " of " + name) + " [" +
                                      std::to_string(p.shape[0]) + ", " +
                                      std::to_string(p.shape[1]) + "]");
    return la;
  }

  void check(loom_status* st, const std::string& what) {
    char msg[1024];
    if (loom_instance_take_status(inst_, st, msg, sizeof(msg)) != LOOM_OK) {
      throw std::runtime_error(who_ + ": " + what + ": " + msg);
    }
  }

  loom_instance* inst_;
  std::string who_;
  void* obj_ = nullptr;
  const loom_quantizer_v1* vt_ = nullptr;
  Scratch ws_, mws_;
  bool bf16_ = false;  // bf16 mode: the float side of every call in bf16 (docs/trainer.md)
  std::vector<uint16_t> x16_, y16_, b16_;
  loom_quant_format laid_{};
};

ParamTensor* find_param(std::vector<ParamTensor>& params, const std::string& name) {
  for (auto& p : params) {
    if (p.name == name) return &p;
  }
  throw std::invalid_argument("loom::trainer: the model has no parameter " + name);
}

}  // namespace

std::unique_ptr<WeightQuantizer> plugin_quantizer(loom_instance* inst, const std::string& who,
                                                  bool bf16) {
  return std::make_unique<PluginQuantizer>(inst, who, bf16);
}

const std::vector<std::string>& default_quant_tensors() {
  static const std::vector<std::string> d{"h.*.attn.qkv.w", "h.*.attn.proj.w", "h.*.mlp.fc.w",
                                          "h.*.mlp.proj.w"};
  return d;
}

bool glob_match(const std::string& pattern, const std::string& text) {
  // Iterative matcher with one backtrack point per '*'.
  size_t p = 0, t = 0, star = std::string::npos, mark = 0;
  while (t < text.size()) {
    if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      mark = t;
    } else if (p < pattern.size() && pattern[p] == text[t]) {
      ++p;
      ++t;
    } else if (star != std::string::npos) {
      p = star + 1;
      t = ++mark;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

std::vector<std::string> select_quant_tensors(const std::vector<ParamTensor>& params,
                                              const std::vector<std::string>& patterns,
                                              const std::vector<int>& layers,
                                              const std::string& who,
                                              std::vector<std::string>& problems) {
  std::vector<std::string> out;
  for (const auto& pat : patterns) {
    bool any = false, non_matrix = false;
    for (const auto& p : params) {
      if (!glob_match(pat, p.name)) continue;
      if (p.shape.size() != 2 || p.name.find(".router.") != std::string::npos) {
        non_matrix = true;
        continue;
      }
      const int l = parameter_block(p.name);
      if (!layers.empty() && std::find(layers.begin(), layers.end(), l) == layers.end()) continue;
      any = true;
      if (std::find(out.begin(), out.end(), p.name) == out.end()) out.push_back(p.name);
    }
    if (!any) {
      problems.push_back(
          who + ": the pattern '" + pat + "' matches no " +
          (non_matrix ? "2-D weight (only the matrices can be quantized: "
                      : "weight of the model (") +
          "h.L.attn.qkv.w, h.L.attn.proj.w, h.L.mlp.fc.w, h.L.mlp.proj.w, wte, "
          "wpe" +
          (layers.empty() ? std::string(")") : std::string(") in [quantization] layers")));
    }
  }
  // In the model's order.
  std::vector<std::string> ordered;
  for (const auto& p : params) {
    if (std::find(out.begin(), out.end(), p.name) != out.end()) ordered.push_back(p.name);
  }
  return ordered;
}

FakeQuantScope::FakeQuantScope(Model& model, WeightQuantizer& q,
                               const std::vector<std::string>& names) {
  auto& params = model.parameters();
  try {
    for (const auto& n : names) {
      ParamTensor* p = find_param(params, n);
      auto packed = q.pack(n, p->value, p->shape[0], p->shape[1]);
      saved_.push_back({p->value, std::vector<float>(p->value, p->value + p->numel)});
      q.unpack(*packed, p->value);
    }
  } catch (...) {
    for (auto& s : saved_) std::copy(s.original.begin(), s.original.end(), s.value);
    throw;
  }
}

FakeQuantScope::~FakeQuantScope() {
  for (auto& s : saved_) std::copy(s.original.begin(), s.original.end(), s.value);
}

QuantizedEval::QuantizedEval(Model& model, WeightQuantizer& q,
                             const std::vector<std::string>& names)
    : model_(model) {
  auto& params = model.parameters();
  packed_.resize(key(model.config().layers, LinearSlot::kQkv));
  quantizer_.assign(packed_.size(), nullptr);
  try {
    for (const auto& n : names) {
      ParamTensor* p = find_param(params, n);
      auto w = q.pack(n, p->value, p->shape[0], p->shape[1]);
      float_bytes_ += 4 * p->numel;
      if (n == "wte" || n == "wpe") {
        // A lookup table: its rows are read decoded (the head multiplies with wte's codes).
        swapped_.push_back({p->value, std::vector<float>(p->value, p->value + p->numel)});
        q.unpack(*w, p->value);
      }
      place(n, &q, std::move(w));
    }
  } catch (...) {
    for (auto& [v, orig] : swapped_) std::copy(orig.begin(), orig.end(), v);
    throw;
  }
  model_.set_linear_hook(this);
}

QuantizedEval::QuantizedEval(Model& model, std::vector<Entry> entries) : model_(model) {
  packed_.resize(key(model.config().layers, LinearSlot::kQkv));
  quantizer_.assign(packed_.size(), nullptr);
  for (auto& e : entries) {
    float_bytes_ += 4 * static_cast<uint64_t>(e.packed->rows * e.packed->cols);
    place(e.name, e.quantizer, std::move(e.packed));
  }
  model_.set_linear_hook(this);
}

void QuantizedEval::place(const std::string& n, WeightQuantizer* q,
                          std::unique_ptr<PackedWeight> w) {
  packed_bytes_ += w->bytes;
  if (n == "wpe") return;  // a lookup table only
  if (n == "wte") {
    quantizer_[key(-1, LinearSlot::kHead)] = q;
    packed_[key(-1, LinearSlot::kHead)] = std::move(w);
    return;
  }
  const LinearSlot slots[] = {LinearSlot::kQkv, LinearSlot::kAttnProj, LinearSlot::kMlpFc,
                              LinearSlot::kMlpProj};
  const int l = parameter_block(n);
  for (const LinearSlot s : slots) {
    if (l >= 0 && l < model_.config().layers &&
        n == "h." + std::to_string(l) + "." + linear_suffix(s)) {
      quantizer_[key(l, s)] = q;
      packed_[key(l, s)] = std::move(w);
      return;
    }
  }
  throw std::invalid_argument("loom::trainer: " + n +
                              " is not a linear weight the quantized evaluation runs");
}

QuantizedEval::~QuantizedEval() {
  model_.set_linear_hook(nullptr);
  for (auto& [v, orig] : swapped_) std::copy(orig.begin(), orig.end(), v);
}

bool QuantizedEval::handles(int layer, LinearSlot slot) {
  const size_t k = key(layer, slot);
  return k < packed_.size() && packed_[k] != nullptr;
}

void QuantizedEval::forward(int layer, LinearSlot slot, const float* x, float* y, int rows, int in,
                            int out, const float* bias) {
  const size_t k = key(layer, slot);
  const PackedWeight& w = *packed_[k];
  if (w.rows != out || w.cols != in) {
    throw std::invalid_argument(
        "loom::trainer: the packed weight of layer " + std::to_string(layer) + " " +
        linear_suffix(slot) + " is [" + std::to_string(w.rows) + ", " + std::to_string(w.cols) +
        "], the matmul needs [" + std::to_string(out) + ", " + std::to_string(in) + "]");
  }
  ++calls_;
  quantizer_[k]->matmul(w, x, y, rows, bias);
}

QuantizedCheckpoint load_quantized_checkpoint(
    const std::string& path, Model& model, loom_session* session,
    std::vector<std::pair<std::string, std::unique_ptr<WeightQuantizer>>>& quantizers,
    const std::string& who) {
  loom_tensor_file* f = nullptr;
  if (loom_tensor_file_open(path.c_str(), &f) != LOOM_OK) {
    throw std::runtime_error(who + ": " + loom_last_error());
  }
  std::unique_ptr<loom_tensor_file, void (*)(loom_tensor_file*)> file(f, loom_tensor_file_close);
  QuantizedCheckpoint out;
  std::error_code ec;
  out.file_bytes = std::filesystem::file_size(path, ec);
  auto& params = model.parameters();
  std::vector<bool> seen(params.size(), false);
  const size_t n = loom_tensor_file_count(f);
  for (size_t i = 0; i < n; ++i) {
    loom_tensor_info t{};
    t.struct_size = LOOM_TENSOR_INFO_SIZE;
    if (loom_tensor_file_info(f, i, &t) != LOOM_OK) {
      throw std::runtime_error(who + ": " + loom_last_error());
    }
    const std::string name = t.name;
    size_t k = 0;
    while (k < params.size() && params[k].name != name) ++k;
    if (k == params.size()) {
      throw std::runtime_error(who + ": " + path + " holds " + name + ", which the model lacks");
    }
    ParamTensor& p = params[k];
    bool same = static_cast<size_t>(t.tensor.ndim) == p.shape.size();
    for (size_t d = 0; same && d < p.shape.size(); ++d) same = t.tensor.shape[d] == p.shape[d];
    if (!same) {
      throw std::runtime_error(who + ": " + path + ": " + name +
                               " has another shape than the model's (a checkpoint of another "
                               "[model])");
    }
    if (loom_tensor_file_read_f32(f, i, p.value, p.numel) != LOOM_OK) {
      throw std::runtime_error(who + ": " + loom_last_error());
    }
    seen[k] = true;
    if (t.quantized == 0) continue;
    const std::string inst = t.quantizer != nullptr ? t.quantizer : "";
    WeightQuantizer* q = nullptr;
    for (auto& [qn, qp] : quantizers) {
      if (qn == inst) q = qp.get();
    }
    if (q == nullptr) {
      loom_instance* qi = nullptr;
      if (loom_find_instance(session, "quantizer", inst.c_str(), &qi) != LOOM_OK) {
        throw std::runtime_error(who + ": " + path + ": " + name + " was quantized by [quantizer." +
                                 inst +
                                 "], which the manifest lacks (evaluate with the manifest loom "
                                 "quantize used): " +
                                 loom_last_error());
      }
      quantizers.emplace_back(inst, plugin_quantizer(qi, who + ": [quantizer." + inst + "]"));
      q = quantizers.back().second.get();
    }
    out.entries.push_back({name, q, static_cast<PluginQuantizer*>(q)->adopt(t)});
    out.names.push_back(name);
    out.instances.push_back(inst);
  }
  for (size_t k = 0; k < params.size(); ++k) {
    if (!seen[k]) {
      throw std::runtime_error(who + ": " + path + " lacks the model's tensor " + params[k].name);
    }
  }
  return out;
}

AdamW::AdamW(std::vector<ParamTensor> params, double lr, double weight_decay)
    : params_(std::move(params)), lr_(lr), wd_(weight_decay) {
  for (const auto& p : params_) {
    m_.emplace_back(p.numel, 0.0f);
    v_.emplace_back(p.numel, 0.0f);
  }
}

void AdamW::step() {
  ++t_;
  const double b1 = 0.9, b2 = 0.999, eps = 1e-8;
  const double c1 = 1.0 - std::pow(b1, static_cast<double>(t_));
  const double c2 = 1.0 - std::pow(b2, static_cast<double>(t_));
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    const bool decay = p.shape.size() >= 2;
    for (size_t j = 0; j < p.numel; ++j) {
      const double g = p.grad[j];
      const double m = b1 * m_[i][j] + (1 - b1) * g;
      const double v = b2 * v_[i][j] + (1 - b2) * g * g;
      m_[i][j] = static_cast<float>(m);
      v_[i][j] = static_cast<float>(v);
      double w = p.value[j];
      if (decay) w -= lr_ * wd_ * w;
      w -= lr_ * (m / c1) / (std::sqrt(v / c2) + eps);
      p.value[j] = static_cast<float>(w);
    }
  }
}

std::vector<LkdLayer> layerwise_distill(Model& student, Model& teacher, WeightQuantizer& q,
                                        const std::vector<std::string>& names, int64_t steps,
                                        double lr, const BatchFn& batch) {
  const int L = student.config().layers;
  const int C = student.config().dim;
  const int V = teacher.config().vocab_size;
  std::vector<LkdLayer> out;
  std::vector<int32_t> tokens, first_tokens;
  std::vector<float> logits, x, y, dy, dx;
  int first_b = 0, first_t = 0;
  batch(0, first_tokens, first_b, first_t);
  // The teacher's input to block l and its output, for a batch.
  auto teacher_io = [&](const std::vector<int32_t>& tok, int B, int Tn, int l) {
    const size_t n = static_cast<size_t>(B) * Tn * C;
    logits.resize(static_cast<size_t>(B) * Tn * V);
    teacher.forward_logits(tok.data(), B, Tn, logits.data());
    const float* in = teacher.layer_output(l - 1);
    const float* target = teacher.layer_output(l);
    x.assign(in, in + n);
    return std::vector<float>(target, target + n);
  };
  for (int l = 0; l < L; ++l) {
    const std::string prefix = "h." + std::to_string(l) + ".";
    std::vector<std::string> mine;
    for (const auto& n : names) {
      if (n.rfind(prefix, 0) == 0) mine.push_back(n);
    }
    auto block_params = student.block_parameters(l);
    AdamW opt(block_params, lr);
    // The block's MSE on `tok` (fake-quantized weights); with `grad`, its gradients too.
    auto mse = [&](const std::vector<int32_t>& tok, int B, int Tn, bool grad) {
      const std::vector<float> target = teacher_io(tok, B, Tn, l);
      const size_t n = target.size();
      y.resize(n);
      FakeQuantScope fq(student, q, mine);
      student.block_forward(l, x.data(), y.data(), B, Tn);
      double acc = 0;
      dy.resize(n);
      for (size_t i = 0; i < n; ++i) {
        const double e = static_cast<double>(y[i]) - target[i];
        acc += e * e;
        dy[i] = static_cast<float>(2.0 * e / static_cast<double>(n));
      }
      if (grad) {
        for (auto& p : block_params) std::fill(p.grad, p.grad + p.numel, 0.0f);
        dx.resize(n);
        student.block_backward(l, dy.data(), dx.data(), B, Tn);
      }
      return acc / static_cast<double>(n);
    };
    LkdLayer r;
    r.layer = l;
    r.mse_before = mse(first_tokens, first_b, first_t, false);
    for (int64_t s = 0; s < steps; ++s) {
      int B = 0, Tn = 0;
      batch(s, tokens, B, Tn);
      mse(tokens, B, Tn, true);  // the scope restored the float weights; grads are STE's
      opt.step();
    }
    r.mse_after = mse(first_tokens, first_b, first_t, false);
    for (auto& p : block_params) std::fill(p.grad, p.grad + p.numel, 0.0f);
    out.push_back(r);
  }
  return out;
}

}  // namespace loom::trainer
