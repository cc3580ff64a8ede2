"""ctypes mirrors of DLPack 0.6's structs (dlpack/dlpack.h) and the DLPack codes this
package names. Kept by hand: DLPack is an outside header whose layout is frozen, not one
of Loom's (gen_abi.py generates loom/_abi/ from those, and loom._abi re-exports these names)."""
from __future__ import annotations

import ctypes

__all__ = ["DLDevice", "DLDataType", "DLTensor", "DLManagedTensor", "DL_CPU", "DL_CUDA",
           "DL_CUDA_HOST", "DL_FLOAT", "DL_BFLOAT", "DL_INT", "DL_UINT", "DEVICE_NAMES",
           "dtype_name"]


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


# DLDeviceType and DLDataTypeCode values this package names.
DL_CPU = 1
DL_CUDA = 2
DL_CUDA_HOST = 3
DL_FLOAT = 2
DL_BFLOAT = 4
DL_INT = 0
DL_UINT = 1

DEVICE_NAMES = {1: "cpu", 2: "cuda", 3: "cuda_host", 4: "opencl", 7: "vulkan", 8: "metal",
                9: "vpi", 10: "rocm", 11: "rocm_host", 13: "cuda_managed", 14: "oneapi"}


def dtype_name(code: int, bits: int, lanes: int) -> str:
    base = {DL_INT: "int", DL_UINT: "uint", DL_FLOAT: "float", DL_BFLOAT: "bfloat",
            3: "opaque_handle", 5: "complex", 6: "bool"}.get(code, f"code{code}_")
    name = f"{base}{bits}"
    return name if lanes == 1 else f"{name}x{lanes}"
