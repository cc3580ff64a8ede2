"""The figures docs/RESULTS.md quotes for the token-routing runs, from their run folders'
metrics.jsonl and summary.json (what `loom train` wrote):

- the setup of each run: layers, parameters, steps, data tokens, layer tokens (the sum
  over layers of the tokens each processed, which the layers' matmul work follows), layer
  tokens per data token and per step, the model FLOPs per data token where every step runs the same
  kept counts (the dense baseline, topk_router);
- the final eval loss, the eval loss at equal layer tokens (every 4th eval point of the
  baseline, in layer tokens; eval points interpolated linearly in layer tokens);
- the layer tokens and the wall time each run needed to first reach the baseline's final
  eval loss (interpolated linearly between the two eval points around it) and their ratios
  to the baseline's. The configs log every eval step, so an eval point's layer tokens and
  wall time (`elapsed_s`) are the logged ones; and the eval loss at the baseline's data
  tokens (equal data, interpolated linearly in data tokens);
- the time per training step (summary.json's train_step_s / steps) and how much it moved
  within the run: the 10th, 50th and 90th percentile of the per-step time of the log
  intervals that hold no eval step, and both the time per step and the 10th percentile (the
  least disturbed steps) against the dense run next to it in time (NEIGHBOUR); for the
  runs above and for repeats of the same configs (routing_baseline_repeat,
  routing_ltd_repeat, routing_topk_repeat, when their folders exist).

    python3 examples/token_routing/report.py build/runs
"""
import json
import os
import statistics
import sys
import tomllib

# baseline_seed: the baseline with another seed, for the size of seed-to-seed differences.
RUNS = ("baseline", "baseline_seed", "ltd", "ltd_short", "ltd_voc", "topk")
# The same configs run again (`--run-dir build/runs/routing_NAME_repeat`), for the timing
# table only: their losses are the first runs' to the bit, their times show the noise.
REPEATS = ("baseline_repeat", "ltd_repeat", "topk_repeat")
# The dense run next to each run in time, in the order docs/RESULTS.md runs them (baseline,
# ltd, ltd_voc, topk, baseline_repeat, ltd_repeat, ltd_short, topk_repeat, baseline_seed):
# the machine's load changes from minute to minute, so a step time compares best with the
# dense run just before or after it.
NEIGHBOUR = {"ltd": "baseline", "ltd_voc": "baseline", "topk": "baseline_repeat",
             "ltd_repeat": "baseline_repeat", "ltd_short": "baseline_seed",
             "topk_repeat": "baseline_seed"}


def load(run):
    train, evals = [], []
    with open(os.path.join(run, "metrics.jsonl")) as f:
        for line in f:
            o = json.loads(line)
            if o.get("type") == "train":
                train.append(o)
            elif o.get("type") == "eval":
                evals.append(o)
    with open(os.path.join(run, "summary.json")) as f:
        summary = json.load(f)
    return train, evals, summary


def flops_per_token(name, train):
    """Forward + backward model FLOPs per data token, counted as the trainer's
    Model::flops() does (docs/trainer.md, "FLOPs and MFU"): per sequence, each layer's
    matmuls 6 * 12 * dim^2 * kept and its causal attention 6 * dim * kept^2, the tied head
    6 * vocab * dim * seq_len; divided by seq_len. The model's shape comes from the run's
    config beside this script, the vocabulary from the dataset's tokenizer file. None when
    a layer's kept count changes during the run (random_ltd), whose compute the layer
    tokens measure."""
    here = os.path.dirname(os.path.abspath(__file__))
    cfg_path = os.path.join(here, f"routing_{name}.toml")
    with open(cfg_path, "rb") as f:
        cfg = tomllib.load(f)
    dim, layers, seq = cfg["model"]["dim"], cfg["model"]["layers"], cfg["train"]["seq_len"]
    dataset = os.path.join(here, cfg["data"]["dataset"])
    with open(os.path.splitext(dataset)[0] + ".tokenizer.json") as f:
        vocab = json.load(f)["vocab_size"]
    kepts = {tuple(o.get("kept", [seq] * layers)) for o in train}
    if len(kepts) != 1:
        return None
    kept = kepts.pop()
    per_seq = sum(6 * 12 * dim * dim * k + 6 * dim * k * k for k in kept)
    return (per_seq + 6 * vocab * dim * seq) / seq


def at_step(train, key, step):
    """train lines' `key` at `step`, interpolated linearly in steps between log lines (the
    first step is always logged, and so is the last)."""
    prev = None
    for o in train:
        if o["step"] == step:
            return o[key]
        if o["step"] > step:
            if prev is None:
                return o[key]
            return prev[key] + (o[key] - prev[key]) * (step - prev["step"]) / (
                o["step"] - prev["step"])
        prev = o
    return prev[key]


def layer_tokens_at(train, step):
    """Consumed layer tokens after `step` (the configs log every eval step, so this is the
    logged total; between log lines it would be interpolated)."""
    return at_step(train, "consumed_layer_tokens", step)


def curve(train, evals, x):
    """[(x at the eval step, eval loss, step)] in step order."""
    return [(x(train, e["step"]), e["eval_loss"], e["step"]) for e in evals]


def first_reach(points, target):
    """(x, step) where the eval loss first reaches `target`, interpolated linearly in x
    between the two eval points around it; None if it never does."""
    prev = None
    for x, loss, step in points:
        if loss <= target:
            if prev is None:
                return x, step
            (x0, l0, s0) = prev
            f = (l0 - target) / (l0 - loss)
            return x0 + (x - x0) * f, s0 + (step - s0) * f
        prev = (x, loss, step)
    return None


