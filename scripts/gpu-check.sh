#!/usr/bin/env bash
# Runs every GPU check of Loom from a bundle made by scripts/gpu-bundle.sh, on the GPU machine:
#
#   bash scripts/gpu-check.sh build/gpu-bundle "$OUT"
#
# Steps (each under its own `timeout`, all within GPU_CHECK_BUDGET_S seconds, default 420; a
# failing step is recorded and the next one runs):
#   smi           nvidia-smi -L and nvidia-smi
#   plugins       loom --version; loom plugins (every bundled plugin loads)
#   codec_bench   loom-bench-codec --device cuda: onebit round trip beside the copy -> codec.jsonl
#   optim_bench   loom-bench-optim --device cuda (adam, lamb; 1M..256M)    -> optim.jsonl
#   router_bench  loom-bench-router --device cuda (gather/scatter/select beside the D2D copy)
#   quant_bench   loom-bench-quant --device cuda: zeroquant W8A8 against cuBLAS bf16 at 8192^3
#                 -> quant.jsonl
#                 -> router.jsonl; anchors/router_peers.py --device cuda -> router_peers.jsonl
#   moe_bench     loom-bench-moe --device cuda at S=8192, M=2048, E=16, top-2 -> moe.jsonl;
#                 anchors/moe_peers.py --device cuda (the one-hot einsum path) -> moe_peers.jsonl
#   peers         anchors/gpu_peers.py (torch fused Adam, DeepSpeed 1-bit) -> peers.json
#   TEST          each test program in the bundle's bin/ (codec_cuda_test,
#                 loom_optimizer_cuda_tests, loom_nccl_tests, ...): gtest JSON ->
#                 gtest-TEST.json (the nccl test is a world of one: one process, no mpirun)
#   python_cuda   python/tests/test_cuda.py under pytest: loom.torch.Optimizer and Router on
#                 CUDA tensors against torch and against the CPU
#   summary       the ratios against Loom's performance targets -> summary.txt, summary.json
# Every step logs to OUTDIR/NAME.log; OUTDIR/steps.tsv holds name, exit status, seconds.
# Without a GPU (as here, on the build machine) the device steps skip or fail quickly and the
# summary says so.
set -uo pipefail
if (($# != 2)); then
  echo "usage: bash scripts/gpu-check.sh BUNDLE_DIR OUTDIR" >&2
  exit 2
fi
bundle=$(cd "$1" && pwd) || exit 2
mkdir -p "$2" && out=$(cd "$2" && pwd) || exit 2
budget=${GPU_CHECK_BUDGET_S:-420}
start=$SECONDS
steps=$out/steps.tsv
printf 'step\trc\tseconds\n' >"$steps"

# The host refuses plugins that users other than their owner can write to, and the programs
# must be executable: a copy that lost its modes on the way is fixed here, or copied to a
# private folder and fixed there when it cannot be.
modes_ok() { ! find "$1" -perm /022 | grep -q . && ! find "$1/bin" -type f ! -perm -u+x | grep -q .; }
fix_modes() { chmod -R go-w "$1" && chmod u+x "$1"/bin/*; } 2>/dev/null
if ! modes_ok "$bundle"; then
  if ! fix_modes "$bundle" || ! modes_ok "$bundle"; then
    private=$(mktemp -d)
    cp -r "$bundle/." "$private/" && fix_modes "$private" && bundle=$private
  fi
fi

nccl_dir=$(python3 -c "import nvidia.nccl as m; print(list(m.__path__)[0] + '/lib')" 2>/dev/null) ||
  nccl_dir=""
export LD_LIBRARY_PATH="$bundle/deps${nccl_dir:+:$nccl_dir}"
export UCX_MODULE_DIR="$bundle/deps/ucx"
export UCX_LOG_LEVEL=${UCX_LOG_LEVEL:-error}
unset LOOM_PLUGIN_PATH LOOM_LOG_LEVEL
{
  echo "bundle: $bundle"
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  echo "UCX_MODULE_DIR=$UCX_MODULE_DIR"
  echo "nccl: ${nccl_dir:-not found (python3 -c 'import nvidia.nccl' failed)}"
  echo "budget: ${budget}s"
  cat "$bundle/BUNDLE.txt" 2>/dev/null
} >"$out/env.log"

# step NAME LIMIT_S COMMAND...: stdout and stderr to NAME.log; never aborts the script.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((budget - (SECONDS - start) - 15))  # 15 s kept for the summary
  if ((left < 5)); then
    echo "== $name: skipped, the ${budget}s budget is spent" | tee "$out/$name.log"
    printf '%s\t%s\t%s\n' "$name" "budget" 0 >>"$steps"
    return
  fi
  ((limit > left)) && limit=$left
  local t0=$SECONDS rc
  echo "== $name (limit ${limit}s): $*"
  timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" $((SECONDS - t0)) >>"$steps"
  echo "   rc=$rc in $((SECONDS - t0))s"
}

# A bench's JSON lines: the log's lines that are JSON objects.
jsonl() { grep '^{' "$out/$1.log" >"$out/$2" 2>/dev/null || true; }

bin=$bundle/bin
step smi 30 bash -c 'nvidia-smi -L && nvidia-smi'
# shellcheck disable=SC2016  # $0 and $1 expand in the inner shell
step plugins 30 bash -c '"$0" --version && "$0" plugins' "$bin/loom"
step codec_bench 120 "$bin/loom-bench-codec" --device cuda --sizes 1M,16M,64M,256M --iters 20
jsonl codec_bench codec.jsonl
step optim_bench 150 "$bin/loom-bench-optim" --device cuda --sizes 1M,16M,64M,256M --iters 10
jsonl optim_bench optim.jsonl
step router_bench 60 "$bin/loom-bench-router" --device cuda --reps 3
jsonl router_bench router.jsonl
step quant_bench 120 "$bin/loom-bench-quant" --device cuda --cuda-gemm-sizes 8192 --reps 5
jsonl quant_bench quant.jsonl
if [[ -f $bundle/anchors/router_peers.py ]]; then
  # shellcheck disable=SC2016  # $0 and $1 expand in the inner shell
  step router_peers 90 env -u OUT bash -c 'python3 "$0" --device cuda --reps 3 >"$1"' \
    "$bundle/anchors/router_peers.py" "$out/router_peers.jsonl"
fi
# The MoE layer's gate + dispatch + combine at S=8192, M=2048, E=16, top-2, and the one-hot
# einsum formulation of the same in torch.
moe_shape=(--tokens 8192 --model-dim 2048 --experts 16 --k 2 --reps 3)
step moe_bench 60 "$bin/loom-bench-moe" --device cuda "${moe_shape[@]}"
jsonl moe_bench moe.jsonl
if [[ -f $bundle/anchors/moe_peers.py ]]; then
  # shellcheck disable=SC2016  # $0 and $1 expand in the inner shell
  step moe_peers 60 env -u OUT bash -c 'python3 "$0" --device cuda "${@:2}" >"$1"' \
    "$bundle/anchors/moe_peers.py" "$out/moe_peers.jsonl" "${moe_shape[@]}"
fi
# The peers before the tests: the targets need their figures, and the budget is shared.
if [[ -f $bundle/anchors/gpu_peers.py ]]; then
  # Its stdout is one JSON object (stderr goes to peers.log).
  # shellcheck disable=SC2016  # $0 and $1 expand in the inner shell
  step peers 240 env -u OUT bash -c 'python3 "$0" >"$1"' "$bundle/anchors/gpu_peers.py" \
    "$out/peers.json"
else
  echo "== peers: no anchors/gpu_peers.py in the bundle" | tee "$out/peers.log"
  printf '%s\t%s\t%s\n' peers missing 0 >>"$steps"
fi

# Every test program in the bundle is a GPU test (GoogleTest).
for t in "$bin"/*test*; do
  [[ -f $t ]] || continue
  name=$(basename "$t")
  filter=()
  # The thread_comm program's CPU tests ran in CI; here only its device-memory ones.
  [[ $name == loom_thread_comm_tests ]] && filter=(--gtest_filter='ThreadCommCuda.*')
  step "$name" 120 "$t" "${filter[@]}" --gtest_output="json:$out/gtest-$name.json"
done

# The Python package on CUDA tensors, with the GPU machine's torch and pytest.
if [[ -f $bundle/python/tests/test_cuda.py ]]; then
  step python_cuda 90 env LOOM_LIBRARY="$bundle/lib/libloom.so.0" PYTHONPATH="$bundle/python" \
    PYTHONDONTWRITEBYTECODE=1 python3 -m pytest -q -p no:cacheprovider -rs \
    "$bundle/python/tests/test_cuda.py"
fi

echo "== summary"
python3 - "$out" >"$out/summary.txt" 2>&1 <<'EOF'
import glob, json, os, sys

out = sys.argv[1]
N256 = 1 << 28
res = {"steps": {}, "tests": {}, "targets": {}}

def rows(name):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        return []
    got = []
    for line in open(path):
        try:
            got.append(json.loads(line))
        except ValueError:
            pass
    return got

for line in open(os.path.join(out, "steps.tsv")).read().splitlines()[1:]:
    name, rc, secs = line.split("\t")
    res["steps"][name] = {"rc": rc, "seconds": int(secs)}

peers = {}
try:
    peers = json.load(open(os.path.join(out, "peers.json")))
except (OSError, ValueError) as e:
    res["peers_error"] = str(e)
res["peers"] = {k: peers.get(k) for k in ("gpu", "torch", "copy_GBps", "adam_fused_ms_256M",
                                          "ds_onebit_roundtrip_ms_256M", "ds_onebit_error")}

def target(key, value, goal, what):
    ok = None if value is None else value >= goal
    res["targets"][key] = {"value": value, "goal": goal, "met": ok, "what": what}

codec = [r for r in rows("codec.jsonl") if r.get("op") == "roundtrip" and r.get("codec") == "onebit"]
rt = next((r for r in codec if r.get("elements") == N256), None)
res["codec_roundtrip_256M"] = rt
ds_ms = peers.get("ds_onebit_roundtrip_ms_256M")
target("codec_speedup_vs_deepspeed", ds_ms / (rt["seconds"] * 1e3) if rt and ds_ms else None, 5.0,
       "DeepSpeed 1-bit round trip time / Loom onebit round trip time, 256M fp32")
target("codec_fraction_of_copy", rt["ratio_to_copy"] if rt else None, 0.70,
       "onebit round trip traffic (48.5 B/element) / D2D copy bandwidth, same run")

adam = next((r for r in rows("optim.jsonl")
             if r.get("optimizer") == "adam" and r.get("device") == "cuda" and r.get("params") == N256), None)
res["adam_cuda_256M"] = adam
torch_ms = peers.get("adam_fused_ms_256M")
target("adam_speed_vs_torch_fused", torch_ms / (adam["seconds"] * 1e3) if adam and torch_ms else None,
       1.0, "torch fused Adam time / Loom adam step time, 256M params")
target("adam_fraction_of_copy", adam["ratio_to_copy"] if adam else None, 0.85,
       "Loom adam at 28 B/param / D2D copy bandwidth, same run")

w8a8 = next((r for r in rows("quant.jsonl")
             if r.get("kind") == "gemm" and r.get("device") == "cuda" and r.get("m") == 8192), None)
res["quant_w8a8_cuda_8192"] = w8a8
target("int8_gemm_vs_cublas_bf16", w8a8["speedup"] if w8a8 else None, 1.6,
       "cuBLAS bf16 GEMM time / zeroquant W8A8 matmul time (quantizing x included), 8192^3")

for path in sorted(glob.glob(os.path.join(out, "gtest-*.json"))):
    name = os.path.basename(path)[len("gtest-"):-len(".json")]
    try:
        g = json.load(open(path))
    except ValueError as e:
        res["tests"][name] = {"error": str(e)}
        continue
    t = {"tests": 0, "passed": 0, "failed": [], "skipped": []}
    for suite in g.get("testsuites", []):
        for case in suite.get("testsuite", []):
            full = suite["name"] + "." + case["name"]
            t["tests"] += 1
            if case.get("failures"):
                t["failed"].append(full)
            elif case.get("result") == "SKIPPED":
                t["skipped"].append(full)
            else:
                t["passed"] += 1
    res["tests"][name] = t

json.dump(res, open(os.path.join(out, "summary.json"), "w"), indent=1)

print("Loom GPU check:", peers.get("gpu") or "no GPU figures (peers did not run)")
print("\nsteps (rc: 0 ok, 77 skipped, 124/137 timed out):")
for name, s in res["steps"].items():
    print(f"  {name:32s} rc={s['rc']:>6s} {s['seconds']:4d}s")
for name, s in res["steps"].items():
    if s["rc"] in ("0", "77"):
        continue
    try:
        tail = open(os.path.join(out, name + ".log"), errors="replace").read().splitlines()[-6:]
    except OSError:
        tail = []
    print(f"  -- {name}.log, last lines:")
    for line in tail:
        print("     " + line[:300])
print("\ntests:")
if not res["tests"]:
    print("  no gtest results")
else:
    ok = [t for t in res["tests"].values() if "error" not in t]
    print(f"  in all: {sum(t['passed'] for t in ok)} passed, {sum(len(t['failed']) for t in ok)} "
          f"failed, {sum(len(t['skipped']) for t in ok)} skipped (with a GPU, only "
          f"Nccl.WithoutAGpuCreationFailsClearly should skip)")
for name, t in res["tests"].items():
    if "error" in t:
        print(f"  {name}: unreadable results: {t['error']}")
        continue
    print(f"  {name}: {t['passed']}/{t['tests']} passed, {len(t['failed'])} failed, "
          f"{len(t['skipped'])} skipped")
    for f in t["failed"]:
        print(f"    FAILED  {f}")
    for f in t["skipped"]:
        print(f"    skipped {f}")
print("\nfigures:")
if rt:
    print(f"  onebit round trip 256M: {rt['seconds']*1e3:.3f} ms, {rt['gbps']:.0f} GB/s of traffic, "
          f"copy {rt['copy_gbps']:.0f} GB/s, input {rt['input_gbps']:.0f} GB/s")
if adam:
    print(f"  adam 256M: {adam['seconds']*1e3:.3f} ms, {adam['gbps']:.0f} GB/s at 28 B/param, "
          f"copy {adam['copy_gbps']:.0f} GB/s")
for k in ("copy_GBps", "adam_fused_ms_256M", "ds_onebit_roundtrip_ms_256M", "ds_onebit_error"):
    if peers.get(k) is not None:
        print(f"  peers {k}: {peers[k]}")
print("\ntargets:")
for k, t in res["targets"].items():
    v = "n/a" if t["value"] is None else f"{t['value']:.3f}"
    verdict = {True: "MET", False: "NOT MET", None: "not measured"}[t["met"]]
    print(f"  {k:27s} {v:>8s} (>= {t['goal']}) {verdict}: {t['what']}")
EOF
echo "   rc=$? (summary)"
cat "$out/summary.txt"
echo "gpu-check: done in $((SECONDS - start))s; results in $out"
