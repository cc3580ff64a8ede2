"""ctypes mirrors of the ABI structs the package passes (abi/include/loom/*.h and
DLPack 0.6's dlpack.h). Each LOOM_*_SIZE is the struct's size up to its last field."""
from __future__ import annotations

import ctypes

ABI_MAJOR = 1

# loom_code
OK = 0
INVALID_ARGUMENT = 1
NOT_FOUND = 2
OUT_OF_RANGE = 3
UNIMPLEMENTED = 4
FAILED_PRECONDITION = 5
UNAVAILABLE = 6
DEADLINE_EXCEEDED = 7
RESOURCE_EXHAUSTED = 8
DATA_LOSS = 9
ABI_MISMATCH = 10
INTERNAL = 11

# loom_log_level, and "off" as the CLI spells it (above every level)
LOG_LEVELS = {"trace": 0, "debug": 1, "info": 2, "warn": 3, "error": 4, "off": 5}

OPTIMIZER_GROUP_NON_FREEZE = 1


def _size(struct, last: str) -> int:
    f = getattr(struct, last)
    return f.offset + f.size


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


class OpenOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("validate_only", ctypes.c_int32),
        ("plugin_path", ctypes.c_char_p),
        ("bootstrap", ctypes.c_void_p),
        ("log_level", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
    ]


OPEN_OPTIONS_SIZE = _size(OpenOptions, "reserved")


class OptimizerTensor(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("param", ctypes.c_void_p),  # DLTensor*
        ("grad", ctypes.c_void_p),
        ("master", ctypes.c_void_p),
        ("exp_avg_mask", ctypes.c_void_p),
    ]


OPTIMIZER_TENSOR_SIZE = _size(OptimizerTensor, "exp_avg_mask")


class OptimizerGroup(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("tensors", ctypes.POINTER(OptimizerTensor)),
        ("tensor_count", ctypes.c_size_t),
        ("lr_scale", ctypes.c_double),
        ("weight_decay", ctypes.c_double),
        ("flags", ctypes.c_uint32),
        ("reserved2", ctypes.c_uint32),
    ]


OPTIMIZER_GROUP_SIZE = _size(OptimizerGroup, "reserved2")


class OptimizerStepArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("groups", ctypes.POINTER(OptimizerGroup)),
        ("group_count", ctypes.c_size_t),
        ("lr", ctypes.c_double),
        ("grad_scale", ctypes.c_double),
        ("step", ctypes.c_int64),
        ("stream", ctypes.c_void_p),
        ("found_inf", ctypes.POINTER(ctypes.c_int32)),
    ]


OPTIMIZER_STEP_ARGS_SIZE = _size(OptimizerStepArgs, "found_inf")


class OptimizerCommInfo(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("owns_communication", ctypes.c_int32),
        ("bytes_sent", ctypes.c_uint64),
        ("bytes_received", ctypes.c_uint64),
        ("rounds", ctypes.c_uint64),
        ("uncompressed_bytes_sent", ctypes.c_uint64),
        ("skipped_steps", ctypes.c_uint64),
    ]


OPTIMIZER_COMM_INFO_SIZE = _size(OptimizerCommInfo, "skipped_steps")


class SamplerPlanArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("dataset_size", ctypes.c_uint64),
        ("global_batch", ctypes.c_int64),
        ("world_size", ctypes.c_int32),
        ("reserved2", ctypes.c_int32),
        ("capacity", ctypes.c_int64),
    ]


SAMPLER_PLAN_ARGS_SIZE = _size(SamplerPlanArgs, "capacity")


class SamplerNextArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("seed", ctypes.c_uint64),
        ("step", ctypes.c_int64),
        ("rank", ctypes.c_int32),
        ("world_size", ctypes.c_int32),
        ("indices", ctypes.POINTER(DLTensor)),
        ("count", ctypes.c_int64),
        ("difficulty", ctypes.c_double),
        ("epoch", ctypes.c_uint64),
        ("consumed", ctypes.c_uint64),
    ]


SAMPLER_NEXT_ARGS_SIZE = _size(SamplerNextArgs, "consumed")

_SAMPLER_PLAN_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p,
                                    ctypes.POINTER(SamplerPlanArgs))
_SAMPLER_NEXT_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p,
                                    ctypes.POINTER(SamplerNextArgs))


class SamplerV1(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("plan", _SAMPLER_PLAN_FN),
        ("next", _SAMPLER_NEXT_FN),
    ]


SAMPLER_V1_SIZE = _size(SamplerV1, "next")


ROUTER_ROUTED = 1
ROUTER_LEARNED = 2


class RouterPlanArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32), ("reserved", ctypes.c_uint32),
        ("batch", ctypes.c_int64), ("seq_len", ctypes.c_int64), ("channels", ctypes.c_int64),
        ("step", ctypes.c_int64), ("layer", ctypes.c_int32), ("num_layers", ctypes.c_int32),
        ("training", ctypes.c_uint32), ("dtype", DLDataType),
        ("flags", ctypes.c_uint32), ("reserved2", ctypes.c_uint32),
        ("kept", ctypes.c_int64), ("saved_bytes", ctypes.c_uint64),
        ("workspace_bytes", ctypes.c_uint64),
    ]


