// The trainer's quantization procedures (trainer/train/quantization.*) against
// quantizers written here in plain C++: the linear-layer seam at evaluation (every block
// matmul through the quantizer, an 8-bit one close to fp32, a lossless one equal to it),
// fake quantization with the straight-through estimator, layer-by-layer distillation, the
// tensor selection, and the [quantization] keys' errors at FILE:LINE:COL.
#include <gtest/gtest.h>
#include <loom/embed.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "bf16.hpp"
#include "config.hpp"
#include "quantization.hpp"

namespace fs = std::filesystem;
using namespace loom::trainer;

namespace {

// Symmetric per-row INT quantization (exact range, round half to even) with `bits` bits;
// bits 0: lossless (the codes are the floats). matmul multiplies x by the codes and applies
// the row scale after the sum: it never decodes W.
struct RowPacked final : PackedWeight {
  std::vector<float> codes;  // integers (or the floats themselves when lossless)
  std::vector<float> scale;  // per row
};

class RowQuantizer final : public WeightQuantizer {
 public:
  explicit RowQuantizer(int bits) : bits_(bits) {}
  std::unique_ptr<PackedWeight> pack(const std::string&, const float* w, int64_t rows,
                                     int64_t cols) override {
    auto p = std::make_unique<RowPacked>();
    p->rows = rows;
    p->cols = cols;
    p->codes.resize(static_cast<size_t>(rows * cols));
    p->scale.assign(static_cast<size_t>(rows), 1.0f);
    const float qmax = bits_ > 0 ? static_cast<float>((1 << (bits_ - 1)) - 1) : 0.0f;
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = w + r * cols;
      float mx = 0;
      for (int64_t k = 0; k < cols; ++k) mx = std::max(mx, std::fabs(row[k]));
      const float s = bits_ == 0 || mx == 0 ? 1.0f : mx / qmax;
      p->scale[static_cast<size_t>(r)] = s;
      for (int64_t k = 0; k < cols; ++k) {
        p->codes[static_cast<size_t>(r * cols + k)] =
            bits_ == 0 ? row[k] : std::clamp(std::nearbyint(row[k] / s), -qmax, qmax);
      }
    }
    p->bytes = static_cast<uint64_t>(rows * cols) * (bits_ == 0 ? 4 : 1) + 4 * rows;
    return p;
  }
  void unpack(const PackedWeight& base, float* w) override {
    const auto& p = static_cast<const RowPacked&>(base);
    for (int64_t r = 0; r < p.rows; ++r)
      for (int64_t k = 0; k < p.cols; ++k)
        w[r * p.cols + k] = p.codes[static_cast<size_t>(r * p.cols + k)] * p.scale[r];
  }
  void matmul(const PackedWeight& base, const float* x, float* y, int m,
              const float* bias) override {
    const auto& p = static_cast<const RowPacked&>(base);
    ++calls;
    for (int i = 0; i < m; ++i) {
      for (int64_t n = 0; n < p.rows; ++n) {
        double acc = 0;
        const float* c = p.codes.data() + n * p.cols;
        for (int64_t k = 0; k < p.cols; ++k) acc += static_cast<double>(x[i * p.cols + k]) * c[k];
        y[i * p.rows + n] = static_cast<float>(acc * p.scale[static_cast<size_t>(n)]) +
                            (bias != nullptr ? bias[n] : 0.0f);
      }
    }
  }
  int64_t calls = 0;

 private:
  int bits_;
};

ModelConfig tiny() { return ModelConfig{64, 16, 2, 2, 32}; }

struct Batch {
  std::vector<int32_t> x, y;
};
Batch batch(int B, int T, uint32_t seed) {
  Batch b;
  uint32_t s = seed;
  for (int i = 0; i < B * T; ++i) {
    s = s * 1664525u + 1013904223u;
    b.x.push_back(static_cast<int32_t>((s >> 8) % 64));
    b.y.push_back(static_cast<int32_t>((s >> 20) % 64));
  }
  return b;
}

