#!/usr/bin/env bash
# Builds the release preset with its tests and runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh release
ctest --preset release -j2
