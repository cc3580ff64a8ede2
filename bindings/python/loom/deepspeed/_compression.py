"""DeepSpeed's ``compression_training``: weight quantization groups as ``[quantizer.GROUP]``
instances (zeroquant, xtc) with ``[[quantize]]`` rules from their ``modules`` lists, and
activation quantization as the zeroquant instances' ``activation_bits``."""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

from ._common import Conversion, Removed, Unmapped, as_int, kind, safe_name

_QUANT_SHARED_REASONS = {
    "schedule_offset": "when quantization starts is the trainer's (QAT from the step it "
                       "chooses; loom quantize for a trained checkpoint)",
    "quantizer_kernel": "Loom's quantizers always run their own kernels (the same arithmetic "
                        "on CPU and CUDA)",
    "quantize_verbose": "logging is the trainer's",
    "quantize_weight_in_forward": "Loom's QAT always quantizes in the forward pass (quantize "
                                  "then dequantize, straight-through gradient): that is true",
    "fp16_mixed_quantize": "Loom has no blend of float and quantized weights; QAT uses the "
                           "quantized weight from its first step",
}

# DeepSpeed's words for the parts of its compression library Loom does not carry.
_PRUNING = {"sparse_pruning": "sparse pruning", "row_pruning": "row pruning",
            "head_pruning": "attention-head pruning", "channel_pruning": "channel pruning",
            "layer_reduction": "layer reduction (XTC's smaller student, distilled from the "
                               "teacher's layers)"}


def _enabled(key: str, v: Any) -> bool:
    """Whether a pruning or layer-reduction section is switched on: layer_reduction has
    its own ``enabled``, the pruning methods theirs under ``shared_parameters``."""
    if not isinstance(v, dict):
        return False
    if key == "layer_reduction":
        return v.get("enabled", False) is True
    shared = v.get("shared_parameters")
    return isinstance(shared, dict) and shared.get("enabled", False) is True


def _unique_name(name: str, out: Conversion) -> str:
    """``name``, or ``name_q``, ``name_q2``, ... when an instance of any kind has it (names
    are unique across kinds)."""
    taken = {h.split(".", 1)[1] for h, _ in out.tables}
    # the optimizer's table is written after compression_training when it comes later in
    # the config: keep its name free too
    taken |= {"main", "world", "onebit", "experts"}
    cand, i = name, 1
    while cand in taken:
        cand = f"{name}_q" if i == 1 else f"{name}_q{i}"
        i += 1
    return cand


def _groups_note(prefix: str, g: Any, out: Conversion) -> None:
    gi = as_int(g)
    if gi is None or gi < 1:
        out.unmapped.append(Unmapped(prefix, f"must be an integer >= 1, not {json.dumps(g)}"))
        return
    out.unmapped.append(Unmapped(
        prefix, f"{gi}: DeepSpeed splits the flattened weight into {gi} equal contiguous "
        "chunks, i.e. blocks of whole output rows when the groups are at most the rows, and "
        "rows cut in equal pieces along the input when there are more; Loom's groups run "
        "along each row (group_size elements of the input features) and never span two rows. "
        "The manifest keeps group_size = 0 (one scale per output row: as fine as DeepSpeed's "
        "or finer); for DeepSpeed's rows * c groups set group_size = in_features / c "
        "yourself (it depends on each matrix's shape)"))


def map_compression(cfg: Any, out: Conversion) -> None:
    if not isinstance(cfg, dict):
        out.unmapped.append(Unmapped("compression_training", f"must be an object, not "
                                     f"{kind(cfg)}"))
        return
    act_bits: Optional[int] = None  # 8: activations quantized; None: not
    aq = cfg.get("activation_quantization")
    if aq is not None:
        act_bits = _activation_quantization(aq, out)
    for k, v in cfg.items():
        if k == "weight_quantization":
            _weight_quantization(v, out, act_bits)
        elif k == "activation_quantization":
            continue
        elif k in _PRUNING:
            enabled = _enabled(k, v)
            out.unmapped.append(Unmapped(f"compression_training.{k}",
                                         "pruning and layer reduction are not part of Loom"
                                         if enabled else "not enabled: nothing to map"))
            if enabled:
                out.removed.append(Removed(f"compression_training.{k}", _PRUNING[k]))
        else:
            out.unmapped.append(Unmapped(f"compression_training.{k}", "not a key of DeepSpeed's "
                                         "compression_training"))
    if aq is not None:
        _activation_removed(aq, act_bits, out)