def loss_at(points, xq):
    prev = None
    for x, loss, _ in points:
        if x >= xq:
            if prev is None:
                return loss
            (x0, l0, _) = prev
            return l0 + (loss - l0) * (xq - x0) / (x - x0)
        prev = (x, loss, None)
    return None


def step_times(train, evals):
    """Seconds per step of each log interval that holds no eval step."""
    eval_steps = {e["step"] for e in evals}
    out = []
    for a, b in zip(train, train[1:]):
        if any(a["step"] < s <= b["step"] for s in eval_steps):
            continue
        out.append((b["elapsed_s"] - a["elapsed_s"]) / (b["step"] - a["step"]))
    return out


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "build/runs"
    runs = {}
    for name in RUNS:
        d = os.path.join(root, "routing_" + name)
        if os.path.isfile(os.path.join(d, "summary.json")):  # a finished run
            runs[name] = load(d)
    if "baseline" not in runs:
        sys.exit(f"report.py: no {os.path.join(root, 'routing_baseline')}")
    btrain, bevals, bs = runs["baseline"]
    target = bs["final_eval_loss"]
    blt = curve(btrain, bevals, layer_tokens_at)
    b_reach_lt = first_reach(blt, target)[0]
    b_reach_wall = at_step(btrain, "elapsed_s", first_reach(blt, target)[1])
    checkpoints = [x for x, _, _ in blt][3::4]

    print("| run | layers | parameters | steps | data tokens | layer tokens | "
          "layer tokens / data token | layer tokens / step | ratio to baseline | "
          "model FLOPs / data token | ratio to baseline | final eval loss |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    b_lps = bs["layer_tokens"] / bs["steps"]
    b_flops = flops_per_token("baseline", btrain)
    for name, (train, evals, s) in runs.items():
        layers = len(train[0]["kept"]) if "kept" in train[0] else None
        layers = layers if layers is not None else round(s["layer_tokens"] / s["tokens"])
        fl = flops_per_token(name, train)
        fl = f"{fl:,.0f} | {fl / b_flops:.3f}" if fl is not None else "- | -"
        lps = s["layer_tokens"] / s["steps"]
        print(f"| `routing_{name}` | {layers} | {s['parameters']:,} | {s['steps']} | "
              f"{s['tokens']:,} | {s['layer_tokens']:,} | {s['layer_tokens'] / s['tokens']:.3f} | "
              f"{lps:,.0f} | {lps / b_lps:.3f} | {fl} | {s['final_eval_loss']:.4f} |")
    print()

    head = " | ".join(f"eval @ {x / 1e6:.3f}M layer tokens" for x in checkpoints)
    print(f"| run | {head} | layer tokens to reach {target:.4f} | ratio to baseline | "
          f"wall s to reach it | ratio to baseline | eval @ {bs['tokens']:,} data tokens |")
    print("|---|" + "---|" * len(checkpoints) + "---|---|---|---|---|")
    for name, (train, evals, s) in runs.items():
        pts = curve(train, evals, layer_tokens_at)
        at = " | ".join(
            (f"{v:.4f}" if (v := loss_at(pts, c)) is not None else "-") for c in checkpoints)
        r = first_reach(pts, target)
        if r is None:
            reach = "not reached | - | - | -"
        else:
            lt, step = r
            wall = at_step(train, "elapsed_s", step)
            reach = (f"{lt:,.0f} | {lt / b_reach_lt:.3f} | {wall:.1f} | "
                     f"{wall / b_reach_wall:.3f}")
        dt = loss_at(curve(train, evals, lambda tr, st: at_step(tr, "tokens", st)), bs["tokens"])
        dt = f"{dt:.4f}" if dt is not None else "-"
        print(f"| `routing_{name}` | {at} | {reach} | {dt} |")
    print()

    for name in REPEATS:
        d = os.path.join(root, "routing_" + name)
        if os.path.isfile(os.path.join(d, "summary.json")):
            runs[name] = load(d)
    def near(name, ms, p10):
        n = NEIGHBOUR.get(name)
        if n is None or n not in runs or ms is None:
            return "- | - | -"
        ntrain, nevals, ns = runs[n]
        n_ms = 1e3 * ns["train_step_s"] / ns["steps"]
        n_p10 = pct([1e3 * t for t in step_times(ntrain, nevals)], 0.1)
        return f"`routing_{n}` | {ms / n_ms:.3f} | {p10 / n_p10:.3f}"

    print("| run | final eval loss | wall s (summary) | ms per step (train_step_s / steps) | "
          "ms per step in the log intervals without an eval: p10 / median / p90 | "
          "(p90 - p10) / median | dense run next to it | ms per step ratio to it | "
          "p10 ratio to it |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (train, evals, s) in runs.items():
        ms = 1e3 * s["train_step_s"] / s["steps"] if "train_step_s" in s else None
        ts = [1e3 * t for t in step_times(train, evals)]
        p10, p50, p90 = pct(ts, 0.1), statistics.median(ts), pct(ts, 0.9)
        ms_s = f"{ms:.1f}" if ms is not None else "-"
        print(f"| `routing_{name}` | {s['final_eval_loss']:.4f} | {s['elapsed_s']:.1f} | {ms_s} | "
              f"{p10:.1f} / {p50:.1f} / {p90:.1f} | {(p90 - p10) / p50:.2f} | "
              f"{near(name, ms, p10)} |")


if __name__ == "__main__":
    main()
