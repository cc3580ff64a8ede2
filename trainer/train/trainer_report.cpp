// Trainer: the banner, the log lines and metrics, evaluation (also --eval-only), and the end
// of a run (trainer.hpp).
#include <sys/resource.h>

#include <cstdio>
#include <iostream>

#include "checkpoint.hpp"
#include "crash_report.hpp"
#include "curriculum_feature.hpp"
#include "quantization_feature.hpp"
#include "trainer.hpp"

namespace loom::trainer {

void Trainer::print_banner() const {
  if (!root_) return;
  std::cout << "loom train: " << numel_ << " parameters, " << world_ << " rank(s), optimizer '"
            << loom_instance_plugin(opt_) << "', " << c_.steps << " steps of " << c_.batch_size
            << " x " << c_.seq_len << " tokens; run dir " << run_dir_.string() << std::endl;
  std::cout << "loom train: CPU " << loom::trainer::cpu_description() << std::endl;
  if (model_->bf16()) {
    std::cout << "loom train: precision bf16: bf16 weights and activations, fp32 master "
                 "weights, gradients and loss"
              << std::endl;
  }
  for (const BannerPart part : {BannerPart::kData, BannerPart::kModel, BannerPart::kSchedule}) {
    for (const auto& f : features_) f->banner(part, std::cout);
  }
  if (c_.train_tokens > 0) {
    std::cout << "loom train: stops at " << c_.train_tokens << " tokens (or step " << c_.steps
              << ")" << std::endl;
  }
  if (c_.train_layer_tokens > 0) {
    std::cout << "loom train: stops at " << c_.train_layer_tokens << " layer tokens (or step "
              << c_.steps << ")" << std::endl;
  }
  if (!wpe_mask_.empty()) {
    std::cout << "loom train: position rows " << c_.seq_len << ".." << c_.model.context - 1
              << " are never used (seq_len < context); their momentum is masked" << std::endl;
  }
}

// ---- logging

// The mean loss since the last log line (over the ranks), a metrics record and a line.
void Trainer::log_step(int64_t step, const StepResult& r) {
  const auto tot = comm_.sum({loss_acc_, static_cast<double>(acc_steps_), aux_acc_});
  const double mean_loss = tot[0] / tot[1];
  const double mean_aux = tot[2] / tot[1];
  // The features' parts of the record (every rank: they may communicate).
  nlohmann::json extra = nlohmann::json::object();
  for (auto& f : features_) f->log_metrics(r, mean_aux, extra);
  const auto now = clk::now();
  const double dt = std::chrono::duration<double>(now - t_log_).count();
  const double tps = static_cast<double>(st_.tokens_seen - log_tokens_) / std::max(dt, 1e-9);
  const auto ci = optimizer_comm_info(opt_);
  const uint64_t sent = comm_.grad_bytes_sent + ci.bytes_sent;
  const uint64_t rounds = comm_.grad_rounds + ci.rounds;
  const double elapsed = elapsed_before_ + std::chrono::duration<double>(now - t_start_).count();
  if (root_) {
    nlohmann::json j = {{"type", "train"},
                        {"step", step},
                        {"loss", mean_loss},
                        {"lr", r.lr},
                        {"grad_norm", r.gnorm},
                        {"tokens_per_s", tps},
                        {"tokens", st_.tokens_seen},
                        {"comm_bytes_sent", sent},
                        {"comm_bytes_received", comm_.grad_bytes_received + ci.bytes_received},
                        {"comm_rounds", rounds},
                        {"uncompressed_bytes", st_.uncompressed_bytes},
                        {"owns_communication", r.owns},
                        {"skipped_steps", st_.skipped_steps},
                        {"elapsed_s", elapsed},
                        {"seq_len", r.seq_len},
                        {"layer_tokens", r.layer_tokens},
                        {"consumed_layer_tokens", st_.layer_tokens}};
    j.update(extra);
    metrics_.append(j.dump());
    double eta = (elapsed - elapsed_before_) / static_cast<double>(step - st_.step) *
                 static_cast<double>(c_.steps - step);
    if (c_.train_tokens > 0 && st_.tokens_seen > start_tokens_) {  // the budget may end first
      const double left = static_cast<double>(c_.train_tokens) -
                          static_cast<double>(std::min<uint64_t>(
                              st_.tokens_seen, static_cast<uint64_t>(c_.train_tokens)));
      eta = std::min(eta, (elapsed - elapsed_before_) * left /
                              static_cast<double>(st_.tokens_seen - start_tokens_));
    }
    if (c_.train_layer_tokens > 0 && st_.layer_tokens > start_layer_tokens_) {  // likewise
      const double left = static_cast<double>(c_.train_layer_tokens) -
                          static_cast<double>(std::min<uint64_t>(
                              st_.layer_tokens, static_cast<uint64_t>(c_.train_layer_tokens)));
      eta = std::min(eta, (elapsed - elapsed_before_) * left /
                              static_cast<double>(st_.layer_tokens - start_layer_tokens_));
    }
    char line[256];
    std::snprintf(line, sizeof(line),
                  "step %lld/%lld  loss %.4f  lr %.2e  %.0f tok/s  sent %s  ETA %s",
                  static_cast<long long>(step), static_cast<long long>(c_.steps), mean_loss, r.lr,
                  tps, human_bytes(static_cast<double>(sent)).c_str(), human_time(eta).c_str());
    if (tty_)
      std::cout << "\r" << line << "\033[K" << std::flush;
    else
      std::cout << line << std::endl;
  }
  loss_acc_ = 0;
  aux_acc_ = 0;
  acc_steps_ = 0;
  log_from_step_ = step;
  log_tokens_ = st_.tokens_seen;
  t_log_ = clk::now();
}

// Eval: the first eval_batches * batch_size windows of seq_len + 1 heldout tokens (fewer
// when the split is small); window w goes to rank w % world.
double Trainer::evaluate() { return evaluate(quant_ != nullptr); }
double Trainer::evaluate(bool quantized) {
  std::unique_ptr<QuantizedEval> qe;
  if (quantized) qe = quant_->quantized_eval();
  const auto h = ds_->heldout();
  size_t windows = std::min<size_t>(static_cast<size_t>(c_.eval_batches) * c_.batch_size,
                                    (h.size() - 1) / c_.seq_len);
  // Expert parallelism: every rank of a group makes the same forwards (they exchange
  // tokens), so each rank gets the same number of windows.
  for (const auto& f : features_) windows = f->eval_windows(windows);
  std::vector<size_t> mine;
  for (size_t w = rank_; w < windows; w += world_) mine.push_back(w);
  double sum = 0;
  // Evaluation forwards pass training = 0 at the last step run (1 before any).
  for (auto& f : features_) f->before_eval(std::max<int64_t>(1, last_step_));
  for (size_t b = 0; b < mine.size(); b += local_batch_) {
    const int n = static_cast<int>(std::min<size_t>(local_batch_, mine.size() - b));
    x_.resize(static_cast<size_t>(n) * c_.seq_len);
    y_.resize(x_.size());
    for (int i = 0; i < n; ++i) {
      const size_t off = mine[b + i] * c_.seq_len;
      for (int j = 0; j < c_.seq_len; ++j) {
        x_[static_cast<size_t>(i) * c_.seq_len + j] = h[off + j];
        y_[static_cast<size_t>(i) * c_.seq_len + j] = h[off + j + 1];
      }
    }
    sum += static_cast<double>(model_->forward_loss(x_.data(), y_.data(), n, c_.seq_len)) * n;
  }
  if (qe) {
    quant_->record_eval(*qe);
  }
  const auto tot = comm_.sum({sum, static_cast<double>(mine.size())});
  return tot[0] / std::max(1.0, tot[1]);
}
void Trainer::eval_step(int64_t step) {
  last_eval_ = evaluate();
  if (root_) {
    nlohmann::json j = {{"type", "eval"},
                        {"step", step},
                        {"eval_loss", last_eval_},
                        {"eval_ppl", std::exp(last_eval_)}};
    metrics_.append(j.dump());
    if (tty_) std::cout << "\n";
    std::printf("eval step %lld: loss %.4f, perplexity %.2f\n", static_cast<long long>(step),
                last_eval_, std::exp(last_eval_));
    std::fflush(stdout);
  }
}
// --eval-only: the weights evaluated in fp32 and, with [quantization], through the
// quantizer's matmuls (after LKD when lkd_steps is set); eval.json in the run directory.
int Trainer::eval_only() {
  nlohmann::json out = {{"config", c_.config_path}};
  if (!c_.weights.empty()) out["weights"] = c_.weights;
  if (!c_.checkpoint.empty()) return eval_checkpoint(out);
  const double fp32 = evaluate(false);
  out["fp32_eval_loss"] = fp32;
  out["fp32_eval_ppl"] = std::exp(fp32);
  if (root_) std::printf("fp32 eval loss: %.4f (perplexity %.2f)\n", fp32, std::exp(fp32));
  if (quant_ != nullptr) {
    if (c_.lkd_steps > 0) {
      quant_->distill_layers(*ds_, local_batch_, root_, metrics_);
      // The distilled fp32 weights, for loom quantize.
      if (root_) {
        std::error_code ec;
        fs::create_directories(run_dir_, ec);
        save_safetensors((run_dir_ / "lkd.safetensors").string(), model_->parameters());
        out["lkd_weights"] = (run_dir_ / "lkd.safetensors").string();
        std::printf("lkd weights: %s\n", (run_dir_ / "lkd.safetensors").string().c_str());
      }
    }
    const double q = evaluate(true);
    out["eval_loss"] = q;
    out["eval_ppl"] = std::exp(q);
    out["quantizer"] = c_.quantizer;
    out["plugin"] = quant_->plugin();
    out["quantized_tensors"] = quant_->names();
    out["packed_bytes"] = quant_->packed_bytes();
    out["float_bytes"] = quant_->float_bytes();
    out["quantized_matmuls"] = quant_->matmul_calls();
    if (!quant_->lkd_log().empty()) out["lkd"] = quant_->lkd_log();
    if (root_) {
      std::printf("quantized eval loss (%s, %s): %.4f (perplexity %.2f, %+.2f%% vs fp32)\n",
                  c_.quantizer.c_str(), quant_->plugin().c_str(), q, std::exp(q),
                  100.0 * (std::exp(q) / std::exp(fp32) - 1.0));
      std::printf("quantized tensors: %zu, %s packed (%s as float32)\n", quant_->names().size(),
                  human_bytes(static_cast<double>(quant_->packed_bytes())).c_str(),
                  human_bytes(static_cast<double>(quant_->float_bytes())).c_str());
    }
  }
  if (root_) {
    std::error_code ec;
    fs::create_directories(run_dir_, ec);
    const std::string text = out.dump(2) + "\n";
    write_file_atomic((run_dir_ / "eval.json").string(), text.data(), text.size());
    std::printf("eval: %s\n", (run_dir_ / "eval.json").string().c_str());
  }
  comm_.barrier();
  return 0;
}

// --eval-only with [quantization] checkpoint: a `loom quantize` file, its quantized
// tensors through the quantizer instances it names (the manifest's), the rest float; and
// beside it the same weights decoded, through the float matmuls.
int Trainer::eval_checkpoint(nlohmann::json& out) {
  std::vector<std::pair<std::string, std::unique_ptr<WeightQuantizer>>> qs;
  QuantizedCheckpoint ck = load_quantized_checkpoint(
      c_.checkpoint, *model_, session_.get(), qs, c_.checkpoint_at + ": [quantization] checkpoint");
  out["checkpoint"] = c_.checkpoint;
  out["file_bytes"] = ck.file_bytes;
  out["quantized_tensors"] = ck.names;
  out["quantizers"] = ck.instances;
  const double deq = evaluate(false);
  out["dequantized_eval_loss"] = deq;
  out["dequantized_eval_ppl"] = std::exp(deq);
  double q = 0;
  {
    QuantizedEval qe(*model_, std::move(ck.entries));
    q = evaluate(false);
    out["packed_bytes"] = qe.packed_bytes();
    out["float_bytes"] = qe.float_bytes();
    out["quantized_matmuls"] = qe.matmul_calls();
  }
  out["eval_loss"] = q;
  out["eval_ppl"] = std::exp(q);
  if (root_) {
    std::printf("dequantized weights, float matmuls: eval loss %.4f (perplexity %.2f)\n", deq,
                std::exp(deq));
    std::printf("quantized matmuls: eval loss %.4f (perplexity %.2f)\n", q, std::exp(q));
    std::printf("%s: %s, %zu quantized tensors\n", c_.checkpoint.c_str(),
                human_bytes(static_cast<double>(ck.file_bytes)).c_str(), ck.names.size());
    std::error_code ec;
    fs::create_directories(run_dir_, ec);
    const std::string text = out.dump(2) + "\n";
    write_file_atomic((run_dir_ / "eval.json").string(), text.data(), text.size());
    std::printf("eval: %s\n", (run_dir_ / "eval.json").string().c_str());
  }
  comm_.barrier();
  return 0;
}
// ---- the end: final eval, summary.json, the totals and the plot

namespace {
uint64_t peak_rss_bytes() {
  rusage u{};
  if (getrusage(RUSAGE_SELF, &u) != 0) return 0;
  return static_cast<uint64_t>(u.ru_maxrss) * 1024;  // KiB on Linux
}
}  // namespace

void Trainer::finish() {
  if (std::isnan(last_eval_)) last_eval_ = evaluate();  // resumed at the end: report again
  // [quantization]: the float weights' loss beside the quantized one (every rank).
  if (quant_ != nullptr) quant_->set_fp32_eval(evaluate(false));
  const auto ci = optimizer_comm_info(opt_);
  const uint64_t sent = comm_.grad_bytes_sent + ci.bytes_sent;
  const uint64_t rounds = comm_.grad_rounds + ci.rounds;
  const double wait_s = comm_.grad_wait_s + static_cast<double>(ci.comm_wait_ns) * 1e-9;
  if (root_) {
    nlohmann::json summary = {
        {"final_eval_loss", last_eval_},
        {"final_eval_ppl", std::exp(last_eval_)},
        {"steps", last_step_},
        {"tokens", st_.tokens_seen},
        {"layer_tokens", st_.layer_tokens},
        {"ranks", world_},
        {"optimizer", loom_instance_plugin(opt_)},
        {"precision", c_.precision},
        {"parameters", numel_},
        {"comm_bytes_sent", sent},
        {"comm_rounds", rounds},
        {"uncompressed_bytes", st_.uncompressed_bytes},
        {"skipped_steps", st_.skipped_steps},
        {"elapsed_s", st_.elapsed_s},
        // Time this process was blocked on the network: the trainer's gradient average, or
        // the exchange of an optimizer that communicates itself (the 1-bit family reports the
        // time its transport calls blocked, not its compression).
        {"comm_wait_s", wait_s},
        {"comm_wait_share", train_step_s_ > 0 ? wait_s / train_step_s_ : 0.0},
        // Rank 0's memory: what its optimizer keeps (its state, as a checkpoint stores it; a
        // sharded one keeps its slice) and the process's peak resident set.
        {"optimizer_state_bytes", export_instance_state(opt_, "optimizer").size()},
        {"peak_rss_bytes", peak_rss_bytes()}};
    for (const auto& f : features_) f->summary(summary, train_step_s_);
    const std::string s = summary.dump(2) + "\n";
    write_file_atomic((run_dir_ / "summary.json").string(), s.data(), s.size());
    if (tty_) std::cout << "\n";
    std::printf("final eval loss: %.4f (perplexity %.2f)\n", last_eval_, std::exp(last_eval_));
    if (st_.skipped_steps > 0) {
      std::printf("steps skipped for a NaN or Inf gradient: %llu\n",
                  static_cast<unsigned long long>(st_.skipped_steps));
    }
    if (world_ > 1) {
      std::printf(
          "bytes sent by rank 0 for gradient sync: %s in %llu rounds; uncompressed Adam "
          "would have sent %s (%.2fx)\n",
          human_bytes(static_cast<double>(sent)).c_str(), static_cast<unsigned long long>(rounds),
          human_bytes(static_cast<double>(st_.uncompressed_bytes)).c_str(),
          sent > 0 ? static_cast<double>(st_.uncompressed_bytes) / static_cast<double>(sent) : 0.0);
    } else {
      std::printf("bytes sent: 0 (one rank; nothing to average)\n");
    }
    if (summary.contains("moe")) {
      // Where the MoE layers' time went (summary.json's moe.phases, rank 0).
      const nlohmann::json& sec = summary["moe"]["phases"]["seconds"];
      std::printf(
          "MoE layers (rank 0): %.2f s, %.0f%% of the steps: gate %.2f, dispatch %.2f, "
          "exchange %.2f, experts %.2f, combine %.2f, other %.2f s\n",
          sec["calls"].get<double>(),
          train_step_s_ > 0 ? 100.0 * sec["calls"].get<double>() / train_step_s_ : 0.0,
          sec["gate"].get<double>(), sec["dispatch"].get<double>(), sec["exchange"].get<double>(),
          sec["experts"].get<double>(), sec["combine"].get<double>(), sec["other"].get<double>());
    }
    std::printf("metrics: %s\n", metrics_path_.string().c_str());
    std::fflush(stdout);
    if (!c_.plot.empty()) {
      std::error_code ec;
      const fs::path self = fs::canonical("/proc/self/exe", ec);
      const fs::path plotter = self.parent_path() / "loom-plot";
      const std::string cmd =
          "'" + plotter.string() + "' '" + run_dir_.string() + "' -o '" + c_.plot + "'";
      if (std::system(cmd.c_str()) == 0) {
        std::printf("plot: %s\n", c_.plot.c_str());
      } else {
        std::printf("plot: not written (loom-plot failed; see above)\n");
      }
    }
  }
  comm_.barrier();
}
}  // namespace loom::trainer
