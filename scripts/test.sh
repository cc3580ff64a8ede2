#!/usr/bin/env bash
# Builds the release preset with its tests and runs the whole suite, then runs the host's
# own tests again under AddressSanitizer and UndefinedBehaviorSanitizer (debug preset).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh release
ctest --preset release -j2

echo "== host tests under AddressSanitizer + UBSan"
cmake --preset debug -DLOOM_BUILD_EXAMPLES=OFF -DLOOM_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build --preset debug --target loom_host_checks
ctest --preset debug -j2 -R '^(host|cli|capi)\.'
