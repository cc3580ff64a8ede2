"""DeepSpeed's ``optimizer`` section: Adam, AdamW, Lamb and the 1-bit family."""
from __future__ import annotations

import json
from typing import Any, Dict, Optional

from ._common import (LR, Conversion, Removed, Unmapped, as_int, check_value, is_int_param,
                      kind)

_COMMON = ("betas", "eps", "weight_decay", "bias_correction")
_PLUGINS = {
    # DeepSpeed's type, lowercased -> (plugin, the DeepSpeed params it carries as is)
    "adam": ("adam", _COMMON + ("adam_w_mode",)),
    "adamw": ("adam", _COMMON),
    "lamb": ("lamb", _COMMON + ("max_coeff", "min_coeff")),
    "onebitadam": ("onebit_adam", _COMMON + ("freeze_step",)),
    "zerooneadam": ("zero_one_adam", _COMMON + ("var_freeze_step", "var_update_scaler",
                                                "local_step_scaler", "local_step_clipper")),
    "onebitlamb": ("onebit_lamb", _COMMON + ("freeze_step", "max_coeff", "min_coeff",
                                             "coeff_beta", "factor_max", "factor_min",
                                             "factor_threshold")),
}
_ONEBIT = ("onebitadam", "zerooneadam", "onebitlamb")
_ONEBIT_NAMES = {"onebitadam": "1-bit Adam", "zerooneadam": "0/1 Adam",
                 "onebitlamb": "1-bit LAMB"}


def comm_plugin_installed(name: str) -> bool:
    """Whether a ``loom.comm/1`` plugin ``name`` is on the plugin search path (False also
    when libloom itself cannot be loaded: the conversion does not need it)."""
    try:
        from ..session import describe_plugins

        info = describe_plugins(name)
    except Exception:  # NotFoundError, LibraryNotFoundError: not usable here either way
        return False
    return any(k.get("kind") == "loom.comm/1"
               for p in info.get("plugins", []) for k in p.get("kinds", []))


def _backend(name: Any, key: str, out: Conversion) -> Optional[str]:
    """The [comm.world] plugin for DeepSpeed's comm_backend_name ``name`` (None: ucx, with
    the reason listed), recording the removed feature."""
    feature = f"the 1-bit compressed allreduce over DeepSpeed's '{name}' backend"
    if name == "nccl":
        out.notes.append("comm_backend_name 'nccl': [comm.world] uses the nccl plugin (device "
                         "memory); ucx is the host-memory transport")
        plugin = "nccl"
    elif name == "mpi":
        if comm_plugin_installed("mpi"):
            out.notes.append("comm_backend_name 'mpi': [comm.world] uses Loom's mpi transport")
            plugin = "mpi"
        else:
            out.notes.append("comm_backend_name 'mpi': Loom's mpi transport is not installed "
                             "here, so [comm.world] uses the ucx plugin (host memory, any "
                             "launcher, mpirun included); with the mpi plugin installed, set "
                             "plugin = \"mpi\" or convert again")
            plugin = "ucx"
    elif name == "compressed":
        out.notes.append("comm_backend_name 'compressed' (DeepSpeed's backend-agnostic one): "
                         "[comm.world] uses the ucx plugin (host memory); use nccl for CUDA "
                         "tensors")
        plugin = "ucx"
    elif name == "hccl":
        out.unmapped.append(Unmapped(key, "'hccl' is DeepSpeed's backend for Ascend NPUs; Loom "
                                     "has no transport for NPU memory (ucx: host memory, "
                                     "nccl: CUDA); [comm.world] uses ucx"))
        out.removed.append(Removed(key, feature))
        return None
    else:
        out.unmapped.append(Unmapped(key, f"{json.dumps(name)} is not one of DeepSpeed's "
                                     "backends (nccl, mpi, hccl, compressed); [comm.world] uses "
                                     "ucx"))
        return None
    missing = " (Loom's mpi plugin is not installed here)" if name == "mpi" and \
        plugin != "mpi" else ""
    out.removed.append(Removed(key, feature, f'[comm.world] plugin "{plugin}"{missing} with '
                               '[codec.onebit] plugin "onebit"'))
    return plugin

_OPT_PARAM_REASONS = {
    "lr": LR,
    "torch_adam": "Loom's adam already follows torch.optim's arithmetic; there is no second "
                  "implementation to choose",
    "max_grad_norm": "gradient clipping is the trainer's (DeepSpeed's own is the top-level "
                     "gradient_clipping)",
    "eps_inside_sqrt": "Loom adds eps outside the square root only (torch.optim's placement)",
    "cuda_aware": "the transport is a [comm] plugin: ucx works on host memory, nccl on device "
                  "memory; there is no MPI staging switch",
    "fused": "Loom's kernels are always fused",
    "foreach": "Loom's kernels are always multi-tensor",
    "capturable": "not a Loom setting",
    "maximize": "Loom's optimizers minimise; negate the loss instead",
}


