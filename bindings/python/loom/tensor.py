"""Borrowing tensors through DLPack, zero-copy.

Any object with ``__dlpack__`` (numpy >= 1.22 arrays, torch tensors, CPU or CUDA) is
accepted. Loom reads the ``DLManagedTensor`` inside the capsule the object exports and
passes its ``DLTensor`` to the plugin as is: the plugin works on the object's own memory.
The capsule is kept alive for the call and never consumed, so the exporter frees it as
usual. Nothing is ever copied or converted: a tensor of the wrong dtype, a non-contiguous
one or one on an unsupported device is refused with :class:`loom.InvalidArgumentError`
naming it.
"""

import ctypes
from typing import Any, Iterable, Optional, Sequence, Tuple

from . import _abi
from ._lib import capsule_name, capsule_pointer
from .errors import InvalidArgumentError

# Friendly dtype names -> (DLDataTypeCode, bits).
DTYPES = {
    "float32": (_abi.DL_FLOAT, 32),
    "float16": (_abi.DL_FLOAT, 16),
    "bfloat16": (_abi.DL_BFLOAT, 16),
    "float64": (_abi.DL_FLOAT, 64),
    "int64": (_abi.DL_INT, 64),
    "int32": (_abi.DL_INT, 32),
    "uint16": (_abi.DL_UINT, 16),
    "uint8": (_abi.DL_UINT, 8),
    "int8": (_abi.DL_INT, 8),
}


class Borrowed:
    """One tensor borrowed through DLPack: ``pointer`` is its ``DLTensor*`` as an int,
    valid while this object (which holds the exporting object and its capsule) lives.

    Attributes:
        pointer (int): address of the DLTensor.
        dtype (str): e.g. "float32".
        device (tuple[str, int]): e.g. ("cpu", 0) or ("cuda", 1).
        shape (tuple[int, ...]): the tensor's shape.
        numel (int): the number of elements.
    """

    __slots__ = ("obj", "capsule", "pointer", "dtype", "device", "shape", "numel", "name")

    def __init__(self, obj: Any, capsule: Any, pointer: int, dtype: str,
                 device: Tuple[str, int], shape: Tuple[int, ...], name: str) -> None:
        self.obj = obj
        self.capsule = capsule
        self.pointer = pointer
        self.dtype = dtype
        self.device = device
        self.shape = shape
        self.numel = 1
        for s in shape:
            self.numel *= s
        self.name = name

    def __repr__(self) -> str:
        return (f"<loom.tensor.Borrowed {self.name}: {self.dtype}{list(self.shape)} on "
                f"{self.device[0]}:{self.device[1]}>")


def _export(obj: Any, name: str, stream: Optional[int]) -> Any:
    exporter = getattr(obj, "__dlpack__", None)
    if exporter is None:
        raise InvalidArgumentError(
            f"{name}: a {type(obj).__module__}.{type(obj).__name__} has no __dlpack__; pass a "
            "numpy (>= 1.22) array or a torch tensor")
    try:
        if stream is None:
            return exporter()
        return exporter(stream=stream)
    except (RuntimeError, TypeError, ValueError, BufferError) as e:
        raise InvalidArgumentError(f"{name}: cannot be exported through DLPack: {e}") from e


