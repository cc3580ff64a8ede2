"""DeepSpeed's 1-bit optimizers under their DeepSpeed names and signatures, over Loom's
plugins: ``loom.torch.OnebitAdam``, ``loom.torch.ZeroOneAdam``, ``loom.torch.OnebitLamb``.

DeepSpeed removed its ``OnebitAdam``, ``ZeroOneAdam`` and ``OnebitLamb`` in September 2026
(deepspeedai/DeepSpeed#8490). These classes take the same arguments, in the same order and
with the same defaults, so a script migrates by changing its import. Each is a
:class:`loom.torch.Optimizer` over the plugin ``onebit_adam``, ``zero_one_adam`` or
``onebit_lamb`` with the arguments mapped onto the plugin's parameters; what each
DeepSpeed argument becomes is in :data:`ARGUMENTS` and in docs/python.md
("Migrating from DeepSpeed's 1-bit optimizers").
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

import torch

from .errors import InvalidArgumentError, NotFoundError
from .session import describe_plugins
from .torch import Optimizer

__all__ = ["OnebitAdam", "ZeroOneAdam", "OnebitLamb", "ARGUMENTS"]

# What each DeepSpeed argument becomes. A refusal raises loom.InvalidArgumentError (a
# ValueError) naming the argument; an argument that only DeepSpeed's engine or its MPI
# staging used is accepted with a warning when set, and has no effect.
ARGUMENTS: Dict[str, str] = {
    "params": "the parameters or param groups, as for any torch optimizer; group keys lr, "
              "weight_decay, exp_avg_mask (all three) and non_freeze (OnebitAdam only: the "
              "others refuse it, where DeepSpeed ignored it)",
    "deepspeed": "DeepSpeed's engine object: not used (Loom's optimizer averages the "
                 "gradients itself, in warmup too); a warning when given",
    "lr": "each group's lr, read at every step (so lr schedulers work)",
    "freeze_step": "the plugin's freeze_step (OnebitAdam, OnebitLamb)",
    "bias_correction": "accepted and without effect, as in DeepSpeed, which never corrects: "
                       "the plugin runs with bias_correction = false (for Loom's correction "
                       "use loom.torch.Optimizer(plugin=..., bias_correction=True))",
    "betas": "the plugin's betas",
    "eps": "the plugin's eps (added outside the square root)",
    "eps_inside_sqrt": "True has no effect, as in DeepSpeed, which never read it (eps stays "
                       "outside the square root); a warning when True",
    "weight_decay": "each group's weight_decay (decoupled, added to the update as DeepSpeed "
                    "does)",
    "max_grad_norm": "0 only; anything else is refused, as DeepSpeed's engine refused it: "
                     "clip the gradients before step() (torch.nn.utils.clip_grad_norm_)",
    "amsgrad": "False only; True is refused, as DeepSpeed refused it",
    "cuda_aware": "True has no effect (DeepSpeed's MPI backend staged through host memory "
                  "without it; a Loom transport moves the memory it is given); a warning "
                  "when True",
    "comm_backend_name": "the transport: 'nccl' (the default) and 'compressed' take nccl "
                         "for CUDA parameters, ucx for host ones; 'mpi' Loom's mpi plugin "
                         "(NotFoundError when it is not installed); 'hccl' (Ascend NPUs) and "
                         "other names are refused",
    "var_freeze_step": "the plugin's var_freeze_step (ZeroOneAdam)",
    "var_update_scaler": "the plugin's var_update_scaler (ZeroOneAdam)",
    "local_step_scaler": "the plugin's local_step_scaler (ZeroOneAdam)",
    "local_step_clipper": "the plugin's local_step_clipper (ZeroOneAdam)",
    "max_coeff": "the plugin's max_coeff (OnebitLamb)",
    "min_coeff": "the plugin's min_coeff (OnebitLamb)",
    "coeff_beta": "the plugin's coeff_beta (OnebitLamb)",
    "factor_max": "the plugin's factor_max (OnebitLamb)",
    "factor_min": "the plugin's factor_min (OnebitLamb)",
    "factor_threshold": "the plugin's factor_threshold (OnebitLamb)",
}

_BACKENDS = ("nccl", "mpi", "hccl", "compressed")


def _flat_params(params: Any) -> tuple:
    """(params as torch.optim takes them, a list now, and every tensor in it)."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params argument given to the optimizer should be an iterable of "
                        f"Tensors or dicts, but got {torch.typename(params)}")
    params = list(params)
    tensors: List[torch.Tensor] = []
    for item in params:
        if isinstance(item, dict):
            ps = item.get("params", [])
            ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
            tensors += ps
            item["params"] = ps  # a generator inside a group is consumed once
        else:
            tensors.append(item)
    return params, tensors


