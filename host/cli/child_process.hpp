// Running `loom` itself in a child process, with a time limit, for the work that runs plugin
// code (loading a plugin runs its static constructors and its entry function): a plugin that
// crashes, hangs or calls exit() takes the child down, never the command. GStreamer's plugin
// scanner does the same.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace loom_child {

struct Run {
  enum class End { kExited, kSignaled, kTimedOut, kNotStarted };
  End end = End::kNotStarted;
  int code = 0;     // kExited: the exit status; kSignaled: the signal
  std::string out;  // everything it wrote on stdout
  std::string why;  // kNotStarted: why not
};

// The seconds a child may go without finishing a line of output before it counts as hung:
// LOOM_SCAN_TIMEOUT when set (a positive number), else 30.
double time_limit_s();

// The running `loom`; empty when /proc/self/exe cannot be read.
const std::string& self_path();

// Runs `loom ARGS` with stdin from /dev/null, stderr shared with this process, and stdout read
// back; `on_line` (when set) gets each complete line, without its '\n', as it arrives. A child
// that goes `limit_s` seconds without a new line is killed (SIGKILL).
Run run_self(const std::vector<std::string>& args, double limit_s,
             const std::function<void(const std::string&)>& on_line = {});

// "SIGSEGV", or "signal N".
std::string signal_name(int sig);

// For the child: moves stdout to a private descriptor, which it returns, and points stdout at
// stderr, so what a plugin prints cannot mix with the results the parent reads.
int take_stdout();

// Writes all of `text` to `fd` (the results descriptor).
void write_all(int fd, const std::string& text);

}  // namespace loom_child