// A model trained a few steps (plain SGD), so its weights are not the symmetric init.
void train_a_little(Model& m, int steps) {
  for (int s = 0; s < steps; ++s) {
    const Batch b = batch(4, 16, 100u + static_cast<uint32_t>(s));
    m.zero_grad();
    m.forward_backward(b.x.data(), b.y.data(), 4, 16);
    for (auto& p : m.parameters())
      for (size_t i = 0; i < p.numel; ++i) p.value[i] -= 0.05f * p.grad[i];
  }
}

std::vector<std::string> linear_names(Model& m) {
  std::vector<std::string> problems;
  auto names = select_quant_tensors(m.parameters(), default_quant_tensors(), {}, "t", problems);
  EXPECT_TRUE(problems.empty());
  return names;
}

}  // namespace

TEST(QuantSeam, EveryBlockMatmulRunsThroughTheQuantizerAndInt8StaysCloseToFp32) {
  Model m(tiny(), 7);
  train_a_little(m, 5);
  const Batch b = batch(3, 16, 42);
  const float fp32 = m.forward_loss(b.x.data(), b.y.data(), 3, 16);
  const auto names = linear_names(m);
  ASSERT_EQ(names.size(), 8u);  // 2 layers x qkv, proj, fc, proj
  {
    RowQuantizer lossless(0);
    QuantizedEval qe(m, lossless, names);
    const float same = m.forward_loss(b.x.data(), b.y.data(), 3, 16);
    EXPECT_EQ(lossless.calls, 8);  // every block matmul of the forward, once
    EXPECT_NEAR(same, fp32, 2e-5f);
  }
  {
    RowQuantizer int8(8);
    QuantizedEval qe(m, int8, names);
    const float q8 = m.forward_loss(b.x.data(), b.y.data(), 3, 16);
    EXPECT_EQ(int8.calls, 8);
    EXPECT_NE(q8, fp32);                  // the codes are not the floats
    EXPECT_NEAR(q8, fp32, 2e-3f * fp32);  // but 8 bits per row are close
    EXPECT_EQ(qe.packed_bytes(), (3 + 1 + 4 + 4) * 32 * 32 * 2 + 4 * (96 + 32 + 128 + 32) * 2u);
    EXPECT_EQ(qe.float_bytes(), 4u * (3 + 1 + 4 + 4) * 32 * 32 * 2);
    // A training forward never takes the hook: its backward needs the float weights.
    m.zero_grad();
    const float train = m.forward_backward(b.x.data(), b.y.data(), 3, 16);
    EXPECT_EQ(int8.calls, 8);
    EXPECT_NEAR(train, fp32, 1e-6f);
    // 2 bits per row: far from fp32 (the seam really uses the quantizer's numbers).
    RowQuantizer int2(2);
    QuantizedEval coarse(m, int2, names);
    EXPECT_GT(std::fabs(m.forward_loss(b.x.data(), b.y.data(), 3, 16) - fp32),
              5 * std::fabs(q8 - fp32));
  }
  // Removed: the float path again.
  EXPECT_EQ(m.forward_loss(b.x.data(), b.y.data(), 3, 16), fp32);
}

TEST(QuantSeam, TheTiedHeadAndTheEmbeddingsCanBeQuantizedToo) {
  Model m(tiny(), 7);
  train_a_little(m, 5);
  const Batch b = batch(2, 16, 43);
  const float fp32 = m.forward_loss(b.x.data(), b.y.data(), 2, 16);
  std::vector<std::string> problems;
  const auto names = select_quant_tensors(m.parameters(), {"wte", "wpe"}, {}, "t", problems);
  ASSERT_EQ(names, (std::vector<std::string>{"wte", "wpe"}));
  const std::vector<float> wte(m.parameters()[0].value, m.parameters()[0].value + 64 * 32);
  RowQuantizer int8(8);
  {
    QuantizedEval qe(m, int8, names);
    const float q = m.forward_loss(b.x.data(), b.y.data(), 2, 16);
    EXPECT_EQ(int8.calls, 1);  // the head
    EXPECT_NE(q, fp32);
    EXPECT_NEAR(q, fp32, 2e-3f * fp32);
  }
  // The lookup tables were decoded for the evaluation and are float again.
  EXPECT_TRUE(std::equal(wte.begin(), wte.end(), m.parameters()[0].value));
}

