// [gradients] overlap with an optimizer that exchanges the gradients itself (the 1-bit
// family): as the backward finishes each block, its tensors are announced to the optimizer
// (loom_optimizer_grads_ready), which starts the exchange of every bucket they complete while
// the backward goes on (docs/trainer.md "Gradient communication"). The buckets are the
// optimizer's (onebit_adam's bucket_mb); the outcome is the bits of the step without overlap.
//
// The trainer lays the optimizer's tensors out in the order the backward finishes them
// (backward_order), so each block is one range of tensors and the buckets fill one after
// another (also with overlap = false, for the same bits). What is finished only at the end (the
// embeddings, the final LayerNorm) is not announced: step() takes it, after every after_backward
// hook has run.
#pragma once

#include <loom/embed.h>

#include <cstdint>
#include <ostream>
#include <utility>
#include <vector>

#include "feature.hpp"
#include "model.hpp"

namespace loom::trainer {

// True when the optimizer has grads_ready (since ABI 1.6).
bool announces_gradients(loom_instance* optimizer);

class GradientAnnounceFeature final : public Feature {
 public:
  // `blocks[l]`: the range [first, first + count) of the step's tensors (numbered across
  // `groups` in order) that block l's backward finishes. The groups stay where they are for
  // the feature's life.
  // `overlap` false: nothing is announced (step() does it all, the same bits).
  GradientAnnounceFeature(Model& model, loom_instance* optimizer,
                          const std::vector<loom_optimizer_group>& groups,
                          std::vector<std::pair<size_t, size_t>> blocks, bool overlap);
  ~GradientAnnounceFeature() override;

  void before_forward(int64_t step, const Batch& b, int64_t first_row) override;
  void banner(BannerPart part, std::ostream& out) const override;
  void summary(nlohmann::json& s, double train_step_s) const override;

 private:
  void ready(int layer);  // the model's grad-ready seam

  Model& model_;
  loom_instance* opt_;
  const std::vector<loom_optimizer_group>& groups_;
  std::vector<std::pair<size_t, size_t>> blocks_;
  loom_optimizer_step_args args_{};
  bool overlap_ = true;
  uint64_t announced_ = 0;  // tensors announced during the backward, all steps
  uint64_t steps_ = 0;
};

}  // namespace loom::trainer
