"""loom.torch.Router over the learned topk_router: the forward against plain torch (top-k of
the scores, sigmoid gates, x + g * (layer(x) - x) on the kept tokens), gradients through the
router's backward (gradcheck in float64, and every gradient against torch's autograd of the
same arithmetic), the layers it does not route, and training the weight."""
import pytest

torch = pytest.importorskip("torch")

import loom  # noqa: E402
import loom.torch  # noqa: E402

MOD = '[router.mod]\nplugin = "topk_router"\ncapacity = 0.5\nlayers = [1, 2]\n'


@pytest.fixture
def inst():
    try:
        s = loom.Session.from_string(MOD, "mod.toml", log_level="error")
    except loom.NotFoundError as e:
        pytest.skip(f"topk_router is not built: {e}")
    with s:
        yield s.instance("router", "mod")


def _router(inst, channels=5, layer_index=1, seed=0):
    torch.manual_seed(seed)
    layer = torch.nn.Sequential(torch.nn.Linear(channels, channels), torch.nn.Tanh()).double()
    r = loom.torch.Router(layer, inst, layer_index, 4, channels=channels).double()
    with torch.no_grad():
        r.weight.normal_()
    return r


def _reference(r, x):
    """The same routing in plain torch: autograd through topk's gathered scores."""
    s = x @ r.weight
    k = max(1, min(x.shape[1], int(0.5 * x.shape[1] + 0.5)))
    idx = s.topk(k, dim=1).indices.sort(dim=1).values
    out = x.clone()
    for b in range(x.shape[0]):
        kept = x[b, idx[b]]
        g = torch.sigmoid(s[b, idx[b]]).unsqueeze(-1)
        out[b, idx[b]] = kept + g * (r.layer(kept.unsqueeze(0)).squeeze(0) - kept)
    return out, idx


def test_forward_matches_torch(inst):
    r = _router(inst)
    x = torch.randn(3, 8, 5, dtype=torch.float64)
    got = r(x)
    ref, idx = _reference(r, x)
    assert r.learned and r.last_indices.shape == (3, 4)
    assert torch.equal(r.last_indices.long(), idx)
    assert torch.allclose(r.last_gates, torch.sigmoid((x @ r.weight).gather(1, idx)),
                          rtol=0, atol=1e-15)
    assert torch.allclose(got, ref, rtol=0, atol=1e-14)
    dropped = torch.ones(3, 8, dtype=torch.bool)
    dropped.scatter_(1, idx, False)
    assert torch.equal(got[dropped], x[dropped])  # the bypass: unchanged bits


def test_gradcheck_float64(inst):
    r = _router(inst, seed=1)
    x = torch.randn(2, 8, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: r(x), (x, r.weight), eps=1e-6, atol=1e-8)


def test_gradients_match_torch_autograd(inst):
    r = _router(inst, seed=2)
    x = torch.randn(2, 8, 5, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(2, 8, 5, dtype=torch.float64)
    (r(x) * dout).sum().backward()
    mine = [x.grad.clone(), r.weight.grad.clone()] + [p.grad.clone() for p in r.layer.parameters()]
    x.grad = None
    r.zero_grad()
    (_reference(r, x)[0] * dout).sum().backward()
    ref = [x.grad, r.weight.grad] + [p.grad for p in r.layer.parameters()]
    assert r.weight.grad.abs().sum() > 0
    for a, b in zip(mine, ref):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12), (a, b)


def test_unrouted_layers_have_no_weight_and_run_on_every_token(inst):
    layer = torch.nn.Linear(5, 5)
    r = loom.torch.Router(layer, inst, 0, 4)  # layer 0 is not in layers
    assert r.learned and r.weight is None and not list(r.parameters())[2:]
    x = torch.randn(2, 8, 5)
    assert torch.equal(r(x), layer(x)) and r.last_indices is None
    with pytest.raises(loom.InvalidArgumentError, match="pass channels="):
        loom.torch.Router(layer, inst, 1, 4)
    r1 = loom.torch.Router(layer, inst, 1, 4, channels=5)
    with pytest.raises(loom.InvalidArgumentError, match="x has 6 channels"):
        r1(torch.randn(2, 8, 6))


def test_a_layer_that_keeps_every_position_still_gates_it(inst):
    r = _router(inst, seed=3)
    x = torch.randn(2, 1, 5, dtype=torch.float64)  # k = 1 = seq_len: not routed, gated
    out = r(x)
    g = torch.sigmoid(x @ r.weight).unsqueeze(-1)
    assert torch.allclose(out, x + g * (r.layer(x) - x), rtol=0, atol=1e-14)
    out.sum().backward()
    assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0


def test_the_weight_trains_with_loom_adam(inst):
    torch.manual_seed(4)
    r = loom.torch.Router(torch.nn.Linear(8, 8), inst, 1, 4, channels=8)
    opt = loom.torch.Optimizer(r.parameters(), plugin="adam", lr=1e-2)
    x = torch.randn(4, 16, 8)
    target = torch.randn(4, 16, 8)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(r(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert r.weight.abs().sum() > 0  # started at 0, learned from the gates' gradient
    assert losses[-1] < losses[0]
    opt.close()
