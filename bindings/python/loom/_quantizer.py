"""The loom.quantizer/1 calls of :class:`loom.Instance` (``quantizer_layout``,
``quantizer_quantize``, ``quantizer_dequantize``, ``quantizer_matmul``) and
:class:`QuantLayout`. A mixin of Instance, kept apart to keep session.py short."""
from __future__ import annotations

import ctypes
from typing import Any, Dict, Optional, Sequence

from . import _abi
from .errors import InvalidArgumentError, UnimplementedError
from .tensor import borrow, host_workspace as _host_workspace


class QuantizerCalls:
    """Instance methods for ``[quantizer.NAME]`` instances (see :class:`loom.Instance`,
    which provides name, plugin, _require, _table and _call)."""

    def _quantizer(self) -> tuple:
        self._require("quantizer")
        return self._table("quantizer", _abi.QUANTIZER_V1_SIZE, _abi.QuantizerV1)

    def quantizer_layout(self, shape: Sequence[int], *, role: str = "weight",
                         dtype: str = "float32", matmul_rows: int = 0) -> "QuantLayout":
        """The packed format a quantizer produces for a 2-D ``shape`` and ``role``
        ("weight": W [N, K], groups along K; "activation": X [M, K], one scale per row),
        and the buffer sizes (loom.quantizer/1 ``layout``). ``matmul_rows``: the
        activation rows to size the matmul's workspace for (0: none)."""
        from .tensor import DTYPES

        obj, table = self._quantizer()
        roles = {"weight": _abi.QUANTIZER_WEIGHT, "activation": _abi.QUANTIZER_ACTIVATION}
        if role not in roles:
            raise InvalidArgumentError(f"role '{role}' is not one of weight, activation")
        if dtype not in DTYPES:
            raise InvalidArgumentError(f"dtype '{dtype}' is not one of {', '.join(DTYPES)}")
        lay = QuantLayout(shape, role, dtype)
        a = _abi.QuantizerLayoutArgs()
        a.struct_size = _abi.QUANTIZER_LAYOUT_ARGS_SIZE
        a.role, a.ndim = roles[role], len(lay.shape)
        a.shape = ctypes.cast(lay._shape, ctypes.POINTER(ctypes.c_int64))
        code, bits = DTYPES[dtype]
        a.dtype = _abi.DLDataType(code, bits, 1)
        a.matmul_rows = int(matmul_rows)
        a.format = ctypes.pointer(lay._format)
        self._call(table.layout(obj, ctypes.byref(a)))
        lay._fill(a, bool(table.matmul))
        return lay

    def _quant_args(self, layout: "QuantLayout", x: Any, packed: Any, scales: Any,
                    zero_points: Any, workspace: Optional[int], workspace_bytes: int,
                    stream: Optional[int], what: str) -> tuple:
        if not isinstance(layout, QuantLayout):
            raise InvalidArgumentError(f"{what}: layout must come from quantizer_layout")
        bx = borrow(x, "x", dtypes=("float32", "bfloat16", "float16"))
        bp = borrow(packed, "packed", dtypes=("uint8",))
        bs = borrow(scales, "scales", dtypes=("float32", "bfloat16", "float16"))
        bz = (borrow(zero_points, "zero_points",
                     dtypes=("uint8", "int8", "float32", "bfloat16", "float16"))
              if zero_points is not None else None)
        a = _abi.QuantizerQuantizeArgs()
        a.struct_size = _abi.QUANTIZER_QUANTIZE_ARGS_SIZE
        a.role = layout._role
        a.format = ctypes.pointer(layout._format)
        a.x, a.packed, a.scales = bx.pointer, bp.pointer, bs.pointer
        a.zero_points = bz.pointer if bz is not None else None
        if workspace_bytes == 0:
            workspace_bytes = layout.workspace_bytes
        host, workspace = _host_workspace(workspace, workspace_bytes, bx, what)
        a.workspace, a.workspace_bytes, a.stream = workspace, int(workspace_bytes), stream
        return a, (bx, bp, bs, bz, host)

    def quantizer_quantize(self, layout: "QuantLayout", x: Any, packed: Any, scales: Any,
                           zero_points: Any = None, *, workspace: Optional[int] = None,
                           workspace_bytes: int = 0, stream: Optional[int] = None) -> None:
        """x -> packed (uint8 [packed_bytes]), scales (scale_count elements of the scale
        dtype) and zero points (asymmetric only) (loom.quantizer/1 ``quantize``)."""
        obj, table = self._quantizer()
        a, held = self._quant_args(layout, x, packed, scales, zero_points, workspace,
                                   workspace_bytes, stream, "quantizer_quantize")
        self._call(table.quantize(obj, ctypes.byref(a)))
        del held

    def quantizer_dequantize(self, layout: "QuantLayout", packed: Any, scales: Any,
                             zero_points: Any, x: Any, *, workspace: Optional[int] = None,
                             workspace_bytes: int = 0, stream: Optional[int] = None) -> None:
        """The reverse of :meth:`quantizer_quantize`: writes x (loom.quantizer/1
        ``dequantize``)."""
        obj, table = self._quantizer()
        a, held = self._quant_args(layout, x, packed, scales, zero_points, workspace,
                                   workspace_bytes, stream, "quantizer_dequantize")
        self._call(table.dequantize(obj, ctypes.byref(a)))
        del held

    def quantizer_matmul(self, layout: "QuantLayout", x: Any, packed: Any, scales: Any,
                         zero_points: Any, y: Any, *, bias: Any = None,
                         workspace: Optional[int] = None, workspace_bytes: int = 0,
                         stream: Optional[int] = None) -> None:
        """y [M, N] = x [M, K] . W^T (+ bias [N]) with W [N, K] packed in ``layout`` (a
        weight layout) (loom.quantizer/1 ``matmul``). ``workspace_bytes``: the layout's
        matmul_workspace_bytes for M rows or more (a host buffer is made here for host
        tensors when no workspace is given)."""
        obj, table = self._quantizer()
        if not table.matmul or not layout.has_matmul:
            raise UnimplementedError(
                f"quantizer.{self.name} (plugin '{self.plugin}') has no matmul for this format")
        floats = ("float32", "bfloat16", "float16")
        bx = borrow(x, "x", dtypes=floats)
        bp = borrow(packed, "packed", dtypes=("uint8",))
        bs = borrow(scales, "scales", dtypes=floats)
        bz = (borrow(zero_points, "zero_points", dtypes=("uint8", "int8") + floats)
              if zero_points is not None else None)
        bb = borrow(bias, "bias", dtypes=floats) if bias is not None else None
        by = borrow(y, "y", dtypes=floats)
        a = _abi.QuantizerMatmulArgs()
        a.struct_size = _abi.QUANTIZER_MATMUL_ARGS_SIZE
        a.format = ctypes.pointer(layout._format)
        a.x, a.packed, a.scales, a.y = bx.pointer, bp.pointer, bs.pointer, by.pointer
        a.zero_points = bz.pointer if bz is not None else None
        a.bias = bb.pointer if bb is not None else None
        host, workspace = _host_workspace(workspace, workspace_bytes, bx, "quantizer_matmul")
        a.workspace, a.workspace_bytes, a.stream = workspace, int(workspace_bytes), stream
        self._call(table.matmul(obj, ctypes.byref(a)))
        del bx, bp, bs, bz, bb, by, host


