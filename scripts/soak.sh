#!/usr/bin/env bash
# Soak test of checkpoint and resume (docs/soak.md): a multi-rank `loom train`
# run is SIGKILLed at random moments (one rank or every rank, mid-step, mid-checkpoint-write,
# before the first checkpoint) and resumed with `--resume` until it ends; its checkpoints and
# metrics must then equal, byte for byte, those of an uninterrupted run of the same config.
#
#   scripts/soak.sh [--minutes M] [--kills K] [--ranks N] [--seed S] [--launcher mpirun|env]
#                   [--steps N] [--bin DIR] [--work-dir DIR] [--keep]
#
#   --minutes M    training wall time of the uninterrupted run (default 30): the step count is
#                  chosen from a short calibration run so that the run takes about M minutes
#   --steps N      the step count itself (no calibration)
#   --kills K      SIGKILLs of the interrupted run, each followed by a resume (default 10)
#   --ranks N      ranks (default 2)
#   --seed S       the kill schedule's random seed (default 1): kinds, moments and delays as
#                  fractions of the time left are the same for a seed; where they land in
#                  the run also depends on the machine's speed
#   --launcher L   mpirun (default: mpirun --oversubscribe --allow-run-as-root) or env (a
#                  shell loop setting RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
#   --bin DIR      where loom and loom-data are (default build/release/bin)
#   --work-dir DIR the dataset, configs, both runs and every attempt's log (default: a new
#                  folder in $TMPDIR or /tmp, deleted after a pass unless --keep)
#
# Exit status 0 when every kill was followed by a resume and the final bytes match; 1 on a
# mismatch, a hang (a job still running comm timeout_s + 30 s after a kill, or past its time
# limit), an attempt that fails on its own, or a run that ends before all kills landed; 2 on
# a usage error. Every job the script starts runs in a session of its own, whose processes
# are killed on exit.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
repo=$PWD

minutes=30
kills=10
ranks=2
seed=1
launcher=mpirun
steps=0
bin=$repo/build/release/bin
work=""
keep=0
comm_timeout=20  # the manifest's [comm.world] timeout_s
usage() {
  sed -n '/^#   scripts\/soak.sh \[/,+1p' "$0" | sed 's/^# *//' >&2
  echo "see the header of scripts/soak.sh for the options" >&2
  exit 2
}
need() { [[ $# -ge 2 && -n $2 ]] || { echo "soak: $1 needs a value" >&2; usage; }; }
while [[ $# -gt 0 ]]; do
  case $1 in
    --minutes) need "$@"; minutes=$2; shift 2 ;;
    --kills) need "$@"; kills=$2; shift 2 ;;
    --ranks) need "$@"; ranks=$2; shift 2 ;;
    --seed) need "$@"; seed=$2; shift 2 ;;
    --launcher) need "$@"; launcher=$2; shift 2 ;;
    --steps) need "$@"; steps=$2; shift 2 ;;
    --bin) need "$@"; bin=$(cd "$2" && pwd) || exit 2; shift 2 ;;
    --work-dir) need "$@"; work=$2; shift 2 ;;
    --keep) keep=1; shift ;;
    -h | --help) sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "soak: unknown option $1" >&2; usage ;;
  esac
done
is_num() { [[ $1 =~ ^[0-9]+([.][0-9]+)?$ ]]; }
is_int() { [[ $1 =~ ^[0-9]+$ ]]; }
is_num "$minutes" || { echo "soak: --minutes $minutes is not a number" >&2; exit 2; }
is_int "$kills" || { echo "soak: --kills $kills is not a count" >&2; exit 2; }
is_int "$steps" || { echo "soak: --steps $steps is not a count" >&2; exit 2; }
is_int "$seed" || { echo "soak: --seed $seed is not a number" >&2; exit 2; }
{ is_int "$ranks" && ((ranks >= 2 && ranks <= 64)); } || { echo "soak: --ranks is 2 to 64" >&2; exit 2; }
[[ $launcher == mpirun || $launcher == env ]] ||
  { echo "soak: --launcher is mpirun or env, not $launcher" >&2; exit 2; }
