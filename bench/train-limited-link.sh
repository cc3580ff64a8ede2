#!/usr/bin/env bash
# End to end on commodity-Ethernet links: `loom train` as 4 ranks over 1 Gbit/s shaped links
# (bench/limited-link.sh), a communication-bound model (12.8M parameters, 8 tokens per rank
# and step), once per gradient-communication setup:
#
#   adam_fp32            Adam, one blocking fp32 allreduce after the backward
#   adam_fp32_overlap    Adam, 25 MiB fp32 buckets started during the backward
#   adam_bf16            Adam, bf16 buckets after the backward
#   adam_bf16_overlap    Adam, bf16 buckets started during the backward
#   onebit_adam          1-bit Adam (fp32 warmup, then 1-bit momentum)
#   onebit_adam_noclip   1-bit Adam without gradient clipping (clip_grad_norm = 0), the
#                        unbucketed reference of the next two
#   onebit_adam_buckets  1-bit Adam in buckets of BUCKET_MB (default 4: a quarter of a block),
#                        exchanged after the backward
#   onebit_adam_overlap  the same buckets, each started during the backward as soon as its
#                        gradients are final ([gradients] overlap = true); both without
#                        gradient clipping (clip_grad_norm = 0: the overlap cannot clip)
#   onebit_adam_sharded  1-bit Adam with shard_state (ZeRO-1; an fp32 warmup), the
#                        parameters allgathered in fp32
#   onebit_adam_sharded_ef8  the same with the ef8 codec (8 bits) and the parameter change
#                        allgathered compressed (shard_gather = "compressed")
#   zero_one_adam        0/1 Adam (variance frozen, then growing local-step intervals)
#   onebit_lamb          1-bit LAMB
#   onebit_lamb_sharded  1-bit LAMB with shard_state (ZeRO-1, host memory)
#   zero_one_adam_buckets, zero_one_adam_overlap, onebit_lamb_buckets, onebit_lamb_overlap
#                        as onebit_adam_buckets and _overlap, for those two (0/1 Adam starts
#                        nothing early after its variance freeze: docs/optimizers.md)
#
#   sudo bench/train-limited-link.sh                    # all of them, 200 steps each
#   STEPS=100 RUNS="adam_bf16_overlap onebit_adam" sudo -E bench/train-limited-link.sh
#   WARMUP_WIRE=bf16 sudo -E bench/train-limited-link.sh   # the 1-bit warmups in bf16
#   BATCH=16 ...          # sequences of 8 tokens per step over the 4 ranks (default 4)
#   NP=2 ...              # 2 ranks (one a core on a 2-core machine) instead of 4
#
# Prints one JSON line per run, then a table: tokens/s over the whole run, wall time, the share
# of step time spent waiting on the network, the final eval loss, the wall time until the
# eval loss first reaches TARGET (default: adam_fp32's final eval loss plus 2%, or the first
# run's when adam_fp32 is not among RUNS), and rank 0's optimizer state and peak resident set
# (MiB). Needs root, build/release (loom-train and the
# plugins) and build/data/fortunes.bin (docs/data.md).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD:-build/release}
STEPS=${STEPS:-200}
BATCH=${BATCH:-4}           # sequences of 8 tokens per step over the 4 ranks
RUNS=${RUNS:-adam_fp32 adam_fp32_overlap adam_bf16 adam_bf16_overlap onebit_adam zero_one_adam onebit_lamb}
DATA=${DATA:-$ROOT/build/data/fortunes.bin}
TRAIN=$ROOT/$BUILD/bin/loom-train
FREEZE=$((STEPS * 15 / 100)) # the 1-bit family's full-precision warmup: 15% of the run
WARMUP_WIRE=${WARMUP_WIRE:-fp32} # the 1-bit family's warmup allreduces on the wire: fp32 or bf16
BUCKET_MB=${BUCKET_MB:-4}        # the *_buckets and *_overlap runs: MiB of fp32 a bucket

[[ $EUID -eq 0 ]] || { echo "train-limited-link.sh: needs root (network namespaces and tc)" >&2; exit 1; }
[[ -x $TRAIN ]] || { echo "train-limited-link.sh: $TRAIN not found; build the release preset" >&2; exit 1; }
[[ -f $DATA ]] || { echo "train-limited-link.sh: $DATA not found; see docs/data.md" >&2; exit 1; }

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
chmod 755 "$WORK"

manifest() { # NAME OPTIMIZER-SECTION
  cat >"$WORK/$1.manifest.toml" <<EOF
[loom]
abi = 1
log_level = "warn"
[comm.world]
plugin = "ucx"
[codec.onebit]
plugin = "onebit"
[codec.ef8]
plugin = "ef8"
[optimizer.main]
$2
EOF
}
config() { # NAME [GRADIENTS-SECTION] [MORE-TRAIN-KEYS]
  cat >"$WORK/$1.toml" <<EOF
[manifest]
path = "$1.manifest.toml"
[model]
context = 64
layers = 4
heads = 8
dim = 512
[data]
dataset = "$DATA"
${2:-}
[train]
steps = $STEPS
batch_size = $BATCH
seq_len = 8
lr = 1e-3
min_lr = 1e-4
warmup_steps = 10
eval_interval = 20
eval_batches = 8
log_interval = 20
checkpoint_interval = 0
plot = "none"
run_dir = "$WORK/runs/$1"
${3:-}
EOF
}