def map_optimizer(cfg: Any, out: Conversion) -> None:
    if not isinstance(cfg, dict):
        out.unmapped.append(Unmapped("optimizer", f"must be an object, not {kind(cfg)}"))
        return
    typ = cfg.get("type")
    if not isinstance(typ, str):
        out.unmapped.append(Unmapped("optimizer.type", "missing or not a string; Loom maps "
                                     "Adam, AdamW, Lamb, OneBitAdam, ZeroOneAdam, OneBitLamb"))
        return
    low = typ.lower().replace("_", "")
    if low not in _PLUGINS:
        out.unmapped.append(Unmapped(
            "optimizer", f"type '{typ}' has no Loom plugin; Loom maps Adam, AdamW, Lamb, "
            "OneBitAdam, ZeroOneAdam, OneBitLamb"))
        return
    plugin, carried = _PLUGINS[low]
    params = cfg.get("params", {})
    for k in cfg:
        if k not in ("type", "params"):
            out.unmapped.append(Unmapped(f"optimizer.{k}", "not a key of DeepSpeed's optimizer "
                                         "section (it takes type and params)"))
    if not isinstance(params, dict):
        out.unmapped.append(Unmapped("optimizer.params", f"must be an object, not "
                                     f"{kind(params)}"))
        params = {}
    table: Dict[str, Any] = {"plugin": plugin}
    comm_plugin = "ucx"
    removed_at = len(out.removed)  # the type's line goes before its backend's
    for k, v in params.items():
        key = f"optimizer.params.{k}"
        if k in carried:
            ok = check_value(k, v)
            if ok is not None:
                out.unmapped.append(Unmapped(key, ok))
                continue
            if k == "betas":
                v = [float(x) for x in v]
            elif is_int_param(k):
                v = as_int(v)
            table[k] = v
        elif k == "amsgrad":
            if v:
                out.unmapped.append(Unmapped(key, "Loom's optimizers have no AMSGrad variant"))
            else:
                out.unmapped.append(Unmapped(key, "false is what Loom's optimizers do; nothing "
                                             "is lost"))
        elif k == "adam_w_mode" and low == "adamw":
            if v is False:
                out.notes.append("optimizer.params.adam_w_mode = false is ignored by DeepSpeed "
                                 "for type AdamW; the manifest keeps AdamW (adam_w_mode = true)")
            else:
                out.unmapped.append(Unmapped(key, "type AdamW is adam with adam_w_mode = true "
                                             "already"))
        elif k == "comm_backend_name" and low in _ONEBIT:
            comm_plugin = _backend(v, key, out) or "ucx"
        elif k in _OPT_PARAM_REASONS:
            out.unmapped.append(Unmapped(key, _OPT_PARAM_REASONS[k]))
        else:
            out.unmapped.append(Unmapped(key, f"not a parameter of Loom's '{plugin}' (it takes "
                                         f"{', '.join(carried)})"))
    if low == "adam" and "adam_w_mode" not in table:
        # DeepSpeed's Adam is AdamW unless adam_w_mode says otherwise; so is Loom's adam,
        # said explicitly for the reader.
        table["adam_w_mode"] = True
        out.notes.append("type Adam without adam_w_mode is AdamW in DeepSpeed (adam_w_mode "
                         "defaults to true); the manifest says so")
    if low == "adamw":
        table["adam_w_mode"] = True
    if low in _ONEBIT:
        # DeepSpeed's 1-bit optimizers accept bias_correction and ignore it.
        if table.get("bias_correction", True) is not False:
            out.notes.append("DeepSpeed's 1-bit optimizers accept bias_correction and ignore it "
                             "(no correction); the manifest sets bias_correction = false to keep "
                             "DeepSpeed's arithmetic (true applies Loom's correction)")
        table["bias_correction"] = False
        out.removed.insert(removed_at, Removed(
            "optimizer.type", f"{_ONEBIT_NAMES[low]} (type \"{typ}\")",
            f'[optimizer.main] plugin "{plugin}" over [comm.world] plugin "{comm_plugin}"'))
        out.tables.append(("comm.world", {"plugin": comm_plugin}))
        out.tables.append(("codec.onebit", {"plugin": "onebit"}))
        table = {"plugin": plugin, "comm": "world", "codec": "onebit",
                 **{k: v for k, v in table.items() if k != "plugin"}}
    out.tables.append(("optimizer.main", table))
