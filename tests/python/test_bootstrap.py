"""loom.Bootstrap: a session's bootstrap from Python callables (the host calls them for its
transports' set-up), and the errors they raise reaching Loom as statuses."""
import threading

import pytest

import loom

UCX = """
[comm.world]
plugin = "ucx"
"""


def _need_ucx():
    try:
        loom.describe_plugins("ucx")
    except loom.LoomError as e:
        pytest.skip(f"the ucx transport is not built: {e}")


def test_two_ranks_in_threads_set_up_through_the_callables():
    """Two sessions in two threads of this process, ranks 0 and 1 of a world whose
    allgather and barrier are Python (threading): ucx exchanges its worker addresses through
    them and connects the two ranks."""
    _need_ucx()
    size = 2
    meet = threading.Barrier(size, timeout=60)
    slots = [None] * size
    calls = [[], []]

    def collectives(rank):
        def allgather(data):
            calls[rank].append(len(data))
            slots[rank] = data
            meet.wait()
            out = b"".join(slots)
            meet.wait()  # nobody overwrites a slot before every rank has read them all
            return out

        return allgather, lambda: meet.wait()

    results = [None] * size

    def rank_main(rank):
        try:
            b = loom.Bootstrap(rank, size, rank, *collectives(rank))
            with loom.Session.from_string(UCX, "ucx.toml", bootstrap=b, log_level="error") as s:
                results[rank] = [i["plugin"] for i in s.describe()]
                assert not b._statuses
        except BaseException as e:  # reported below
            results[rank] = e
            meet.abort()

    # Daemon threads, their joins checked: a stuck rank fails the test, not hangs pytest.
    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), f"a rank is stuck after 120 s: {results}"
    assert results == [["ucx"], ["ucx"]], results
    # Two rounds: the address lengths, then the addresses.
    assert len(calls[0]) >= 2 and calls[0] == calls[1] and all(n > 0 for n in calls[0])


@pytest.mark.parametrize("exc,cls", [
    (RuntimeError("the group is gone"), loom.UnavailableError),
    (TimeoutError("30 s"), loom.DeadlineExceededError),
    (loom.InvalidArgumentError("bad bytes"), loom.InvalidArgumentError),
])
def test_a_raising_callable_fails_the_open_with_its_text(exc, cls):
    """Rank 0 of 2: ucx's first step is the allgather, which fails before any peer."""
    _need_ucx()

    def allgather(data):
        raise exc

    b = loom.Bootstrap(0, 2, 0, allgather, lambda: None)
    with pytest.raises(cls) as e:
        loom.Session.from_string(UCX, "ucx.toml", bootstrap=b, log_level="off")
    assert f"bootstrap allgather on rank 0 of 2: {type(exc).__name__}: {exc}" in str(e.value)
    assert not b._statuses  # Loom destroyed the status it was given


def test_a_wrong_length_result_is_an_error():
    _need_ucx()
    b = loom.Bootstrap(0, 2, 0, lambda d: d + b"x", lambda: None)
    with pytest.raises(loom.InvalidArgumentError, match=r"returned \d+ bytes, not size"):
        loom.Session.from_string(UCX, "ucx.toml", bootstrap=b, log_level="off")


def test_bad_arguments():
    ok = (lambda d: d, lambda: None)
    for args, what in (((1, 1, 0), "0 <= rank < size"), ((0, 0, 0), "size >= 1"),
                       ((0, 2, 2), "local_rank 2"), ((0.5, 1, 0), "rank must be an integer")):
        with pytest.raises(loom.InvalidArgumentError, match=what):
            loom.Bootstrap(*args, *ok)
    with pytest.raises(loom.InvalidArgumentError, match="callables"):
        loom.Bootstrap(0, 1, 0, None, None)
    with pytest.raises(loom.InvalidArgumentError, match="must be a loom.Bootstrap"):
        loom.Session.from_string("", bootstrap=object())


def test_distributed_bootstrap_needs_an_initialised_group():
    torch = pytest.importorskip("torch")
    import loom.torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        pytest.skip("torch.distributed is initialised in this process")
    with pytest.raises(loom.FailedPreconditionError, match="not initialised"):
        loom.torch.distributed_bootstrap()


def test_optimizer_bootstrap_argument():
    pytest.importorskip("torch")
    import torch

    import loom.torch

    p = torch.zeros(3, requires_grad=True)
    with loom.Session.from_string('[optimizer.main]\nplugin = "adam"\n') as s:
        with pytest.raises(loom.InvalidArgumentError, match="bootstrap= goes with plugin="):
            loom.torch.Optimizer([p], s.optimizer(), bootstrap=None)
    with pytest.raises(loom.InvalidArgumentError, match="'auto', None or a loom.Bootstrap"):
        loom.torch.Optimizer([p], plugin="adam", bootstrap="gloo")
    # A world of one given explicitly: adam opens and steps as usual.
    b = loom.Bootstrap(0, 1, 0, lambda d: d, lambda: None)
    opt = loom.torch.Optimizer([p], plugin="adam", lr=0.1, bootstrap=b)
    assert opt._session._bootstrap is b
    p.grad = torch.ones(3)
    opt.step()
    assert torch.all(p < 0)
    opt.close()