ROUTER_PLAN_ARGS_SIZE = _size(RouterPlanArgs, "workspace_bytes")


class RouterSelectArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32), ("reserved", ctypes.c_uint32),
        ("seed", ctypes.c_uint64), ("step", ctypes.c_int64), ("batch", ctypes.c_int64),
        ("seq_len", ctypes.c_int64), ("channels", ctypes.c_int64),
        ("first_sample", ctypes.c_int64), ("layer", ctypes.c_int32),
        ("num_layers", ctypes.c_int32), ("training", ctypes.c_uint32),
        ("reserved2", ctypes.c_uint32),
        ("x", ctypes.c_void_p), ("weight", ctypes.c_void_p), ("indices", ctypes.c_void_p),
        ("gates", ctypes.c_void_p), ("saved", ctypes.c_void_p), ("saved_bytes", ctypes.c_uint64),
        ("workspace", ctypes.c_void_p), ("workspace_bytes", ctypes.c_uint64),
        ("stream", ctypes.c_void_p),
    ]


ROUTER_SELECT_ARGS_SIZE = _size(RouterSelectArgs, "stream")


class RouterMoveArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32), ("reserved", ctypes.c_uint32),
        ("full", ctypes.c_void_p), ("kept", ctypes.c_void_p), ("indices", ctypes.c_void_p),
        ("stream", ctypes.c_void_p),
    ]


ROUTER_MOVE_ARGS_SIZE = _size(RouterMoveArgs, "stream")


class RouterAdvanceArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32), ("reserved", ctypes.c_uint32),
        ("step", ctypes.c_int64), ("batch", ctypes.c_int64), ("seq_len", ctypes.c_int64),
        ("num_layers", ctypes.c_int32), ("reserved2", ctypes.c_int32),
        ("layer_tokens", ctypes.c_int64), ("consumed_layer_tokens", ctypes.c_uint64),
    ]


ROUTER_ADVANCE_ARGS_SIZE = _size(RouterAdvanceArgs, "consumed_layer_tokens")

_VP = ctypes.c_void_p


class RouterBackwardArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32), ("reserved", ctypes.c_uint32),
        ("batch", ctypes.c_int64), ("seq_len", ctypes.c_int64), ("channels", ctypes.c_int64),
        ("x", _VP), ("weight", _VP), ("indices", _VP), ("dgates", _VP), ("dx", _VP),
        ("dweight", _VP), ("saved", _VP), ("saved_bytes", ctypes.c_uint64),
        ("workspace", _VP), ("workspace_bytes", ctypes.c_uint64), ("stream", _VP),
    ]


ROUTER_BACKWARD_ARGS_SIZE = _size(RouterBackwardArgs, "stream")


class RouterV1(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32), ("reserved", ctypes.c_uint32),
        ("plan", ctypes.CFUNCTYPE(_VP, _VP, ctypes.POINTER(RouterPlanArgs))),
        ("select", ctypes.CFUNCTYPE(_VP, _VP, ctypes.POINTER(RouterSelectArgs))),
        ("gather", ctypes.CFUNCTYPE(_VP, _VP, ctypes.POINTER(RouterMoveArgs))),
        ("scatter", ctypes.CFUNCTYPE(_VP, _VP, ctypes.POINTER(RouterMoveArgs))),
        ("advance", ctypes.CFUNCTYPE(_VP, _VP, ctypes.POINTER(RouterAdvanceArgs))),
        ("backward", ctypes.CFUNCTYPE(_VP, _VP, ctypes.POINTER(RouterBackwardArgs))),
    ]


ROUTER_V1_SIZE = _size(RouterV1, "backward")


class Status(ctypes.Structure):
    pass


STATUS_DESTROY_FN = ctypes.CFUNCTYPE(None, ctypes.POINTER(Status))
Status._fields_ = [
    ("struct_size", ctypes.c_uint32),
    ("code", ctypes.c_int32),
    ("message", ctypes.c_char_p),
    ("destroy", STATUS_DESTROY_FN),
]
STATUS_SIZE = _size(Status, "destroy")

BOOTSTRAP_ALLGATHER_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                          ctypes.c_size_t, ctypes.c_void_p)
BOOTSTRAP_BARRIER_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)


class Bootstrap(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("rank", ctypes.c_int32),
        ("size", ctypes.c_int32),
        ("local_rank", ctypes.c_int32),
        ("ctx", ctypes.c_void_p),
        ("allgather", BOOTSTRAP_ALLGATHER_FN),
        ("barrier", BOOTSTRAP_BARRIER_FN),
    ]


BOOTSTRAP_SIZE = _size(Bootstrap, "barrier")
