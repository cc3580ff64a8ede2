#!/usr/bin/env python3
"""Prints the Markdown parameter table of each optimizer plugin from `loom describe NAME
--json`, for docs/optimizers.md.

usage: scripts/optimizer_param_tables.py [path/to/loom] [NAME...]
"""
import json
import subprocess
import sys

loom = sys.argv[1] if len(sys.argv) > 1 else "build/release/bin/loom"
names = sys.argv[2:] or ["adam", "lamb", "onebit_adam", "zero_one_adam", "onebit_lamb"]


def fmt_range(p):
    lo, hi = p.get("min"), p.get("max")
    if lo is None and hi is None:
        return ""
    lo = "" if lo is None or lo in ("-inf", float("-inf")) else lo
    hi = "" if hi is None or hi in ("inf", float("inf")) else hi
    if lo == "" and hi == "":
        return ""
    opening = "(" if p.get("min_exclusive") else "["
    closing = ")" if p.get("max_exclusive") else "]"
    if hi == "":
        return f"> {lo}" if p.get("min_exclusive") else f">= {lo}"
    return f"{opening}{lo}, {hi}{closing}"


for name in names:
    out = subprocess.run([loom, "describe", name, "--json"], check=True, capture_output=True,
                         text=True).stdout
    d = json.loads(out)
    print(f"### `{name}` parameters\n")
    print("| name | type | default | range | description |")
    print("|---|---|---|---|---|")
    for kind in d["kinds"]:
        for p in kind["params"]:
            default = "required" if p.get("required") else json.dumps(p.get("default"))
            doc = p.get("doc", "").replace("|", "\\|")
            print(f"| `{p['name']}` | {p.get('type_phrase', p['type'])} | {default} | "
                  f"{fmt_range(p)} | {doc} |")
    print()
