"""Group quantization and fp32 matmuls written in torch, timed on the same machine and shapes
as `loom bench quant`: what a PyTorch user runs to store a weight in INT8, INT4 or ternary
form (our own code, plain torch ops), and torch's fp32 matmul of the shapes whose quantized
versions the bench times (the reference a user would compare against).

Group quantization of W [N, K] in groups of G along K:
    int8, int4: symmetric, s = max|w| / (2^(b-1) - 1) per group, q = round(w / s) clamped,
                int8 codes stored as int8, int4 codes packed two per byte (low nibble first);
    ternary:    Delta = 0.7 mean|w| per group, alpha = mean |w| over |w| > Delta, codes
                0 / 1 / 2 packed four per byte (lowest bits first).
The traffic counted is the same as the bench's: W read once, codes and float32 scales
written once. The reference in the same run is torch's own copy of the same number of bytes
(`Tensor.copy_` of the output size, plus a `sum` over the rest of W), as the bench's roof.

Prints one JSON object per line:
    {"kind":"peer_quant", "scheme", "rows", "cols", "group_size", "threads", "seconds",
     "gb_per_s", "roof_gb_per_s", "ratio_to_roof"}
    {"kind":"peer_matmul", "m", "n", "k", "threads", "seconds", "gflops"}
Without torch it prints {"kind":"skip", "reason": ...} and exits 0.

    /usr/bin/python3 bench/peers/quant_peers.py --reps 5
"""
import argparse
import json
import os
import time


def best_seconds(fn, reps):
    fn()  # warm: allocations, first touch
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def int_list(s):
    return [int(v) for v in s.split(",") if v]


def quantize_int(torch, w, group, bits):
    """Symmetric group quantization; returns (codes, scales)."""
    n, k = w.shape
    g = w.view(n, k // group, group)
    qmax = 2 ** (bits - 1) - 1
    scales = g.abs().amax(dim=2, keepdim=True) / qmax
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = torch.round(g / scales).clamp_(-qmax, qmax).to(torch.int8)
    if bits == 4:
        u = (q.view(n, k // 2, 2) & 0xF).to(torch.uint8)
        q = u[..., 0] | (u[..., 1] << 4)
    return q, scales


def quantize_ternary(torch, w, group, threshold=0.7):
    """Ternary group quantization (TWN); returns (packed codes, alphas)."""
    n, k = w.shape
    g = w.view(n, k // group, group)
    a = g.abs()
    delta = threshold * a.mean(dim=2, keepdim=True)
    keep = a > delta
    kept = keep.sum(dim=2, keepdim=True).clamp_(min=1)
    alpha = (a * keep).sum(dim=2, keepdim=True) / kept
    codes = (keep & (g > 0)).to(torch.uint8) | ((keep & (g < 0)).to(torch.uint8) << 1)
    c = codes.view(n, k // 4, 4)
    packed = c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)
    return packed, alpha


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quant-shape", type=int_list, default=[4096, 4096])
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--gemm-sizes", type=int_list, default=[2048])
    ap.add_argument("--decode-shape", type=int_list, default=[4096, 4096])
    ap.add_argument("--decode-batches", type=int_list, default=[1, 4, 16])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    args = ap.parse_args()
    try:
        import torch
    except ImportError as e:
        print(json.dumps({"kind": "skip", "peer": "torch",
                          "reason": f"torch is not installed ({e}); Debian: "
                                    "apt-get install python3-torch"}))
        return
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)  # every core, as Loom's side uses
    torch.manual_seed(1)

    n, k = args.quant_shape
    group = args.group_size
    if k % group != 0:
        raise SystemExit(f"--group-size {group} must divide K = {k} (the torch code reshapes)")
    w = torch.randn(n, k) * 0.05
    flat = w.view(-1)
    read = w.numel() * 4
    for scheme, bits in (("int8", 8), ("int4", 4), ("ternary", 2)):
        written = w.numel() * bits // 8 + (w.numel() // group) * 4
        out = torch.empty(written // 4, dtype=torch.float32)
        if scheme == "ternary":
            fn = lambda: quantize_ternary(torch, w, group)
        else:
            fn = lambda b=bits: quantize_int(torch, w, group, b)

        def roof():
            out.copy_(flat[: out.numel()])
            return flat[out.numel():].sum()

        t = best_seconds(fn, args.reps)
        r = best_seconds(roof, args.reps)
        gbs = (read + written) / t / 1e9
        roof_gbs = (read + written) / r / 1e9
        print(json.dumps({"kind": "peer_quant", "scheme": scheme, "rows": n, "cols": k,
                          "group_size": group, "threads": threads, "seconds": t,
                          "gb_per_s": gbs, "roof_gb_per_s": roof_gbs,
                          "ratio_to_roof": gbs / roof_gbs}), flush=True)

    shapes = [(s, s, s) for s in args.gemm_sizes]
    shapes += [(8 * 128, nn, kk) for nn, kk in ((384, 128), (128, 128), (512, 128), (128, 512))]
    dn, dk = args.decode_shape
    shapes += [(m, dn, dk) for m in args.decode_batches]
    for m, nn, kk in shapes:
        x = torch.randn(m, kk)
        wt = torch.randn(nn, kk)
        t = best_seconds(lambda: torch.matmul(x, wt.t()), args.reps)
        print(json.dumps({"kind": "peer_matmul", "m": m, "n": nn, "k": kk, "threads": threads,
                          "seconds": t, "gflops": 2.0 * m * nn * kk / t / 1e9}), flush=True)


if __name__ == "__main__":
    main()
