"""loom.torch's quantization: :class:`QuantizedTensor`, :func:`quantize`,
:func:`dequantize` and :class:`QuantizedLinear` over ``loom.quantizer/1`` instances
(imported from :mod:`loom.torch`)."""
from typing import Any, Dict, Optional

import torch

from ._torch_common import _DTYPES, _buffer, _stream
from .errors import InvalidArgumentError
from .session import Instance

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                 "float16": torch.float16, "uint8": torch.uint8, "int8": torch.int8}


def _quantizer_instance(instance: Any, what: str) -> Instance:
    if not isinstance(instance, Instance) or instance.section != "quantizer":
        raise InvalidArgumentError(
            f"{what} needs a loom.quantizer/1 instance (session.instance('quantizer', NAME)), "
            f"not {instance!r}")
    return instance


class QuantizedTensor:
    """A 2-D float tensor in a quantizer's packed form: ``codes`` (uint8 [packed_bytes]),
    ``scales`` ([scale_shape] of the format's scale dtype), ``zero_points`` (asymmetric INT
    only, else None) and the ``layout`` (a :class:`loom.session.QuantLayout`: scheme,
    bits, packing, group size, ...), with the ``instance`` that made it."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor,
                 zero_points: Optional[torch.Tensor], layout: Any, instance: Instance) -> None:
        self.codes, self.scales, self.zero_points = codes, scales, zero_points
        self.layout, self.instance = layout, instance

    @property
    def shape(self) -> tuple:
        return self.layout.shape

    def dequantize(self) -> torch.Tensor:
        return dequantize(self)

    def __repr__(self) -> str:
        return (f"<loom.torch.QuantizedTensor {list(self.shape)} {self.layout.scheme}"
                f"{self.layout.bits} group_size {self.layout.group_size}: "
                f"{self.layout.packed_bytes} code bytes>")


def _quant_buffers(layout: Any, device: torch.device) -> tuple:
    codes = torch.empty(layout.packed_bytes, dtype=torch.uint8, device=device)
    if layout.scale_dtype not in _TORCH_DTYPES:
        raise InvalidArgumentError(f"the quantizer's scale dtype {layout.scale_dtype} has no "
                                   "torch dtype here")
    scales = torch.empty(layout.scale_shape, dtype=_TORCH_DTYPES[layout.scale_dtype],
                         device=device)
    zeros = None
    if layout.zero_point_count > 0:
        if layout.zero_point_dtype not in _TORCH_DTYPES:
            raise InvalidArgumentError(f"the quantizer's zero-point dtype "
                                       f"{layout.zero_point_dtype} has no torch dtype here")
        zeros = torch.empty(layout.scale_shape, dtype=_TORCH_DTYPES[layout.zero_point_dtype],
                            device=device)
    return codes, scales, zeros


def quantize(tensor: torch.Tensor, instance: Instance, *,
             role: str = "weight") -> QuantizedTensor:
    """Quantizes a 2-D float tensor through a ``loom.quantizer/1`` instance (its layout,
    then quantize): a weight [N, K] (groups along K) or activations [M, K] (one scale per
    row, ``role="activation"``). Nothing is converted: the tensor must be contiguous and of
    a dtype the plugin takes (float32; on CUDA also bfloat16)."""
    instance = _quantizer_instance(instance, "loom.torch.quantize")
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2:
        raise InvalidArgumentError(
            "loom.torch.quantize takes a 2-D tensor ([N, K] weight or [M, K] activations), "
            f"not {getattr(tensor, 'shape', type(tensor).__name__)}")
    if tensor.dtype not in _DTYPES:
        raise InvalidArgumentError(f"loom.torch.quantize: dtype {tensor.dtype} is not a float "
                                   "type a quantizer takes")
    t = tensor.detach()
    layout = instance.quantizer_layout(tuple(t.shape), role=role, dtype=_DTYPES[t.dtype])
    codes, scales, zeros = _quant_buffers(layout, t.device)
    ws, ws_at = _buffer(layout.workspace_bytes, t.device)
    instance.quantizer_quantize(layout, t, codes, scales, zeros, workspace=ws_at,
                                workspace_bytes=layout.workspace_bytes, stream=_stream(t))
    del ws
    return QuantizedTensor(codes, scales, zeros, layout, instance)


def dequantize(q: QuantizedTensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The float tensor a :class:`QuantizedTensor` decodes to (the quantizer's dequantize),
    of the layout's float dtype unless ``dtype`` names another the plugin writes."""
    if not isinstance(q, QuantizedTensor):
        raise InvalidArgumentError(
            f"loom.torch.dequantize takes a loom.torch.QuantizedTensor, not {type(q).__name__}")
    dtype = _TORCH_DTYPES[q.layout.dtype] if dtype is None else dtype
    out = torch.empty(q.layout.shape, dtype=dtype, device=q.codes.device)
    ws, ws_at = _buffer(q.layout.workspace_bytes, out.device)
    q.instance.quantizer_dequantize(q.layout, q.codes, q.scales, q.zero_points, out,
                                    workspace=ws_at, workspace_bytes=q.layout.workspace_bytes,
                                    stream=_stream(out))
    del ws
    return out


class _QuantMatmul(torch.autograd.Function):
    """y = x . W^T (+ bias) through the quantizer's matmul; in backward x's gradient is
    dy . W with W decoded (only then, and only when x needs it); the codes get none."""

    @staticmethod
    def forward(ctx, x, bias, module):  # type: ignore[override]
        ctx.module = module
        ctx.bias = bias is not None
        return module._matmul(x.detach(), None if bias is None else bias.detach())

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        dx = db = None
        if ctx.needs_input_grad[0]:
            w = ctx.module.dequantize().to(dy.dtype)
            dx = dy @ w
        if ctx.bias and ctx.needs_input_grad[1]:
            db = dy.sum(dim=0)
        return dx, db, None


