"""Sessions (an opened manifest) and their instances."""

import ctypes
import json
import math
import os
import sys
import weakref
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

from . import _abi
from ._lib import lib
from .bootstrap import Bootstrap
from .errors import (FailedPreconditionError, InvalidArgumentError, UnimplementedError,
                     check)
from ._curriculum import CurriculumCalls
from ._quantizer import QuantizerCalls, QuantLayout  # noqa: F401 (loom.session.QuantLayout)
from .tensor import Borrowed, borrow
from .tensor import host_workspace as _host_workspace

PathLike = Union[str, os.PathLike]

# Manifest section -> kind ID, from the kind headers' LOOM_KIND_* (loom.optimizer/1 ...).
KINDS = {n[len("KIND_"):].lower(): v for n, v in vars(_abi).items() if n.startswith("KIND_")}
# loom_log_level by name, and "off" as the CLI spells it (above every level).
_LOG_LEVELS = {name: v for v, name in sorted(_abi.LOG_LEVEL_NAMES.items())}
_LOG_LEVELS["off"] = max(_abi.LOG_LEVEL_NAMES) + 1
# loom_moe_weights' tensors, in field order (after struct_size and reserved).
_MOE_WEIGHT_NAMES = tuple(n for n, _t in _abi.MoeWeights._fields_[2:])


def _b(s: Optional[PathLike], what: str = "argument", path: bool = False) -> Optional[bytes]:
    """``s`` as a C string for libloom (``path``: encoded as the OS encodes file names). A NUL
    in it is refused: C would read only what comes before it, silently (a name or a path cut
    short)."""
    if s is None:
        return None
    raw = os.fsencode(s) if path or isinstance(s, os.PathLike) else s.encode()
    at = raw.find(b"\0")
    if at >= 0:
        # A long one is shown around the NUL, so the message stays short and still points.
        lo, hi = max(0, at - 48), min(len(raw), at + 16)
        shown = ("..." if lo else "") + os.fsdecode(raw[lo:hi]) + ("..." if hi < len(raw) else "")
        raise InvalidArgumentError(
            f"{what} {shown!r} contains a NUL character (U+0000) at byte {at}; libloom takes "
            f"a C string, which would end there")
    return raw


def _manifest_text(text: str, origin: str) -> bytes:
    """The manifest ``text`` as UTF-8 for libloom. A NUL is refused, with the line and column
    the CLI would give for it in a file (TOML allows no control character but TAB): libloom
    takes a C string and would silently ignore everything after it."""
    at = text.find("\0")
    if at >= 0:
        line = text.count("\n", 0, at) + 1
        col = at - (text.rfind("\n", 0, at) + 1) + 1
        more = text.count("\0") - 1
        raise InvalidArgumentError(
            f"{origin}:{line}:{col}: TOML syntax error: a NUL character (U+0000); control "
            f"characters other than TAB (U+0009) are prohibited"
            + (f" ({more} more NUL characters follow)" if more else ""))
    return text.encode("utf-8")


def _s(raw: Optional[bytes]) -> str:
    return "" if raw is None else raw.decode("utf-8", errors="replace")


def _options(plugin_path: Union[None, str, Sequence[str]], validate_only: bool,
             log_level: Union[None, str, int], bootstrap: Any = None) -> _abi.OpenOptions:
    o = _abi.OpenOptions()
    o.struct_size = _abi.OPEN_OPTIONS_SIZE
    o.validate_only = 1 if validate_only else 0
    if plugin_path is not None and not isinstance(plugin_path, str):
        plugin_path = ":".join(os.fspath(p) for p in plugin_path)
    o.plugin_path = _b(plugin_path, "plugin_path", path=True) if plugin_path else None
    if bootstrap is not None and not isinstance(bootstrap, Bootstrap):
        raise InvalidArgumentError(
            f"bootstrap must be a loom.Bootstrap (e.g. loom.torch.distributed_bootstrap()), "
            f"not {type(bootstrap).__name__}")
    o.bootstrap = ctypes.cast(bootstrap.pointer, ctypes.POINTER(_abi.Bootstrap)) \
        if bootstrap is not None else None
    if log_level is None:
        o.log_level = -1
    elif isinstance(log_level, str):
        if log_level not in _LOG_LEVELS:
            raise InvalidArgumentError(
                f"log_level '{log_level}' is not one of {', '.join(_LOG_LEVELS)}")
        o.log_level = _LOG_LEVELS[log_level]
    else:
        o.log_level = int(log_level)
    o.reserved = 0
    return o


def version() -> str:
    """libloom's version string, e.g. "0.1.0"."""
    return _s(lib().loom_version())


def abi_version() -> tuple:
    """The plugin ABI libloom speaks, as (major, minor)."""
    return (lib().loom_abi_major(), lib().loom_abi_minor())


def thread_count() -> int:
    """The threads of the process's pool (libloom's, which every plugin's kernels use), the
    caller's included: LOOM_NUM_THREADS when set, else the cores divided among this
    machine's ranks."""
    return int(lib().loom_thread_count())


def set_thread_count(threads: int) -> None:
    """Resizes the process's pool for every session and plugin (0: the default above)."""
    if not isinstance(threads, int) or threads < 0:
        raise InvalidArgumentError(f"threads must be an integer >= 0, not {threads!r}")
    check(lib().loom_set_thread_count(threads))


def abort_job(status: int = 1) -> None:
    """Ends this process and its job after an error only this rank saw (docs/embedding.md).

    Under mpirun, MPI_Abort (the launcher ends every rank, a stopped one too); under the env
    bootstrap, SIGKILL to the job's other processes on this host. Exit handlers are not run
    (MPI's would wait for the other ranks). Never returns.
    """
    if not isinstance(status, int) or not 0 <= status <= 255:
        raise InvalidArgumentError(f"status must be an integer in 0..255, not {status!r}")
    sys.stdout.flush()
    sys.stderr.flush()
    lib().loom_abort_job(status)


