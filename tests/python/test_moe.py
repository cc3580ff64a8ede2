"""loom.torch.MoE over the moe plugin against a plain torch reference of the same routing
(top-1, top-2, capacity and drops, PR-MoE), and its gradients against torch autograd through
that reference."""
import os

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import loom  # noqa: E402
import loom.torch  # noqa: E402

# fp32 everywhere: the plugin and the reference sum in different orders, so values agree to
# a few ulps of their magnitude, not bit for bit.
ATOL, RTOL = 2e-5, 1e-4


def session(**params):
    body = "\n".join(f"{k} = {v}" for k, v in params.items())
    return loom.Session.from_string(f'[moe.m]\nplugin = "moe"\n{body}\n', "<test_moe>",
                                    log_level="error")


def reference(mod, x, *, k, capacity_factor=1.0, min_capacity=0, drop_tokens=True):
    """y and aux of the routing rules (probs drop policy, no noise), in plain torch ops, so
    autograd gives the gradient at that routing."""
    S, M = x.shape
    E = mod.num_experts
    logits = x @ mod.gate_w.t()
    p = torch.softmax(logits, dim=-1)
    # top-k by p, ties to the lower index (argsort is stable on a negated copy)
    order = torch.sort(-p.detach(), dim=-1, stable=True).indices[:, :k]
    route = order.clone()
    if drop_tokens:
        import math
        cap = min(max(math.ceil(k * capacity_factor * S / E), min_capacity), S)
        for e in range(E):
            cand = [(j, -float(p[s, e]), s) for s in range(S) for j in range(k)
                    if int(order[s, j]) == e]
            for j, _, s in sorted(cand)[cap:]:
                route[s, j] = -1
    y = torch.zeros_like(x)
    kept_sum = torch.zeros(S)
    for j in range(k):
        for s in range(S):
            if route[s, j] >= 0:
                kept_sum = kept_sum + F.one_hot(torch.tensor(s), S) * p[s, route[s, j]]
    for s in range(S):
        for j in range(k):
            e = int(route[s, j])
            if e < 0:
                continue
            w = p[s, e] if k == 1 else p[s, e] / torch.clamp(kept_sum[s], min=1.1920929e-07)
            h = F.gelu(x[s] @ mod.w1[e].t() + mod.b1[e], approximate="tanh")
            y = y + F.one_hot(torch.tensor(s), S).unsqueeze(1).float() * (
                w * (h @ mod.w2[e].t() + mod.b2[e])).unsqueeze(0)
    if mod.plan["residual"]:
        hr = F.gelu(x @ mod.res_w1.t() + mod.res_b1, approximate="tanh")
        r = hr @ mod.res_w2.t() + mod.res_b2
        c = torch.softmax(x @ mod.coef_w.t() + mod.coef_b, dim=-1)
        y = c[:, :1] * y + c[:, 1:] * r
    first = order[:, 0] if k <= 2 else None
    me = p.mean(dim=0)
    ce = torch.bincount(first, minlength=E).float() / S
    aux = E * (me * ce).sum()
    return y, aux, route


def grads_of(mod, x, y, aux, coef, dy):
    names = [n for n, _ in mod.named_parameters()]
    loss = (y * dy).sum() + coef * aux
    g = torch.autograd.grad(loss, [x] + [getattr(mod, n) for n in names])
    return dict(zip(["x"] + names, g))


@pytest.mark.parametrize("k,cf,residual", [(1, 1.0, False), (2, 1.0, False), (2, 0.5, True),
                                           (1, 2.0, True)])
