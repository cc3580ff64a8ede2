"""loom.torch's Mixture of Experts: :class:`MoE`, a ``loom.moe/1`` layer as a
``torch.nn.Module`` (imported from :mod:`loom.torch`)."""
from typing import Any, Dict, List, Optional

import torch

from ._torch_common import _buffer, _stream
from .errors import InvalidArgumentError
from .session import Instance

_MOE_SHAPES = {
    # name -> shape from (E, E_l, M, H)
    "gate_w": lambda e, el, m, h: (e, m),
    "w1": lambda e, el, m, h: (el, h, m),
    "b1": lambda e, el, m, h: (el, h),
    "w2": lambda e, el, m, h: (el, m, h),
    "b2": lambda e, el, m, h: (el, m),
    "res_w1": lambda e, el, m, h: (h, m),
    "res_b1": lambda e, el, m, h: (h,),
    "res_w2": lambda e, el, m, h: (m, h),
    "res_b2": lambda e, el, m, h: (m,),
    "coef_w": lambda e, el, m, h: (2, m),
    "coef_b": lambda e, el, m, h: (2,),
}
_MOE_EXPERT_NAMES = ("w1", "b1", "w2", "b2")
_MOE_RESIDUAL_NAMES = ("res_w1", "res_b1", "res_w2", "res_b2", "coef_w", "coef_b")


# x's dtypes the moe plugin takes, by the plan's name for them
_MOE_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class _MoEFunction(torch.autograd.Function):
    """(y, aux) = the layer's forward over x and the weights; in backward the plugin's
    backward with aux_loss_coef = the gradient that reached aux (so a loss of
    task + coef * aux hands it coef), dx written and the weights' gradients accumulated
    from zero."""

    @staticmethod
    def forward(ctx, x, module, call, *weights):  # type: ignore[override]
        names = call["names"]
        xd = x.detach()
        # float32 parameters with a 16-bit x: the layer reads their rounding to x's dtype
        # (and its backward hands back float32 gradients, the plugin's mixed layout)
        wd = {n: w.detach().to(xd.dtype) for n, w in zip(names, weights)}
        y = torch.empty_like(xd, memory_format=torch.contiguous_format)
        saved, saved_at = _buffer(call["saved_bytes"], x.device)
        ws, ws_at = _buffer(call["workspace_bytes"], x.device)
        stats = module.instance.moe_forward(
            x=xd, weights=wd, y=y, hidden_dim=module.hidden_dim, seed=call["seed"],
            step=call["step"], first_token=call["first_token"],
            num_experts=module.num_experts_planned, layer=module.layer_index,
            num_layers=module.num_layers, training=call["training"],
            expert_bias=module.expert_bias if call["expert_bias"] else None,
            route_experts=call["route_experts"], route_weights=call["route_weights"],
            load_count=module.num_experts, saved=saved_at, saved_bytes=call["saved_bytes"],
            workspace=ws_at, workspace_bytes=call["workspace_bytes"], stream=_stream(x))
        del ws
        call["stats"] = stats
        ctx.module, ctx.call = module, call
        ctx.saved, ctx.saved_at = saved, saved_at
        ctx.save_for_backward(xd, *[wd[n] for n in names])
        aux = torch.tensor(stats["aux_loss"], dtype=torch.float32, device=x.device)
        ctx.grad_dtype = weights[0].dtype if weights else xd.dtype
        return y, aux

    @staticmethod
    def backward(ctx, dy, daux):  # type: ignore[override]
        module, call = ctx.module, ctx.call
        x, *weights = ctx.saved_tensors
        names = call["names"]
        wd = dict(zip(names, weights))
        grads = {n: torch.zeros_like(w, dtype=ctx.grad_dtype,
                                     memory_format=torch.contiguous_format)
                 for n, w in wd.items()}
        if dy is None:
            dy = torch.zeros_like(x)
        coef = 0.0 if daux is None else float(daux.detach().reshape(()).item())
        dx = torch.empty_like(x, memory_format=torch.contiguous_format)
        ws, ws_at = _buffer(call["workspace_bytes"], x.device)
        module.instance.moe_backward(
            x=x, weights=wd, dy=dy.contiguous(), dx=dx, grads=grads,
            hidden_dim=module.hidden_dim, saved=ctx.saved_at, saved_bytes=call["saved_bytes"],
            seed=call["seed"], step=call["step"], first_token=call["first_token"],
            num_experts=module.num_experts_planned, layer=module.layer_index,
            num_layers=module.num_layers, training=call["training"], aux_loss_coef=coef,
            workspace=ws_at, workspace_bytes=call["workspace_bytes"], stream=_stream(x))
        del ws  # the saved buffer stays with ctx: a retained graph may run backward again
        return (dx, None, None) + tuple(grads[n] for n in names)


