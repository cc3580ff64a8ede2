"""Writing the small subset of TOML a manifest needs (tables of scalars and arrays)."""
from __future__ import annotations

import json
import math
import re
from typing import Any, Dict, List, Tuple

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def value(v: Any) -> str:
    """One value as TOML: bool, int, float (inf and nan included), str, or a list of them."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        r = repr(v)
        return r if any(c in r for c in ".en") else r + ".0"
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(value(x) for x in v) + "]"
    raise TypeError(f"cannot write a {type(v).__name__} as a manifest value")


def key(k: str) -> str:
    return k if _BARE_KEY.match(k) else json.dumps(k)


def table(header: str, entries: Dict[str, Any], comments: Dict[str, str] = None) -> str:
    """``[header]`` and one ``key = value`` line per entry (None values are left out),
    each with an optional trailing comment."""
    comments = comments or {}
    lines = [f"[{header}]"]
    for k, v in entries.items():
        if v is None:
            continue
        line = f"{key(k)} = {value(v)}"
        if k in comments:
            line += f"  # {comments[k]}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def array_table(header: str, entries: Dict[str, Any]) -> str:
    """One entry of an array of tables: ``[[header]]`` and its ``key = value`` lines."""
    head, body = table(header, entries).split("\n", 1)
    return f"[{head}]\n{body}"


def manifest(tables: List[Tuple[str, Dict[str, Any]]], header_comment: str = "",
             arrays: List[Tuple[str, Dict[str, Any]]] = ()) -> str:
    """The manifest text: the comment, the ``tables`` in order, then the ``arrays``
    entries (``[[quantize]]`` rules), each as ``[[header]]``."""
    parts = []
    if header_comment:
        parts.append("".join(f"# {line}\n" if line else "#\n" for line in header_comment.split("\n")))
    parts += [table(h, e) for h, e in tables]
    parts += [array_table(h, e) for h, e in arrays]
    return "\n".join(parts)
