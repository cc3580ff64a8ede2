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


# ---- loom.curriculum/1 (abi/include/loom/kinds/curriculum.h)
CURRICULUM_METRIC = 1 << 0
CURRICULUM_SCHEDULE = 1 << 1
SEQ_LEN_NONE = 0
SEQ_LEN_TRUNCATE = 1
SEQ_LEN_RESHAPE = 2
SEQ_LEN_MODES = {0: "none", 1: "truncate", 2: "reshape"}


class CurriculumPlanArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32), ("reserved", ctypes.c_uint32),
        ("vocab_size", ctypes.c_uint32), ("reserved2", ctypes.c_uint32),
        ("roles", ctypes.c_uint32), ("seq_len_mode", ctypes.c_uint32),
        ("stats_count", ctypes.c_uint64),
    ]


CURRICULUM_PLAN_ARGS_SIZE = _size(CurriculumPlanArgs, "stats_count")


class CurriculumSamples(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32), ("reserved", ctypes.c_uint32),
        ("tokens", ctypes.c_void_p), ("offsets", ctypes.c_void_p),
    ]


CURRICULUM_SAMPLES_SIZE = _size(CurriculumSamples, "offsets")


class CurriculumCountArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32), ("reserved", ctypes.c_uint32),
        ("samples", CurriculumSamples),
        ("vocab_size", ctypes.c_uint32), ("reserved2", ctypes.c_uint32),
        ("stats", ctypes.c_void_p), ("stream", ctypes.c_void_p),
    ]


CURRICULUM_COUNT_ARGS_SIZE = _size(CurriculumCountArgs, "stream")


class CurriculumScoreArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32), ("reserved", ctypes.c_uint32),
        ("samples", CurriculumSamples),
        ("vocab_size", ctypes.c_uint32), ("reserved2", ctypes.c_uint32),
        ("stats", ctypes.c_void_p), ("scores", ctypes.c_void_p), ("stream", ctypes.c_void_p),
    ]


CURRICULUM_SCORE_ARGS_SIZE = _size(CurriculumScoreArgs, "stream")


class CurriculumAtArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32), ("reserved", ctypes.c_uint32),
        ("step", ctypes.c_int64), ("difficulty", ctypes.c_double), ("seq_len", ctypes.c_int64),
    ]


CURRICULUM_AT_ARGS_SIZE = _size(CurriculumAtArgs, "seq_len")


class CurriculumV1(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32), ("reserved", ctypes.c_uint32),
        ("plan", ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p,
                                  ctypes.POINTER(CurriculumPlanArgs))),
        ("count", ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p,
                                   ctypes.POINTER(CurriculumCountArgs))),
        ("score", ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p,
                                   ctypes.POINTER(CurriculumScoreArgs))),
        ("at", ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p,
                                ctypes.POINTER(CurriculumAtArgs))),
    ]


CURRICULUM_V1_SIZE = _size(CurriculumV1, "at")


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


# ---- loom.moe/1 (abi/include/loom/kinds/moe.h)
MOE_RESIDUAL = 1 << 0
MOE_DROPLESS = 1 << 1
MOE_EXPERT_BIAS = 1 << 2
MOE_EXPERT_PARALLEL = 1 << 3
MOE_ACTIVATIONS = {1: "gelu", 2: "relu", 3: "silu"}

_I32, _U32, _I64, _U64 = ctypes.c_int32, ctypes.c_uint32, ctypes.c_int64, ctypes.c_uint64


class MoePlanArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", _U32), ("reserved", _U32),
        ("tokens", _I64), ("model_dim", _I64), ("hidden_dim", _I64),
        ("num_experts", _I32), ("layer", _I32), ("num_layers", _I32), ("training", _U32),
        ("dtype", DLDataType),
        ("flags", _U32), ("experts", _I32), ("local_experts", _I32), ("ep_size", _I32),
        ("ep_rank", _I32), ("top_k", _I32), ("activation", _I32), ("reserved2", _I32),
        ("capacity", _I64), ("max_expert_rows", _I64), ("saved_bytes", _U64),
        ("workspace_bytes", _U64),
    ]