for p in loom loom-data; do
  [[ -x $bin/$p ]] || { echo "soak: $bin/$p not found (build it, or pass --bin DIR)" >&2; exit 2; }
done
if [[ $launcher == mpirun ]] && ! command -v mpirun >/dev/null; then
  echo "soak: mpirun not found" >&2
  exit 2
fi
command -v python3 >/dev/null || { echo "soak: python3 not found (it compares the runs)" >&2; exit 2; }

if [[ -z $work ]]; then
  work=$(mktemp -d "${TMPDIR:-/tmp}/loom-soak.XXXXXX")
else
  mkdir -p "$work" && work=$(cd "$work" && pwd)
fi
mkdir -p "$work/logs"
t0=$EPOCHREALTIME
say() { printf '== soak (%5.0f s): %s\n' "$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN{print b-a}')" "$*"; }
fail() { echo "soak: FAILED: $*" >&2; result="FAILED: $*"; }
result=""

# ---- processes: every job in a session of its own (mpirun moves its ranks into process
# groups of their own, but not out of the session), all killed on exit

declare -A sessions=()  # session id -> 1 while the job may be running
session_pids() { pgrep -s "$1" 2>/dev/null; }
kill_session() {
  local p
  for p in $(session_pids "$1"); do kill -KILL "$p" 2>/dev/null; done
}
cleanup() {
  local s
  for s in "${!sessions[@]}"; do kill_session "$s"; done
}
on_exit() {
  local rc=$?
  cleanup
  if [[ $rc -eq 0 && $keep -eq 0 ]]; then
    rm -rf "$work"
  else
    echo "soak: work folder kept: $work" >&2
  fi
  exit "$rc"
}
trap on_exit EXIT
trap 'echo "soak: interrupted" >&2; exit 130' INT TERM HUP

