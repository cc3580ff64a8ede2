"""PyTorch integration: Loom optimizer plugins as ``torch.optim.Optimizer`` objects
(DeepSpeed's 1-bit ones also by their DeepSpeed names: ``OnebitAdam``, ``ZeroOneAdam``,
``OnebitLamb``, in _torch_onebit.py), routers and Mixture-of-Experts layers as modules,
quantizers as packed linear layers.

``import loom.torch`` needs torch; the rest of the package does not.
"""

from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Union

import torch

import os
import socket

from . import _toml
from .bootstrap import Bootstrap
from .errors import FailedPreconditionError, InvalidArgumentError
from ._torch_common import _DTYPES, _buffer, _stream
# quantization: in _torch_quant.py, to keep this file short
from ._torch_quant import QuantizedLinear, QuantizedTensor, dequantize, quantize  # noqa: F401
# Mixture of Experts: in _torch_moe.py, likewise
from ._torch_moe import MoE  # noqa: F401
from .session import Instance, Session, describe_plugins

__all__ = ["Optimizer", "OnebitAdam", "ZeroOneAdam", "OnebitLamb", "Router", "MoE",
           "QuantizedLinear", "QuantizedTensor", "quantize", "dequantize",
           "distributed_bootstrap"]

_ONEBIT = ("OnebitAdam", "ZeroOneAdam", "OnebitLamb")


def __getattr__(name: str) -> Any:
    """DeepSpeed's 1-bit optimizers by their names (in _torch_onebit.py, which builds on
    Optimizer below; loaded on first use so either module may be imported first)."""
    if name in _ONEBIT:
        from . import _torch_onebit

        return getattr(_torch_onebit, name)
    raise AttributeError(f"module 'loom.torch' has no attribute {name!r}")


