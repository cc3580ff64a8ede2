#include "gradient_announce_feature.hpp"

#include <loom/kinds/optimizer.h>

#include <string>

#include "run.hpp"

namespace loom::trainer {

bool announces_gradients(loom_instance* optimizer) {
  const auto* vt = static_cast<const loom_optimizer_v1*>(loom_instance_vtable(optimizer));
  return vt != nullptr && vt->struct_size >= LOOM_STRUCT_SIZE(loom_optimizer_v1, grads_ready) &&
         vt->grads_ready != nullptr;
}

GradientAnnounceFeature::GradientAnnounceFeature(Model& model, loom_instance* optimizer,
                                                 const std::vector<loom_optimizer_group>& groups,
                                                 std::vector<std::pair<size_t, size_t>> blocks,
                                                 bool overlap)
    : model_(model),
      opt_(optimizer),
      groups_(groups),
      blocks_(std::move(blocks)),
      overlap_(overlap) {
  if (overlap_) model_.set_grad_ready([this](int layer) { ready(layer); });
}

GradientAnnounceFeature::~GradientAnnounceFeature() { model_.set_grad_ready({}); }

void GradientAnnounceFeature::before_forward(int64_t step, const Batch& /*b*/,
                                             int64_t /*first_row*/) {
  // The step() to come gets the same groups, grad_scale and step (its lr is known later).
  args_ = loom_optimizer_step_args{
      LOOM_OPTIMIZER_STEP_ARGS_SIZE, 0, groups_.data(), groups_.size(), 0.0, 1.0, step, nullptr};
  ++steps_;
}

void GradientAnnounceFeature::ready(int layer) {
  if (layer < 0 || static_cast<size_t>(layer) >= blocks_.size()) return;  // step() takes the rest
  const auto [first, count] = blocks_[static_cast<size_t>(layer)];
  if (count == 0) return;
  const loom_optimizer_ready_args r{LOOM_OPTIMIZER_READY_ARGS_SIZE, 0, &args_, first, count};
  check_loom(loom_optimizer_grads_ready(opt_, &r),
             "optimizer grads_ready (block " + std::to_string(layer) + ")");
  announced_ += count;
}

void GradientAnnounceFeature::banner(BannerPart part, std::ostream& out) const {
  if (part != BannerPart::kSchedule) return;
  out << "gradients: the optimizer exchanges them itself, in its own buckets, "
      << (overlap_ ? "each started as the backward finishes its blocks" : "after the backward")
      << " (tensors in backward order)\n";
}

void GradientAnnounceFeature::summary(nlohmann::json& s, double /*train_step_s*/) const {
  nlohmann::json g;
  g["overlap"] = overlap_;
  g["announced_to_optimizer"] = overlap_;
  size_t tensors = 0;
  for (const auto& g2 : groups_) tensors += g2.tensor_count;
  g["announced_during_backward"] =
      steps_ > 0 && tensors > 0 ? static_cast<double>(announced_) /
                                      (static_cast<double>(steps_) * static_cast<double>(tensors))
                                : 0.0;
  s["gradients"] = g;
}

}  // namespace loom::trainer