# start LOG ARGS...: runs `loom train ARGS` on every rank (the launcher and its ranks) in a new
# session, output to LOG; sets job (the session id). The job's exit status goes to a file
# (the job is disowned, so bash reports no killed job).
job=0
jobs_started=0
port=0
start() {
  local log=$1 f
  shift
  jobs_started=$((jobs_started + 1))
  f=$work/logs/job_$jobs_started
  rm -f "$f.sid" "$f.rc"
  local -a cmd
  if [[ $launcher == mpirun ]]; then
    cmd=(mpirun --oversubscribe --allow-run-as-root -np "$ranks" "$bin/loom" train "$@")
  else
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    # shellcheck disable=SC2016 # expanded by the inner shell
    cmd=(bash -c '
      n=$1 port=$2 loom=$3; shift 3
      pids=""
      for ((r = 0; r < n; r++)); do
        RANK=$r LOCAL_RANK=$r WORLD_SIZE=$n LOCAL_WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 \
          MASTER_PORT=$port "$loom" train "$@" &
        pids="$pids $!"
      done
      rc=0
      for p in $pids; do wait "$p" || rc=$?; done
      exit $rc' _ "$ranks" "$port" "$bin/loom" "$@")
  fi
  # shellcheck disable=SC2016 # expanded by the inner shell
  setsid bash -c 'f=$1; shift; echo $$ >"$f.sid"; "$@"; echo $? >"$f.rc"' _ "$f" "${cmd[@]}" \
    >"$log" 2>&1 </dev/null &
  disown $!
  local i
  for ((i = 0; i < 500; i++)); do
    [[ -s $f.sid ]] && break
    sleep 0.01
  done
  job=$(cat "$f.sid" 2>/dev/null) || { fail "a job did not start (setsid)"; exit 1; }
  sessions[$job]=1
  job_file=$f
}
alive() { [[ -n $(session_pids "$1") ]]; }
# finish SID LIMIT_S: waits for the job to end within LIMIT_S seconds (the launcher and every
# process left in its session). Sets job_rc (the launcher's exit status, 137 when it was
# killed); returns 1 on a hang, after killing the session.
job_rc=0
job_file=""
finish() {
  local sid=$1 deadline
  deadline=$(awk -v now="$EPOCHREALTIME" -v s="$2" 'BEGIN{printf "%.3f", now + s}')
  while alive "$sid"; do
    if awk -v now="$EPOCHREALTIME" -v d="$deadline" 'BEGIN{exit !(now > d)}'; then
      kill_session "$sid"
      unset "sessions[$sid]"
      job_rc=137
      return 1
    fi
    sleep 0.2
  done
  unset "sessions[$sid]"
  job_rc=$(cat "$job_file.rc" 2>/dev/null) || job_rc=137
  return 0
}
# The pid of each rank of job SID, by rank: its loom-train processes (`loom train` execs
# loom-train), ranked by the launcher's variable in their environment.
declare -A rank_pid=()
rank_pids() {
  local p r
  rank_pid=()
  for p in $(pgrep -s "$1" -x loom-train); do
    r=$(tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null |
      sed -n 's/^OMPI_COMM_WORLD_RANK=//p; s/^RANK=//p' | head -n 1)
    [[ -n $r ]] && rank_pid[$r]=$p
  done
}
now() { echo "$EPOCHREALTIME"; }
# nap S: sleeps S seconds without starting a process (a read that times out on a pipe that
# never gets data).
exec {nap_fd}<> <(:)
nap() { read -rt "$1" -u "$nap_fd" _ || true; }
since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN{printf "%.2f", b - a}'; }
# frac R: R (a draw of $RANDOM, made in this shell: a subshell's RANDOM is reseeded) in [0, 1).
frac() { awk -v r="$1" 'BEGIN{printf "%.4f", r / 32768}'; }
last_step() { grep -ao '^step [0-9]*' "$1" 2>/dev/null | tail -n 1 | cut -d' ' -f2; }
latest() { cat "$1/checkpoints/latest" 2>/dev/null || echo none; }

# ---- the dataset and the config

# The bootstrap's timeout as the comm's: a rank killed before the ranks have met leaves the
# others waiting that long.
export UCX_LOG_LEVEL=${UCX_LOG_LEVEL:-error} LOOM_PROGRESS=lines LOOM_BOOTSTRAP_TIMEOUT=$comm_timeout
data=$work/data.bin
if [[ -d /usr/share/games/fortunes ]]; then
  corpus=/usr/share/games/fortunes
else  # a generated English-like text (Debian's fortunes package is not installed)
  corpus=$work/corpus.txt
  awk 'BEGIN { srand(7); split("the cat|a dog|my friend|the old sailor|every student", s, "|");
               split("sees|likes|finds|carries|remembers", v, "|");
               split("the red ball|a long letter|the river|seven apples|her green hat", o, "|");
               for (i = 0; i < 60000; i++) printf "%s %s %s.%s", s[int(rand()*5)+1],
                 v[int(rand()*5)+1], o[int(rand()*5)+1], (i % 4 == 3) ? "\n%\n" : " " }' \
    >"$corpus"
fi
"$bin/loom-data" prepare --input "$corpus" --output "$data" >"$work/logs/prepare.log" 2>&1 ||
  { cat "$work/logs/prepare.log" >&2; fail "loom data prepare"; exit 1; }

# write_config STEPS: the manifest (1-bit Adam over ucx: its warmup, then compressed steps with
# error-feedback state, from step STEPS / 5) and the trainer config (4 sequences per rank). Checkpoints every 10 steps (a few hundred ms
# apart, each written with fsyncs), metrics every 3 (so a line averages steps on both sides of
# a checkpoint).
write_config() {
  local freeze=$(($1 / 5 > 20 ? $1 / 5 : 20))
  cat >"$work/manifest.toml" <<EOF
[comm.world]
plugin = "ucx"
timeout_s = $comm_timeout
[codec.onebit]
plugin = "onebit"
[optimizer.main]
plugin = "onebit_adam"
comm = "world"
codec = "onebit"
freeze_step = $freeze
EOF
  cat >"$work/soak.toml" <<EOF
[manifest]
path = "manifest.toml"
[model]
context = 64
layers = 2
heads = 4
dim = 64
[data]
dataset = "data.bin"
[train]
steps = $1
batch_size = $((4 * ranks))
seq_len = 64
lr = 2e-3
min_lr = 2e-4
warmup_steps = 20
eval_interval = 100
eval_batches = 2
checkpoint_interval = 10
log_interval = 3
plot = "none"
EOF
}
ckpt_interval=10

