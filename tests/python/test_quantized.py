"""loom.torch.quantize / dequantize / QuantizedLinear over the zeroquant and xtc plugins,
against plain torch formulas of their schemes."""
import pytest

torch = pytest.importorskip("torch")

import loom  # noqa: E402
import loom.torch  # noqa: E402


def session(plugin, **params):
    body = "\n".join(f"{k} = {v}" for k, v in params.items())
    return loom.Session.from_string(f'[quantizer.q]\nplugin = "{plugin}"\n{body}\n',
                                    "<test_quantized>", log_level="error")


def groups(w, g):
    """w [N, K] -> [N, K/g, g] (g divides K here)."""
    n, k = w.shape
    return w.reshape(n, k // g, g)


def int_symmetric_reference(w, bits, g):
    wg = groups(w, g)
    qmax = 2 ** (bits - 1) - 1
    s = wg.abs().amax(dim=-1, keepdim=True) / qmax
    s = torch.where(s == 0, torch.ones_like(s), s)
    q = torch.clamp(torch.round(wg / s), -qmax, qmax)  # torch.round: half to even
    return q.reshape(w.shape).to(torch.int32), s.squeeze(-1), (q * s).reshape(w.shape)


@pytest.mark.parametrize("bits,g", [(8, 0), (4, 8), (4, 0)])
def test_zeroquant_quantize_matches_formula(bits, g):
    torch.manual_seed(bits + g)
    w = torch.randn(6, 16)
    with session("zeroquant", bits=bits, group_size=g) as s:
        q = loom.torch.quantize(w, s.instance("quantizer", "q"))
        assert q.layout.scheme == "int" and q.layout.bits == bits and q.layout.symmetric
        assert q.layout.packing == "lsb_first"
        codes, scales, deq = int_symmetric_reference(w, bits, g or 16)
        assert q.codes.dtype == torch.uint8 and q.codes.numel() == 6 * 16 * bits // 8
        torch.testing.assert_close(q.scales.reshape(scales.shape), scales)
        # LSB first: element 0 in the low bits of byte 0
        flat = codes.reshape(-1) & (2 ** bits - 1)
        if bits == 8:
            assert torch.equal(q.codes.to(torch.int32), flat)
        else:
            assert torch.equal((q.codes & 0xF).to(torch.int32), flat[0::2])
            assert torch.equal((q.codes >> 4).to(torch.int32), flat[1::2])
        torch.testing.assert_close(loom.torch.dequantize(q), deq)
        torch.testing.assert_close(q.dequantize(), deq)


def test_zeroquant_asymmetric_has_zero_points():
    torch.manual_seed(3)
    w = torch.rand(4, 8) * 2 - 0.5  # skewed: the zero point matters
    with session("zeroquant", bits=8, symmetric="false", activation_bits=0) as s:
        q = loom.torch.quantize(w, s.instance("quantizer", "q"))
        assert q.zero_points is not None and q.zero_points.dtype == torch.uint8
        # the exact range, widened to hold 0
        lo = w.amin(dim=1, keepdim=True).clamp(max=0)
        hi = w.amax(dim=1, keepdim=True).clamp(min=0)
        scale = (hi - lo) / 255
        assert torch.equal(q.zero_points.reshape(4, 1).float(),
                           torch.clamp(torch.round(-lo / scale), 0, 255))
        torch.testing.assert_close(q.scales.reshape(4, 1), scale)
        err = (loom.torch.dequantize(q) - w).abs()
        assert float((err / scale).max()) <= 0.5 + 1e-3  # within half a step


@pytest.mark.parametrize("bits,g,abits", [(8, 0, 8), (4, 0, 8), (4, 8, 0), (8, 8, 0)])
def test_quantized_linear_zeroquant(bits, g, abits):
    torch.manual_seed(7)
    lin = torch.nn.Linear(16, 5)
    with session("zeroquant", bits=bits, group_size=g, activation_bits=abits) as s:
        qlin = loom.torch.QuantizedLinear.from_linear(lin, s.instance("quantizer", "q"))
        assert qlin.qcodes.dtype == torch.uint8 and qlin.qcodes.numel() == 5 * 16 * bits // 8
        assert set(dict(qlin.named_buffers())) == {"qcodes", "qscale", "bias"}
        assert not list(qlin.parameters())
        wq = qlin.dequantize()
        x = torch.randn(2, 3, 16)
        y = qlin(x)
        assert y.shape == (2, 3, 5)
        xf = x.reshape(-1, 16)
        if abits == 8:
            # W8A8 / W4A8: x per token to symmetric INT8, exact integer products, scaled
            assert qlin.layout.int8_activations
            sx = xf.abs().amax(dim=1, keepdim=True) / 127
            qx = torch.clamp(torch.round(xf / sx), -127, 127)
            codes, sw, _ = int_symmetric_reference(lin.weight.detach(), bits, 16)
            acc = (qx.double() @ codes.double().t())
            ref = (acc * sx.double() * sw.double().reshape(1, -1)).float() + lin.bias.detach()
        else:
            ref = xf @ wq.t() + lin.bias.detach()
        torch.testing.assert_close(y.reshape(-1, 5), ref, atol=1e-5, rtol=1e-5)
        # and close to the float layer (the quantization error only)
        assert float((y - lin(x)).abs().max()) < (0.05 if bits == 8 else 0.5)


def test_quantized_linear_gives_x_a_gradient():
    torch.manual_seed(1)
    lin = torch.nn.Linear(8, 4)
    with session("zeroquant", bits=8, activation_bits=0) as s:
        qlin = loom.torch.QuantizedLinear.from_linear(lin, s.instance("quantizer", "q"))
        x = torch.randn(3, 8, requires_grad=True)
        dy = torch.randn(3, 4)
        (qlin(x) * dy).sum().backward()
        torch.testing.assert_close(x.grad, dy @ qlin.dequantize())


def xtc_reference(w, mode, threshold=0.7):
    a = w.abs()
    if mode == "binary":
        alpha = a.mean(dim=1, keepdim=True)
        return torch.where(w >= 0, alpha, -alpha)
    delta = threshold * a.mean(dim=1, keepdim=True)
    keep = a > delta
    alpha = (a * keep).sum(dim=1, keepdim=True) / keep.sum(dim=1, keepdim=True).clamp(min=1)
    return torch.where(keep, torch.sign(w) * alpha, torch.zeros_like(w))


@pytest.mark.parametrize("mode,bits", [("binary", 1), ("ternary", 2)])
def test_xtc_quantize_and_linear(mode, bits):
    torch.manual_seed(4)
    lin = torch.nn.Linear(24, 6)
    with session("xtc", mode=f'"{mode}"') as s:
        inst = s.instance("quantizer", "q")
        q = loom.torch.quantize(lin.weight.detach(), inst)
        assert q.layout.scheme == mode and q.layout.bits == bits
        assert q.codes.numel() == 6 * 24 * bits // 8
        ref = xtc_reference(lin.weight.detach(), mode)
        torch.testing.assert_close(loom.torch.dequantize(q), ref)
        qlin = loom.torch.QuantizedLinear.from_linear(lin, inst)
        torch.testing.assert_close(qlin.dequantize(), ref)
        x = torch.randn(5, 24)
        torch.testing.assert_close(qlin(x), x @ ref.t() + lin.bias.detach(), atol=1e-5,
                                   rtol=1e-5)


def test_quantized_linear_state_dict_round_trip():
    torch.manual_seed(2)
    lin = torch.nn.Linear(16, 4)
    with session("zeroquant", bits=4, group_size=8, activation_bits=0) as s:
        inst = s.instance("quantizer", "q")
        a = loom.torch.QuantizedLinear.from_linear(lin, inst)
        b = loom.torch.QuantizedLinear(inst, 16, 4)
        b.load_state_dict(a.state_dict())
        x = torch.randn(2, 16)
        assert torch.equal(a(x), b(x))


def test_bad_inputs_are_clear():
    with session("zeroquant", bits=8) as s:
        inst = s.instance("quantizer", "q")
        with pytest.raises(loom.InvalidArgumentError, match="2-D"):
            loom.torch.quantize(torch.zeros(4), inst)
        w = torch.zeros(2, 4)
        w[1, 2] = float("nan")
        with pytest.raises(loom.InvalidArgumentError, match=r"\(1, 2\)|row 1|1, 2"):
            loom.torch.quantize(w, inst)
        qlin = loom.torch.QuantizedLinear.from_linear(torch.nn.Linear(4, 2), inst)
        with pytest.raises(loom.InvalidArgumentError, match="in_features|\\[..., 4\\]"):
            qlin(torch.zeros(3, 5))
        with pytest.raises(loom.InvalidArgumentError, match="torch.nn.Linear"):
            loom.torch.QuantizedLinear.from_linear(torch.nn.Conv1d(1, 1, 1), inst)
        with pytest.raises(loom.InvalidArgumentError, match="loom.quantizer/1"):
            loom.torch.quantize(torch.zeros(2, 2), None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("plugin,params", [("zeroquant", {"bits": 8}),
                                           ("zeroquant", {"bits": 4, "activation_bits": 0}),
                                           ("xtc", {"mode": '"ternary"'})])
def test_cuda_matches_cpu(plugin, params):
    torch.manual_seed(9)
    lin = torch.nn.Linear(32, 8)
    with session(plugin, **params) as s:
        inst = s.instance("quantizer", "q")
        qc = loom.torch.QuantizedLinear.from_linear(lin, inst)
        qg = loom.torch.QuantizedLinear.from_linear(lin.cuda(), inst)
        assert torch.equal(qg.qcodes.cpu(), qc.qcodes)
        assert torch.equal(qg.qscale.cpu(), qc.qscale)
        x = torch.randn(3, 32)
        torch.testing.assert_close(qg(x.cuda()).cpu(), qc(x), atol=1e-5, rtol=1e-5)


# ---- range = "deepspeed" against DeepSpeed's simulated quantizer (docs/quantization.md,
# "Exact and DeepSpeed ranges"), reproduced here from its published arithmetic: one group
# per row (DeepSpeed's num_groups = rows), q_range = 2^b.

def deepspeed_symmetric(w, bits):
    """s = 2 max|x| / 2^b, q = clamp(round(x / s), -2^(b-1), 2^(b-1) - 1), out = q s."""
    q_range = 2 ** bits
    s = 2 * w.abs().amax(dim=1, keepdim=True) / q_range
    q = torch.clamp(torch.round(w / s), -q_range // 2, q_range // 2 - 1)
    return q, s, q * s


def deepspeed_asymmetric(w, bits):
    """s = (max - min) / 2^b, the zero point as a float, zp = round(min / s) s,
    q = clamp(round((x - zp) / s), 0, 2^b - 1), out = q s + zp."""
    q_range = 2 ** bits
    lo = w.amin(dim=1, keepdim=True)
    hi = w.amax(dim=1, keepdim=True)
    s = (hi - lo) / q_range
    zp = torch.round(lo / s) * s
    q = torch.clamp(torch.round((w - zp) / s), 0, q_range - 1)
    return q, s, -torch.round(lo / s), q * s + zp


def loom_codes(q, bits, signed):
    """The codes of a QuantizedTensor as float, unpacked (LSB first) and sign-extended."""
    n, k = q.shape
    raw = q.codes.to(torch.int32)
    if bits == 4:
        raw = torch.stack([raw & 0xF, raw >> 4], dim=1).reshape(-1)
    codes = raw[: n * k].reshape(n, k)
    if signed:
        codes = torch.where(codes >= 2 ** (bits - 1), codes - 2 ** bits, codes)
    return codes.to(torch.float32)


def deepspeed_weights(seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(24, 64, generator=g) * torch.rand(24, 1, generator=g) * 3
    w[:, 0] = -w[:, 0].abs() - 0.01  # every row holds both signs (docs: the asymmetric case
    w[:, 1] = w[:, 1].abs() + 0.01   # where DeepSpeed's zero point fits a uint8)
    return w


@pytest.mark.parametrize("bits", [8, 4])
def test_deepspeed_range_symmetric_matches_deepspeed(bits):
    w = deepspeed_weights(bits)
    with session("zeroquant", bits=bits, range='"deepspeed"', activation_bits=0) as s:
        q = loom.torch.quantize(w, s.instance("quantizer", "q"))
        codes, scale, ds = deepspeed_symmetric(w, bits)
        assert torch.equal(loom_codes(q, bits, signed=True), codes)
        assert torch.equal(q.scales.reshape(scale.shape), scale)
        deq = loom.torch.dequantize(q)
        # the same values; only the sign of zero differs: DeepSpeed's -0.0 (round(x / s)
        # of a small negative x is -0.0, times s) is Loom's +0.0
        assert torch.equal(deq, ds)
        negative_zero = (ds == 0) & torch.signbit(ds)
        assert negative_zero.any()  # the data has such codes
        assert not ((deq == 0) & torch.signbit(deq)).any()
        assert torch.equal(negative_zero, (codes == 0) & (w < 0))
        same = ~negative_zero
        assert torch.equal(deq[same].view(torch.int32), ds[same].view(torch.int32))


@pytest.mark.parametrize("bits", [8, 4])
def test_deepspeed_range_asymmetric_matches_deepspeed_within_the_bound(bits):
    w = deepspeed_weights(10 + bits)
    with session("zeroquant", bits=bits, symmetric="false", range='"deepspeed"',
                 activation_bits=0) as s:
        q = loom.torch.quantize(w, s.instance("quantizer", "q"))
        codes, scale, zero, ds = deepspeed_asymmetric(w, bits)
        # codes, scales and zero points: identical
        assert torch.equal(loom_codes(q, bits, signed=False), codes)
        assert torch.equal(q.scales.reshape(scale.shape), scale)
        assert torch.equal(q.zero_points.reshape(zero.shape).to(torch.float32), zero)
        deq = loom.torch.dequantize(q)
        # Loom decodes s (q - z) (q - z exact, one rounding), DeepSpeed q s + round(min/s) s
        # (three roundings): within 2^-21 max|x| of the group, not always equal
        assert torch.equal(deq, scale * (codes - zero))
        bound = 2.0 ** -21 * w.abs().amax(dim=1, keepdim=True)
        assert bool(((deq - ds).abs() <= bound).all())
        assert not torch.equal(deq, ds)
