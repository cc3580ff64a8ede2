#!/usr/bin/env bash
# Builds Loom with CUDA and assembles build/gpu-bundle: everything the GPU machine needs to run
# the GPU tests and benchmarks with scripts/gpu-check.sh (docs/gpu.md), as one folder to carry.
#
#   scripts/gpu-bundle.sh [BUILD_DIR]      # default build/release (the release preset's settings)
#
# Layout (no symbolic links; the binaries find libloom through RUNPATH $ORIGIN/../lib, and
# libloom finds its plugins in lib/loom/plugins beside itself):
#   bin/      loom, loom-bench-codec, loom-bench-optim, loom-bench-router, loom-bench-quant, the GPU tests (codec_cuda_test,
#             loom_optimizer_cuda_tests, loom_nccl_tests and any other *cuda* test program)
#   lib/      libloom.so.0, lib/loom/plugins/*.so
#   deps/     what `ldd` lists for those files, less the C/C++ runtime and libnccl (the GPU
#             machine's own; NCCL comes from its PyTorch environment); deps/ucx: UCX's modules
#   anchors/  bench/peers/gpu_peers.py, common.py, router_peers.py, moe_peers.py: the peers' figures (torch,
#             DeepSpeed's path)
#   python/   the loom Python package (python/loom) and its CUDA tests (python/tests)
#   BUNDLE.txt  what was built from what
# Then checks that every file resolves its libraries inside the bundle (or from the allowed
# system set) and prints the bundle's size.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
build=${1:-build/release}
bundle=$root/build/gpu-bundle
umask 022

echo "== configure $build (release settings, LOOM_CUDA=ON)"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_COMPILER=clang \
  -DCMAKE_CXX_COMPILER=clang++ -DLOOM_CUDA=ON >"$build.configure.log" 2>&1 ||
  { cat "$build.configure.log"; exit 1; }
grep -q "Loom: CUDA ON" "$build.configure.log" || {
  echo "gpu-bundle: CUDA was not enabled in $build" >&2
  exit 1
}

# The GPU tests: these three, and any other test program with "cuda" in its name (left out,
# with a warning, when it does not build).
bins=(loom loom-bench-codec loom-bench-optim loom-bench-router loom-bench-moe loom-bench-quant codec_cuda_test loom_optimizer_cuda_tests
  loom_nccl_tests loom_thread_comm_tests)
echo "== build ${bins[*]}"
ninja -C "$build" "${bins[@]/#/bin/}"
mapfile -t extra < <(ninja -C "$build" -t targets all |
  sed -n 's|^bin/\([^:/]*cuda[^:/]*\): .*|\1|p' | sort -u)
for t in "${extra[@]}"; do
  [[ " ${bins[*]} " == *" $t "* ]] && continue
  if ninja -C "$build" "bin/$t" >"$build/gpu-bundle-$t.log" 2>&1; then
    bins+=("$t")
  else
    echo "gpu-bundle: warning: $t does not build, left out (see $build/gpu-bundle-$t.log)" >&2
  fi
done
# Every bundled plugin (the targets above pull in only the ones they use).
mapfile -t plugins < <(ninja -C "$build" -t targets all |
  sed -n 's|^\(lib/loom/plugins/loom_[a-z0-9_]*\.so\): .*|\1|p' | sort -u)
ninja -C "$build" "${plugins[@]}" >/dev/null

echo "== assemble $bundle"
rm -rf "$bundle"
mkdir -p "$bundle"/{bin,lib/loom/plugins,deps/ucx,anchors,test-plugins}
for b in "${bins[@]}"; do
  install -m 755 "$build/bin/$b" "$bundle/bin/$b"
done
install -m 755 "$(readlink -f "$build/lib/libloom.so.0")" "$bundle/lib/libloom.so.0"
for p in "${plugins[@]}"; do
  install -m 755 "$build/$p" "$bundle/$p"
done
# The in-process multi-rank transport of the tests (one GPU, several ranks); tests look for
# it in ../test-plugins beside their program, as in the build tree.
ninja -C "$build" loom_test_plugin_thread_comm >/dev/null
install -m 755 "$build/test-plugins/loom_thread_comm.so" "$bundle/test-plugins/"

