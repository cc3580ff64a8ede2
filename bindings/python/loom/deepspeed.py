"""The Loom manifest for a DeepSpeed config.

``convert(ds_config)`` (also ``loom.from_deepspeed``) maps the config's ``optimizer``
(Adam, AdamW, Lamb, OneBitAdam, ZeroOneAdam, OneBitLamb), its legacy
``curriculum_learning`` (sequence-length warmup), ``data_efficiency.data_sampling``'s
curriculum metrics and ``data_routing.random_ltd``, a ``moe`` object holding the arguments
of DeepSpeed's MoE layer (``deepspeed.moe.layer.MoE``: num_experts, k, capacity_factor, ...)
and ``compression_training``'s weight and activation quantization onto Loom's plugins, and
lists every key it cannot map with the reason. From the shell::

    python -m loom.deepspeed ds_config.json [-o run.toml] [--check]

writes the manifest (to stdout or ``-o``) and one ``FILE: KEY: not mapped: REASON`` line per
key it could not map (to stderr).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

from . import _toml

__all__ = ["convert", "Conversion", "Unmapped", "main"]


@dataclass
class Unmapped:
    """A DeepSpeed key the manifest does not carry, and why."""
    key: str  # dotted path in the config, e.g. "optimizer.params.lr"
    reason: str

    def __str__(self) -> str:
        return f"{self.key}: not mapped: {self.reason}"


@dataclass
class Conversion:
    """What :func:`convert` made of a DeepSpeed config.

    Attributes:
        tables (list[tuple[str, dict]]): the manifest's instances, ("optimizer.main",
            {"plugin": "adam", ...}), in order.
        unmapped (list[Unmapped]): every key not carried, with the reason.
        notes (list[str]): keys that were mapped with a caveat worth reading.
    """
    tables: List[Tuple[str, Dict[str, Any]]] = field(default_factory=list)
    unmapped: List[Unmapped] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    source: str = "<dict>"

    @property
    def manifest(self) -> str:
        """The manifest as TOML text, headed by comments naming the source, the notes
        and the keys left out."""
        head = [f"Loom manifest converted from the DeepSpeed config {self.source}."]
        if self.notes:
            head.append("")
            head += [f"note: {n}" for n in self.notes]
        if self.unmapped:
            head.append("")
            head.append("DeepSpeed keys not mapped:")
            head += [f"  {u}" for u in self.unmapped]
        body = [("loom", {"abi": 1})] + self.tables
        return _toml.manifest(body, "\n".join(head))

    def report(self) -> str:
        """One line per note and per unmapped key, prefixed with the source."""
        lines = [f"{self.source}: note: {n}" for n in self.notes]
        lines += [f"{self.source}: {u}" for u in self.unmapped]
        return "\n".join(lines)

    def instance(self, header: str) -> Optional[Dict[str, Any]]:
        """The parameters of the table ``header`` ("optimizer.main"), or None."""
        for h, t in self.tables:
            if h == header:
                return t
        return None


# ---------------------------------------------------------------- reasons

LR = ("Loom takes the learning rate per step from the trainer or its scheduler "
      "(loom.torch.Optimizer reads each param group's lr at every step), not from the manifest")

TOP_LEVEL = {
    "train_batch_size": "batch sizes are the trainer's (the loom train config, or your loop)",
    "train_micro_batch_size_per_gpu": "batch sizes are the trainer's (the loom train config, "
                                      "or your loop)",
    "gradient_accumulation_steps": "gradient accumulation is the trainer's",
    "scheduler": "learning-rate schedules are the trainer's: use a torch.optim.lr_scheduler "
                 "with loom.torch.Optimizer, which passes each group's lr at every step",
    "fp16": "mixed precision and loss scaling are the trainer's: pass bf16/fp16 params with "
            "fp32 masters, and the loss scale as the step's grad_scale",
    "bf16": "mixed precision is the trainer's: pass bf16 params with fp32 masters",
    "amp": "mixed precision is the trainer's",
    "gradient_clipping": "gradient clipping is the trainer's (clip before the step)",
    "zero_optimization": "ZeRO partitioning is not part of Loom",
    "zero_allow_untested_optimizer": "ZeRO partitioning is not part of Loom",
    "zero_force_ds_cpu_optimizer": "ZeRO partitioning is not part of Loom",
    "activation_checkpointing": "activation checkpointing is the model's",
    "steps_per_print": "logging is the trainer's ([loom] log_level sets Loom's own)",
    "wall_clock_breakdown": "profiling is the trainer's",
    "flops_profiler": "profiling is the trainer's",
    "tensorboard": "monitoring is the trainer's",
    "wandb": "monitoring is the trainer's",
    "csv_monitor": "monitoring is the trainer's",
    "comms_logger": "Loom's optimizers count their own traffic (comm_info)",
    "dump_state": "not a Loom setting",
    "prescale_gradients": "gradient averaging is the trainer's (or the 1-bit optimizer's own)",
    "gradient_predivide_factor": "gradient averaging is the trainer's (or the 1-bit "
                                 "optimizer's own)",
    "sparse_gradients": "Loom optimizers take dense gradients",
    "communication_data_type": "the 1-bit optimizers compress with their codec; other "
                               "allreduces are the trainer's",
    "pipeline": "pipeline parallelism is the trainer's",
    "elasticity": "elastic training is the launcher's",
    "checkpoint": "checkpoints are the trainer's (Loom instances export and import state)",
    "data_types": "dtypes are the trainer's",
}

# ---------------------------------------------------------------- optimizers

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


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _optimizer(cfg: Any, out: Conversion) -> None:
    if not isinstance(cfg, dict):
        out.unmapped.append(Unmapped("optimizer", f"must be an object, not {_kind(cfg)}"))
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
                                     f"{_kind(params)}"))
        params = {}
    table: Dict[str, Any] = {"plugin": plugin}
    comm_plugin = "ucx"
    for k, v in params.items():
        key = f"optimizer.params.{k}"
        if k in carried:
            ok = _check_value(k, v)
            if ok is not None:
                out.unmapped.append(Unmapped(key, ok))
                continue
            if k == "betas":
                v = [float(x) for x in v]
            elif k in _INTS:
                v = _as_int(v)
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
            if v == "nccl":
                comm_plugin = "nccl"
                out.notes.append("comm_backend_name 'nccl': [comm.world] uses the nccl plugin "
                                 "(device memory); ucx is the host-memory transport")
            elif v in ("mpi", "compressed"):
                out.notes.append(f"comm_backend_name '{v}': [comm.world] uses the ucx plugin "
                                 "(host memory, any launcher)")
            else:
                out.unmapped.append(Unmapped(key, f"no Loom transport for '{v}'; [comm.world] "
                                             "uses ucx"))
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
        out.tables.append(("comm.world", {"plugin": comm_plugin}))
        out.tables.append(("codec.onebit", {"plugin": "onebit"}))
        table = {"plugin": plugin, "comm": "world", "codec": "onebit",
                 **{k: v for k, v in table.items() if k != "plugin"}}
    out.tables.append(("optimizer.main", table))


_INTS = {"freeze_step", "var_freeze_step", "var_update_scaler", "local_step_scaler",
         "local_step_clipper", "total_curriculum_step", "difficulty_step"}
_BOOLS = {"bias_correction", "adam_w_mode"}


def _check_value(k: str, v: Any) -> Optional[str]:
    """None when ``v`` has the type the Loom parameter takes, else the reason."""
    if k == "betas":
        if not (isinstance(v, (list, tuple)) and len(v) == 2 and all(_is_number(x) for x in v)):
            return f"must be a list of two numbers, not {json.dumps(v)}"
        return None
    if k in _BOOLS:
        return None if isinstance(v, bool) else f"must be true or false, not {json.dumps(v)}"
    if k in _INTS:
        return None if _as_int(v) is not None else f"must be an integer, not {json.dumps(v)}"
    return None if _is_number(v) else f"must be a finite number, not {json.dumps(v)}"


def _kind(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(v), "a number")


# ---------------------------------------------------------------- curriculum

def _as_int(v: Any) -> Optional[int]:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return None


def _schedule(prefix: str, cfg: Dict[str, Any], out: Conversion, *,
              seqlen: bool) -> Optional[Dict[str, Any]]:
    """The parameters of a Loom schedule for a DeepSpeed difficulty schedule (the keys
    min_difficulty, max_difficulty, schedule_type, schedule_config)."""
    typ = cfg.get("schedule_type")
    allowed = ("fixed_linear", "fixed_root") if seqlen else ("fixed_linear", "fixed_root",
                                                              "fixed_discrete")
    if typ == "custom":
        out.unmapped.append(Unmapped(f"{prefix}.schedule_type", "a custom schedule is a Loom "
                                     "plugin of kind loom.curriculum/1 that implements 'at'; "
                                     "name it in the manifest yourself"))
        return None
    if typ not in allowed:
        why = ("sequence-length warmup (seqlen_warmup) takes fixed_linear or fixed_root"
               if seqlen else "Loom's schedules are fixed_linear, fixed_root and fixed_discrete")
        out.unmapped.append(Unmapped(f"{prefix}.schedule_type", f"'{typ}': {why}"))
        return None
    t: Dict[str, Any] = {}
    if seqlen:
        t["plugin"] = "seqlen_warmup"
        t["schedule_type"] = typ
    else:
        t["plugin"] = typ
    sc = cfg.get("schedule_config", {})
    if not isinstance(sc, dict):
        out.unmapped.append(Unmapped(f"{prefix}.schedule_config", "must be an object"))
        sc = {}
    for k in ("min_difficulty", "max_difficulty"):
        if k not in cfg:
            continue
        v = cfg[k]
        if typ == "fixed_discrete":
            out.unmapped.append(Unmapped(f"{prefix}.{k}", "fixed_discrete's range is its "
                                         "difficulty list; it takes no bounds"))
        elif seqlen:
            iv = _as_int(v)
            if iv is None:
                out.unmapped.append(Unmapped(f"{prefix}.{k}", f"a sequence length must be an "
                                             f"integer, not {json.dumps(v)}"))
            else:
                t[k] = iv
        elif _is_number(v):
            t[k] = float(v)
        else:
            out.unmapped.append(Unmapped(f"{prefix}.{k}", f"must be a number, not "
                                         f"{json.dumps(v)}"))
    wanted = {"fixed_linear": ("total_curriculum_step", "difficulty_step"),
              "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
              "fixed_discrete": ("difficulty", "max_step")}[typ]
    for k, v in sc.items():
        key = f"{prefix}.schedule_config.{k}"
        if k not in wanted:
            out.unmapped.append(Unmapped(key, f"not used by {typ} (it takes "
                                         f"{', '.join(wanted)})"))
        elif k in ("total_curriculum_step", "difficulty_step"):
            iv = _as_int(v)
            if iv is None:
                out.unmapped.append(Unmapped(key, f"must be an integer, not {json.dumps(v)}"))
            else:
                t[k] = iv
        elif k == "root_degree":
            if _is_number(v):
                t[k] = float(v)
            else:
                out.unmapped.append(Unmapped(key, f"must be a number, not {json.dumps(v)}"))
        elif k == "difficulty":
            if isinstance(v, list) and all(_is_number(x) for x in v):
                t[k] = [float(x) for x in v]
            else:
                out.unmapped.append(Unmapped(key, "must be a list of numbers"))
        elif k == "max_step":
            if isinstance(v, list) and all(_as_int(x) is not None for x in v):
                t[k] = [_as_int(x) for x in v]
            else:
                out.unmapped.append(Unmapped(key, "must be a list of integers"))
    return t


def _legacy_curriculum(cfg: Any, out: Conversion) -> None:
    if not isinstance(cfg, dict):
        out.unmapped.append(Unmapped("curriculum_learning", "must be an object"))
        return
    if not cfg.get("enabled", False):
        out.unmapped.append(Unmapped("curriculum_learning", "enabled is false (or missing): "
                                     "nothing to map"))
        return
    ctype = cfg.get("curriculum_type")
    if ctype != "seqlen":
        out.unmapped.append(Unmapped("curriculum_learning.curriculum_type",
                                     f"'{ctype}': the legacy curriculum is sequence-length "
                                     "warmup only ('seqlen')"))
        return
    for k in cfg:
        if k not in ("enabled", "curriculum_type", "min_difficulty", "max_difficulty",
                     "schedule_type", "schedule_config"):
            out.unmapped.append(Unmapped(f"curriculum_learning.{k}", "not a key of DeepSpeed's "
                                         "legacy curriculum"))
    t = _schedule("curriculum_learning", cfg, out, seqlen=True)
    if t is not None:
        t = {"plugin": t.pop("plugin"), "mode": "truncate", **t}
        out.tables.append(("curriculum.seqlen", t))
        out.notes.append("curriculum_learning (seqlen) is [curriculum.seqlen], a seqlen_warmup "
                         "schedule: the trainer cuts each batch to its seq_len (mode "
                         "truncate), as DeepSpeed's curriculum_seqlen asks the model to")


_METRIC_PLUGINS = {"vocabularyrarity": "vocabulary_rarity", "vocabulary_rarity": "vocabulary_rarity",
                   "voc": "vocabulary_rarity", "seqlen": "seqlen"}


def _data_efficiency(cfg: Any, out: Conversion) -> None:
    if not isinstance(cfg, dict):
        out.unmapped.append(Unmapped("data_efficiency", "must be an object"))
        return
    if not cfg.get("enabled", False):
        out.unmapped.append(Unmapped("data_efficiency", "enabled is false (or missing): "
                                     "nothing to map"))
        return
    for k, v in cfg.items():
        if k == "enabled":
            continue
        if k == "seed":
            out.unmapped.append(Unmapped("data_efficiency.seed", "the sampler's seed is passed "
                                         "by the trainer with every call (loom train's seed)"))
        elif k == "data_sampling":
            _data_sampling(v, out)
        elif k == "data_routing":
            _data_routing(v, out)
        else:
            out.unmapped.append(Unmapped(f"data_efficiency.{k}", "not a key of DeepSpeed's "
                                         "data_efficiency"))


def _data_sampling(cfg: Any, out: Conversion) -> None:
    p = "data_efficiency.data_sampling"
    if not isinstance(cfg, dict) or not cfg.get("enabled", False):
        out.unmapped.append(Unmapped(p, "enabled is false (or missing): nothing to map"))
        return
    sampler_done = False
    for k, v in cfg.items():
        if k == "enabled":
            continue
        if k == "num_epochs":
            out.unmapped.append(Unmapped(f"{p}.num_epochs", "the run's length is the "
                                         "trainer's; the sampler starts a new pass whenever "
                                         "one is spent"))
        elif k == "num_workers":
            out.unmapped.append(Unmapped(f"{p}.num_workers", "data loader workers are the "
                                         "trainer's"))
        elif k == "curriculum_learning":
            sampler_done = _metrics(f"{p}.curriculum_learning", v, out)
        else:
            out.unmapped.append(Unmapped(f"{p}.{k}", "not a key of DeepSpeed's data_sampling"))
    if not sampler_done:
        out.tables.append(("sampler.data", {"plugin": "curriculum_sampler",
                                            "clustering_type": "single_cluster"}))
        out.notes.append("data_sampling without a curriculum metric is [sampler.data], an "
                         "epoch-shuffled curriculum_sampler (single_cluster)")


def _data_routing(cfg: Any, out: Conversion) -> None:
    p = "data_efficiency.data_routing"
    if not isinstance(cfg, dict) or not cfg.get("enabled", False):
        out.unmapped.append(Unmapped(p, "enabled is false (or missing): nothing to map"))
        return
    for k, v in cfg.items():
        if k == "enabled":
            continue
        if k == "random_ltd":
            _random_ltd(f"{p}.random_ltd", v, out)
        else:
            out.unmapped.append(Unmapped(f"{p}.{k}", "not a key of DeepSpeed's data_routing"))


_LTD_REASONS = {
    "total_layer_num": "the router learns the model's layer count at its first plan",
    "random_ltd_layer_num": "implied by layers (the list of routed layers)",
    "model_mask_name": "the trainer applies the attention mask among the kept positions",
    "model_type": "the trainer's model decides how routed layers attend",
    "hidden_state_order": "the router takes [batch, seq, channels] and [seq, batch, "
                          "channels] storage alike (free batch and position strides)",
    "global_batch_size": "the trainer passes the batch to the router's advance",
    "micro_batch_size": "the trainer passes the batch to the router's advance",
    "layer_token_lr_schedule": "the learning rate by layer tokens is the trainer's "
                               "(loom train: [train] lr_unit = \"layer_tokens\")",
}


def _random_ltd(p: str, cfg: Any, out: Conversion) -> None:
    if not isinstance(cfg, dict) or not cfg.get("enabled", False):
        out.unmapped.append(Unmapped(p, "enabled is false (or missing): nothing to map"))
        return
    t: Dict[str, Any] = {"plugin": "random_ltd"}
    for k, v in cfg.items():
        key = f"{p}.{k}"
        if k == "enabled":
            continue
        if k == "random_ltd_layer_id":
            ids = [_as_int(x) for x in v] if isinstance(v, list) else None
            if ids is None or any(i is None or i < 0 for i in ids):
                out.unmapped.append(Unmapped(key, "must be a list of layer indices >= 0"))
            else:
                t["layers"] = sorted(set(ids))
                if len(t["layers"]) != len(ids) or t["layers"] != ids:
                    out.notes.append(f"{key}: layers are listed sorted and once each")
        elif k == "random_ltd_schedule":
            if not isinstance(v, dict):
                out.unmapped.append(Unmapped(key, "must be an object"))
                continue
            for sk, sv in v.items():
                skey = f"{key}.{sk}"
                if sk in ("min_value", "max_value"):
                    iv = _as_int(sv)
                    if iv is None:
                        out.unmapped.append(Unmapped(skey, f"must be an integer, not "
                                                     f"{json.dumps(sv)}"))
                    else:
                        t[sk] = iv
                elif sk == "schedule_type":
                    if sv == "fixed_linear":
                        t[sk] = sv
                    else:
                        out.unmapped.append(Unmapped(skey, f"'{sv}': random_ltd's schedule is "
                                                     "fixed_linear"))
                elif sk == "schedule_config" and isinstance(sv, dict):
                    for ck, cv in sv.items():
                        iv = _as_int(cv)
                        if ck in ("require_steps", "seq_per_step") and iv is not None:
                            t[ck] = iv
                        else:
                            out.unmapped.append(Unmapped(
                                f"{skey}.{ck}", "random_ltd takes require_steps and "
                                "seq_per_step (integers)"))
                else:
                    out.unmapped.append(Unmapped(skey, "not a key of DeepSpeed's "
                                                 "random_ltd_schedule"))
        elif k in _LTD_REASONS:
            out.unmapped.append(Unmapped(key, _LTD_REASONS[k]))
        else:
            out.unmapped.append(Unmapped(key, "not a key of DeepSpeed's random_ltd"))
    out.tables.append(("router.ltd", t))
    out.notes.append("random_ltd is [router.ltd]: the trainer routes with it ([routing] router "
                     "= \"ltd\" in a loom train config)")


def _metrics(p: str, cfg: Any, out: Conversion) -> bool:
    """Maps curriculum_metrics; True when it declared the sampler."""
    if not isinstance(cfg, dict) or not cfg.get("enabled", False):
        out.unmapped.append(Unmapped(p, "enabled is false (or missing): nothing to map"))
        return False
    sampler = False
    for k, v in cfg.items():
        if k == "enabled":
            continue
        if k == "data_cluster_path":
            out.unmapped.append(Unmapped(f"{p}.data_cluster_path", "Loom's sampler writes no "
                                         "cluster files: clusters follow from the schedule and "
                                         "resume from the exported state"))
        elif k == "curriculum_metrics":
            if not isinstance(v, dict):
                out.unmapped.append(Unmapped(f"{p}.curriculum_metrics", "must be an object"))
                continue
            for name, m in v.items():
                sampler = _metric(f"{p}.curriculum_metrics.{name}", name, m, out,
                                  sampler) or sampler
        else:
            out.unmapped.append(Unmapped(f"{p}.{k}", "not a key of DeepSpeed's "
                                         "curriculum_learning"))
    return sampler


def _metric(p: str, name: str, m: Any, out: Conversion, have_sampler: bool) -> bool:
    if not isinstance(m, dict):
        out.unmapped.append(Unmapped(p, "must be an object"))
        return False
    safe = "".join(c if c.isalnum() or c in "_-" else "_" for c in name)
    sched_keys = ("min_difficulty", "max_difficulty", "schedule_type", "schedule_config")
    if name in ("seqlen_truncate", "seqlen_reshape"):
        t = _schedule(p, m, out, seqlen=True)
        for k in m:
            if k not in sched_keys:
                out.unmapped.append(Unmapped(f"{p}.{k}", f"{name} is sequence-length warmup "
                                             "(seqlen_warmup); it reads no index"))
        if t is not None:
            mode = "truncate" if name == "seqlen_truncate" else "reshape"
            out.tables.append((f"curriculum.{safe}",
                               {"plugin": t.pop("plugin"), "mode": mode, **t}))
        return False
    if have_sampler:
        out.unmapped.append(Unmapped(p, "Loom's curriculum_sampler follows one metric; "
                                     "DeepSpeed's intersection of several is not mapped (this "
                                     "manifest follows the first)"))
        return False
    t = _schedule(p, m, out, seqlen=False)
    if t is None:
        return False
    metric_plugin = _METRIC_PLUGINS.get(name.lower().replace("-", "_"))
    if metric_plugin is not None:
        out.tables.append((f"curriculum.{safe}", {"plugin": metric_plugin}))
    else:
        out.notes.append(f"metric '{name}' has no bundled Loom metric (seqlen, "
                         "vocabulary_rarity); [sampler.data] reads an index written for a "
                         f"[curriculum.{safe}] metric plugin of your own")
    out.tables.append((f"curriculum.{safe}_schedule", t))
    s: Dict[str, Any] = {"plugin": "curriculum_sampler", "schedule": f"{safe}_schedule",
                         "index": f"{safe}-index", "metric": safe}
    for k, v in m.items():
        if k in sched_keys:
            continue
        key = f"{p}.{k}"
        if k in ("difficulty_type", "clustering_type"):
            allowed = (("value", "percentile") if k == "difficulty_type"
                       else ("schedule_based", "single_cluster"))
            if v in allowed:
                s[k] = v
            else:
                out.unmapped.append(Unmapped(key, f"'{v}' is not one of {', '.join(allowed)}"))
        elif k in ("index_to_sample_path", "index_to_metric_path"):
            out.unmapped.append(Unmapped(key, "DeepSpeed's index files are not Loom's: run "
                                         f"`loom data analyze` with [curriculum.{safe}] and set "
                                         f"[sampler.data] index to its output folder (now "
                                         f"'{safe}-index')"))
        else:
            out.unmapped.append(Unmapped(key, "not a key of a DeepSpeed curriculum metric"))
    out.tables.append(("sampler.data", s))
    return True


# ---------------------------------------------------------------- mixture of experts

_MOE_REASONS = {
    "hidden_size": "the model width is the trainer's (the layer's model_dim); the experts' "
                   "hidden width is the trainer's [moe] hidden",
    "expert": "the experts are the moe plugin's two-layer MLPs (activation = gelu, relu or "
              "silu); their weights are the trainer's parameters",
    "use_tutel": "Loom's dispatch is its own (a stable counting sort by expert, gathered rows, "
                 "grouped GEMMs); there is no Tutel path to choose",
    "enable_expert_tensor_parallelism": "experts are not split by tensor parallelism in Loom "
                                        "(expert parallelism is ep_size)",
    "top2_2nd_expert_sampling": "Loom's second choice is the second-highest probability "
                                "(deterministic, in evaluation too); noisy_gate_policy = "
                                "\"RSample\" adds Gumbel noise to every choice in training",
    "enabled": "the section's presence declares the layer",
    "layers": "which blocks are MoE is the trainer's ([moe] layers)",
    "num_layers": "which blocks are MoE is the trainer's ([moe] layers)",
    "aux_loss_coef": "the aux loss coefficient is the trainer's ([moe] aux_loss_coef, or "
                     "your loss = task + coef * aux with loom.torch.MoE)",
    "moe_loss_coeff": "the aux loss coefficient is the trainer's ([moe] aux_loss_coef, or "
                      "your loss = task + coef * aux with loom.torch.MoE)",
}
_MOE_INTS = ("num_experts", "k", "min_capacity", "ep_size")
_MOE_FLOATS = ("capacity_factor", "eval_capacity_factor")
_MOE_BOOLS = ("drop_tokens", "use_rts", "use_residual")


def _moe(cfg: Any, out: Conversion) -> None:
    if not isinstance(cfg, dict):
        out.unmapped.append(Unmapped("moe", f"must be an object holding DeepSpeed's MoE layer "
                                     f"arguments, not {_kind(cfg)}"))
        return
    if cfg.get("enabled", True) is False:
        out.unmapped.append(Unmapped("moe", "enabled is false: nothing to map"))
        return
    t: Dict[str, Any] = {"plugin": "moe"}
    for k, v in cfg.items():
        key = f"moe.{k}"
        if k in _MOE_INTS:
            iv = _as_int(v)
            if iv is None or iv < (0 if k == "min_capacity" else 1):
                out.unmapped.append(Unmapped(key, f"must be an integer >= "
                                             f"{0 if k == 'min_capacity' else 1}, not "
                                             f"{json.dumps(v)}"))
            else:
                t[k] = iv
        elif k in _MOE_FLOATS:
            if _is_number(v) and v > 0:
                t[k] = float(v)
            else:
                out.unmapped.append(Unmapped(key, f"must be a number > 0, not {json.dumps(v)}"))
        elif k in _MOE_BOOLS:
            if isinstance(v, bool):
                t[k] = v
            else:
                out.unmapped.append(Unmapped(key, f"must be true or false, not {json.dumps(v)}"))
        elif k == "noisy_gate_policy":
            if v is None or v in ("None", "none"):
                t[k] = "none"
            elif v in ("Jitter", "RSample"):
                t[k] = v
            else:
                out.unmapped.append(Unmapped(key, f"{json.dumps(v)} is not a policy; DeepSpeed "
                                             "and Loom take None, Jitter or RSample"))
        elif k == "enabled":
            continue
        elif k in _MOE_REASONS:
            out.unmapped.append(Unmapped(key, _MOE_REASONS[k]))
        else:
            out.unmapped.append(Unmapped(key, "not an argument of DeepSpeed's MoE layer"))
    if "num_experts" not in t:
        # DeepSpeed's MoE defaults to 1 expert; Loom's parameter to 8. Keep DeepSpeed's.
        t["num_experts"] = 1
        out.notes.append("moe without num_experts has one expert in DeepSpeed (its default); "
                         "the manifest says num_experts = 1 (Loom's own default is 8)")
    if "use_rts" not in t:
        t["use_rts"] = True
        out.notes.append("moe: DeepSpeed's use_rts defaults to true (random token selection "
                         "in training); Loom's defaults to false, so the manifest sets "
                         "use_rts = true")
    if int(t.get("k", 1)) == 2 and cfg.get("top2_2nd_expert_sampling", True) is not False:
        out.notes.append("moe: k = 2: DeepSpeed samples the second expert with Gumbel noise by "
                         "default (in evaluation too); Loom takes the second-highest "
                         "probability, deterministically")
    e, k_, ep = int(t["num_experts"]), int(t.get("k", 1)), int(t.get("ep_size", 1))
    if k_ > e:
        out.notes.append(f"moe: k = {k_} is more than num_experts = {e}: loom check refuses it")
    if ep > 1:
        if e % ep != 0:
            out.notes.append(f"moe: num_experts = {e} is not a multiple of ep_size = {ep}: loom "
                             "check refuses it")
        if not any(h == "comm.world" for h, _ in out.tables):
            out.tables.append(("comm.world", {"plugin": "ucx"}))
        t["comm"] = "world"
        out.notes.append(f"moe: ep_size = {ep} splits [comm.world] (ucx; nccl for device "
                         "memory) into expert-parallel groups of consecutive ranks")
    out.tables.append(("moe.experts", t))
    out.notes.append("moe is [moe.experts]: the trainer's [moe] instance = \"experts\" (or "
                     "loom.torch.MoE(session.instance(\"moe\", \"experts\"), ...)); DeepSpeed's "
                     "capacity C = max(ceil(k * capacity_factor * S / E), min_capacity) is the "
                     "plugin's")


# ---------------------------------------------------------------- compression (quantization)

_QUANT_SHARED_REASONS = {
    "schedule_offset": "when quantization starts is the trainer's (QAT from the step it "
                       "chooses; loom quantize for a trained checkpoint)",
    "quantizer_kernel": "Loom's quantizers always run their own kernels (the same arithmetic "
                        "on CPU and CUDA)",
    "quantize_verbose": "logging is the trainer's",
    "quantize_weight_in_forward": "Loom's QAT always quantizes in the forward pass (quantize "
                                  "then dequantize, straight-through gradient): that is true",
    "fp16_mixed_quantize": "Loom has no blend of float and quantized weights; QAT uses the "
                           "quantized weight from its first step",
}

_PRUNING = ("sparse_pruning", "row_pruning", "head_pruning", "channel_pruning",
            "layer_reduction")


def _safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "_-" else "_" for c in str(name)) or "group"


def _unique_name(name: str, out: Conversion) -> str:
    """``name``, or ``name_q``, ``name_q2``, ... when an instance of any kind has it (names
    are unique across kinds)."""
    taken = {h.split(".", 1)[1] for h, _ in out.tables}
    # the optimizer's table is written after compression_training when it comes later in
    # the config: keep its name free too
    taken |= {"main", "world", "onebit", "experts"}
    cand, i = name, 1
    while cand in taken:
        cand = f"{name}_q" if i == 1 else f"{name}_q{i}"
        i += 1
    return cand


def _groups_note(prefix: str, g: Any, out: Conversion) -> None:
    gi = _as_int(g)
    if gi is None or gi < 1:
        out.unmapped.append(Unmapped(prefix, f"must be an integer >= 1, not {json.dumps(g)}"))
        return
    out.unmapped.append(Unmapped(
        prefix, f"{gi}: DeepSpeed splits the flattened weight into {gi} equal contiguous "
        "chunks, i.e. blocks of whole output rows when the groups are at most the rows, and "
        "rows cut in equal pieces along the input when there are more; Loom's groups run "
        "along each row (group_size elements of the input features) and never span two rows. "
        "The manifest keeps group_size = 0 (one scale per output row: as fine as DeepSpeed's "
        "or finer); for DeepSpeed's rows * c groups set group_size = in_features / c "
        "yourself (it depends on each matrix's shape)"))


def _compression(cfg: Any, out: Conversion) -> None:
    if not isinstance(cfg, dict):
        out.unmapped.append(Unmapped("compression_training", f"must be an object, not "
                                     f"{_kind(cfg)}"))
        return
    act_bits: Optional[int] = None  # 8: activations quantized; None: not
    aq = cfg.get("activation_quantization")
    if aq is not None:
        act_bits = _activation_quantization(aq, out)
    for k, v in cfg.items():
        if k == "weight_quantization":
            _weight_quantization(v, out, act_bits)
        elif k == "activation_quantization":
            continue
        elif k in _PRUNING:
            enabled = isinstance(v, dict) and isinstance(v.get("shared_parameters"), dict) and \
                v["shared_parameters"].get("enabled", False)
            out.unmapped.append(Unmapped(f"compression_training.{k}",
                                         "pruning and layer reduction are not part of Loom"
                                         if enabled else "not enabled: nothing to map"))
        else:
            out.unmapped.append(Unmapped(f"compression_training.{k}", "not a key of DeepSpeed's "
                                         "compression_training"))


def _activation_quantization(cfg: Any, out: Conversion) -> Optional[int]:
    p = "compression_training.activation_quantization"
    if not isinstance(cfg, dict):
        out.unmapped.append(Unmapped(p, "must be an object"))
        return None
    shared = cfg.get("shared_parameters", {})
    if not isinstance(shared, dict) or not shared.get("enabled", False):
        out.unmapped.append(Unmapped(p, "enabled is false (or missing): nothing to map; the "
                                     "zeroquant instances multiply float activations "
                                     "(activation_bits = 0)"))
        return None
    ok = True
    for k, v in shared.items():
        key = f"{p}.shared_parameters.{k}"
        if k == "enabled":
            continue
        if k == "quantization_type":
            if v != "symmetric":
                out.unmapped.append(Unmapped(key, f"'{v}': Loom quantizes activations "
                                             "symmetrically only (one INT8 scale per token)"))
                ok = False
        elif k == "range_calibration":
            if v != "dynamic":
                out.unmapped.append(Unmapped(key, f"'{v}': Loom's activation scales are dynamic "
                                             "(max|x| of each token, computed in the matmul); "
                                             "static calibrated ranges are not kept"))
        elif k == "schedule_offset":
            out.unmapped.append(Unmapped(key, _QUANT_SHARED_REASONS["schedule_offset"]))
        else:
            out.unmapped.append(Unmapped(key, "not a key of DeepSpeed's activation "
                                         "quantization"))
    bits: Optional[int] = None
    groups = cfg.get("different_groups", {})
    if not isinstance(groups, dict):
        out.unmapped.append(Unmapped(f"{p}.different_groups", "must be an object"))
        groups = {}
    for name, g in groups.items():
        gp = f"{p}.different_groups.{name}"
        params = g.get("params", {}) if isinstance(g, dict) else None
        if not isinstance(params, dict):
            out.unmapped.append(Unmapped(gp, "must be an object with params.bits"))
            continue
        b = _as_int(params.get("bits"))
        if b == 8:
            bits = 8
        else:
            out.unmapped.append(Unmapped(f"{gp}.params.bits", f"{json.dumps(params.get('bits'))}:"
                                         " Loom's quantized matmul takes INT8 activations (8) "
                                         "or float ones"))
        for k in params:
            if k != "bits":
                out.unmapped.append(Unmapped(f"{gp}.params.{k}", "not a parameter of DeepSpeed's "
                                             "activation quantization"))
        if isinstance(g, dict) and "modules" in g:
            out.unmapped.append(Unmapped(
                f"{gp}.modules", f"{json.dumps(g['modules'])}: INT8 activations apply to every "
                "matmul of a zeroquant instance (activation_bits = 8); which layers use which "
                "instance is the trainer's and loom quantize's rules"))
    if not ok or bits is None:
        return None
    out.notes.append("activation_quantization (8 bits, symmetric, dynamic) is activation_bits "
                     "= 8 on the zeroquant instances: their matmul quantizes each token of x to "
                     "INT8 and multiplies codes by codes (W8A8, W4A8); xtc's 1- and 2-bit "
                     "matmul takes float activations")
    return 8


def _weight_quantization(cfg: Any, out: Conversion, act_bits: Optional[int]) -> None:
    p = "compression_training.weight_quantization"
    if not isinstance(cfg, dict):
        out.unmapped.append(Unmapped(p, "must be an object"))
        return
    shared = cfg.get("shared_parameters", {})
    if not isinstance(shared, dict) or not shared.get("enabled", False):
        out.unmapped.append(Unmapped(p, "enabled is false (or missing): nothing to map"))
        return
    symmetric = True
    for k, v in shared.items():
        key = f"{p}.shared_parameters.{k}"
        if k == "enabled":
            continue
        if k == "quantization_type":
            if v in ("symmetric", "asymmetric"):
                symmetric = v == "symmetric"
            else:
                out.unmapped.append(Unmapped(key, f"'{v}' is not symmetric or asymmetric; the "
                                             "manifest uses symmetric"))
        elif k == "quantize_groups":
            _groups_note(key, v, out)
        elif k == "rounding":
            if v != "nearest":
                out.unmapped.append(Unmapped(key, f"'{v}': Loom rounds to nearest (half to "
                                             "even) only, the same on CPU and CUDA"))
        elif k in _QUANT_SHARED_REASONS:
            if k == "quantize_weight_in_forward" and v is True:
                continue  # what Loom's QAT does
            out.unmapped.append(Unmapped(key, _QUANT_SHARED_REASONS[k]))
        else:
            out.unmapped.append(Unmapped(key, "not a key of DeepSpeed's weight quantization"))
    groups = cfg.get("different_groups", {})
    if not isinstance(groups, dict) or not groups:
        out.unmapped.append(Unmapped(f"{p}.different_groups", "missing or empty: DeepSpeed "
                                     "needs at least one group with target_bits"))
        return
    for name, g in groups.items():
        gp = f"{p}.different_groups.{name}"
        if not isinstance(g, dict) or not isinstance(g.get("params"), dict):
            out.unmapped.append(Unmapped(gp, "must be an object with params.target_bits"))
            continue
        params = g["params"]
        bits = _as_int(params.get("target_bits"))
        if bits is None or not 1 <= bits <= 8:
            out.unmapped.append(Unmapped(f"{gp}.params.target_bits", f"must be an integer 1..8, "
                                         f"not {json.dumps(params.get('target_bits'))}"))
            continue
        header = f"quantizer.{_unique_name(_safe_name(name), out)}"
        if bits >= 3:
            t: Dict[str, Any] = {"plugin": "zeroquant", "bits": bits, "symmetric": symmetric,
                                 "group_size": 0, "range": "deepspeed",
                                 "activation_bits": 8 if act_bits == 8 else 0}
            if not symmetric and bits == 8 and act_bits == 8:
                t["activation_bits"] = 0
                out.unmapped.append(Unmapped(
                    f"{gp}.params.target_bits", "8 bits asymmetric with INT8 activations: "
                    "asymmetric 8-bit codes minus their zero points do not fit the INT8 GEMM, "
                    f"so [{header}] multiplies float activations (activation_bits = 0); use "
                    "quantization_type symmetric or at most 7 bits for W8A8"))
            if bits not in (4, 8):
                out.notes.append(f"{gp}: {bits}-bit codes are packed and computed exactly, "
                                 "but only 8 and 4 bits have tuned kernels")
        else:
            if not symmetric:
                out.unmapped.append(Unmapped(f"{gp}.params.target_bits",
                                             f"{bits} bits with quantization_type asymmetric: "
                                             "DeepSpeed refuses it (1- and 2-bit weights are "
                                             "binary or ternary, symmetric by definition); the "
                                             "manifest uses xtc"))
            t = {"plugin": "xtc", "mode": "binary" if bits == 1 else "ternary", "group_size": 0}
        for k, v in params.items():
            key = f"{gp}.params.{k}"
            if k == "target_bits":
                continue
            if k == "start_bits":
                if _as_int(v) != bits:
                    out.unmapped.append(Unmapped(key, f"{json.dumps(v)}: Loom quantizes at "
                                                 "target_bits from the start (DeepSpeed's "
                                                 "quantize-in-forward path ignores start_bits "
                                                 "too)"))
            elif k == "quantization_period":
                out.unmapped.append(Unmapped(key, "Loom has no bit schedule (start_bits down to "
                                             "target_bits); it quantizes at target_bits"))
            else:
                out.unmapped.append(Unmapped(key, "not a parameter of DeepSpeed's weight "
                                             "quantization"))
        for k, v in g.items():
            if k == "params":
                continue
            if k in ("modules", "related_modules"):
                out.unmapped.append(Unmapped(
                    f"{gp}.{k}", f"{json.dumps(v)}: which tensors [{header}] takes is the "
                    "trainer's and loom quantize's rules (match these names there)"))
            else:
                out.unmapped.append(Unmapped(f"{gp}.{k}", "not a key of a DeepSpeed "
                                             "quantization group"))
        out.tables.append((header, t))
        if t["plugin"] == "zeroquant":
            out.notes.append(f"{gp} is [{header}] (zeroquant, {bits} bits, range = "
                             "\"deepspeed\": DeepSpeed's divisor 2^b, bit-exact to its simulated "
                             "quantizer; Loom's own \"exact\" range maps max|w| to the largest "
                             "code)")
        else:
            rule = ("BWN, alpha = mean|w|; a zero weight decodes to +alpha" if bits == 1
                    else "TWN, Delta = 0.7 mean|w|")
            floats = ", activations stay float" if act_bits == 8 else ""
            out.notes.append(f"{gp} is [{header}] (xtc {t['mode']}: {rule}{floats})")


# ---------------------------------------------------------------- entry points

def convert(config: Union[Dict[str, Any], str, "os.PathLike[str]"]) -> Conversion:
    """The Loom manifest for a DeepSpeed config.

    Args:
        config: the config as a dict, or the path of its JSON file.

    Returns:
        Conversion: ``.manifest`` (TOML text), ``.tables``, ``.unmapped`` (every key not
        carried, with the reason) and ``.notes``.

    Raises:
        ValueError: the file is not JSON, or the config is not an object.
        OSError: the file cannot be read.
    """
    source = "<dict>"
    if isinstance(config, (str, os.PathLike)):
        source = os.fspath(config)
        with open(source, encoding="utf-8") as f:
            text = f.read()
        try:
            config = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{source}: not JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{source}: a DeepSpeed config is a JSON object, not {_kind(config)}")
    out = Conversion(source=source)
    for k, v in config.items():
        if k == "optimizer":
            _optimizer(v, out)
        elif k == "curriculum_learning":
            _legacy_curriculum(v, out)
        elif k == "data_efficiency":
            _data_efficiency(v, out)
        elif k == "moe":
            _moe(v, out)
        elif k == "compression_training":
            _compression(v, out)
        elif k in TOP_LEVEL:
            out.unmapped.append(Unmapped(k, TOP_LEVEL[k]))
        else:
            out.unmapped.append(Unmapped(k, "no Loom equivalent"))
    return out


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m loom.deepspeed``: see the module's docstring."""
    ap = argparse.ArgumentParser(
        prog="python -m loom.deepspeed",
        description="Write the Loom manifest for a DeepSpeed config; list what it cannot map.")
    ap.add_argument("config", help="the DeepSpeed config (JSON)")
    ap.add_argument("-o", "--output", help="write the manifest here instead of stdout")
    ap.add_argument("--check", action="store_true",
                    help="also validate the manifest against the installed plugins "
                         "(as loom check)")
    ap.add_argument("-q", "--quiet", action="store_true",
                    help="do not list the keys it cannot map")
    args = ap.parse_args(argv)
    try:
        conv = convert(args.config)
    except (OSError, ValueError) as e:
        print(f"python -m loom.deepspeed: {e}", file=sys.stderr)
        return 1
    text = conv.manifest
    if args.check:
        from .errors import LoomError
        from .session import Session

        try:
            Session.from_string(text, args.output or "converted.toml", validate_only=True,
                                log_level="error").close()
        except LoomError as e:
            print(f"python -m loom.deepspeed: the converted manifest is not valid:\n{e}",
                  file=sys.stderr)
            return 1
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    if not args.quiet and conv.report():
        print(conv.report(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