def describe_plugins(name: Optional[str] = None,
                     plugin_path: Union[None, str, Sequence[str]] = None) -> Dict[str, Any]:
    """Plugins on the search path and their parameter schemas, as ``loom describe --json``.

    Args:
        name: one plugin ("adam"), or None for every plugin found.
        plugin_path: extra folders searched first (a ':'-separated string or a list).

    Returns:
        dict: {"search_path": [...], "plugins": [{"name", "version", "description", "abi",
        "path", "kinds": [{"kind", "params": [...]}]}], "errors": [...]}.

    Raises:
        NotFoundError: ``name`` is not on the search path.
    """
    if plugin_path is not None and not isinstance(plugin_path, str):
        plugin_path = ":".join(os.fspath(p) for p in plugin_path)
    out = ctypes.c_void_p()
    path = _b(plugin_path, "plugin_path", path=True) if plugin_path else None
    check(lib().loom_describe_plugins(_b(name, "name"), path, ctypes.byref(out)))
    try:
        return json.loads(ctypes.string_at(out.value).decode("utf-8"))
    finally:
        lib().loom_free_string(out)


class Session:
    """An opened manifest: its plugins loaded, parameters validated, instances created.

    Open a file with ``Session("run.toml")`` or TOML text with
    ``Session.from_string(text)``. Use it as a context manager, or call :meth:`close`;
    closing destroys every instance (in reverse creation order) and invalidates the
    :class:`Instance` objects taken from it.

    Args:
        manifest: path of the manifest file.
        plugin_path: extra plugin folders (a ':'-separated string or a list), searched
            after the manifest's ``plugin_path`` and before ``LOOM_PLUGIN_PATH``.
        validate_only: parse, load the plugins and validate, but create no instance
            (what ``loom check`` does).
        log_level: "trace", "debug", "info", "warn", "error", "off", or None for the
            manifest's ``log_level`` (``LOOM_LOG_LEVEL`` overrides either).
        bootstrap: this rank's :class:`loom.Bootstrap` (for example
            :func:`loom.torch.distributed_bootstrap`, over torch.distributed), or None: the
            host picks one from the launcher's environment (a world of one outside a job).
            The session keeps it alive while open.

    Raises:
        InvalidArgumentError: the manifest is invalid; the message has one
            ``FILE:LINE:COL: message`` line per problem.
        NotFoundError, UnavailableError, ...: see :mod:`loom.errors`.

    Example::

        with loom.Session("run.toml") as s:
            opt = s.instance("optimizer", "main")
            print(opt.plugin, s.describe())
    """

    def __init__(self, manifest: PathLike, *, plugin_path: Union[None, str, Sequence[str]] = None,
                 validate_only: bool = False, log_level: Union[None, str, int] = None,
                 bootstrap: Optional[Bootstrap] = None) -> None:
        self._handle = ctypes.c_void_p()
        self._bootstrap = bootstrap
        self._instances: "weakref.WeakSet[Instance]" = weakref.WeakSet()
        self.origin = os.fspath(manifest)
        self.validate_only = bool(validate_only)
        opts = _options(plugin_path, validate_only, log_level, bootstrap)
        check(lib().loom_open_file(_b(self.origin, "manifest path", path=True), ctypes.byref(opts),
                                   ctypes.byref(self._handle)))

    @classmethod
    def from_string(cls, text: str, origin: Optional[str] = None, *,
                    plugin_path: Union[None, str, Sequence[str]] = None,
                    validate_only: bool = False,
                    log_level: Union[None, str, int] = None,
                    bootstrap: Optional[Bootstrap] = None) -> "Session":
        """Opens a manifest given as TOML text.

        Args:
            text: the manifest.
            origin: the name messages give it, as a file name would (None: "<string>");
                relative ``plugin_path`` entries resolve against its folder.
            plugin_path, validate_only, log_level, bootstrap: as for :class:`Session`.

        Raises:
            InvalidArgumentError: as for :class:`Session`; also for a NUL character in
                ``text`` (``ORIGIN:LINE:COL``, as the host reports one in a file).
        """
        self = cls.__new__(cls)
        self._handle = ctypes.c_void_p()
        self._bootstrap = bootstrap
        self._instances = weakref.WeakSet()
        self.origin = origin or "<string>"
        self.validate_only = bool(validate_only)
        opts = _options(plugin_path, validate_only, log_level, bootstrap)
        check(lib().loom_open_string(_manifest_text(text, self.origin), _b(origin, "origin"),
                                     ctypes.byref(opts),
                                     ctypes.byref(self._handle)))
        return self

    # -- lifetime
    def close(self) -> None:
        """Destroys every instance; the session and its Instance objects are unusable
        afterwards. Closing twice is a no-op."""
        if getattr(self, "_handle", None) is not None and self._handle.value:
            for inst in list(self._instances):
                inst._handle = None
            lib().loom_close(self._handle)
            self._handle = ctypes.c_void_p()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing useful to do
            pass

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return not self._handle.value

    def _live(self) -> ctypes.c_void_p:
        if not self._handle.value:
            raise FailedPreconditionError(f"session {self.origin} is closed")
        return self._handle

    # -- instances
    def __len__(self) -> int:
        return int(lib().loom_instance_count(self._live()))

    def __iter__(self) -> Iterator["Instance"]:
        return iter(self.instances)

    @property
    def instances(self) -> List["Instance"]:
        """Every instance, in creation (dependency) order."""
        h = self._live()
        out = []
        for i in range(lib().loom_instance_count(h)):
            out.append(self._wrap(lib().loom_instance_at(h, i)))
        return out

    def instance(self, kind: str, name: str) -> "Instance":
        """The instance declared as ``[KIND.NAME]``.

        Args:
            kind: a manifest section ("optimizer") or a kind ID ("loom.optimizer/1").
            name: the instance's name.

        Raises:
            NotFoundError: no such instance (the message lists what there is).
            InvalidArgumentError: an unknown kind.
        """
        out = ctypes.c_void_p()
        check(lib().loom_find_instance(self._live(), _b(kind, "kind"), _b(name, "name"),
                                       ctypes.byref(out)))
        return self._wrap(out.value)

    def optimizer(self, name: str = "main") -> "Instance":
        """Shorthand for ``instance("optimizer", name)``."""
        return self.instance("optimizer", name)

    def _wrap(self, handle: Optional[int]) -> "Instance":
        if not handle:
            check(lib().loom_last_error_code() or _abi.INTERNAL)
        inst = Instance(self, handle)
        self._instances.add(inst)
        return inst

    def describe(self) -> List[Dict[str, Any]]:
        """The session's instances: for each, its section, name, kind ID and plugin.

        Returns:
            list[dict]: [{"section": "optimizer", "name": "main", "kind":
            "loom.optimizer/1", "plugin": "adam"}, ...] in creation order.
        """
        return [i.describe() for i in self.instances]

    def __repr__(self) -> str:
        if self.closed:
            return f"<loom.Session {self.origin} (closed)>"
        names = ", ".join(f"{d['section']}.{d['name']}" for d in self.describe())
        return f"<loom.Session {self.origin}: {names}>"