# ---- calibration: seconds per step of this config on this machine

if ((steps == 0)); then
  # Trains for 20 s (compressed steps from step 100) and reads the pace off its last metrics
  # line. (Not from step 20: 1-bit Adam frozen that early, in the lr warmup, makes this
  # model's later steps several times slower, nearly all of it in sgemm.)
  write_config 500
  say "calibrating: 20 s of training on $ranks ranks ($launcher)"
  start "$work/logs/calibrate.log" "$work/soak.toml" --fresh --steps 100000000 \
    --run-dir "$work/calibrate"
  t=$(now)
  while alive "$job" && awk -v a="$t" -v b="$EPOCHREALTIME" 'BEGIN{exit !(b - a < 20)}'; do
    sleep 0.5
  done
  alive "$job" || { tail -n 20 "$work/logs/calibrate.log" >&2; fail "the calibration run failed"; exit 1; }
  kill_session "$job"
  finish "$job" 30 || { fail "the calibration run did not end after SIGKILL"; exit 1; }
  step_s=$(python3 -c '
import json, sys
last = [json.loads(l) for l in open(sys.argv[1]) if "\"train\"" in l][-1]
print(last["elapsed_s"] / last["step"])' "$work/calibrate/metrics.jsonl") ||
    { fail "the calibration run wrote no metrics"; exit 1; }
  steps=$(awk -v m="$minutes" -v s="$step_s" 'BEGIN{n = int(m * 60 / s / 10 + 0.5) * 10;
                                               print (n < 100 ? 100 : n)}')
  say "$(awk -v s="$step_s" 'BEGIN{printf "%.1f ms", s * 1000}') per step: $steps steps for $minutes min"
  rm -rf "$work/calibrate"
fi
write_config "$steps"

# ---- the uninterrupted reference run

say "reference: $steps steps on $ranks ranks ($launcher), uninterrupted"
t=$(now)
start "$work/logs/reference.log" "$work/soak.toml" --fresh --run-dir "$work/reference"
# Limit: three times the planned minutes (at least 10 minutes): a slower machine still passes.
ref_limit=$(awk -v m="$minutes" 'BEGIN{l = m * 180; print (l < 600 ? 600 : l)}')
if ! finish "$job" "$ref_limit"; then
  fail "the reference run hung (still running after $ref_limit s)"
  exit 1
fi
ref_wall=$(since "$t")
((job_rc == 0)) || { tail -n 20 "$work/logs/reference.log" >&2; fail "the reference run failed"; exit 1; }
ref_train=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["elapsed_s"])' \
  "$work/reference/summary.json")
step_s=$(awk -v t="$ref_train" -v n="$steps" 'BEGIN{print t / n}')
startup_s=$(awk -v w="$ref_wall" -v t="$ref_train" 'BEGIN{s = w - t; print (s < 0.2 ? 0.2 : s)}')
say "reference done: $ref_wall s wall, $(printf '%.1f' "$ref_train") s training"

# ---- the interrupted run: K kills, each followed by a resume

