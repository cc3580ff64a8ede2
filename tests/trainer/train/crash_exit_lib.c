/* A shared library that calls exit(), as a plugin that gives up that way would:
 * crash_report_test.cpp checks that loom-train's exit report names it. */
#include <stdlib.h>

__attribute__((visibility("default"))) void loom_test_exit_from_library(int status);

/* noinline, so this library's frame is on the stack when exit() runs (a noreturn function is
 * called, never jumped to). */
__attribute__((visibility("default"), noinline)) void loom_test_exit_from_library(int status) {
  exit(status);
}