class MoE(torch.nn.Module):
    """A ``loom.moe/1`` Mixture-of-Experts layer (the plugin ``moe``: DeepSpeed's top-k
    gating with capacity, noise, random token selection, PR-MoE, aux-loss-free balancing)
    as a ``torch.nn.Module`` whose weights are this module's Parameters.

    ``forward(x)`` returns ``(y, aux)``: ``y`` has x's shape and dtype, ``aux`` is the
    layer's load-balancing loss (a 0-dim float32 tensor, before any coefficient). x may be
    float32, bfloat16 or float16: with parameters of x's dtype (``module.bfloat16()``) the
    gradients are of that dtype too; with float32 parameters and a 16-bit x the layer reads
    the parameters rounded to x's dtype and their gradients stay float32 (mixed precision:
    float32 masters, 16-bit compute). Add aux to the loss with
    your coefficient, ``loss = task + 0.01 * aux``: autograd hands the plugin's backward
    the gradient that reaches ``aux`` as its ``aux_loss_coef``, so the coefficient is
    whatever you multiplied by (0 when aux is not used). The gate, the experts and (PR-MoE)
    the residual MLP and its coefficient get their gradients through the plugin's
    backward; the routing itself (which expert, what was dropped) is discrete.

    Parameters, for E experts (E_l = E / ep_size of them on this rank), model width M and
    expert width H: ``gate_w`` [E, M]; ``w1`` [E_l, H, M], ``b1`` [E_l, H], ``w2``
    [E_l, M, H], ``b2`` [E_l, M]; with ``use_residual``: ``res_w1`` [H, M], ``res_b1`` [H],
    ``res_w2`` [M, H], ``res_b2`` [M], ``coef_w`` [2, M], ``coef_b`` [2]. With
    ``bias_update_rate > 0`` the buffer ``expert_bias`` [E] (float32, in the state dict) is
    the aux-loss-free balancing state, updated by each training forward.

    The routing is a pure function of (x, gate_w, expert_bias, seed, step, layer,
    first_token): set ``step`` (1-based, the training step) and ``first_token`` (this
    rank's offset in the global batch) as the trainer goes, or pass them to forward.
    ``module.eval()`` routes with the eval capacity factor and no noise.

    Expert parallelism: give the instance ``ep_size`` and a ``comm`` in its manifest and
    open the session over the ranks (``loom.Session(..., bootstrap=
    loom.torch.distributed_bootstrap())``); the module then holds its rank's E_l experts
    and the forward and backward exchange tokens over the comm (every rank of an
    expert-parallel group calls them in the same order). Average the expert gradients
    with :meth:`reduce_gradients` (over the expert-data-parallel group) and every other
    gradient over the world as usual (not with DDP over the expert parameters).

    Args:
        instance: a moe instance (``session.instance("moe", NAME)``).
        model_dim: M, the features of a token.
        hidden_dim: H, each expert's hidden width (default 4 * M).
        num_experts: E for this layer (0: the instance's ``num_experts``).
        layer_index, num_layers: this layer's place in the model (noise counters).
        seed: the run's seed, the same on every rank.
        init_std: None (the default) initialises like ``torch.nn.Linear``; a number draws
            every weight from N(0, init_std) and the biases as 0.

    Attributes:
        step, first_token (int): the counters of the next forward.
        last_stats (dict | None): after each forward: ``aux_loss`` (float), ``dropped``
            (choices dropped by capacity), ``expert_rows`` (rows this rank's experts
            ran), ``load`` (torch.int64 [E]: choices per expert before capacity).
        last_route_experts, last_route_weights (torch.Tensor | None): the last forward's
            routing ([S, k] int32 experts, -1 dropped; float32 combine weights), with
            ``keep_routing=True``.
        plan (dict): the instance's plan for this layer (experts, local_experts, top_k,
            ep_size, ep_rank, flags ...).
    """

    def __init__(self, instance: Instance, model_dim: int, hidden_dim: Optional[int] = None,
                 *, num_experts: int = 0, layer_index: int = 0, num_layers: int = 1,
                 seed: int = 0, init_std: Optional[float] = None,
                 keep_routing: bool = False) -> None:
        super().__init__()
        if not isinstance(instance, Instance) or instance.section != "moe":
            raise InvalidArgumentError(
                f"loom.torch.MoE needs a loom.moe/1 instance (session.instance('moe', NAME)), "
                f"not {instance!r}")
        if not isinstance(model_dim, int) or model_dim < 1:
            raise InvalidArgumentError(f"model_dim must be an int >= 1, not {model_dim!r}")
        hidden_dim = 4 * model_dim if hidden_dim is None else hidden_dim
        if not isinstance(hidden_dim, int) or hidden_dim < 1:
            raise InvalidArgumentError(f"hidden_dim must be an int >= 1, not {hidden_dim!r}")
        if not 0 <= layer_index < num_layers:
            raise InvalidArgumentError(
                f"layer_index {layer_index} is outside 0 .. num_layers - 1 ({num_layers - 1})")
        self.instance = instance
        self.model_dim, self.hidden_dim = int(model_dim), int(hidden_dim)
        self.num_experts_planned = int(num_experts)
        self.layer_index, self.num_layers = int(layer_index), int(num_layers)
        self.seed = int(seed)
        self.step = 1
        self.first_token = 0
        self.keep_routing = bool(keep_routing)
        self.last_stats: Optional[Dict[str, Any]] = None
        self.last_route_experts: Optional[torch.Tensor] = None
        self.last_route_weights: Optional[torch.Tensor] = None
        self.plan = instance.moe_plan(tokens=1, model_dim=self.model_dim,
                                      hidden_dim=self.hidden_dim, num_experts=int(num_experts),
                                      layer=self.layer_index, num_layers=self.num_layers)
        self.num_experts = self.plan["experts"]
        self.local_experts = self.plan["local_experts"]
        self.top_k = self.plan["top_k"]
        e, el, m, h = self.num_experts, self.local_experts, self.model_dim, self.hidden_dim
        self._names = ["gate_w", *_MOE_EXPERT_NAMES]
        if self.plan["residual"]:
            self._names += list(_MOE_RESIDUAL_NAMES)
        for n in self._names:
            self.register_parameter(n, torch.nn.Parameter(torch.empty(_MOE_SHAPES[n](e, el, m, h))))
        if self.plan["expert_bias"]:
            self.register_buffer("expert_bias", torch.zeros(e, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.reset_parameters(init_std)

    @torch.no_grad()
    def reset_parameters(self, init_std: Optional[float] = None) -> None:
        """Initialises the weights: as ``torch.nn.Linear`` does (uniform within
        1/sqrt(fan_in), per expert) by default, or N(0, init_std) with zero biases."""
        for n in self._names:
            p = getattr(self, n)
            if init_std is not None:
                if n.startswith("b") or n.endswith("_b") or n.startswith("res_b"):
                    p.zero_()
                else:
                    p.normal_(0.0, float(init_std))
                continue
            fan_in = {"gate_w": self.model_dim, "w1": self.model_dim, "b1": self.model_dim,
                      "w2": self.hidden_dim, "b2": self.hidden_dim,
                      "res_w1": self.model_dim, "res_b1": self.model_dim,
                      "res_w2": self.hidden_dim, "res_b2": self.hidden_dim,
                      "coef_w": self.model_dim, "coef_b": self.model_dim}[n]
            bound = 1.0 / fan_in ** 0.5
            p.uniform_(-bound, bound)

    def expert_parameters(self) -> List[torch.nn.Parameter]:
        """The parameters that belong to this rank's experts (w1, b1, w2, b2): average
        their gradients with :meth:`reduce_gradients`, the others over the world."""
        return [getattr(self, n) for n in _MOE_EXPERT_NAMES]

    def reduce_gradients(self) -> None:
        """Averages the expert parameters' gradients over the expert-data-parallel group
        (the plugin's ``reduce_gradients``; the world average with ep_size 1)."""
        grads = [p.grad for p in self.expert_parameters() if p.grad is not None]
        if grads:
            self.instance.moe_reduce_gradients(grads, _stream(grads[0]))

    def forward(self, x: torch.Tensor, step: Optional[int] = None,
                first_token: Optional[int] = None) -> tuple:
        """``x``: ``[..., model_dim]`` float32, bfloat16 or float16 (the tokens of this
        rank, flattened over the leading dimensions). Returns ``(y, aux)``."""
        if x.dim() < 1 or x.shape[-1] != self.model_dim:
            raise InvalidArgumentError(
                f"loom.torch.MoE: x must be [..., {self.model_dim}] (model_dim), not shape "
                f"{list(x.shape)}")
        if x.dtype not in _MOE_DTYPES:
            raise InvalidArgumentError(
                f"loom.torch.MoE: x is {x.dtype}; the moe plugin takes float32, bfloat16 or "
                "float16")
        first_dtype = getattr(self, self._names[0]).dtype
        for n in self._names:
            p = getattr(self, n)
            if p.device != x.device or p.dtype != first_dtype or \
                    p.dtype not in (x.dtype, torch.float32):
                raise InvalidArgumentError(
                    f"loom.torch.MoE: parameter {n} is {p.dtype} on {p.device}, x is "
                    f"{x.dtype} on {x.device} (the parameters are all x's dtype, or all "
                    "float32, on x's device)")
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            raise InvalidArgumentError(
                f"loom.torch.MoE: expert_bias is {self.expert_bias.dtype}; the balancing "
                "state stays float32")
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.model_dim)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        tokens = flat.shape[0]
        step = self.step if step is None else int(step)
        first = self.first_token if first_token is None else int(first_token)
        plan = self.instance.moe_plan(tokens=max(1, tokens), model_dim=self.model_dim,
                                      hidden_dim=self.hidden_dim,
                                      num_experts=self.num_experts_planned,
                                      layer=self.layer_index, num_layers=self.num_layers,
                                      training=self.training, dtype=_MOE_DTYPES[x.dtype])
        route_e = route_w = None
        if self.keep_routing:
            route_e = torch.empty((tokens, self.top_k), dtype=torch.int32, device=x.device)
            route_w = torch.empty((tokens, self.top_k), dtype=torch.float32, device=x.device)
        call = {"names": self._names, "saved_bytes": plan["saved_bytes"],
                "workspace_bytes": plan["workspace_bytes"], "seed": self.seed, "step": step,
                "first_token": first, "training": self.training,
                "expert_bias": self.expert_bias is not None,
                "route_experts": route_e, "route_weights": route_w}
        y, aux = _MoEFunction.apply(flat, self, call, *[getattr(self, n) for n in self._names])
        stats = dict(call["stats"])
        stats["load"] = torch.tensor(stats["load"], dtype=torch.int64)
        self.last_stats = stats
        self.last_route_experts, self.last_route_weights = route_e, route_w
        return y.reshape(*lead, self.model_dim), aux

    def _apply(self, fn, *args, **kwargs):  # type: ignore[override]
        # module.to(dtype) / .bfloat16() convert the parameters; the balancing state stays
        # float32 (rounding it would lose the small steps it moves by)
        bias = self.expert_bias
        out = super()._apply(fn, *args, **kwargs)
        if bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias = bias.to(device=self.expert_bias.device)
        return out

    def extra_repr(self) -> str:
        return (f"moe.{self.instance.name}: experts={self.num_experts} "
                f"(local {self.local_experts}), k={self.top_k}, model_dim={self.model_dim}, "
                f"hidden_dim={self.hidden_dim}, residual={self.plan['residual']}")
