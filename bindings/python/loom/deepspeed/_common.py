"""What every part of the importer shares: the result (:class:`Conversion`), the unmapped
key (:class:`Unmapped`), the top-level reasons and the value checks."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

from .. import _toml


@dataclass
class Unmapped:
    """A DeepSpeed key the manifest does not carry, and why."""
    key: str  # dotted path in the config, e.g. "optimizer.params.lr"
    reason: str

    def __str__(self) -> str:
        return f"{self.key}: not mapped: {self.reason}"


# DeepSpeed removed these in September 2026 (deepspeedai/DeepSpeed#8490, tracked in #8489;
# the 1-bit compressed-allreduce backends followed in #8547): its config no longer takes them.
REMOVED_IN = "September 2026 (deepspeedai/DeepSpeed#8490)"


@dataclass
class Removed:
    """A feature of the config that DeepSpeed removed in September 2026, and what carries it
    in the manifest (None: Loom does not carry it either)."""
    key: str  # dotted path in the config, e.g. "optimizer.type"
    feature: str  # what DeepSpeed called it, in words: "1-bit Adam (type OneBitAdam)"
    loom: Optional[str] = None  # what the manifest has for it: '[optimizer.main] plugin "..."'

    def __str__(self) -> str:
        return f"{self.key}: {self.feature}" + (f" -> {self.loom}" if self.loom else "")


def analyze_path(manifest_path: Union[str, "os.PathLike[str]"]) -> str:
    """Where the analyzer's manifest is written beside the manifest ``manifest_path``:
    ``run.toml`` -> ``run.analyze.toml``."""
    p = os.fspath(manifest_path)
    root, ext = os.path.splitext(p)
    return (root if ext == ".toml" else p) + ".analyze.toml"


@dataclass
class Conversion:
    """What :func:`convert` made of a DeepSpeed config.

    Attributes:
        tables (list[tuple[str, dict]]): the manifest's instances, ("optimizer.main",
            {"plugin": "adam", ...}), in order.
        rules (list[dict]): the manifest's ``[[quantize]]`` rules for ``loom quantize``
            ({"tensors": [...], "quantizer": NAME} or {"tensors": [...], "copy": True}),
            first match wins.
        analyze (list[tuple[str, dict]]): the metric instances ``loom data analyze`` runs to
            build the index the sampler reads (see :attr:`analyze_manifest`).
        removed (list[Removed]): the features of the config that DeepSpeed removed in
            September 2026 (the 1-bit optimizers and their comm backends, the compression
            library's ZeroQuant, XTC, pruning and layer reduction), each with the Loom
            instance that carries it, or None; reported before everything else.
        unmapped (list[Unmapped]): every key not carried, with the reason.
        notes (list[str]): keys that were mapped with a caveat worth reading, and what to
            run before the manifest is used.
        source (str): the config's path, or "<dict>".
        manifest_path (str or None): where the manifest is to be written, as given to
            :func:`convert`; the notes name files beside it.
    """
    tables: List[Tuple[str, Dict[str, Any]]] = field(default_factory=list)
    rules: List[Dict[str, Any]] = field(default_factory=list)
    analyze: List[Tuple[str, Dict[str, Any]]] = field(default_factory=list)
    unmapped: List[Unmapped] = field(default_factory=list)
    removed: List[Removed] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    source: str = "<dict>"
    manifest_path: Optional[str] = None

    @property
    def empty(self) -> bool:
        """True when nothing of the config maps to a Loom instance."""
        return not self.tables

    @property
    def manifest(self) -> str:
        """The manifest as TOML text, headed by comments naming the source, the features
        DeepSpeed removed that the config uses, the notes and the keys left out."""
        head = [f"Loom manifest converted from the DeepSpeed config {self.source}."]
        if self.removed:
            head.append("")
            head += self.removed_lines()
        if self.notes:
            head.append("")
            head += [f"note: {n}" for n in self.notes]
        if self.unmapped:
            head.append("")
            head.append("DeepSpeed keys not mapped:")
            head += [f"  {u}" for u in self.unmapped]
        body = [("loom", {"abi": 1})] + self.tables
        return _toml.manifest(body, "\n".join(head), [("quantize", r) for r in self.rules])

    @property
    def analyze_manifest(self) -> Optional[str]:
        """The manifest for ``loom data analyze``: the metric instances of the sampler's
        index alone (the converted manifest's sampler opens its index when it is created,
        so the analyzer cannot open that one before the index exists), or None when the
        sampler reads no index of a bundled metric."""
        if not self.analyze:
            return None
        head = (f"The metrics `loom data analyze` runs for the manifest converted from "
                f"{self.source}:\nits curriculum sampler reads the index they write.")
        return _toml.manifest([("loom", {"abi": 1})] + self.analyze, head)

    def write(self, path: Union[str, "os.PathLike[str]"]) -> List[str]:
        """Writes :attr:`manifest` to ``path`` and, when there is one, the
        :attr:`analyze_manifest` beside it (:func:`analyze_path`). Returns the paths
        written."""
        path = os.fspath(path)
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.manifest)
        written = [path]
        extra = self.analyze_manifest
        if extra is not None:
            with open(analyze_path(path), "w", encoding="utf-8") as f:
                f.write(extra)
            written.append(analyze_path(path))
        return written

    def removed_lines(self) -> List[str]:
        """What :meth:`report` and the manifest say first: the features of the config that
        DeepSpeed removed, those Loom carries (with the instance each maps to), then those
        it does not. Empty when the config uses none."""
        carried = [r for r in self.removed if r.loom]
        dropped = [r for r in self.removed if not r.loom]
        lines: List[str] = []
        if carried:
            lines.append(f"this config uses features DeepSpeed removed in {REMOVED_IN}; "
                         "Loom carries these:")
            lines += [f"  {r}" for r in carried]
        if dropped:
            lines.append(f"this config uses features DeepSpeed removed in {REMOVED_IN}; "
                         "Loom does not carry these (the keys not mapped say why):")
            lines += [f"  {r}" for r in dropped]
        return lines

    def report(self) -> str:
        """First the features DeepSpeed removed that the config uses
        (:meth:`removed_lines`), then one line per note and per unmapped key, each line
        prefixed with the source."""
        lines = [f"{self.source}: {line}" for line in self.removed_lines()]
        lines += [f"{self.source}: note: {n}" for n in self.notes]
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


# ---------------------------------------------------------------- values

_INTS = {"freeze_step", "var_freeze_step", "var_update_scaler", "local_step_scaler",
         "local_step_clipper", "total_curriculum_step", "difficulty_step"}
_BOOLS = {"bias_correction", "adam_w_mode"}


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def as_int(v: Any) -> Optional[int]:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return None


def check_value(k: str, v: Any) -> Optional[str]:
    """None when ``v`` has the type the Loom parameter takes, else the reason."""
    if k == "betas":
        if not (isinstance(v, (list, tuple)) and len(v) == 2 and all(is_number(x) for x in v)):
            return f"must be a list of two numbers, not {json.dumps(v)}"
        return None
    if k in _BOOLS:
        return None if isinstance(v, bool) else f"must be true or false, not {json.dumps(v)}"
    if k in _INTS:
        return None if as_int(v) is not None else f"must be an integer, not {json.dumps(v)}"
    return None if is_number(v) else f"must be a finite number, not {json.dumps(v)}"


def is_int_param(k: str) -> bool:
    return k in _INTS


def kind(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(v), "a number")


def safe_name(name: str) -> str:
    """A manifest instance name for ``name``: letters, digits, '_' and '-' kept, the rest
    '_'."""
    return "".join(c if c.isalnum() or c in "_-" else "_" for c in str(name)) or "group"
