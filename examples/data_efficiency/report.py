"""The figures docs/RESULTS.md quotes for the data-efficiency runs, from their run folders'
metrics.jsonl and summary.json (what `loom train` wrote):

- for the stability runs: the final eval loss and the largest loss spike (the largest rise
  of a step's train loss above the lowest train loss of the steps before it);
- for the curriculum runs: the final eval loss, the tokens each run needed to first reach
  the baseline's final eval loss (eval points interpolated linearly in tokens) and their
  ratio to the baseline's, the eval loss at equal tokens (each eval point of the baseline),
  wall time and the sampler's share of the step time.

    python3 examples/data_efficiency/report.py build/runs            # both tables
"""
import json
import os
import sys


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


def tokens_at(train, step):
    """Tokens consumed after `step` (train lines carry the running total)."""
    best = None
    for o in train:
        if o["step"] <= step:
            best = o
    return best["tokens"] if best else 0


def eval_curve(train, evals):
    """[(tokens, eval loss)] in step order."""
    return [(tokens_at(train, e["step"]), e["eval_loss"]) for e in evals]


def tokens_to_reach(curve, target):
    prev = None
    for t, loss in curve:
        if loss <= target:
            if prev is None:
                return t
            (t0, l0) = prev
            return t0 + (t - t0) * (l0 - target) / (l0 - loss)
        prev = (t, loss)
    return None


def loss_at(curve, tokens):
    prev = None
    for t, loss in curve:
        if t >= tokens:
            if prev is None:
                return loss
            (t0, l0) = prev
            return l0 + (loss - l0) * (tokens - t0) / (t - t0)
        prev = (t, loss)
    return None


def largest_spike(train):
    low, spike, at = float("inf"), 0.0, None
    for o in train:
        if o["loss"] - low > spike:
            spike, at = o["loss"] - low, o["step"]
        low = min(low, o["loss"])
    return spike, at


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "build/runs"
    print("| stability run | steps | tokens | final eval loss | largest loss spike (step) |")
    print("|---|---|---|---|---|")
    for name in ("stability_baseline", "stability_slw"):
        run = os.path.join(root, name)
        if not os.path.isdir(run):
            continue
        train, evals, s = load(run)
        spike, at = largest_spike(train)
        print(f"| `{name}` | {s['steps']} | {s['tokens']:,} | {s['final_eval_loss']:.4f} | "
              f"{spike:.3f} (step {at}) |")
    print()
    base = os.path.join(root, "curriculum_baseline")
    if not os.path.isdir(base):
        return
    btrain, bevals, bs = load(base)
    bcurve = eval_curve(btrain, bevals)
    target = bs["final_eval_loss"]
    btok = tokens_to_reach(bcurve, target)
    checkpoints = [t for t, _ in bcurve][3::4]  # every 4th eval point of the baseline
    head = " | ".join(f"eval @ {t / 1e3:.0f}k tokens" for t in checkpoints)
    print(f"| curriculum run | final eval loss | tokens to reach {target:.4f} | ratio to baseline "
          f"| {head} | wall s | sampler share of step |")
    print("|---|---|---|---|" + "---|" * len(checkpoints) + "---|---|")
    for name in ("baseline", "voc", "slw", "voc_slw"):
        run = os.path.join(root, "curriculum_" + name)
        if not os.path.isdir(run):
            continue
        train, evals, s = load(run)
        curve = eval_curve(train, evals)
        t = tokens_to_reach(curve, target)
        reach = f"{t:,.0f}" if t is not None else "not reached"
        ratio = f"{t / btok:.3f}" if t is not None else "-"
        at = " | ".join(f"{loss_at(curve, c):.4f}" for c in checkpoints)
        share = s.get("sampler_share_of_step")
        share = f"{share * 100:.4f}%" if share is not None else "-"
        print(f"| `curriculum_{name}` | {s['final_eval_loss']:.4f} | {reach} | {ratio} | {at} | "
              f"{s['elapsed_s']:.0f} | {share} |")


if __name__ == "__main__":
    main()
