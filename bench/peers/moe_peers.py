"""The one-hot einsum formulation of a top-k MoE layer's gate, dispatch and combine, written in
torch the way DeepSpeed's gating formulates them, timed on the same machine and shapes as
`loom bench moe`:

  gate:     logits = x . wg^T, p = softmax(logits); the first choice is the argmax of p, the
            second the argmax of the logits with the first masked out (no noise: the bench's
            side runs without noise too); each choice's place in its expert's queue is a
            cumulative sum of one-hot masks over tokens (the second choices queue after all
            the first ones, counted before capacity as DeepSpeed does); choices at or beyond the capacity C = ceil(k * f * S / E) are
            masked off; the kept pair's weight is p over the sum of the token's kept p; the
            weights and the places become the dense combine tensor [S, E, C] (one-hot over C),
            and the dispatch mask is where it is non-zero;
  dispatch: rows [E, C, M] = einsum("sec,sm->ecm", dispatch_mask, x);
  combine:  y [S, M] = einsum("sec,ecm->sm", combine_weights, rows).
The experts are left out (the rows are combined as they were dispatched), so the figure is
the routing's own cost, which is what the bench compares it with. Top-1 (k = 1) uses the first
choice only, weight p unnormalised.

Prints one JSON object per line, keys matching the bench's:
    {"kind":"peer", "op":"gate_dispatch_combine", "device", "tokens", "model_dim", "experts",
     "k", "capacity", "threads", "seconds", "gate_seconds", "dispatch_seconds",
     "combine_seconds"}
every figure the best of --reps (each timing ends with torch.cuda.synchronize on CUDA).
Without torch it prints {"kind":"skip", "reason": ...} and exits 0.

    /usr/bin/python3 bench/peers/moe_peers.py --tokens 2048 --model-dim 512 --experts 16 --k 2
"""
import argparse
import json
import math
import os
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="S")
    ap.add_argument("--model-dim", type=int, default=512, help="M")
    ap.add_argument("--experts", type=int, default=16, help="E")
    ap.add_argument("--k", type=int, default=2, choices=[1, 2])
    ap.add_argument("--capacity-factor", type=float, default=1.25)
    ap.add_argument("--min-capacity", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (torch with CUDA)")
    args = ap.parse_args()
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        print(json.dumps({"kind": "skip", "peer": "torch",
                          "reason": f"torch is not installed ({e}); Debian: "
                                    "apt-get install python3-torch"}))
        return
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    dev = torch.device(args.device)
    sync = lambda: None  # noqa: E731
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            print(json.dumps({"kind": "skip", "peer": "torch", "device": "cuda",
                              "reason": "torch has no CUDA device"}))
            return
        sync = torch.cuda.synchronize
    S, M, E, k = args.tokens, args.model_dim, args.experts, args.k
    C = min(S, max(args.min_capacity, math.ceil(k * args.capacity_factor * S / E)))
    gen = torch.Generator(device=dev).manual_seed(1234)
    x = torch.randn(S, M, generator=gen, device=dev)
    wg = torch.randn(E, M, generator=gen, device=dev) * (1.0 / math.sqrt(M))

    def gate():
        logits = x @ wg.t()
        p = F.softmax(logits, dim=1)
        idx1 = torch.argmax(p, dim=1)
        mask1 = F.one_hot(idx1, E)
        mask1_all = mask1  # before capacity: the second choices queue after all first ones
        loc1 = torch.cumsum(mask1, dim=0) - 1
        me = p.mean(dim=0)
        ce = mask1.float().mean(dim=0)
        aux = (me * ce).sum() * E
        mask1 = mask1 * torch.lt(loc1, C)
        loc1_s = (loc1 * mask1).sum(dim=1)
        g1 = (p * mask1).sum(dim=1)
        if k == 1:
            w1 = g1.unsqueeze(1) * mask1
            combine = w1.unsqueeze(2) * F.one_hot(loc1_s, C).unsqueeze(1)
        else:
            idx2 = torch.argmax(logits.masked_fill(mask1_all.bool(), float("-inf")), dim=1)
            mask2 = F.one_hot(idx2, E)
            loc2 = torch.cumsum(mask2, dim=0) - 1 + mask1_all.sum(dim=0, keepdim=True)
            mask2 = mask2 * torch.lt(loc2, C)
            loc2_s = (loc2 * mask2).sum(dim=1)
            g2 = (p * mask2).sum(dim=1)
            denom = torch.clamp(g1 + g2, min=torch.finfo(p.dtype).eps)
            w1 = torch.einsum("s,se->se", g1 / denom, mask1.to(p.dtype))
            w2 = torch.einsum("s,se->se", g2 / denom, mask2.to(p.dtype))
            combine = (torch.einsum("se,sc->sec", w1, F.one_hot(loc1_s, C).to(p.dtype))
                       + torch.einsum("se,sc->sec", w2, F.one_hot(loc2_s, C).to(p.dtype)))
        return combine, combine.bool(), aux

    state = {}

    def run_gate():
        state["combine"], state["mask"], _ = gate()

    def run_dispatch():
        state["rows"] = torch.einsum("sec,sm->ecm", state["mask"].to(x.dtype), x)

    def run_combine():
        state["y"] = torch.einsum("sec,ecm->sm", state["combine"], state["rows"])

    def timed(fn):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    run_gate(); run_dispatch(); run_combine()  # warm: allocations, first touch
    best = {"gate": math.inf, "dispatch": math.inf, "combine": math.inf, "all": math.inf}
    for _ in range(args.reps):
        g = timed(run_gate)
        d = timed(run_dispatch)
        c = timed(run_combine)
        best["gate"] = min(best["gate"], g)
        best["dispatch"] = min(best["dispatch"], d)
        best["combine"] = min(best["combine"], c)
        best["all"] = min(best["all"], g + d + c)
    kept = int(state["mask"].sum().item())
    print(json.dumps({"kind": "peer", "peer": f"torch {torch.__version__} einsum",
                      "op": "gate_dispatch_combine", "device": dev.type, "tokens": S,
                      "model_dim": M, "experts": E, "k": k, "capacity": C, "kept": kept,
                      "threads": threads, "seconds": best["all"],
                      "gate_seconds": best["gate"], "dispatch_seconds": best["dispatch"],
                      "combine_seconds": best["combine"]}), flush=True)


if __name__ == "__main__":
    main()
