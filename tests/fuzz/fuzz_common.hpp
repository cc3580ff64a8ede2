// Helpers the fuzz targets share: failing an invariant, writing the committed seed corpus,
// and an in-memory file for readers that only take a path.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace loom_fuzz {

[[noreturn]] inline void invariant_failed(const char* target, const char* what,
                                          const std::string& detail) {
  std::fprintf(stderr, "%s: invariant violated: %s: %s\n", target, what, detail.c_str());
  std::abort();
}

// A named seed input.
struct Seed {
  std::string name;
  std::vector<uint8_t> bytes;
};

// The seeds a target generates are committed under tests/fuzz/NAME_corpus/; running the
// target with LOOM_FUZZ_WRITE_SEEDS=DIR writes them into DIR and exits, so they can be
// regenerated when a format changes (docs/fuzzing.md).
inline void write_seeds_if_asked(const std::vector<Seed>& seeds) {
  const char* dir = std::getenv("LOOM_FUZZ_WRITE_SEEDS");
  if (dir == nullptr || *dir == '\0') return;
  std::filesystem::create_directories(dir);
  for (const Seed& s : seeds) {
    std::ofstream out(std::filesystem::path(dir) / s.name, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(s.bytes.data()),
              static_cast<std::streamsize>(s.bytes.size()));
    if (!out) {
      std::fprintf(stderr, "cannot write seed %s/%s\n", dir, s.name.c_str());
      std::exit(1);
    }
  }
  std::fprintf(stderr, "wrote %zu seeds to %s\n", seeds.size(), dir);
  std::exit(0);
}

inline std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }

// An anonymous in-memory file (memfd) reachable by path: /proc/self/fd/N. Each input is
// written over it, so readers that open a path read the fuzz input without touching a disk
// and without races between fuzzing processes.
class MemFile {
 public:
  explicit MemFile(const char* name) : fd_(::memfd_create(name, MFD_CLOEXEC)) {
    if (fd_ < 0) {
      std::perror("memfd_create");
      std::abort();
    }
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  ~MemFile() { ::close(fd_); }
  MemFile(const MemFile&) = delete;
  MemFile& operator=(const MemFile&) = delete;

  const std::string& path() const { return path_; }
  void set(const void* data, size_t size) {
    if (::ftruncate(fd_, 0) != 0 ||
        (size > 0 && ::pwrite(fd_, data, size, 0) != static_cast<ssize_t>(size))) {
      std::perror("memfd write");
      std::abort();
    }
  }

 private:
  int fd_;
  std::string path_;
};

}  // namespace loom_fuzz
