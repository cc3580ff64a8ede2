"""``python3 -m loom.deepspeed`` (and the ``loom-from-deepspeed`` script)."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from ._common import analyze_path
from ._convert import convert

PROG = "python3 -m loom.deepspeed"


def main(argv: Optional[List[str]] = None) -> int:
    """``python3 -m loom.deepspeed``: see :mod:`loom.deepspeed`. On stderr, first the
    features DeepSpeed removed in September 2026 that the config uses and what carries
    them here, then the notes and the keys not mapped. Exit status: 0 written, 1
    an unreadable config, one of which nothing maps, or (``--check``) a manifest that does
    not validate; 2 a usage error."""
    ap = argparse.ArgumentParser(
        prog=PROG,
        description="Write the Loom manifest for a DeepSpeed config; list what it cannot map.")
    ap.add_argument("config", help="the DeepSpeed config (JSON)")
    ap.add_argument("-o", "--output",
                    help="write the manifest here instead of stdout (and, when the sampler "
                         "needs an index, the analyzer's manifest beside it: "
                         "RUN.toml -> RUN.analyze.toml)")
    ap.add_argument("--check", action="store_true",
                    help="also validate the manifest against the installed plugins "
                         "(as loom check)")
    ap.add_argument("-q", "--quiet", action="store_true",
                    help="print nothing but errors (the manifest's comments still list the "
                         "removed DeepSpeed features, the notes and the keys not mapped)")
    args = ap.parse_args(argv)
    try:
        conv = convert(args.config, manifest_path=args.output)
    except (OSError, ValueError) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    report = conv.report().splitlines()
    first = len(conv.removed_lines())
    if not args.quiet and first and not conv.empty:
        # What DeepSpeed removed comes first, before the manifest and its check: the reason
        # this config no longer runs there, and what carries it here.
        print("\n".join(report[:first]), file=sys.stderr, flush=True)
    if conv.empty:
        # Nothing to write: a manifest of [loom] alone would look like a conversion.
        if not args.quiet and conv.report():
            print(conv.report(), file=sys.stderr)
        listed = ", listed above" if not args.quiet and conv.unmapped else ""
        print(f"{PROG}: {conv.source}: nothing in this config maps to a Loom instance "
              f"({len(conv.unmapped)} key(s) not mapped{listed}); Loom maps optimizer, "
              "curriculum_learning, data_efficiency, dynamic_train (random-LTD), moe and "
              "compression_training; no manifest written", file=sys.stderr)
        return 1
    text = conv.manifest
    if args.check:
        from ..errors import LoomError
        from ..session import Session

        try:
            Session.from_string(text, args.output or "converted.toml", validate_only=True,
                                log_level="error").close()
        except LoomError as e:
            print(f"{PROG}: the converted manifest is not valid:\n{e}", file=sys.stderr)
            return 1
    if args.output:
        conv.write(args.output)
    else:
        sys.stdout.write(text)
    if not args.quiet and report[first:]:
        print("\n".join(report[first:]), file=sys.stderr)
    if args.output and conv.analyze_manifest is not None and not args.quiet:
        print(f"{conv.source}: wrote {args.output} and {analyze_path(args.output)} (the "
              "metrics for loom data analyze)", file=sys.stderr)
    return 0