class PendingStep:
    """A step announced to the optimizer gradient by gradient (:meth:`Instance.begin_step`)."""

    def __init__(self, instance: "Instance", args: Any, keep: List[Any], tensors: List[Any],
                 found_inf: Any) -> None:
        self._instance = instance
        self._args = args
        self._keep = keep
        self._tensors = tensors
        self._first = [0]
        for ts in tensors[:-1]:
            self._first.append(self._first[-1] + len(ts))
        self._found_inf = found_inf  # the args point at it: alive as long as they are

    def ready(self, group: int, index: int, grad: Any) -> None:
        """Tensor ``index`` of group ``group`` has its final gradient ``grad`` (the one the
        step will get): the optimizer may start exchanging it.

        Raises:
            FailedPreconditionError: from an optimizer that started exchanging, when the
                tensor was announced already in this step (a second backward before the
                step); the optimizer then drops the step in progress, state as before.
        """
        bg = borrow(grad, f"groups[{group}].grads[{index}]",
                    dtypes=("float32", "bfloat16", "float16"))
        self._keep.append(bg)
        self._tensors[group][index].grad = bg.pointer
        r = _abi.OptimizerReadyArgs()
        r.struct_size = _abi.OPTIMIZER_READY_ARGS_SIZE
        r.step = ctypes.pointer(self._args)
        r.first = self._first[group] + index
        r.count = 1
        check(lib().loom_optimizer_grads_ready(self._instance._live(), ctypes.byref(r)))


