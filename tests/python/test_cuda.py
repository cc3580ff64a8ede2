"""The package on CUDA tensors, where a GPU is present (skipped otherwise; the GPU bundle
runs this file on the GPU machine): loom.torch.Optimizer(adam) against torch.optim.Adam on
the device, bf16 parameters with fp32 masters, exact resume, and loom.torch.Router with the
random and the learned router giving the CPU's results."""
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import loom  # noqa: E402
import loom.torch  # noqa: E402

SHAPES = [(7,), (33, 5), (1001,), (3, 9)]


def _params(device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(device=device, dtype=dtype).requires_grad_()
            for s in SHAPES]


def _grads(step, device):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g).to(device) for s in SHAPES]


@pytest.mark.parametrize("adam_w_mode,decay", [(False, 0.0), (True, 0.0), (False, 0.01)])
def test_adam_on_cuda_matches_torch(adam_w_mode, decay):
    mine, ref = _params("cuda"), _params("cuda")
    opt = loom.torch.Optimizer(mine, plugin="adam", lr=1e-3, weight_decay=decay,
                               adam_w_mode=adam_w_mode)
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    tref = cls(ref, lr=1e-3, weight_decay=decay)
    for step in range(1, 101):
        for p, q, g in zip(mine, ref, _grads(step, "cuda")):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        tref.step()
    torch.cuda.synchronize()
    for p, q in zip(mine, ref):
        assert ((p - q).norm() / q.norm()).item() < 1e-6
    opt.close()


def test_bf16_params_with_masters_on_cuda():
    mine = _params("cuda", torch.bfloat16)
    ref = [p.detach().float().clone().requires_grad_() for p in mine]
    opt = loom.torch.Optimizer(mine, plugin="adam", lr=1e-3, adam_w_mode=False)
    tref = torch.optim.Adam(ref, lr=1e-3)
    for step in range(1, 31):
        for p, q, g in zip(mine, ref, _grads(step, "cuda")):
            p.grad, q.grad = g.to(torch.bfloat16), g.to(torch.bfloat16).float()
        opt.step()
        tref.step()
    torch.cuda.synchronize()
    for (gi, pi), m in opt._masters.items():
        q = ref[pi]
        assert m.is_cuda and ((m - q).norm() / q.norm()).item() < 1e-6
        assert torch.equal(mine[pi].detach(), m.to(torch.bfloat16))
    opt.close()


def test_resume_on_cuda_is_bit_identical():
    a, b = _params("cuda"), _params("cuda")
    oa = loom.torch.Optimizer(a, plugin="adam", lr=1e-3)
    ob = loom.torch.Optimizer(b, plugin="adam", lr=1e-3)
    for step in range(1, 21):
        for p, g in zip(a, _grads(step, "cuda")):
            p.grad = g
        oa.step()
        if step <= 10:
            for p, g in zip(b, _grads(step, "cuda")):
                p.grad = g
            ob.step()
        if step == 10:
            sd = ob.state_dict()
            ob.close()
            ob = loom.torch.Optimizer(b, plugin="adam", lr=1e-3)
            ob.load_state_dict(sd)
        if step > 10:
            for p, g in zip(b, _grads(step, "cuda")):
                p.grad = g
            ob.step()
    torch.cuda.synchronize()
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    oa.close()
    ob.close()


def _routed(manifest, name, dtype, learned):
    try:
        s = loom.Session.from_string(manifest, "r.toml", log_level="error")
    except loom.NotFoundError as e:
        pytest.skip(f"{name} is not built: {e}")
    inst = s.instance("router", name)
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()).to(dtype)
    kw = {"channels": 16} if learned else {"seed": 11}
    r = loom.torch.Router(layer, inst, 1, 4, **kw).to(dtype)
    if learned:
        with torch.no_grad():
            r.weight.normal_()
    x = torch.randn(4, 64, 16, dtype=dtype)
    dout = torch.randn(4, 64, 16, dtype=dtype)
    results = []
    for device in ("cpu", "cuda"):
        r.to(device)
        r.zero_grad()
        xd = x.to(device).requires_grad_()
        out = r(xd)
        (out * dout.to(device)).sum().backward()
        torch.cuda.synchronize()
        results.append({"out": out.detach().cpu(), "idx": r.last_indices.cpu(),
                        "dx": xd.grad.cpu(),
                        "grads": [p.grad.cpu() for p in r.parameters()],
                        "gates": None if r.last_gates is None else r.last_gates.cpu()})
    s.close()
    return results


def test_random_router_on_cuda_chooses_as_on_cpu():
    cpu, cuda = _routed('[router.ltd]\nplugin = "random_ltd"\nmin_value = 16\n'
                        'max_value = 64\nrequire_steps = 10\nseq_per_step = 4\n', "ltd",
                        torch.float32, False)
    assert torch.equal(cpu["idx"], cuda["idx"])
    assert torch.allclose(cpu["out"], cuda["out"], rtol=1e-5, atol=1e-6)
    assert torch.allclose(cpu["dx"], cuda["dx"], rtol=1e-5, atol=1e-6)


def test_learned_router_on_cuda_gives_the_cpu_bits():
    cpu, cuda = _routed('[router.mod]\nplugin = "topk_router"\ncapacity = 0.25\n', "mod",
                        torch.float64, True)
    # topk_router computes scores, gates and its backward in one fixed order of float64
    # operations on both devices (docs/routing.md): the same choice and the same gates.
    assert torch.equal(cpu["idx"], cuda["idx"])
    assert torch.equal(cpu["gates"], cuda["gates"])
    assert torch.allclose(cpu["out"], cuda["out"], rtol=1e-12, atol=1e-12)
    assert torch.allclose(cpu["dx"], cuda["dx"], rtol=1e-12, atol=1e-12)
    for a, b in zip(cpu["grads"], cuda["grads"]):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
