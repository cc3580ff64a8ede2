#include "job_processes.hpp"

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

namespace loom::host {
namespace {

std::mutex g_mu;
std::vector<ProcessRecord> g_same_host;

// Field 22 of /proc/PID/stat (after the command name, which may hold spaces and parentheses:
// the fields resume after its last ')'). 0 when unreadable.
uint64_t start_ticks(int64_t pid) {
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  std::FILE* f = std::fopen(path.c_str(), "re");
  if (f == nullptr) return 0;
  char buf[1024] = {};
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* p = std::strrchr(buf, ')');
  if (p == nullptr) return 0;
  // The space after the ")" of field 2 starts field 3 (the state); starttime is field 22.
  int field = 2;
  for (++p; *p != '\0' && field < 22; ++p) {
    if (*p == ' ') ++field;
  }
  char* end = nullptr;
  const unsigned long long v = std::strtoull(p, &end, 10);
  return end != p ? v : 0;
}

}  // namespace

ProcessRecord this_process() {
  ProcessRecord r{};
  if (::gethostname(r.host, sizeof r.host - 1) != 0) std::strncpy(r.host, "?", sizeof r.host);
  r.host[sizeof r.host - 1] = '\0';
  r.pid = ::getpid();
  r.start_ticks = start_ticks(r.pid);
  return r;
}

void remember_job_processes(const std::vector<ProcessRecord>& all, int self) {
  const ProcessRecord me = this_process();
  const std::lock_guard<std::mutex> lock(g_mu);
  g_same_host.clear();
  for (size_t i = 0; i < all.size(); ++i) {
    if (static_cast<int>(i) == self) continue;
    if (std::strncmp(all[i].host, me.host, sizeof me.host) == 0 && all[i].pid > 0 &&
        all[i].start_ticks != 0) {
      g_same_host.push_back(all[i]);
    }
  }
}

void end_same_host_ranks() {
  const std::lock_guard<std::mutex> lock(g_mu);
  for (const auto& r : g_same_host) {
    if (start_ticks(r.pid) == r.start_ticks) (void)::kill(static_cast<pid_t>(r.pid), SIGKILL);
  }
}

}  // namespace loom::host
