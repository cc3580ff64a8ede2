// Quantized evaluation and quantization-aware training for the reference trainer
// (docs/trainer.md "Quantization"): which weights are quantized, the packed weights the
// evaluation's matmuls run on (the model's linear-layer seam, linear_hook.hpp), fake
// quantization with the straight-through estimator for QAT, and ZeroQuant's layer-by-layer
// distillation. The quantizer itself is an interface: PluginQuantizer (a loom.quantizer/1
// instance of the manifest) in the trainer, plain C++ ones in the tests.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "model.hpp"

struct loom_instance;
struct loom_session;

namespace loom::trainer {

// One weight W [rows, cols] in a quantizer's packed form.
struct PackedWeight {
  virtual ~PackedWeight() = default;
  int64_t rows = 0;
  int64_t cols = 0;
  uint64_t bytes = 0;  // what it stores: codes, scales and zero points
};

class WeightQuantizer {
 public:
  virtual ~WeightQuantizer() = default;
  // W [rows, cols] (out features, in features) in the packed form; `name` is for errors.
  virtual std::unique_ptr<PackedWeight> pack(const std::string& name, const float* w, int64_t rows,
                                             int64_t cols) = 0;
  // The decoded weight [rows, cols] (fake quantization, embedding lookups).
  virtual void unpack(const PackedWeight& p, float* w) = 0;
  // y [m, rows] = x [m, cols] . W^T (+ bias [rows]) computed on the packed form.
  virtual void matmul(const PackedWeight& p, const float* x, float* y, int m,
                      const float* bias) = 0;
};

// A loom.quantizer/1 instance (found by the caller) as a WeightQuantizer: layout, quantize,
// dequantize and matmul through its table; `who` prefixes every error (the config key).
// Throws std::runtime_error naming `who` when the instance is not a quantizer or has no
// matmul for the weights it makes. With bf16 (the trainer's bf16 mode) the float side of
// every call is bf16: the weights' bf16 rounding is quantized, and dequantized weights and
// matmul outputs come back rounded to bf16.
std::unique_ptr<WeightQuantizer> plugin_quantizer(loom_instance* inst, const std::string& who,
                                                  bool bf16 = false);

// The default [quantization] tensors: every block's four linear weights.
const std::vector<std::string>& default_quant_tensors();

// The names of the model's parameters that match any of `patterns` (globs: `*` matches any
// run of characters) and, when `layers` is not empty, belong to one of those blocks (wte and
// wpe have no block: `layers` leaves them out). Only 2-D weights qualify. Appends to
// `problems` one message per pattern that matches nothing quantizable (prefixed with `who`).
std::vector<std::string> select_quant_tensors(const std::vector<ParamTensor>& params,
                                              const std::vector<std::string>& patterns,
                                              const std::vector<int>& layers,
                                              const std::string& who,
                                              std::vector<std::string>& problems);

bool glob_match(const std::string& pattern, const std::string& text);

// While alive: the selected weights of `model` hold dequantize(quantize(W)) (their float
// values saved); the destructor puts the float values back. A forward_backward inside the
// scope thus computes the gradient at the quantized weights and adds it into the float
// weights' gradients: the straight-through estimator.
class FakeQuantScope {
 public:
  FakeQuantScope(Model& model, WeightQuantizer& q, const std::vector<std::string>& names);
  ~FakeQuantScope();
  FakeQuantScope(const FakeQuantScope&) = delete;
  FakeQuantScope& operator=(const FakeQuantScope&) = delete;

