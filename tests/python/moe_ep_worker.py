"""One rank of a 2-process expert-parallel loom.torch.MoE run (run by test_moe.py with
RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT: the host's env bootstrap). Four experts, two per
rank, unequal token counts per rank; writes y, the gradients (before and after
reduce_gradients) and the stats to OUT_DIR/rankN.json."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                                os.pardir, "bindings", "python"))

import torch  # noqa: E402

import loom  # noqa: E402
import loom.torch  # noqa: E402

E, K, M, H = 4, 2, 4, 6
TOKENS = (5, 3)
MANIFEST = f"""
[comm.world]
plugin = "ucx"

[moe.m]
plugin = "moe"
num_experts = {E}
k = {K}
capacity_factor = 2.0
ep_size = 2
comm = "world"
"""


def full_weights():
    """The layer's weights over all experts, the same on every rank."""
    g = torch.Generator().manual_seed(0)
    shapes = {"gate_w": (E, M), "w1": (E, H, M), "b1": (E, H), "w2": (E, M, H), "b2": (E, M)}
    return {n: torch.randn(s, generator=g) * 0.5 for n, s in shapes.items()}


def inputs(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(TOKENS[rank], M, generator=g), torch.randn(TOKENS[rank], M, generator=g)


def main():
    rank = int(os.environ["RANK"])
    w = full_weights()
    x, dy = inputs(rank)
    with loom.Session.from_string(MANIFEST, "moe_ep.toml", log_level="error") as s:
        mod = loom.torch.MoE(s.instance("moe", "m"), M, H, seed=5)
        el = mod.local_experts
        with torch.no_grad():
            mod.gate_w.copy_(w["gate_w"])
            for n in ("w1", "b1", "w2", "b2"):
                getattr(mod, n).copy_(w[n][rank * el:(rank + 1) * el])
        x.requires_grad_(True)
        y, aux = mod(x, first_token=sum(TOKENS[:rank]))
        ((y * dy).sum() + 0.1 * aux).backward()
        out = {"rank": rank, "plan": mod.plan, "y": y.tolist(), "aux": float(aux),
               "dx": x.grad.tolist(), "stats": {k: v for k, v in mod.last_stats.items()
                                                if k != "load"},
               "load": mod.last_stats["load"].tolist(),
               "grads": {n: p.grad.tolist() for n, p in mod.named_parameters()}}
        mod.reduce_gradients()
        out["reduced"] = {n: getattr(mod, n).grad.tolist() for n in ("w1", "b1", "w2", "b2")}
    with open(os.path.join(os.environ["OUT_DIR"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
