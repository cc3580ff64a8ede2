#include "crash_report.hpp"

#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "layers.hpp"

namespace loom::trainer {
namespace {

constexpr std::array<int, 4> kSignals = {SIGILL, SIGSEGV, SIGBUS, SIGFPE};

// Built before any signal can arrive: the handler may only write() them.
std::array<char, 128> g_prefix{};
std::array<char, 384> g_cpu{};

const char* signal_name(int sig) {
  switch (sig) {
    case SIGILL:
      return "SIGILL (illegal instruction)";
    case SIGSEGV:
      return "SIGSEGV (invalid memory access)";
    case SIGBUS:
      return "SIGBUS (bus error)";
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

}  // namespace

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
