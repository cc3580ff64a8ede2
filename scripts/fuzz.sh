#!/usr/bin/env bash
# The fuzzing campaign (docs/fuzzing.md): builds the libFuzzer targets (release preset, clang,
# AddressSanitizer + UBSan) and runs each reader of outside data for a number of executions,
# one process per target, one target after the other, each on a fresh copy of its committed
# seed corpus under build/release/fuzz/NAME/. Prints per target the executions, wall seconds,
# executions per second, corpus size and the result; exits 1 when any target crashed.
#
#   scripts/fuzz.sh                       # every target, 10,000,000 executions each
#   scripts/fuzz.sh --runs 100000         # a short pass
#   scripts/fuzz.sh --only config,dataset --max-time 60
#
# Options:
#   --runs N        executions per target (default 10000000; the seeds count among them)
#   --max-time S    also stop a target after S seconds (default: no limit)
#   --only A,B      only these targets (names as listed by --list)
#   --resume        keep the corpus of an earlier run instead of starting from the seeds
#   --no-build      use the fuzz programs already built
#   --list          print the target names and exit
# LOOM_BUILD_LOCK=FILE builds under `flock FILE` (for machines where builds share a lock).
set -euo pipefail
cd "$(dirname "$0")/.."

# name:seed folder (relative to the repository; "-" for a target that writes its own seeds).
targets=(
  manifest:tests/fuzz/corpus
  safetensors:tests/fuzz/safetensors_corpus
  index:-
  config:tests/fuzz/config_corpus
  dataset:tests/fuzz/dataset_corpus
  optimizer_state:tests/fuzz/optimizer_state_corpus
  plugin_state:tests/fuzz/plugin_state_corpus
  checkpoint:tests/fuzz/checkpoint_corpus
)

runs=10000000
max_time=0
only=""
resume=0
build=1
usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --runs) runs=${2:?--runs needs a number}; shift 2 ;;
    --max-time) max_time=${2:?--max-time needs seconds}; shift 2 ;;
    --only) only=${2:?--only needs target names}; shift 2 ;;
    --resume) resume=1; shift ;;
    --no-build) build=0; shift ;;
    --list) for t in "${targets[@]}"; do echo "${t%%:*}"; done; exit 0 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "fuzz.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ $runs =~ ^[0-9]+$ && $runs -gt 0 ]] || { echo "fuzz.sh: --runs must be a positive integer" >&2; exit 2; }
[[ $max_time =~ ^[0-9]+$ ]] || { echo "fuzz.sh: --max-time must be whole seconds" >&2; exit 2; }

selected=()
for t in "${targets[@]}"; do
  name=${t%%:*}
  if [[ -z $only || ",$only," == *",$name,"* ]]; then selected+=("$t"); fi
done
if [[ -n $only ]]; then
  for want in ${only//,/ }; do
    found=0
    for t in "${selected[@]}"; do [[ ${t%%:*} == "$want" ]] && found=1; done
    if [[ $found == 0 ]]; then
      echo "fuzz.sh: no target '$want' (see --list)" >&2
      exit 2
    fi
  done
fi

bin=build/release/bin
if [[ $build == 1 ]]; then
  [[ -f build/release/build.ninja ]] || cmake --preset release >/dev/null
  names=()
  for t in "${selected[@]}"; do names+=("${t%%:*}_fuzz"); done
  lock=()
  [[ -n ${LOOM_BUILD_LOCK:-} ]] && lock=(flock "$LOOM_BUILD_LOCK")
  "${lock[@]}" cmake --build --preset release --target "${names[@]}"
fi

summary=()
failed=0
for t in "${selected[@]}"; do
  name=${t%%:*}
  seeds=${t#*:}
  prog=$bin/${name}_fuzz
  if [[ ! -x $prog ]]; then
    echo "fuzz.sh: $prog is not built (clang only; the trainer's targets need LOOM_BUILD_TRAINER=ON)" >&2
    exit 1
  fi
  work=build/release/fuzz/$name
  if [[ $resume == 0 ]]; then rm -rf "$work"; fi
  mkdir -p "$work/corpus" "$work/artifacts"
  rm -f "$work"/artifacts/*
  if [[ $resume == 0 && $seeds != - ]]; then cp "$seeds"/* "$work/corpus/"; fi
  echo "== $name: $runs executions$([[ $max_time != 0 ]] && echo " or $max_time s") (log: $work/fuzz.log)"
  start=$(date +%s.%N)
  set +e
  "$prog" -runs="$runs" -max_total_time="$max_time" -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="$work/artifacts/" "$work/corpus" >"$work/fuzz.log" 2>&1
  rc=$?
  set -e
  end=$(date +%s.%N)
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/fuzz.log" | tail -1)
  execs=${execs:-0}
  wall=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }')
  rate=$(awk -v n="$execs" -v s="$wall" 'BEGIN { printf "%.0f", (s > 0 ? n / s : 0) }')
  corpus=$(find "$work/corpus" -type f | wc -l)
  artifact=$(sed -n 's/.*Test unit written to //p' "$work/fuzz.log" | tail -1)
  if [[ $rc == 0 ]]; then
    result=clean
  elif [[ -n $artifact ]]; then
    result="crash: $artifact"
    failed=1
  else
    result="error (exit $rc, see $work/fuzz.log)"
    failed=1
  fi
  line=$(printf '%-16s %12s %9s %9s %7s  %s' "$name" "$execs" "$wall" "$rate" "$corpus" "$result")
  echo "$line"
  summary+=("$line")
done

echo
printf '%-16s %12s %9s %9s %7s  %s\n' target executions "wall s" "exec/s" corpus result
for line in "${summary[@]}"; do echo "$line"; done
exit $failed
