#include "loom_test.hpp"

#include <sys/stat.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <stdexcept>

namespace loom_test {

std::filesystem::path plugin_dir() { return LOOM_TEST_PLUGIN_DIR; }

std::filesystem::path plugin_file(const std::string& name) {
  return plugin_dir() / ("loom_" + name + ".so");
}

TempDir::TempDir() {
  std::string pattern = (std::filesystem::temp_directory_path() / "loom-test-XXXXXX").string();
  if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  path_ = pattern;
}

TempDir::~TempDir() {
  std::error_code ec;
  // A test may have made the folder group-writable or read-only; removal needs rwx.
  ::chmod(path_.c_str(), 0700);
  std::filesystem::remove_all(path_, ec);
}

std::filesystem::path TempDir::write(const std::string& name, const std::string& text) const {
  const auto file = path_ / name;
  std::ofstream out(file, std::ios::binary);
  out << text;
  if (!out) throw std::runtime_error("cannot write " + file.string());
  return file;
}

Opened open_file(const std::filesystem::path& file, bool validate_only,
                 const std::string& plugin_path) {
  loom_open_options opts{};
  opts.struct_size = LOOM_OPEN_OPTIONS_SIZE;
  opts.validate_only = validate_only ? 1 : 0;
  opts.plugin_path = plugin_path.empty() ? nullptr : plugin_path.c_str();
  opts.log_level = LOOM_LOG_ERROR;
  Opened out;
  out.rc = loom_open_file(file.c_str(), &opts, &out.session);
  out.error = loom_last_error();
  return out;
}

std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start < text.size()) {
    const size_t end = text.find('\n', start);
    if (end == std::string::npos) {
      out.push_back(text.substr(start));
      break;
    }
    out.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

probe_events* probe_event_log(loom_session* session, const char* comm_name) {
  loom_instance* comm = nullptr;
  if (loom_find_instance(session, "comm", comm_name, &comm) != LOOM_OK) return nullptr;
  const auto* vt = static_cast<const loom_comm_v1*>(loom_instance_vtable(comm));
  const char* kind = nullptr;
  void* handle = nullptr;
  loom_status* s = vt->native_handle(loom_instance_object(comm), &kind, &handle);
  if (s != nullptr) {
    s->destroy(s);
    return nullptr;
  }
  if (kind == nullptr || std::strcmp(kind, PROBE_EVENTS_KIND) != 0) return nullptr;
  return static_cast<probe_events*>(handle);
}

std::string take_events(probe_events* log) {
  std::string out(log->text, log->len);
  log->len = 0;
  log->text[0] = '\0';
  return out;
}

void ManifestTest::TearDown() {
  loom_close(session_);
  session_ = nullptr;
}

int32_t ManifestTest::check(const std::string& toml) {
  file_ = dir_.write("manifest.toml", toml);
  auto r = open_file(file_, true);
  error_ = r.error;
  loom_close(r.session);
  return r.rc;
}

int32_t ManifestTest::open(const std::string& toml) {
  file_ = dir_.write("manifest.toml", toml);
  loom_close(session_);
  auto r = open_file(file_, false);
  error_ = r.error;
  session_ = r.session;
  return r.rc;
}

std::string ManifestTest::at(int line, int col) const {
  return file_.string() + ":" + std::to_string(line) + ":" + std::to_string(col) + ": ";
}

}  // namespace loom_test
