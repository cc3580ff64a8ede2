"""What a DeepSpeed user runs for the data-efficiency pipeline, timed on the same machine as
`loom bench data`: the data analyzer's map stage for the `seqlen` and vocabulary-rarity
metrics (DeepSpeed's analyzer calls a metric function on batches of samples as torch
tensors; the rarity function indexes a table of log-probabilities and sums per row), and
the curriculum sampler's per-batch draw (numpy: choose a cluster per slot with probability
proportional to its size, take ids from the clusters' cursors, shuffle the batch).

Samples are the ones Loom's analyzer scores: sample i is the seq_len input tokens starting at
token i * seq_len of the train split of a `loom data prepare` dataset. Prints one JSON object.

    /usr/bin/python3 bench/peers/data_peers.py --dataset build/data/fortunes.bin --seq-len 128
"""
import argparse
import json
import os
import struct
import sys
import time


def best_seconds(fn, reps):
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", required=True, help="a dataset file from `loom data prepare`")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=10000, help="samples per metric call")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--clusters", type=int, default=100)
    ap.add_argument("--global-batch", type=int, default=512)
    ap.add_argument("--sampler-samples", type=int, default=10_000_000)
    args = ap.parse_args()

    import numpy as np
    import torch

    with open(args.dataset, "rb") as f:
        header = f.read(64)
    if header[:8] != b"LOOMDATA":
        sys.exit(f"{args.dataset}: not a Loom dataset file")
    vocab, header_bytes, train_tokens = struct.unpack_from("<IIQ", header, 16)
    tokens = np.memmap(args.dataset, dtype=np.uint16, mode="r", offset=header_bytes,
                       shape=(train_tokens,))
    L = args.seq_len
    n = (train_tokens - 1) // L
    windows = np.asarray(tokens[: n * L]).reshape(n, L)
    torch.set_num_threads(os.cpu_count() or 1)  # all cores, as Loom's side uses

    counts = torch.bincount(torch.from_numpy(windows.astype(np.int64)).reshape(-1),
                            minlength=vocab).double()
    counts[counts == 0] = 1
    neg_log_p = -torch.log(counts / counts.sum())

    def map_stage(metric):
        out = []
        for b in range(0, n, args.batch):
            batch = torch.from_numpy(windows[b:b + args.batch].astype(np.int64))
            if metric == "seqlen":
                out.append(torch.count_nonzero(batch >= 0, dim=1))
            else:
                out.append(neg_log_p[batch].sum(dim=1))
        return torch.cat(out)

    result = {"samples": int(n), "seq_len": L, "torch_threads": torch.get_num_threads()}
    payload = n * L * 2
    for metric in ("seqlen", "vocabulary_rarity"):
        s = best_seconds(lambda: map_stage(metric), args.reps)
        result[f"{metric}_map_s"] = s
        result[f"{metric}_map_GBps"] = payload / s / 1e9

    # DeepSpeed's sampler draw for one global batch over `clusters` equal clusters.
    rng = np.random.default_rng(1234)
    sizes = np.full(args.clusters, args.sampler_samples // args.clusters)
    clusters = [rng.permutation(s) for s in sizes]
    cursors = np.zeros(args.clusters, dtype=np.int64)
    weights = sizes / sizes.sum()

    def draw():
        picked = np.bincount(rng.choice(args.clusters, args.global_batch, replace=True,
                                        p=weights), minlength=args.clusters)
        parts = []
        for c in np.nonzero(picked)[0]:
            k = picked[c]
            if cursors[c] + k > sizes[c]:
                clusters[c] = rng.permutation(sizes[c])
                cursors[c] = 0
            parts.append(clusters[c][cursors[c]:cursors[c] + k])
            cursors[c] += k
        batch = np.concatenate(parts)
        rng.shuffle(batch)
        return batch

    draws = 200
    s = best_seconds(lambda: [draw() for _ in range(draws)], args.reps)
    result["sampler_us_per_batch"] = s / draws * 1e6
    result["sampler_global_batch"] = args.global_batch
    result["sampler_clusters"] = args.clusters
    print(json.dumps(result))


if __name__ == "__main__":
    main()
