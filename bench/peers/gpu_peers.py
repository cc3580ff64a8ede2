#!/usr/bin/env python3
"""What a user would run instead of Loom on one GPU, timed in one run with CUDA events, to
set beside loom-bench-codec and loom-bench-optim (scripts/gpu-check.sh runs them together):

  gpu, torch                          the device and torch's version
  copy_GBps                           device-to-device copy, read + write bytes per second
  adam_{fused,foreach}_ms_SIZE        torch.optim.Adam step on SIZE fp32 parameters
  adam_{fused,foreach}_GBps_28B       the same as 28 bytes per parameter per step
  ds_onebit_roundtrip_ms_SIZE         DeepSpeed's 1-bit compressed allreduce path (torch ops,
                                      cupy packbits) on a world of one: the work Loom's
                                      onebit round trip does (loom-bench-codec)
  ds_onebit_roundtrip_input_GBps      fp32 input bytes per second of that round trip
  ds_onebit_error                     why that path did not run (no cupy, ...), if it did not

Needs PyTorch with CUDA and CuPy. Prints one JSON object on stdout; with $OUT set, also
writes it to $OUT/peers.json.

  python3 gpu_peers.py [--elements 256M] [--iters 10]
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import onebit_round_trip, size_label  # noqa: E402


def parse_size(text):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * mult[text[-1].upper()] if text[-1].upper() in mult else int(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", default="256M", help="fp32 elements per buffer (default 256M)")
    ap.add_argument("--iters", type=int, default=10, help="timed calls, mean kept (default 10)")
    args = ap.parse_args()
    import torch

    def mean_seconds(fn, iters, warmup=3):
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / iters

    dev = "cuda"
    n = parse_size(args.elements)
    label = size_label(n)
    res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "elements": n}

    x = torch.randn(n, device=dev)
    y = torch.empty_like(x)
    res["copy_GBps"] = 2 * 4 * n / mean_seconds(lambda: y.copy_(x), args.iters) / 1e9
    del y

    p = torch.nn.Parameter(torch.randn(n, device=dev))
    p.grad = torch.randn(n, device=dev)
    for name in ("fused", "foreach"):
        opt = torch.optim.Adam([p], lr=1e-3, fused=name == "fused", foreach=name == "foreach")
        t = mean_seconds(opt.step, args.iters)
        res[f"adam_{name}_ms_{label}"] = t * 1e3
        res[f"adam_{name}_GBps_28B"] = 28 * n / t / 1e9
        del opt
    del p
    torch.cuda.empty_cache()

    try:
        import cupy

        worker_error = torch.zeros(n, device=dev)
        server_error = torch.zeros(n, device=dev)
        pack = lambda bits: cupy.packbits(cupy.asarray(bits))  # noqa: E731
        unpack = lambda packed: torch.as_tensor(cupy.unpackbits(packed), device=dev).float()  # noqa: E731
        t = mean_seconds(lambda: onebit_round_trip(torch, x, worker_error, server_error, pack,
                                                   unpack), max(1, args.iters // 2))
        res[f"ds_onebit_roundtrip_ms_{label}"] = t * 1e3
        res["ds_onebit_roundtrip_input_GBps"] = 4 * n / t / 1e9
    except Exception as e:  # the figure is missing, and the summary says why
        res["ds_onebit_error"] = repr(e)

    text = json.dumps(res, indent=1)
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "peers.json"), "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