def distributed_bootstrap(group: Any = None) -> Bootstrap:
    """A :class:`loom.Bootstrap` over an initialised torch.distributed process group, so
    Loom's transports (``ucx``, ``nccl``) exchange their addresses through it: no
    rendezvous of Loom's own, no second port.

    Args:
        group: a torch.distributed group with a CPU backend (gloo or mpi, or a mixed one
            such as "cpu:gloo,cuda:nccl"), or None for the default group. With a NCCL
            default group, make a gloo one for Loom:
            ``torch.distributed.new_group(backend="gloo")``.

    The bootstrap's rank and size are the group's; its local rank is ``LOCAL_RANK`` when
    that is set (torchrun sets it), else this rank's position among the group's ranks on
    the same host name. Every rank of the group must open its sessions in the same order
    (their set-up is collective over the group); the collectives wait as long as the
    group's timeout (``init_process_group(timeout=...)``), not ``LOOM_BOOTSTRAP_TIMEOUT``.

    Raises:
        FailedPreconditionError: torch.distributed is not initialised.
        InvalidArgumentError: the group's backend cannot move CPU tensors.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise FailedPreconditionError(
            "loom.torch.distributed_bootstrap: torch.distributed is not initialised (call "
            "torch.distributed.init_process_group first, or open the session without a "
            "bootstrap so the host reads the launcher's RANK, WORLD_SIZE, MASTER_ADDR, "
            "MASTER_PORT)")
    backend = str(dist.get_backend(group)).lower()
    # A mixed backend ("cpu:gloo,cuda:nccl") moves CPU tensors through its cpu: entry.
    entries = [e.strip() for e in backend.split(",") if e.strip()]
    cpu = [e.split(":", 1)[1].strip() for e in entries if e.startswith("cpu:")]
    plain = [e for e in entries if ":" not in e]
    if not (any(b in ("gloo", "mpi") for b in cpu) or any(b in ("gloo", "mpi") for b in plain)):
        raise InvalidArgumentError(
            f"loom.torch.distributed_bootstrap: the group's backend is {backend}, which "
            "does not move CPU tensors; pass a gloo group: "
            "torch.distributed.new_group(backend=\"gloo\")")
    rank, size = dist.get_rank(group), dist.get_world_size(group)

    def allgather(data: bytes) -> bytes:
        if not data:
            return b""
        mine = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(parts, mine, group=group)
        return b"".join(bytes(p.tolist()) for p in parts)

    def barrier() -> None:
        dist.barrier(group=group)

    local = os.environ.get("LOCAL_RANK")
    if local is not None and local.strip().isdigit() and int(local) < size:
        local_rank = int(local)
    else:
        host = socket.gethostname().encode()[:255].ljust(256, b"\0")
        names = allgather(host)
        hosts = [names[i * 256:(i + 1) * 256] for i in range(size)]
        local_rank = sum(1 for h in hosts[:rank] if h == host)
    return Bootstrap(rank, size, local_rank, allgather, barrier)


def _auto_bootstrap() -> Optional[Bootstrap]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return distributed_bootstrap()
    return None


def _manifest(plugin: str, params: Dict[str, Any], plugin_path: Any, comm_plugin: str,
              codec_plugin: str) -> tuple:
    """The manifest of an optimizer opened by name: the optimizer's table, and a transport
    and a codec instance when its plugin refers to them and the caller named none. Returns
    (text, whether the plugin takes a transport: only then does its session need a
    bootstrap over torch.distributed)."""
    tables = []
    params = dict(params)
    try:
        info = describe_plugins(plugin, plugin_path)
        specs = [q for k in info["plugins"][0]["kinds"] for q in k["params"]]
    except Exception:  # an unknown plugin: the session's open names it
        specs = []
    takes_comm = any(q.get("type") == "ref" and q.get("ref_kind") == "loom.comm/1"
                     for q in specs)
    if "comm" not in params or "codec" not in params:
        for q in specs:
            if q.get("type") != "ref" or q["name"] in params:
                continue
            if q.get("ref_kind") == "loom.comm/1":
                tables.append(_toml.table("comm.world", {"plugin": comm_plugin}))
                params[q["name"]] = "world"
            elif q.get("ref_kind") == "loom.codec/1":
                tables.append(_toml.table("codec.onebit", {"plugin": codec_plugin}))
                params[q["name"]] = "onebit"
    tables.append(_toml.table("optimizer.main", {"plugin": plugin, **params}))
    return "\n".join(tables), takes_comm


def _masks(gi: int, params: List[torch.Tensor], mask: Any) -> Optional[List[torch.Tensor]]:
    """A group's ``exp_avg_mask`` as the plugin takes it: one fp32 contiguous tensor per
    parameter, of its shape and on its device (the mask itself when it is one already, else
    the mask broadcast to it, as DeepSpeed multiplies it in). None without a mask."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise InvalidArgumentError(
            f"param_groups[{gi}]['exp_avg_mask'] is a {type(mask).__name__}, not a tensor")
    out = []
    for pi, p in enumerate(params):
        m = mask.detach()
        if m.dtype != torch.float32 or m.shape != p.shape or m.device != p.device or \
                not m.is_contiguous():
            try:
                m = torch.broadcast_to(m.to(device=p.device, dtype=torch.float32),
                                       p.shape).contiguous()
            except RuntimeError:
                raise InvalidArgumentError(
                    f"param_groups[{gi}]['exp_avg_mask'] has shape {list(mask.shape)}, which "
                    f"does not broadcast to param {pi}'s {list(p.shape)}; give masked "
                    "parameters a group of their own") from None
        out.append(m)
    return out


