#!/usr/bin/env bash
# Style and static checks over the project's own sources:
#   clang-format (every C/C++/CUDA file git tracks) and clang-tidy (the host and the CLI,
#   using the compile database of BUILD_DIR). Usage: scripts/lint.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/release}

mapfile -t sources < <(git ls-files '*.c' '*.cc' '*.cpp' '*.h' '*.hpp' '*.cu' '*.cuh')
echo "lint: clang-format on ${#sources[@]} files"
clang-format --dry-run --Werror "${sources[@]}"

# Portable binaries: SIMD only through Highway's run-time dispatch, never compile-time ISA
# choices (a target_clones body or -march flag can put AVX-512 into code an AVX2 CPU runs).
if git grep -nE 'target_clones|-march=|-mavx|-mfma|-mtune=native' -- \
    '*.c' '*.cpp' '*.hpp' '*.h' '*.cu' '*.cmake' '*CMakeLists.txt' ':!scripts/lint.sh'; then
  echo "lint: compile-time instruction-set choices found (use Highway dispatch)" >&2
  exit 1
fi

if [[ ! -f $build/compile_commands.json ]]; then
  echo "lint: $build/compile_commands.json is missing; configure first" >&2
  exit 1
fi
mapfile -t tidy < <(git ls-files 'host/*.cpp')
echo "lint: clang-tidy on ${#tidy[@]} files"
# clang-tidy checks a file once per compile command the database has for it, and some host
# sources are compiled again into test programs (the bootstrap peer, the manifest fuzzer):
# a copy of the database with each file's first command (its own target's, CMake lists
# those first) checks every file exactly once.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 - "$build/compile_commands.json" "$work/compile_commands.json" <<'PY'
import json, sys
seen, out = set(), []
for entry in json.load(open(sys.argv[1])):
    if entry["file"] not in seen:
        seen.add(entry["file"])
        out.append(entry)
json.dump(out, open(sys.argv[2], "w"))
PY
printf '%s\n' "${tidy[@]}" | xargs -P "$(nproc)" -n 1 clang-tidy -p "$work" --quiet 2>&1 |
  grep -v "warnings generated" | tee "$work/tidy.log" || true
if grep -qE "(warning|error):" "$work/tidy.log"; then
  echo "lint: clang-tidy found problems" >&2
  exit 1
fi
echo "lint: ok"