TEST(QuantQat, TheStraightThroughGradientIsTheFp32GradientAtTheQuantizedWeights) {
  Model a(tiny(), 11), b(tiny(), 11);
  train_a_little(a, 3);
  train_a_little(b, 3);
  const auto names = linear_names(a);
  RowQuantizer q(4);
  const Batch d = batch(2, 16, 5);
  std::vector<std::vector<float>> before;
  for (auto& p : a.parameters()) before.emplace_back(p.value, p.value + p.numel);
  a.zero_grad();
  float loss_a;
  {
    FakeQuantScope fq(a, q, names);
    loss_a = a.forward_backward(d.x.data(), d.y.data(), 2, 16);
  }
  // The float weights are back, bit for bit.
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(std::equal(before[i].begin(), before[i].end(), a.parameters()[i].value))
        << a.parameters()[i].name;
  }
  // b: the same weights with the selected ones replaced by their quantized values.
  for (auto& p : b.parameters()) {
    if (std::find(names.begin(), names.end(), p.name) == names.end()) continue;
    auto packed = q.pack(p.name, p.value, p.shape[0], p.shape[1]);
    q.unpack(*packed, p.value);
  }
  b.zero_grad();
  const float loss_b = b.forward_backward(d.x.data(), d.y.data(), 2, 16);
  EXPECT_EQ(loss_a, loss_b);
  size_t differing = 0;
  for (size_t i = 0; i < a.parameters().size(); ++i) {
    const auto& pa = a.parameters()[i];
    const auto& pb = b.parameters()[i];
    EXPECT_TRUE(std::equal(pa.grad, pa.grad + pa.numel, pb.grad)) << pa.name;
    // At least the quantized weights' gradients differ from the fp32 model's own.
    differing += pa.numel;
  }
  EXPECT_GT(differing, 0u);
  // And they are not the gradients at the float weights: 4 bits move them.
  Model c(tiny(), 11);
  train_a_little(c, 3);
  c.zero_grad();
  c.forward_backward(d.x.data(), d.y.data(), 2, 16);
  double diff = 0;
  for (size_t i = 0; i < c.parameters().size(); ++i) {
    for (size_t j = 0; j < c.parameters()[i].numel; ++j)
      diff += std::fabs(c.parameters()[i].grad[j] - a.parameters()[i].grad[j]);
  }
  EXPECT_GT(diff, 1e-4);
}

TEST(QuantLkd, LayerByLayerDistillationLowersEachBlocksMse) {
  Model teacher(tiny(), 3), student(tiny(), 3);
  train_a_little(teacher, 5);
  train_a_little(student, 5);  // the same weights: the student starts as the teacher
  RowQuantizer q(3);
  const auto names = linear_names(student);
  std::vector<float> wte_before(student.parameters()[0].value,
                                student.parameters()[0].value + student.parameters()[0].numel);
  const auto res = layerwise_distill(student, teacher, q, names, 12, 3e-4,
                                     [](int64_t i, std::vector<int32_t>& tok, int& B, int& T) {
                                       tok = batch(2, 16, 900u + static_cast<uint32_t>(i)).x;
                                       B = 2;
                                       T = 16;
                                     });
  ASSERT_EQ(res.size(), 2u);
  for (const auto& r : res) {
    EXPECT_GT(r.mse_before, 0.0) << r.layer;  // 3 bits: the block's output moved
    EXPECT_LT(r.mse_after, 0.8 * r.mse_before) << r.layer;
  }
  // Only the blocks' parameters were trained.
  EXPECT_TRUE(std::equal(wte_before.begin(), wte_before.end(), student.parameters()[0].value));
}