class Optimizer(torch.optim.Optimizer):
    """A Loom optimizer plugin (``loom.optimizer/1``) as a ``torch.optim.Optimizer``.

    Either give an optimizer instance of an open :class:`loom.Session`, or name a plugin
    and its manifest parameters, and the optimizer opens a session of its own::

        opt = loom.torch.Optimizer(model.parameters(), plugin="adam", lr=1e-3,
                                   betas=(0.9, 0.999), adam_w_mode=False)
        sched = torch.optim.lr_scheduler.StepLR(opt, 100)   # schedulers work as usual

        with loom.Session("run.toml") as s:
            opt = loom.torch.Optimizer(model.parameters(), s.optimizer("main"), lr=1e-3)

    Parameters are updated in place through DLPack (zero-copy); they must be contiguous
    tensors (CPU or CUDA), every one with a gradient at every step, in the same groups and
    order (Loom keys optimizer state by position). fp32 parameters are updated directly;
    for bf16 and fp16 ones the optimizer keeps an fp32 master copy (made from the parameter
    at the first step, saved in :meth:`state_dict`), the plugin updates it and writes the
    parameter back rounded to nearest even. Gradients are fp32, bf16 or fp16. Nothing is
    converted or copied on the way in: another dtype or a non-contiguous tensor raises
    :class:`loom.InvalidArgumentError`.

    Args:
        params: the parameters, or a list of param-group dicts as for any torch
            optimizer. Group keys: ``lr``, ``weight_decay`` (None: the plugin's
            ``weight_decay`` parameter), ``non_freeze`` (1-bit Adam's uncompressed groups),
            ``exp_avg_mask`` (the 1-bit family's momentum mask, as DeepSpeed's: a tensor
            broadcast to each of the group's parameters; kept as it is by
            :meth:`load_state_dict`, as DeepSpeed keeps the script's mask).
        instance: an optimizer instance (``session.optimizer("main")``); the caller keeps
            its session open while the optimizer is used.
        plugin: instead of ``instance``, the plugin to open ("adam", "lamb", ...).
        lr: the default learning rate of a group; read from each group at every step, so
            learning-rate schedulers drive it.
        weight_decay: the default ``weight_decay`` of a group (None: the plugin's).
        plugin_path: extra plugin folders for ``plugin``.
        log_level: the session's log level for ``plugin``.
        overlap_backward: announce each parameter's gradient to the optimizer as soon as the
            backward has accumulated it (a gradient hook; ``loom_optimizer_grads_ready``), so
            an optimizer that exchanges the gradients itself starts while the backward goes
            on (the 1-bit family with ``bucket_mb > 0``; others start nothing early). The same bits
            as without it. Each backward must be the last before :meth:`step` (where buckets
            have left, a second backward raises FailedPreconditionError and the plugin drops
            the step in progress), ``step()``'s ``grad_scale`` must be 1.0, and nothing may
            change the gradients between the backward and the step (no clipping: what the
            backward produced is what was sent).
        bootstrap: for ``plugin``: the session's :class:`loom.Bootstrap`; "auto" (the
            default) is, for a plugin that takes a transport (the 1-bit family),
            :func:`distributed_bootstrap` over torch.distributed's default group when it
            is initialised, else the host's own (the launcher's variables); for any other
            plugin no bootstrap at all (its session does no set-up across ranks). None is
            always the host's.
        comm_plugin, codec_plugin: for a ``plugin`` that takes a transport and a codec
            (onebit_adam, zero_one_adam, onebit_lamb) and is not given ``comm``/``codec``:
            the plugins of the ``[comm.world]`` and ``[codec.onebit]`` instances its session
            declares for it ("ucx" and "onebit").
        **plugin_params: manifest parameters of ``plugin`` (``betas``, ``eps``,
            ``adam_w_mode``, ...); ``loom describe PLUGIN`` lists them.

    Attributes:
        instance (loom.Instance): the Loom optimizer instance.
        last_step_skipped (bool): whether the last step was skipped for a non-finite
            gradient (parameters and state left as they were).
    """

    def __init__(self, params: Iterable[Any], instance: Optional[Instance] = None, *,
                 plugin: Optional[str] = None, lr: float = 1e-3,
                 weight_decay: Optional[float] = None,
                 plugin_path: Union[None, str, Sequence[str]] = None,
                 log_level: Optional[str] = None, bootstrap: Any = "auto",
                 comm_plugin: str = "ucx", codec_plugin: str = "onebit",
                 overlap_backward: bool = False, **plugin_params: Any) -> None:
        if (instance is None) == (plugin is None):
            raise InvalidArgumentError(
                "loom.torch.Optimizer needs exactly one of an instance "
                "(session.optimizer(NAME)) or plugin='NAME'")
        if not isinstance(lr, (int, float)) or lr < 0:
            raise InvalidArgumentError(f"lr must be a number >= 0, not {lr!r}")
        self._session: Optional[Session] = None
        if plugin is not None:
            if "plugin" in plugin_params or "lr" in plugin_params:
                raise InvalidArgumentError("plugin parameters cannot include 'plugin' or 'lr'")
            text, takes_comm = _manifest(plugin, plugin_params, plugin_path, comm_plugin,
                                         codec_plugin)
            if isinstance(bootstrap, str):
                if bootstrap != "auto":
                    raise InvalidArgumentError(
                        f"bootstrap must be 'auto', None or a loom.Bootstrap, not {bootstrap!r}")
                # Only a session with a transport sets up over the ranks; for one without
                # (adam, lamb, ...) a bootstrap would be a collective some ranks may skip,
                # and the default group may be NCCL.
                bootstrap = _auto_bootstrap() if takes_comm else None
            self._session = Session.from_string(text, f"<loom.torch.Optimizer {plugin}>",
                                                plugin_path=plugin_path, log_level=log_level,
                                                bootstrap=bootstrap)
            instance = self._session.optimizer("main")
        elif not (isinstance(bootstrap, str) and bootstrap == "auto"):
            raise InvalidArgumentError(
                "bootstrap= goes with plugin=; an instance's session has its own "
                "(loom.Session(..., bootstrap=loom.torch.distributed_bootstrap()))")
        elif plugin_params:
            raise InvalidArgumentError(
                f"manifest parameters ({', '.join(plugin_params)}) go in the manifest of "
                "the instance's session, not to loom.torch.Optimizer")
        assert instance is not None
        if instance.section != "optimizer":
            raise InvalidArgumentError(
                f"{instance.section}.{instance.name} is a {instance.kind} instance, not an "
                "optimizer")
        self.instance: Instance = instance
        self.last_step_skipped = False
        self._step = 0
        # fp32 master copies of bf16/fp16 parameters, by position (group, index).
        self._masters: Dict[tuple, torch.Tensor] = {}
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "non_freeze": False})
        if not isinstance(overlap_backward, bool):
            raise InvalidArgumentError(
                f"overlap_backward must be True or False, not {overlap_backward!r}")
        self._pending: Any = None  # the step announced during this backward
        self._hooks: List[Any] = []
        if overlap_backward:
            self._hook_gradients()

    def _hook_gradients(self) -> None:
        """A hook on each parameter that runs once its gradient is accumulated: torch >= 2.1's
        post-accumulate hook, else one on the parameter's AccumulateGrad node (kept alive
        here), as DDP did before it."""
        for gi, g in enumerate(self.param_groups):
            for pi, p in enumerate(g["params"]):
                def ready(*_: Any, gi: int = gi, pi: int = pi, p: Any = p) -> None:
                    self._announce(gi, pi, p)

                if hasattr(p, "register_post_accumulate_grad_hook"):
                    self._hooks.append(p.register_post_accumulate_grad_hook(ready))
                else:
                    node = p.expand_as(p).grad_fn.next_functions[0][0]
                    self._hooks.append((node, node.register_hook(ready)))

    def _announce(self, gi: int, pi: int, p: Any) -> None:
        if p.grad is None:
            return
        try:
            if self._pending is None:
                groups, _, stream = self._groups(partial=True)
                self._pending = self.instance.begin_step(groups, step=self._step + 1,
                                                         stream=stream)
            self._pending.ready(gi, pi, p.grad.detach())
        except BaseException:
            # The plugin dropped the step in progress: the next backward starts anew.
            self._pending = None
            raise

    def _groups(self, partial: bool = False) -> tuple:
        lr0 = float(self.param_groups[0]["lr"])
        # The step's lr is the first group's; the others are lr_scale multiples of it, so
        # the first group's rate reaches the plugin exactly.
        base = lr0 if lr0 != 0.0 else 1.0
        groups: List[Dict[str, Any]] = []
        stream = None
        for gi, g in enumerate(self.param_groups):
            params, grads, masters = [], [], []
            for pi, p in enumerate(g["params"]):
                if p.grad is None and not partial:
                    raise InvalidArgumentError(
                        f"param_groups[{gi}]['params'][{pi}] (shape {list(p.shape)}) has no "
                        "gradient; a Loom optimizer updates the same tensors at every step "
                        "(its state is kept by position), so give every parameter a gradient "
                        "or leave it out of the optimizer")
                if p.grad is not None and p.grad.is_sparse:
                    raise InvalidArgumentError(
                        f"param_groups[{gi}]['params'][{pi}] has a sparse gradient; Loom "
                        "optimizers take dense ones")
                params.append(p.detach())
                # A gradient the backward has not reached yet: its parameter stands in (same
                # shape; begin_step reads no gradient before its ready()).
                grads.append(p.grad.detach() if p.grad is not None else p.detach())
                if p.dtype in (torch.bfloat16, torch.float16):
                    m = self._masters.get((gi, pi))
                    if m is None or m.shape != p.shape or m.device != p.device:
                        m = p.detach().to(torch.float32, memory_format=torch.contiguous_format)
                        self._masters[(gi, pi)] = m
                    masters.append(m)
                else:
                    masters.append(None)
                if p.is_cuda and stream is None:
                    stream = torch.cuda.current_stream(p.device).cuda_stream
            lr = float(g["lr"])
            if lr < 0:
                raise InvalidArgumentError(f"param_groups[{gi}]['lr'] = {lr} is negative")
            wd = g.get("weight_decay")
            groups.append({
                "params": params,
                "grads": grads,
                "masters": masters if any(m is not None for m in masters) else None,
                "lr_scale": 1.0 if gi == 0 and lr0 != 0.0 else lr / base,
                "weight_decay": None if wd is None else float(wd),
                "non_freeze": bool(g.get("non_freeze", False)),
                "exp_avg_mask": _masks(gi, g["params"], g.get("exp_avg_mask")),
            })
        return groups, base, stream

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, *,
             grad_scale: float = 1.0) -> Any:
        """One step of the plugin over every group.

        Args:
            closure: re-evaluates the model and returns the loss (optional).
            grad_scale: the gradients are divided by it (loss scaling); 1.0 for none.

        Returns:
            the closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._pending is not None and grad_scale != 1.0:
            self._pending = None
            raise InvalidArgumentError(
                f"step(grad_scale={grad_scale}) after a backward announced with "
                "overlap_backward=True, whose gradients left at grad_scale 1.0: unscale the "
                "loss before backward, or turn overlap_backward off")
        groups, lr, stream = self._groups()
        try:
            self.last_step_skipped = self.instance.step(groups, lr, grad_scale=grad_scale,
                                                        step=self._step + 1, stream=stream)
        finally:
            self._pending = None
        self._step += 1
        return loss

    def comm_info(self) -> Dict[str, int]:
        """The plugin's traffic counters and skipped steps (``Instance.comm_info``)."""
        return self.instance.comm_info()

    def state_dict(self) -> Dict[str, Any]:
        """torch's state dict (param groups with their hyperparameters) plus the plugin's
        exported state under ``"loom"``: {"plugin", "state" (bytes), "step"}. Loading it
        into a fresh optimizer over the same parameters resumes bit for bit."""
        sd = super().state_dict()
        sd["loom"] = {"plugin": self.instance.plugin, "state": self.instance.export_state(),
                      "step": self._step,
                      "masters": {f"{g}.{i}": m.clone() for (g, i), m in self._masters.items()}}
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output: the param groups' hyperparameters, the
        step and the fp32 masters (all checked first), and last the plugin's state through
        its import_state.

        Raises:
            InvalidArgumentError: not a loom.torch.Optimizer state dict, from another
                plugin, with other groups, or with masters that do not fit the parameters;
                DataLossError: a damaged blob. Nothing is
                changed when it raises.
        """
        entry = state_dict.get("loom") if isinstance(state_dict, dict) else None
        if not isinstance(entry, dict) or not isinstance(entry.get("state"), (bytes, bytearray)):
            raise InvalidArgumentError(
                "not a loom.torch.Optimizer state dict (it has no 'loom' entry with the "
                "plugin's state); a torch.optim optimizer's state cannot be imported")
        if entry.get("plugin") != self.instance.plugin:
            raise InvalidArgumentError(
                f"the state dict is from plugin '{entry.get('plugin')}', this optimizer is "
                f"plugin '{self.instance.plugin}'")
        saved = state_dict.get("param_groups", [])
        if len(saved) != len(self.param_groups):
            raise InvalidArgumentError(
                f"the state dict has {len(saved)} param groups, this optimizer "
                f"{len(self.param_groups)}")
        for gi, (a, b) in enumerate(zip(saved, self.param_groups)):
            if len(a["params"]) != len(b["params"]):
                raise InvalidArgumentError(
                    f"param group {gi}: the state dict has {len(a['params'])} params, this "
                    f"optimizer {len(b['params'])}")
        step = entry.get("step", 0)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise InvalidArgumentError(f"the state dict's step is {step!r}, not an integer >= 0")
        raw = entry.get("masters")
        raw = {} if raw is None else raw
        if not isinstance(raw, dict):
            raise InvalidArgumentError(
                f"the state dict's masters are a {type(raw).__name__}, not a dict")
        masters: Dict[tuple, torch.Tensor] = {}
        for key, m in raw.items():
            parts = str(key).split(".")
            if len(parts) != 2 or not all(x.isdigit() for x in parts):
                raise InvalidArgumentError(
                    f"the state dict's master {key!r} is not named GROUP.INDEX")
            g, i = int(parts[0]), int(parts[1])
            if g >= len(self.param_groups) or i >= len(self.param_groups[g]["params"]):
                raise InvalidArgumentError(
                    f"the state dict has a master for param {key}, which this optimizer "
                    "does not have")
            p = self.param_groups[g]["params"][i]
            if p.dtype not in (torch.bfloat16, torch.float16):
                raise InvalidArgumentError(
                    f"the state dict has a master for param {key}, which is {p.dtype} here "
                    "(only bf16 and fp16 parameters have one)")
            if not isinstance(m, torch.Tensor) or tuple(m.shape) != tuple(p.shape):
                what = list(m.shape) if isinstance(m, torch.Tensor) else type(m).__name__
                raise InvalidArgumentError(
                    f"the state dict's master {key} is {what}, the parameter is shape "
                    f"{list(p.shape)}")
            masters[(g, i)] = m.to(device=p.device, dtype=torch.float32).contiguous()
        # torch's part next (it checks before it changes anything), the plugin's last: if
        # its import refuses the blob, torch's part is put back.
        old_state, old_groups = self.state, self.param_groups
        super().load_state_dict({"state": state_dict.get("state", {}), "param_groups": saved})
        # The script's masks stay (DeepSpeed's rule: a mask may change between stages, say
        # BERT's sequence length 128 then 512), whatever the checkpoint's groups held.
        for g, old in zip(self.param_groups, old_groups):
            g.pop("exp_avg_mask", None)
            if old.get("exp_avg_mask") is not None:
                g["exp_avg_mask"] = old["exp_avg_mask"]
        try:
            self.instance.import_state(bytes(entry["state"]))
        except BaseException:
            self.state, self.param_groups = old_state, old_groups
            raise
        self._step = step
        self._masters = masters

    def close(self) -> None:
        """Closes the session the optimizer opened for ``plugin=`` (a no-op for an
        instance passed in)."""
        for h in self._hooks:
            (h[1] if isinstance(h, tuple) else h).remove()
        self._hooks = []
        if self._session is not None:
            self._session.close()


# ---------------------------------------------------------------- token routing

class _Gather(torch.autograd.Function):
    """kept = full[b, indices[b, j]] through the router's gather; its adjoint (zeros, then
    scatter) in backward."""

    @staticmethod
    def forward(ctx, full, indices, instance):  # type: ignore[override]
        b, k = indices.shape
        kept = full.new_empty((b, k, full.shape[2]))
        instance.router_gather(full.detach(), kept, indices, _stream(full))
        ctx.save_for_backward(indices)
        ctx.instance = instance
        ctx.full_shape = full.shape
        return kept

    @staticmethod
    def backward(ctx, dkept):  # type: ignore[override]
        (indices,) = ctx.saved_tensors
        dfull = dkept.new_zeros(ctx.full_shape)
        ctx.instance.router_scatter(dfull, dkept.contiguous(), indices, _stream(dkept))
        return dfull, None, None


class _Scatter(torch.autograd.Function):
    """out = base with its kept positions replaced by kept, through the router's scatter;
    in backward the base's gradient is the output's with the kept positions zeroed, and the
    kept rows' gradient is gathered from the output's."""

    @staticmethod
    def forward(ctx, base, kept, indices, instance):  # type: ignore[override]
        out = base.detach().clone(memory_format=torch.contiguous_format)
        instance.router_scatter(out, kept.detach().contiguous(), indices, _stream(base))
        ctx.save_for_backward(indices)
        ctx.instance = instance
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        (indices,) = ctx.saved_tensors
        dout = dout.contiguous()
        b, k = indices.shape
        dkept = dout.new_empty((b, k, dout.shape[2]))
        ctx.instance.router_gather(dout, dkept, indices, _stream(dout))
        dbase = dout.clone()
        ctx.instance.router_scatter(dbase, dout.new_zeros((b, k, dout.shape[2])), indices,
                                    _stream(dout))
        return dbase, dkept, None, None


class _LearnedSelect(torch.autograd.Function):
    """A learned router's select: (gates, indices) from x and the scoring weight; in
    backward the router's own backward turns the gates' gradient into x's and the
    weight's."""

    @staticmethod
    def forward(ctx, x, weight, instance, args):  # type: ignore[override]
        b, n, c = x.shape
        k = args["kept"]
        indices = torch.empty((b, k), dtype=torch.int32, device=x.device)
        gates = x.new_empty((b, k))
        saved, saved_at = _buffer(args["saved_bytes"], x.device)
        ws, ws_at = _buffer(args["workspace_bytes"], x.device)
        xd, wd = x.detach(), weight.detach()
        instance.router_select(indices, seed=args["seed"], step=args["step"], batch=b,
                               seq_len=n, channels=c, layer=args["layer"],
                               num_layers=args["num_layers"], training=args["training"],
                               first_sample=args["first_sample"], x=xd, weight=wd,
                               gates=gates, saved=saved_at, saved_bytes=args["saved_bytes"],
                               workspace=ws_at, workspace_bytes=args["workspace_bytes"],
                               stream=_stream(x))
        del ws
        ctx.save_for_backward(xd, wd, indices)
        ctx.instance, ctx.args = instance, args
        ctx.saved, ctx.saved_at = saved, saved_at
        ctx.mark_non_differentiable(indices)
        return gates, indices

    @staticmethod
    def backward(ctx, dgates, _dindices):  # type: ignore[override]
        x, weight, indices = ctx.saved_tensors
        dx = torch.zeros_like(x, memory_format=torch.contiguous_format)
        dw = torch.zeros_like(weight, memory_format=torch.contiguous_format)
        ws, ws_at = _buffer(ctx.args["workspace_bytes"], x.device)
        ctx.instance.router_backward(x=x, weight=weight, indices=indices,
                                     dgates=dgates.contiguous(), dx=dx, dweight=dw,
                                     saved=ctx.saved_at, saved_bytes=ctx.args["saved_bytes"],
                                     workspace=ws_at,
                                     workspace_bytes=ctx.args["workspace_bytes"],
                                     stream=_stream(x))
        del ws
        return dx, dw, None, None


