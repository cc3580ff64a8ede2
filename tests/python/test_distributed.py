"""loom.torch.Optimizer over onebit_adam on 2 processes, started as torchrun starts them
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: the host's env bootstrap), and under torchrun
itself when it is installed."""
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from conftest import ROOT, report, run_together

pytest.importorskip("torch")

import loom  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "onebit_worker.py")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _need_ucx():
    try:
        loom.describe_plugins("ucx")
    except loom.LoomError as e:
        pytest.skip(f"the ucx transport is not built: {e}")


def _env(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OUT_DIR=str(tmp_path), UCX_LOG_LEVEL="error", LOOM_NUM_THREADS="1",
               LOOM_BOOTSTRAP_TIMEOUT="60")
    return env


def _check(tmp_path, shard=False):
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    # 1-bit Adam's warmup is Adam over the averaged gradients (uncompressed allreduce).
    for r in ranks:
        if r["plugin"] == "onebit_adam":
            assert r["warmup_rel"] < 1e-6, r["warmup_rel"]
    # After the freeze, compressed averaging keeps the ranks' parameters identical (0/1
    # Adam's local steps keep them apart between its syncs).
    if ranks[0]["plugin"] != "zero_one_adam":
        assert ranks[0]["params"] == ranks[1]["params"]
    info = ranks[0]["info"]
    assert info["owns_communication"] == 1
    if shard:
        # The parameters are allgathered in fp32: about half an fp32 allreduce a step.
        assert 0 < info["bytes_sent"] < info["uncompressed_bytes_sent"], info
        # m, v and the server error for half the 1173 parameters (padded to 1184), the worker
        # error for all: (1 + 3/2) * 4 = 10 bytes a parameter, where unsharded keeps
        # (3 + 1/2) * 4 = 14 (m, v and the worker error for all, the server error for half).
        assert ranks[0]["state_bytes"] < 11 * 1173, ranks[0]["state_bytes"]
    else:
        assert 0 < info["bytes_sent"] < info["uncompressed_bytes_sent"] / 2, info
        assert ranks[0]["state_bytes"] > 14 * 1173, ranks[0]["state_bytes"]


def _spawn(tmp_path, codes=(0, 0), **extra):
    """Ranks 0 and 1 of the worker, with the launcher's variables set here. Returns their
    stdout (the worker's results and errors; warnings go to stderr)."""
    port = str(_free_port())
    commands = []
    for r in (0, 1):
        env = dict(_env(tmp_path), RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **extra)
        commands.append(([sys.executable, WORKER], env))
    results = run_together(commands, 180, "the two ranks")
    assert [rc for rc, _, _ in results] == list(codes), report(results)
    if codes == (0, 0):
        _check(tmp_path, shard=bool(extra.get("WORKER_SHARD")))
    return [out for _, out, _ in results]


def test_two_ranks_from_launcher_variables(tmp_path):
    _need_ucx()
    _spawn(tmp_path)


def test_two_ranks_with_sharded_state(tmp_path):
    """shard_state = true through the Python binding: each rank keeps half the moments, the
    ranks' parameters stay identical, the warmup is Adam's."""
    _need_ucx()
    _spawn(tmp_path, WORKER_SHARD="1")


@pytest.mark.parametrize("plugin", ["onebit_adam", "zero_one_adam", "onebit_lamb"])
def test_two_ranks_with_gradient_hooks(tmp_path, plugin):
    """overlap_backward=True: the backward's hooks announce each gradient, the optimizer's
    buckets start during the backward; the parameters stay the bits of the same buckets
    stepped without hooks, through each of its phases. A second backward before step() is
    refused, and the optimizer goes on after it."""
    _need_ucx()
    _spawn(tmp_path, WORKER_OVERLAP="1", WORKER_OVERLAP_PLUGIN=plugin)
    for r in (0, 1):
        out = json.load(open(tmp_path / f"rank{r}.json"))
        assert out["overlap_identical"] is True
        # A second backward before step() is refused, and the run goes on after it.
        assert "announced already" in out["second_backward"], out["second_backward"]
        assert out["stepped_after_refusal"] is True


