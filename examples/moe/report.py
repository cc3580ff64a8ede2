"""The figures docs/RESULTS.md quotes for the Mixture-of-Experts runs, from their run folders'
metrics.jsonl and summary.json (what `loom train` wrote for the configs beside this script):

- per run (dense, top1, top1_e4, prmoe, prmoe_wide): its MoE layers, parameters (all of them, and those a token
  passes through: the dense ones plus, per MoE layer, the gate, k experts and the residual
  MLP), forward + backward FLOPs per token, the eval loss at every eval step (equal steps),
  the final eval loss, the 10th and 50th percentile of the time per step over the log
  intervals without an eval (the 10th: the least disturbed by other jobs' load), the wall
  time of the run (summary.json's elapsed_s, evaluations
  included) and the eval loss at half and all of the shortest run's time to its last eval
  point (equal wall time, interpolated linearly in seconds between eval points; each eval
  point's time is the elapsed_s of the train line of the same step);
- equal quality: the step and the wall time at which each run first reaches the dense run's
  final eval loss (interpolated linearly between the two eval points around it), and the
  parameters of each MoE run against top1's;
- the expert load of the MoE runs at the last step: per layer the smallest and largest share
  of the choices an expert got, and the dropped choices as a share of all;
- equal wall time (dense and top1 on 1 rank, dense_dp2 and top1_ep2 on 2, dense_dp4 and
  top1_ep4 on 4: the same global batch, steps and data at each rank count): each pair's wall
  time, median ms per step, final eval losses, the wall time at which the MoE run first
  reaches the dense run's final eval loss (and its share of the dense run's wall time), and
  the MoE run's phase seconds from summary.json (rank 0);
- expert parallelism (ep1, ep2, ep4) and its controls (dp2, dp4: the same on 2 and 4 ranks
  with every expert on every rank): the largest difference of the train loss at any logged
  step and of the eval loss at any eval step from ep1 (absolute and relative), and of ep2
  from dp2 and ep4 from dp4 (what splitting the experts changes at a given rank count).

    python3 examples/moe/report.py build/runs
"""
import json
import os
import sys
import tomllib

HERE = os.path.dirname(os.path.abspath(__file__))
RUNS = ("dense", "top1", "top1_e4", "prmoe", "prmoe_wide")
EP = ("ep1", "ep2", "ep4", "dp2", "dp4")
WALL = ((1, "dense", "top1"), (2, "dense_dp2", "top1_ep2"), (4, "dense_dp4", "top1_ep4"))
PHASES = ("gate", "dispatch", "exchange", "experts", "combine", "other")


def load(root, name):
    folder = os.path.join(root, f"moe_{name}")
    train, evals = [], []
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        for line in f:
            o = json.loads(line)
            (train if o.get("type") == "train" else evals).append(o)
    evals = [e for e in evals if e.get("type") == "eval"]
    with open(os.path.join(folder, "summary.json")) as f:
        summary = json.load(f)
    return train, evals, summary


def config(name):
    with open(os.path.join(HERE, f"{name}.toml"), "rb") as f:
        return tomllib.load(f)


def manifest_instance(cfg, instance):
    with open(os.path.join(HERE, cfg["manifest"]["path"]), "rb") as f:
        return tomllib.load(f)["moe"][instance]


def shape(name, summary):
    """(per-token parameters, FLOPs per token, description) from the config and the run."""
    cfg = config(name)
    C, L = cfg["model"]["dim"], cfg["model"]["layers"]
    seq = cfg["train"]["seq_len"]
    dataset = os.path.normpath(os.path.join(HERE, cfg["data"]["dataset"]))
    with open(os.path.splitext(dataset)[0] + ".tokenizer.json") as f:
        V = json.load(f)["vocab_size"]
    dense_mlp = 2 * 4 * C * C + 4 * C + C
    attn_ln = 2 * C + 3 * C * C + 3 * C + C * C + C + 2 * C
    active = V * C + cfg["model"]["context"] * C + L * attn_ln + 2 * C
    flops = 6 * C * V + L * (6 * 4 * C * C + 6 * seq * C)
    moe = cfg.get("moe")
    moe_layers = set(moe["layers"]) if moe else set()
    desc = "dense"
    if moe:
        inst = manifest_instance(cfg, moe["instance"])
        k = inst.get("k", 1)
        H = moe.get("hidden", 4 * C)
        experts = moe["experts"] if isinstance(moe["experts"], list) else [moe["experts"]] * len(
            moe["layers"])
        residual = inst.get("use_residual", False)
        mlp = 2 * H * C + H + C
        for E in experts:
            active += E * C + k * mlp + (mlp + 2 * C + 2 if residual else 0)
            flops += 6 * C * E + 6 * 2 * C * H * k + (6 * 2 * C * H + 6 * 2 * C if residual else 0)
        desc = (f"MoE layers {moe['layers']}, experts {experts}, top-{k}, hidden {H}"
                + (", residual" if residual else ""))
    for layer in range(L):
        if layer not in moe_layers:
            active += dense_mlp
            flops += 6 * 2 * 4 * C * C
    return active, flops, desc


