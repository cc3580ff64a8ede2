// Shared helpers for the host's tests: temporary folders, manifests written to files,
// opening them through the public C API, and the probe plugin's event log.
#pragma once

#include <loom/embed.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "probe_layout.h"

namespace loom_test {

// The folder the test plugins are built into (only tests use it).
std::filesystem::path plugin_dir();
std::filesystem::path plugin_file(const std::string& name);  // plugin_dir()/loom_<name>.so

// A fresh folder (mode 0700) removed with everything in it on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  [[nodiscard]] const std::filesystem::path& path() const { return path_; }
  // Writes `text` to path()/name and returns the full path.
  std::filesystem::path write(const std::string& name, const std::string& text) const;

 private:
  std::filesystem::path path_;
};

// The result of opening a manifest.
struct Opened {
  int32_t rc = LOOM_OK;
  std::string error;  // loom_last_error() after the call
  loom_session* session = nullptr;
};

// Opens `file`; the test plugin folder is passed as options.plugin_path unless
// `plugin_path` says otherwise ("" for none).
Opened open_file(const std::filesystem::path& file, bool validate_only,
                 const std::string& plugin_path = plugin_dir().string());

// Splits on '\n', dropping a trailing empty line.
std::vector<std::string> lines(const std::string& text);

// The probe plugin's process-wide create/destroy log, reached through a probe comm's
// native_handle. Clears it.
probe_events* probe_event_log(loom_session* session, const char* comm_name);
std::string take_events(probe_events* log);

// A fixture with a temporary folder for manifests. check() validates only; open()
// creates instances; both keep the last error in error_ and the file in file_.
class ManifestTest : public ::testing::Test {
 protected:
  void TearDown() override;
  int32_t check(const std::string& toml);
  int32_t open(const std::string& toml);
  // "FILE:LINE:COL: " for the manifest written last.
  [[nodiscard]] std::string at(int line, int col) const;

  TempDir dir_;
  std::filesystem::path file_;
  std::string error_;
  loom_session* session_ = nullptr;
};

}  // namespace loom_test
