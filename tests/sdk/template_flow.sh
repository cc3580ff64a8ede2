#!/bin/sh
# The plugin author's path, end to end: install Loom from this build tree, build
# sdk/template out of tree against the installed package only, then describe the plugin
# and check manifests that use it with the installed `loom`.
#
# Usage: template_flow.sh CMAKE BUILD_DIR SOURCE_DIR CXX_COMPILER
set -eu

cmake=$1
build_dir=$2
source_dir=$3
cxx=$4

tmp=$(mktemp -d "${TMPDIR:-/tmp}/loom-template-XXXXXX")
trap 'rm -rf "$tmp"' EXIT INT TERM
# Only the folders named here may hold plugins.
unset LOOM_PLUGIN_PATH LOOM_LOG_LEVEL

fail() {
  echo "template_flow: FAIL: $*" >&2
  exit 1
}

echo "== install into $tmp/prefix"
"$cmake" --install "$build_dir" --prefix "$tmp/prefix" >"$tmp/install.log" ||
  { cat "$tmp/install.log"; fail "cmake --install"; }
loom="$tmp/prefix/bin/loom"
[ -x "$loom" ] || fail "no installed loom at $loom"

echo "== configure and build sdk/template against the installed package"
# Nothing from the source or build tree: only the prefix.
"$cmake" -S "$source_dir/sdk/template" -B "$tmp/build" -G Ninja \
  -DCMAKE_PREFIX_PATH="$tmp/prefix" -DCMAKE_CXX_COMPILER="$cxx" \
  -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF >"$tmp/configure.log" 2>&1 ||
  { cat "$tmp/configure.log"; fail "configuring the template"; }
grep -q "Loom_DIR:PATH=$tmp/prefix/" "$tmp/build/CMakeCache.txt" ||
  fail "the template found a Loom package outside the install prefix"
"$cmake" --build "$tmp/build" >"$tmp/build.log" 2>&1 ||
  { cat "$tmp/build.log"; fail "building the template"; }
[ -f "$tmp/build/loom_sgd.so" ] || fail "no loom_sgd.so in $tmp/build"

echo "== loom describe sgd"
"$loom" describe sgd --plugin-path "$tmp/build" >"$tmp/describe.txt" 2>&1 ||
  { cat "$tmp/describe.txt"; fail "loom describe sgd"; }
cat "$tmp/describe.txt"
grep -q "^sgd " "$tmp/describe.txt" || fail "describe does not name the plugin"
grep -q "^loom.optimizer/1" "$tmp/describe.txt" || fail "describe does not list loom.optimizer/1"
for param in momentum dampening nesterov weight_decay; do
  grep -q "^  $param (" "$tmp/describe.txt" || fail "describe does not list $param"
done
grep -q "^  momentum (a number), default 0.0, range \[0.0, 1.0\]" "$tmp/describe.txt" ||
  fail "momentum's default or range is not what the template declares"
grep -q "^  nesterov (a boolean), default false" "$tmp/describe.txt" ||
  fail "nesterov's default is not what the template declares"

echo "== loom check (valid manifest)"
cat >"$tmp/sgd.toml" <<'TOML'
[loom]
abi = 1
plugin_path = ["build"]

[optimizer.main]
plugin = "sgd"
momentum = 0.9
dampening = 0.0
nesterov = true
weight_decay = 1e-4
TOML
out=$("$loom" check "$tmp/sgd.toml" 2>&1) || fail "loom check rejected a valid manifest: $out"
[ "$out" = "$tmp/sgd.toml: ok" ] || fail "unexpected loom check output: $out"

echo "== loom check (invalid manifest)"
cat >"$tmp/bad.toml" <<'TOML'
[loom]
abi = 1
plugin_path = ["build"]

[optimizer.main]
plugin = "sgd"
momentum = 1.5
nesterovv = true
TOML
set +e
"$loom" check "$tmp/bad.toml" >"$tmp/bad.out" 2>"$tmp/bad.err"
rc=$?
set -e
cat "$tmp/bad.err"
[ "$rc" -eq 2 ] || fail "loom check exited $rc on an invalid manifest, expected 2"
grep -q "^$tmp/bad.toml:7:12: parameter 'momentum' of optimizer.main = 1.5 is out of range \[0, 1\]$" \
  "$tmp/bad.err" || fail "no out-of-range error at 7:12"
grep -q "^$tmp/bad.toml:8:1: unknown parameter 'nesterovv' for optimizer.main (plugin 'sgd') (did you mean 'nesterov'?)" \
  "$tmp/bad.err" || fail "no unknown-parameter error at 8:1"
[ "$(wc -l <"$tmp/bad.err")" -eq 2 ] || fail "expected exactly 2 errors"

echo "== loom check (nesterov without momentum: the template's validate_params)"
cat >"$tmp/nesterov.toml" <<'TOML'
[loom]
abi = 1
plugin_path = ["build"]

[optimizer.main]
plugin = "sgd"
dampening = 0.0
nesterov = true
TOML
set +e
"$loom" check "$tmp/nesterov.toml" >"$tmp/nesterov.out" 2>"$tmp/nesterov.err"
rc=$?
set -e
cat "$tmp/nesterov.err"
[ "$rc" -eq 2 ] || fail "loom check exited $rc on nesterov without momentum, expected 2"
grep -qx "$tmp/nesterov.toml:8:1: parameter 'nesterov' of optimizer.main: nesterov needs momentum > 0 and dampening = 0" \
  "$tmp/nesterov.err" || fail "no cross-parameter error at the nesterov key (8:1)"
[ "$(wc -l <"$tmp/nesterov.err")" -eq 1 ] || fail "expected exactly 1 error"

echo "template_flow: ok"
