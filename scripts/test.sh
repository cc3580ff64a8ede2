#!/usr/bin/env bash
# Builds the release preset with its tests and runs the whole suite, builds the tree with GCC 12
# (gcc preset), then runs the host's own tests and the plugins' CPU tests again under
# AddressSanitizer and UndefinedBehaviorSanitizer (debug preset), and the GPU tests under the
# CUDA emulation.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh release
echo "== (${SECONDS} s) release tests, and beside them the tree built with GCC 12"
# CI's other builds use clang; the gcc preset (-O0, no tests or benchmarks: a compile check)
# keeps the code warning-free under GCC too. It builds on one job at the lowest priority while
# the tests run, in the CPU time they leave.
gcc_log=$(mktemp)
(cmake --preset gcc >/dev/null && nice -n 19 cmake --build --preset gcc -j1) >"$gcc_log" 2>&1 &
gcc_pid=$!
trap 'kill "$gcc_pid" 2>/dev/null || true' EXIT  # a failing test run stops it too
ctest --preset release -j2
if ! wait "$gcc_pid"; then
  cat "$gcc_log" >&2
  echo "the GCC 12 build failed (cmake --preset gcc && cmake --build --preset gcc)" >&2
  exit 1
fi
trap - EXIT
rm -f "$gcc_log"
echo "== (${SECONDS} s) the GCC 12 build passed"

echo "== (${SECONDS} s) host tests under AddressSanitizer + UBSan"
cmake --preset debug -DLOOM_BUILD_TRAINER=OFF -DLOOM_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build --preset debug --target loom_host_checks
ctest --preset debug -j2 -R '^((host|cli|capi)\.|sdk\.SdkKinds\.)'

echo "== (${SECONDS} s) plugin tests (transports, codecs, optimizers, curriculum, routers, quantizers) under AddressSanitizer + UBSan"
cmake --build --preset debug --target loom_plugin_checks
plugin_tests='^(comm\.|codec\.|Codecs\.|OnebitKernels\.|Ef8Kernels\.|optimizers\.|half\.|curriculum\.|data\.sampler\.|data\.index\.|routers\.|moe\.|quantizers\.)'
# Multi-rank tests (under mpirun, .npN; under the env launcher, .envN; no_join): OpenMPI and
# UCX leak at exit in their own code, and LeakSanitizer's stop-the-world tracer has crashed
# (signal 11) in a 3-rank UCX process at exit under load, so leak checking is off for those
# (every other sanitizer check stays on).
ctest --preset debug -j2 -R "$plugin_tests" -E '[Cc]uda|\.np[0-9]|\.env[0-9]|no_join|nccl'
ASAN_OPTIONS=detect_leaks=0 ctest --preset debug -j2 -E '[Cc]uda|nccl' \
  -R '^(comm|codec|optimizers|moe)\..*(\.np[0-9]|\.env[0-9]|no_join)'

echo "== (${SECONDS} s) GPU tests under CUDA emulation (CPU)"
# The CUDA code built as C++ against an emulated CUDA runtime (tests/cuda_emulation, see
# docs/gpu.md "Without a GPU"), with AddressSanitizer + UBSan: a verification of the host
# logic, stream ordering, index math and pointer use, not of GPU behaviour. The test preset
# sets EMU_CUDA_DEVICES=2 and EMU_CUDA_ABORT=1 (an emulator report fails the test); leak
# checking stays on. A CUDA test that skips ("no CUDA device") fails this pass.
cmake --preset cuda-emulation >/dev/null
cmake --build --preset cuda-emulation --target loom_cuda_emulation_checks
emulation_log=$(mktemp)
trap 'rm -f "$emulation_log"' EXIT
ctest --preset cuda-emulation -j2 -R '[Cc]uda' | tee "$emulation_log"
# ctest's own marks of a skipped test ("***Skipped" on its line, "(Skipped)" in the summary),
# not a test whose name contains the word.
if grep -qE '\*\*\*Skipped|\(Skipped\)' "$emulation_log"; then
  echo "CUDA emulation: tests were skipped (no emulated device?)" >&2
  exit 1
fi
echo "== (${SECONDS} s) done"
