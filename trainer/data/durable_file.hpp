// Writes that count: every file the trainer writes is flushed to the disk (fsync of the file,
// then of its folder after a rename) before the run relies on it, and every failure is an
// error naming the file and the system's reason (a full disk, a read-only folder...).
#pragma once

#include <cstddef>
#include <initializer_list>
#include <stdexcept>
#include <string>

namespace loom::trainer {

class WriteError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Writes `bytes` to PATH.tmp, fsyncs it, renames it to PATH and fsyncs PATH's folder: PATH is
// the old file or the whole new one, even after a power loss. Throws WriteError.
void write_file_atomic(const std::string& path, const void* data, size_t bytes);
// The same for a file made of several pieces, written one after the other.
struct FilePart {
  const void* data;
  size_t bytes;
};
void write_file_atomic(const std::string& path, std::initializer_list<FilePart> parts);

// fsync of a folder, so the names created or renamed in it survive a power loss.
void sync_folder(const std::string& path);

// A line-per-record log (metrics.jsonl) appended line by line. Each line is written whole and
// fsynced before append() returns; a line that cannot be written whole is cut off again, so
// the file always ends with a complete line. Throws WriteError.
class AppendFile {
 public:
  AppendFile() = default;
  AppendFile(const AppendFile&) = delete;
  AppendFile& operator=(const AppendFile&) = delete;
  ~AppendFile();
  void open(const std::string& path);
  [[nodiscard]] bool is_open() const { return fd_ >= 0; }
  // `line` without its newline.
  void append(const std::string& line);

 private:
  std::string path_;
  int fd_ = -1;
};

}  // namespace loom::trainer
