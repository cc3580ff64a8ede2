#!/usr/bin/env bash
# `loom data analyze` on 1 and on 2 ranks (mpirun, the ucx comm) over the same dataset:
# prints each run's score-pass time, samples/s and wall time, the 2-rank speed-up, and
# checks that both runs wrote byte-identical index files.
#
#   bench/data/analyze-scaling.sh                       # synthetic 32M tokens, build/release
#   DATASET=data.bin SEQ_LEN=2048 METRICS="seqlen vocabulary_rarity" bench/data/analyze-scaling.sh
#
# mpirun's default placement applies: OpenMPI binds each of at most 2 ranks to one core, so
# 1 rank runs on one core and 2 ranks on two (each rank's threads are the cores it may use):
# the speed-up is that of adding a rank with its core. MPIRUN_ARGS="--bind-to none" lets every
# rank see every core instead (then 2 ranks share what 1 rank had).
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
  mpirun --allow-run-as-root ${MPIRUN_ARGS:-} -np $np "$BIN/loom-data" analyze "$WORK/analyze.toml" \
    --dataset "$DATASET" --seq-len "$SEQ_LEN" --output "$WORK/out$np" \
    ${PLUGIN_PATH:+--plugin-path "$PLUGIN_PATH"} >/dev/null 2>"$WORK/log$np"
  end=$(date +%s.%N)
  # One pass scores every metric, so the pass times are the same in each summary.
  first=${METRICS%% *}
  jq -c --arg wall "$(printf '%.3f' "$(echo "$end - $start" | bc)")" '{ranks: .run.ranks, threads_per_rank:
      .run.threads_per_rank, samples, wall_s: ($wall | tonumber), count_s: (.run.count.seconds
      // 0), score_s: .run.score.seconds, score_samples_per_s: .run.score.samples_per_s}' \
    "$WORK/out$np/$first.summary.json"
done
for m in $METRICS; do
  for f in sample_to_metric sorted percentiles; do
    cmp "$WORK/out1/$m.$f.idx" "$WORK/out2/$m.$f.idx"
  done
done
first=${METRICS%% *}
s1=$(jq '.run.score.seconds + (.run.count.seconds // 0)' "$WORK/out1/$first.summary.json")
s2=$(jq '.run.score.seconds + (.run.count.seconds // 0)' "$WORK/out2/$first.summary.json")
echo "map_speedup_1_to_2=$(printf '%.3f' "$(echo "scale=4; $s1 / $s2" | bc)") identical_files=yes"
