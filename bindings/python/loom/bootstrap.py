"""A rank's bootstrap from Python callables: how a program that already has its own
process group (torch.distributed, mpi4py, ...) lets Loom's transports exchange what they
need through it instead of a rendezvous of their own.

The host needs a bootstrap only for its collectives at set-up (a transport's worker
addresses, a NCCL unique id): an allgather of a few bytes per rank and a barrier.
:func:`loom.torch.distributed_bootstrap` builds one over a torch.distributed group.
"""

import ctypes
from typing import Callable, Dict

from . import _abi
from .errors import InvalidArgumentError, LoomError

__all__ = ["Bootstrap"]


class Bootstrap:
    """A ``loom_bootstrap`` whose collectives are Python callables.

    Args:
        rank: this process's rank, 0 .. size - 1.
        size: the number of ranks.
        local_rank: this rank's position among the ranks on its machine.
        allgather: ``allgather(data: bytes) -> bytes``: every rank contributes
            ``len(data)`` bytes (the same length on every rank) and gets the
            ``size * len(data)`` bytes of all contributions, rank i's at offset
            ``i * len(data)``. Collective: every rank calls it in the same order.
        barrier: ``barrier() -> None``: returns once every rank has entered.

    An exception raised by either callable reaches Loom as an error status: a
    :class:`loom.LoomError` keeps its code, ``TimeoutError`` is DEADLINE_EXCEEDED, any
    other exception UNAVAILABLE, each with the exception's text. Pass the object as
    ``Session(..., bootstrap=...)``; the session keeps it alive while it is open.
    """

    def __init__(self, rank: int, size: int, local_rank: int,
                 allgather: Callable[[bytes], bytes], barrier: Callable[[], None]) -> None:
        for name, v in (("rank", rank), ("size", size), ("local_rank", local_rank)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise InvalidArgumentError(f"bootstrap {name} must be an integer, not {v!r}")
        if size < 1 or not 0 <= rank < size:
            raise InvalidArgumentError(
                f"bootstrap rank {rank} and size {size}: need size >= 1 and 0 <= rank < size")
        if not 0 <= local_rank < size:
            raise InvalidArgumentError(
                f"bootstrap local_rank {local_rank} is outside 0 .. size - 1 ({size - 1})")
        if not callable(allgather) or not callable(barrier):
            raise InvalidArgumentError("bootstrap allgather and barrier must be callables")
        self.rank, self.size, self.local_rank = rank, size, local_rank
        self._allgather, self._barrier = allgather, barrier
        # Statuses handed to Loom, alive until Loom destroys them (by address).
        self._statuses: Dict[int, tuple] = {}
        self._destroy = _abi.STATUS_DESTROY_FN(self._destroy_status)
        self._c_allgather = _abi.BOOTSTRAP_ALLGATHER_FN(self._on_allgather)
        self._c_barrier = _abi.BOOTSTRAP_BARRIER_FN(self._on_barrier)
        t = _abi.Bootstrap()
        t.struct_size = _abi.BOOTSTRAP_SIZE
        t.rank, t.size, t.local_rank = rank, size, local_rank
        t.ctx = None
        t.allgather = self._c_allgather
        t.barrier = self._c_barrier
        self._table = t

    @property
    def pointer(self) -> int:
        """The address of the ``loom_bootstrap`` (valid while this object lives)."""
        return ctypes.addressof(self._table)

    # -- the C side
    def _status(self, exc: BaseException, what: str) -> int:
        if isinstance(exc, LoomError) and exc.code > 0:
            code = exc.code
        elif isinstance(exc, TimeoutError):
            code = _abi.DEADLINE_EXCEEDED
        else:
            code = _abi.UNAVAILABLE
        text = f"bootstrap {what} on rank {self.rank} of {self.size}: " \
               f"{type(exc).__name__}: {exc}"
        msg = ctypes.create_string_buffer(text.encode("utf-8", errors="replace"))
        st = _abi.Status()
        st.struct_size = _abi.STATUS_SIZE
        st.code = code
        st.message = ctypes.cast(msg, ctypes.c_char_p)
        st.destroy = self._destroy
        addr = ctypes.addressof(st)
        self._statuses[addr] = (st, msg)
        return addr

    def _destroy_status(self, p: "ctypes._Pointer") -> None:
        self._statuses.pop(ctypes.addressof(p.contents), None)

    def _on_allgather(self, _ctx: int, send: int, nbytes: int, recv: int) -> int:
        try:
            data = ctypes.string_at(send, nbytes) if nbytes else b""
            out = self._allgather(data)
            out = bytes(out)
            if len(out) != nbytes * self.size:
                raise InvalidArgumentError(
                    f"the allgather callable returned {len(out)} bytes, not size * "
                    f"{nbytes} = {nbytes * self.size}")
            if out:
                ctypes.memmove(recv, out, len(out))
            return 0
        except BaseException as e:  # nothing may propagate through C
            return self._status(e, "allgather")

    def _on_barrier(self, _ctx: int) -> int:
        try:
            self._barrier()
            return 0
        except BaseException as e:
            return self._status(e, "barrier")

    def __repr__(self) -> str:
        return f"<loom.Bootstrap rank {self.rank} of {self.size} (local {self.local_rank})>"
