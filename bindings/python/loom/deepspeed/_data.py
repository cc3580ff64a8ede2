"""DeepSpeed's data efficiency: the legacy ``curriculum_learning`` (sequence-length warmup),
``data_efficiency.data_sampling``'s curriculum metrics, and random-LTD, in its current place
(``data_efficiency.data_routing.random_ltd``) and in the older one of DeepSpeed before 0.8
that Megatron-DeepSpeed's ``examples/random_ltd`` configs use (``dynamic_train.random_ltd``,
keys spelled ``randomltd_*``)."""
from __future__ import annotations

import json
import shlex
from typing import Any, Dict, Optional

from ._common import (Conversion, Unmapped, analyze_path, as_int, is_number, safe_name)

def _schedule(prefix: str, cfg: Dict[str, Any], out: Conversion, *,
              seqlen: bool) -> Optional[Dict[str, Any]]:
    """The parameters of a Loom schedule for a DeepSpeed difficulty schedule (the keys
    min_difficulty, max_difficulty, schedule_type, schedule_config)."""
    typ = cfg.get("schedule_type")
    allowed = ("fixed_linear", "fixed_root") if seqlen else ("fixed_linear", "fixed_root",
                                                              "fixed_discrete")
    if typ == "custom":
        out.unmapped.append(Unmapped(f"{prefix}.schedule_type", "a custom schedule is a Loom "
                                     "plugin of kind loom.curriculum/1 that implements 'at'; "
                                     "name it in the manifest yourself"))
        return None
    if typ not in allowed:
        why = ("sequence-length warmup (seqlen_warmup) takes fixed_linear or fixed_root"
               if seqlen else "Loom's schedules are fixed_linear, fixed_root and fixed_discrete")
        out.unmapped.append(Unmapped(f"{prefix}.schedule_type", f"'{typ}': {why}"))
        return None
    t: Dict[str, Any] = {}
    if seqlen:
        t["plugin"] = "seqlen_warmup"
        t["schedule_type"] = typ
    else:
        t["plugin"] = typ
    sc = cfg.get("schedule_config", {})
    if not isinstance(sc, dict):
        out.unmapped.append(Unmapped(f"{prefix}.schedule_config", "must be an object"))
        sc = {}
    for k in ("min_difficulty", "max_difficulty"):
        if k not in cfg:
            continue
        v = cfg[k]
        if typ == "fixed_discrete":
            out.unmapped.append(Unmapped(f"{prefix}.{k}", "fixed_discrete's range is its "
                                         "difficulty list; it takes no bounds"))
        elif seqlen:
            iv = as_int(v)
            if iv is None:
                out.unmapped.append(Unmapped(f"{prefix}.{k}", f"a sequence length must be an "
                                             f"integer, not {json.dumps(v)}"))
            else:
                t[k] = iv
        elif is_number(v):
            t[k] = float(v)
        else:
            out.unmapped.append(Unmapped(f"{prefix}.{k}", f"must be a number, not "
                                         f"{json.dumps(v)}"))
    wanted = {"fixed_linear": ("total_curriculum_step", "difficulty_step"),
              "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
              "fixed_discrete": ("difficulty", "max_step")}[typ]
    for k, v in sc.items():
        key = f"{prefix}.schedule_config.{k}"
        if k not in wanted:
            out.unmapped.append(Unmapped(key, f"not used by {typ} (it takes "
                                         f"{', '.join(wanted)})"))
        elif k in ("total_curriculum_step", "difficulty_step"):
            iv = as_int(v)
            if iv is None:
                out.unmapped.append(Unmapped(key, f"must be an integer, not {json.dumps(v)}"))
            else:
                t[k] = iv
        elif k == "root_degree":
            if is_number(v):
                t[k] = float(v)
            else:
                out.unmapped.append(Unmapped(key, f"must be a number, not {json.dumps(v)}"))
        elif k == "difficulty":
            if isinstance(v, list) and all(is_number(x) for x in v):
                t[k] = [float(x) for x in v]
            else:
                out.unmapped.append(Unmapped(key, "must be a list of numbers"))
        elif k == "max_step":
            if isinstance(v, list) and all(as_int(x) is not None for x in v):
                t[k] = [as_int(x) for x in v]
            else:
                out.unmapped.append(Unmapped(key, "must be a list of integers"))
    return t


