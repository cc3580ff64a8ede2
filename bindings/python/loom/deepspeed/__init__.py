"""The Loom manifest for a DeepSpeed config.

``convert(ds_config)`` (also ``loom.from_deepspeed``) maps the config's ``optimizer``
(Adam, AdamW, Lamb, OneBitAdam, ZeroOneAdam, OneBitLamb), its legacy
``curriculum_learning`` (sequence-length warmup), ``data_efficiency.data_sampling``'s
curriculum metrics and random-LTD (``data_efficiency.data_routing.random_ltd``, and the
older ``dynamic_train.random_ltd`` of DeepSpeed before 0.8), a ``moe`` object holding the
arguments of DeepSpeed's MoE layer (``deepspeed.moe.layer.MoE``: num_experts, k,
capacity_factor, ...) and ``compression_training``'s weight and activation quantization
(quantizer instances and ``[[quantize]]`` rules) onto Loom's plugins, and lists every key it
cannot map with the reason. From the shell::

    python3 -m loom.deepspeed ds_config.json [-o run.toml] [--check]

writes the manifest (to stdout or ``-o``; with ``-o``, and a curriculum metric whose index
``loom data analyze`` must build, also the analyzer's manifest ``run.analyze.toml``) and, on
stderr, first the features DeepSpeed removed in September 2026 that the config uses (the
OneBitAdam, ZeroOneAdam and OneBitLamb optimizers and their ``comm_backend_name``, the
compression library's ZeroQuant and XTC quantization, pruning and layer reduction), each
with the Loom instance that carries it (``Conversion.removed``), then one
``FILE: KEY: not mapped: REASON`` line per key it could not map. A config of which nothing
maps is an error (exit status 1).
"""
from __future__ import annotations

from ._cli import main
from ._common import Conversion, Removed, Unmapped, analyze_path
from ._convert import convert

__all__ = ["convert", "Conversion", "Removed", "Unmapped", "analyze_path", "main"]
