"""``convert``: a DeepSpeed config, section by section, onto a :class:`Conversion`."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Union

from ._common import TOP_LEVEL, Conversion, Unmapped, kind
from ._compression import map_compression
from ._data import map_data_efficiency, map_dynamic_train, map_legacy_curriculum
from ._moe import map_moe
from ._optimizer import map_optimizer

_SECTIONS = {
    "optimizer": map_optimizer,
    "curriculum_learning": map_legacy_curriculum,
    "data_efficiency": map_data_efficiency,
    "dynamic_train": map_dynamic_train,
    "moe": map_moe,
    "compression_training": map_compression,
}


def convert(config: Union[Dict[str, Any], str, "os.PathLike[str]"], *,
            manifest_path: Union[None, str, "os.PathLike[str]"] = None) -> Conversion:
    """The Loom manifest for a DeepSpeed config.

    Args:
        config: the config as a dict, or the path of its JSON file.
        manifest_path: where the manifest will be written (``Conversion.write``), so that
            the notes name the files beside it (the analyzer's manifest); None names
            placeholders (RUN.toml).

    Returns:
        Conversion: ``.manifest`` (TOML text), ``.tables``, ``.rules`` (``[[quantize]]``),
        ``.analyze_manifest``, ``.removed`` (the features DeepSpeed removed in September
        2026 that the config uses, and what carries each here), ``.unmapped`` (every key
        not carried, with the reason),
        ``.notes`` and ``.empty`` (nothing mapped).

    Raises:
        ValueError: the file is not JSON, or the config is not an object.
        OSError: the file cannot be read.
    """
    source = "<dict>"
    if isinstance(config, (str, os.PathLike)):
        source = os.fspath(config)
        with open(source, encoding="utf-8") as f:
            text = f.read()
        try:
            config = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{source}: not JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{source}: a DeepSpeed config is a JSON object, not {kind(config)}")
    out = Conversion(source=source,
                     manifest_path=None if manifest_path is None else os.fspath(manifest_path))
    for k, v in config.items():
        section = _SECTIONS.get(k)
        if section is not None:
            section(v, out)
        elif k in TOP_LEVEL:
            out.unmapped.append(Unmapped(k, TOP_LEVEL[k]))
        else:
            out.unmapped.append(Unmapped(k, "no Loom equivalent"))
    return out