def step_times(train, evals):
    """Seconds per step of each log interval that holds no eval step, sorted."""
    eval_steps = {e["step"] for e in evals}
    out = []
    for a, b in zip(train, train[1:]):
        if not any(a["step"] < s <= b["step"] for s in eval_steps):
            out.append((b["elapsed_s"] - a["elapsed_s"]) / (b["step"] - a["step"]))
    return sorted(out)


def time_at(train, step):
    for o in train:
        if o["step"] >= step:
            return o["elapsed_s"]
    return train[-1]["elapsed_s"]


def interp(points, xq):
    """points: [(x, y)] increasing in x; y at xq, linear between points (None past the end)."""
    prev = None
    for x, y in points:
        if x >= xq:
            if prev is None:
                return y
            x0, y0 = prev
            return y0 + (y - y0) * (xq - x0) / (x - x0)
        prev = (x, y)
    return None


def first_reach(points, target):
    prev = None
    for x, y in points:
        if y <= target:
            if prev is None:
                return x
            x0, y0 = prev
            return x0 + (x - x0) * (y0 - target) / (y0 - y)
        prev = (x, y)
    return None


def main():
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    root = sys.argv[1]
    runs = {}
    for name in RUNS:
        if os.path.exists(os.path.join(root, f"moe_{name}", "summary.json")):
            runs[name] = load(root, name)
    if "dense" not in runs:
        raise SystemExit(f"{root}/moe_dense: no finished run (see the configs' commands)")
    print("## Runs\n")
    print("| run | layers | parameters | per token | FLOPs/token | final eval | wall s | "
          "ms/step p10 | p50 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (train, evals, summary) in runs.items():
        active, flops, desc = shape(name, summary)
        st = step_times(train, evals)
        print(f"| {name} | {desc} | {summary['parameters']:,} | {active:,} | {flops / 1e6:.2f}M "
              f"| {summary['final_eval_loss']:.4f} | {summary['elapsed_s']:.1f} | "
              f"{1e3 * st[len(st) // 10]:.1f} | {1e3 * st[len(st) // 2]:.1f} |")
    print("\n## Eval loss at equal steps\n")
    steps = [e["step"] for e in runs["dense"][1]]
    print("| step | " + " | ".join(runs) + " |")
    print("|---" * (len(runs) + 1) + "|")
    for s in steps:
        row = []
        for name, (train, evals, _) in runs.items():
            v = [e["eval_loss"] for e in evals if e["step"] == s]
            row.append(f"{v[0]:.4f}" if v else "-")
        print(f"| {s} | " + " | ".join(row) + " |")
    print("\n## Eval loss at equal wall time\n")
    curves = {n: [(time_at(t, e["step"]), e["eval_loss"]) for e in ev]
              for n, (t, ev, _) in runs.items()}
    tmin = min(c[-1][0] for c in curves.values())  # the earliest last eval point
    for frac in (0.5, 1.0):
        tq = tmin * frac
        vals = ", ".join(f"{n} {interp(c, tq):.4f}" for n, c in curves.items()
                         if interp(c, tq) is not None)
        print(f"- at {tq:.1f} s: {vals}")
    target = runs["dense"][2]["final_eval_loss"]
    print(f"\n## Equal quality: first reaching dense's final eval loss {target:.4f}\n")
    for name, (train, evals, summary) in runs.items():
        step = first_reach([(e["step"], e["eval_loss"]) for e in evals], target)
        secs = first_reach(curves[name], target)
        print(f"- {name}: " + (f"step {step:.0f}, {secs:.1f} s" if step is not None
                               else "not reached") + f"; parameters {summary['parameters']:,}")
    if "top1" in runs and "prmoe" in runs:
        p, q = runs["prmoe"][2]["parameters"], runs["top1"][2]["parameters"]
        print(f"- prmoe / top1 parameters: {p / q:.3f}; final eval loss prmoe - top1: "
              f"{runs['prmoe'][2]['final_eval_loss'] - runs['top1'][2]['final_eval_loss']:+.4f}")
    print("\n## Expert load at the last step\n")
    for name, (train, _, _) in runs.items():
        last = train[-1]
        for layer in last.get("moe", []):
            counts = layer["load"]
            total = sum(counts)
            print(f"- {name} layer {layer['layer']}: shares {min(counts) / total:.3f} .. "
                  f"{max(counts) / total:.3f} (uniform {1 / len(counts):.3f}), dropped "
                  f"{layer['dropped'] / total:.3f}, aux loss {layer['aux_loss']:.4f}")
    wall_table(root)
    eps = {}
    for name in EP:
        if os.path.exists(os.path.join(root, f"moe_{name}", "summary.json")):
            eps[name] = load(root, name)
    if "ep1" in eps:
        print("\n## Expert parallelism against 1 rank\n")
        base_t, base_e, _ = eps["ep1"]
        for name in ("ep2", "ep4", "dp2", "dp4"):
            if name not in eps:
                continue
            t, e, s = eps[name]
            dt = [abs(a["loss"] - b["loss"]) for a, b in zip(base_t, t)]
            rt = [abs(a["loss"] - b["loss"]) / a["loss"] for a, b in zip(base_t, t)]
            de = [abs(a["eval_loss"] - b["eval_loss"]) for a, b in zip(base_e, e)]
            print(f"- {name} ({s['ranks']} ranks, {len(t)} train lines, {len(e)} evals): train "
                  f"loss max |diff| {max(dt):.2e} (relative {max(rt):.2e}), eval loss max "
                  f"|diff| {max(de):.2e}; final eval {s['final_eval_loss']:.4f} vs "
                  f"{eps['ep1'][2]['final_eval_loss']:.4f}")
        for ep, dp in (("ep2", "dp2"), ("ep4", "dp4")):
            if ep in eps and dp in eps:
                (a, ae, _), (b, be, _) = eps[dp], eps[ep]
                dt = max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b))
                de = max(abs(x["eval_loss"] - y["eval_loss"]) for x, y in zip(ae, be))
                print(f"- {ep} against {dp}: train loss max |diff| {dt:.2e}, eval loss max "
                      f"|diff| {de:.2e}")