def _check_bool(who: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{who}: {name}={value!r}: expected True or False")


def _number(name: str, value: Any, who: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value):
        raise InvalidArgumentError(f"{who}: {name} must be a finite number, not {value!r}")
    return float(value)


def _comm_plugin(who: str, name: Any, tensors: List[torch.Tensor],
                 plugin_path: Union[None, str, Sequence[str]]) -> str:
    """The Loom transport for DeepSpeed's comm_backend_name, given the parameters."""
    if name not in _BACKENDS:
        raise InvalidArgumentError(
            f"{who}: comm_backend_name={name!r} is not one of DeepSpeed's backends "
            f"({', '.join(repr(b) for b in _BACKENDS)})")
    if name == "hccl":
        raise InvalidArgumentError(
            f"{who}: comm_backend_name='hccl' is DeepSpeed's backend for Ascend NPUs; Loom has "
            "no transport for NPU memory (ucx moves host memory, nccl CUDA memory): use "
            "comm_backend_name='nccl'")
    if name == "mpi":
        try:
            info = describe_plugins("mpi", plugin_path)
        except NotFoundError as e:
            raise NotFoundError(
                f"{who}: comm_backend_name='mpi' runs over Loom's 'mpi' transport plugin, "
                f"which is not installed: {e}. Install it (or add its folder with "
                "plugin_path= or LOOM_PLUGIN_PATH), or use comm_backend_name='nccl' (nccl "
                "for CUDA parameters, ucx for host ones)") from None
        kinds = [k.get("kind") for p in info.get("plugins", []) for k in p.get("kinds", [])]
        if "loom.comm/1" not in kinds:
            raise NotFoundError(f"{who}: the plugin 'mpi' found is not a loom.comm/1 transport "
                                f"(it provides {', '.join(map(str, kinds)) or 'nothing'})")
        return "mpi"
    # 'nccl' (DeepSpeed's default) and 'compressed' (its backend-agnostic one): the
    # transport for the parameters' memory.
    devices = {t.device.type for t in tensors if isinstance(t, torch.Tensor)}
    if len(devices) > 1:
        raise InvalidArgumentError(
            f"{who}: the parameters are on {' and '.join(sorted(devices))}; a 1-bit optimizer "
            "steps all of them on one device (all on the CPU or all on one CUDA device)")
    return "nccl" if devices == {"cuda"} else "ucx"


class _DeepSpeedOnebit:
    """What the three classes share: the checks of DeepSpeed's common arguments, and the
    opening of the plugin through loom.torch.Optimizer."""

    def _open(self, who: str, plugin: str, params: Any, *, deepspeed: Any, lr: Any,
              bias_correction: Any, betas: Any, eps: Any, eps_inside_sqrt: Any,
              weight_decay: Any, max_grad_norm: Any, amsgrad: Any, cuda_aware: Any,
              comm_backend_name: Any, plugin_params: Dict[str, Any],
              plugin_path: Union[None, str, Sequence[str]], log_level: Optional[str],
              bootstrap: Any, non_freeze: bool) -> None:
        if amsgrad:
            raise InvalidArgumentError(
                f"{who}: amsgrad=True: the 1-bit optimizers have no AMSGrad variant "
                "(DeepSpeed refused it too)")
        if _number("max_grad_norm", max_grad_norm, who) != 0.0:
            raise InvalidArgumentError(
                f"{who}: max_grad_norm={max_grad_norm!r}: the optimizer does not clip "
                "(DeepSpeed's engine refused max_grad_norm as an optimizer parameter); clip "
                "the gradients before step(), e.g. torch.nn.utils.clip_grad_norm_")
        if not isinstance(bias_correction, bool):
            raise InvalidArgumentError(
                f"{who}: bias_correction must be True or False, not {bias_correction!r}")
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise InvalidArgumentError(f"{who}: betas must be a pair of numbers, not {betas!r}")
        betas = [_number("betas", b, who) for b in betas]
        eps = _number("eps", eps, who)
        lr = _number("lr", lr, who)
        weight_decay = _number("weight_decay", weight_decay, who)
        if weight_decay < 0 or eps < 0 or lr < 0:
            bad = "weight_decay" if weight_decay < 0 else "eps" if eps < 0 else "lr"
            raise InvalidArgumentError(f"{who}: {bad} must be >= 0, not "
                                       f"{dict(weight_decay=weight_decay, eps=eps, lr=lr)[bad]}")
        if deepspeed is not None:
            warnings.warn(
                f"{who}: the deepspeed engine argument is not used: Loom's optimizer averages "
                "the gradients over its own transport, in warmup too, so the engine must not "
                "allreduce them (with its backward allreduce on they are averaged twice: the "
                "same result, none of the saving)", stacklevel=3)
        if eps_inside_sqrt:
            warnings.warn(f"{who}: eps_inside_sqrt=True has no effect (DeepSpeed never read "
                          "it either): eps is added outside the square root", stacklevel=3)
        if cuda_aware:
            warnings.warn(f"{who}: cuda_aware=True has no effect: it was DeepSpeed's switch "
                          "for staging MPI buffers through host memory; a Loom transport "
                          "moves the memory it is given", stacklevel=3)
        params, tensors = _flat_params(params)
        for gi, g in enumerate(params):
            if isinstance(g, dict) and g.get("non_freeze") and not non_freeze:
                raise InvalidArgumentError(
                    f"{who}: param group {gi} sets non_freeze, which only OnebitAdam has "
                    "(DeepSpeed's other 1-bit optimizers ignored it); remove it")
        comm = _comm_plugin(who, comm_backend_name, tensors, plugin_path)
        # plugin= opens the plugin in a session of the optimizer's own, with the transport
        # and codec it declares for the 1-bit family.
        Optimizer.__init__(self, params, plugin=plugin, lr=lr, weight_decay=weight_decay,
                           plugin_path=plugin_path, log_level=log_level, bootstrap=bootstrap,
                           comm_plugin=comm, codec_plugin="onebit", betas=betas, eps=eps,
                           bias_correction=False, **plugin_params)
        self.comm_backend_name = comm_backend_name
        self.comm_plugin = comm
        self.deepspeed = deepspeed

    @staticmethod
    def _buckets(who: str, bucket_mb: Any, overlap_backward: Optional[bool]) -> Dict[str, Any]:
        """The plugin's ``bucket_mb`` and the hooks' switch (on by default with buckets)."""
        bucket_mb = _number("bucket_mb", bucket_mb, who)
        if bucket_mb < 0:
            raise InvalidArgumentError(f"{who}: bucket_mb={bucket_mb!r}: must be >= 0")
        if overlap_backward is None:
            overlap_backward = bucket_mb > 0
        return {"bucket_mb": bucket_mb, "overlap_backward": overlap_backward}


class OnebitAdam(_DeepSpeedOnebit, Optimizer):
    """1-bit Adam (DeepSpeed's ``OnebitAdam``, which DeepSpeed removed in September
    2026) on Loom's ``onebit_adam`` plugin: Adam for ``freeze_step`` steps with the
    gradients averaged exactly, then the variance frozen and the momentum averaged with
    the 1-bit compressed allreduce.

    The arguments are DeepSpeed's, in its order and with its defaults; what each
    becomes is :data:`loom._torch_onebit.ARGUMENTS` (docs/python.md, "Migrating from
    DeepSpeed's 1-bit optimizers"). Pass each rank's local gradients (no DDP, no
    allreduce of your own): the optimizer averages them. Step 1 is the first real step
    (DeepSpeed's fp16 wrapper spent a first step() on zeros). Refusals raise
    :class:`loom.InvalidArgumentError` (a ValueError) naming the argument. Loom's own
    keyword-only arguments follow DeepSpeed's: ``plugin_path``, ``log_level`` and
    ``bootstrap``, as for :class:`loom.torch.Optimizer`; ``shard_state``: True keeps
    each rank's share of the moments only (ZeRO stage 1, which DeepSpeed refused for its
    1-bit optimizers; the plugin's ``shard_state``, docs/optimizers.md); ``bucket_mb``: >
    0 exchanges in buckets of that many MiB, each started by a gradient hook during the
    backward as soon as its gradients are final (``overlap_backward``, True by default
    then; see :class:`loom.torch.Optimizer`).

    Attributes:
        comm_backend_name (str): as given; comm_plugin (str): the Loom transport it
            became ("ucx", "nccl" or "mpi"); instance, last_step_skipped: as for
            loom.torch.Optimizer.
    """

    def __init__(self, params: Iterable[Any], deepspeed: Any = None, lr: float = 1e-3,
                 freeze_step: int = 100000, bias_correction: bool = True,
                 betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.,
                 max_grad_norm: float = 0., amsgrad: bool = False,
                 cuda_aware: bool = False, comm_backend_name: str = 'nccl', *,
                 plugin_path: Union[None, str, Sequence[str]] = None,
                 log_level: Optional[str] = None, bootstrap: Any = "auto",
                 shard_state: bool = False, bucket_mb: float = 0.0,
                 overlap_backward: Optional[bool] = None) -> None:
        _check_bool("loom.torch.OnebitAdam", "shard_state", shard_state)
        self._open("loom.torch.OnebitAdam", "onebit_adam", params, deepspeed=deepspeed,
                   lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                   eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay,
                   max_grad_norm=max_grad_norm, amsgrad=amsgrad, cuda_aware=cuda_aware,
                   comm_backend_name=comm_backend_name,
                   plugin_params={"freeze_step": freeze_step, "shard_state": shard_state,
                                  **self._buckets("loom.torch.OnebitAdam", bucket_mb,
                                                  overlap_backward)},
                   plugin_path=plugin_path,
                   log_level=log_level, bootstrap=bootstrap, non_freeze=True)
        self.freeze_step = freeze_step


class ZeroOneAdam(_DeepSpeedOnebit, Optimizer):
    """0/1 Adam (DeepSpeed's ``ZeroOneAdam``, which DeepSpeed removed in September
    2026) on Loom's ``zero_one_adam`` plugin: adaptive variance freezing with 1-bit
    gradient averaging, then local steps synced by the 1-bit compressed allreduce.

    The arguments are DeepSpeed's, in its order and with its defaults (``var_freeze_step``
    100000, ``var_update_scaler`` 16, ``local_step_scaler`` 32678, ``local_step_clipper``
    16); see :class:`OnebitAdam` for the rest (``bucket_mb`` and ``overlap_backward``
    too: after the variance freeze a sync step's buckets start in :meth:`step`, which has
    the lr). Local steps start at step ``var_freeze_step + 1`` (DeepSpeed switched one
    step later); ``non_freeze`` groups are refused.
    """

    def __init__(self, params: Iterable[Any], deepspeed: Any = None, lr: float = 1e-3,
                 bias_correction: bool = True, betas: Sequence[float] = (0.9, 0.999),
                 eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0., max_grad_norm: float = 0.,
                 var_freeze_step: int = 100000, var_update_scaler: int = 16,
                 local_step_scaler: int = 32678, local_step_clipper: int = 16,
                 amsgrad: bool = False, cuda_aware: bool = False,
                 comm_backend_name: str = 'nccl', *,
                 plugin_path: Union[None, str, Sequence[str]] = None,
                 log_level: Optional[str] = None, bootstrap: Any = "auto",
                 bucket_mb: float = 0.0, overlap_backward: Optional[bool] = None) -> None:
        self._open("loom.torch.ZeroOneAdam", "zero_one_adam", params,
                   deepspeed=deepspeed, lr=lr, bias_correction=bias_correction,
                   betas=betas, eps=eps, eps_inside_sqrt=eps_inside_sqrt,
                   weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                   amsgrad=amsgrad, cuda_aware=cuda_aware,
                   comm_backend_name=comm_backend_name,
                   plugin_params={"var_freeze_step": var_freeze_step,
                                  "var_update_scaler": var_update_scaler,
                                  "local_step_scaler": local_step_scaler,
                                  "local_step_clipper": local_step_clipper,
                                  **self._buckets("loom.torch.ZeroOneAdam", bucket_mb,
                                                  overlap_backward)},
                   plugin_path=plugin_path, log_level=log_level, bootstrap=bootstrap,
                   non_freeze=False)
        self.var_freeze_step = var_freeze_step


class OnebitLamb(_DeepSpeedOnebit, Optimizer):
    """1-bit LAMB (DeepSpeed's ``OnebitLamb``, which DeepSpeed removed in September
    2026) on Loom's ``onebit_lamb`` plugin: LAMB for ``freeze_step`` steps, then the
    variance and trust ratio frozen, the momentum of the whole model averaged with one
    1-bit compressed allreduce, and the ratio rescaled by the clamped factor.

    The arguments are DeepSpeed's, in its order and with its defaults (``max_coeff``
    10.0, ``min_coeff`` 0.01, ``coeff_beta`` 0.9, ``factor_max`` 4.0, ``factor_min``
    0.5, ``factor_threshold`` 0.1); see :class:`OnebitAdam` for the rest (``shard_state``,
    on host memory, ``bucket_mb`` and ``overlap_backward`` too). As DeepSpeed did,
    parameters with no elements are left out of the optimizer; ``non_freeze`` groups are
    refused.
    """

    def __init__(self, params: Iterable[Any], deepspeed: Any = None, lr: float = 1e-3,
                 freeze_step: int = 100000, bias_correction: bool = True,
                 betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.,
                 max_grad_norm: float = 0., max_coeff: float = 10.0,
                 min_coeff: float = 0.01, amsgrad: bool = False,
                 cuda_aware: bool = False, comm_backend_name: str = 'nccl',
                 coeff_beta: float = 0.9, factor_max: float = 4.0,
                 factor_min: float = 0.5, factor_threshold: float = 0.1, *,
                 plugin_path: Union[None, str, Sequence[str]] = None,
                 log_level: Optional[str] = None, bootstrap: Any = "auto",
                 shard_state: bool = False, bucket_mb: float = 0.0,
                 overlap_backward: Optional[bool] = None) -> None:
        _check_bool("loom.torch.OnebitLamb", "shard_state", shard_state)
        self._open("loom.torch.OnebitLamb", "onebit_lamb", _non_empty(params),
                   deepspeed=deepspeed, lr=lr, bias_correction=bias_correction,
                   betas=betas, eps=eps, eps_inside_sqrt=eps_inside_sqrt,
                   weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                   amsgrad=amsgrad, cuda_aware=cuda_aware,
                   comm_backend_name=comm_backend_name,
                   plugin_params={"freeze_step": freeze_step, "max_coeff": max_coeff,
                                  "min_coeff": min_coeff, "coeff_beta": coeff_beta,
                                  "factor_max": factor_max, "factor_min": factor_min,
                                  "factor_threshold": factor_threshold,
                                  "shard_state": shard_state,
                                  **self._buckets("loom.torch.OnebitLamb", bucket_mb,
                                                  overlap_backward)},
                   plugin_path=plugin_path, log_level=log_level, bootstrap=bootstrap,
                   non_freeze=False)
        self.freeze_step = freeze_step


for _cls in (OnebitAdam, ZeroOneAdam, OnebitLamb):
    _cls.__module__ = "loom.torch"  # where users find them (and pickles look them up)


def _non_empty(params: Any) -> Any:
    """DeepSpeed's OnebitLamb leaves out parameters with no elements (their trust ratio
    would be 0/0), and groups left without any: the same, for tensors or param groups."""
    if isinstance(params, torch.Tensor):
        return params  # refused by _flat_params with torch's message
    out = []
    for item in params:
        if isinstance(item, dict):
            g = dict(item)
            ps = g.get("params", [])
            ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
            g["params"] = [p for p in ps if p.numel() > 0]
            if g["params"]:  # as DeepSpeed, a group left empty is dropped
                out.append(g)
        elif not (isinstance(item, torch.Tensor) and item.numel() == 0):
            out.append(item)
    return out