TEST(QuantSelect, PatternsLayersAndWhatCannotBeQuantized) {
  EXPECT_TRUE(glob_match("h.*.mlp.*.w", "h.12.mlp.fc.w"));
  EXPECT_FALSE(glob_match("h.*.mlp.*.w", "h.12.mlp.fc.b"));
  EXPECT_TRUE(glob_match("*", ""));
  EXPECT_FALSE(glob_match("wte", "wte2"));
  Model m(ModelConfig{64, 16, 3, 2, 32}, 1);
  std::vector<std::string> problems;
  auto names = select_quant_tensors(m.parameters(), {"h.*.mlp.fc.w", "h.*.attn.qkv.w"}, {0, 2},
                                    "WHERE", problems);
  EXPECT_TRUE(problems.empty());
  EXPECT_EQ(names, (std::vector<std::string>{"h.0.attn.qkv.w", "h.0.mlp.fc.w", "h.2.attn.qkv.w",
                                             "h.2.mlp.fc.w"}));
  names = select_quant_tensors(m.parameters(), {"h.*.ln1.w", "nothing*"}, {}, "WHERE", problems);
  EXPECT_TRUE(names.empty());
  ASSERT_EQ(problems.size(), 2u);
  EXPECT_NE(problems[0].find("WHERE: the pattern 'h.*.ln1.w' matches no 2-D weight"),
            std::string::npos)
      << problems[0];
  EXPECT_NE(problems[1].find("'nothing*' matches no weight"), std::string::npos) << problems[1];
}