def map_legacy_curriculum(cfg: Any, out: Conversion) -> None:
    if not isinstance(cfg, dict):
        out.unmapped.append(Unmapped("curriculum_learning", "must be an object"))
        return
    if not cfg.get("enabled", False):
        out.unmapped.append(Unmapped("curriculum_learning", "enabled is false (or missing): "
                                     "nothing to map"))
        return
    ctype = cfg.get("curriculum_type")
    if ctype != "seqlen":
        out.unmapped.append(Unmapped("curriculum_learning.curriculum_type",
                                     f"'{ctype}': the legacy curriculum is sequence-length "
                                     "warmup only ('seqlen')"))
        return
    for k in cfg:
        if k not in ("enabled", "curriculum_type", "min_difficulty", "max_difficulty",
                     "schedule_type", "schedule_config"):
            out.unmapped.append(Unmapped(f"curriculum_learning.{k}", "not a key of DeepSpeed's "
                                         "legacy curriculum"))
    t = _schedule("curriculum_learning", cfg, out, seqlen=True)
    if t is not None:
        t = {"plugin": t.pop("plugin"), "mode": "truncate", **t}
        out.tables.append(("curriculum.seqlen", t))
        out.notes.append("curriculum_learning (seqlen) is [curriculum.seqlen], a seqlen_warmup "
                         "schedule: the trainer cuts each batch to its seq_len (mode "
                         "truncate), as DeepSpeed's curriculum_seqlen asks the model to")


# DeepSpeed's metric names (the config's curriculum_metrics keys, which its examples choose
# freely) -> Loom's bundled metric, looked up lowercased without '_' and '-': DeepSpeed's
# docs say "vocabularyrarity", its data analyzer "vocab_rarity", the GPT configs
# "vocabrarity" and Megatron-DeepSpeed's run scripts "voc"; "seqlen" counts non-padding
# tokens in both. ("seqlenvocabrarity" weighs the length in with a coefficient of its own:
# no bundled Loom metric.)
_METRIC_PLUGINS = {"vocabularyrarity": "vocabulary_rarity", "vocabrarity": "vocabulary_rarity",
                   "voc": "vocabulary_rarity", "seqlen": "seqlen"}


def metric_plugin(name: str) -> Optional[str]:
    """Loom's bundled metric for a DeepSpeed metric name, or None."""
    return _METRIC_PLUGINS.get(str(name).lower().replace("-", "").replace("_", ""))


def map_data_efficiency(cfg: Any, out: Conversion) -> None:
    if not isinstance(cfg, dict):
        out.unmapped.append(Unmapped("data_efficiency", "must be an object"))
        return
    if not cfg.get("enabled", False):
        out.unmapped.append(Unmapped("data_efficiency", "enabled is false (or missing): "
                                     "nothing to map"))
        return
    for k, v in cfg.items():
        if k == "enabled":
            continue
        if k == "seed":
            out.unmapped.append(Unmapped("data_efficiency.seed", "the sampler's seed is passed "
                                         "by the trainer with every call (loom train's seed)"))
        elif k == "data_sampling":
            _data_sampling(v, out)
        elif k == "data_routing":
            _data_routing(v, out)
        else:
            out.unmapped.append(Unmapped(f"data_efficiency.{k}", "not a key of DeepSpeed's "
                                         "data_efficiency"))


def _data_sampling(cfg: Any, out: Conversion) -> None:
    p = "data_efficiency.data_sampling"
    if not isinstance(cfg, dict) or not cfg.get("enabled", False):
        out.unmapped.append(Unmapped(p, "enabled is false (or missing): nothing to map"))
        return
    sampler_done = False
    for k, v in cfg.items():
        if k == "enabled":
            continue
        if k == "num_epochs":
            out.unmapped.append(Unmapped(f"{p}.num_epochs", "the run's length is the "
                                         "trainer's; the sampler starts a new pass whenever "
                                         "one is spent"))
        elif k == "num_workers":
            out.unmapped.append(Unmapped(f"{p}.num_workers", "data loader workers are the "
                                         "trainer's"))
        elif k == "curriculum_learning":
            sampler_done = _metrics(f"{p}.curriculum_learning", v, out)
        else:
            out.unmapped.append(Unmapped(f"{p}.{k}", "not a key of DeepSpeed's data_sampling"))
    if not sampler_done:
        out.tables.append(("sampler.data", {"plugin": "curriculum_sampler",
                                            "clustering_type": "single_cluster"}))
        out.notes.append("data_sampling without a curriculum metric is [sampler.data], an "
                         "epoch-shuffled curriculum_sampler (single_cluster)")