def wall_table(root):
    """MoE against dense at equal wall time, per rank count (the pairs in WALL that ran)."""
    rows = []
    for ranks, dense, moe in WALL:
        if not all(os.path.exists(os.path.join(root, f"moe_{n}", "summary.json"))
                   for n in (dense, moe)):
            continue
        (dt, de, ds), (mt, me, ms) = load(root, dense), load(root, moe)
        target = ds["final_eval_loss"]
        curve = [(time_at(mt, e["step"]), e["eval_loss"]) for e in me]
        reach = first_reach(curve, target)
        step = first_reach([(e["step"], e["eval_loss"]) for e in me], target)
        p50 = lambda t, e: 1e3 * step_times(t, e)[len(step_times(t, e)) // 2]
        ph = ms.get("moe", {}).get("phases", {}).get("seconds", {})
        phases = " / ".join(f"{ph.get(k, 0.0):.2f}" for k in PHASES)
        reached = (f"{reach:.1f} s (step {step:.0f}), {reach / ds['elapsed_s']:.2f}"
                   if reach is not None else "not reached")
        rows.append(f"| {ranks} | {ds['elapsed_s']:.1f} | {ms['elapsed_s']:.1f} | "
                    f"{p50(dt, de):.1f} | {p50(mt, me):.1f} | {target:.4f} | "
                    f"{ms['final_eval_loss']:.4f} | {reached} | {phases} |")
    if not rows:
        return
    print("\n## Equal wall time: MoE (top-1, 8 experts per MoE layer) against dense\n")
    print("| ranks | dense s | MoE s | dense ms/step p50 | MoE ms/step p50 | dense final | "
          "MoE final | MoE reaches dense's final (share of dense's wall time) | MoE phases s: "
          + " / ".join(PHASES) + " |")
    print("|---" * 9 + "|")
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