def _activation_removed(aq: Any, act_bits: Optional[int], out: Conversion) -> None:
    """The removed-feature line of an enabled activation_quantization: the zeroquant
    instances that carry it (activation_bits = 8), or none."""
    shared = aq.get("shared_parameters") if isinstance(aq, dict) else None
    if not isinstance(shared, dict) or shared.get("enabled", False) is not True:
        return
    key = "compression_training.activation_quantization"
    carriers = [f"[{h}]" for h, t in out.tables
                if h.startswith("quantizer.") and t.get("activation_bits") == 8]
    feature = "ZeroQuant's INT8 activation quantization"
    if act_bits == 8 and carriers:
        out.removed.append(Removed(key, feature, f"activation_bits = 8 on {', '.join(carriers)} "
                                   "(plugin \"zeroquant\")"))
    elif act_bits == 8:
        out.removed.append(Removed(key, f"{feature}: no zeroquant instance takes it (xtc's 1- "
                                   "and 2-bit matmul multiplies float activations)"))
    else:
        out.removed.append(Removed(key, "ZeroQuant's activation quantization, as configured "
                                   "here (Loom's is 8-bit, symmetric and dynamic)"))


def _activation_quantization(cfg: Any, out: Conversion) -> Optional[int]:
    p = "compression_training.activation_quantization"
    if not isinstance(cfg, dict):
        out.unmapped.append(Unmapped(p, "must be an object"))
        return None
    shared = cfg.get("shared_parameters", {})
    if not isinstance(shared, dict) or not shared.get("enabled", False):
        out.unmapped.append(Unmapped(p, "enabled is false (or missing): nothing to map; the "
                                     "zeroquant instances multiply float activations "
                                     "(activation_bits = 0)"))
        return None
    ok = True
    for k, v in shared.items():
        key = f"{p}.shared_parameters.{k}"
        if k == "enabled":
            continue
        if k == "quantization_type":
            if v != "symmetric":
                out.unmapped.append(Unmapped(key, f"'{v}': Loom quantizes activations "
                                             "symmetrically only (one INT8 scale per token)"))
                ok = False
        elif k == "range_calibration":
            if v != "dynamic":
                out.unmapped.append(Unmapped(key, f"'{v}': Loom's activation scales are dynamic "
                                             "(max|x| of each token, computed in the matmul); "
                                             "static calibrated ranges are not kept"))
        elif k == "schedule_offset":
            out.unmapped.append(Unmapped(key, _QUANT_SHARED_REASONS["schedule_offset"]))
        else:
            out.unmapped.append(Unmapped(key, "not a key of DeepSpeed's activation "
                                         "quantization"))
    bits: Optional[int] = None
    groups = cfg.get("different_groups", {})
    if not isinstance(groups, dict):
        out.unmapped.append(Unmapped(f"{p}.different_groups", "must be an object"))
        groups = {}
    for name, g in groups.items():
        gp = f"{p}.different_groups.{name}"
        params = g.get("params", {}) if isinstance(g, dict) else None
        if not isinstance(params, dict):
            out.unmapped.append(Unmapped(gp, "must be an object with params.bits"))
            continue
        b = as_int(params.get("bits"))
        if b == 8:
            bits = 8
        else:
            out.unmapped.append(Unmapped(f"{gp}.params.bits", f"{json.dumps(params.get('bits'))}:"
                                         " Loom's quantized matmul takes INT8 activations (8) "
                                         "or float ones"))
        for k in params:
            if k != "bits":
                out.unmapped.append(Unmapped(f"{gp}.params.{k}", "not a parameter of DeepSpeed's "
                                             "activation quantization"))
        if isinstance(g, dict) and "modules" in g:
            out.unmapped.append(Unmapped(
                f"{gp}.modules", f"{json.dumps(g['modules'])}: INT8 activations apply to every "
                "matmul of a zeroquant instance (activation_bits = 8); which layers use which "
                "instance is the trainer's and loom quantize's rules"))
    if not ok or bits is None:
        return None
    out.notes.append("activation_quantization (8 bits, symmetric, dynamic) is activation_bits "
                     "= 8 on the zeroquant instances: their matmul quantizes each token of x to "
                     "INT8 and multiplies codes by codes (W8A8, W4A8); xtc's 1- and 2-bit "
                     "matmul takes float activations")
    return 8