def test_forward_and_backward_match_reference(k, cf, residual):
    torch.manual_seed(11 + k)
    S, M, H, E = 12, 6, 10, 4
    with session(num_experts=E, k=k, capacity_factor=cf, min_capacity=0,
                 use_residual="true" if residual else "false") as s:
        mod = loom.torch.MoE(s.instance("moe", "m"), M, H, seed=3, keep_routing=True)
        assert mod.gate_w.shape == (E, M) and mod.w1.shape == (E, H, M)
        assert mod.w2.shape == (E, M, H) and mod.b2.shape == (E, M)
        assert (hasattr(mod, "coef_w") and mod.coef_w.shape == (2, M)) == residual
        x = torch.randn(S, M, requires_grad=True)
        y, aux = mod(x)
        yr, auxr, route = reference(mod, x, k=k, capacity_factor=cf)
        assert torch.equal(mod.last_route_experts.long(), route)
        torch.testing.assert_close(y, yr, atol=ATOL, rtol=RTOL)
        assert abs(float(aux) - float(auxr)) < 1e-5
        st = mod.last_stats
        assert st["dropped"] == int((route < 0).sum())
        if cf < 1.0:
            assert st["dropped"] >= k * S - E * 3  # capacity ceil(2 * 0.5 * 12 / 4) = 3
        assert st["load"].tolist() == torch.bincount(
            torch.sort(-x.detach() @ mod.gate_w.detach().t(), dim=-1,
                       stable=True).indices[:, :k].reshape(-1), minlength=E).tolist()
        dy = torch.randn(S, M)
        coef = 0.37
        got = grads_of(mod, x, y, aux, coef, dy)
        want = grads_of(mod, x, yr, auxr, coef, dy)
        for n in want:
            torch.testing.assert_close(got[n], want[n], atol=ATOL, rtol=RTOL, msg=n)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_layers_are_the_float32_layer_rounded(dtype):
    # The plugin computes a 16-bit layer in float32 on the widened values and rounds its
    # outputs once: y and dx are the float32 layer's (on the rounded x and weights) rounded,
    # bit for bit, the routing is the same, and with float32 parameters (mixed precision)
    # the gradients are the float32 layer's exactly.
    torch.manual_seed(21)
    S, M, H, E = 16, 8, 12, 4
    with session(num_experts=E, k=2, capacity_factor=0.75, min_capacity=0,
                 use_residual="true", bias_update_rate=0.01) as s:
        inst = s.instance("moe", "m")
        ref = loom.torch.MoE(inst, M, H, seed=5, keep_routing=True)
        pure = loom.torch.MoE(inst, M, H, seed=5, keep_routing=True)
        mixed = loom.torch.MoE(inst, M, H, seed=5, keep_routing=True)
        with torch.no_grad():
            for n, p in ref.named_parameters():
                p.copy_(p.to(dtype).float())  # values every dtype holds exactly
        pure.load_state_dict(ref.state_dict())
        mixed.load_state_dict(ref.state_dict())
        pure.to(dtype)
        assert pure.w1.dtype == dtype and pure.expert_bias.dtype == torch.float32
        x16 = torch.randn(S, M).to(dtype)
        dy16 = torch.randn(S, M).to(dtype)
        x32 = x16.float().requires_grad_(True)
        y32, aux32 = ref(x32)
        (y32 * dy16.float()).sum().add(0.2 * aux32).backward()
        for mod in (pure, mixed):
            x = x16.clone().requires_grad_(True)
            y, aux = mod(x)
            assert y.dtype == dtype and aux.dtype == torch.float32
            assert torch.equal(mod.last_route_experts, ref.last_route_experts)
            assert torch.equal(mod.expert_bias, ref.expert_bias)
            assert float(aux) == float(aux32)
            assert torch.equal(y, y32.to(dtype))
            (y.float() * dy16.float()).sum().add(0.2 * aux).backward()
            assert x.grad.dtype == dtype and torch.equal(x.grad, x32.grad.to(dtype))
            for n, p in ref.named_parameters():
                g = getattr(mod, n).grad
                if mod is mixed:
                    assert g.dtype == torch.float32 and torch.equal(g, p.grad), n
                else:  # 16-bit gradients: the float32 sums, rounded
                    assert g.dtype == dtype and torch.equal(g, p.grad.to(dtype)), n
        with pytest.raises(loom.InvalidArgumentError, match="all x's dtype, or all float32"):
            mixed.w1.data = mixed.w1.data.to(dtype)
            mixed(x16)


def test_aux_coefficient_reaches_backward_and_zero_without_aux():
    torch.manual_seed(5)
    with session(num_experts=4, k=2) as s:
        mod = loom.torch.MoE(s.instance("moe", "m"), 4, 8)
        x = torch.randn(8, 4)
        y, aux = mod(x)
        y.sum().backward()  # aux unused: coefficient 0
        g0 = mod.gate_w.grad.clone()
        mod.zero_grad()
        y, aux = mod(x)
        (y.sum() + 0.0 * aux).backward()
        torch.testing.assert_close(mod.gate_w.grad, g0)
        mod.zero_grad()
        y, aux = mod(x)
        aux.backward()  # aux alone: only the gate sees it
        assert mod.gate_w.grad.abs().sum() > 0
        assert mod.w1.grad.abs().sum() == 0


