#include "durable_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

namespace loom::trainer {
namespace {

std::string reason(int err) { return std::strerror(err); }

// write() until every byte is out; false with errno set on the first failure.
bool write_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    if (w == 0) {
      errno = ENOSPC;
      return false;
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

std::string parent_of(const std::string& path) {
  const std::string p = std::filesystem::path(path).parent_path().string();
  return p.empty() ? "." : p;
}

}  // namespace

void sync_folder(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw WriteError(path + ": cannot open the folder to sync it: " + reason(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  // EINVAL: a file system without fsync on folders (some network ones); names there are as
  // durable as it makes them.
  if (rc != 0 && err != EINVAL) throw WriteError(path + ": folder sync failed: " + reason(err));
}

void write_file_atomic(const std::string& path, const void* data, size_t bytes) {
  write_file_atomic(path, {FilePart{data, bytes}});
}

void write_file_atomic(const std::string& path, std::initializer_list<FilePart> parts) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw WriteError(tmp + ": cannot create the file: " + reason(errno));
  bool ok = true;
  for (const FilePart& part : parts) {
    ok = ok && write_all(fd, static_cast<const char*>(part.data), part.bytes);
  }
  ok = ok && ::fsync(fd) == 0;
  const int err = errno;
  if (::close(fd) != 0 && ok) {
    const int close_err = errno;
    (void)::unlink(tmp.c_str());
    throw WriteError(tmp + ": write failed: " + reason(close_err));
  }
  if (!ok) {
    (void)::unlink(tmp.c_str());  // leave no partial file behind (and free the space)
    throw WriteError(tmp + ": write failed: " + reason(err));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int rename_err = errno;
    (void)::unlink(tmp.c_str());
    throw WriteError(path + ": cannot rename into place: " + reason(rename_err));
  }
  sync_folder(parent_of(path));
}

AppendFile::~AppendFile() {
  if (fd_ >= 0) ::close(fd_);
}

void AppendFile::open(const std::string& path) {
  path_ = path;
  fd_ = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) throw WriteError(path + ": cannot open for writing: " + reason(errno));
  sync_folder(parent_of(path));
}

void AppendFile::append(const std::string& line) {
  if (fd_ < 0) throw WriteError(path_ + ": not open");
  struct stat st {};
  if (::fstat(fd_, &st) != 0) throw WriteError(path_ + ": cannot stat: " + reason(errno));
  const std::string text = line + "\n";
  if (write_all(fd_, text.data(), text.size()) && ::fdatasync(fd_) == 0) return;
  const int err = errno;
  // Cut the torn line off, so readers still see whole lines only.
  const bool cut = ::ftruncate(fd_, st.st_size) == 0;
  throw WriteError(path_ + ": cannot write a line: " + reason(err) +
                   (cut ? "" : " (and the partly written line could not be removed)"));
}

}  // namespace loom::trainer
