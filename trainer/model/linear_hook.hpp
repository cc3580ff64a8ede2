// The model's linear-layer seam: at evaluation, each weight matmul of a block (the attention's
// qkv and proj, the MLP's fc and proj) and the tied output head may run through a hook instead
// of the float sgemm, e.g. a quantizer's matmul on packed codes. Gpt<T> asks the hook, for
// every such matmul of an evaluation forward (forward_loss without training, forward_logits),
// whether it takes that layer's slot; when it does, the hook writes y itself. Training
// forwards (forward_backward, forward_loss with training) never consult it: their backward
// needs the float weights the forward used. A replaced MLP (Gpt::replace_mlp) is not a dense
// MLP and is never routed through the hook.
//
// Distillation (the quantization-aware training procedures): Gpt<T>::set_distillation makes a
// training forward add to the cross-entropy a soft cross-entropy against a teacher's logits
// and a mean squared error of every block's output against the teacher's, and the backward
// their gradients (see DistillationT).
#pragma once

#include <cstdint>
#include <vector>

namespace loom::trainer {

// Which matmul of a layer. kHead is the tied output head (layer -1, W = wte [vocab, dim]).
enum class LinearSlot : int { kQkv = 0, kAttnProj = 1, kMlpFc = 2, kMlpProj = 3, kHead = 4 };

// The parameter name of a slot's weight: "h.L.attn.qkv.w", ..., "wte" for the head.
inline const char* linear_suffix(LinearSlot s) {
  switch (s) {
    case LinearSlot::kQkv:
      return "attn.qkv.w";
    case LinearSlot::kAttnProj:
      return "attn.proj.w";
    case LinearSlot::kMlpFc:
      return "mlp.fc.w";
    case LinearSlot::kMlpProj:
      return "mlp.proj.w";
    case LinearSlot::kHead:
      return "wte";
  }
  return "";
}

template <typename T>
class LinearHookT {
 public:
  virtual ~LinearHookT() = default;
  // Whether the slot of layer `layer` (-1 with kHead) runs through forward().
  virtual bool handles(int layer, LinearSlot slot) = 0;
  // y [rows, out] = x [rows, in] . W^T (+ bias [out], NULL for none), W the slot's weight
  // [out, in] as the hook holds it. Writes y.
  virtual void forward(int layer, LinearSlot slot, const T* x, T* y, int rows, int in, int out,
                       const T* bias) = 0;
};

using LinearHook = LinearHookT<float>;

// What a training forward distils from (all pointers owned by the caller, valid until the
// backward of that forward): loss = CE + logit_weight * SCE + hidden_weight * MSE, where
//   SCE = mean over rows of -sum_v q_v log p_v, p = softmax(student logits), q =
//         softmax(teacher_logits) [rows, vocab];
//   MSE = mean over the blocks l with teacher_hidden[l] != NULL of the mean over elements of
//         (h_l - teacher_hidden[l])^2, h_l block l's output [rows, dim].
template <typename T>
struct DistillationT {
  const T* teacher_logits = nullptr;  // NULL: no logit term
  double logit_weight = 0;
  std::vector<const T*> teacher_hidden;  // one per layer (NULL: that layer has no term)
  double hidden_weight = 0;
};

using Distillation = DistillationT<float>;

// The terms of the last distilled forward (unweighted).
struct DistillationTerms {
  double ce = 0;
  double soft_ce = 0;
  double hidden_mse = 0;
};

}  // namespace loom::trainer