def _weight_quantization(cfg: Any, out: Conversion, act_bits: Optional[int]) -> None:
    p = "compression_training.weight_quantization"
    if not isinstance(cfg, dict):
        out.unmapped.append(Unmapped(p, "must be an object"))
        return
    shared = cfg.get("shared_parameters", {})
    if not isinstance(shared, dict) or not shared.get("enabled", False):
        out.unmapped.append(Unmapped(p, "enabled is false (or missing): nothing to map"))
        return
    symmetric = True
    for k, v in shared.items():
        key = f"{p}.shared_parameters.{k}"
        if k == "enabled":
            continue
        if k == "quantization_type":
            if v in ("symmetric", "asymmetric"):
                symmetric = v == "symmetric"
            else:
                out.unmapped.append(Unmapped(key, f"'{v}' is not symmetric or asymmetric; the "
                                             "manifest uses symmetric"))
        elif k == "quantize_groups":
            _groups_note(key, v, out)
        elif k == "rounding":
            if v != "nearest":
                out.unmapped.append(Unmapped(key, f"'{v}': Loom rounds to nearest (half to "
                                             "even) only, the same on CPU and CUDA"))
        elif k in _QUANT_SHARED_REASONS:
            if k == "quantize_weight_in_forward" and v is True:
                continue  # what Loom's QAT does
            out.unmapped.append(Unmapped(key, _QUANT_SHARED_REASONS[k]))
        else:
            out.unmapped.append(Unmapped(key, "not a key of DeepSpeed's weight quantization"))
    groups = cfg.get("different_groups", {})
    if not isinstance(groups, dict) or not groups:
        out.unmapped.append(Unmapped(f"{p}.different_groups", "missing or empty: DeepSpeed "
                                     "needs at least one group with target_bits"))
        return
    rules: List[Dict[str, Any]] = []  # [[quantize]] rules of groups that name modules
    catch_all: List[Tuple[str, str]] = []  # (group, instance) of groups over every module
    for name, g in groups.items():
        gp = f"{p}.different_groups.{name}"
        if not isinstance(g, dict) or not isinstance(g.get("params"), dict):
            out.unmapped.append(Unmapped(gp, "must be an object with params.target_bits"))
            continue
        params = g["params"]
        bits = as_int(params.get("target_bits"))
        if bits is None or not 1 <= bits <= 8:
            out.unmapped.append(Unmapped(f"{gp}.params.target_bits", f"must be an integer 1..8, "
                                         f"not {json.dumps(params.get('target_bits'))}"))
            continue
        header = f"quantizer.{_unique_name(safe_name(name), out)}"
        if bits >= 3:
            t: Dict[str, Any] = {"plugin": "zeroquant", "bits": bits, "symmetric": symmetric,
                                 "group_size": 0, "range": "deepspeed",
                                 "activation_bits": 8 if act_bits == 8 else 0}
            if not symmetric and bits == 8 and act_bits == 8:
                t["activation_bits"] = 0
                out.unmapped.append(Unmapped(
                    f"{gp}.params.target_bits", "8 bits asymmetric with INT8 activations: "
                    "asymmetric 8-bit codes minus their zero points do not fit the INT8 GEMM, "
                    f"so [{header}] multiplies float activations (activation_bits = 0); use "
                    "quantization_type symmetric or at most 7 bits for W8A8"))
            if bits not in (4, 8):
                out.notes.append(f"{gp}: {bits}-bit codes are packed and computed exactly, "
                                 "but only 8 and 4 bits have tuned kernels")
        else:
            if not symmetric:
                out.unmapped.append(Unmapped(f"{gp}.params.target_bits",
                                             f"{bits} bits with quantization_type asymmetric: "
                                             "DeepSpeed refuses it (1- and 2-bit weights are "
                                             "binary or ternary, symmetric by definition); the "
                                             "manifest uses xtc"))
            t = {"plugin": "xtc", "mode": "binary" if bits == 1 else "ternary", "group_size": 0}
        for k, v in params.items():
            key = f"{gp}.params.{k}"
            if k == "target_bits":
                continue
            if k == "start_bits":
                if as_int(v) != bits:
                    out.unmapped.append(Unmapped(key, f"{json.dumps(v)}: Loom quantizes at "
                                                 "target_bits from the start (DeepSpeed's "
                                                 "quantize-in-forward path ignores start_bits "
                                                 "too)"))
            elif k == "quantization_period":
                out.unmapped.append(Unmapped(key, "Loom has no bit schedule (start_bits down to "
                                             "target_bits); it quantizes at target_bits"))
            else:
                out.unmapped.append(Unmapped(key, "not a parameter of DeepSpeed's weight "
                                             "quantization"))
        instance = header.split(".", 1)[1]
        for k, v in g.items():
            if k == "params":
                continue
            if k == "modules":
                if v == "*" or v == ["*"]:
                    catch_all.append((gp, instance))
                else:
                    globs = _module_globs(f"{gp}.modules", v, out)
                    if globs:
                        rules.append({"tensors": globs, "quantizer": instance})
            elif k == "related_modules":
                out.unmapped.append(Unmapped(f"{gp}.{k}", "only DeepSpeed's pruning uses "
                                             "related_modules; quantization ignores it"))
            else:
                out.unmapped.append(Unmapped(f"{gp}.{k}", "not a key of a DeepSpeed "
                                             "quantization group"))
        if "modules" not in g:  # DeepSpeed's default scope: "*", every compressible module
            catch_all.append((gp, instance))
        out.tables.append((header, t))
        out.removed.append(Removed(
            gp, f"ZeroQuant {bits}-bit weight quantization" if t["plugin"] == "zeroquant"
            else f"XTC {t['mode']} ({bits}-bit) weight quantization",
            f'[{header}] plugin "{t["plugin"]}"'))
        if t["plugin"] == "zeroquant":
            decoded = ("the dequantized weights equal, but +0.0 where DeepSpeed's are -0.0"
                       if symmetric else "the dequantized weights within 2^-21 max|w| of its "
                       "own")
            out.notes.append(f"{gp} is [{header}] (zeroquant, {bits} bits, range = "
                             "\"deepspeed\": DeepSpeed's divisor 2^b; its simulated "
                             f"quantizer's codes, scales and zero points exactly, {decoded} "
                             "(docs/quantization.md); Loom's own \"exact\" range maps max|w| "
                             "to the largest code)")
        else:
            rule = ("BWN, alpha = mean|w|; a zero weight decodes to +alpha" if bits == 1
                    else "TWN, Delta = 0.7 mean|w|")
            floats = ", activations stay float" if act_bits == 8 else ""
            out.notes.append(f"{gp} is [{header}] (xtc {t['mode']}: {rule}{floats})")

    _quantize_rules(p, rules, catch_all, out)


