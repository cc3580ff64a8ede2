#include "gradient_buckets_feature.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <iomanip>
#include <ostream>
#include <string>

#include "bf16.hpp"

namespace loom::trainer {

namespace {

using Clock = std::chrono::steady_clock;

loom_comm_stats stats_of(const loom::sdk::InstanceRef<loom_comm_v1>& comm) {
  loom_comm_stats s{};
  s.struct_size = LOOM_COMM_STATS_SIZE;
  comm.call(&loom_comm_v1::stats, &s);
  return s;
}

}  // namespace

int backward_position(Model& model, size_t param) {
  const int layers = model.config().layers;
  const int l = parameter_block(model.parameters()[param].name);
  return l >= 0 && l < layers ? layers - 1 - l : layers;
}

std::vector<size_t> backward_order(Model& model, std::vector<size_t> params) {
  std::stable_sort(params.begin(), params.end(), [&](size_t a, size_t b) {
    const int pa = backward_position(model, a);
    const int pb = backward_position(model, b);
    return pa != pb ? pa < pb : a > b;
  });
  return params;
}

struct GradientBucketsFeature::Bucket {
  std::vector<size_t> params;  // in the order the backward finishes them
  int ready_after = 0;         // the grad-ready position (0: the last block) that finishes it
  size_t numel = 0;
  float* in_place = nullptr;   // fp32 and one block of memory: reduced where it lies
  std::vector<float> fp32;     // else a buffer of its own
  std::vector<uint16_t> bf16;  //   (bf16 on the wire)
  int64_t shape = 0;
  DLTensor tensor{};
  loom_allreduce_args args{};
  loom::sdk::CommRequest request;
  bool started = false;
};

GradientBucketsFeature::GradientBucketsFeature(const TrainConfig& c, Model& model, Comm& comm,
                                               const std::vector<size_t>& averaged, bool owns)
    : model_(model),
      trainer_comm_(comm),
      layers_(model.config().layers),
      bf16_(c.wire == "bf16"),
      overlap_(c.overlap),
      active_(!owns),
      bucket_mb_(c.bucket_mb) {
  const int rc = loom_comm_split(comm.instance, 0, 0, &sub_);
  loom_instance* use = comm.instance;
  if (rc == LOOM_OK) {
    use = sub_;
  } else if (rc != LOOM_ERR_UNIMPLEMENTED) {
    check_loom(rc, "[gradients]: splitting the comm for the gradient buckets");
  }
  comm_ = loom::sdk::InstanceRef<loom_comm_v1>(
      "gradients", loom_instance_object(use),
      static_cast<const loom_comm_v1*>(loom_instance_vtable(use)));

  auto& params = model_.parameters();
  auto position = [&](size_t i) { return backward_position(model_, i); };
  const std::vector<size_t> order = backward_order(model_, averaged);
  const auto limit = static_cast<size_t>(bucket_mb_ * 1024.0 * 1024.0 / sizeof(float));
  for (const size_t i : order) {
    if (buckets_.empty() || buckets_.back()->numel >= limit) {
      buckets_.push_back(std::make_unique<Bucket>());
    }
    Bucket& b = *buckets_.back();
    b.params.push_back(i);
    b.numel += params[i].numel;
    b.ready_after = std::max(b.ready_after, position(i));
  }
  for (auto& bp : buckets_) {
    Bucket& b = *bp;
    // One block of memory: each parameter's gradient ends where the previous one's starts.
    bool contiguous = true;
    for (size_t k = 1; k < b.params.size(); ++k) {
      const ParamTensor& hi = params[b.params[k - 1]];
      const ParamTensor& lo = params[b.params[k]];
      contiguous &= lo.grad + lo.numel == hi.grad;
    }
    if (contiguous && !bf16_) {
      b.in_place = params[b.params.back()].grad;
    } else if (bf16_) {
      b.bf16.resize(b.numel);
    } else {
      b.fp32.resize(b.numel);
    }
    b.shape = static_cast<int64_t>(b.numel);
    void* data = b.in_place != nullptr ? static_cast<void*>(b.in_place)
                 : bf16_               ? static_cast<void*>(b.bf16.data())
                                       : static_cast<void*>(b.fp32.data());
    b.tensor = Comm::tensor(data, &b.shape, bf16_ ? kDLBfloat : kDLFloat, bf16_ ? 16 : 32);
    b.args =
        loom_allreduce_args{LOOM_ALLREDUCE_ARGS_SIZE, LOOM_REDUCE_AVG, nullptr, &b.tensor, nullptr};
  }
  last_ = stats_of(comm_);
  if (overlap_) model_.set_grad_ready([this](int layer) { ready(layer); });
}

GradientBucketsFeature::~GradientBucketsFeature() {
  model_.set_grad_ready({});
  for (auto& b : buckets_) {
    try {
      b->request.wait();  // a step that failed between the backward and the average
    } catch (...) {       // the step's own error is the one reported
    }
  }
}

void GradientBucketsFeature::before_forward(int64_t /*step*/, const Batch& /*b*/,
                                            int64_t /*first_row*/) {
  next_ = 0;
  for (auto& b : buckets_) b->started = false;
}

// Block `layer`'s gradients are final (-1: all of them): start every bucket they finish.
void GradientBucketsFeature::ready(int layer) {
  if (!active_) return;
  const int position = layer >= 0 ? layers_ - 1 - layer : layers_;
  while (next_ < buckets_.size() && buckets_[next_]->ready_after <= position) {
    start(*buckets_[next_++]);
    started_early_ += 1;
  }
}

void GradientBucketsFeature::start(Bucket& b) {
  auto& params = model_.parameters();
  if (b.in_place == nullptr) {
    size_t o = 0;
    for (const size_t i : b.params) {
      const ParamTensor& p = params[i];
      if (bf16_) {
        for (size_t k = 0; k < p.numel; ++k) b.bf16[o + k] = to_bf16(p.grad[k]);
      } else {
        std::memcpy(b.fp32.data() + o, p.grad, p.numel * sizeof(float));
      }
      o += p.numel;
    }
  }
  b.request = loom::sdk::comm_start(comm_, LOOM_COLLECTIVE_ALLREDUCE, &b.args);
  b.started = true;
  started_ += 1;
}

bool GradientBucketsFeature::average_gradients(const std::vector<size_t>& /*params*/) {
  if (!active_) return false;
  const auto t0 = Clock::now();
  while (next_ < buckets_.size()) start(*buckets_[next_++]);
  auto& params = model_.parameters();
  for (auto& bp : buckets_) {
    Bucket& b = *bp;
    b.request.wait();
    if (b.in_place != nullptr) continue;
    size_t o = 0;
    for (const size_t i : b.params) {
      const ParamTensor& p = params[i];
      if (bf16_) {
        for (size_t k = 0; k < p.numel; ++k) p.grad[k] = from_bf16(b.bf16[o + k]);
      } else {
        std::memcpy(p.grad, b.fp32.data() + o, p.numel * sizeof(float));
      }
      o += p.numel;
    }
  }
  const double waited = std::chrono::duration<double>(Clock::now() - t0).count();
  const loom_comm_stats now = stats_of(comm_);
  trainer_comm_.grad_bytes_sent += now.bytes_sent - last_.bytes_sent;
  trainer_comm_.grad_bytes_received += now.bytes_received - last_.bytes_received;
  trainer_comm_.grad_rounds += now.rounds - last_.rounds;
  trainer_comm_.grad_wait_s += waited;
  last_ = now;
  return true;
}

void GradientBucketsFeature::banner(BannerPart part, std::ostream& out) const {
  if (part != BannerPart::kSchedule) return;
  out << "gradients: " << buckets_.size() << " bucket(s) of up to " << bucket_mb_ << " MiB, "
      << (bf16_ ? "bf16" : "fp32") << " on the wire, "
      << (overlap_ ? "started during the backward" : "after the backward")
      << (sub_ != nullptr ? "" : " (on the comm itself: it has no process groups)")
      << (active_ ? "" : "; idle: the optimizer communicates itself") << "\n";
}

void GradientBucketsFeature::summary(nlohmann::json& s, double /*train_step_s*/) const {
  nlohmann::json g;
  g["buckets"] = buckets_.size();
  g["bucket_mb"] = bucket_mb_;
  g["wire"] = bf16_ ? "bf16" : "fp32";
  g["overlap"] = overlap_;
  g["started_during_backward"] = started_ > 0 ? started_early_ / started_ : 0.0;
  s["gradients"] = g;
}

}  // namespace loom::trainer