# What the machine provides itself: the C and C++ runtime, the loader, the CUDA driver and NCCL.
system_lib='^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|libpthread\.|librt\.|libgcc_s\.|libstdc\+\+\.|libnccl\.|libcuda\.|libnvidia-)'
mapfile -t elves < <(find "$bundle/bin" "$bundle/lib" "$bundle/test-plugins" -type f)
declare -A seen=()
for f in "${elves[@]}"; do
  while read -r name _ path _; do
    [[ $name =~ $system_lib || $name == libloom.so.0 || -n ${seen[$name]:-} ]] && continue
    if [[ ! -f $path ]]; then
      echo "gpu-bundle: $f needs $name, which ldd does not find here" >&2
      exit 1
    fi
    seen[$name]=1
    install -m 644 "$(readlink -f "$path")" "$bundle/deps/$name"
  done < <(ldd "$f" | awk '/=>/ {print $1, $2, $3, $4}')
done
# UCX loads its transports from a module folder (UCX_MODULE_DIR on the GPU machine).
for m in /usr/lib/x86_64-linux-gnu/ucx/*.so.0; do
  [[ -e $m ]] && install -m 644 "$(readlink -f "$m")" "$bundle/deps/ucx/$(basename "$m")"
done
shopt -s nullglob
for d in "$bundle"/deps/*.so*; do  # the libraries those deps need in turn
  while read -r name _ path _; do
    [[ $name =~ $system_lib || -n ${seen[$name]:-} || ! -f $path ]] && continue
    seen[$name]=1
    install -m 644 "$(readlink -f "$path")" "$bundle/deps/$name"
  done < <(ldd "$d" | awk '/=>/ {print $1, $2, $3, $4}')
done
shopt -u nullglob

for f in gpu_peers.py common.py router_peers.py moe_peers.py; do
  install -m 644 "$root/bench/peers/$f" "$bundle/anchors/$f"
done

# The Python package and its CUDA tests (gpu-check.sh's python_cuda step).
mkdir -p "$bundle/python/loom/_abi/kinds" "$bundle/python/tests"
install -m 644 "$root"/bindings/python/loom/*.py "$bundle/python/loom/"
install -m 644 "$root"/bindings/python/loom/_abi/*.py "$bundle/python/loom/_abi/"
install -m 644 "$root"/bindings/python/loom/_abi/kinds/*.py "$bundle/python/loom/_abi/kinds/"
install -m 644 "$root/tests/python/test_cuda.py" "$bundle/python/tests/"

{
  echo "Loom GPU bundle, built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n)"
  echo "source: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  if [[ -n $(git status --porcelain 2>/dev/null) ]]; then
    echo "working tree differs from that commit:"
    git status --porcelain | sed 's/^/  /'
  fi
  echo "build dir: $build"
  echo "nvcc: $(/usr/local/cuda/bin/nvcc --version | tail -1)"
  grep -E '^CMAKE_CUDA_ARCHITECTURES' "$build/CMakeCache.txt" || true
  echo "files:"
  (cd "$bundle" && find . -type f | sort | sed 's/^/  /')
} >"$bundle/BUNDLE.txt"

echo "== check: every file resolves its libraries inside the bundle (ldd, loom plugins)"
# UCX's modules are left out: UCX loads the ones whose libraries the machine has (the ib and
# rdmacm transports need its rdma-core) and skips the others; shared memory needs none.
bad=0
for f in "${elves[@]}" "$bundle"/deps/*.so*; do
  while read -r name path; do
    [[ $name =~ $system_lib ]] && continue
    case $path in
      "$bundle"/*) ;;
      *)
        echo "gpu-bundle: ${f#"$bundle"/}: $name resolves to ${path:-nothing}" >&2
        bad=1
        ;;
    esac
  done < <(env -i LD_LIBRARY_PATH="$bundle/deps" ldd "$f" | awk '/=>/ {print $1, $3}')
done
# At run time too: `loom plugins` loads every plugin; nothing may come from outside the bundle
# but the allowed system set.
while read -r path; do
  [[ $path == "$bundle"/* || $(basename "$path") =~ $system_lib ]] && continue
  echo "gpu-bundle: loom plugins loaded $path from outside the bundle" >&2
  bad=1
done < <(env -i LD_LIBRARY_PATH="$bundle/deps" LD_DEBUG=files "$bundle/bin/loom" plugins 2>&1 \
  >/dev/null | sed -n 's/.*calling init: //p' | sort -u)
((bad == 0)) || exit 1
if find "$bundle" -perm /022 | grep -q .; then
  echo "gpu-bundle: files writable by group or others (plugins would be refused)" >&2
  exit 1
fi
size=$(du -sb "$bundle" | cut -f1)
echo "gpu-bundle: $bundle: $(du -sh "$bundle" | cut -f1) ($size bytes, $(find "$bundle" -type f | wc -l) files)"
if ((size > 60 * 1024 * 1024)); then
  echo "gpu-bundle: the bundle is over 60 MiB (the carry limit is 64 MiB)" >&2
  exit 1
fi