def _data_routing(cfg: Any, out: Conversion) -> None:
    p = "data_efficiency.data_routing"
    if not isinstance(cfg, dict) or not cfg.get("enabled", False):
        out.unmapped.append(Unmapped(p, "enabled is false (or missing): nothing to map"))
        return
    for k, v in cfg.items():
        if k == "enabled":
            continue
        if k == "random_ltd":
            _random_ltd(f"{p}.random_ltd", v, out)
        else:
            out.unmapped.append(Unmapped(f"{p}.{k}", "not a key of DeepSpeed's data_routing"))


_LTD_REASONS = {
    "total_layer_num": "the router learns the model's layer count at its first plan",
    "random_ltd_layer_num": "implied by layers (the list of routed layers)",
    "model_mask_name": "the trainer applies the attention mask among the kept positions",
    "model_type": "the trainer's model decides how routed layers attend",
    "hidden_state_order": "the router takes [batch, seq, channels] and [seq, batch, "
                          "channels] storage alike (free batch and position strides)",
    "global_batch_size": "the trainer passes the batch to the router's advance",
    "micro_batch_size": "the trainer passes the batch to the router's advance",
    "layer_token_lr_schedule": "the learning rate by layer tokens is the trainer's "
                               "(loom train: [train] lr_unit = \"layer_tokens\")",
}


# The older layout's spellings (DeepSpeed before 0.8, Megatron-DeepSpeed's
# examples/random_ltd): dynamic_train.random_ltd.randomltd_* -> the current names.
_LTD_LEGACY_KEYS = {"randomltd_layer_id": "random_ltd_layer_id",
                    "randomltd_layer_num": "random_ltd_layer_num",
                    "randomltd_schedule": "random_ltd_schedule"}


def _random_ltd(p: str, cfg: Any, out: Conversion, *, legacy: bool = False) -> None:
    if not isinstance(cfg, dict) or not cfg.get("enabled", False):
        out.unmapped.append(Unmapped(p, "enabled is false (or missing): nothing to map"))
        return
    previous = next((h for h, _ in out.tables if h == "router.ltd"), None)
    if previous is not None:
        out.unmapped.append(Unmapped(p, "a second random-LTD section: [router.ltd] is mapped "
                                     "from the first one already"))
        return
    t: Dict[str, Any] = {"plugin": "random_ltd"}
    for k, v in cfg.items():
        key = f"{p}.{k}"
        k = _LTD_LEGACY_KEYS.get(k, k) if legacy else k
        if k == "enabled":
            continue
        if k == "random_ltd_layer_id":
            ids = [as_int(x) for x in v] if isinstance(v, list) else None
            if ids is None or any(i is None or i < 0 for i in ids):
                out.unmapped.append(Unmapped(key, "must be a list of layer indices >= 0"))
            else:
                t["layers"] = sorted(set(ids))
                if len(t["layers"]) != len(ids) or t["layers"] != ids:
                    out.notes.append(f"{key}: layers are listed sorted and once each")
        elif k == "random_ltd_schedule":
            if not isinstance(v, dict):
                out.unmapped.append(Unmapped(key, "must be an object"))
                continue
            _ltd_schedule(key, v, t, out)
        elif k in _LTD_REASONS:
            out.unmapped.append(Unmapped(key, _LTD_REASONS[k]))
        else:
            out.unmapped.append(Unmapped(key, "not a key of DeepSpeed's random_ltd"))
    out.tables.append(("router.ltd", t))
    if legacy:
        out.notes.append(f"{p} is the layout of DeepSpeed before 0.8 (Megatron-DeepSpeed's "
                         "examples/random_ltd; randomltd_* keys): mapped as today's "
                         "data_efficiency.data_routing.random_ltd")
    out.notes.append("random_ltd is [router.ltd]: the trainer routes with it ([routing] router "
                     "= \"ltd\" in a loom train config)")


