// Trainer: the run folder, resume, and the checkpoints (trainer.hpp; docs/trainer.md
// "Checkpoints").
#include <fstream>
#include <iostream>
#include <random>

#include "checkpoint.hpp"
#include "trainer.hpp"

namespace loom::trainer {

// Run directory and resume: refuses to start over a run's checkpoints or metrics unless
// --resume or --fresh.
void Trainer::resume_or_start() {
  run_dir_ = c_.run_dir;
  ckpt_root_ = run_dir_ / "checkpoints";
  metrics_path_ = run_dir_ / "metrics.jsonl";
  latest_file_ = ckpt_root_ / "latest";
  st_.seed = c_.seed;
  st_.world = world_;
  on_every_rank([&] {
    std::error_code ec;
    fs::create_directories(ckpt_root_, ec);
    if (ec) throw TrainError(ckpt_root_.string() + ": cannot create: " + ec.message());
  });
  check_shared_run_dir();
  std::string from;  // the checkpoint folder to resume from ("": start at step 1)
  on_every_rank([&] {
    const std::string held = run_contents(ckpt_root_, metrics_path_);
    if (!held.empty() && !args_.resume && !args_.fresh) {
      throw TrainError(run_dir_.string() + " already holds " + held +
                       "; pass --resume to continue or --fresh to start over");
    }
    if (args_.fresh) return;
    bool newest = false;
    from = checkpoint_to_resume(ckpt_root_, &newest);
    if (newest && root_) {
      std::cerr << "loom train: " << latest_file_.string()
                << " is missing; resuming from the newest complete checkpoint, " << from << "\n";
    }
  });
  if (from.empty()) {
    on_every_rank([&] {
      if (!root_) return;
      std::error_code ec;
      fs::remove_all(ckpt_root_, ec);
      fs::create_directories(ckpt_root_, ec);
      if (ec) throw TrainError(ckpt_root_.string() + ": cannot create: " + ec.message());
      fs::remove(metrics_path_, ec);
      sync_folder(run_dir_.string());
    });
    if (root_ && args_.resume) {
      std::cerr << "loom train: no checkpoint in " << ckpt_root_.string()
                << " to resume from; starting at step 1\n";
    }
  } else {
    on_every_rank([&] { load_checkpoint(from); });
  }
  loss_acc_ = st_.loss_acc;  // see TrainerState
  acc_steps_ = st_.acc_steps;
}

// Every rank reads the checkpoints of its own rank from the run folder, which rank 0
// manages: a folder that is not shared (node-local disks) would fail later, with a
// confusing error, or mix runs. Rank 0 writes a token file the others must read back.
void Trainer::check_shared_run_dir() {
  if (world_ == 1) return;
  const fs::path probe = ckpt_root_ / ".shared";
  uint64_t token = 0;
  if (root_) {
    token = (static_cast<uint64_t>(std::random_device{}()) << 20 ^
             static_cast<uint64_t>(clk::now().time_since_epoch().count())) &
            ((uint64_t{1} << 52) - 1);  // exact in a double
  }
  on_every_rank([&] {
    if (!root_) return;
    const std::string text = std::to_string(token);
    write_file_atomic(probe.string(), text.data(), text.size());
  });
  token = static_cast<uint64_t>(comm_.sum({static_cast<double>(token)})[0]);
  on_every_rank([&] {
    std::error_code ec;
    if (!fs::exists(probe, ec) || read_text(probe) != std::to_string(token)) {
      throw TrainError(
          "cannot see " + probe.string() +
          ", which rank 0 has just written: checkpoints need a run folder that every rank "
          "shares (a shared file system, mounted at the same path on every host)");
    }
  });
}

// Restores the checkpoint in folder `name`: trainer state, model, optimizer state.
void Trainer::load_checkpoint(const std::string& name) {
  const fs::path dir = ckpt_root_ / name;
  const int64_t folder_step = checkpoint_step(name);
  if (folder_step < 0 || !fs::is_directory(dir)) {
    throw CheckpointError(latest_file_.string() + ": names '" + name +
                          "', which is not a checkpoint directory");
  }
  const std::string rs = "rank" + std::to_string(rank_);
  const std::string tfile = (dir / ("trainer." + rs + ".bin")).string();
  st_ = decode_trainer_state(load_blob(tfile, BlobKind::kTrainer), tfile);
  if (st_.world != world_) {
    throw CheckpointError(dir.string() + ": written by " + std::to_string(st_.world) +
                          " ranks; resume with the same number of ranks (now " +
                          std::to_string(world_) + ")");
  }
  if (st_.seed != c_.seed) throw CheckpointError(tfile + ": written with another seed");
  // Before LTS5 there was no routing: every layer processed every token.
  if (!st_.has_layer_tokens) {
    st_.layer_tokens = st_.tokens_seen * static_cast<uint64_t>(c_.model.layers);
    st_.warmup_layer_tokens = st_.warmup_tokens * static_cast<uint64_t>(c_.model.layers);
    st_.has_layer_tokens = true;
  }
  TrainerStateLimits limits;
  limits.folder_step = folder_step;
  limits.max_step_tokens = static_cast<uint64_t>(c_.batch_size) * c_.seq_len;
  limits.layers = static_cast<uint64_t>(std::max(1, c_.model.layers));
  check_trainer_state(st_, limits, tfile);
  // State that changes the parameters (the [moe] layers') before the weights.
  for (auto& f : features_) f->load_state_before_weights(dir, rs);
  load_safetensors((dir / ("model." + rs + ".safetensors")).string(), model_->parameters());
  const std::string ofile = (dir / ("optimizer." + rs + ".bin")).string();
  const auto blob = load_blob(ofile, BlobKind::kOptimizer);
  if (loom_instance_import_state(opt_, blob.data(), blob.size()) != LOOM_OK) {
    throw CheckpointError(ofile + ": the optimizer refused its state: " + loom_last_error());
  }
  for (auto& f : features_) f->load_state(dir, rs);
  for (auto& f : features_) f->refuse_foreign_state(dir, rs);
  comm_.grad_bytes_sent = st_.grad_bytes_sent;
  comm_.grad_bytes_received = st_.grad_bytes_received;
  comm_.grad_rounds = st_.grad_rounds;
  // Metrics past the checkpoint are recomputed: drop them.
  if (root_ && fs::exists(metrics_path_)) {
    std::ifstream in(metrics_path_);
    std::string line, kept;
    while (std::getline(in, line)) {
      auto j = nlohmann::json::parse(line, nullptr, false);
      if (!j.is_discarded() && j.value("step", int64_t{0}) <= st_.step) kept += line + "\n";
    }
    write_file_atomic(metrics_path_.string(), kept.data(), kept.size());
  }
  if (root_)
    std::cerr << "loom train: resumed from " << dir.string() << " (step " << st_.step << ")\n";
}
// ---- checkpoints

// step_N.tmp on every rank, renamed into place by rank 0 once all have written; the last
// two are kept. The optimizer's state is exported once (size query, then the copy from
// the same serialisation).
void Trainer::save_checkpoint(int64_t step) {
  const fs::path tmp = ckpt_root_ / (step_dir_name(step) + ".tmp");
  const fs::path dir = ckpt_root_ / step_dir_name(step);
  on_every_rank([&] {
    if (!root_) return;
    std::error_code ec;
    fs::remove_all(tmp, ec);
    fs::create_directories(tmp, ec);
    if (ec) throw CheckpointError(tmp.string() + ": cannot create: " + ec.message());
  });
  on_every_rank([&] { write_checkpoint_files(tmp, step); });
  // Complete on every rank: rank 0 names it. The folder's entries are synced before the
  // rename and the rename before `latest` names it, so `latest` never names a folder a
  // power loss could empty.
  on_every_rank([&] {
    if (!root_) return;
    std::error_code ec;
    sync_folder(tmp.string());
    fs::remove_all(dir, ec);
    fs::rename(tmp, dir, ec);
    if (ec) throw CheckpointError(dir.string() + ": cannot rename into place: " + ec.message());
    sync_folder(ckpt_root_.string());
    const std::string name = step_dir_name(step) + "\n";
    write_file_atomic(latest_file_.string(), name.data(), name.size());
    // Keep the last two checkpoints.
    std::vector<fs::path> old;
    for (const auto& e : fs::directory_iterator(ckpt_root_, ec)) {
      const auto f = e.path().filename().string();
      if (e.is_directory() && f.rfind("step_", 0) == 0 && f.find(".tmp") == std::string::npos &&
          f < step_dir_name(step))
        old.push_back(e.path());
    }
    std::sort(old.begin(), old.end());
    for (size_t i = 0; i + 1 < old.size(); ++i) fs::remove_all(old[i], ec);
  });
}
// This rank's files of the checkpoint of `step`, in the folder `tmp`.
void Trainer::write_checkpoint_files(const fs::path& tmp, int64_t step) {
  const std::string rs = "rank" + std::to_string(rank_);
  save_safetensors((tmp / ("model." + rs + ".safetensors")).string(), model_->parameters(),
                   {{"step", std::to_string(step)}});
  size_t n = 0;
  check_loom(loom_instance_export_state(opt_, nullptr, 0, &n), "optimizer export_state");
  std::vector<uint8_t> blob(n);
  check_loom(loom_instance_export_state(opt_, blob.data(), blob.size(), &n),
             "optimizer export_state");
  blob.resize(n);
  save_blob((tmp / ("optimizer." + rs + ".bin")).string(), BlobKind::kOptimizer, blob);
  for (auto& f : features_) f->save_state(tmp, rs);
  TrainerState s = st_;
  s.step = step;
  s.grad_bytes_sent = comm_.grad_bytes_sent;
  s.grad_bytes_received = comm_.grad_bytes_received;
  s.grad_rounds = comm_.grad_rounds;
  s.loss_acc = loss_acc_;
  s.acc_steps = acc_steps_;
  save_blob((tmp / ("trainer." + rs + ".bin")).string(), BlobKind::kTrainer,
            encode_trainer_state(s));
}

}  // namespace loom::trainer
