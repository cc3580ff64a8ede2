#!/usr/bin/env bash
# The fresh-machine check: builds and runs Loom in a bare Debian 12 root with nothing but what
# scripts/install-deps.sh installs there, so a missing install step fails here whatever the
# machine running this happens to have. CI runs it first (.ci/run).
#
#   scripts/fresh-check.sh           install-deps, the configure step (every optional library's
#                                    CMake package is loaded there), and the pieces a missing or
#                                    different package changes: OpenBLAS's two builds through
#                                    loom/sdk/blas.hpp, the trainer's model tests, and two short
#                                    `loom train` runs at 1 and 2 threads that must end with the
#                                    same bytes
#   scripts/fresh-check.sh --full    scripts/test.sh in the root instead (about an hour on 2 cores)
#
# Needs root (mmdebstrap, chroot, bind mounts). The bare root is made once with mmdebstrap and
# kept as a tarball in $LOOM_FRESH_CACHE (default /var/cache/loom-fresh), with the root's
# downloaded packages and compiler cache: each run unpacks a new root from it, so nothing of an
# earlier run's installs survives, only downloads and compiled objects.
set -euo pipefail
cd "$(dirname "$0")/.."
src=$PWD
mode=subset
case "${1:-}" in
  "") ;;
  --full) mode=full ;;
  *) echo "usage: scripts/fresh-check.sh [--full]" >&2; exit 2 ;;
esac
if [[ $(id -u) -ne 0 ]]; then
  echo "fresh-check: run as root (it makes a Debian root with mmdebstrap and chroots into it)" >&2
  exit 1
fi
start=$SECONDS
say() { echo "== fresh-check ($((SECONDS - start)) s): $*"; }

if ! command -v mmdebstrap >/dev/null; then
  say "installing mmdebstrap"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null
fi

cache=${LOOM_FRESH_CACHE:-/var/cache/loom-fresh}
mkdir -p "$cache/archives" "$cache/ccache"
base=$cache/bookworm-apt.tar
# The package registry may serve a snapshot whose Release files are past their Valid-Until.
aptopt='Acquire::Check-Valid-Until "false";'
if [[ ! -s $base ]]; then
  say "making a bare Debian 12 root (mmdebstrap --variant=apt bookworm)"
  mmdebstrap --quiet --variant=apt --format=tar --aptopt="$aptopt" bookworm "$base.part"
  mv "$base.part" "$base"
fi

root=$(mktemp -d /var/tmp/loom-fresh.XXXXXX)
mounted=()
cleanup() {
  local i
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do
    umount -l "${mounted[i]}" 2>/dev/null || true
  done
  rm -rf --one-file-system "$root"
}
trap cleanup EXIT
bind() {  # bind HOST_PATH ROOT_PATH
  mkdir -p "$root$2"
  mount --bind "$1" "$root$2"
  mounted+=("$root$2")
}

say "unpacking the root in $root"
tar -C "$root" -xf "$base"
# mmdebstrap leaves no /etc/hosts; without one, localhost does not resolve (torchrun, UCX).
printf '127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n' >"$root/etc/hosts"
cp /etc/resolv.conf "$root/etc/resolv.conf"
# The work tree as it is (tracked and untracked files git does not ignore), not the build.
mkdir -p "$root/src"
git ls-files -z --cached --others --exclude-standard |
  tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -C "$root/src" -xf -
bind /proc /proc
bind /sys /sys
bind /dev /dev
bind /dev/pts /dev/pts
bind "$cache/archives" /var/cache/apt/archives
bind "$cache/ccache" /root/.cache/ccache

if [[ $mode == full ]]; then
  job='./scripts/test.sh'
else
  job=$(cat <<'JOB'
./scripts/install-deps.sh
echo "== configure (no CUDA in the root)"
cmake --preset release -DLOOM_BUILD_BENCHMARKS=OFF >/dev/null
echo "== build"
cmake --build --preset release --target loom-train loom-data loom_trainer_model_tests \
  loom_sdk_blas_pthread_tests loom_sdk_blas_serial_tests
bin=build/release/bin
echo "== OpenBLAS: both builds through loom/sdk/blas.hpp"
"$bin/loom_sdk_blas_pthread_tests" --gtest_brief=1
"$bin/loom_sdk_blas_serial_tests" --gtest_brief=1
echo "== the trainer's model tests"
LOOM_NUM_THREADS=2 "$bin/loom_trainer_model_tests" --gtest_brief=1
echo "== loom train at 1 and 2 threads: the same bytes"
mkdir -p build/data
"$bin/loom-data" prepare --input /usr/share/games/fortunes --output build/data/fortunes.bin
for t in 1 2; do
  LOOM_NUM_THREADS=$t "$bin/loom-train" examples/train_adam.toml --fresh --steps 30 --no-plot \
    --run-dir "build/runs/fresh_t$t" >"build/runs-fresh_t$t.log"
  tail -n 3 "build/runs-fresh_t$t.log"
done
digest() { (cd "$1/checkpoints" && find . -name '*.safetensors' -type f | sort | xargs -r sha256sum); }
[ -n "$(digest build/runs/fresh_t1)" ] || { echo "no checkpoint was written" >&2; exit 1; }
if [ "$(digest build/runs/fresh_t1)" != "$(digest build/runs/fresh_t2)" ]; then
  echo "loom train: 1 and 2 threads wrote different checkpoints" >&2
  diff <(digest build/runs/fresh_t1) <(digest build/runs/fresh_t2) >&2 || true
  exit 1
fi
echo "identical checkpoints: $(digest build/runs/fresh_t1 | wc -l) files"
JOB
)
fi
say "running in the root: ${mode}"
chroot "$root" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM=dumb \
  PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  bash -euo pipefail -c "cd /src && $job"
say "passed"