MOE_PLAN_ARGS_SIZE = _size(MoePlanArgs, "workspace_bytes")

MOE_WEIGHT_NAMES = ("gate_w", "w1", "b1", "w2", "b2", "res_w1", "res_b1", "res_w2", "res_b2",
                    "coef_w", "coef_b")


class MoeWeights(ctypes.Structure):
    _fields_ = [("struct_size", _U32), ("reserved", _U32)] + [
        (n, _VP) for n in MOE_WEIGHT_NAMES]


MOE_WEIGHTS_SIZE = _size(MoeWeights, "coef_b")


class MoeStats(ctypes.Structure):
    _fields_ = [
        ("struct_size", _U32), ("reserved", _U32),
        ("aux_loss", ctypes.c_double), ("dropped", _I64), ("expert_rows", _I64),
        ("load", ctypes.POINTER(_I64)), ("load_count", _I64),
    ]


MOE_STATS_SIZE = _size(MoeStats, "load_count")


class MoeForwardArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", _U32), ("reserved", _U32),
        ("seed", _U64), ("step", _I64), ("tokens", _I64), ("first_token", _I64),
        ("model_dim", _I64), ("hidden_dim", _I64),
        ("num_experts", _I32), ("layer", _I32), ("num_layers", _I32), ("training", _U32),
        ("x", _VP), ("weights", ctypes.POINTER(MoeWeights)), ("expert_bias", _VP), ("y", _VP),
        ("route_experts", _VP), ("route_weights", _VP), ("stats", ctypes.POINTER(MoeStats)),
        ("saved", _VP), ("saved_bytes", _U64), ("workspace", _VP), ("workspace_bytes", _U64),
        ("stream", _VP),
    ]


MOE_FORWARD_ARGS_SIZE = _size(MoeForwardArgs, "stream")


class MoeBackwardArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", _U32), ("reserved", _U32),
        ("seed", _U64), ("step", _I64), ("tokens", _I64), ("first_token", _I64),
        ("model_dim", _I64), ("hidden_dim", _I64),
        ("num_experts", _I32), ("layer", _I32), ("num_layers", _I32), ("training", _U32),
        ("aux_loss_coef", ctypes.c_double),
        ("x", _VP), ("weights", ctypes.POINTER(MoeWeights)), ("dy", _VP), ("dx", _VP),
        ("grads", ctypes.POINTER(MoeWeights)), ("saved", _VP), ("saved_bytes", _U64),
        ("workspace", _VP), ("workspace_bytes", _U64), ("stream", _VP),
    ]


MOE_BACKWARD_ARGS_SIZE = _size(MoeBackwardArgs, "stream")


class MoeDispatchArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", _U32), ("reserved", _U32),
        ("tokens", _I64), ("model_dim", _I64), ("num_experts", _I32), ("top_k", _I32),
        ("x", _VP), ("rows", _VP), ("route_experts", _VP), ("route_weights", _VP),
        ("counts", ctypes.POINTER(_I64)), ("counts_count", _I64),
        ("workspace", _VP), ("workspace_bytes", _U64), ("stream", _VP),
    ]


MOE_DISPATCH_ARGS_SIZE = _size(MoeDispatchArgs, "stream")


class MoeReduceArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", _U32), ("reserved", _U32),
        ("tensors", ctypes.POINTER(_VP)), ("count", _I64), ("stream", _VP),
    ]


MOE_REDUCE_ARGS_SIZE = _size(MoeReduceArgs, "stream")


class MoeV1(ctypes.Structure):
    _fields_ = [
        ("struct_size", _U32), ("reserved", _U32),
        ("plan", ctypes.CFUNCTYPE(_VP, _VP, ctypes.POINTER(MoePlanArgs))),
        ("forward", ctypes.CFUNCTYPE(_VP, _VP, ctypes.POINTER(MoeForwardArgs))),
        ("backward", ctypes.CFUNCTYPE(_VP, _VP, ctypes.POINTER(MoeBackwardArgs))),
        ("dispatch", ctypes.CFUNCTYPE(_VP, _VP, ctypes.POINTER(MoeDispatchArgs))),
        ("combine", ctypes.CFUNCTYPE(_VP, _VP, ctypes.POINTER(MoeDispatchArgs))),
        ("reduce_gradients", ctypes.CFUNCTYPE(_VP, _VP, ctypes.POINTER(MoeReduceArgs))),
    ]