def _dtype_of(d: "_abi.DLDataType") -> Optional[str]:
    from .tensor import DTYPES

    if d.code == 0 and d.bits == 0:
        return None
    for name, (code, bits) in DTYPES.items():
        if (code, bits) == (d.code, d.bits) and d.lanes == 1:
            return name
    return _abi.dtype_name(d.code, d.bits, d.lanes)


class QuantLayout:
    """What a quantizer's ``layout`` returned for one shape and role: the packed format
    (a ``loom_quant_format`` kept alive with its shape) and the buffer sizes.

    Attributes:
        shape (tuple[int, int]), role ("weight" | "activation"), dtype (the float side),
        scheme ("int" | "binary" | "ternary"), bits, symmetric (bool), packing
        ("lsb_first" | "msb_first"), axis, group_size, scale_dtype, zero_point_dtype (None
        without zero points), scale_shape (tuple), packed_bytes, scale_count,
        zero_point_count, workspace_bytes, matmul_workspace_bytes, has_matmul,
        int8_activations.
    """

    def __init__(self, shape: Sequence[int], role: str, dtype: str) -> None:
        self.shape = tuple(int(v) for v in shape)
        if len(self.shape) != 2 or any(v < 0 for v in self.shape):
            raise InvalidArgumentError(
                f"a quantizer takes 2-D shapes ([N, K] or [M, K]), not {list(self.shape)}")
        self.role, self.dtype = role, dtype
        self._role = _abi.QUANTIZER_WEIGHT if role == "weight" else _abi.QUANTIZER_ACTIVATION
        self._shape = (ctypes.c_int64 * 2)(*self.shape)
        self._format = _abi.QuantFormat()
        self._format.struct_size = _abi.QUANT_FORMAT_SIZE

    def _fill(self, a: "_abi.QuantizerLayoutArgs", table_has_matmul: bool) -> None:
        f = self._format
        self.scheme = _abi.QUANT_SCHEME_NAMES.get(int(f.scheme), str(f.scheme))
        self.bits = int(f.bits)
        self.symmetric = bool(f.flags & _abi.QUANT_SYMMETRIC)
        self.packing = _abi.QUANT_PACKING_NAMES.get(int(f.packing), str(f.packing))
        self.axis, self.group_size = int(f.axis), int(f.group_size)
        self.scale_dtype = _dtype_of(f.scale_dtype)
        self.zero_point_dtype = _dtype_of(f.zero_point_dtype)
        if self.group_size == 0:
            self.scale_shape: tuple = (1,)
        else:
            dims = list(self.shape)
            dims[self.axis] = -(-dims[self.axis] // self.group_size)
            self.scale_shape = tuple(dims)
        self.flags = int(a.flags)
        self.has_matmul = table_has_matmul and bool(a.flags & _abi.QUANTIZER_HAS_MATMUL)
        self.int8_activations = bool(a.flags & _abi.QUANTIZER_INT8_ACTIVATIONS)
        self.packed_bytes = int(a.packed_bytes)
        self.scale_count = int(a.scale_count)
        self.zero_point_count = int(a.zero_point_count)
        self.workspace_bytes = int(a.workspace_bytes)
        self.matmul_workspace_bytes = int(a.matmul_workspace_bytes)

    def describe(self) -> Dict[str, Any]:
        """The format and sizes as a dict."""
        keys = ("shape", "role", "dtype", "scheme", "bits", "symmetric", "packing", "axis",
                "group_size", "scale_dtype", "zero_point_dtype", "scale_shape",
                "packed_bytes", "scale_count", "zero_point_count", "workspace_bytes",
                "matmul_workspace_bytes", "has_matmul", "int8_activations")
        return {k: getattr(self, k) for k in keys}

    def __repr__(self) -> str:
        return (f"<loom.QuantLayout {self.role} {list(self.shape)}: {self.scheme}{self.bits} "
                f"group_size {self.group_size}, {self.packed_bytes} bytes>")
