"""loom.torch.Router over the random_ltd router: the routed forward against plain torch
indexing, gradients (gradcheck in float64), evaluation, batch splits, advance and resume."""
import pytest

torch = pytest.importorskip("torch")

import loom  # noqa: E402
import loom.torch  # noqa: E402

LTD = ('[router.ltd]\nplugin = "random_ltd"\nmin_value = 4\nmax_value = 16\n'
       'require_steps = 10\nseq_per_step = 2\n')


@pytest.fixture
def session():
    try:
        s = loom.Session.from_string(LTD, "ltd.toml", log_level="error")
    except loom.NotFoundError as e:
        pytest.skip(f"random_ltd is not built: {e}")
    with s:
        yield s


def _reference(layer, x, idx):
    ref = x.clone()
    for b in range(x.shape[0]):
        ref[b, idx[b]] = layer(x[b, idx[b]].unsqueeze(0)).squeeze(0)
    return ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_matches_torch_indexing(session, dtype):
    torch.manual_seed(0)
    layer = torch.nn.Linear(5, 5).to(dtype)
    r = loom.torch.Router(layer, session.instance("router", "ltd"), 1, 4, seed=7)
    x = torch.randn(3, 16, 5, dtype=dtype)
    out = r(x)
    idx = r.last_indices.long()
    assert idx.shape == (3, 4)  # min_value at step 1
    assert all((row[1:] > row[:-1]).all() for row in idx)
    assert torch.equal(out, _reference(layer, x, idx))
    assert not torch.equal(idx[0], idx[1])  # each sequence draws its own subset


def test_gradients(session):
    torch.manual_seed(1)
    layer = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 4))
    layer = layer.double()
    r = loom.torch.Router(layer, session.instance("router", "ltd"), 2, 4, seed=3)
    r.step = 4
    x = torch.randn(2, 12, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: r(t), (x,))
    # The layer's parameters get the same gradients as through plain indexing.
    out = r(x)
    idx = r.last_indices.long()
    (out * torch.arange(out.numel(), dtype=torch.float64).view_as(out)).sum().backward()
    got = [p.grad.clone() for p in layer.parameters()]
    gx = x.grad.clone()
    layer.zero_grad()
    x.grad = None
    ref = _reference(layer, x, idx)
    (ref * torch.arange(ref.numel(), dtype=torch.float64).view_as(ref)).sum().backward()
    for a, b in zip(got, layer.parameters()):
        assert torch.allclose(a, b.grad, rtol=1e-12, atol=1e-12)
    assert torch.allclose(gx, x.grad, rtol=1e-12, atol=1e-12)


def test_position_major_storage(session):
    layer = torch.nn.Linear(3, 3)
    r = loom.torch.Router(layer, session.instance("router", "ltd"), 1, 4)
    x = torch.randn(16, 2, 3).transpose(0, 1)  # [batch, seq, channels] view of [seq, batch, c]
    out = r(x)
    assert torch.equal(out, _reference(layer, x, r.last_indices.long()))
    with pytest.raises(loom.InvalidArgumentError, match="last dimension is not contiguous"):
        r(torch.randn(2, 3, 16).transpose(1, 2))


def test_schedule_evaluation_and_splits(session):
    inst = session.instance("router", "ltd")
    layer = torch.nn.Linear(3, 3)
    r = loom.torch.Router(layer, inst, 1, 4, seed=5)
    x = torch.randn(4, 16, 3)
    kept = []
    for step in (1, 6, 11):
        r(x, step=step)
        kept.append(None if r.last_indices is None else r.last_indices.shape[1])
    assert kept == [4, 10, None]  # 4 + (5/10) * 12 = 10; from step R + 1 on, every token
    r.eval()
    with torch.no_grad():
        assert torch.equal(r(x, step=1), layer(x)) and r.last_indices is None
    r.train()
    # Outer layers are not routed (the default layers: every middle one).
    outer = loom.torch.Router(layer, inst, 0, 4)
    assert torch.equal(outer(x, step=1), layer(x)) and outer.last_indices is None
    # A batch split over two ranks chooses the rows the whole batch would.
    r(x, step=3)
    whole = r.last_indices.clone()
    r(x[:2], step=3, first_sample=0)
    a = r.last_indices.clone()
    r(x[2:], step=3, first_sample=2)
    assert torch.equal(torch.cat([a, r.last_indices]), whole)


def test_advance_and_resume(session):
    inst = session.instance("router", "ltd")
    first = inst.router_advance(step=1, batch=8, seq_len=16, num_layers=4)
    assert first == {"layer_tokens": 8 * (16 + 4 + 4 + 16), "consumed_layer_tokens": 320}
    state = inst.export_state()
    second = inst.router_advance(step=2, batch=8, seq_len=16, num_layers=4)
    with loom.Session.from_string(LTD, log_level="error") as s:
        other = s.instance("router", "ltd")
        other.import_state(state)
        assert other.router_advance(step=2, batch=8, seq_len=16, num_layers=4) == second
        with pytest.raises(loom.LoomError):
            other.router_advance(step=9, batch=8, seq_len=16, num_layers=4)


def test_bad_arguments(session):
    inst = session.instance("router", "ltd")
    with pytest.raises(loom.InvalidArgumentError, match="layer_index 4"):
        loom.torch.Router(torch.nn.Identity(), inst, 4, 4)
    with loom.Session.from_string('[optimizer.main]\nplugin = "adam"\n') as s:
        with pytest.raises(loom.InvalidArgumentError, match="loom.router/1 instance"):
            loom.torch.Router(torch.nn.Identity(), s.optimizer(), 0, 2)
    r = loom.torch.Router(torch.nn.Identity(), inst, 1, 4)
    with pytest.raises(loom.InvalidArgumentError, match=r"\[batch, seq_len, channels\]"):
        r(torch.ones(16, 3))
    with pytest.raises(loom.LoomError, match="step"):
        r(torch.ones(1, 16, 3), step=0)


def test_a_device_tensor_without_a_workspace_is_refused():
    """router_select / router_backward make a host workspace only for host tensors; for
    device ones (here a stand-in: only the device is read) they refuse rather than hand a
    host buffer to device code."""
    from loom.session import _host_workspace

    class OnDevice:
        device = ("cuda", 1)

    with pytest.raises(loom.InvalidArgumentError,
                       match=r"router_select: .*64-byte workspace .* on cuda:1; pass workspace="):
        _host_workspace(None, 64, OnDevice(), "router_select")
    assert _host_workspace(None, 0, OnDevice(), "router_select") == (None, None)
    assert _host_workspace(4096, 64, OnDevice(), "router_select") == (None, 4096)

    class OnHost:
        device = ("cpu", 0)

    holder, at = _host_workspace(None, 64, OnHost(), "router_backward")
    assert at % 256 == 0 and len(holder) >= 64 + 256
