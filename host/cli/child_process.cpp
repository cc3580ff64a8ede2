#include "child_process.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>

extern char** environ;  // NOLINT: posix_spawn passes the environment on

namespace loom_child {
namespace {

constexpr double kDefaultLimitS = 30;

using Clock = std::chrono::steady_clock;

Clock::time_point after(double seconds) {
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

}  // namespace

double time_limit_s() {
  static const double limit = [] {
    const char* env = std::getenv("LOOM_SCAN_TIMEOUT");
    if (env == nullptr || *env == '\0') return kDefaultLimitS;
    char* end = nullptr;
    const double v = std::strtod(env, &end);
    if (end == env || *end != '\0' || !std::isfinite(v) || v <= 0) {
      std::cerr << "loom: LOOM_SCAN_TIMEOUT='" << env
                << "' is not a positive number of seconds; using 30\n";
      return kDefaultLimitS;
    }
    return v;
  }();
  return limit;
}

const std::string& self_path() {
  static const std::string path = [] {
    std::error_code ec;
    auto p = std::filesystem::canonical("/proc/self/exe", ec);
    return ec ? std::string() : p.string();
  }();
  return path;
}

std::string signal_name(int sig) {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 32))
  if (const char* abbrev = ::sigabbrev_np(sig); abbrev != nullptr) {
    return std::string("SIG") + abbrev;
  }
#endif
  return "signal " + std::to_string(sig);
}

int take_stdout() {
  std::cout.flush();
  std::fflush(stdout);
  const int fd = ::fcntl(STDOUT_FILENO, F_DUPFD_CLOEXEC, 3);
  ::dup2(STDERR_FILENO, STDOUT_FILENO);
  return fd;
}

void write_all(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // the parent is gone: nobody to tell
    done += static_cast<size_t>(n);
  }
}

Run run_self(const std::vector<std::string>& args, double limit_s,
             const std::function<void(const std::string&)>& on_line) {
  Run r;
  const std::string& exe = self_path();
  if (exe.empty()) {
    r.why = "/proc/self/exe is unreadable, so loom cannot run itself";
    return r;
  }
  std::array<int, 2> fds{};
  if (::pipe2(fds.data(), O_CLOEXEC) != 0) {
    r.why = std::string("pipe: ") + std::strerror(errno);
    return r;
  }
  posix_spawn_file_actions_t actions;
  ::posix_spawn_file_actions_init(&actions);
  ::posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  ::posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  std::vector<std::string> storage{exe};
  storage.insert(storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  argv.reserve(storage.size() + 1);
  for (auto& a : storage) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int spawned = ::posix_spawn(&pid, exe.c_str(), &actions, nullptr, argv.data(), environ);
  ::posix_spawn_file_actions_destroy(&actions);
  ::close(fds[1]);
  if (spawned != 0) {
    ::close(fds[0]);
    r.why = "cannot run " + exe + ": " + std::strerror(spawned);
    return r;
  }
  (void)::fcntl(fds[0], F_SETFL, O_NONBLOCK);

  auto deadline = after(limit_s);
  size_t line_start = 0;
  // Reads what is there; true at end of file.
  auto drain = [&] {
    std::array<char, 4096> buf{};
    for (;;) {
      const ssize_t n = ::read(fds[0], buf.data(), buf.size());
      if (n > 0) {
        r.out.append(buf.data(), static_cast<size_t>(n));
        for (size_t nl = r.out.find('\n', line_start); nl != std::string::npos;
             nl = r.out.find('\n', line_start)) {
          if (on_line) on_line(r.out.substr(line_start, nl - line_start));
          line_start = nl + 1;
          deadline = after(limit_s);  // progress: the limit counts from the last line
        }
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      return n == 0;
    }
  };
  bool eof = false;
  int status = 0;
  for (;;) {
    if (!eof) eof = drain();
    const pid_t w = ::waitpid(pid, &status, WNOHANG);
    if (w == pid) {
      // Done. What it wrote is in the pipe already; a process it started that still holds
      // the pipe open is not waited for.
      if (!eof) drain();
      break;
    }
    const auto now = Clock::now();
    if (now >= deadline) {
      ::kill(pid, SIGKILL);
      while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
      ::close(fds[0]);
      r.end = Run::End::kTimedOut;
      return r;
    }
    // Wakes on output or end of file; after end of file only the exit is left to wait for,
    // which follows at once in the usual case.
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now);
    const int wait_ms = static_cast<int>(std::clamp<int64_t>(left.count() + 1, 1, eof ? 2 : 50));
    pollfd p{fds[0], POLLIN, 0};
    (void)::poll(&p, eof ? 0 : 1, wait_ms);
  }
  ::close(fds[0]);
  if (WIFSIGNALED(status)) {
    r.end = Run::End::kSignaled;
    r.code = WTERMSIG(status);
  } else {
    r.end = Run::End::kExited;
    r.code = WEXITSTATUS(status);
  }
  return r;
}

}  // namespace loom_child
