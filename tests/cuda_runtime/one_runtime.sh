#!/bin/sh
# Every shared object the build ships that carries device code links the shared CUDA
# runtime: a copy of cudart_static inside a plugin would give that plugin its own device
# state (contexts, streams, error codes) apart from libloom's and the other plugins'.
# Usage: one_runtime.sh LIB_DIR PLUGIN_DIR
set -eu
lib_dir=$1
plugin_dir=$2
checked=0
bad=0
for so in "$lib_dir"/libloom.so "$plugin_dir"/*.so; do
  [ -e "$so" ] || continue
  if readelf -S -W "$so" | grep -q '\.nv_fatbin'; then
    checked=$((checked + 1))
    if ! readelf -d -W "$so" | grep -q 'NEEDED.*libcudart\.so'; then
      echo "one_runtime: $so has device code but does not link the shared libcudart" >&2
      bad=1
    fi
  fi
done
if [ "$checked" -eq 0 ]; then
  echo "one_runtime: no shared object with device code found in $lib_dir or $plugin_dir" >&2
  exit 1
fi
if [ "$bad" -ne 0 ]; then
  exit 1
fi
echo "one_runtime: $checked shared objects with device code, all on the shared libcudart"