class QuantizedLinear(torch.nn.Module):
    """A linear layer whose weight is held only in a quantizer's packed form: the buffers
    ``qcodes`` (uint8), ``qscale`` (the group scales) and, for asymmetric INT, ``qzero``
    (the zero points); ``bias`` stays float (a buffer). ``forward`` runs the quantizer's
    matmul on the packed weight (zeroquant: W8A8 / W4A8 with per-token INT8 activations,
    or weight-only; xtc: the 1- and 2-bit kernels), never materialising the float weight.
    Its backward gives x a gradient (dy . W, the weight decoded for it) so layers before it
    train; the packed weight itself is frozen.

    Build it with :meth:`from_linear`; :meth:`dequantize` returns the weight the layer
    computes with. A plugin without a matmul for the format is refused at construction.

    Attributes:
        in_features, out_features (int), instance (loom.Instance), layout
        (loom.session.QuantLayout): the packed format.
    """

    def __init__(self, instance: Instance, in_features: int, out_features: int, *,
                 bias: bool = True, dtype: torch.dtype = torch.float32,
                 device: Any = None) -> None:
        super().__init__()
        self.instance = _quantizer_instance(instance, "loom.torch.QuantizedLinear")
        if dtype not in _DTYPES:
            raise InvalidArgumentError(f"loom.torch.QuantizedLinear: dtype {dtype} is not a "
                                       "float type a quantizer takes")
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.dtype = dtype
        self.layout = self.instance.quantizer_layout((self.out_features, self.in_features),
                                                     role="weight", dtype=_DTYPES[dtype])
        if not self.layout.has_matmul:
            raise InvalidArgumentError(
                f"quantizer.{self.instance.name} (plugin '{self.instance.plugin}') has no "
                f"matmul for its {self.layout.scheme}{self.layout.bits} format: use "
                "loom.torch.quantize / dequantize and a float linear instead")
        codes, scales, zeros = _quant_buffers(self.layout, torch.device(device or "cpu"))
        self.register_buffer("qcodes", codes.zero_())
        self.register_buffer("qscale", scales.zero_())
        self.register_buffer("qzero", zeros.zero_() if zeros is not None else None)
        self.register_buffer("bias", torch.zeros(self.out_features, dtype=dtype,
                                                 device=device) if bias else None)
        self._matmul_layouts: Dict[int, Any] = {}

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, instance: Instance) -> "QuantizedLinear":
        """Quantizes ``linear``'s weight [out, in] through ``instance`` (its layout and
        quantize) and keeps the bias; the new layer is on linear's device."""
        if not isinstance(linear, torch.nn.Linear):
            raise InvalidArgumentError(
                f"QuantizedLinear.from_linear takes a torch.nn.Linear, not "
                f"{type(linear).__name__}")
        w = linear.weight.detach()
        mod = cls(instance, linear.in_features, linear.out_features,
                  bias=linear.bias is not None, dtype=w.dtype, device=w.device)
        q = quantize(w.contiguous(), mod.instance)
        mod.qcodes.copy_(q.codes)
        mod.qscale.copy_(q.scales)
        if q.zero_points is not None:
            mod.qzero.copy_(q.zero_points)
        if linear.bias is not None:
            mod.bias.copy_(linear.bias.detach())
        return mod

    def quantized_weight(self) -> QuantizedTensor:
        """The packed weight as a :class:`QuantizedTensor` (views of the buffers)."""
        return QuantizedTensor(self.qcodes, self.qscale, self.qzero, self.layout,
                               self.instance)

    def dequantize(self) -> torch.Tensor:
        """The float weight [out, in] the layer computes with (decoded now, not kept)."""
        return dequantize(self.quantized_weight())

    def _matmul(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        m = x.shape[0]
        layout = self._matmul_layouts.get(m)
        if layout is None:
            layout = self.instance.quantizer_layout((self.out_features, self.in_features),
                                                    role="weight", dtype=_DTYPES[self.dtype],
                                                    matmul_rows=m)
            if len(self._matmul_layouts) > 8:
                self._matmul_layouts.clear()
            self._matmul_layouts[m] = layout
        y = torch.empty((m, self.out_features), dtype=x.dtype, device=x.device)
        ws, ws_at = _buffer(layout.matmul_workspace_bytes, x.device)
        self.instance.quantizer_matmul(layout, x, self.qcodes, self.qscale, self.qzero, y,
                                       bias=bias, workspace=ws_at,
                                       workspace_bytes=layout.matmul_workspace_bytes,
                                       stream=_stream(x))
        del ws
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., in_features]`` of the layer's dtype; returns ``[..., out]``."""
        if x.dim() < 1 or x.shape[-1] != self.in_features:
            raise InvalidArgumentError(
                f"loom.torch.QuantizedLinear: x must be [..., {self.in_features}], not shape "
                f"{list(x.shape)}")
        if x.dtype != self.dtype:
            raise InvalidArgumentError(
                f"loom.torch.QuantizedLinear: x is {x.dtype}, the layer {self.dtype}")
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        y = _QuantMatmul.apply(flat, self.bias, self)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        l = self.layout
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, quantizer.{self.instance.name}: "
                f"{l.scheme}{l.bits} group_size={l.group_size}"
                f"{' W8A8' if l.int8_activations else ''}")
