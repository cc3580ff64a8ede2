#!/usr/bin/python3
"""What a user would run instead of Loom on the CPU, timed in one run on this machine, to
set beside loom-bench-optim and `loom bench comm` figures measured in the same session:

  copy_GBps                          torch copy, read + write bytes per second
  adam_{foreach,single}_ms_SIZE      torch.optim.Adam step on SIZE fp32 parameters
  adam_{foreach,single}_GBps_28B     the same as 28 bytes per parameter per step
  ds_onebit_roundtrip_ms_SIZE        DeepSpeed's 1-bit compressed allreduce path (torch ops,
                                     numpy packbits) on a world of one: the work Loom's
                                     compressed allreduce does with the onebit codec
  ds_onebit_roundtrip_input_GBps     fp32 input bytes per second of that round trip

Needs Debian's python3-torch and python3-numpy (apt-get install python3-torch
python3-numpy); run with /usr/bin/python3. Prints one JSON object.

  /usr/bin/python3 bench/peers/cpu_peers.py [--elements 64M] [--threads 2] [--iters 5]
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import onebit_round_trip, size_label  # noqa: E402


def parse_size(text):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * mult[text[-1].upper()] if text[-1].upper() in mult else int(text)


def median_seconds(fn, iters, warmup=1):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", default="64M", help="fp32 elements per buffer (default 64M)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--iters", type=int, default=5, help="timed calls, median kept (default 5)")
    args = ap.parse_args()
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    n = parse_size(args.elements)
    label = size_label(n)
    res = {"torch": torch.__version__, "numpy": np.__version__,
           "threads": torch.get_num_threads(), "elements": n}

    x = torch.randn(n)
    y = torch.empty_like(x)
    t = median_seconds(lambda: y.copy_(x), args.iters)
    res["copy_GBps"] = 2 * 4 * n / t / 1e9
    del y

    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    for name, foreach in (("foreach", True), ("single", False)):
        opt = torch.optim.Adam([p], lr=1e-3, foreach=foreach)
        t = median_seconds(opt.step, args.iters)
        res[f"adam_{name}_ms_{label}"] = t * 1e3
        res[f"adam_{name}_GBps_28B"] = 28 * n / t / 1e9
        del opt
    del p

    worker_error, server_error = torch.zeros(n), torch.zeros(n)
    pack = lambda bits: np.packbits(bits.numpy())  # noqa: E731
    unpack = lambda packed: torch.from_numpy(np.unpackbits(packed)).float()  # noqa: E731
    t = median_seconds(lambda: onebit_round_trip(torch, x, worker_error, server_error, pack,
                                                 unpack), max(1, min(args.iters, 3)))
    res[f"ds_onebit_roundtrip_ms_{label}"] = t * 1e3
    res["ds_onebit_roundtrip_input_GBps"] = 4 * n / t / 1e9
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
