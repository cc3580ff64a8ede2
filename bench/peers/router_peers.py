"""What a PyTorch user runs to drop tokens from a layer, timed on the same machine and shapes as
`loom bench router`: the kept rows of x [B, S, C] gathered with `index_select` over the
flattened [B * S, C] view (row b * S + position), written back with `index_copy_`, and the
random subset drawn as a batched argsort of uniform keys, then sorted (a uniform random subset
per sequence in position order). The reference in the same run is torch's own contiguous copy
of the same bytes (`Tensor.copy_`), so a ratio can be quoted beside Loom's ratio to its roof.

Prints one JSON object per line, the keys matching the bench's:
    {"kind":"peer", "op" (index_select|index_copy_|copy_|select), "device", "dtype", "batch",
     "seq_len", "kept", "channels", "threads", "bytes", "seconds", "gb_per_s", "ratio_to_copy"}
With --device cuda the same on the GPU (each timing ends with torch.cuda.synchronize).
gb_per_s counts reads plus writes of the moved rows (bytes each way), as the bench does.
Without torch it prints {"kind":"skip", "reason": ...} and exits 0.

    /usr/bin/python3 bench/peers/router_peers.py --seq-lens 2048,32768 --channels 512,1024
"""
import argparse
import json
import os
import time


def best_seconds(fn, reps, sync=lambda: None):
    fn()  # warm: allocations, first-touch
    sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def int_list(s):
    return [int(v) for v in s.split(",") if v]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-lens", type=int_list, default=[2048, 32768])
    ap.add_argument("--channels", type=int_list, default=[512, 1024])
    ap.add_argument("--keep", type=float, default=0.5)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (torch with CUDA)")
    args = ap.parse_args()
    try:
        import torch
    except ImportError as e:
        print(json.dumps({"kind": "skip", "peer": "torch",
                          "reason": f"torch is not installed ({e}); Debian: "
                                    "apt-get install python3-torch"}))
        return
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)  # every core, as Loom's side uses
    dev = torch.device(args.device)
    sync = lambda: None  # noqa: E731
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            print(json.dumps({"kind": "skip", "peer": "torch", "device": "cuda",
                              "reason": "torch has no CUDA device"}))
            return
        sync = torch.cuda.synchronize
    gen = torch.Generator(device=dev).manual_seed(1234)
    for name in args.dtypes.split(","):
        if name not in dtypes:
            raise SystemExit(f"--dtypes: '{name}' is not one of {', '.join(dtypes)}")
        dt = dtypes[name]
        for S in args.seq_lens:
            for C in args.channels:
                B = args.batch
                K = min(S, max(1, int(args.keep * S + 0.5)))
                full = torch.ones(B * S, C, dtype=dt, device=dev)
                kept = torch.empty(B * K, C, dtype=dt, device=dev)
                idx = None

                def select():
                    nonlocal idx
                    keys = torch.rand(B, S, generator=gen, device=dev)
                    pos = keys.argsort(dim=1)[:, :K].sort(dim=1).values
                    idx = (pos + torch.arange(B, device=dev).unsqueeze(1) * S).reshape(-1)

                sel = best_seconds(select, args.reps, sync)
                src = full[: B * K]  # contiguous rows, the same bytes as the kept ones
                moves = {
                    "copy_": lambda: kept.copy_(src),
                    "index_select": lambda: torch.index_select(full, 0, idx, out=kept),
                    "index_copy_": lambda: full.index_copy_(0, idx, kept),
                }
                secs = {}
                for _ in range(args.reps):  # interleaved, as the bench does
                    for op, fn in moves.items():
                        secs[op] = min(secs.get(op, float("inf")), best_seconds(fn, 1, sync))
                nbytes = B * K * C * full.element_size()
                copy_gbs = 2 * nbytes / secs["copy_"] / 1e9
                base = {"kind": "peer", "peer": f"torch {torch.__version__}",
                        "device": dev.type, "dtype": name,
                        "batch": B, "seq_len": S, "kept": K, "channels": C, "threads": threads}
                for op, sec in secs.items():
                    gbs = 2 * nbytes / sec / 1e9
                    print(json.dumps({**base, "op": op, "bytes": nbytes, "seconds": sec,
                                      "gb_per_s": gbs, "ratio_to_copy": gbs / copy_gbs}),
                          flush=True)
                print(json.dumps({**base, "op": "select", "seconds": sel,
                                  "positions_per_s": B * S / sel}), flush=True)


if __name__ == "__main__":
    main()
