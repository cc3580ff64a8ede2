// [gradients]: the world average of the gradients in buckets, each started as soon as the
// backward has finished its gradients (DDP's scheme), so the exchange overlaps the rest of the
// backward; fp32 or bf16 on the wire (docs/trainer.md "Gradient communication").
//
// Buckets hold the averaged parameters in the order the backward finishes them: the last
// block's first, the embeddings and the final LayerNorm (finished only at the end, the token
// embedding being tied to the output head) last. A bucket closes once it reaches bucket_mb; a
// bucket whose gradients are one block of memory is reduced in place (fp32), any other goes
// through a buffer of its own. With overlap = false the same buckets start after the backward
// instead, in the same order: the results are the same bits, only the timing differs.
//
// The buckets run on a sub-communicator of the trainer's comm (split once), so their traffic
// is counted apart and other features' collectives (MoE's exchange in the backward) do not
// wait behind them; a transport without process groups is used as it is.
#pragma once

#include <loom/embed.h>
#include <loom/sdk/comm.hpp>

#include <cstdint>
#include <memory>
#include <vector>

#include "config.hpp"
#include "feature.hpp"
#include "model.hpp"
#include "run.hpp"

namespace loom::trainer {

// The order the backward finishes the parameters (indices into model.parameters()): blocks
// from the last down (within one, in reverse storage order, so neighbours tend to be one block
// of memory), then everything finished at the end (the embeddings, the final LayerNorm).
std::vector<size_t> backward_order(Model& model, std::vector<size_t> params);
// Its key: 0 for the last block, layers - 1 for the first, layers for the rest. The model's
// grad-ready seam passes block l when position layers - 1 - l is final (-1: all).
int backward_position(Model& model, size_t param);

class GradientBucketsFeature final : public Feature {
 public:
  // `averaged`: the parameters (indices into model.parameters()) the trainer's world average
  // takes; `owns`: whether the optimizer does the gradient communication itself this step
  // (then the buckets stay idle). Collective over `comm` (the split). Throws TrainError.
  GradientBucketsFeature(const TrainConfig& c, Model& model, Comm& comm,
                         const std::vector<size_t>& averaged, bool owns);
  ~GradientBucketsFeature() override;

  void before_forward(int64_t step, const Batch& b, int64_t first_row) override;
  bool average_gradients(const std::vector<size_t>& params) override;
  void banner(BannerPart part, std::ostream& out) const override;
  void summary(nlohmann::json& s, double train_step_s) const override;

 private:
  struct Bucket;
  void start(Bucket& b);
  void ready(int layer);  // the model's grad-ready seam

  Model& model_;
  Comm& trainer_comm_;            // its gradient traffic and wait are counted there
  loom_instance* sub_ = nullptr;  // the split, owned by the session (nullptr: the comm itself)
  loom::sdk::InstanceRef<loom_comm_v1> comm_;
  std::vector<std::unique_ptr<Bucket>> buckets_;
  size_t next_ = 0;  // the first bucket not yet started this step
  int layers_ = 0;
  bool bf16_ = false;
  bool overlap_ = true;
  bool active_ = true;  // false while the optimizer communicates itself
  double bucket_mb_ = 25.0;
  loom_comm_stats last_{};    // the bucket comm's counters after the last average
  double started_early_ = 0;  // buckets started during the backward, all steps
  double started_ = 0;        // buckets started, all steps
};

}  // namespace loom::trainer
