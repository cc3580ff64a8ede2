"""A PEP 517 build backend for the loom package, standard library only.

The package is pure Python, so a wheel is a zip of ``loom/`` plus its metadata. Building
needs nothing from a package index. When the source folder has no ``loom/_install.json``
(one is written by ``cmake --install`` into PREFIX/share/loom/python) and it sits in a
Loom checkout with a built libloom (build/release/lib), the wheel records that folder, so
the installed package finds the checkout's libloom.
"""
from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import tarfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
NAME = "loom"
TAG = "py3-none-any"


def _project() -> dict:
    text = open(os.path.join(HERE, "pyproject.toml"), encoding="utf-8").read()
    version = re.search(r'^version\s*=\s*"([^"]+)"', text, re.M).group(1)
    summary = re.search(r'^description\s*=\s*"([^"]+)"', text, re.M).group(1)
    requires = re.search(r'^requires-python\s*=\s*"([^"]+)"', text, re.M).group(1)
    return {"version": version, "summary": summary, "requires_python": requires}


def _metadata(p: dict) -> str:
    readme = open(os.path.join(HERE, "README.md"), encoding="utf-8").read()
    return (f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {p['version']}\n"
            f"Summary: {p['summary']}\nRequires-Python: {p['requires_python']}\n"
            "License: Apache-2.0\nProvides-Extra: numpy\nProvides-Extra: torch\n"
            "Requires-Dist: numpy>=1.22; extra == \"numpy\"\n"
            "Requires-Dist: torch>=1.13; extra == \"torch\"\n"
            "Description-Content-Type: text/markdown\n\n" + readme)


def _package_files() -> list:
    out = []
    root = os.path.join(HERE, NAME)
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        for f in sorted(files):
            if f.endswith((".py", ".json", ".typed")):
                full = os.path.join(d, f)
                out.append((full, os.path.relpath(full, HERE).replace(os.sep, "/")))
    return out


def _checkout_libdir() -> str:
    repo = os.path.abspath(os.path.join(HERE, os.pardir, os.pardir))
    lib = os.path.join(repo, "build", "release", "lib")
    if (os.path.isfile(os.path.join(repo, "host", "include", "loom", "embed.h"))
            and os.path.isfile(os.path.join(lib, "libloom.so.0"))):
        return lib
    return ""


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest},{len(data)}"


def _write_wheel(wheel_directory: str, editable: bool) -> str:
    p = _project()
    dist = f"{NAME}-{p['version']}.dist-info"
    filename = f"{NAME}-{p['version']}-{TAG}.whl"
    entries = []
    if editable:
        entries.append((f"__editable__.{NAME}.pth", (HERE + "\n").encode()))
    else:
        names = set()
        for full, rel in _package_files():
            with open(full, "rb") as f:
                entries.append((rel, f.read()))
            names.add(rel)
        install = f"{NAME}/_install.json"
        libdir = os.environ.get("LOOM_LIBDIR", "") or _checkout_libdir()
        if install not in names and libdir:
            entries.append((install, (json.dumps({"libdir": libdir}) + "\n").encode()))
    entries.append((f"{dist}/METADATA", _metadata(p).encode()))
    entries.append((f"{dist}/WHEEL", (f"Wheel-Version: 1.0\nGenerator: loom_build\n"
                                      f"Root-Is-Purelib: true\nTag: {TAG}\n").encode()))
    entries.append((f"{dist}/entry_points.txt",
                    b"[console_scripts]\nloom-from-deepspeed = loom.deepspeed:main\n"))
    entries.append((f"{dist}/top_level.txt", f"{NAME}\n".encode()))
    record = "".join(f"{n},{_record_hash(d)}\n" for n, d in entries) + f"{dist}/RECORD,,\n"
    entries.append((f"{dist}/RECORD", record.encode()))
    path = os.path.join(wheel_directory, filename)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for n, d in entries:
            info = zipfile.ZipInfo(n, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, d)
    return filename


# ---- PEP 517 / PEP 660 hooks

def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _write_wheel(wheel_directory, editable=False)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    return _write_wheel(wheel_directory, editable=True)


def build_sdist(sdist_directory, config_settings=None):
    p = _project()
    base = f"{NAME}-{p['version']}"
    filename = f"{base}.tar.gz"
    with tarfile.open(os.path.join(sdist_directory, filename), "w:gz") as t:
        for rel in ("pyproject.toml", "README.md", "loom_build.py"):
            t.add(os.path.join(HERE, rel), f"{base}/{rel}")
        for full, rel in _package_files():
            if not rel.endswith("_install.json"):
                t.add(full, f"{base}/{rel}")
        meta = _metadata(p).encode()
        info = tarfile.TarInfo(f"{base}/PKG-INFO")
        info.size = len(meta)
        t.addfile(info, io.BytesIO(meta))
    return filename