def test_gradcheck_against_finite_differences():
    # float32 central differences. The routing is discrete (and the aux loss counts first
    # choices), so an element whose step changes any token's choices is skipped; the rest
    # must agree to the differences' own error.
    torch.manual_seed(2)
    S, M, H = 5, 3, 4
    with session(num_experts=2, k=2, drop_tokens="false", activation='"silu"') as s:
        mod = loom.torch.MoE(s.instance("moe", "m"), M, H, init_std=0.5, keep_routing=True)
        x = torch.randn(S, M)
        dy = torch.randn(S, M)

        def f(xx):
            with torch.no_grad():
                y, aux = mod(xx)
            return float((y * dy).sum() + 0.1 * aux), mod.last_route_experts.clone()

        xr = x.clone().requires_grad_(True)
        y, aux = mod(xr)
        route = mod.last_route_experts.clone()
        ((y * dy).sum() + 0.1 * aux).backward()
        eps, checked = 1e-2, 0
        for i in range(S):
            for j in range(M):
                e = torch.zeros_like(x)
                e[i, j] = eps
                (fp, rp), (fm, rm) = f(x + e), f(x - e)
                if not (torch.equal(rp, route) and torch.equal(rm, route)):
                    continue
                checked += 1
                fd = (fp - fm) / (2 * eps)
                assert abs(fd - float(xr.grad[i, j])) < 2e-3, (i, j, fd, float(xr.grad[i, j]))
        assert checked >= S * M - 3


def test_eval_is_deterministic_and_shapes_kept():
    torch.manual_seed(0)
    with session(num_experts=4, k=1, noisy_gate_policy='"RSample"', use_rts="true") as s:
        mod = loom.torch.MoE(s.instance("moe", "m"), 4, 8, seed=9)
        x = torch.randn(2, 5, 4)
        mod.eval()
        with torch.no_grad():
            a, _ = mod(x, step=1)
            b, _ = mod(x, step=7)
        assert a.shape == x.shape and torch.equal(a, b)
        mod.train()
        with torch.no_grad():
            c, _ = mod(x, step=3)
            d, _ = mod(x, step=3)
        assert torch.equal(c, d)  # the same counters draw the same noise


def test_expert_bias_buffer_moves_in_training():
    torch.manual_seed(1)
    with session(num_experts=4, k=1, bias_update_rate=0.1) as s:
        mod = loom.torch.MoE(s.instance("moe", "m"), 4, 8)
        assert mod.expert_bias.shape == (4,) and "expert_bias" in mod.state_dict()
        with torch.no_grad():
            mod(torch.randn(16, 4))
        assert mod.expert_bias.abs().sum() > 0


def test_bad_inputs_are_clear():
    with session(num_experts=4, k=1) as s:
        mod = loom.torch.MoE(s.instance("moe", "m"), 4, 8)
        with pytest.raises(loom.InvalidArgumentError, match="model_dim"):
            mod(torch.zeros(3, 5))
        with pytest.raises(loom.InvalidArgumentError, match="float32, bfloat16 or float16"):
            mod(torch.zeros(3, 4, dtype=torch.float64))
    with pytest.raises(loom.InvalidArgumentError, match="k = 3 is more than num_experts = 2"):
        session(num_experts=2, k=3)
    with session(num_experts=2, k=2) as s:
        # a layer planned with fewer experts than k is refused at plan, naming both
        with pytest.raises(loom.InvalidArgumentError, match="k = 2 is more than num_experts = 1"):
            loom.torch.MoE(s.instance("moe", "m"), 4, 8, num_experts=1)
    with loom.Session.from_string('[quantizer.q]\nplugin = "xtc"\n', "<t>") as s:
        with pytest.raises(loom.InvalidArgumentError, match="loom.moe/1"):
            loom.torch.MoE(s.instance("quantizer", "q"), 4)