 private:
  struct Saved {
    float* value;
    std::vector<float> original;
  };
  std::vector<Saved> saved_;
};

// While alive: the model's evaluation forwards run the selected linear weights through the
// quantizer's matmul on their packed forms (packed from the model's current float weights when
// constructed); a selected wte also runs the head through it, and the embedding lookups of a
// selected wte or wpe read their decoded rows. The destructor restores the model.
class QuantizedEval final : public LinearHook {
 public:
  // A weight already packed (read from a file) and the quantizer whose matmul takes it.
  struct Entry {
    std::string name;
    WeightQuantizer* quantizer;
    std::unique_ptr<PackedWeight> packed;
  };
  QuantizedEval(Model& model, WeightQuantizer& q, const std::vector<std::string>& names);
  // The packed weights given; the embedding tables among them must already hold their
  // decoded values (load_quantized_checkpoint does that).
  QuantizedEval(Model& model, std::vector<Entry> entries);
  ~QuantizedEval() override;
  QuantizedEval(const QuantizedEval&) = delete;
  QuantizedEval& operator=(const QuantizedEval&) = delete;

  bool handles(int layer, LinearSlot slot) override;
  void forward(int layer, LinearSlot slot, const float* x, float* y, int rows, int in, int out,
               const float* bias) override;
  // Bytes of the packed forms, and of the float tensors they replace.
  uint64_t packed_bytes() const { return packed_bytes_; }
  uint64_t float_bytes() const { return float_bytes_; }
  int64_t matmul_calls() const { return calls_; }

 private:
  static size_t key(int layer, LinearSlot slot) {
    return static_cast<size_t>(layer + 1) * 8 + static_cast<size_t>(slot);
  }
  void place(const std::string& name, WeightQuantizer* q, std::unique_ptr<PackedWeight> w);
  Model& model_;
  std::vector<std::unique_ptr<PackedWeight>> packed_;           // by key(); null: float
  std::vector<WeightQuantizer*> quantizer_;                     // by key()
  std::vector<std::pair<float*, std::vector<float>>> swapped_;  // embedding tables decoded
  uint64_t packed_bytes_ = 0, float_bytes_ = 0;
  int64_t calls_ = 0;
};

// A safetensors file written by `loom quantize`, read through libloom's tensor-file C API: its
// plain tensors go into the model's parameters; each quantized one is decoded into its
// parameter (the float path and the embedding lookups) and kept packed, with the session's
// quantizer instance the file names (`quantizers` caches them by name), for QuantizedEval.
// Every parameter must be in the file, with its shape. Errors name the file (and `who`).
struct QuantizedCheckpoint {
  std::vector<QuantizedEval::Entry> entries;
  std::vector<std::string> names;      // the quantized tensors
  std::vector<std::string> instances;  // their quantizer instances, in the same order
  uint64_t file_bytes = 0;
};
QuantizedCheckpoint load_quantized_checkpoint(
    const std::string& path, Model& model, loom_session* session,
    std::vector<std::pair<std::string, std::unique_ptr<WeightQuantizer>>>& quantizers,
    const std::string& who);

// AdamW over a set of float tensors (decoupled weight decay on 2-D tensors only), for LKD.
class AdamW {
 public:
  AdamW(std::vector<ParamTensor> params, double lr, double weight_decay = 0.01);
  void step();  // one update from the tensors' grads
 private:
  std::vector<ParamTensor> params_;
  std::vector<std::vector<float>> m_, v_;
  double lr_, wd_;
  int64_t t_ = 0;
};

// ZeroQuant's layer-by-layer distillation. For each block l in turn: `steps` AdamW steps on
// block l's parameters only; each step runs the fp32 teacher on a batch (batch(i, tokens,
// batch_size, seq) fills it), feeds the teacher's input to block l into the student's block l
// with its selected weights fake-quantized, and descends the mean squared error between that
// output and the teacher's block l output (straight-through gradients). No labels.
struct LkdLayer {
  int layer = 0;
  double mse_before = 0;  // on the first batch, before block l's steps
  double mse_after = 0;   // on the same batch, after them
};
using BatchFn =
    std::function<void(int64_t index, std::vector<int32_t>& tokens, int& batch, int& seq)>;
std::vector<LkdLayer> layerwise_distill(Model& student, Model& teacher, WeightQuantizer& q,
                                        const std::vector<std::string>& names, int64_t steps,
                                        double lr, const BatchFn& batch);

}  // namespace loom::trainer
