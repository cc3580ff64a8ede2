"""examples/python/moe_quantized.py for a few steps: the MoE model trains (its loss falls,
the load covers every token choice) and the quantized evaluations run."""
import os
import re
import runpy
import sys

import pytest

pytest.importorskip("torch")

from conftest import ROOT  # noqa: E402

EXAMPLE = os.path.join(ROOT, "examples", "python", "moe_quantized.py")


def test_moe_quantized_example(capsys, monkeypatch):
    # in this interpreter (torch is imported once for the suite), as `python3 EXAMPLE`
    monkeypatch.setattr(sys, "argv", [EXAMPLE, "--steps", "10"])
    runpy.run_path(EXAMPLE, run_name="__main__")
    out = capsys.readouterr().out
    steps = re.findall(r"step +(\d+) +loss ([\d.]+) +aux ([\d.]+) +dropped +(\d+) +load "
                       r"\[([\d, ]+)\]", out)
    assert len(steps) >= 2, out
    assert float(steps[-1][1]) < float(steps[0][1])
    sums = {sum(int(v) for v in load.split(",")) for *_, load in steps}
    # the same batch every step, k = 2 choices per token, all counted before capacity
    assert len(sums) == 1 and sums.pop() % 2 == 0
    assert all(float(aux) > 0.5 for _, _, aux, _, _ in steps)
    assert any(int(dropped) > 0 for _, _, _, dropped, _ in steps)  # capacity_factor 1.0
    evals = dict(re.findall(r"eval (\w+) .*loss ([\d.]+)", out))
    assert set(evals) == {"float32", "w8a8", "w4a8", "ternary"}, out
    assert abs(float(evals["w8a8"]) - float(evals["float32"])) < 0.1
