#include "crash_report.hpp"

#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "layers.hpp"

namespace loom::trainer {
namespace {

constexpr std::array<int, 5> kSignals = {SIGILL, SIGSEGV, SIGBUS, SIGFPE, SIGABRT};

// Built before any signal can arrive: the handler may only write() them.
std::array<char, 128> g_prefix{};
std::array<char, 384> g_cpu{};
std::array<char, 128> g_program{};
std::atomic<bool> g_clean_exit{false};

const char* signal_name(int sig) {
  switch (sig) {
    case SIGILL:
      return "SIGILL (illegal instruction)";
    case SIGSEGV:
      return "SIGSEGV (invalid memory access)";
    case SIGBUS:
      return "SIGBUS (bus error)";
    case SIGABRT:
      return "SIGABRT (abort: a failed assertion, std::terminate or abort())";
    default:
      return "SIGFPE (arithmetic fault)";
  }
}

void write_text(const char* text) { (void)!::write(STDERR_FILENO, text, std::strlen(text)); }

void handler(int sig, siginfo_t* /*info*/, void* /*ucontext*/) {
  write_text(g_prefix.data());
  write_text(signal_name(sig));
  write_text(g_cpu.data());
  // Our own backtrace, then the default action. UCX's and OpenMPI's handlers are not
  // chained to: they would print the crash as theirs, and UCX re-raises into a loop.
  std::array<void*, 64> frames{};
  const int depth = ::backtrace(frames.data(), static_cast<int>(frames.size()));
  ::backtrace_symbols_fd(frames.data(), depth, STDERR_FILENO);
  ::signal(sig, SIG_DFL);
  // Raised again whatever its origin (a fault, kill(), an asynchronous machine check): it is
  // blocked while this handler runs, so the default action ends the process on return.
  ::raise(sig);
}

// The file of the shared library that called exit(), from the exit handler's backtrace: past
// the handler's own frames (this program) and then the C library's (exit() and the code that
// runs the handlers), the first frame. NULL when that frame is this program's: the trainer's
// own exit, or main returning (through the C library's start code, from _start).
const char* exit_caller(void* const* frames, int depth) {
  auto object = [](const void* pc, const char** file) -> const void* {
    Dl_info at{};
    if (::dladdr(pc, &at) == 0) return nullptr;
    if (file != nullptr) *file = at.dli_fname;
    return at.dli_fbase;
  };
  const void* self = object(reinterpret_cast<const void*>(&exit_caller), nullptr);  // NOLINT
  int i = 0;
  while (i < depth && object(frames[i], nullptr) == self) ++i;
  if (i == depth) return nullptr;
  const void* libc = object(frames[i], nullptr);
  while (i < depth && object(frames[i], nullptr) == libc) ++i;
  const char* file = nullptr;
  if (i == depth || object(frames[i], &file) == self) return nullptr;
  return file;
}

// Runs inside exit() and quick_exit() (not in a signal handler: stdio is usable). `status` is
// negative for quick_exit, whose handlers are not told it.
void report_exit(int status) {
  if (g_clean_exit.load()) return;
  std::array<void*, 64> frames{};
  const int depth = ::backtrace(frames.data(), static_cast<int>(frames.size()));
  const char* caller = exit_caller(frames.data(), depth);
  if (caller == nullptr) return;
  std::fflush(stdout);
  if (status >= 0) {
    std::fprintf(stderr, "%s: the process exited with status %d from inside %s", g_program.data(),
                 status, caller);
  } else {
    std::fprintf(stderr, "%s: the process ended through quick_exit() from inside %s",
                 g_program.data(), caller);
  }
  std::fprintf(stderr, " (a plugin called exit?) before the trainer finished; backtrace:\n");
  std::fflush(stderr);
  ::backtrace_symbols_fd(frames.data(), depth, STDERR_FILENO);
}

}  // namespace

void mark_clean_exit() { g_clean_exit.store(true); }

std::string cpu_description() {
  std::string have;
  std::string lack;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  auto note = [&](bool present, const char* name) {
    (present ? have : lack) += std::string(" ") + name;
  };
  note(__builtin_cpu_supports("sse4.2"), "sse4.2");
  note(__builtin_cpu_supports("avx"), "avx");
  note(__builtin_cpu_supports("avx2"), "avx2");
  note(__builtin_cpu_supports("fma"), "fma");
  note(__builtin_cpu_supports("avx512f"), "avx512f");
  note(__builtin_cpu_supports("avx512bw"), "avx512bw");
  note(__builtin_cpu_supports("avx512vl"), "avx512vl");
  std::string out = "x86-64" + have;
#else
  std::string out = "cpu";
#endif
  if (!lack.empty()) out += " (no" + lack + ")";
  out += std::string("; SIMD kernels: ") + layers::kernel_target();
  const char* cap = std::getenv("LOOM_SIMD_MAX");
  if (cap != nullptr && *cap != '\0') out += std::string(" (LOOM_SIMD_MAX=") + cap + ")";
  return out;
}

void apply_simd_cap(const char* program) {
  if (!layers::cap_simd_from_env().empty()) install_crash_report(program);  // new target name
}

void install_crash_report(const char* program) {
  std::snprintf(g_prefix.data(), g_prefix.size(), "%s: fatal ", program);
  std::snprintf(g_program.data(), g_program.size(), "%s", program);
  static const bool exit_hooks = [] {
    // on_exit (glibc) is told the status, which atexit is not.
    (void)::on_exit([](int status, void* /*arg*/) { report_exit(status); }, nullptr);
    (void)std::at_quick_exit([] { report_exit(-1); });
    return true;
  }();
  (void)exit_hooks;
  std::snprintf(g_cpu.data(), g_cpu.size(), "; CPU: %s\n", cpu_description().c_str());
  std::array<void*, 1> warm{};
  ::backtrace(warm.data(), 1);  // loads libgcc's unwinder now, not inside the handler
  // An alternate stack for this thread, so a stack overflow is reported too.
  static std::array<char, 64 * 1024> alt_stack{};
  stack_t ss{};
  ss.ss_sp = alt_stack.data();
  ss.ss_size = alt_stack.size();
  (void)::sigaltstack(&ss, nullptr);
  struct sigaction sa {};
  sa.sa_sigaction = handler;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  for (const int sig : kSignals) sigaddset(&sa.sa_mask, sig);  // no re-entry from another
  for (const int sig : kSignals) ::sigaction(sig, &sa, nullptr);
}

}  // namespace loom::trainer
