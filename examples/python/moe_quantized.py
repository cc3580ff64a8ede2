"""A tiny character-level model with a Mixture-of-Experts feed-forward layer
(loom.torch.MoE over the moe plugin), trained on one CPU process with torch's Adam; then
its linear layers are quantized (loom.torch.QuantizedLinear over zeroquant W8A8, zeroquant
W4A8 and xtc ternary) and evaluated without any float copy of their weights.

    python3 examples/python/moe_quantized.py [--steps 200]

Prints the training loss with the aux loss and the expert load, then the evaluation loss of
the float model and of each quantized one.
"""
import argparse
import os
import sys

try:
    import loom
except ImportError:  # run from a checkout without installing the package
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                                    os.pardir, "bindings", "python"))
    import loom
import loom.torch
import torch
import torch.nn as nn
import torch.nn.functional as F

TEXT = ("experts take the tokens the gate sends them, each its share; the gate learns to "
        "spread the load, and the quantized layers keep only their codes. ") * 4

MANIFEST = """
[moe.ffn]
plugin = "moe"
num_experts = 4
k = 2
capacity_factor = 1.0

[quantizer.w8a8]
plugin = "zeroquant"
bits = 8

[quantizer.w4a8]
plugin = "zeroquant"
bits = 4
group_size = 16

[quantizer.ternary]
plugin = "xtc"
mode = "ternary"
"""


class Model(nn.Module):
    def __init__(self, vocab: int, d: int, moe: nn.Module) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.inp = nn.Linear(2 * d, d)  # the previous two characters
        self.moe = moe
        self.head = nn.Linear(d, vocab)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple:
        h = torch.tanh(self.inp(torch.cat([self.emb(a), self.emb(b)], dim=-1)))
        y, aux = self.moe(h)
        return self.head(h + y), aux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--aux", type=float, default=0.01, help="the aux loss coefficient")
    args = ap.parse_args()
    torch.manual_seed(0)
    chars = sorted(set(TEXT))
    ids = torch.tensor([chars.index(c) for c in TEXT])
    a, b, target = ids[:-2], ids[1:-1], ids[2:]
    with loom.Session.from_string(MANIFEST, "<moe_quantized>") as s:
        moe = loom.torch.MoE(s.instance("moe", "ffn"), args.dim, 2 * args.dim, seed=1)
        model = Model(len(chars), args.dim, moe)
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        for step in range(1, args.steps + 1):
            moe.step = step
            logits, aux = model(a, b)
            loss = F.cross_entropy(logits, target)
            opt.zero_grad()
            (loss + args.aux * aux).backward()
            opt.step()
            if step == 1 or step % max(1, args.steps // 5) == 0 or step == args.steps:
                st = moe.last_stats
                print(f"step {step:4d}  loss {loss.item():.4f}  aux {st['aux_loss']:.4f}  "
                      f"dropped {st['dropped']:3d}  load {st['load'].tolist()}")
        model.eval()
        with torch.no_grad():
            base = F.cross_entropy(model(a, b)[0], target).item()
            print(f"eval float32           loss {base:.4f}")
            for name in ("w8a8", "w4a8", "ternary"):
                inst = s.instance("quantizer", name)
                saved = (model.inp, model.head)
                model.inp = loom.torch.QuantizedLinear.from_linear(saved[0], inst)
                model.head = loom.torch.QuantizedLinear.from_linear(saved[1], inst)
                ql = F.cross_entropy(model(a, b)[0], target).item()
                packed = model.inp.qcodes.numel() + model.head.qcodes.numel()
                lay = model.head.layout
                scheme = lay.scheme if lay.scheme != "int" else f"int{lay.bits}"
                print(f"eval {name:8s} {scheme:8s} "
                      f"loss {ql:.4f}  ({packed} code bytes for "
                      f"{4 * (saved[0].weight.numel() + saved[1].weight.numel())} float bytes)")
                model.inp, model.head = saved


if __name__ == "__main__":
    main()
