// Where a test finds loom_thread_comm.so: ../test-plugins beside the test program (the
// layout of both the build tree and the GPU bundle, scripts/gpu-bundle.sh), else the
// folder CMake configured (LOOM_TEST_PLUGIN_DIR). "" when neither has it.
#pragma once

#include <filesystem>
#include <string>
#include <system_error>

namespace loom_test {

inline std::string thread_comm_dir() {
  std::error_code ec;
  std::filesystem::path candidates[2];
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) candidates[0] = exe.parent_path().parent_path() / "test-plugins";
#ifdef LOOM_TEST_PLUGIN_DIR
  candidates[1] = LOOM_TEST_PLUGIN_DIR;
#endif
  for (const auto& d : candidates) {
    if (!d.empty() && std::filesystem::exists(d / "loom_thread_comm.so", ec)) return d.string();
  }
  return "";
}

}  // namespace loom_test