def _ltd_schedule(key: str, v: Dict[str, Any], t: Dict[str, Any], out: Conversion) -> None:
    for sk, sv in v.items():
        skey = f"{key}.{sk}"
        if sk in ("min_value", "max_value"):
            iv = as_int(sv)
            if iv is None:
                out.unmapped.append(Unmapped(skey, f"must be an integer, not {json.dumps(sv)}"))
            else:
                t[sk] = iv
        elif sk == "schedule_type":
            if sv == "fixed_linear":
                t[sk] = sv
            else:
                out.unmapped.append(Unmapped(skey, f"'{sv}': random_ltd's schedule is "
                                             "fixed_linear"))
        elif sk == "schedule_config":
            if not isinstance(sv, dict):
                out.unmapped.append(Unmapped(skey, "must be an object"))
                continue
            for ck, cv in sv.items():
                iv = as_int(cv)
                if ck in ("require_steps", "seq_per_step") and iv is not None:
                    t[ck] = iv
                elif ck == "saving_layer_tokens":
                    out.unmapped.append(Unmapped(
                        f"{skey}.{ck}", "not a setting of Loom's random_ltd: the router counts "
                        "the layer tokens itself (router_advance; kept in its exported "
                        "state)"))
                else:
                    out.unmapped.append(Unmapped(
                        f"{skey}.{ck}", "random_ltd takes require_steps and seq_per_step "
                        "(integers)"))
        else:
            out.unmapped.append(Unmapped(skey, "not a key of DeepSpeed's random_ltd_schedule"))


def map_dynamic_train(cfg: Any, out: Conversion) -> None:
    """``dynamic_train``: where DeepSpeed before 0.8 kept random-LTD (Megatron-DeepSpeed's
    examples/random_ltd configs), mapped as ``data_efficiency.data_routing.random_ltd``."""
    if not isinstance(cfg, dict):
        out.unmapped.append(Unmapped("dynamic_train", "must be an object"))
        return
    for k, v in cfg.items():
        if k == "random_ltd":
            _random_ltd("dynamic_train.random_ltd", v, out, legacy=True)
        else:
            out.unmapped.append(Unmapped(f"dynamic_train.{k}", "not a key of the pre-0.8 "
                                         "dynamic_train section (it holds random_ltd)"))


def _metrics(p: str, cfg: Any, out: Conversion) -> bool:
    """Maps curriculum_metrics; True when it declared the sampler."""
    if not isinstance(cfg, dict) or not cfg.get("enabled", False):
        out.unmapped.append(Unmapped(p, "enabled is false (or missing): nothing to map"))
        return False
    sampler = False
    for k, v in cfg.items():
        if k == "enabled":
            continue
        if k == "data_cluster_path":
            out.unmapped.append(Unmapped(f"{p}.data_cluster_path", "Loom's sampler writes no "
                                         "cluster files: clusters follow from the schedule and "
                                         "resume from the exported state"))
        elif k == "curriculum_metrics":
            if not isinstance(v, dict):
                out.unmapped.append(Unmapped(f"{p}.curriculum_metrics", "must be an object"))
                continue
            for name, m in v.items():
                sampler = _metric(f"{p}.curriculum_metrics.{name}", name, m, out,
                                  sampler) or sampler
        else:
            out.unmapped.append(Unmapped(f"{p}.{k}", "not a key of DeepSpeed's "
                                         "curriculum_learning"))
    return sampler