MOE_V1_SIZE = _size(MoeV1, "reduce_gradients")


# ---- packed quantized data (abi/include/loom/quant_format.h)
QUANT_INT = 1
QUANT_BINARY = 2
QUANT_TERNARY = 3
QUANT_SCHEMES = {1: "int", 2: "binary", 3: "ternary"}
QUANT_PACK_LSB_FIRST = 1
QUANT_PACK_MSB_FIRST = 2
QUANT_PACKINGS = {1: "lsb_first", 2: "msb_first"}
QUANT_SYMMETRIC = 1 << 0


class QuantFormat(ctypes.Structure):
    _fields_ = [
        ("struct_size", _U32), ("scheme", _I32), ("bits", _U32), ("flags", _U32),
        ("packing", _I32), ("axis", _I32), ("group_size", _I64), ("ndim", _I32),
        ("reserved", _U32), ("shape", ctypes.POINTER(_I64)),
        ("scale_dtype", DLDataType), ("zero_point_dtype", DLDataType),
    ]


QUANT_FORMAT_SIZE = _size(QuantFormat, "zero_point_dtype")

# ---- loom.quantizer/1 (abi/include/loom/kinds/quantizer.h)
QUANTIZER_WEIGHT = 1
QUANTIZER_ACTIVATION = 2
QUANTIZER_HAS_MATMUL = 1 << 0
QUANTIZER_INT8_ACTIVATIONS = 1 << 1


class QuantizerLayoutArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", _U32), ("reserved", _U32),
        ("role", _I32), ("ndim", _I32), ("shape", ctypes.POINTER(_I64)),
        ("dtype", DLDataType), ("reserved2", _U32), ("matmul_rows", _I64),
        ("format", ctypes.POINTER(QuantFormat)),
        ("flags", _U32), ("reserved3", _U32), ("packed_bytes", _U64), ("scale_count", _I64),
        ("zero_point_count", _I64), ("workspace_bytes", _U64),
        ("matmul_workspace_bytes", _U64),
    ]


QUANTIZER_LAYOUT_ARGS_SIZE = _size(QuantizerLayoutArgs, "matmul_workspace_bytes")


class QuantizerQuantizeArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", _U32), ("reserved", _U32), ("role", _I32), ("reserved2", _U32),
        ("format", ctypes.POINTER(QuantFormat)),
        ("x", _VP), ("packed", _VP), ("scales", _VP), ("zero_points", _VP),
        ("workspace", _VP), ("workspace_bytes", _U64), ("stream", _VP),
    ]


QUANTIZER_QUANTIZE_ARGS_SIZE = _size(QuantizerQuantizeArgs, "stream")


class QuantizerMatmulArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", _U32), ("reserved", _U32),
        ("format", ctypes.POINTER(QuantFormat)),
        ("x", _VP), ("packed", _VP), ("scales", _VP), ("zero_points", _VP), ("bias", _VP),
        ("y", _VP), ("workspace", _VP), ("workspace_bytes", _U64), ("stream", _VP),
    ]


QUANTIZER_MATMUL_ARGS_SIZE = _size(QuantizerMatmulArgs, "stream")


class QuantizerV1(ctypes.Structure):
    _fields_ = [
        ("struct_size", _U32), ("reserved", _U32),
        ("layout", ctypes.CFUNCTYPE(_VP, _VP, ctypes.POINTER(QuantizerLayoutArgs))),
        ("quantize", ctypes.CFUNCTYPE(_VP, _VP, ctypes.POINTER(QuantizerQuantizeArgs))),
        ("dequantize", ctypes.CFUNCTYPE(_VP, _VP, ctypes.POINTER(QuantizerQuantizeArgs))),
        ("matmul", ctypes.CFUNCTYPE(_VP, _VP, ctypes.POINTER(QuantizerMatmulArgs))),
    ]


QUANTIZER_V1_SIZE = _size(QuantizerV1, "matmul")


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