class Instance(CurriculumCalls, QuantizerCalls):
    """One instance of a session (``[KIND.NAME]``), valid until its session closes.

    Attributes:
        session (Session): the session it belongs to.
        name (str): its name in the manifest.
        kind (str): its kind ID ("loom.optimizer/1").
        section (str): its manifest section ("optimizer").
        plugin (str): the plugin that implements it ("adam").
    """

    def __init__(self, session: Session, handle: int) -> None:
        self.session = session
        self._handle: Optional[int] = handle
        h = lib()
        self.name = _s(h.loom_instance_name(handle))
        self.kind = _s(h.loom_instance_kind(handle))
        self.plugin = _s(h.loom_instance_plugin(handle))
        self.section = next((s for s, k in KINDS.items() if k == self.kind),
                            self.kind.split(".")[-1].split("/")[0])

    def _live(self) -> int:
        if not self._handle:
            raise FailedPreconditionError(
                f"{self.section}.{self.name}: its session {self.session.origin} is closed")
        return self._handle

    def describe(self) -> Dict[str, str]:
        """{"section", "name", "kind", "plugin"} of this instance."""
        return {"section": self.section, "name": self.name, "kind": self.kind,
                "plugin": self.plugin}

    def schema(self) -> List[Dict[str, Any]]:
        """The plugin's parameters for this kind (name, type, default, range, doc), as
        ``loom describe PLUGIN --json`` lists them."""
        doc = describe_plugins(self.plugin)
        for p in doc.get("plugins", []):
            for k in p.get("kinds", []):
                if k.get("kind") == self.kind:
                    return list(k.get("params", []))
        return []

    # -- state
    def export_state(self) -> bytes:
        """Everything a restart needs, as the plugin's versioned blob (b"" when the plugin
        keeps no state)."""
        h = self._live()
        size = ctypes.c_size_t()
        check(lib().loom_instance_export_state(h, None, 0, ctypes.byref(size)))
        if size.value == 0:
            return b""
        buf = ctypes.create_string_buffer(size.value)
        check(lib().loom_instance_export_state(h, buf, size.value, ctypes.byref(size)))
        return buf.raw[:size.value]

    def import_state(self, blob: bytes) -> None:
        """Restores a blob :meth:`export_state` wrote. A foreign, truncated or damaged
        blob raises (DataLossError or InvalidArgumentError) and changes nothing."""
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise InvalidArgumentError(
                f"{self.section}.{self.name}: state must be bytes, not {type(blob).__name__}")
        data = bytes(blob)
        check(lib().loom_instance_import_state(self._live(), data, len(data)))

    # -- loom.optimizer/1
    def _require(self, section: str) -> None:
        if self.section != section:
            raise InvalidArgumentError(
                f"{self.section}.{self.name} is a {self.kind} instance, not a "
                f"{KINDS[section]} one")

    def step(self, groups: Sequence[Dict[str, Any]], lr: float, *, grad_scale: float = 1.0,
             step: int = 0, stream: Optional[int] = None) -> bool:
        """One optimizer step (loom.optimizer/1), updating the parameters in place.

        Args:
            groups: parameter groups, each a dict with "params" and "grads" (equal-length
                lists of DLPack tensors: fp32, or bf16/fp16 params with "masters", fp32
                copies), and optionally "lr_scale" (default 1.0), "weight_decay" (None:
                the instance's), "non_freeze" (bool) and "exp_avg_mask" (a list with a
                tensor or None per param). Pass the same groups, shapes and order on
                every step: the optimizer keys its state by position.
            lr: the step's learning rate.
            grad_scale: gradients are divided by it (loss scaling).
            step: the trainer's 1-based global step (informational).
            stream: a cudaStream_t (as an int) for CUDA tensors, None for CPU ones.

        Returns:
            bool: True when the step was skipped for a non-finite gradient (parameters and
            state unchanged).

        Raises:
            InvalidArgumentError: a tensor of the wrong dtype, device or layout (checked
                here, before Loom), or a shape the plugin refuses; nothing is changed.
        """
        self._require("optimizer")
        args, keep, _, found_inf = self._step_args(groups, lr, grad_scale, step, stream)
        check(lib().loom_optimizer_step(self._live(), ctypes.byref(args)))
        del keep
        return bool(found_inf.value)

    def begin_step(self, groups: Sequence[Dict[str, Any]], *, grad_scale: float = 1.0,
                   step: int = 0, stream: Optional[int] = None) -> "PendingStep":
        """The coming step, announced gradient by gradient while the backward runs
        (``loom_optimizer_grads_ready``, ABI 1.6), so an optimizer that exchanges the
        gradients itself (the 1-bit family with ``bucket_mb``) starts early. ``groups`` as for
        :meth:`step`; a gradient not computed yet may be any tensor of its shape and dtype (it
        is not read before :meth:`PendingStep.ready` gives the real one). Then call
        :meth:`step` with the same groups, grad_scale, step and stream: the outcome is the
        bits of that step alone.

        :meth:`PendingStep.ready` raises UnimplementedError when the optimizer has no
        ``grads_ready`` (its step does it all).
        """
        self._require("optimizer")
        args, keep, tensors, found_inf = self._step_args(groups, 0.0, grad_scale, step, stream)
        return PendingStep(self, args, keep, tensors, found_inf)

    def _step_args(self, groups: Sequence[Dict[str, Any]], lr: float, grad_scale: float,
                   step: int, stream: Optional[int]) -> tuple:
        """The step's args struct, the borrowed capsules it points into (keep them alive while
        it is used), its tensor arrays by group, and its found_inf out-field."""
        keep: List[Borrowed] = []  # the capsules, alive while the args are used
        g_arr = (_abi.OptimizerGroup * max(1, len(groups)))()
        t_arrays = []
        for gi, g in enumerate(groups):
            params = list(g.get("params", []))
            grads = list(g.get("grads", []))
            masters = g.get("masters")
            masks = g.get("exp_avg_mask")
            if len(grads) != len(params):
                raise InvalidArgumentError(
                    f"groups[{gi}]: {len(params)} params but {len(grads)} grads")
            for label, extra in (("masters", masters), ("exp_avg_mask", masks)):
                if extra is not None and len(extra) != len(params):
                    raise InvalidArgumentError(
                        f"groups[{gi}]: {len(params)} params but {len(extra)} {label}")
            ts = (_abi.OptimizerTensor * max(1, len(params)))()
            for ti, p in enumerate(params):
                where = f"groups[{gi}]"
                master = masters[ti] if masters is not None else None
                pdt = ("bfloat16", "float16") if master is not None else ("float32",)
                bp = borrow(p, f"{where}.params[{ti}]", dtypes=pdt)
                bg = borrow(grads[ti], f"{where}.grads[{ti}]",
                            dtypes=("float32", "bfloat16", "float16"))
                ts[ti].struct_size = _abi.OPTIMIZER_TENSOR_SIZE
                ts[ti].param = bp.pointer
                ts[ti].grad = bg.pointer
                keep += [bp, bg]
                if master is not None:
                    bm = borrow(master, f"{where}.masters[{ti}]")
                    ts[ti].master = bm.pointer
                    keep.append(bm)
                mask = masks[ti] if masks is not None else None
                if mask is not None:
                    bk = borrow(mask, f"{where}.exp_avg_mask[{ti}]")
                    ts[ti].exp_avg_mask = bk.pointer
                    keep.append(bk)
            t_arrays.append(ts)
            gr = g_arr[gi]
            gr.struct_size = _abi.OPTIMIZER_GROUP_SIZE
            gr.tensors = ts
            gr.tensor_count = len(params)
            gr.lr_scale = float(g.get("lr_scale", 1.0))
            wd = g.get("weight_decay")
            gr.weight_decay = math.nan if wd is None else float(wd)
            gr.flags = _abi.OPTIMIZER_GROUP_NON_FREEZE if g.get("non_freeze") else 0
        found_inf = ctypes.c_int32(0)
        args = _abi.OptimizerStepArgs()
        args.struct_size = _abi.OPTIMIZER_STEP_ARGS_SIZE
        args.groups = g_arr
        args.group_count = len(groups)
        args.lr = float(lr)
        args.grad_scale = float(grad_scale)
        args.step = int(step)
        args.stream = stream
        args.found_inf = ctypes.pointer(found_inf)
        keep.append(g_arr)  # type: ignore[arg-type]
        return args, keep, t_arrays, found_inf

    def comm_info(self) -> Dict[str, int]:
        """What an optimizer communicated on its own (the 1-bit family) and the steps it
        skipped: {"owns_communication", "bytes_sent", "bytes_received", "rounds",
        "uncompressed_bytes_sent", "skipped_steps", "comm_wait_ns"}."""
        self._require("optimizer")
        info = _abi.OptimizerCommInfo()
        info.struct_size = _abi.OPTIMIZER_COMM_INFO_SIZE
        check(lib().loom_optimizer_get_comm_info(self._live(), ctypes.byref(info)))
        return {name: int(getattr(info, name)) for name, _ in info._fields_[1:]}

    # -- loom.sampler/1
    def _table(self, section: str, min_size: int, struct: Any) -> tuple:
        obj = ctypes.c_void_p()
        table = ctypes.c_void_p()
        check(lib().loom_instance_table(self._live(), section.encode(), min_size,
                                        ctypes.byref(obj), ctypes.byref(table)))
        return obj, struct.from_address(table.value)

    def _call(self, status: Optional[int]) -> None:
        check(lib().loom_instance_take_status(self._live(), status, None, 0))

    def sampler_plan(self, dataset_size: int, global_batch: int, world_size: int = 1) -> int:
        """Fixes a sampler's sizes (loom.sampler/1 ``plan``) and returns its capacity: the
        most sample ids one rank gets per step.

        Args:
            dataset_size: samples in the dataset (ids 0 .. dataset_size - 1).
            global_batch: samples per step over all ranks.
            world_size: the data-parallel ranks the batch is split over.
        """
        self._require("sampler")
        obj, table = self._table("sampler", _abi.SAMPLER_V1_SIZE, _abi.SamplerV1)
        args = _abi.SamplerPlanArgs()
        args.struct_size = _abi.SAMPLER_PLAN_ARGS_SIZE
        args.dataset_size = int(dataset_size)
        args.global_batch = int(global_batch)
        args.world_size = int(world_size)
        self._call(table.plan(obj, ctypes.byref(args)))
        return int(args.capacity)

    def sampler_next(self, step: int, *, seed: int, rank: int = 0, world_size: int = 1,
                     capacity: int) -> Dict[str, Any]:
        """This rank's share of the global batch of ``step`` (loom.sampler/1 ``next``).

        Args:
            step: 1-based; the step after the last one drawn, or the last one again.
            seed: the same on every call and every rank.
            rank, world_size: this rank, and the ranks as given to :meth:`sampler_plan`.
            capacity: what :meth:`sampler_plan` returned.

        Returns:
            dict: {"indices": list[int], "difficulty": float (NaN without a curriculum),
            "epoch": int, "consumed": int}.

        Raises:
            FailedPreconditionError: a step that is neither the next nor the last one.
        """
        self._require("sampler")
        obj, table = self._table("sampler", _abi.SAMPLER_V1_SIZE, _abi.SamplerV1)
        buf = (ctypes.c_int64 * max(1, int(capacity)))()
        shape = (ctypes.c_int64 * 1)(int(capacity))
        t = _abi.DLTensor()
        t.data = ctypes.addressof(buf)
        t.device = _abi.DLDevice(_abi.DL_CPU, 0)
        t.ndim = 1
        t.dtype = _abi.DLDataType(_abi.DL_INT, 64, 1)
        t.shape = shape
        t.strides = None
        t.byte_offset = 0
        args = _abi.SamplerNextArgs()
        args.struct_size = _abi.SAMPLER_NEXT_ARGS_SIZE
        args.seed = int(seed)
        args.step = int(step)
        args.rank = int(rank)
        args.world_size = int(world_size)
        args.indices = ctypes.addressof(t)
        self._call(table.next(obj, ctypes.byref(args)))
        return {"indices": list(buf[:args.count]), "difficulty": float(args.difficulty),
                "epoch": int(args.epoch), "consumed": int(args.consumed)}

    # -- loom.router/1 (plan, select, gather, scatter, advance; backward for learned routers)
    def router_plan(self, *, batch: int, seq_len: int, channels: int, step: int, layer: int,
                    num_layers: int, training: bool = True,
                    dtype: str = "float32") -> Dict[str, int]:
        """What a router does with a layer at a step (loom.router/1 ``plan``).

        Returns:
            dict: {"kept" (positions kept per sequence), "routed" (bool: kept < seq_len),
            "learned" (bool), "saved_bytes", "workspace_bytes"}.
        """
        from .tensor import DTYPES

        self._require("router")
        obj, table = self._table("router", _abi.ROUTER_V1_SIZE, _abi.RouterV1)
        if dtype not in DTYPES:
            raise InvalidArgumentError(f"dtype '{dtype}' is not one of {', '.join(DTYPES)}")
        a = _abi.RouterPlanArgs()
        a.struct_size = _abi.ROUTER_PLAN_ARGS_SIZE
        a.batch, a.seq_len, a.channels, a.step = int(batch), int(seq_len), int(channels), int(step)
        a.layer, a.num_layers, a.training = int(layer), int(num_layers), 1 if training else 0
        code, bits = DTYPES[dtype]
        a.dtype = _abi.DLDataType(code, bits, 1)
        self._call(table.plan(obj, ctypes.byref(a)))
        return {"kept": int(a.kept), "routed": bool(a.flags & _abi.ROUTER_ROUTED),
                "learned": bool(a.flags & _abi.ROUTER_LEARNED),
                "saved_bytes": int(a.saved_bytes), "workspace_bytes": int(a.workspace_bytes)}

    def router_select(self, indices: Any, *, seed: int, step: int, batch: int, seq_len: int,
                      channels: int, layer: int, num_layers: int, training: bool = True,
                      first_sample: int = 0, x: Any = None, weight: Any = None,
                      gates: Any = None, saved: Optional[int] = None, saved_bytes: int = 0,
                      workspace: Optional[int] = None, workspace_bytes: int = 0,
                      stream: Optional[int] = None) -> None:
        """Writes the kept positions into ``indices`` (int32 [batch, kept], DLPack)
        (loom.router/1 ``select``). A learned router also reads ``x`` ([batch, seq_len,
        channels], channels contiguous) and ``weight`` ([channels]) and writes ``gates``
        ([batch, kept]), all of x's dtype, and its ``saved`` buffer for backward.
        ``saved`` and ``workspace`` are addresses of ``saved_bytes`` and
        ``workspace_bytes`` (256-byte aligned, on x's device) when plan asked for them; for
        host tensors a workspace is allocated here when None.

        Raises:
            InvalidArgumentError: device tensors, workspace_bytes > 0 and no workspace (a
                host buffer would be handed to device code).
        """
        self._require("router")
        obj, table = self._table("router", _abi.ROUTER_V1_SIZE, _abi.RouterV1)
        floats = ("float32", "float64", "bfloat16", "float16")
        bi = borrow(indices, "indices", dtypes=("int32",))
        bx = borrow(x, "x", dtypes=floats, layout="rows") if x is not None else None
        bw = borrow(weight, "weight", dtypes=floats) if weight is not None else None
        bg = borrow(gates, "gates", dtypes=floats) if gates is not None else None
        a = _abi.RouterSelectArgs()
        a.struct_size = _abi.ROUTER_SELECT_ARGS_SIZE
        a.seed, a.step, a.batch, a.seq_len = int(seed), int(step), int(batch), int(seq_len)
        a.channels, a.first_sample = int(channels), int(first_sample)
        a.layer, a.num_layers, a.training = int(layer), int(num_layers), 1 if training else 0
        a.x = bx.pointer if bx is not None else None
        a.weight = bw.pointer if bw is not None else None
        a.indices = bi.pointer
        a.gates = bg.pointer if bg is not None else None
        a.saved = saved
        a.saved_bytes = int(saved_bytes)
        host, workspace = _host_workspace(workspace, workspace_bytes, bi, "router_select")
        a.workspace = workspace
        a.workspace_bytes = int(workspace_bytes)
        a.stream = stream
        self._call(table.select(obj, ctypes.byref(a)))
        del bi, bx, bw, bg, host

    def router_backward(self, *, x: Any, weight: Any, indices: Any, dgates: Any, dx: Any,
                        dweight: Any, saved: Optional[int], saved_bytes: int,
                        workspace: Optional[int] = None, workspace_bytes: int = 0,
                        stream: Optional[int] = None) -> None:
        """A learned router's backward (loom.router/1 ``backward``): ADDS the gates'
        contribution, given their gradient ``dgates`` ([batch, kept]), to ``dx`` ([batch,
        seq_len, channels], at the kept positions) and to ``dweight`` ([channels]). ``x``,
        ``weight``, ``indices`` and ``saved`` are what :meth:`router_select` was given and
        wrote.

        Raises:
            UnimplementedError: the router is not a learned one (it has no backward).
            InvalidArgumentError: device tensors, workspace_bytes > 0 and no workspace.
        """
        self._require("router")
        obj, table = self._table("router", _abi.ROUTER_V1_SIZE, _abi.RouterV1)
        if not table.backward:
            raise UnimplementedError(
                f"router.{self.name} (plugin '{self.plugin}') has no backward: it is not a "
                "learned router")
        floats = ("float32", "float64", "bfloat16", "float16")
        bx = borrow(x, "x", dtypes=floats, layout="rows")
        bw = borrow(weight, "weight", dtypes=floats)
        bi = borrow(indices, "indices", dtypes=("int32",))
        bdg = borrow(dgates, "dgates", dtypes=floats)
        bdx = borrow(dx, "dx", dtypes=floats, layout="rows")
        bdw = borrow(dweight, "dweight", dtypes=floats)
        if len(bx.shape) != 3:
            raise InvalidArgumentError(
                f"x must be [batch, seq_len, channels], not shape {list(bx.shape)}")
        shape = bx.shape
        a = _abi.RouterBackwardArgs()
        a.struct_size = _abi.ROUTER_BACKWARD_ARGS_SIZE
        a.batch, a.seq_len, a.channels = shape[0], shape[1], shape[2]
        a.x, a.weight, a.indices = bx.pointer, bw.pointer, bi.pointer
        a.dgates, a.dx, a.dweight = bdg.pointer, bdx.pointer, bdw.pointer
        a.saved, a.saved_bytes = saved, int(saved_bytes)
        host, workspace = _host_workspace(workspace, workspace_bytes, bx, "router_backward")
        a.workspace, a.workspace_bytes, a.stream = workspace, int(workspace_bytes), stream
        self._call(table.backward(obj, ctypes.byref(a)))
        del bx, bw, bi, bdg, bdx, bdw, host

    def _move(self, which: str, full: Any, kept: Any, indices: Any,
              stream: Optional[int]) -> None:
        self._require("router")
        obj, table = self._table("router", _abi.ROUTER_V1_SIZE, _abi.RouterV1)
        anyf = ("float32", "float64", "bfloat16", "float16", "int64", "int32", "uint16", "uint8")
        bf = borrow(full, "full", dtypes=anyf, layout="rows")
        bk = borrow(kept, "kept", dtypes=anyf, layout="rows")
        bi = borrow(indices, "indices", dtypes=("int32",))
        a = _abi.RouterMoveArgs()
        a.struct_size = _abi.ROUTER_MOVE_ARGS_SIZE
        a.full, a.kept, a.indices, a.stream = bf.pointer, bk.pointer, bi.pointer, stream
        self._call(getattr(table, which)(obj, ctypes.byref(a)))
        del bf, bk, bi

    def router_gather(self, full: Any, kept: Any, indices: Any,
                      stream: Optional[int] = None) -> None:
        """kept[b, j, :] = full[b, indices[b, j], :] (loom.router/1 ``gather``)."""
        self._move("gather", full, kept, indices, stream)

    def router_scatter(self, full: Any, kept: Any, indices: Any,
                       stream: Optional[int] = None) -> None:
        """full[b, indices[b, j], :] = kept[b, j, :]; other positions of full are left as
        they are (loom.router/1 ``scatter``)."""
        self._move("scatter", full, kept, indices, stream)

    def router_advance(self, *, step: int, batch: int, seq_len: int,
                       num_layers: int) -> Dict[str, int]:
        """Accounts a finished training step (loom.router/1 ``advance``): ``batch`` is the
        step's sequences over every rank and micro-batch.

        Returns:
            dict: {"layer_tokens" (this step), "consumed_layer_tokens" (so far)}.
        """
        self._require("router")
        obj, table = self._table("router", _abi.ROUTER_V1_SIZE, _abi.RouterV1)
        a = _abi.RouterAdvanceArgs()
        a.struct_size = _abi.ROUTER_ADVANCE_ARGS_SIZE
        a.step, a.batch, a.seq_len, a.num_layers = int(step), int(batch), int(seq_len), int(num_layers)
        self._call(table.advance(obj, ctypes.byref(a)))
        return {"layer_tokens": int(a.layer_tokens),
                "consumed_layer_tokens": int(a.consumed_layer_tokens)}

    # -- loom.moe/1 (plan, forward, backward, reduce_gradients)
    def _moe(self) -> tuple:
        self._require("moe")
        return self._table("moe", _abi.MOE_V1_SIZE, _abi.MoeV1)

    def moe_plan(self, *, tokens: int, model_dim: int, hidden_dim: int, num_experts: int = 0,
                 layer: int = 0, num_layers: int = 1, training: bool = True,
                 dtype: str = "float32") -> Dict[str, Any]:
        """The resolved layout of a MoE layer and its buffer sizes (loom.moe/1 ``plan``).

        Returns:
            dict: {"flags", "residual", "dropless", "expert_bias", "expert_parallel" (bools
            of the flags), "experts", "local_experts", "ep_size", "ep_rank", "top_k",
            "activation" ("gelu", "relu", "silu"), "capacity", "max_expert_rows",
            "saved_bytes", "workspace_bytes"}.
        """
        from .tensor import DTYPES

        obj, table = self._moe()
        if dtype not in DTYPES:
            raise InvalidArgumentError(f"dtype '{dtype}' is not one of {', '.join(DTYPES)}")
        a = _abi.MoePlanArgs()
        a.struct_size = _abi.MOE_PLAN_ARGS_SIZE
        a.tokens, a.model_dim, a.hidden_dim = int(tokens), int(model_dim), int(hidden_dim)
        a.num_experts, a.layer, a.num_layers = int(num_experts), int(layer), int(num_layers)
        a.training = 1 if training else 0
        code, bits = DTYPES[dtype]
        a.dtype = _abi.DLDataType(code, bits, 1)
        self._call(table.plan(obj, ctypes.byref(a)))
        f = int(a.flags)
        return {"flags": f, "residual": bool(f & _abi.MOE_RESIDUAL),
                "dropless": bool(f & _abi.MOE_DROPLESS),
                "expert_bias": bool(f & _abi.MOE_EXPERT_BIAS),
                "expert_parallel": bool(f & _abi.MOE_EXPERT_PARALLEL),
                "experts": int(a.experts), "local_experts": int(a.local_experts),
                "ep_size": int(a.ep_size), "ep_rank": int(a.ep_rank), "top_k": int(a.top_k),
                "activation": _abi.MOE_ACTIVATION_NAMES.get(int(a.activation),
                                                            str(a.activation)),
                "capacity": int(a.capacity), "max_expert_rows": int(a.max_expert_rows),
                "saved_bytes": int(a.saved_bytes), "workspace_bytes": int(a.workspace_bytes)}

    @staticmethod
    def _moe_weights(weights: Dict[str, Any], what: str) -> tuple:
        unknown = sorted(set(weights) - set(_MOE_WEIGHT_NAMES))
        if unknown:
            raise InvalidArgumentError(
                f"{what}: {', '.join(unknown)} is not a MoE weight (they are "
                f"{', '.join(_MOE_WEIGHT_NAMES)})")
        w = _abi.MoeWeights()
        w.struct_size = _abi.MOE_WEIGHTS_SIZE
        held = []
        for name in _MOE_WEIGHT_NAMES:
            t = weights.get(name)
            if t is None:
                continue
            b = borrow(t, f"{what}['{name}']", dtypes=("float32", "bfloat16", "float16"))
            held.append(b)
            setattr(w, name, b.pointer)
        return w, held

    def moe_forward(self, *, x: Any, weights: Dict[str, Any], y: Any, hidden_dim: int,
                    seed: int = 0, step: int = 1, first_token: int = 0, num_experts: int = 0,
                    layer: int = 0, num_layers: int = 1, training: bool = True,
                    expert_bias: Any = None, route_experts: Any = None,
                    route_weights: Any = None, load_count: int = 0,
                    saved: Optional[int] = None, saved_bytes: int = 0,
                    workspace: Optional[int] = None, workspace_bytes: int = 0,
                    stream: Optional[int] = None) -> Dict[str, Any]:
        """One MoE layer over this rank's tokens (loom.moe/1 ``forward``): writes ``y``
        ([tokens, model_dim], like ``x``) and ``saved`` (the address of ``saved_bytes``
        from :meth:`moe_plan`, 256-byte aligned, on x's device) for backward.

        Args:
            weights: {"gate_w", "w1", "b1", "w2", "b2"} (and the residual ones for PR-MoE)
                -> tensors of the plan's shapes.
            load_count: the layer's experts E to return the per-expert load for (0: none).

        Returns:
            dict: {"aux_loss", "dropped", "expert_rows", "load" (list of E ints, or None)}.
        """
        obj, table = self._moe()
        bx = borrow(x, "x", dtypes=("float32", "bfloat16", "float16"))
        by = borrow(y, "y", dtypes=("float32", "bfloat16", "float16"))
        w, held = self._moe_weights(weights, "weights")
        bb = borrow(expert_bias, "expert_bias") if expert_bias is not None else None
        bre = (borrow(route_experts, "route_experts", dtypes=("int32",))
               if route_experts is not None else None)
        brw = borrow(route_weights, "route_weights") if route_weights is not None else None
        stats = _abi.MoeStats()
        stats.struct_size = _abi.MOE_STATS_SIZE
        load = (ctypes.c_int64 * int(load_count))() if load_count > 0 else None
        if load is not None:
            stats.load = ctypes.cast(load, ctypes.POINTER(ctypes.c_int64))
            stats.load_count = int(load_count)
        a = _abi.MoeForwardArgs()
        a.struct_size = _abi.MOE_FORWARD_ARGS_SIZE
        a.seed, a.step, a.first_token = int(seed), int(step), int(first_token)
        a.tokens = bx.shape[0] if bx.shape else 0
        a.model_dim = bx.shape[1] if len(bx.shape) == 2 else 0
        a.hidden_dim, a.num_experts = int(hidden_dim), int(num_experts)
        a.layer, a.num_layers, a.training = int(layer), int(num_layers), 1 if training else 0
        a.x, a.weights, a.y = bx.pointer, ctypes.pointer(w), by.pointer
        a.expert_bias = bb.pointer if bb is not None else None
        a.route_experts = bre.pointer if bre is not None else None
        a.route_weights = brw.pointer if brw is not None else None
        a.stats = ctypes.pointer(stats)
        a.saved, a.saved_bytes = saved, int(saved_bytes)
        host, workspace = _host_workspace(workspace, workspace_bytes, bx, "moe_forward")
        a.workspace, a.workspace_bytes, a.stream = workspace, int(workspace_bytes), stream
        self._call(table.forward(obj, ctypes.byref(a)))
        del bx, by, held, bb, bre, brw, host
        return {"aux_loss": float(stats.aux_loss), "dropped": int(stats.dropped),
                "expert_rows": int(stats.expert_rows),
                "load": list(load) if load is not None else None}

    def moe_backward(self, *, x: Any, weights: Dict[str, Any], dy: Any, dx: Any,
                     grads: Dict[str, Any], hidden_dim: int, saved: Optional[int],
                     saved_bytes: int, seed: int = 0, step: int = 1, first_token: int = 0,
                     num_experts: int = 0, layer: int = 0, num_layers: int = 1,
                     training: bool = True, aux_loss_coef: float = 0.0,
                     workspace: Optional[int] = None, workspace_bytes: int = 0,
                     stream: Optional[int] = None) -> None:
        """The adjoint of the :meth:`moe_forward` whose ``saved`` is passed (loom.moe/1
        ``backward``), with the same scalars, ``x`` and ``weights``: writes ``dx`` and ADDS
        to every tensor of ``grads`` (same names and shapes as ``weights``). The caller's
        loss is task + aux_loss_coef * aux_loss."""
        obj, table = self._moe()
        bx = borrow(x, "x", dtypes=("float32", "bfloat16", "float16"))
        bdy = borrow(dy, "dy", dtypes=("float32", "bfloat16", "float16"))
        bdx = borrow(dx, "dx", dtypes=("float32", "bfloat16", "float16"))
        w, held = self._moe_weights(weights, "weights")
        g, held_g = self._moe_weights(grads, "grads")
        a = _abi.MoeBackwardArgs()
        a.struct_size = _abi.MOE_BACKWARD_ARGS_SIZE
        a.seed, a.step, a.first_token = int(seed), int(step), int(first_token)
        a.tokens = bx.shape[0] if bx.shape else 0
        a.model_dim = bx.shape[1] if len(bx.shape) == 2 else 0
        a.hidden_dim, a.num_experts = int(hidden_dim), int(num_experts)
        a.layer, a.num_layers, a.training = int(layer), int(num_layers), 1 if training else 0
        a.aux_loss_coef = float(aux_loss_coef)
        a.x, a.weights, a.dy, a.dx = bx.pointer, ctypes.pointer(w), bdy.pointer, bdx.pointer
        a.grads = ctypes.pointer(g)
        a.saved, a.saved_bytes = saved, int(saved_bytes)
        host, workspace = _host_workspace(workspace, workspace_bytes, bx, "moe_backward")
        a.workspace, a.workspace_bytes, a.stream = workspace, int(workspace_bytes), stream
        self._call(table.backward(obj, ctypes.byref(a)))
        del bx, bdy, bdx, held, held_g, host

    def _moe_move(self, which: str, x: Any, rows: Any, route_experts: Any,
                  route_weights: Any, num_experts: int, counts_count: int,
                  workspace: Optional[int], workspace_bytes: int,
                  stream: Optional[int]) -> Optional[List[int]]:
        obj, table = self._moe()
        if not getattr(table, which):
            raise UnimplementedError(f"moe.{self.name} (plugin '{self.plugin}') has no {which}")
        floats = ("float32", "bfloat16", "float16")
        bx = borrow(x, "x" if which == "dispatch" else "y", dtypes=floats)
        br = borrow(rows, "rows", dtypes=floats)
        be = borrow(route_experts, "route_experts", dtypes=("int32",))
        bw = borrow(route_weights, "route_weights") if route_weights is not None else None
        if len(be.shape) != 2:
            raise InvalidArgumentError(
                f"route_experts must be [tokens, k], not shape {list(be.shape)}")
        a = _abi.MoeDispatchArgs()
        a.struct_size = _abi.MOE_DISPATCH_ARGS_SIZE
        a.tokens, a.top_k = be.shape[0], be.shape[1]
        a.model_dim = bx.shape[1] if len(bx.shape) == 2 else 0
        a.num_experts = int(num_experts)
        a.x, a.rows, a.route_experts = bx.pointer, br.pointer, be.pointer
        a.route_weights = bw.pointer if bw is not None else None
        counts = None
        if which == "dispatch":
            counts = (ctypes.c_int64 * max(1, int(counts_count)))()
            a.counts = ctypes.cast(counts, ctypes.POINTER(ctypes.c_int64))
            a.counts_count = int(counts_count)
        host, workspace = _host_workspace(workspace, workspace_bytes, bx, f"moe_{which}")
        a.workspace, a.workspace_bytes, a.stream = workspace, int(workspace_bytes), stream
        self._call(getattr(table, which)(obj, ctypes.byref(a)))
        del bx, br, be, bw, host
        return list(counts[:int(counts_count)]) if counts is not None else None

    def moe_dispatch(self, *, x: Any, rows: Any, route_experts: Any, route_weights: Any = None,
                     local_experts: int, num_experts: int = 0,
                     workspace: Optional[int] = None, workspace_bytes: int = 0,
                     stream: Optional[int] = None) -> List[int]:
        """The rows of x ([tokens, M]) for this rank's experts, for a caller that runs its
        own experts (loom.moe/1 ``dispatch``): written into ``rows`` ([max_expert_rows, M]),
        grouped by local expert (then source rank, token, choice), each scaled by its
        choice's weight when ``route_weights`` is given. ``route_experts`` is int32
        [tokens, k] (-1: none), as :meth:`moe_forward` returns it. Returns the rows of
        each of the ``local_experts`` local experts."""
        counts = self._moe_move("dispatch", x, rows, route_experts, route_weights,
                                num_experts, local_experts, workspace, workspace_bytes, stream)
        assert counts is not None
        return counts

    def moe_combine(self, *, rows: Any, y: Any, route_experts: Any, route_weights: Any = None,
                    num_experts: int = 0, workspace: Optional[int] = None,
                    workspace_bytes: int = 0, stream: Optional[int] = None) -> None:
        """The adjoint of :meth:`moe_dispatch` (loom.moe/1 ``combine``): y[t] = the sum over
        t's choices of (weight *) its row, brought back to its token; ``y`` written."""
        self._moe_move("combine", y, rows, route_experts, route_weights, num_experts, 0,
                       workspace, workspace_bytes, stream)

    def moe_reduce_gradients(self, tensors: Sequence[Any], stream: Optional[int] = None) -> None:
        """Averages expert gradients over the expert-data-parallel group, in place, float32
        (loom.moe/1 ``reduce_gradients``; with ep_size 1, the world average)."""
        obj, table = self._moe()
        held = [borrow(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
        ptrs = (ctypes.c_void_p * max(1, len(held)))(*[b.pointer for b in held])
        a = _abi.MoeReduceArgs()
        a.struct_size = _abi.MOE_REDUCE_ARGS_SIZE
        a.tensors = ctypes.cast(ptrs, ctypes.POINTER(ctypes.c_void_p))
        a.count, a.stream = len(held), stream
        self._call(table.reduce_gradients(obj, ctypes.byref(a)))
        del held

    def __repr__(self) -> str:
        return f"<loom.Instance {self.section}.{self.name} (plugin '{self.plugin}')>"