@pytest.mark.parametrize("plugin", ["onebit_adam", "zero_one_adam", "onebit_lamb"])
def test_the_one_bit_family_by_name_declares_its_transport_and_codec(plugin):
    _need_ucx()
    torch = pytest.importorskip("torch")
    import loom.torch

    p = torch.ones(5, requires_grad=True)
    opt = loom.torch.Optimizer([p], plugin=plugin, lr=0.1, log_level="error")
    got = sorted((i["section"], i["name"], i["plugin"]) for i in opt._session.describe())
    assert got == [("codec", "onebit", "onebit"), ("comm", "world", "ucx"),
                   ("optimizer", "main", plugin)]
    assert opt.comm_info()["owns_communication"] == 1
    p.grad = torch.ones(5)
    opt.step()  # a world of one (no launcher, no torch.distributed)
    assert torch.all(p < 1)
    opt.close()
    with pytest.raises(loom.InvalidArgumentError, match="comm.world: unknown plugin .no_such_transport."):
        loom.torch.Optimizer([p], plugin=plugin, comm_plugin="no_such_transport")


class _FakeDist:
    """torch.distributed as seen by loom.torch: initialised, with a given backend, its
    collectives those of a world of one (recorded)."""

    def __init__(self, backend):
        self.backend = backend
        self.calls = []

    def is_available(self):
        return True

    def is_initialized(self):
        return True

    def get_backend(self, group=None):
        return self.backend

    def get_rank(self, group=None):
        return 0

    def get_world_size(self, group=None):
        return 1

    def all_gather(self, parts, mine, group=None):
        self.calls.append("all_gather")
        parts[0].copy_(mine)

    def barrier(self, group=None):
        self.calls.append("barrier")


@pytest.fixture
def fake_dist(monkeypatch):
    torch = pytest.importorskip("torch")

    def make(backend):
        fake = _FakeDist(backend)
        for name in ("is_available", "is_initialized", "get_backend", "get_rank",
                     "get_world_size", "all_gather", "barrier"):
            monkeypatch.setattr(torch.distributed, name, getattr(fake, name))
        return fake
    return make


def test_auto_bootstrap_is_not_used_for_a_plugin_without_a_transport(fake_dist, monkeypatch):
    """Under a NCCL default group, adam by name opens (no bootstrap: its session does no
    set-up across ranks) and no collective is run."""
    import torch

    import loom.torch

    fake = fake_dist("nccl")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(loom.InvalidArgumentError, match="backend is nccl"):
        loom.torch.distributed_bootstrap()
    p = torch.zeros(3, requires_grad=True)
    opt = loom.torch.Optimizer([p], plugin="adam", lr=0.1)
    assert opt._session._bootstrap is None
    p.grad = torch.ones(3)
    opt.step()
    assert torch.all(p < 0)
    opt.close()
    assert fake.calls == []


@pytest.mark.parametrize("backend", ["gloo", "cpu:gloo,cuda:nccl", "cuda:nccl,cpu:mpi"])
def test_distributed_bootstrap_takes_a_cpu_capable_backend(fake_dist, monkeypatch, backend):
    fake = fake_dist(backend)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    import loom.torch

    b = loom.torch.distributed_bootstrap()
    assert (b.rank, b.size, b.local_rank) == (0, 1, 0)
    assert fake.calls == ["all_gather"]  # the host names, without LOCAL_RANK


@pytest.mark.parametrize("backend", ["nccl", "cpu:nccl,cuda:nccl", "cuda:nccl"])
def test_distributed_bootstrap_refuses_a_backend_without_cpu_tensors(fake_dist, backend):
    fake_dist(backend)
    import loom.torch

    with pytest.raises(loom.InvalidArgumentError, match="does not move CPU tensors"):
        loom.torch.distributed_bootstrap()


def test_auto_bootstrap_is_used_for_the_one_bit_family(fake_dist, monkeypatch):
    _need_ucx()
    import torch

    import loom.torch

    fake = fake_dist("gloo")
    monkeypatch.setenv("LOCAL_RANK", "0")
    p = torch.ones(5, requires_grad=True)
    opt = loom.torch.Optimizer([p], plugin="onebit_adam", lr=0.1, log_level="error")
    assert isinstance(opt._session._bootstrap, loom.Bootstrap)
    opt.close()