namespace {
fs::path temp_dir() {
  const fs::path d =
      fs::temp_directory_path() / ("loom-trainer-quant-" + std::to_string(::getpid()));
  fs::create_directories(d);
  return d;
}
std::string error_of(const fs::path& cfg, const std::string& text) {
  {
    std::ofstream f(cfg, std::ios::binary | std::ios::trunc);
    f << text;
  }
  try {
    load_config(cfg.string());
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}
const std::string kBase =
    "[manifest]\npath = \"m.toml\"\n[data]\ndataset = \"x\"\n[model]\nlayers = 2\n";
}  // namespace

TEST(QuantConfig, KeysAreReadAndBadValuesNamedAtTheirPlace) {
  const auto cfg = temp_dir() / "q.toml";
  ASSERT_EQ(error_of(cfg, kBase + "[quantization]\nquantizer = \"w4\"\nqat = true\nkd = true\n"
                                  "weights = \"fp32.safetensors\"\nkd_weight = 0.5\nlayers = [1]\n"
                                  "tensors = [\"h.*.mlp.*.w\"]\nlkd_steps = 3\nlkd_lr = 1e-3\n"),
            "");
  const TrainConfig c = load_config(cfg.string());
  EXPECT_EQ(c.quantizer, "w4");
  EXPECT_EQ(c.quantizer_at, cfg.string() + ":8:13");
  EXPECT_TRUE(c.qat && c.kd);
  EXPECT_EQ(c.kd_weight, 0.5);
  EXPECT_EQ(c.lkd_steps, 3);
  EXPECT_EQ(c.weights, (cfg.parent_path() / "fp32.safetensors").string());
  EXPECT_EQ(c.teacher, c.weights);  // the teacher defaults to the weights
  EXPECT_EQ(quantized_tensor_names(c),
            (std::vector<std::string>{"h.1.mlp.fc.w", "h.1.mlp.proj.w"}));
  // The defaults: every block's four linear weights.
  ASSERT_EQ(error_of(cfg, kBase + "[quantization]\nquantizer = \"w8\"\n"), "");
  EXPECT_EQ(quantized_tensor_names(load_config(cfg.string())).size(), 8u);

  const std::string f = cfg.string();
  EXPECT_EQ(error_of(cfg, kBase + "[quantization]\nqat = true\n"),
            f + ":7:1: [quantization] quantizer is required (the manifest's [quantizer.NAME])");
  EXPECT_EQ(error_of(cfg, kBase + "[quantization]\nquantizer = \"q\"\nkd = true\n"),
            f + ":9:6: [quantization] kd: needs the fp32 teacher: set teacher (or weights, which "
                "the teacher defaults to)");
  EXPECT_EQ(error_of(cfg, kBase + "[quantization]\nquantizer = \"q\"\nlkd_steps = 5\n"),
            f + ":9:13: [quantization] lkd_steps: needs the fp32 teacher: set teacher (or "
                "weights, which the teacher defaults to)");
  EXPECT_EQ(error_of(cfg, kBase + "[quantization]\nquantizer = \"q\"\nlayers = [0, 2]\n"),
            f + ":9:14: [quantization] layers: layer 2 is out of range [0, 2) ([model] layers 2)");
  EXPECT_EQ(error_of(cfg, kBase + "[quantization]\nquantizer = \"q\"\ntensors = [\"h.*.ln1.w\"]\n"),
            f + ":9:11: [quantization] tensors: the pattern 'h.*.ln1.w' matches no 2-D weight "
                "(only the matrices can be quantized: h.L.attn.qkv.w, h.L.attn.proj.w, "
                "h.L.mlp.fc.w, h.L.mlp.proj.w, wte, wpe)");
  EXPECT_EQ(error_of(cfg, kBase + "[quantization]\nquantizer = \"q\"\nqatt = true\n"),
            f + ":9:1: [quantization] qatt: unknown key (did you mean 'qat'?)");
  EXPECT_EQ(error_of(cfg, kBase + "[quantization]\nquantizer = \"q\"\nteacher = \"t\"\n"),
            f + ":9:11: [quantization] teacher: no procedure uses it (set lkd_steps or kd = true)");
  EXPECT_EQ(error_of(cfg, kBase + "[quantization]\nquantizer = \"q\"\nlkd_lr = -1.0\n"),
            f + ":9:10: [quantization] lkd_lr: -1 is out of range [0, 10]");
}

// bf16 mode's quantizer (plugin_quantizer with bf16, over the bundled zeroquant): the plugin
// gets bf16 tensors, so packing W is packing its bf16 rounding, and the decoded weight and the
// matmul's output are the fp32 calls' on the rounded inputs, rounded to bf16.
TEST(QuantPlugin, Bf16ModeHandsTheQuantizerBf16Tensors) {
  loom_open_options o{};
  o.struct_size = LOOM_OPEN_OPTIONS_SIZE;
  o.log_level = -1;
  loom_session* s = nullptr;
  ASSERT_EQ(loom_open_string("[quantizer.w8]\nplugin = \"zeroquant\"\nactivation_bits = 0\n",
                             "bf16.toml", &o, &s),
            0)
      << loom_last_error();
  loom_instance* qi = nullptr;
  ASSERT_EQ(loom_find_instance(s, "quantizer", "w8", &qi), 0) << loom_last_error();
  const auto q32 = loom::trainer::plugin_quantizer(qi, "w8");
  const auto q16 = loom::trainer::plugin_quantizer(qi, "w8", true);
  const int64_t n = 8, k = 32;
  const int m = 3;
  auto rounded = [](std::vector<float> v) {
    for (auto& x : v) x = loom::trainer::round_bf16(x);
    return v;
  };
  std::vector<float> w(n * k), x(m * k), b(n);
  for (size_t i = 0; i < w.size(); ++i) w[i] = std::sin(0.37f * static_cast<float>(i)) * 0.2f;
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::cos(0.11f * static_cast<float>(i));
  for (size_t i = 0; i < b.size(); ++i) b[i] = 0.01f * static_cast<float>(i);
  const auto wr = rounded(w), xr = rounded(x), br = rounded(b);
  const auto p32 = q32->pack("w", wr.data(), n, k);
  const auto p16 = q16->pack("w", w.data(), n, k);
  std::vector<float> u32(w.size()), u16(w.size());
  q32->unpack(*p32, u32.data());
  q16->unpack(*p16, u16.data());
  EXPECT_EQ(u16, rounded(u32));
  EXPECT_NE(u16, u32);  // the rounding is real
  std::vector<float> y32(m * n), y16(m * n);
  q32->matmul(*p32, xr.data(), y32.data(), m, br.data());
  q16->matmul(*p16, x.data(), y16.data(), m, b.data());
  EXPECT_EQ(y16, rounded(y32));
  loom_close(s);
}
