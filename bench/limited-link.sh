#!/usr/bin/env bash
# fp32 allreduce against the compressed allreduce on commodity-Ethernet links: 4 ranks, each
# in its own network namespace, joined by veth pairs to a bridge, every veth shaped to
# 1 Gbit/s with tc tbf, and all data traffic (UCX and MPI) forced onto those links.
#
#   sudo bench/limited-link.sh                       # 256 MiB, build/release
#   BUILD=build/release SIZE=64M ITERS=2 sudo -E bench/limited-link.sh
#
#   sudo bench/limited-link.sh -- build/release/bin/loom train CONFIG.toml --fresh
#                                                    # any command, as the 4 ranks instead
#   HOSTS=2 sudo -E bench/limited-link.sh -- COMMAND  # 2 namespaces ("hosts") of 2 ranks:
#                                                    # ranks 0-1 in the first, 2-3 in the second
#   RATE=100mbit MIN_SIZE=1M SIZE=256M sudo -E bench/limited-link.sh
#                                                    # a sweep: 1, 4, 16, 64, 256 MiB
#   NP=2 sudo -E bench/limited-link.sh -- COMMAND     # 2 ranks instead of 4
#
# The ranks get every LOOM_* variable of the caller's environment.
# Prints the benchmark's JSON lines, then for each size (its own heading when there are
# several) a line per codec, the hierarchical row where HOSTS makes one, and the time ratio
#   fp32_over_compressed=<t(fp32 ucx allreduce) / t(compressed allreduce)>
# (only when the benchmark has compressed_allreduce rows; else that line says so).
# Needs root (ip netns, tc): exits 77 (skipped) without. Everything it creates is removed on
# exit, also on failure.
set -euo pipefail

BUILD=${BUILD:-build/release}
SIZE=${SIZE:-256M}
MIN_SIZE=${MIN_SIZE:-$SIZE}  # below SIZE: every 4x from MIN_SIZE up to SIZE
ITERS=${ITERS:-1}
RATE=${RATE:-1gbit}
CODEC=${CODEC:-onebit}
NP=${NP:-4}              # ranks
HOSTS=${HOSTS:-$NP}      # network namespaces; NP / HOSTS ranks in each
TAG=ll$$                 # keeps names unique (and short: interface names <= 15 chars)
BR=${TAG}br
SUBNET=10.213.77
DEV=lleth0               # the veth's name inside every namespace (UCX_NET_DEVICES)

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BENCH=$ROOT/$BUILD/bin/loom-bench-comm
if [[ $EUID -ne 0 ]]; then
  echo "limited-link.sh: needs root (network namespaces and tc); skipped" >&2
  exit 77
fi
if (( HOSTS < 1 || NP % HOSTS != 0 )); then
  echo "limited-link.sh: HOSTS=$HOSTS must divide the $NP ranks" >&2
  exit 2
