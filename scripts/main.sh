#!/usr/bin/env bash
# The main job: builds and installs Loom, builds the SDK's template plugin out of tree
# against the installed package, then lists the plugins and checks the example manifest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh release
prefix=$PWD/build/prefix
cmake --install build/release --prefix "$prefix" >/dev/null
cmake -S sdk/template -B build/template -G Ninja -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build build/template >/dev/null
echo "== loom --version"
"$prefix/bin/loom" --version
echo "== loom plugins --plugin-path build/template"
"$prefix/bin/loom" plugins --plugin-path build/template
echo "== loom check examples/sgd.toml"
"$prefix/bin/loom" check examples/sgd.toml
