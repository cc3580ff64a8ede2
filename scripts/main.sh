#!/usr/bin/env bash
# The main job: builds and installs Loom, builds the SDK's template plugin out of tree
# against the installed package, lists the plugins and checks the example manifest, then
# trains the reference trainer's example on 2 ranks with 1-bit Adam (docs/trainer.md).
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
echo "== loom data prepare (the fortunes corpus, byte-level)"
data=build/data/fortunes.bin
if ! "$prefix/bin/loom" data info "$data" >/dev/null 2>&1; then
  mkdir -p "$(dirname "$data")"
  "$prefix/bin/loom" data prepare --input /usr/share/games/fortunes --output "$data"
fi
echo "== loom train examples/train_onebit_adam.toml (2 ranks, 1-bit Adam; one to two minutes)"
# --resume: a run killed part-way continues from its last checkpoint (a new run starts
# fresh). As root in a container, OpenMPI needs --allow-run-as-root.
UCX_LOG_LEVEL=${UCX_LOG_LEVEL:-error} mpirun --oversubscribe --allow-run-as-root -np 2 \
  "$prefix/bin/loom" train examples/train_onebit_adam.toml --run-dir build/runs/main --resume
