#!/bin/sh
# The SDK templates (sdk/template: an optimizer; sdk/template_codec: a codec;
# sdk/template_metric: a curriculum metric and schedule, two plugins) build out of tree
# against an installed Loom as a third party builds them: with g++ and with clang++, at -O3
# -Wall -Wextra -Werror. Each built plugin is then described with the installed `loom`, the
# template's own manifest is checked as its README says, the codec runs a
# compressed-allreduce round trip (loom-bench-codec, when it was built), and the metric and
# schedule run through their table (tests/docs/curriculum_check).
#
# Usage: sdk_templates.sh CMAKE BUILD_DIR SOURCE_DIR
set -eu

cmake=$1
build_dir=$2
source_dir=$3

tmp=$(mktemp -d "${TMPDIR:-/tmp}/loom-templates-XXXXXX")
trap 'rm -rf "$tmp"' EXIT INT TERM
umask 022  # the host refuses plugin folders that others can write to
unset LOOM_PLUGIN_PATH LOOM_LOG_LEVEL
export UCX_LOG_LEVEL="${UCX_LOG_LEVEL:-error}"

fail() {
  echo "sdk_templates: FAIL: $*" >&2
  exit 1
}

echo "== install into $tmp/prefix"
"$cmake" --install "$build_dir" --prefix "$tmp/prefix" >"$tmp/install.log" ||
  { cat "$tmp/install.log"; fail "cmake --install $build_dir"; }
loom=$tmp/prefix/bin/loom
[ -x "$loom" ] || fail "no installed loom at $loom"