def _quantize_rules(p: str, rules: List[Dict[str, Any]], catch_all: List[Tuple[str, str]],
                    out: Conversion) -> None:
    """The [[quantize]] rules: the groups that name modules first (in the config's order),
    then one group over every module, then (without one) a rule that copies the rest."""
    if not rules and not catch_all:
        return
    if catch_all:
        first_gp, first = catch_all[0]
        rules.append({"tensors": ["*"], "quantizer": first})
        for gp, _ in catch_all[1:]:
            out.unmapped.append(Unmapped(
                f"{gp}.modules", f"every module (DeepSpeed's default scope) is {first_gp}'s "
                "already, and DeepSpeed refuses a module in two groups: no [[quantize]] rule "
                "names this group's instance"))
    else:
        rules.append({"tensors": ["*"], "copy": True})
    out.rules.extend(rules)
    out.notes.append(
        f"{p}'s modules are the manifest's [[quantize]] rules, for `loom quantize MANIFEST "
        "IN.safetensors OUT.safetensors` (first match wins): each DeepSpeed keyword K, a "
        "regular expression DeepSpeed searches in module names, is the tensor-name pattern "
        "'*K*' ('^' and '$' anchor it: '$' as K.weight; '\\w+' and '.*' become '*'; a '.' "
        "is a dot); loom quantize packs the 2-D float tensors a rule matches (Linear and "
        "Embedding weights) and copies the rest (biases, norms)" +
        ("; the last rule copies every tensor no group names" if not catch_all else
         f"; {catch_all[0][0]} names no modules (DeepSpeed's default, all of them), so its "
         "rule, last, takes every other 2-D tensor"))


