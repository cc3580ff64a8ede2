// Trainer: setup and the training step (trainer.hpp).
#include "trainer.hpp"

#include <loom/kinds/moe.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <numeric>

#include "checkpoint.hpp"
#include "crash_report.hpp"
#include "curriculum_feature.hpp"
#include "gradient_announce_feature.hpp"
#include "gradient_buckets_feature.hpp"
#include "moe_feature.hpp"
#include "nonfinite_feature.hpp"
#include "quantization_feature.hpp"
#include "routing_feature.hpp"

namespace loom::trainer {

Trainer::Trainer(const Args& args) : args_(args) {}
Trainer::~Trainer() = default;

int Trainer::run() {
  if (!args_.eval_only && !load_config(args_.config).checkpoint.empty()) {
    const TrainConfig c = load_config(args_.config);
    throw ConfigError(c.checkpoint_at +
                      ": [quantization] checkpoint: a quantized file is evaluated, not trained: "
                      "run loom train with --eval-only");
  }
  setup();
  if (args_.eval_only) return eval_only();
  if (quant_ != nullptr && c_.lkd_steps > 0 && st_.step == 0) {
    quant_->distill_layers(*ds_, local_batch_, root_, metrics_);
  }
  for (int64_t step = st_.step + 1; step <= c_.steps && !tokens_done(); ++step) {
    const auto step_start = clk::now();
    const StepResult r = train_step(step);
    train_step_s_ += std::chrono::duration<double>(clk::now() - step_start).count();
    last_step_ = step;
    // The last step: `steps`, or the one that reaches train_tokens.
    const bool last = step == c_.steps || tokens_done();
    if (step % c_.log_interval == 0 || last || step == 1) log_step(step, r);
    if ((c_.eval_interval > 0 && step % c_.eval_interval == 0) || last) eval_step(step);
    st_.elapsed_s = elapsed_before_ + std::chrono::duration<double>(clk::now() - t_start_).count();
    if ((c_.checkpoint_interval > 0 && step % c_.checkpoint_interval == 0) || last) {
      save_checkpoint(step);
    }
    if (c_.stop_after > 0 && step == c_.stop_after && !last) {
      if (root_) {
        std::cout << "\nloom train: stopped after step " << c_.stop_after << " (stop_after)\n";
      }
      return 0;
    }
  }
  finish();
  return 0;
}

bool Trainer::tokens_done() const {
  return (c_.train_tokens > 0 && st_.tokens_seen >= static_cast<uint64_t>(c_.train_tokens)) ||
         (c_.train_layer_tokens > 0 &&
          st_.layer_tokens >= static_cast<uint64_t>(c_.train_layer_tokens));
}

// ---- setup

void Trainer::setup() {
  loom::trainer::apply_simd_cap("loom train");
  configure();
  ds_.emplace(c_.dataset);
  fit_to_dataset(c_, *ds_);
  open_loom();
  open_curriculum();
  // 0: the pool's own default (LOOM_NUM_THREADS, else the cores over this machine's ranks).
  set_num_threads(c_.threads);
  model_.emplace(c_.model, c_.seed);
  // Before the features: the MoE layers and the optimizer's views take the master weights.
  model_->set_bf16(c_.precision == "bf16");
  open_features();
  numel_ = model_->num_parameters();
  build_groups();
  if (args_.eval_only) {
    eval_weights();
    return;
  }
  resume_or_start();
  open_metrics();
  choose_progress();
  print_banner();
  t_start_ = clk::now();
  t_log_ = t_start_;
  elapsed_before_ = st_.elapsed_s;
  log_from_step_ = st_.step;
  log_tokens_ = st_.tokens_seen;
  start_tokens_ = st_.tokens_seen;
  start_layer_tokens_ = st_.layer_tokens;
  last_step_ = st_.step;
}

// The config, with the command line's overrides.
void Trainer::configure() {
  c_ = load_config(args_.config);
  if (args_.steps > 0) c_.steps = args_.steps;
  if (args_.stop_after >= 0) c_.stop_after = args_.stop_after;
  if (!args_.run_dir.empty()) {
    c_.run_dir = fs::absolute(args_.run_dir).lexically_normal().string();
    if (c_.plot == (fs::path(load_config(args_.config).run_dir) / "loss.png").string()) {
      c_.plot = (fs::path(c_.run_dir) / "loss.png").string();
    }
  }
  if (args_.no_plot) c_.plot.clear();
  // --weights: the fp32 weights [quantization] quantizes, or (without a quantizer) a file
  // evaluated as it is, quantized by loom quantize or plain.
  if (!args_.weights.empty()) {
    if (!args_.eval_only) throw ConfigError("--weights is for --eval-only");
    const std::string w = fs::absolute(args_.weights).lexically_normal().string();
    if (!c_.quantizer.empty()) {
      c_.weights = w;
      c_.weights_at = "--weights";
    } else {
      c_.checkpoint = w;
      c_.checkpoint_at = "--weights";
    }
  }
  // The plot is drawn at the end: a folder that is not there should fail now, not then.
  const fs::path plot_dir = fs::path(c_.plot).parent_path();
  std::error_code plot_ec;
  if (!c_.plot.empty() && plot_dir != fs::path(c_.run_dir) &&
      !fs::is_directory(plot_dir, plot_ec)) {
    throw ConfigError(c_.config_path + ": [train] plot: the folder " + plot_dir.string() +
                      " does not exist (create it first, or use plot = \"auto\")");
  }
}

// Loom: the manifest's instances, and this rank's place in the comm's world.
void Trainer::open_loom() {
  loom_open_options opts{};
  opts.struct_size = LOOM_OPEN_OPTIONS_SIZE;
  opts.log_level = -1;
  opts.plugin_path = args_.plugin_path.empty() ? nullptr : args_.plugin_path.c_str();
  loom_session* session = nullptr;
  if (loom_open_file(c_.manifest.c_str(), &opts, &session) != LOOM_OK) {
    throw TrainError("loom manifest: " + with_run_values(loom_last_error(), c_));
  }
  loom::trainer::install_crash_report("loom train");  // again: UCX and MPI installed theirs
  session_.reset(session);
  check_loom(loom_find_instance(session, "optimizer", c_.optimizer.c_str(), &opt_),
             c_.manifest + ": optimizer '" + c_.optimizer + "'");
  if (!c_.comm.empty()) {
    loom_instance* ci = nullptr;
    check_loom(loom_find_instance(session, "comm", c_.comm.c_str(), &ci),
               c_.manifest + ": comm '" + c_.comm + "'");
    comm_.instance = ci;
    comm_.obj = loom_instance_object(ci);
    comm_.vt = static_cast<const loom_comm_v1*>(loom_instance_vtable(ci));
    comm_.rank = comm_.vt->rank(comm_.obj);
    comm_.size = comm_.vt->size(comm_.obj);
  }
  rank_ = comm_.rank;
  world_ = comm_.size;
  root_ = rank_ == 0;
  g_job_ranks = world_;
  if (c_.batch_size % world_ != 0) {
    throw ConfigError(c_.config_path + ": [train] batch_size " + std::to_string(c_.batch_size) +
                      " is not divisible by the " + std::to_string(world_) + " ranks");
  }
  local_batch_ = c_.batch_size / world_;
}

// The [curriculum] instances: found, checked and planned (the sampler over the dataset's
// fixed samples, before a resume imports its position).
void Trainer::open_curriculum() {
  auto cur =
      std::make_unique<CurriculumFeature>(session_.get(), c_, *ds_, rank_, world_, local_batch_);
  // Valid but likely unintended settings: one line each on stderr, rank 0.
  std::vector<std::string> warnings = config_warnings(c_);
  for (auto& w : cur->warnings()) warnings.push_back(std::move(w));
  if (root_) {
    for (const auto& w : warnings) std::cerr << "loom train: " << w << "\n";
  }
  curriculum_ = cur.get();
  features_.push_back(std::move(cur));
}

// The model's features after the curriculum, in hook order: the [routing] router (installed
// as the model's router hook, which adds the learned router weights to the parameters), the
// [moe] layers (which replace their blocks' MLPs), [quantization].
void Trainer::open_features() {
  if (!c_.router.empty()) {
    features_.push_back(std::make_unique<RoutingFeature>(session_.get(), c_, *model_, world_));
  } else {
    features_.push_back(std::make_unique<NoRoutingFeature>());
  }
  if (!c_.moe.empty()) {
    features_.push_back(std::make_unique<MoeFeature>(session_.get(), c_, *model_, comm_, opt_,
                                                     world_, local_batch_, aux_acc_));
  } else {
    features_.push_back(std::make_unique<NoMoeFeature>());
  }
  if (!c_.quantizer.empty()) {
    auto q = std::make_unique<QuantizationFeature>(session_.get(), c_, *model_);
    quant_ = q.get();
    features_.push_back(std::move(q));
  }
}

// --eval-only without [quantization] weights: the run directory's latest checkpoint.
void Trainer::eval_weights() {
  run_dir_ = c_.run_dir;
  metrics_path_ = run_dir_ / "metrics.jsonl";
  if (!c_.weights.empty() || !c_.checkpoint.empty()) return;
  const fs::path latest = run_dir_ / "checkpoints" / "latest";
  if (!fs::exists(latest)) {
    throw TrainError("--eval-only: no weights to evaluate: " + c_.config_path +
                     " has no [quantization] weights and " + run_dir_.string() +
                     " holds no checkpoint");
  }
  std::string name = read_text(latest);
  while (!name.empty() && std::isspace(static_cast<unsigned char>(name.back()))) name.pop_back();
  load_safetensors(
      (run_dir_ / "checkpoints" / name / ("model.rank" + std::to_string(rank_) + ".safetensors"))
          .string(),
      model_->parameters());
}

// Optimizer groups: matrices decay (the manifest's weight_decay), vectors do not.
void Trainer::build_groups() {
  auto& params = model_->parameters();
  pt_.resize(params.size());
  gt_.resize(params.size());
  // [gradients] overlap with an optimizer that exchanges the gradients itself: it is told which
  // are final during the backward, and gets its tensors in the order the backward finishes them.
  // The order is the same with overlap = false, so that both give the same bits.
  const bool owns = optimizer_comm_info(opt_).owns_communication != 0;
  const bool announce = c_.grad_buckets && world_ > 1 && owns && announces_gradients(opt_);
  if (announce && c_.overlap && c_.clip_grad_norm > 0) {
    throw ConfigError(c_.config_path + ": [gradients] overlap = true with optimizer '" +
                      c_.optimizer +
                      "', which exchanges each gradient as the backward finishes it: "
                      "clip_grad_norm cannot scale them afterwards (set [train] clip_grad_norm "
                      "= 0, or [gradients] overlap = false)");
  }
  std::vector<size_t> order(params.size());
  std::iota(order.begin(), order.end(), size_t{0});
  if (announce) order = backward_order(*model_, order);
  std::vector<bool> decays(params.size(), false);
  // The momentum mask of the position embedding: rows < seq_len are 1, the rest (never
  // used, so their gradient is always 0) are 0. See TrainConfig::mask_unused_positions.
  for (size_t i = 0; i < params.size(); ++i) {
    auto& p = params[i];
    pt_[i] = DLTensor{};
    pt_[i].data = p.value;
    pt_[i].device = {kDLCPU, 0};
    pt_[i].ndim = static_cast<int32_t>(p.shape.size());
    pt_[i].dtype = {kDLFloat, 32, 1};
    pt_[i].shape = p.shape.data();
    gt_[i] = pt_[i];
    gt_[i].data = p.grad;
    const DLTensor* mask = nullptr;
    if (p.name == "wpe" && c_.mask_unused_positions && c_.seq_len < c_.model.context) {
      const auto row = static_cast<size_t>(p.shape[1]);
      wpe_mask_.assign(p.numel, 0.0f);
      std::fill(wpe_mask_.begin(), wpe_mask_.begin() + static_cast<ptrdiff_t>(row * c_.seq_len),
                1.0f);
      wpe_mask_t_ = pt_[i];
      wpe_mask_t_.data = wpe_mask_.data();
      mask = &wpe_mask_t_;
    }
    const bool expert_bias =
        p.name.size() > 11 && (p.name.compare(p.name.size() - 11, 11, ".experts.b1") == 0 ||
                               p.name.compare(p.name.size() - 11, 11, ".experts.b2") == 0);
    decays[i] = p.shape.size() >= 2 && !expert_bias;
    (decays[i] ? decay_ : no_decay_)
        .push_back({LOOM_OPTIMIZER_TENSOR_SIZE, 0, &pt_[i], &gt_[i], nullptr, mask});
  }
  if (!announce) {  // two groups: matrices, then vectors, each in storage order
    if (!decay_.empty())
      groups_.push_back({LOOM_OPTIMIZER_GROUP_SIZE, 0, decay_.data(), decay_.size(), 1.0, NAN});
    if (!no_decay_.empty()) {
      groups_.push_back(
          {LOOM_OPTIMIZER_GROUP_SIZE, 0, no_decay_.data(), no_decay_.size(), 1.0, 0.0});
    }
  } else {
    announce_groups(order, decays);
  }
  contiguous_ = true;
  for (size_t i = 1; i < params.size(); ++i) {
    contiguous_ &= params[i].grad == params[i - 1].grad + params[i - 1].numel;
  }
  // The gradients the trainer's world average takes (the features reduce the rest), and the
  // squares of the global norm the features sum apart.
  sums_norm_.assign(features_.size(), false);
  norm_owner_.assign(params.size(), -1);
  for (size_t i = 0; i < params.size(); ++i) {
    bool own = false;
    for (size_t k = 0; k < features_.size(); ++k) {
      own = own || features_[k]->reduces_own(i);
      if (norm_owner_[i] < 0 && features_[k]->owns_norm(i)) {
        norm_owner_[i] = static_cast<int>(k);
        sums_norm_[k] = true;
      }
    }
    if (!own) averaged_.push_back(i);
  }
  average_all_ = averaged_.size() == params.size();
  flat_.assign(contiguous_ && average_all_ ? 0 : numel_, 0.0f);
  // [gradients]: the average in buckets, started during the backward (collective: a split).
  if (c_.grad_buckets && world_ > 1 && !announce) {
    features_.push_back(std::make_unique<GradientBucketsFeature>(
        c_, *model_, comm_, averaged_, optimizer_comm_info(opt_).owns_communication != 0));
  }
}

// The groups in backward order: a group per run of tensors of one kind (decaying or not), each
// block one range of tensors, announced to the optimizer when its backward is done (overlap).
void Trainer::announce_groups(const std::vector<size_t>& order, const std::vector<bool>& decays) {
  auto& params = model_->parameters();
  std::vector<loom_optimizer_tensor> all;
  for (auto* list : {&decay_, &no_decay_}) {
    for (const auto& t : *list) all.push_back(t);
  }
  // decay_ holds them all now, in order (the groups point into it: no reallocation after).
  std::vector<loom_optimizer_tensor> ordered;
  ordered.reserve(all.size());
  for (const size_t i : order) {
    for (const auto& t : all) {
      if (t.param == &pt_[i]) ordered.push_back(t);
    }
  }
  decay_ = std::move(ordered);
  no_decay_.clear();
  std::vector<std::pair<size_t, size_t>> blocks(static_cast<size_t>(c_.model.layers), {0, 0});
  for (size_t k = 0; k < order.size(); ++k) {
    const bool d = decays[order[k]];
    if (k == 0 || d != decays[order[k - 1]]) {
      groups_.push_back({LOOM_OPTIMIZER_GROUP_SIZE, 0, decay_.data() + k, 0, 1.0, d ? NAN : 0.0});
    }
    groups_.back().tensor_count += 1;
    const int l = parameter_block(params[order[k]].name);
    if (l >= 0 && l < c_.model.layers) {
      auto& [first, count] = blocks[static_cast<size_t>(l)];
      if (count == 0) first = k;
      count += 1;
    }
  }
  features_.push_back(std::make_unique<GradientAnnounceFeature>(*model_, opt_, groups_,
                                                                std::move(blocks), c_.overlap));
}

void Trainer::open_metrics() {
  if (root_) {
    metrics_.open(metrics_path_.string());
  }
}

// A progress line on a terminal, log lines elsewhere. OpenMPI gives its ranks a pty for
// stdout whatever mpirun's own output is, so under a launcher it is log lines unless
// LOOM_PROGRESS=tty asks for the progress line (LOOM_PROGRESS=lines forces log lines).
void Trainer::choose_progress() {
  const char* progress = std::getenv("LOOM_PROGRESS");
  const bool launched =
      std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_RANK") || std::getenv("PMIX_RANK");
  tty_ = root_ && ::isatty(STDOUT_FILENO) && !launched;
  if (progress && std::string(progress) == "tty") tty_ = root_;
  if (progress && std::string(progress) == "lines") tty_ = false;
  per_step_uncompressed_ =
      world_ > 1 ? 2.0 * (world_ - 1) / world_ * 4.0 * static_cast<double>(numel_) : 0.0;
  if (auto f = NonfiniteFeature::from_environment(*model_, rank_, world_)) {
    features_.push_back(std::move(f));
  }
}

// ---- one step: batch -> forward and backward -> reduce -> clip, lr, optimizer step

StepResult Trainer::train_step(int64_t step) {
  StepResult r;
  const Batch b = next_batch(step, r);
  // Every rank has the same rows; the step's tokens over all ranks.
  const uint64_t step_tokens = static_cast<uint64_t>(b.rows) * world_ * r.seq_len;
  for (auto& f : features_) f->before_forward(step, b, static_cast<int64_t>(rank_) * b.rows);
  r.loss = forward_backward(b, r);
  r.layer_tokens = static_cast<uint64_t>(model_->layer_tokens()) * world_;
  for (auto& f : features_) f->after_backward(step, r);
  if (!std::isfinite(r.loss)) {
    throw TrainError("step " + std::to_string(step) + ": the loss is " + std::to_string(r.loss) +
                     " (diverged; lower lr or clip_grad_norm)");
  }
  // The optimizer may do the gradient communication itself (the 1-bit family).
  r.owns = optimizer_comm_info(opt_).owns_communication != 0;
  if (!r.owns && world_ > 1) reduce_gradients();
  clip_gradients(r);
  r.lr = learning_rate(step, r, step_tokens);
  optimizer_step(step, r);
  count_step(step, b, r, step_tokens);
  return r;
}

// This rank's rows of the step: a feature's draw (the sampler) or the run's seeded positions,
// then shaped by the features (sequence-length warmup).
Batch Trainer::next_batch(int64_t step, StepResult& r) {
  bool drawn = false;
  for (auto& f : features_) {
    if ((drawn = f->draw_batch(step, x_, y_, r))) break;
  }
  if (!drawn) fill_batch(*ds_, c_, step, rank_ * local_batch_, local_batch_, x_, y_);
  Batch b{x_.data(), y_.data(), local_batch_, c_.seq_len};
  r.seq_len = c_.seq_len;
  for (auto& f : features_) f->shape_batch(step, b, r);
  return b;
}

float Trainer::forward_backward(const Batch& b, StepResult& r) {
  model_->zero_grad();
  for (auto& f : features_) {
    if (const std::optional<float> loss = f->forward_backward(b, r)) return *loss;
  }
  return model_->forward_backward(b.x, b.y, b.rows, b.seq_len);
}

// The world average of the gradients the features do not reduce themselves (in place when
// they are one block, else through flat_), then the features' own reductions.
void Trainer::reduce_gradients() {
  auto& params = model_->parameters();
  bool averaged = false;
  for (auto& f : features_) {
    if ((averaged = f->average_gradients(averaged_))) break;
  }
  if (!averaged && average_all_ && contiguous_) {
    comm_.average(params[0].grad, numel_, true);
  } else if (!averaged) {
    size_t o = 0;
    for (const size_t i : averaged_) {
      std::memcpy(flat_.data() + o, params[i].grad, 4 * params[i].numel);
      o += params[i].numel;
    }
    comm_.average(flat_.data(), o, true);
    o = 0;
    for (const size_t i : averaged_) {
      std::memcpy(params[i].grad, flat_.data() + o, 4 * params[i].numel);
      o += params[i].numel;
    }
  }
  for (auto& f : features_) f->reduce_gradients();
}

// Global-norm clipping: of the averaged gradient when the trainer averages, of the local
// gradient when the optimizer owns communication (each rank its own coefficient). The squares
// of a feature's sharded parameters are summed by the feature (norm_squares).
void Trainer::clip_gradients(StepResult& r) {
  auto& params = model_->parameters();
  double sq = 0;
  std::vector<double> own(features_.size(), 0.0);
  for (size_t j = 0; j < params.size(); ++j) {
    const auto& p = params[j];
    double s = 0;
    for (size_t i = 0; i < p.numel; ++i) s += static_cast<double>(p.grad[i]) * p.grad[i];
    (norm_owner_[j] >= 0 ? own[static_cast<size_t>(norm_owner_[j])] : sq) += s;
  }
  for (size_t k = 0; k < features_.size(); ++k) {
    if (sums_norm_[k]) sq += features_[k]->norm_squares(own[k]);
  }
  r.gnorm = std::sqrt(sq);
  if (c_.clip_grad_norm > 0 && r.gnorm > c_.clip_grad_norm) {
    const float s = static_cast<float>(c_.clip_grad_norm / (r.gnorm + 1e-6));
    for (auto& p : params)
      for (size_t i = 0; i < p.numel; ++i) p.grad[i] *= s;
  }
}

double Trainer::learning_rate(int64_t step, const StepResult& r, uint64_t step_tokens) const {
  return c_.lr_unit == "tokens"
             ? lr_at_tokens(c_, step, st_.tokens_seen + step_tokens, st_.warmup_tokens)
         : c_.lr_unit == "layer_tokens"
             ? lr_at_layer_tokens(c_, step, st_.layer_tokens + r.layer_tokens,
                                  st_.warmup_layer_tokens)
             : lr_at(c_, step);
}

// found_inf: the optimizer checks the gradients and skips a step with a NaN or an Inf (every
// rank skips the same one); parameters and its state stay as they were.
void Trainer::optimizer_step(int64_t step, StepResult& r) {
  int32_t found_inf = 0;
  loom_optimizer_step_args sa{
      LOOM_OPTIMIZER_STEP_ARGS_SIZE, 0, groups_.data(), groups_.size(), r.lr, 1.0, step, nullptr};
  sa.found_inf = &found_inf;
  check_loom(loom_optimizer_step(opt_, &sa), "optimizer step " + std::to_string(step));
  if (found_inf != 0) {
    r.skipped = true;
    ++st_.skipped_steps;
    if (root_) {
      if (tty_) std::cout << "\n";
      std::printf(
          "step %lld: skipped by the optimizer (a gradient is NaN or Inf); %llu skipped "
          "so far\n",
          static_cast<long long>(step), static_cast<unsigned long long>(st_.skipped_steps));
      std::fflush(stdout);
    }
  }
}

// The step's tokens into the run's counts (the features' accounting checked first).
void Trainer::count_step(int64_t step, const Batch& b, const StepResult& r, uint64_t step_tokens) {
  st_.tokens_seen += step_tokens;
  for (auto& f : features_) f->after_step(step, b, r, st_);
  st_.layer_tokens += r.layer_tokens;
  if (step == c_.warmup_steps) {
    st_.warmup_tokens = st_.tokens_seen;
    st_.warmup_layer_tokens = st_.layer_tokens;
  }
  st_.uncompressed_bytes += static_cast<uint64_t>(per_step_uncompressed_);
  loss_acc_ += r.loss;
  aux_acc_ += r.aux;
  ++acc_steps_;
}

int run(const Args& args) {
  Trainer trainer(args);
  return trainer.run();
}

}  // namespace loom::trainer
