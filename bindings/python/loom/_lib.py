"""Finding libloom and declaring the embedding API (host/include/loom/embed.h) to ctypes.

Nothing here is public: the rest of the package calls ``lib()`` and gets the loaded
library with every prototype set.
"""
from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
from typing import List, Optional

from . import _abi

# The soname libloom is installed under; the unversioned link is only in build trees
# and development installs.
_NAMES = ("libloom.so.0", "libloom.so")

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_path: Optional[str] = None


class LibraryNotFoundError(ImportError):
    """libloom could not be found or loaded. The message lists every place looked at."""


def _package_dir() -> str:
    return os.path.dirname(os.path.abspath(__file__))


def _install_config() -> dict:
    """What ``cmake --install`` recorded beside the package (its prefix's lib folder)."""
    path = os.path.join(_package_dir(), "_install.json")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def candidates() -> List[str]:
    """The folders searched for libloom, in order (LOOM_LIBRARY aside)."""
    here = _package_dir()
    dirs: List[str] = [here]  # a wheel or a copy that carries libloom beside the package
    libdir = _install_config().get("libdir")
    if isinstance(libdir, str) and libdir:
        dirs.append(libdir)  # the prefix this copy was installed from
    # A repository checkout: bindings/python/loom -> build/release/lib. Before the prefix
    # rule below, which in a checkout would point at whatever lib/ lies four folders up.
    repo = os.path.abspath(os.path.join(here, os.pardir, os.pardir, os.pardir))
    if os.path.isfile(os.path.join(repo, "host", "include", "loom", "embed.h")):
        dirs.append(os.path.join(repo, "build", "release", "lib"))
    # The package inside an installed prefix: PREFIX/lib/pythonX.Y/site-packages/loom or
    # PREFIX/share/loom/python/loom, both four folders below PREFIX.
    prefix = os.path.abspath(os.path.join(here, *([os.pardir] * 4)))
    dirs.append(os.path.join(prefix, "lib"))
    seen = set()
    ordered = []
    for d in dirs:
        if d not in seen:
            seen.add(d)
            ordered.append(d)
    return ordered


def _locate() -> str:
    env = os.environ.get("LOOM_LIBRARY", "")
    if env:
        if not os.path.isfile(env):
            raise LibraryNotFoundError(
                f"LOOM_LIBRARY is set to '{env}', which is not a file; set it to libloom's "
                "full path (PREFIX/lib/libloom.so.0) or unset it to search the install")
        return env
    looked = []
    for d in candidates():
        for name in _NAMES:
            p = os.path.join(d, name)
            looked.append(p)
            if os.path.isfile(p):
                return p
    raise LibraryNotFoundError(
        "libloom not found; looked in LOOM_LIBRARY (unset) and at:\n  " + "\n  ".join(looked) +
        "\nInstall Loom (cmake --install build/release --prefix PREFIX) and install this "
        "package from PREFIX/share/loom/python, or set LOOM_LIBRARY to libloom's full path")


def path() -> str:
    """The file libloom was (or will be) loaded from."""
    lib()
    assert _path is not None
    return _path


def lib() -> ctypes.CDLL:
    """The loaded libloom with its prototypes declared; loaded on first use."""
    global _lib, _path
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is None:
            p = _locate()
            try:
                handle = ctypes.CDLL(p)
            except OSError as e:
                raise LibraryNotFoundError(f"cannot load libloom from {p}: {e}") from e
            try:
                _declare(handle)
            except AttributeError as e:
                raise LibraryNotFoundError(
                    f"{p} is not a libloom this package can use (missing symbol: {e})") from e
            major = handle.loom_abi_major()
            if major != _abi.ABI_MAJOR:
                raise LibraryNotFoundError(
                    f"{p} speaks Loom ABI {major}.{handle.loom_abi_minor()}; this package "
                    f"needs ABI {_abi.ABI_MAJOR}.x")
            _path = p
            _lib = handle
    return _lib


def _fn(handle, name, restype, argtypes):
    f = getattr(handle, name)
    f.restype = restype
    f.argtypes = argtypes


def _declare(h) -> None:
    c = ctypes
    vp = c.c_void_p
    i32 = c.c_int32
    size = c.c_size_t
    sizep = c.POINTER(c.c_size_t)
    _fn(h, "loom_version", c.c_char_p, [])
    _fn(h, "loom_abi_major", c.c_uint32, [])
    _fn(h, "loom_abi_minor", c.c_uint32, [])
    _fn(h, "loom_last_error", c.c_char_p, [])
    _fn(h, "loom_last_error_code", i32, [])
    _fn(h, "loom_abort_job", None, [i32])
    _fn(h, "loom_open_file", i32, [c.c_char_p, c.POINTER(_abi.OpenOptions), c.POINTER(vp)])
    _fn(h, "loom_open_string", i32,
        [c.c_char_p, c.c_char_p, c.POINTER(_abi.OpenOptions), c.POINTER(vp)])
    _fn(h, "loom_close", None, [vp])
    _fn(h, "loom_instance_count", size, [vp])
    _fn(h, "loom_instance_at", vp, [vp, size])
    _fn(h, "loom_find_instance", i32, [vp, c.c_char_p, c.c_char_p, c.POINTER(vp)])
    _fn(h, "loom_instance_name", c.c_char_p, [vp])
    _fn(h, "loom_instance_kind", c.c_char_p, [vp])
    _fn(h, "loom_instance_plugin", c.c_char_p, [vp])
    _fn(h, "loom_instance_export_state", i32, [vp, vp, size, sizep])
    _fn(h, "loom_instance_import_state", i32, [vp, c.c_char_p, size])
    _fn(h, "loom_optimizer_step", i32, [vp, c.POINTER(_abi.OptimizerStepArgs)])
    _fn(h, "loom_optimizer_grads_ready", i32, [vp, c.POINTER(_abi.OptimizerReadyArgs)])
    _fn(h, "loom_optimizer_get_comm_info", i32, [vp, c.POINTER(_abi.OptimizerCommInfo)])
    _fn(h, "loom_instance_table", i32,
        [vp, c.c_char_p, c.c_uint32, c.POINTER(vp), c.POINTER(vp)])
    _fn(h, "loom_instance_take_status", i32, [vp, vp, c.c_char_p, size])
    _fn(h, "loom_describe_plugins", i32, [c.c_char_p, c.c_char_p, c.POINTER(vp)])
    _fn(h, "loom_free_string", None, [vp])
    _fn(h, "loom_thread_count", size, [])
    _fn(h, "loom_set_thread_count", i32, [size])


# PyCapsule access for DLPack, from the interpreter's own C API.
_capsule_get = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_get.restype = ctypes.c_void_p
_capsule_get.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_valid.restype = ctypes.c_int
_capsule_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype = ctypes.c_char_p
_capsule_name.argtypes = [ctypes.py_object]


def capsule_pointer(capsule: object, name: bytes) -> Optional[int]:
    """The pointer in a capsule named ``name``, or None when it is not such a capsule
    (another name, such as a consumed "used_dltensor", or not a capsule at all)."""
    if type(capsule).__name__ != "PyCapsule" or not _capsule_valid(capsule, name):
        return None
    return _capsule_get(capsule, name)


def capsule_name(capsule: object) -> str:
    if type(capsule).__name__ != "PyCapsule":
        return f"a {type(capsule).__name__}, not a capsule"
    n = _capsule_name(capsule)
    return "an unnamed capsule" if n is None else f"a capsule named '{n.decode(errors='replace')}'"


if sys.byteorder != "little":  # pragma: no cover - every platform Loom builds for
    raise ImportError("loom: the Python package assumes a little-endian host")
