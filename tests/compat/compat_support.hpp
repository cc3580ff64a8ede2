// Helpers shared by the compatibility tests: a 1-D tensor view and a session over a manifest
// written to a temporary folder.
#pragma once

#include <loom/embed.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "loom_test.hpp"

namespace compat_test {

// A 1-D fp32 CPU DLTensor over a vector (the shape lives beside it).
struct Tensor1d {
  int64_t shape = 0;
  DLTensor t{};
  explicit Tensor1d(std::vector<float>& v) : shape(static_cast<int64_t>(v.size())) {
    t.data = v.data();
    t.device = {kDLCPU, 0};
    t.ndim = 1;
    t.dtype = {kDLFloat, 32, 1};
    t.shape = &shape;
  }
  Tensor1d(const Tensor1d&) = delete;
  Tensor1d& operator=(const Tensor1d&) = delete;
  Tensor1d(Tensor1d&&) = delete;
  Tensor1d& operator=(Tensor1d&&) = delete;
  ~Tensor1d() = default;
};

// A session over a manifest written to a temporary folder, with `plugin_path` (':'-separated
// folders) as the options' plugin path.
class Session {
 public:
  explicit Session(std::string plugin_path) : plugin_path_(std::move(plugin_path)) {}
  int32_t open(const std::string& toml, bool validate_only = false) {
    close();
    file_ = dir_.write("manifest.toml", toml);
    auto r = loom_test::open_file(file_, validate_only, plugin_path_);
    error_ = r.error;
    session_ = r.session;
    return r.rc;
  }
  void close() {
    loom_close(session_);
    session_ = nullptr;
  }
  loom_instance* find(const char* kind, const char* name) const {
    loom_instance* out = nullptr;
    EXPECT_EQ(loom_find_instance(session_, kind, name, &out), LOOM_OK) << loom_last_error();
    return out;
  }
  [[nodiscard]] std::string at(int line, int col) const {
    return file_.string() + ":" + std::to_string(line) + ":" + std::to_string(col) + ": ";
  }
  [[nodiscard]] const std::string& error() const { return error_; }
  [[nodiscard]] loom_session* session() const { return session_; }
  [[nodiscard]] const loom_test::TempDir& dir() const { return dir_; }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
  Session(Session&&) = delete;
  Session& operator=(Session&&) = delete;
  ~Session() { close(); }

 private:
  loom_test::TempDir dir_;
  std::string plugin_path_;
  std::filesystem::path file_;
  std::string error_;
  loom_session* session_ = nullptr;
};

}  // namespace compat_test