def _module_globs(prefix: str, modules: Any, out: Conversion) -> List[str]:
    """The tensor-name patterns of a group's DeepSpeed ``modules`` keywords."""
    if isinstance(modules, str):
        modules = [modules]
    if not isinstance(modules, list):
        out.unmapped.append(Unmapped(prefix, f"must be a list of module-name patterns, not "
                                     f"{kind(modules)}"))
        return []
    globs: List[str] = []
    for i, kw in enumerate(modules):
        key = f"{prefix}[{i}]"
        if not isinstance(kw, str) or not kw:
            out.unmapped.append(Unmapped(key, f"must be a non-empty string, not "
                                         f"{json.dumps(kw)}"))
            continue
        glob, loose = _regex_glob(kw)
        if glob is None:
            out.unmapped.append(Unmapped(key, f"'{kw}': a regular expression with no "
                                         "tensor-name pattern equivalent (patterns have only * "
                                         "and ?): add a [[quantize]] rule for its tensors "
                                         "yourself, before the last rule"))
            continue
        if loose:
            out.notes.append(f"{key}: '{kw}' is the pattern '{glob}', which matches "
                             f"more names than DeepSpeed's {loose} ('*' also matches dots): "
                             "check loom quantize's per-tensor report")
        if glob not in globs:
            globs.append(glob)
    return globs


_LITERAL = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-/:")


def _regex_glob(regex: str) -> Tuple[Optional[str], Optional[str]]:
    """(pattern, loose) for a DeepSpeed module keyword: the tensor-name glob of the module
    names ``re.search(regex, name)`` finds, or (None, None) when the expression uses more
    than literals, '.', '.*', '.+', '\\w', '\\d' (with '+' or '*'), escaped punctuation and
    the anchors. ``loose`` names the part that matched fewer names in DeepSpeed."""
    start = regex.startswith("^")
    end = regex.endswith("$") and not regex.endswith("\\$")
    body = regex[1 if start else 0:len(regex) - 1 if end else len(regex)]
    out: List[str] = []
    loose: Optional[str] = None
    i = 0
    while i < len(body):
        c = body[i]
        nxt = body[i + 1] if i + 1 < len(body) else ""
        if c == "\\":
            if nxt in ("w", "d"):
                rep = body[i + 2] if i + 2 < len(body) else ""
                if rep in ("+", "*"):
                    out.append("*")
                    loose = loose or body[i:i + 3]
                    i += 3
                else:
                    out.append("?")
                    loose = loose or body[i:i + 2]
                    i += 2
            elif nxt in ".-_/:":
                out.append(nxt)
                i += 2
            else:
                return None, None
        elif c == ".":
            if nxt in ("*", "+"):
                out.append("*")
                i += 2
            else:
                out.append(".")  # module names join their parts with dots
                i += 1
        elif c in _LITERAL:
            out.append(c)
            i += 1
        else:
            return None, None
    if not out:
        return None, None
    return ("" if start else "*") + "".join(out) + (".weight" if end else "*"), loose
