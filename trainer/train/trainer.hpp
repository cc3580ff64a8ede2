// One run of loom train: the data-parallel loop, with the config's features
// (features/feature.hpp) at its hooks.
#pragma once

#include <loom/embed.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "config.hpp"
#include "dataset.hpp"
#include "durable_file.hpp"
#include "feature.hpp"
#include "model.hpp"
#include "run.hpp"
#include "trainer_state.hpp"

namespace loom::trainer {

class CurriculumFeature;
class QuantizationFeature;

// One training run. setup() reads the config and the dataset, opens the Loom session, builds
// the model, its features and the optimizer's groups, and resumes or starts over; then every
// step is train_step() (batch, forward and backward, gradient reduction, clipping, optimizer
// step), log_step() at log intervals, eval_step() at eval intervals and save_checkpoint() at
// checkpoint intervals; finish() reports the final eval and writes the summary and the plot.
class Trainer {
 public:
  explicit Trainer(const Args& args);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  int run();

 private:
  using clk = std::chrono::steady_clock;

  // Runs `work` here, then learns every rank's outcome (one allgather): when any rank failed,
  // every rank throws AgreedError with that rank's message, so a local failure (a full disk,
  // an unreadable file) ends every rank at once rather than leaving the others to wait out
  // the comm's timeout in the next collective.
  template <class Work>
  void on_every_rank(Work&& work) {
    std::string error;
    try {
      work();
    } catch (const ConfigError& e) {
      for (const auto& line : e.errors()) error += (error.empty() ? "" : "\n") + line;
    } catch (const std::exception& e) {
      error = *e.what() != '\0' ? e.what() : "failed";
    }
    const auto all = comm_.gather_text(error);
    for (size_t r = 0; r < all.size(); ++r) {
      if (all[r].empty()) continue;
      throw AgreedError(static_cast<int>(r) == rank_ || all.size() == 1
                            ? all[r]
                            : "rank " + std::to_string(r) + ": " + all[r]);
    }
  }

  bool tokens_done() const;

  // ---- setup (trainer.cpp)
  void setup();
  void configure();
  void open_loom();
  void open_curriculum();
  void open_features();
  void eval_weights();
  void build_groups();
  void announce_groups(const std::vector<size_t>& order, const std::vector<bool>& decays);
  void open_metrics();
  void choose_progress();

  // ---- one step (trainer.cpp)
  StepResult train_step(int64_t step);
  Batch next_batch(int64_t step, StepResult& r);
  float forward_backward(const Batch& b, StepResult& r);
  void reduce_gradients();
  void clip_gradients(StepResult& r);
  double learning_rate(int64_t step, const StepResult& r, uint64_t step_tokens) const;
  void optimizer_step(int64_t step, StepResult& r);
  void count_step(int64_t step, const Batch& b, const StepResult& r, uint64_t step_tokens);

  // ---- checkpoints (trainer_checkpoint.cpp)
  void resume_or_start();
  void check_shared_run_dir();
  void load_checkpoint(const std::string& name);
  void save_checkpoint(int64_t step);
  void write_checkpoint_files(const fs::path& tmp, int64_t step);

  // ---- reports and evaluation (trainer_report.cpp)
  void print_banner() const;
  void log_step(int64_t step, const StepResult& r);
  double evaluate();
  double evaluate(bool quantized);
  void eval_step(int64_t step);
  int eval_only();
  int eval_checkpoint(nlohmann::json& out);
  void finish();

  // Declared in the order they are made, so they are destroyed in reverse: the features, the
  // model and the metrics file before the session, the session before the dataset.
  const Args& args_;
  TrainConfig c_;
  std::optional<Dataset> ds_;
  std::unique_ptr<loom_session, void (*)(loom_session*)> session_{nullptr, loom_close};
  loom_instance* opt_ = nullptr;
  Comm comm_;
  int rank_ = 0, world_ = 1;
  bool root_ = true;
  int local_batch_ = 0;
  std::optional<Model> model_;
  size_t numel_ = 0;

  // The config's features, in hook order: curriculum, routing, moe, quantization, then the
  // test aids. The typed pointers are into the list (nullptr: not configured).
  std::vector<std::unique_ptr<Feature>> features_;
  CurriculumFeature* curriculum_ = nullptr;
  QuantizationFeature* quant_ = nullptr;

  // The optimizer's view of the parameters (pointers into these vectors and into
  // wpe_mask_t_, so Trainer is neither copied nor moved).
  std::vector<DLTensor> pt_, gt_;
  std::vector<loom_optimizer_tensor> decay_, no_decay_;
  std::vector<float> wpe_mask_;
  DLTensor wpe_mask_t_{};
  std::vector<loom_optimizer_group> groups_;
  bool contiguous_ = true;
  std::vector<float> flat_;       // gradient staging when the gradients are not one block
  std::vector<size_t> averaged_;  // the parameters the world average takes
  bool average_all_ = true;       // averaged_ is every parameter
  std::vector<int> norm_owner_;   // per parameter: the feature summing its squares (-1: none)
  std::vector<bool> sums_norm_;   // per feature: it sums the squares of some

  fs::path run_dir_, ckpt_root_, metrics_path_, latest_file_;
  TrainerState st_;
  AppendFile metrics_;
  double loss_acc_ = 0;  // see TrainerState
  int64_t acc_steps_ = 0;
  double aux_acc_ = 0;          // like loss_acc_, of StepResult::aux
  std::vector<int32_t> x_, y_;  // the batch (and eval windows)
  bool tty_ = false;
  double per_step_uncompressed_ = 0;

  clk::time_point t_start_, t_log_;
  double elapsed_before_ = 0;
  double train_step_s_ = 0;  // time in train_step (sampler included), this process
  int64_t log_from_step_ = 0;
  uint64_t log_tokens_ = 0;          // tokens_seen at the last log line
  uint64_t start_tokens_ = 0;        // tokens_seen when this process started training
  uint64_t start_layer_tokens_ = 0;  // layer_tokens then
  int64_t last_step_ = 0;
  double last_eval_ = NAN;
};

// loom train: a Trainer's run (trainer.cpp), and --check (check.cpp). 0 or 2.
int run(const Args& args);
int check(const Args& args);

}  // namespace loom::trainer