adam='plugin = "adam"
weight_decay = 0.01'
onebit() { # NAME PLUGIN CODEC PARAMETERS [GRADIENTS-SECTION] [MORE-TRAIN-KEYS]: a 1-bit
  # family run (it owns its communication)
  manifest "$1" "plugin = \"$2\"
comm = \"world\"
codec = \"$3\"
weight_decay = 0.01
$4"
  config "$1" "${5:-}" "${6:-}"
}
phases() { # PLUGIN: its warmup and schedule in these runs
  case $1 in
    onebit_adam | onebit_lamb) printf 'warmup_wire = "%s"\nfreeze_step = %s' "$WARMUP_WIRE" "$FREEZE" ;;
    zero_one_adam) printf 'warmup_wire = "%s"\nvar_freeze_step = %s\nvar_update_scaler = 4\nlocal_step_scaler = %s\nlocal_step_clipper = 4' \
      "$WARMUP_WIRE" "$FREEZE" "$FREEZE" ;;
  esac
}
for run in $RUNS; do
  case $run in
    adam_fp32) manifest "$run" "$adam"; config "$run" ;;
    adam_fp32_overlap) manifest "$run" "$adam"
      config "$run" $'[gradients]\nwire = "fp32"\noverlap = true' ;;
    adam_bf16) manifest "$run" "$adam"; config "$run" $'[gradients]\nwire = "bf16"\noverlap = false' ;;
    adam_bf16_overlap) manifest "$run" "$adam"
      config "$run" $'[gradients]\nwire = "bf16"\noverlap = true' ;;
    onebit_adam | zero_one_adam | onebit_lamb) onebit "$run" "$run" onebit "$(phases "$run")" ;;
    onebit_adam_noclip) onebit "$run" onebit_adam onebit "$(phases onebit_adam)" "" \
      'clip_grad_norm = 0' ;;
    onebit_adam_buckets | onebit_adam_overlap | zero_one_adam_buckets | zero_one_adam_overlap | \
      onebit_lamb_buckets | onebit_lamb_overlap)
      overlap=false; [[ $run == *_overlap ]] && overlap=true
      plugin=${run%_*}
      onebit "$run" "$plugin" onebit "$(phases "$plugin")
bucket_mb = $BUCKET_MB" $'[gradients]\noverlap = '"$overlap" 'clip_grad_norm = 0' ;;
    onebit_adam_sharded) onebit "$run" onebit_adam onebit "shard_state = true
freeze_step = $FREEZE" ;;
    onebit_adam_sharded_ef8) onebit "$run" onebit_adam ef8 "shard_state = true
shard_gather = \"compressed\"
freeze_step = $FREEZE" ;;
    onebit_lamb_sharded) onebit "$run" onebit_lamb onebit "shard_state = true
freeze_step = $FREEZE" ;;
    *) echo "train-limited-link.sh: unknown run '$run'" >&2; exit 2 ;;
  esac
  echo "== $run ($STEPS steps)" >&2
  (cd "$WORK" && "$ROOT/bench/limited-link.sh" -- "$TRAIN" "$WORK/$run.toml" --fresh) \
    >"$WORK/$run.log" 2>&1 || { cat "$WORK/$run.log" >&2; exit 1; }
done

python3 - "$WORK" "${TARGET:-}" $RUNS <<'EOF'
import json, sys
work, target, runs = sys.argv[1], sys.argv[2], sys.argv[3:]
rows = {}
for run in runs:
    d = f"{work}/runs/{run}"
    summary = json.load(open(f"{d}/summary.json"))
    elapsed_at = {}  # step -> elapsed seconds at that step's log line (before its eval)
    window = []  # [step, tokens/s since the previous log line] (where the time goes)
    evals = []
    for line in open(f"{d}/metrics.jsonl"):
        j = json.loads(line)
        if j.get("type") == "train":
            elapsed_at[j["step"]] = j["elapsed_s"]
            window.append([j["step"], round(j["tokens_per_s"], 1)])
        elif j.get("type") == "eval":
            evals.append((j["step"], j["eval_loss"]))
    rows[run] = (summary, elapsed_at, evals, window)
if target:
    target = float(target)
else:
    base = "adam_fp32" if "adam_fp32" in rows else runs[0]
    target = rows[base][0]["final_eval_loss"] * 1.02
print(f"target eval loss {target:.4f}")
print(f"{'run':20} {'tok/s':>7} {'wall s':>7} {'wait':>5} {'eval':>7} {'to target s':>11} "
      f"{'state MiB':>9} {'RSS MiB':>7}")
for run in runs:
    s, elapsed_at, evals, window = rows[run]
    reach = next((elapsed_at.get(st) for st, loss in evals if loss <= target), None)
    out = {"run": run, "tokens_per_s": s["tokens"] / s["elapsed_s"], "elapsed_s": s["elapsed_s"],
           "comm_wait_share": s.get("comm_wait_share"), "final_eval_loss": s["final_eval_loss"],
           "seconds_to_target": reach, "target_eval_loss": target,
           "comm_bytes_sent": s.get("comm_bytes_sent"),
           "optimizer_state_bytes": s.get("optimizer_state_bytes"),
           "peak_rss_bytes": s.get("peak_rss_bytes"), "evals": evals,
           "tokens_per_s_by_window": window}
    print(json.dumps(out), file=sys.stderr)
    print(f"{run:20} {out['tokens_per_s']:7.1f} {s['elapsed_s']:7.1f} "
          f"{(s.get('comm_wait_share') or 0):5.2f} {s['final_eval_loss']:7.4f} "
          f"{reach if reach is None else round(reach, 1)!s:>11} "
          f"{(s.get('optimizer_state_bytes') or 0) / 2**20:9.1f} "
          f"{(s.get('peak_rss_bytes') or 0) / 2**20:7.1f}")
EOF