def test_backward_twice_with_a_retained_graph():
    torch.manual_seed(8)
    with session(num_experts=4, k=2) as s:
        mod = loom.torch.MoE(s.instance("moe", "m"), 4, 8)
        x = torch.randn(6, 4, requires_grad=True)
        y, aux = mod(x)
        loss = y.square().sum() + 0.1 * aux
        loss.backward(retain_graph=True)
        g1 = (x.grad.clone(), mod.w1.grad.clone())
        loss.backward()
        torch.testing.assert_close(x.grad, 2 * g1[0])
        torch.testing.assert_close(mod.w1.grad, 2 * g1[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_matches_cpu():
    torch.manual_seed(6)
    with session(num_experts=4, k=2, capacity_factor=0.75) as s:
        cpu = loom.torch.MoE(s.instance("moe", "m"), 8, 16, keep_routing=True)
        gpu = loom.torch.MoE(s.instance("moe", "m"), 8, 16, keep_routing=True)
        gpu.load_state_dict(cpu.state_dict())
        gpu.cuda()
        x = torch.randn(10, 8)
        yc, ac = cpu(x)
        yg, ag = gpu(x.cuda())
        assert torch.equal(cpu.last_route_experts, gpu.last_route_experts.cpu())
        torch.testing.assert_close(yg.cpu(), yc, atol=ATOL, rtol=RTOL)
        (yc.sum() + 0.1 * ac).backward()
        (yg.sum() + 0.1 * ag).backward()
        for n, p in cpu.named_parameters():
            torch.testing.assert_close(getattr(gpu, n).grad.cpu(), p.grad, atol=ATOL, rtol=RTOL,
                                       msg=n)


def test_dispatch_and_combine_move_the_routed_rows():
    torch.manual_seed(12)
    S, M, E = 5, 3, 3
    with session(num_experts=E, k=2) as s:
        inst = s.instance("moe", "m")
        plan = inst.moe_plan(tokens=S, model_dim=M, hidden_dim=4)
        x = torch.randn(S, M)
        route = torch.tensor([[0, 2], [1, -1], [2, 0], [0, 1], [-1, -1]], dtype=torch.int32)
        w = torch.rand(S, 2)
        rows = torch.zeros(plan["max_expert_rows"], M)
        counts = inst.moe_dispatch(x=x, rows=rows, route_experts=route, route_weights=w,
                                   local_experts=plan["local_experts"])
        # grouped by expert, then token, then choice
        want = [(int(t), j) for e in range(E) for t in range(S) for j in range(2)
                if int(route[t, j]) == e]
        assert counts == [sum(1 for t, j in want if int(route[t, j]) == e) for e in range(E)]
        for r, (t, j) in enumerate(want):
            torch.testing.assert_close(rows[r], w[t, j] * x[t])
        y = torch.full((S, M), 7.0)
        inst.moe_combine(rows=rows, y=y, route_experts=route)
        ref = torch.zeros(S, M)
        for r, (t, j) in enumerate(want):
            ref[t] += rows[r]
        torch.testing.assert_close(y, ref)  # written: the dropped token's row is 0


def test_expert_parallel_on_two_processes(tmp_path):
    # Two ranks, ep_size 2 over a ucx world (the host's env bootstrap), two experts each and
    # unequal token counts: each rank's y, dx and gate gradient equal a one-rank layer's over
    # its own tokens with all four experts, and its experts' gradients are the sum over both
    # ranks' tokens (then divided by the world size by reduce_gradients).
    import json
    import socket
    import sys

    from conftest import report, run_together

    try:
        loom.describe_plugins("ucx")
    except loom.LoomError as e:
        pytest.skip(f"the ucx transport is not built: {e}")
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    import moe_ep_worker as W

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OUT_DIR=str(tmp_path), UCX_LOG_LEVEL="error", LOOM_NUM_THREADS="1",
               LOOM_BOOTSTRAP_TIMEOUT="60", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=port)
    results = run_together([([sys.executable, os.path.join(here, "moe_ep_worker.py")],
                             dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in (0, 1)],
                           60, "the expert-parallel MoE workers")
    assert all(rc == 0 for rc, _, _ in results), report(results)
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    w = W.full_weights()
    refs = []
    with session(num_experts=W.E, k=W.K, capacity_factor=2.0) as s:
        for r in (0, 1):
            ref = loom.torch.MoE(s.instance("moe", "m"), W.M, W.H, seed=5)
            with torch.no_grad():
                for n, t in w.items():
                    getattr(ref, n).copy_(t)
            x, dy = W.inputs(r)
            x.requires_grad_(True)
            y, aux = ref(x, first_token=sum(W.TOKENS[:r]))
            ((y * dy).sum() + 0.1 * aux).backward()
            refs.append((y.detach(), float(aux), x.grad, {n: p.grad for n, p in
                                                          ref.named_parameters()},
                         ref.last_stats["load"].tolist()))
    el = W.E // 2
    for r, got in enumerate(ranks):
        y, aux, dx, grads, load = refs[r]
        assert got["plan"]["ep_size"] == 2 and got["plan"]["ep_rank"] == r
        assert got["plan"]["local_experts"] == el and got["plan"]["expert_parallel"]
        torch.testing.assert_close(torch.tensor(got["y"]), y, atol=ATOL, rtol=RTOL)
        assert abs(got["aux"] - aux) < 1e-5 and got["load"] == load
        torch.testing.assert_close(torch.tensor(got["dx"]), dx, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(torch.tensor(got["grads"]["gate_w"]), grads["gate_w"],
                                   atol=ATOL, rtol=RTOL)
        for n in ("w1", "b1", "w2", "b2"):
            both = sum(refs[q][3][n][r * el:(r + 1) * el] for q in (0, 1))
            torch.testing.assert_close(torch.tensor(got["grads"][n]), both, atol=ATOL,
                                       rtol=RTOL, msg=n)
            torch.testing.assert_close(torch.tensor(got["reduced"][n]), both / 2, atol=ATOL,
                                       rtol=RTOL, msg=n)
