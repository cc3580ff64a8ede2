"""Loom from Python: open a manifest, find its instances and call them, over libloom's
embedding C API through ctypes (no compile step; CPython >= 3.9).

Main entry points:

- :class:`Session`: an opened manifest (``Session("run.toml")``,
  ``Session.from_string(text)``) and its :class:`Instance` objects.
- :mod:`loom.torch`: ``loom.torch.Optimizer`` wraps an optimizer plugin as a
  ``torch.optim.Optimizer`` (``OnebitAdam``, ``ZeroOneAdam``, ``OnebitLamb``: DeepSpeed's
  removed 1-bit optimizers with its constructor arguments), ``loom.torch.Router`` a random or learned router around a layer
  (imported on demand, so torch is optional).
- :class:`Bootstrap`: a rank's bootstrap from Python callables
  (``loom.torch.distributed_bootstrap()`` builds one over torch.distributed).
- :mod:`loom.data`: ``loom.data.CurriculumSampler``, a sampler plugin as a batch sampler.
- :func:`from_deepspeed`: the Loom manifest for a DeepSpeed config (also
  ``python3 -m loom.deepspeed ds_config.json``).
- :mod:`loom.errors`: one exception class per Loom status code.

A session and its instances are used from one thread at a time. Tensors cross zero-copy through DLPack (:mod:`loom.tensor`). libloom is found from
``LOOM_LIBRARY``, beside the package, or the install prefix (see :func:`library_path`).
"""
from __future__ import annotations

from ._lib import LibraryNotFoundError
from .bootstrap import Bootstrap
from ._lib import path as library_path
from .errors import (AbiMismatchError, DataLossError, DeadlineExceededError,
                     FailedPreconditionError, InternalError, InvalidArgumentError, LoomError,
                     NotFoundError, OutOfRangeError, ResourceExhaustedError, UnavailableError,
                     UnimplementedError)
from .session import (Instance, Session, abi_version, abort_job, describe_plugins,
                      set_thread_count, thread_count, version)

__version__ = "0.1.0"

__all__ = [
    "Session", "Instance", "Bootstrap", "version", "abi_version", "describe_plugins", "library_path",
    "thread_count", "set_thread_count", "abort_job",
    "from_deepspeed", "LibraryNotFoundError", "LoomError", "InvalidArgumentError",
    "NotFoundError", "OutOfRangeError", "UnimplementedError", "FailedPreconditionError",
    "UnavailableError", "DeadlineExceededError", "ResourceExhaustedError", "DataLossError",
    "AbiMismatchError", "InternalError",
]


def from_deepspeed(config):
    """The Loom manifest for a DeepSpeed config (a dict, or the path of its JSON file):
    a :class:`loom.deepspeed.Conversion` with ``.manifest`` (TOML text), ``.tables``,
    ``.removed`` (the features DeepSpeed removed in September 2026 that the config uses,
    and the Loom instance that carries each), ``.unmapped`` (every key not carried, with
    the reason) and ``.notes``. See
    :func:`loom.deepspeed.convert`."""
    from .deepspeed import convert

    return convert(config)