class Router(torch.nn.Module):
    """Runs ``layer`` on the tokens a ``loom.router/1`` router keeps (``random_ltd``:
    random layerwise token dropping; ``topk_router``: learned, Mixture-of-Depths style); the
    other tokens bypass it unchanged.

    At each call the router's plan gives the kept count for (step, layer, sequence length);
    select draws the kept positions (a pure function of seed, step, layer and sample, so
    data-parallel ranks and a resumed run choose the same ones); the kept rows are gathered
    into a ``[batch, kept, channels]`` tensor, ``layer`` runs on it, and its output is
    scattered over the kept positions of a copy of ``x``. Gradients flow through both
    moves (scatter is gather's adjoint), to ``x`` and to ``layer``'s parameters. In
    evaluation (``module.eval()``) a random router keeps every token.

    A learned router scores each token with ``weight`` (a ``[channels]`` parameter of this
    module, initialised to 0, of x's dtype: ``.double()`` the module for float64), keeps the
    best-scoring positions and gives each a gate ``g``; a kept token becomes
    ``x + g * (layer(x) - x)``. The router's backward gives ``weight`` and ``x`` the gates'
    gradient. Layers the router never routes get no weight and run on every token.

    Args:
        layer: the module routed; it maps ``[batch, kept, channels]`` to the same shape.
        instance: a router instance (``session.instance("router", NAME)``).
        layer_index: this layer's index in the model, 0 .. num_layers - 1.
        num_layers: the model's layer count.
        seed: the run's seed, the same on every rank.
        channels: a learned router's channel count (the size of ``weight``); required for
            one, ignored otherwise.

    Attributes:
        step (int): the training step the next forward routes for (1-based); the trainer
            sets it, or passes ``step=`` to forward.
        first_sample (int): this rank's offset in the global batch.
        last_indices (torch.Tensor | None): the kept positions of the last routed forward.
        last_gates (torch.Tensor | None): a learned router's gates of the last forward.
        learned (bool): whether the router is a learned one.
        weight (torch.nn.Parameter | None): a learned router's scoring weight.
    """

    def __init__(self, layer: torch.nn.Module, instance: Instance, layer_index: int,
                 num_layers: int, *, seed: int = 0, channels: Optional[int] = None) -> None:
        super().__init__()
        if not isinstance(instance, Instance) or instance.section != "router":
            raise InvalidArgumentError(
                f"loom.torch.Router needs a loom.router/1 instance, not {instance!r}")
        if not 0 <= layer_index < num_layers:
            raise InvalidArgumentError(
                f"layer_index {layer_index} is outside 0 .. num_layers - 1 ({num_layers - 1})")
        self.layer = layer
        self.instance = instance
        self.layer_index = int(layer_index)
        self.num_layers = int(num_layers)
        self.seed = int(seed)
        self.step = 1
        self.first_sample = 0
        self.last_indices: Optional[torch.Tensor] = None
        self.last_gates: Optional[torch.Tensor] = None
        # Whether the router is learned, and routes this layer at all: a plan over a long
        # sequence keeps a strict subset of a routed layer.
        try:
            probe = instance.router_plan(batch=1, seq_len=1 << 16, channels=channels or 1,
                                         step=1, layer=self.layer_index,
                                         num_layers=self.num_layers)
        except Exception:  # the forward's plan reports what is wrong
            probe = {"learned": False, "routed": False}
        self.learned = bool(probe["learned"])
        self.weight: Optional[torch.nn.Parameter] = None
        if self.learned and probe["routed"]:
            if not isinstance(channels, int) or channels < 1:
                raise InvalidArgumentError(
                    f"router.{instance.name} (plugin '{instance.plugin}') is a learned router: "
                    "pass channels= (the size of its scoring weight), not "
                    f"{channels!r}")
            self.weight = torch.nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor, step: Optional[int] = None,
                first_sample: Optional[int] = None) -> torch.Tensor:
        """``x``: ``[batch, seq_len, channels]`` with contiguous channels."""
        if x.dim() != 3:
            raise InvalidArgumentError(
                f"loom.torch.Router: x must be [batch, seq_len, channels], not shape "
                f"{list(x.shape)}")
        if x.dtype not in _DTYPES and x.dtype != torch.float64:
            raise InvalidArgumentError(f"loom.torch.Router: dtype {x.dtype} is not accepted")
        step = self.step if step is None else int(step)
        first = self.first_sample if first_sample is None else int(first_sample)
        b, n, c = x.shape
        dtype = "float64" if x.dtype == torch.float64 else _DTYPES[x.dtype]
        plan = self.instance.router_plan(batch=b, seq_len=n, channels=c, step=step,
                                         layer=self.layer_index, num_layers=self.num_layers,
                                         training=self.training, dtype=dtype)
        if plan["learned"]:
            return self._learned(x, plan, step, first)
        if not plan["routed"]:
            self.last_indices = None
            return self.layer(x)
        indices = torch.empty((b, plan["kept"]), dtype=torch.int32, device=x.device)
        workspace, holder = None, None
        if plan["workspace_bytes"] and x.is_cuda:
            holder = torch.empty(plan["workspace_bytes"] + 256, dtype=torch.uint8,
                                 device=x.device)
            workspace = (holder.data_ptr() + 255) // 256 * 256
        self.instance.router_select(indices, seed=self.seed, step=step, batch=b, seq_len=n,
                                    channels=c, layer=self.layer_index,
                                    num_layers=self.num_layers, training=self.training,
                                    first_sample=first, workspace=workspace,
                                    workspace_bytes=plan["workspace_bytes"], stream=_stream(x))
        del holder
        self.last_indices = indices
        kept = _Gather.apply(x, indices, self.instance)
        return _Scatter.apply(x, self.layer(kept), indices, self.instance)

    def _learned(self, x: torch.Tensor, plan: Dict[str, Any], step: int,
                 first: int) -> torch.Tensor:
        if self.weight is None:
            if not plan["routed"]:
                self.last_indices = self.last_gates = None
                return self.layer(x)
            raise InvalidArgumentError(
                f"router.{self.instance.name} routes layer {self.layer_index}, but this "
                "loom.torch.Router has no weight (construct it with channels=)")
        if self.weight.shape != (x.shape[2],):
            raise InvalidArgumentError(
                f"loom.torch.Router: x has {x.shape[2]} channels, the router weight "
                f"{list(self.weight.shape)}")
        # A layer with a weight selects even when it keeps every position (a gate per
        # position), so its weight has a gradient at every step.
        args = {"kept": plan["kept"], "saved_bytes": plan["saved_bytes"],
                "workspace_bytes": plan["workspace_bytes"], "seed": self.seed, "step": step,
                "layer": self.layer_index, "num_layers": self.num_layers,
                "training": self.training, "first_sample": first}
        gates, indices = _LearnedSelect.apply(x, self.weight, self.instance, args)
        self.last_indices, self.last_gates = indices, gates.detach()
        kept = _Gather.apply(x, indices, self.instance)
        update = kept + gates.unsqueeze(-1) * (self.layer(kept) - kept)
        return _Scatter.apply(x, update, indices, self.instance)