RANDOM=$seed
run=$work/interrupted
declare -a log_lines=()
kills_done=0
attempt=0
declare -A kinds=()
hang=0
while ((kills_done < kills)); do
  attempt=$((attempt + 1))
  log=$work/logs/attempt_$(printf '%02d' "$attempt").log
  mode=--resume
  ((attempt == 1)) && mode=--fresh
  # The plan, drawn in a fixed order from the seeded generator. The kind is random, but the
  # last kill is the kind not used yet if there is one.
  if ((RANDOM % 2 == 0)); then kind=one; else kind=all; fi
  if ((kills_done == kills - 1 && kills > 1)); then
    [[ -z ${kinds[one]:-} ]] && kind=one
    [[ -z ${kinds[all]:-} ]] && kind=all
  fi
  victim=$((RANDOM % ranks))
  moment_draw=$((RANDOM % 3))
  r1=$RANDOM r2=$RANDOM
  if ((kills_done == 0)); then
    # Before the first checkpoint (step 10): from the start up to half the reference's time
    # outside training (start-up, the final evaluation, the exit) and 5 steps.
    moment=early
    window=$(awk -v a="$startup_s" -v s="$step_s" 'BEGIN{print a / 2 + s * 5}')
  else
    # The second kill waits for a checkpoint write; the others do so one time in three.
    if ((moment_draw == 0 || kills_done == 1)); then moment="write"; else moment="step"; fi
    # Spread the kills left over the time left: a window of twice an even share.
    done_step=$(latest "$run" | sed 's/^step_0*//; s/^none$/0/; s/^$/0/')
    window=$(awk -v n="$steps" -v d="$done_step" -v s="$step_s" -v a="$startup_s" \
      -v k=$((kills - kills_done)) 'BEGIN{print 2 * ((n - d) * s + a) / (k + 1)}')
  fi
  delay=$(awk -v f="$(frac "$r1")" -v w="$window" 'BEGIN{printf "%.3f", f * w}')
  start "$log" "$work/soak.toml" "$mode" --run-dir "$run"
  pid=$job
  t=$(now)
  # Wait for the delay, or for the job to end first.
  while alive "$pid" && awk -v a="$t" -v b="$EPOCHREALTIME" -v d="$delay" 'BEGIN{exit !(b - a < d)}'; do
    sleep 0.02
  done
  # The ranks' pids (their launcher starts them; at an early moment there may be none yet).
  alive "$pid" && rank_pids "$pid"
  if [[ $kind == one ]]; then
    targets=${rank_pid[$victim]:-}
    what="rank $victim"
  else
    targets=${rank_pid[*]}
    what="all ranks"
  fi
  if [[ $moment == write ]]; then
    # Then until a checkpoint folder is being written (at most 30 checkpoint intervals), and
    # a little into the write (its files are written and synced one by one, 10 to 120 ms on
    # the development machine): 0 to 10 ms. Polled with shell builtins, every millisecond.
    deadline=$((${EPOCHREALTIME/./} + $(awk -v s="$step_s" -v i="$ckpt_interval" 'BEGIN{printf "%d", (30 * s * i + 5) * 1e6}')))
    into=$(awk -v f="$(frac "$r2")" 'BEGIN{printf "%d", f * 1e4}')
    watch=${targets%% *}
    while ! compgen -G "$run/checkpoints/step_*.tmp" >/dev/null; do
      ((${EPOCHREALTIME/./} > deadline)) && break
      if [[ -n $watch ]]; then kill -0 "$watch" 2>/dev/null || break; fi
      nap 0.001
    done
    deadline=$((${EPOCHREALTIME/./} + into))
    while ((${EPOCHREALTIME/./} < deadline)); do nap 0.001; done
  fi
  if ! alive "$pid"; then
    finish "$pid" 5
    if ((job_rc == 0)); then
      fail "the run ended (step $(last_step "$log")) before kill $((kills_done + 1)) of $kills: lower --kills or raise --minutes"
    else
      tail -n 20 "$log" >&2
      fail "attempt $attempt ($mode) failed on its own with status $job_rc (log: $log)"
    fi
    break
  fi
  # The state at the kill (shell builtins only, so it is read within a millisecond of it).
  at_tmp=no
  compgen -G "$run/checkpoints/step_*.tmp" >/dev/null && at_tmp=yes
  at_latest=none
  [[ -r $run/checkpoints/latest ]] && read -r at_latest <"$run/checkpoints/latest"
  if [[ -z $targets ]]; then
    # The ranks have not started yet (or are gone): kill the whole job.
    kill_session "$pid"
    what="the launcher (no rank yet)"
  else
    # shellcheck disable=SC2086
    kill -KILL $targets 2>/dev/null
  fi
  at_s=$(since "$t")
  tk=$(now)
  at_step=$(last_step "$log")
  kills_done=$((kills_done + 1))
  kinds[$kind]=$((${kinds[$kind]:-0} + 1))
  grace=$((comm_timeout + 30))
  if finish "$pid" "$grace"; then
    ended="job ended in $(since "$tk") s"
  else
    ended="HANG: still running ${grace} s after the kill; its processes were killed"
    hang=1
  fi
  log_lines+=("$(printf 'kill %2d  attempt %2d %-8s %-9s %-6s at %6.2f s: step %-6s latest %-13s tmp %-3s -> %s (status %d)' \
    "$kills_done" "$attempt" "$mode" "$what" "$moment" "$at_s" "${at_step:-none}" "$at_latest" \
    "$at_tmp" "$ended" "$job_rc")")
  echo "${log_lines[-1]}"
  grep -a 'resumed from\|no checkpoint in' "$log" | sed 's/^/           /' | head -n 2
  if ((hang)); then
    fail "a hang after kill $kills_done (log: $log)"
    break
  fi
