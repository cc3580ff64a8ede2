#!/usr/bin/env bash
# `loom data analyze` on 1 and on 2 ranks (mpirun, the ucx comm) over the same dataset:
# prints each run's score-pass time, samples/s and wall time, the 2-rank speed-up, and
# checks that both runs wrote byte-identical index files.
#
#   bench/data/analyze-scaling.sh                       # synthetic 32M tokens, build/release
#   DATASET=data.bin SEQ_LEN=2048 METRICS="seqlen vocabulary_rarity" bench/data/analyze-scaling.sh
#
# Each rank uses the cores mpirun gives it (loom_thread_count: the cores over the local
# ranks), so on one machine 2 ranks share the cores 1 rank had alone: the speed-up measures
# the sharding and the gather, not more hardware.
set -euo pipefail

BUILD=${BUILD:-build/release}
SEQ_LEN=${SEQ_LEN:-1024}
TOKENS=${TOKENS:-32M}
METRICS=${METRICS:-"seqlen vocabulary_rarity"}
PLUGIN_PATH=${PLUGIN_PATH:-}  # extra plugin folders for metrics that are not bundled
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN=$ROOT/$BUILD/bin
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

if [[ -z ${DATASET:-} ]]; then
  # A synthetic text corpus of about TOKENS bytes, byte-tokenized.
  python3 - "$WORK/corpus.txt" "$TOKENS" <<'PY'
import random, sys
n = sys.argv[2]
mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
size = int(float(n[:-1]) * mult[n[-1]]) if n[-1] in mult else int(n)
words = ["the", "of", "curriculum", "a", "token", "rare", "sample", "loom", "data", "x"]
rng = random.Random(1)
with open(sys.argv[1], "w") as f:
    out = 0
    while out < size:
        line = " ".join(rng.choice(words) for _ in range(rng.randint(1, 40))) + "\n"
        f.write(line)
        out += len(line)
PY
  "$BIN/loom-data" prepare --input "$WORK/corpus.txt" --output "$WORK/data.bin" >/dev/null
  DATASET=$WORK/data.bin
fi

{
  echo '[comm.world]'
  echo 'plugin = "ucx"'
  for m in $METRICS; do
    echo "[curriculum.$m]"
    echo "plugin = \"$m\""
  done
} >"$WORK/analyze.toml"

export UCX_LOG_LEVEL=error OMPI_MCA_rmaps_base_oversubscribe=1
for np in 1 2; do
  mkdir -p "$WORK/out$np"
  start=$(date +%s.%N)
  mpirun --allow-run-as-root -np $np "$BIN/loom-data" analyze "$WORK/analyze.toml" \
    --dataset "$DATASET" --seq-len "$SEQ_LEN" --output "$WORK/out$np" \
    ${PLUGIN_PATH:+--plugin-path "$PLUGIN_PATH"} >/dev/null 2>"$WORK/log$np"
  end=$(date +%s.%N)
  echo "ranks=$np wall_s=$(echo "$end - $start" | bc)"
  for m in $METRICS; do
    jq -c --arg np "$np" '{ranks: ($np | tonumber), metric, samples,
        score_s: .run.score.seconds, score_samples_per_s: .run.score.samples_per_s,
        count_s: (.run.count.seconds // 0)}' "$WORK/out$np/$m.summary.json"
  done
done
for m in $METRICS; do
  for f in sample_to_metric sorted percentiles; do
    cmp "$WORK/out1/$m.$f.idx" "$WORK/out2/$m.$f.idx"
  done
  s1=$(jq .run.score.seconds "$WORK/out1/$m.summary.json")
  s2=$(jq .run.score.seconds "$WORK/out2/$m.summary.json")
  echo "metric=$m score_speedup_1_to_2=$(echo "scale=3; $s1 / $s2" | bc) identical_files=yes"
done
