"""A small GPT (character level, CPU) trained data-parallel with Loom's 1-bit Adam through
loom.torch.Optimizer, on torch.distributed (gloo); prints the loss and, at the end, the
traffic the optimizer saved against an uncompressed fp32 allreduce.

    torchrun --nproc_per_node 2 examples/python/gpt_onebit.py
    # or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (LOCAL_RANK):
    for r in 0 1; do RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 \\
      MASTER_PORT=29500 python3 examples/python/gpt_onebit.py & done; wait

Each rank trains on its own batches and hands the optimizer its local gradients: 1-bit
Adam averages them itself, uncompressed for the first --freeze-step steps (Adam's warmup),
then as 1-bit signs with error feedback. Its session's transport (ucx) sets up through
torch.distributed's group (loom.torch.distributed_bootstrap), so Loom opens no port of its
own.
"""
import argparse
import math
import os
import sys
import time

try:
    import loom
except ImportError:  # run from a checkout without installing the package
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                                    os.pardir, "bindings", "python"))
    import loom
import loom.torch
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

TEXT = (
    "the loom weaves the threads of many ranks into one model. each rank reads its own "
    "batches, and the optimizer averages what they learned. one bit per value crosses the "
    "wire once the variance is frozen, and the error each rank made is fed back next time, "
    "so nothing is lost for good. "
)


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (t.view(b, n, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.ln2(x))


class Gpt(nn.Module):
    def __init__(self, vocab: int, seq_len: int, d: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--freeze-step", type=int, default=60,
                    help="uncompressed warmup steps before 1-bit compression")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--log-every", type=int, default=25)
    args = ap.parse_args()

    if "RANK" not in os.environ:  # a world of one, without a launcher
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29500"))
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    loom.set_thread_count(1)

    chars = sorted(set(TEXT))
    data = torch.tensor([chars.index(c) for c in TEXT * 8], dtype=torch.long)
    torch.manual_seed(1234)  # the same initial model on every rank
    model = Gpt(len(chars), args.seq_len, args.d_model, args.layers, args.heads)
    numel = sum(p.numel() for p in model.parameters())
    # The session declares [comm.world] (ucx) and [codec.onebit] for the optimizer, and
    # takes torch.distributed's group as its bootstrap (bootstrap="auto").
    opt = loom.torch.Optimizer(model.parameters(), plugin="onebit_adam", lr=args.lr,
                               freeze_step=args.freeze_step, betas=(0.9, 0.999),
                               log_level="error")
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    if rank == 0:
        print(f"gpt: {args.layers} layers, d_model {args.d_model}, {numel} parameters; "
              f"{world} ranks, 1-bit Adam (warmup {args.freeze_step} steps)", flush=True)
    at_freeze = None
    t0 = time.time()
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, len(data) - args.seq_len - 1, (args.batch,), generator=gen)
        x = torch.stack([data[s:s + args.seq_len] for s in starts])
        y = torch.stack([data[s + 1:s + 1 + args.seq_len] for s in starts])
        loss = F.cross_entropy(model(x).view(-1, len(chars)), y.view(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()  # averages the local gradients itself: no allreduce here
        if step == args.freeze_step:
            at_freeze = opt.comm_info()
        if rank == 0 and (step % args.log_every == 0 or step == args.steps):
            print(f"step {step:4d}  loss {loss.item():.3f}  ({time.time() - t0:.1f} s)",
                  flush=True)
    info = opt.comm_info()

    # The ranks' models after compressed averaging (the same on every rank by design).
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    same = all(torch.equal(gathered[0], g) for g in gathered)
    if rank == 0:
        def line(label, sent, plain):
            saved = 100.0 * (1 - sent / plain) if plain else 0.0
            ratio = plain / sent if sent else float("inf")
            print(f"  {label}: sent {sent} bytes, an fp32 allreduce {plain} bytes: "
                  f"{saved:.1f}% saved ({ratio:.1f}x less)")

        print(f"traffic of rank 0 over {args.steps} steps "
              f"({info['rounds']} collective rounds):")
        line("all steps", info["bytes_sent"], info["uncompressed_bytes_sent"])
        if at_freeze is not None and args.steps > args.freeze_step:
            line(f"steps 1-{args.freeze_step} (warmup, uncompressed)",
                 at_freeze["bytes_sent"], at_freeze["uncompressed_bytes_sent"])
            line(f"steps {args.freeze_step + 1}-{args.steps} (1-bit)",
                 info["bytes_sent"] - at_freeze["bytes_sent"],
                 info["uncompressed_bytes_sent"] - at_freeze["uncompressed_bytes_sent"])
        print(f"ranks' parameters identical: {'yes' if same else 'NO'}", flush=True)
    opt.close()
    dist.destroy_process_group()
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