done

# ---- the last resume, to the end

if [[ -z $result ]]; then
  attempt=$((attempt + 1))
  log=$work/logs/attempt_$(printf '%02d' "$attempt").log
  say "final resume (attempt $attempt) from $(latest "$run")"
  start "$log" "$work/soak.toml" --resume --run-dir "$run"
  final_limit=$(awk -v r="$ref_wall" 'BEGIN{print 3 * r + 120}')
  if ! finish "$job" "$final_limit"; then
    fail "the final resume hung (still running after $final_limit s; log: $log)"
  elif ((job_rc != 0)); then
    tail -n 20 "$log" >&2
    fail "the final resume failed with status $job_rc (log: $log)"
  else
    grep -a 'resumed from\|no checkpoint in' "$log" | sed 's/^/           /' | head -n 2
  fi
fi

# ---- the comparison: every checkpoint file, the metrics and the summary without timings

compare_out=""
if [[ -z $result ]]; then
  say "comparing $run with $work/reference"
  compare_out=$(python3 - "$work/reference" "$run" <<'PY'
import json, os, struct, sys

ref, run = sys.argv[1], sys.argv[2]
# Wall-clock fields (metrics lines and summary.json); everything else must match.
TIMING = {"tokens_per_s", "elapsed_s", "sampler_s", "train_step_s", "sampler_share_of_step"}
problems = []

def fnv1a64(b):
    h = 0xcbf29ce484222325
    for x in b:
        h = ((h ^ x) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return h

def normalized(rel, b):
    # trainer.rank{R}.bin: a LOOMCKPT frame (kind 2) over the LTS5 trainer state, whose
    # elapsed_s (payload bytes 64..72, training wall time carried across resumes) and the
    # frame's checksum over it are the only bytes allowed to differ; the checksum is checked.
    name = os.path.basename(rel)
    if not (name.startswith("trainer.rank") and name.endswith(".bin")):
        return b
    if (len(b) != 152 or b[:8] != b"LOOMCKPT" or struct.unpack_from("<I", b, 12)[0] != 2
            or struct.unpack_from("<Q", b, 16)[0] != 120
            or struct.unpack_from("<I", b, 32)[0] != 0x4C545335):
        problems.append(f"{rel}: not the trainer state layout this script knows (LTS5, 152 bytes)")
        return b
    if fnv1a64(b[32:]) != struct.unpack_from("<Q", b, 24)[0]:
        problems.append(f"{rel}: payload checksum mismatch")
    m = bytearray(b)
    m[24:32] = bytes(8)
    m[96:104] = bytes(8)
    return bytes(m)

notes = []

def files(root):
    # `latest` and every file of every complete checkpoint folder (step_N/); anything else
    # in checkpoints/ (a step_N.tmp a kill left, the ranks' .shared probe) is only noted.
    out = {}
    base = os.path.join(root, "checkpoints")
    for e in sorted(os.listdir(base)):
        p = os.path.join(base, e)
        if e == "latest" and os.path.isfile(p):
            out[e] = p
        elif e.startswith("step_") and e[5:].isdigit() and os.path.isdir(p):
            for d, _, names in os.walk(p):
                for n in names:
                    out[os.path.relpath(os.path.join(d, n), base)] = os.path.join(d, n)
        else:
            notes.append(f"{os.path.basename(root)}/checkpoints/{e}")
    return out

a, b = files(ref), files(run)
for rel in sorted(set(a) | set(b)):
    if rel not in b:
        problems.append(f"checkpoints/{rel}: missing after the resumes")
        continue
    if rel not in a:
        problems.append(f"checkpoints/{rel}: not in the uninterrupted run")
        continue
    x = normalized(rel, open(a[rel], "rb").read())
    y = normalized(rel, open(b[rel], "rb").read())
    if x != y:
        at = next((i for i in range(min(len(x), len(y))) if x[i] != y[i]), min(len(x), len(y)))
        problems.append(f"checkpoints/{rel}: differs from byte {at} ({len(x)} and {len(y)} bytes)")

def lines(root):
    out = []
    with open(os.path.join(root, "metrics.jsonl"), "rb") as f:
        for i, raw in enumerate(f.read().split(b"\n")):
            if not raw:
                continue
            try:
                j = json.loads(raw)
            except ValueError:
                problems.append(f"{root}/metrics.jsonl line {i + 1} is not JSON: {raw[:80]!r}")
                continue
            out.append({k: v for k, v in j.items() if k not in TIMING})
    return out

ma, mb = lines(ref), lines(run)
if len(ma) != len(mb):
    problems.append(f"metrics.jsonl: {len(mb)} lines after the resumes, {len(ma)} uninterrupted")
for i, (x, y) in enumerate(zip(ma, mb)):
    if x != y:
        problems.append(f"metrics.jsonl line {i + 1}: {json.dumps(y)}\n    uninterrupted: {json.dumps(x)}")
        break

sa = json.load(open(os.path.join(ref, "summary.json")))
sb = json.load(open(os.path.join(run, "summary.json")))
for s in (sa, sb):
    for k in TIMING:
        s.pop(k, None)
if sa != sb:
    problems.append(f"summary.json: {json.dumps(sb)}\n    uninterrupted: {json.dumps(sa)}")

steps = sorted(os.path.dirname(r) for r in a if os.path.dirname(r))
if problems:
    print("MISMATCH")
    for p in problems[:20]:
        print("  " + p)
    if len(problems) > 20:
        print(f"  ... and {len(problems) - 20} more")
    sys.exit(1)
dirs = sorted(set(steps))
print(f"IDENTICAL: {len(a)} checkpoint files ({', '.join(dirs)} and latest; trainer.rank*.bin "
      f"but for elapsed_s), {len(ma)} metrics lines (timing fields removed), summary.json "
      f"(steps {sa.get('steps')}, final eval loss {sa.get('final_eval_loss')})")
if notes:
    print("not compared (not checkpoint files): " + ", ".join(notes))
PY
  ) || fail "the resumed run differs from the uninterrupted one"
fi

# ---- summary

resumes=$((attempt > 0 ? attempt - 1 : 0))
echo
echo "soak summary"
echo "  config:      $work/soak.toml: $steps steps, $ranks ranks ($launcher), 1-bit Adam, checkpoints every $ckpt_interval steps, comm timeout_s $comm_timeout"
echo "  reference:   ${ref_wall:-?} s wall, ${ref_train:-?} s training"
echo "  kills:       $kills_done of $kills (one rank: ${kinds[one]:-0}, all ranks: ${kinds[all]:-0}); seed $seed"
for l in "${log_lines[@]}"; do echo "    $l"; done
echo "  resumes:     $resumes (attempts: $attempt)"
[[ -n $compare_out ]] && echo "  comparison:  $compare_out" | sed '2,$s/^/  /'
if [[ -n $result ]]; then
  echo "  result:      $result"
  exit 1
fi
echo "  result:      PASSED in $(since "$t0") s"