def borrow(obj: Any, name: str = "tensor", *, dtypes: Iterable[str] = ("float32",),
           devices: Iterable[str] = ("cpu", "cuda"), stream: Optional[int] = None,
           layout: str = "contiguous") -> Borrowed:
    """Borrows ``obj`` through DLPack after checking it.

    Args:
        obj: an object with ``__dlpack__`` (a numpy array, a torch tensor).
        name: what error messages call it ("params[0][3]").
        dtypes: the dtype names the caller accepts ("float32", "bfloat16", "float16", ...).
        devices: the device kinds accepted ("cpu", "cuda").
        stream: passed to ``__dlpack__(stream=...)`` for device tensors (None: not passed).
        layout: "contiguous" (compact row-major, the default) or "rows" (only the last
            dimension must be contiguous; the others may have any stride, which the call
            that takes such tensors checks itself).

    Returns:
        Borrowed: the tensor, its capsule and its ``DLTensor*``.

    Raises:
        InvalidArgumentError: not exportable, consumed, the wrong dtype or device,
            or not contiguous (compact row-major). Nothing is copied to fix it.
    """
    capsule = _export(obj, name, stream)
    pointer = capsule_pointer(capsule, b"dltensor")
    if not pointer:
        raise InvalidArgumentError(
            f"{name}: __dlpack__ returned {capsule_name(capsule)}, not an unconsumed "
            "'dltensor' capsule")
    managed = _abi.DLManagedTensor.from_address(pointer)
    t = managed.dl_tensor
    dt = _abi.dtype_name(t.dtype.code, t.dtype.bits, t.dtype.lanes)
    wanted = tuple(dtypes)
    if t.dtype.lanes != 1 or (t.dtype.code, t.dtype.bits) not in [DTYPES[d] for d in wanted]:
        raise InvalidArgumentError(
            f"{name}: dtype {dt} is not accepted here (accepted: {', '.join(wanted)}); "
            "Loom does not convert tensors, convert it yourself")
    dev = _abi.DEVICE_NAMES.get(t.device.device_type, f"device type {t.device.device_type}")
    if dev not in tuple(devices):
        raise InvalidArgumentError(
            f"{name}: tensors on {dev} are not accepted here (accepted: "
            f"{', '.join(devices)})")
    if t.ndim < 0:
        raise InvalidArgumentError(f"{name}: ndim {t.ndim} is negative")
    shape = tuple(t.shape[i] for i in range(t.ndim))
    if any(s < 0 for s in shape):
        raise InvalidArgumentError(f"{name}: shape {list(shape)} has a negative extent")
    if t.strides and layout == "rows":
        if t.ndim and shape[-1] != 1 and t.strides[t.ndim - 1] != 1:
            strides = [t.strides[j] for j in range(t.ndim)]
            raise InvalidArgumentError(
                f"{name}: its last dimension is not contiguous (shape {list(shape)}, strides "
                f"{strides} in elements); Loom does not copy")
    elif t.strides:
        expected = 1
        for i in reversed(range(t.ndim)):
            if shape[i] != 1 and t.strides[i] != expected:
                strides = [t.strides[j] for j in range(t.ndim)]
                raise InvalidArgumentError(
                    f"{name}: not contiguous (shape {list(shape)}, strides {strides} in "
                    "elements; Loom needs compact row-major tensors and does not copy: call "
                    ".contiguous() or numpy.ascontiguousarray yourself)")
            expected *= shape[i]
    return Borrowed(obj, capsule, pointer, dt, (dev, t.device.device_id), shape, name)


def borrow_all(objs: Sequence[Any], name: str, **kwargs: Any) -> list:
    """borrow() for each element, named ``name[i]``."""
    return [borrow(o, f"{name}[{i}]", **kwargs) for i, o in enumerate(objs)]


def host_workspace(workspace: Optional[int], nbytes: int, like: Any, what: str) -> tuple:
    """(holder, address): the caller's workspace, or for host tensors a 256-byte aligned
    host buffer of nbytes made here when the caller gave none."""
    if workspace is not None or nbytes <= 0:
        return None, workspace
    if like.device[0] not in ("cpu", "cuda_host"):
        raise InvalidArgumentError(
            f"{what}: the plugin asks for a {nbytes}-byte workspace and the tensors are on "
            f"{like.device[0]}:{like.device[1]}; pass workspace= (the address of a 256-byte "
            "aligned buffer of workspace_bytes on that device): a host buffer is made "
            "only for host tensors")
    host = ctypes.create_string_buffer(int(nbytes) + 256)
    return host, (ctypes.addressof(host) + 255) // 256 * 256
