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

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
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