fi
COMMAND=()
if [[ ${1:-} == -- ]]; then
  shift
  COMMAND=("$@")
  [[ ${#COMMAND[@]} -gt 0 ]] || { echo "limited-link.sh: nothing after --" >&2; exit 2; }
fi
if [[ ${#COMMAND[@]} -eq 0 && ! -x $BENCH ]]; then
  echo "limited-link.sh: $BENCH not found; build the loom-bench-comm target first" >&2
  exit 1
fi

WORK=$(mktemp -d)
cleanup() {
  set +e
  for i in $(seq 0 $((HOSTS - 1))); do
    ip netns del "${TAG}ns$i" 2>/dev/null
    ip link del "${TAG}h$i" 2>/dev/null
  done
  ip link del "$BR" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

# A run killed outright (a test's timeout sends SIGKILL) leaves its namespaces and bridge
# behind, and its bridge's address on the same subnet would swallow this run's traffic: remove
# what belongs to runs whose process is gone.
for stale in $(ip -o link show type bridge 2>/dev/null | sed -n 's/^[0-9]*: ll\([0-9]*\)br[:@].*/\1/p'); do
  [[ -d /proc/$stale ]] && continue
  echo "limited-link.sh: removing what the dead run $stale left behind" >&2
  for ns in $(ip netns list | awk '{print $1}' | grep "^ll${stale}ns" || true); do
    ip netns del "$ns" 2>/dev/null || true
  done
  ip link del "ll${stale}br" 2>/dev/null || true
done

if ! ip link add "$BR" type bridge 2>/dev/null; then
  echo "limited-link.sh: cannot create network devices here (no CAP_NET_ADMIN?); skipped" >&2
  exit 77
fi
ip addr add "$SUBNET.254/24" dev "$BR"
ip link set "$BR" up
for i in $(seq 0 $((HOSTS - 1))); do
  ns=${TAG}ns$i
  ip netns add "$ns"
  ip link add "${TAG}h$i" type veth peer name "${TAG}n$i"
  ip link set "${TAG}n$i" netns "$ns"
  ip -n "$ns" link set "${TAG}n$i" name "$DEV"
  ip -n "$ns" addr add "$SUBNET.$((i + 1))/24" dev "$DEV"
  ip -n "$ns" link set "$DEV" up
  ip -n "$ns" link set lo up
  ip link set "${TAG}h$i" master "$BR" up
  # Both directions of each link: into the namespace (host side) and out of it.
  tc qdisc add dev "${TAG}h$i" root tbf rate "$RATE" burst 128kb latency 100ms
  tc -n "$ns" qdisc add dev "$DEV" root tbf rate "$RATE" burst 128kb latency 100ms
done

cat >"$WORK/in-ns.sh" <<EOF
#!/bin/sh
exec ip netns exec ${TAG}ns\$((OMPI_COMM_WORLD_RANK / $((NP / HOSTS)))) "\$@"
EOF
chmod +x "$WORK/in-ns.sh"

export PMIX_MCA_ptl_tcp_if_include=$SUBNET.0/24
export PMIX_MCA_ptl_tcp_remote_connections=1
MPIRUN=(mpirun --allow-run-as-root --oversubscribe -np "$NP"
  --mca oob_tcp_if_include "$BR"
  --mca pml ob1 --mca btl self,tcp --mca btl_tcp_if_include "$SUBNET.0/24"
  -x UCX_TLS=tcp,self -x UCX_NET_DEVICES=$DEV -x UCX_LOG_LEVEL=error
  -x LOOM_BOOTSTRAP_TIMEOUT="${LOOM_BOOTSTRAP_TIMEOUT:-600}")
for v in $(compgen -e | grep '^LOOM_' || true); do
  [[ $v == LOOM_BOOTSTRAP_TIMEOUT ]] || MPIRUN+=(-x "$v")
done
MPIRUN+=("$WORK/in-ns.sh")
# What the ranks run: the given command (its status is the script's), or the benchmark.
if [[ ${#COMMAND[@]} -gt 0 ]]; then
  "${MPIRUN[@]}" "${COMMAND[@]}"
  exit 0
fi
"${MPIRUN[@]}" "$BENCH" --min-bytes "$MIN_SIZE" --max-bytes "$SIZE" --iters "$ITERS" \
  | tee "$WORK/out.jsonl"

python3 - "$WORK/out.jsonl" "$CODEC" "$RATE" <<'EOF'
import json, re, sys
from collections import defaultdict
# Per size (fp32 elements): the ucx allreduces, the fastest compressed row of each codec
# (seconds, sent, received, segments), the codec work alone, the hierarchical row.
fp32, bf16, hier = {}, {}, {}
comp, compute = defaultdict(dict), defaultdict(dict)
for line in open(sys.argv[1]):
    line = line.strip()
    if not line.startswith("{"):
        continue
    j = json.loads(line)
    n = j.get("elements")
    if j.get("bench") == "allreduce" and j.get("impl") == "ucx":
        (bf16 if j.get("dtype") == "bfloat16" else fp32)[n] = j["seconds"]
    elif j.get("bench") == "compressed_allreduce" and j.get("hierarchical"):
        hier[n] = j
    elif j.get("bench") == "compressed_allreduce":
        row = (j["seconds"], j.get("wire_bytes_per_rank", 0),
               j.get("wire_bytes_received_per_rank", 0), j.get("segments", 1))
        if j["codec"] not in comp[n] or row[0] < comp[n][j["codec"]][0]:
            comp[n][j["codec"]] = row
    elif j.get("bench") == "compressed_compute":
        compute[n][j.get("codec")] = j["seconds"]
m = re.fullmatch(r"([0-9.]+)([kmg]?)bit", sys.argv[3].lower())
rate = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)] if m else None
sizes = sorted(set(fp32) | set(comp))
for n in sizes:
    if len(sizes) > 1:
        print("%d MiB:" % (n * 4 >> 20) if n * 4 >= 1 << 20 else "%d bytes:" % (n * 4))
    for c, (s, sent, recv, segs) in sorted(comp[n].items()):
        parts = ["codec %s: %.3f s (%d segment(s))" % (c, s, segs)]
        if rate:
            bound = max(sent, recv) * 8 / rate
            parts.append("wire bound %.3f s (%d bytes each way at %s), %.2f of it"
                         % (bound, max(sent, recv), sys.argv[3], bound / s))
        if c in compute[n]:
            parts.append("codec work alone %.3f s" % compute[n][c])
        if n in bf16:
            parts.append("bf16 allreduce %.3f s (%.2fx)" % (bf16[n], bf16[n] / s))
        print("; ".join(parts))
    if n in hier:
        h = hier[n]
        print("hierarchical %s (%d hosts x %d ranks): %.3f s, %d bytes between hosts per rank"
              % (h["codec"], h["hosts"], h["ranks_per_host"], h["seconds"],
                 h["between_hosts_bytes_per_rank"])
              + ("; fp32 %.2fx" % (fp32[n] / h["seconds"]) if n in fp32 else ""))
    if n not in fp32:
        print("fp32_over_compressed=unavailable (no fp32 allreduce row)")
    elif not comp[n]:
        print("fp32_over_compressed=unavailable (no compressed_allreduce rows: fp32 only, %.3f s)"
              % fp32[n])
    else:
        codec = sys.argv[2] if sys.argv[2] in comp[n] else sorted(comp[n])[0]
        print("fp32_over_compressed=%.2f (codec %s, fp32 %.3f s, compressed %.3f s)"
              % (fp32[n] / comp[n][codec][0], codec, fp32[n], comp[n][codec][0]))
EOF
