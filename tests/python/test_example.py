"""examples/python/gpt_onebit.py, the small GPT trained with 1-bit Adam, for a few steps on
2 processes started with torchrun's variables: it trains, the ranks stay identical, and the
traffic it prints is what the counters say (the compressed steps send far less than an fp32
allreduce)."""
import math
import os
import re
import socket
import sys

import pytest

pytest.importorskip("torch")

import loom  # noqa: E402

from conftest import ROOT, report, run_together  # noqa: E402

EXAMPLE = os.path.join(ROOT, "examples", "python", "gpt_onebit.py")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_gpt_onebit_on_two_ranks():
    try:
        loom.describe_plugins("ucx")
    except loom.LoomError as e:
        pytest.skip(f"the ucx transport is not built: {e}")
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    port = str(_free_port())
    base = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    base.update(UCX_LOG_LEVEL="error", PYTHONPATH=os.path.join(ROOT, "bindings", "python"))
    argv = [sys.executable, EXAMPLE, "--steps", "12", "--freeze-step", "4", "--log-every", "4",
            "--layers", "1", "--d-model", "32"]
    results = run_together(
        [(argv, dict(base, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=port)) for r in (0, 1)],
        180, "the example")
    assert [rc for rc, _, _ in results] == [0, 0], report(results)
    # stdout only: c10d and gloo may warn on stderr (a socket retry, ...).
    out = results[0][1]
    assert results[1][1] == "", results[1][1]  # only rank 0 prints
    losses = [float(x) for x in re.findall(r"^step +\d+  loss ([0-9.]+)", out, re.M)]
    assert len(losses) == 3 and all(math.isfinite(x) and x > 0 for x in losses), out
    numel = int(re.search(r"(\d+) parameters", out).group(1))
    traffic = {m.group(1): (int(m.group(2)), int(m.group(3))) for m in re.finditer(
        r"^  (.+?): sent (\d+) bytes, an fp32 allreduce (\d+) bytes", out, re.M)}
    assert set(traffic) == {"all steps", "steps 1-4 (warmup, uncompressed)",
                            "steps 5-12 (1-bit)"}, out
    # An fp32 allreduce of the gradients: 4 bytes per parameter per step.
    assert traffic["all steps"][1] == 12 * 4 * numel
    warm, onebit = traffic["steps 1-4 (warmup, uncompressed)"], traffic["steps 5-12 (1-bit)"]
    assert warm[0] == warm[1] == 4 * 4 * numel
    assert 0 < onebit[0] * 16 < onebit[1], onebit  # 1 bit per value (and scales): ~32x less
    assert "ranks' parameters identical: yes" in out
