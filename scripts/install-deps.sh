#!/usr/bin/env bash
# Installs the Debian 12 packages Loom needs to build and test. Idempotent: it calls
# apt-get only when something is missing. Run as root.
set -euo pipefail

# Named one by one, not through a metapackage that accepts alternatives: libopenblas-dev would be
# satisfied by the serial build alone (cmake/LoomBlas.cmake needs the pthread and the serial one),
# and libdnnl-dev only recommends the OpenCL files its CMake package asks for.
packages=(
  build-essential cmake ninja-build pkg-config git ccache
  clang libclang-rt-14-dev clang-format clang-tidy
  libboost-dev libtomlplusplus-dev libspdlog-dev libfmt-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libdlpack-dev libcli11-dev nlohmann-json3-dev
  libucx-dev libopenmpi-dev openmpi-bin libhwy-dev
  libopenblas-pthread-dev libopenblas-serial-dev libdnnl-dev ocl-icd-opencl-dev
  iproute2 python3 qemu-user
  python3-pytest python3-numpy python3-torch python3-venv
  fortunes gnuplot-nox
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
  echo "install-deps: missing packages (${missing[*]}); run as root to install them" >&2
  exit 1
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
