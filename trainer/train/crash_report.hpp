// A fatal signal (SIGILL, SIGSEGV, SIGBUS, SIGFPE, SIGABRT) in loom-train prints one line
// naming the signal, this CPU's SIMD features and the kernels' Highway target, then a
// backtrace (which names the .so of each frame), before the process dies, so a crash inside a
// kernel does not read as a UCX or MPI problem (both install handlers that print only their
// own backtrace). An exit() called from inside a shared library (a plugin, or a library one
// uses) before the trainer finished prints the status and that library with a backtrace too.
// _exit() and _Exit() cannot be seen from inside the process: no handler runs for them; only
// a parent (`loom validate-plugin` for a plugin on its own) sees such an exit.
#pragma once

#include <string>

namespace loom::trainer {

// Installs the handlers (the line, a backtrace, then the default action: the process dies
// of the signal), and, the first time, the exit report (on_exit and at_quick_exit). Call once
// at start, and again after the Loom session is open: UCX and OpenMPI install their own
// handlers while it opens, and ours replace them.
void install_crash_report(const char* program);

// The trainer finished (or gave up on purpose): an exit() from here on is not reported. An
// exit() from the program's own code, or main returning, never is.
void mark_clean_exit();

// Applies LOOM_SIMD_MAX (layers::cap_simd_from_env; throws on a bad value) and refreshes
// the report's line.
void apply_simd_cap(const char* program);

// The one-line CPU description the report prints, e.g. "x86-64 sse4.2 avx avx2 fma
// (no avx512f); SIMD kernels: AVX2".
std::string cpu_description();

}  // namespace loom::trainer
