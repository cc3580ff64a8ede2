// trainer/train/crash_report.cpp: the reports loom-train prints when a fatal signal
// (here SIGABRT) ends it, and when a shared library (crash_exit_lib.c, standing in for a
// plugin) calls exit() before the trainer finished. Each case runs in a death test's child.
#include <gtest/gtest.h>

#include <csignal>
#include <cstdlib>

#include "crash_report.hpp"

extern "C" void loom_test_exit_from_library(int status);  // crash_exit_lib.c: exit(status)

namespace {

using ::testing::ExitedWithCode;
using ::testing::KilledBySignal;

TEST(CrashReport, AbortIsReportedWithABacktraceThenEndsTheProcess) {
  // The line, then a backtrace that names each frame's file (abort's in the C library), then
  // the default action: the process dies of SIGABRT.
  EXPECT_EXIT(
      {
        loom::trainer::install_crash_report("loom train");
        std::abort();
      },
      KilledBySignal(SIGABRT),
      "^loom train: fatal SIGABRT \\(abort: [^)]*\\)\\); CPU: [^\n]*SIMD kernels: [^\n]*\n"
      ".*libc\\.so[^\n]*\\(abort\\+");
}

TEST(CrashReport, ExitFromInsideALibraryNamesTheLibraryAndTheStatus) {
  EXPECT_EXIT(
      {
        loom::trainer::install_crash_report("loom train");
        loom_test_exit_from_library(7);
      },
      ExitedWithCode(7),
      "^loom train: the process exited with status 7 from inside [^\n]*libloom_test_exit_caller"
      "\\.so \\(a plugin called exit\\?\\) before the trainer finished; backtrace:\n"
      ".*/libloom_test_exit_caller\\.so\\(");
}

TEST(CrashReport, ExitsThatAreTheProgramsOwnAreNotReported) {
  // The program's own exit() (main returning is the same).
  EXPECT_EXIT(
      {
        loom::trainer::install_crash_report("loom train");
        std::exit(3);
      },
      ExitedWithCode(3), "^$");
  // After the trainer said it finished.
  EXPECT_EXIT(
      {
        loom::trainer::install_crash_report("loom train");
        loom::trainer::mark_clean_exit();
        loom_test_exit_from_library(4);
      },
      ExitedWithCode(4), "^$");
}

}  // namespace