def test_two_ranks_over_torch_distributed(tmp_path):
    """torch.distributed (gloo) started from the launcher's variables holds MASTER_PORT on
    rank 0; loom.torch.Optimizer(plugin="onebit_adam") takes its group as the bootstrap, so
    the host opens no rendezvous of its own (which would find the port taken). A second
    optimizer is interrupted after the freeze and resumed from its state dict."""
    _need_ucx()
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    _spawn(tmp_path, WORKER_MODE="torch_distributed")
    for r in (0, 1):
        got = json.load(open(tmp_path / f"rank{r}.json"))
        assert got["bootstrap"] == f"<loom.Bootstrap rank {r} of 2 (local {r})>"
        kinds = sorted((i["section"], i["name"], i["plugin"]) for i in got["session"])
        assert kinds == [("codec", "onebit", "onebit"), ("comm", "world", "ucx"),
                         ("optimizer", "main", "onebit_adam")]
        # Interrupted after the freeze and resumed from torch.save: the same bits, and the
        # traffic counters restored with the state.
        assert got["resumed_identical"] is True
        assert got["resumed_info"]["bytes_sent"] == got["info"]["bytes_sent"]


# Debian 12's torch 1.13 torchrun fails under Python 3.11 before starting anything: it cannot
# parse its own default --redirects / --tee. docs/python.md (and docs/trainer.md) give this
# workaround: say them, and where the ranks' output goes.
TORCHRUN_WORKAROUND = ["--redirects", "1", "--tee", "1", "--log_dir"]


def _torchrun_flags(torchrun, tmp_path):
    """[] when torchrun starts processes as is, the workaround's flags when only those make
    it start, None when neither does."""
    for flags in ([], TORCHRUN_WORKAROUND + [str(tmp_path / "probe-logs")]):
        probe = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "1", *flags,
                                "--no_python", "true"], capture_output=True, text=True,
                               timeout=120)
        if probe.returncode == 0:
            return flags
    return None


def test_the_torchrun_workaround_is_documented():
    with open(os.path.join(ROOT, "docs", "python.md"), encoding="utf-8") as f:
        doc = f.read()
    assert " ".join(TORCHRUN_WORKAROUND) + " DIR" in doc


def test_two_ranks_under_torchrun(tmp_path):
    _need_ucx()
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    flags = _torchrun_flags(torchrun, tmp_path)
    if flags is None:
        pytest.skip("this torchrun cannot start a process, even with "
                    f"{' '.join(TORCHRUN_WORKAROUND)} DIR")
    if flags:
        flags = TORCHRUN_WORKAROUND + [str(tmp_path / "logs")]
    results = run_together([([torchrun, "--nproc_per_node", "2", *flags, "--master_addr",
                              "127.0.0.1", "--master_port", str(_free_port()), WORKER],
                             _env(tmp_path))], 240, "torchrun")
    assert results[0][0] == 0, report(results)
    _check(tmp_path)


def test_the_hosts_own_rendezvous_cannot_share_torch_distributeds_port(tmp_path):
    """The contrast to the test above: with bootstrap=None the host's env rendezvous wants
    MASTER_PORT, which torch.distributed's store holds on rank 0."""
    _need_ucx()
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    outs = _spawn(tmp_path, codes=(3, 3), WORKER_MODE="torch_distributed_host_bootstrap",
                  LOOM_BOOTSTRAP_TIMEOUT="3")
    errors = [[ln for ln in out.splitlines() if ln.startswith("UnavailableError:")]
              for out in outs]
    assert errors[0] and errors[1], outs
    assert "env bootstrap: rank 0 cannot listen on port" in errors[0][-1], outs[0]
    assert "(MASTER_PORT): Address already in use" in errors[0][-1], outs[0]
    assert "env bootstrap: rank 1 of 2" in errors[1][-1], outs[1]
