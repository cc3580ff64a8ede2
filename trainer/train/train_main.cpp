// loom-train (run as `loom train CONFIG.toml [--resume] [--fresh] [--steps N] [--run-dir DIR]`):
// the reference trainer's loop. Data parallel over the ranks mpirun starts, through the Loom
// manifest's comm instance; optimizer from the manifest; warmup + cosine/linear decay;
// global-norm clipping; eval at intervals; exact checkpoints; metrics JSONL; a plot at the end.
// docs/trainer.md describes the files and the numbers it prints. This file is the command
// line; trainer.hpp the loop, features/ what the config's sections add to it.
#include <loom/embed.h>

#include <algorithm>
#include <iostream>
#include <loom_cli_support.hpp>
#include <sstream>
#include <string>

#include "config.hpp"
#include "crash_report.hpp"
#include "run.hpp"
#include "trainer.hpp"

using namespace loom::trainer;

int main(int argc, char** argv) {
  loom::trainer::install_crash_report("loom train");
  CLI::App app{"Train a model with the reference trainer (docs/trainer.md)"};
  loom_cli::configure(app, "loom train");
  Args a;
  app.add_option("CONFIG", a.config, "Trainer config (TOML) naming a Loom manifest")
      ->required()
      ->type_name("FILE");
  auto* resume =
      app.add_flag("--resume", a.resume, "Continue from the run directory's last checkpoint");
  app.add_flag("--fresh", a.fresh, "Start over, deleting the run directory's checkpoints")
      ->excludes(resume);
  app.add_option("--steps", a.steps, "Override [train] steps (0: the config's)")
      ->check(loom_cli::integer_in(0, int64_t{1} << 40))
      ->type_name("N");
  app.add_option("--stop-after", a.stop_after, "Exit after this step (for tests; -1: never)")
      ->check(loom_cli::integer_in(-1, int64_t{1} << 40))
      ->type_name("STEP");
  app.add_option("--run-dir", a.run_dir, "Override [train] run_dir")->type_name("DIR");
  app.add_flag("--no-plot", a.no_plot, "Do not draw the plot at the end");
  app.add_flag("--eval-only", a.eval_only,
               "Evaluate the weights ([quantization] weights, else the run's latest checkpoint) "
               "in fp32 and quantized, write RUN_DIR/eval.json, and exit");
  app.add_option("--weights", a.weights,
                 "With --eval-only: the weights to evaluate (a loom quantize output, or fp32 "
                 "weights the config's [quantization] quantizer quantizes)")
      ->type_name("FILE");
  app.add_flag("--check", a.check,
               "Validate the config, its manifest and dataset, and exit (what loom check does)");
  app.add_option("--plugin-path", a.plugin_path,
                 "Extra plugin folders (':'-separated), searched after the manifest's")
      ->type_name("DIRS");
  if (const int rc = loom_cli::parse(app, argc, argv, true); rc >= 0) return rc;
  try {
    const int rc = a.check ? check(a) : run(a);
    loom::trainer::mark_clean_exit();
    return rc;
  } catch (const ConfigError& e) {  // the same on every rank: each exits by itself
    std::cout << std::flush;
    for (const auto& line : e.errors()) std::cerr << "loom train: error: " << line << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cout << std::flush;
    std::istringstream lines(e.what());
    for (std::string line; std::getline(lines, line);) {
      std::cerr << "loom train: error: " << line << "\n";
    }
    std::cerr << std::flush;
    // A failure this rank alone saw (a peer that died or stopped, a plugin error): end the
    // job, or the other ranks would wait for this one, and MPI's exit handler for them.
    const bool agreed = dynamic_cast<const AgreedError*>(&e) != nullptr;
    if (!agreed && std::max(g_job_ranks, launcher_ranks()) > 1) loom_abort_job(2);
    return 2;
  }
}