def _metric(p: str, name: str, m: Any, out: Conversion, have_sampler: bool) -> bool:
    if not isinstance(m, dict):
        out.unmapped.append(Unmapped(p, "must be an object"))
        return False
    safe = safe_name(name)
    sched_keys = ("min_difficulty", "max_difficulty", "schedule_type", "schedule_config")
    if name in ("seqlen_truncate", "seqlen_reshape"):
        t = _schedule(p, m, out, seqlen=True)
        for k in m:
            if k not in sched_keys:
                out.unmapped.append(Unmapped(f"{p}.{k}", f"{name} is sequence-length warmup "
                                             "(seqlen_warmup); it reads no index"))
        if t is not None:
            mode = "truncate" if name == "seqlen_truncate" else "reshape"
            out.tables.append((f"curriculum.{safe}",
                               {"plugin": t.pop("plugin"), "mode": mode, **t}))
        return False
    if have_sampler:
        out.unmapped.append(Unmapped(p, "Loom's curriculum_sampler follows one metric; "
                                     "DeepSpeed's intersection of several is not mapped (this "
                                     "manifest follows the first)"))
        return False
    t = _schedule(p, m, out, seqlen=False)
    if t is None:
        return False
    plugin = metric_plugin(name)
    index = f"{safe}-index"
    if plugin is not None:
        out.tables.append((f"curriculum.{safe}", {"plugin": plugin}))
        if name != plugin:
            out.notes.append(f"metric '{name}' is [curriculum.{safe}], Loom's {plugin} "
                             f"({_METRIC_MEANING[plugin]})")
        if m.get("clustering_type") != "single_cluster":  # single_cluster reads no index
            out.analyze.append((f"curriculum.{safe}", {"plugin": plugin}))
            out.notes.append(_analyze_hint(safe, index, out))
    else:
        out.notes.append(f"metric '{name}' has no bundled Loom metric (seqlen, "
                         "vocabulary_rarity); [sampler.data] reads an index written for a "
                         f"[curriculum.{safe}] metric plugin of your own (loom data analyze "
                         f"with that plugin, --metric {safe}, into '{index}')")
    out.tables.append((f"curriculum.{safe}_schedule", t))
    s: Dict[str, Any] = {"plugin": "curriculum_sampler", "schedule": f"{safe}_schedule",
                         "index": index, "metric": safe}
    for k, v in m.items():
        if k in sched_keys:
            continue
        key = f"{p}.{k}"
        if k in ("difficulty_type", "clustering_type"):
            allowed = (("value", "percentile") if k == "difficulty_type"
                       else ("schedule_based", "single_cluster"))
            if v in allowed:
                s[k] = v
            else:
                out.unmapped.append(Unmapped(key, f"'{v}' is not one of {', '.join(allowed)}"))
        elif k == "index_to_sample_path":
            out.unmapped.append(Unmapped(key, "DeepSpeed's index files are not Loom's: "
                                         "`loom data analyze` writes Loom's into the folder "
                                         f"'{index}', [sampler.data]'s index (" +
                                         ("the command is in the notes)" if plugin else
                                          "with a metric plugin of your own)")))
        elif k == "index_to_metric_path":
            out.unmapped.append(Unmapped(key, "Loom's index is one folder, written by `loom data "
                                         f"analyze` (see index_to_sample_path): '{index}'"))
        else:
            out.unmapped.append(Unmapped(key, "not a key of a DeepSpeed curriculum metric"))
    out.tables.append(("sampler.data", s))
    return True


_METRIC_MEANING = {
    "vocabulary_rarity": "a sample's sum of -log p(t) over its tokens, DeepSpeed's vocab_rarity",
    "seqlen": "a sample's count of tokens that are not padding",
}


def _analyze_hint(metric: str, index: str, out: Conversion) -> str:
    """The note that says how to build the sampler's index: the exact command, on the
    analyzer's manifest written beside the converted one."""
    q = shlex.quote
    if out.manifest_path:
        manifest = out.manifest_path
        amanifest = analyze_path(manifest)
        where = (f"{amanifest} (written beside {manifest}) declares [curriculum.{metric}] "
                 f"alone: the analyzer cannot open {manifest} itself, whose [sampler.data] "
                 "opens the index when it is created")
    else:
        amanifest = "RUN.analyze.toml"
        where = ("RUN.analyze.toml is the manifest that `python3 -m loom.deepspeed CONFIG -o "
                 f"RUN.toml` writes beside RUN.toml (Conversion.analyze_manifest): "
                 f"[curriculum.{metric}] alone, since the analyzer cannot open the converted "
                 "manifest, whose [sampler.data] opens the index when it is created")
    cmd = (f"mkdir -p {q(index)} && loom data analyze {q(amanifest)} --dataset DATA.bin "
           f"--seq-len L --output {q(index)} --metric {q(metric)}")
    return (f"[sampler.data] reads the index of [curriculum.{metric}] from the folder "
            f"'{index}', relative to the working directory of the run; build it there, before "
            f"the run, with: {cmd}   ({where}; DATA.bin is the dataset `loom data prepare` "
            "wrote and L the trainer's seq_len, the same as the run's: "
            "docs/data.md, \"The data analyzer\")")