flags="-O3 -Wall -Wextra -Werror"
for cxx in g++ clang++; do
  command -v "$cxx" >/dev/null || fail "$cxx is not installed (scripts/install-deps.sh)"
  # template folder, plugin names (comma-separated), kind they provide, the template's manifest
  for spec in "template sgd loom.optimizer/1 sgd.toml" \
              "template_codec scaled_sign loom.codec/1 scaled_sign.toml" \
              "template_metric distinct_tokens,cosine_schedule loom.curriculum/1 curriculum.toml"; do
    # shellcheck disable=SC2086  # word splitting is the point
    set -- $spec
    template=$1 names=$2 kind=$3 manifest=$4
    # A copy of the template, built into its own build/, as its README does it.
    work=$tmp/$cxx/$template
    mkdir -p "$tmp/$cxx"
    cp -r "$source_dir/sdk/$template" "$work"
    rm -rf "$work/build"
    echo "== $template with $cxx $flags"
    "$cmake" -S "$work" -B "$work/build" -G Ninja -DCMAKE_CXX_COMPILER="$cxx" \
      -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_PREFIX_PATH="$tmp/prefix" \
      -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF >"$work.configure.log" 2>&1 ||
      { cat "$work.configure.log"; fail "configuring $template with $cxx"; }
    grep -q "Loom_DIR:PATH=$tmp/prefix/" "$work/build/CMakeCache.txt" ||
      fail "$template found a Loom package outside the install prefix"
    "$cmake" --build "$work/build" -- -v >"$work.build.log" 2>&1 ||
      { cat "$work.build.log"; fail "building $template with $cxx at $flags"; }
    grep -q -- "-O3 -Wall -Wextra -Werror" "$work.build.log" ||
      fail "$template was not compiled with $flags"
    if grep -q "warning:" "$work.build.log"; then
      cat "$work.build.log"
      fail "$template with $cxx printed warnings"
    fi
    for name in $(echo "$names" | tr ',' ' '); do
      [ -f "$work/build/loom_$name.so" ] || fail "no loom_$name.so from $template with $cxx"
      "$loom" describe "$name" --plugin-path "$work/build" >"$work.describe" 2>&1 ||
        { cat "$work.describe"; fail "loom describe $name ($cxx)"; }
      grep -q "^$name 1.0.0" "$work.describe" || fail "describe does not name $name ($cxx)"
      grep -q "^$kind" "$work.describe" || fail "$name does not provide $kind ($cxx)"
    done
    out=$("$loom" check "$work/$manifest" 2>&1) ||
      fail "loom check $template/$manifest ($cxx): $out"
    [ "$out" = "$work/$manifest: ok" ] || fail "unexpected loom check output: $out"
    if [ "$template" = template_metric ]; then
      # cosine_schedule's validate_params: max_difficulty below min_difficulty fails
      # `loom check` at the max_difficulty key (sdk/template_metric/README.md).
      sed 's/^max_difficulty = 100$/max_difficulty = 5/' "$work/$manifest" >"$work/bad.toml"
      line=$(grep -n '^max_difficulty = 5$' "$work/bad.toml" | cut -d: -f1)
      [ -n "$line" ] || fail "no 'max_difficulty = 100' line in $template/$manifest"
      if out=$("$loom" check "$work/bad.toml" 2>&1); then
        fail "loom check accepted max_difficulty below min_difficulty ($cxx)"
      fi
      [ "$out" = "$work/bad.toml:$line:1: parameter 'max_difficulty' of curriculum.cosine: max_difficulty must be >= min_difficulty" ] ||
        fail "unexpected error for max_difficulty below min_difficulty ($cxx): $out"
    fi
    if [ "$names" = sgd ]; then
      # The template's validate_params: nesterov without momentum fails `loom check` at the
      # nesterov key (sdk/template/README.md).
      sed 's/^momentum = 0.9$/momentum = 0.0/' "$work/$manifest" >"$work/nesterov.toml"
      line=$(grep -n '^nesterov = true$' "$work/nesterov.toml" | cut -d: -f1)
      [ -n "$line" ] || fail "no 'nesterov = true' line in $template/$manifest"
      if out=$("$loom" check "$work/nesterov.toml" 2>&1); then
        fail "loom check accepted nesterov with momentum 0 ($cxx)"
      fi
      [ "$out" = "$work/nesterov.toml:$line:1: parameter 'nesterov' of optimizer.main: nesterov needs momentum > 0 and dampening = 0" ] ||
        fail "unexpected error for nesterov with momentum 0 ($cxx): $out"
    fi
  done

  # docs/sdk.md's test program (its one ```c block), built with docs/embedding.md's CMake
  # project (its one ```cmake block, which links Loom::loom), opens the optimizer just built.
  case $cxx in g++) cc=gcc ;; *) cc=clang ;; esac
  embed=$tmp/$cxx/embed
  mkdir -p "$embed"
  block() { awk -v lang="$1" '$0 == "```" lang {on = 1; n++; next} /^```/ {on = 0} on && n == 1' "$2"; }
  block c "$source_dir/docs/sdk.md" >"$embed/main.c"
  block cmake "$source_dir/docs/embedding.md" >"$embed/CMakeLists.txt"
  grep -q loom_open_string "$embed/main.c" || fail "no \`\`\`c block with loom_open_string in docs/sdk.md"
  grep -q Loom::loom "$embed/CMakeLists.txt" || fail "no \`\`\`cmake block with Loom::loom in docs/embedding.md"
  echo "== docs/sdk.md's C test program with $cc, against Loom::loom"
  "$cmake" -S "$embed" -B "$embed/build" -G Ninja -DCMAKE_C_COMPILER="$cc" \
    -DCMAKE_C_FLAGS="-Wall -Wextra -Werror" -DCMAKE_PREFIX_PATH="$tmp/prefix" \
    -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF >"$embed.configure.log" 2>&1 ||
    { cat "$embed.configure.log"; fail "configuring docs/embedding.md's CMake project ($cc)"; }
  "$cmake" --build "$embed/build" >"$embed.build.log" 2>&1 ||
    { cat "$embed.build.log"; fail "building docs/sdk.md's C program ($cc)"; }
  # Run beside the template's build/ folder, which the program names as its plugin path.
  out=$(cd "$tmp/$cxx/template" && "$embed/build/my_trainer" 2>&1) ||
    fail "docs/sdk.md's C program ($cc): $out"
  [ "$out" = "0.9 1.9 2.9 3.9" ] ||
    fail "docs/sdk.md's C program printed '$out', the doc says 0.9 1.9 2.9 3.9"

  # The codec's contract (docs/sdk.md, "Writing a codec"), through its table.
  echo "== scaled_sign ($cxx) against the codec contract (tests/docs/codec_check)"
  check=$tmp/$cxx/codec_check
  "$cmake" -S "$source_dir/tests/docs/codec_check" -B "$check" -G Ninja -DCMAKE_C_COMPILER="$cc" \
    -DCMAKE_C_FLAGS="-Wall -Wextra -Werror" -DCMAKE_PREFIX_PATH="$tmp/prefix" \
    -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF >"$check.configure.log" 2>&1 ||
    { cat "$check.configure.log"; fail "configuring tests/docs/codec_check ($cc)"; }
  "$cmake" --build "$check" >"$check.build.log" 2>&1 ||
    { cat "$check.build.log"; fail "building tests/docs/codec_check ($cc)"; }
  "$check/codec_check" "$tmp/$cxx/template_codec/build" ||
    fail "the template codec built with $cxx breaks the codec contract"

  # The metric's and the schedule's behaviour (sdk/template_metric/README.md), through the
  # loom.curriculum/1 table as a trainer or the data analyzer reaches it.
  echo "== distinct_tokens and cosine_schedule ($cxx) through their table (tests/docs/curriculum_check)"
  ccheck=$tmp/$cxx/curriculum_check
  "$cmake" -S "$source_dir/tests/docs/curriculum_check" -B "$ccheck" -G Ninja \
    -DCMAKE_C_COMPILER="$cc" -DCMAKE_C_FLAGS="-Wall -Wextra -Werror" \
    -DCMAKE_PREFIX_PATH="$tmp/prefix" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF \
    >"$ccheck.configure.log" 2>&1 ||
    { cat "$ccheck.configure.log"; fail "configuring tests/docs/curriculum_check ($cc)"; }
  "$cmake" --build "$ccheck" >"$ccheck.build.log" 2>&1 ||
    { cat "$ccheck.build.log"; fail "building tests/docs/curriculum_check ($cc)"; }
  "$ccheck/curriculum_check" "$tmp/$cxx/template_metric/build" ||
    fail "the template metric or schedule built with $cxx does not do what its README says"

  bench=$tmp/prefix/bin/loom-bench-codec
  if [ -x "$bench" ]; then
    echo "== scaled_sign ($cxx) through the compressed allreduce (loom-bench-codec)"
    LOOM_PLUGIN_PATH=$tmp/$cxx/template_codec/build "$bench" --device cpu --sizes 64K \
      --iters 1 --codecs scaled_sign >"$tmp/bench.out" 2>&1 ||
      { cat "$tmp/bench.out"; fail "the compressed allreduce with scaled_sign ($cxx)"; }
    grep -q '"codec":"scaled_sign".*"op":"roundtrip"' "$tmp/bench.out" ||
      { cat "$tmp/bench.out"; fail "no scaled_sign round trip in loom-bench-codec's output"; }
  fi
done
echo "sdk_templates: ok"
