// What the tests that start loom-train share: the environment its processes run in, and the
// dataset they train on (a generated corpus prepared by loom-data).
#pragma once

#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "corpus.hpp"

namespace loom::trainer::test_run {

// Quiet logs, OpenMPI as root with more ranks than cores, a bounded bootstrap
// (`bootstrap_timeout_s`), and log lines rather than a progress line (docs/comm.md).
inline void set_environment(const char* bootstrap_timeout_s = "30") {
  ::setenv("LOOM_LOG_LEVEL", "", 1);
  ::setenv("UCX_LOG_LEVEL", "error", 1);
  ::setenv("OMPI_MCA_rmaps_base_oversubscribe", "1", 1);
  ::setenv("LOOM_BOOTSTRAP_TIMEOUT", bootstrap_timeout_s, 1);
  ::setenv("LOOM_PROGRESS", "lines", 1);
}

// A fresh folder `dir` holding DIR/data.bin, `bytes` of generated text prepared by
// `loom_data` with a tenth held out. The command's exit status (0: done); its output in
// DIR/prepare.log.
inline int prepare_dataset(const std::filesystem::path& dir, const std::string& loom_data,
                           size_t bytes = 120000) {
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "corpus.txt") << test_corpus::generated_corpus(bytes);
  const int st =
      std::system((loom_data + " prepare --input " + (dir / "corpus.txt").string() + " --output " +
                   (dir / "data.bin").string() + " --heldout-fraction 0.1 > " +
                   (dir / "prepare.log").string() + " 2>&1")
                      .c_str());
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

}  // namespace loom::trainer::test_run
