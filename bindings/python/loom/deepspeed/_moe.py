"""A ``moe`` object holding the arguments of DeepSpeed's MoE layer
(``deepspeed.moe.layer.MoE``: num_experts, k, capacity_factor, ...)."""
from __future__ import annotations

import json
from typing import Any, Dict

from ._common import Conversion, Unmapped, as_int, is_number, kind

_MOE_REASONS = {
    "hidden_size": "the model width is the trainer's (the layer's model_dim); the experts' "
                   "hidden width is the trainer's [moe] hidden",
    "expert": "the experts are the moe plugin's two-layer MLPs (activation = gelu, relu or "
              "silu); their weights are the trainer's parameters",
    "use_tutel": "Loom's dispatch is its own (a stable counting sort by expert, gathered rows, "
                 "grouped GEMMs); there is no Tutel path to choose",
    "enable_expert_tensor_parallelism": "experts are not split by tensor parallelism in Loom "
                                        "(expert parallelism is ep_size)",
    "top2_2nd_expert_sampling": "Loom's second choice is the second-highest probability "
                                "(deterministic, in evaluation too); noisy_gate_policy = "
                                "\"RSample\" adds Gumbel noise to every choice in training",
    "enabled": "the section's presence declares the layer",
    "layers": "which blocks are MoE is the trainer's ([moe] layers)",
    "num_layers": "which blocks are MoE is the trainer's ([moe] layers)",
    "aux_loss_coef": "the aux loss coefficient is the trainer's ([moe] aux_loss_coef, or "
                     "your loss = task + coef * aux with loom.torch.MoE)",
    "moe_loss_coeff": "the aux loss coefficient is the trainer's ([moe] aux_loss_coef, or "
                      "your loss = task + coef * aux with loom.torch.MoE)",
}
_MOE_INTS = ("num_experts", "k", "min_capacity", "ep_size")
_MOE_FLOATS = ("capacity_factor", "eval_capacity_factor")
_MOE_BOOLS = ("drop_tokens", "use_rts", "use_residual")


def map_moe(cfg: Any, out: Conversion) -> None:
    if not isinstance(cfg, dict):
        out.unmapped.append(Unmapped("moe", f"must be an object holding DeepSpeed's MoE layer "
                                     f"arguments, not {kind(cfg)}"))
        return
    if cfg.get("enabled", True) is False:
        out.unmapped.append(Unmapped("moe", "enabled is false: nothing to map"))
        return
    t: Dict[str, Any] = {"plugin": "moe"}
    for k, v in cfg.items():
        key = f"moe.{k}"
        if k in _MOE_INTS:
            iv = as_int(v)
            if iv is None or iv < (0 if k == "min_capacity" else 1):
                out.unmapped.append(Unmapped(key, f"must be an integer >= "
                                             f"{0 if k == 'min_capacity' else 1}, not "
                                             f"{json.dumps(v)}"))
            else:
                t[k] = iv
        elif k in _MOE_FLOATS:
            if is_number(v) and v > 0:
                t[k] = float(v)
            else:
                out.unmapped.append(Unmapped(key, f"must be a number > 0, not {json.dumps(v)}"))
        elif k in _MOE_BOOLS:
            if isinstance(v, bool):
                t[k] = v
            else:
                out.unmapped.append(Unmapped(key, f"must be true or false, not {json.dumps(v)}"))
        elif k == "noisy_gate_policy":
            if v is None or v in ("None", "none"):
                t[k] = "none"
            elif v in ("Jitter", "RSample"):
                t[k] = v
            else:
                out.unmapped.append(Unmapped(key, f"{json.dumps(v)} is not a policy; DeepSpeed "
                                             "and Loom take None, Jitter or RSample"))
        elif k == "enabled":
            continue
        elif k in _MOE_REASONS:
            out.unmapped.append(Unmapped(key, _MOE_REASONS[k]))
        else:
            out.unmapped.append(Unmapped(key, "not an argument of DeepSpeed's MoE layer"))
    if "num_experts" not in t:
        # DeepSpeed's MoE defaults to 1 expert; Loom's parameter to 8. Keep DeepSpeed's.
        t["num_experts"] = 1
        out.notes.append("moe without num_experts has one expert in DeepSpeed (its default); "
                         "the manifest says num_experts = 1 (Loom's own default is 8)")
    if "use_rts" not in t:
        t["use_rts"] = True
        out.notes.append("moe: DeepSpeed's use_rts defaults to true (random token selection "
                         "in training); Loom's defaults to false, so the manifest sets "
                         "use_rts = true")
    if int(t.get("k", 1)) == 2 and cfg.get("top2_2nd_expert_sampling", True) is not False:
        out.notes.append("moe: k = 2: DeepSpeed samples the second expert with Gumbel noise by "
                         "default (in evaluation too); Loom takes the second-highest "
                         "probability, deterministically")
    e, k_, ep = int(t["num_experts"]), int(t.get("k", 1)), int(t.get("ep_size", 1))
    if k_ > e:
        out.notes.append(f"moe: k = {k_} is more than num_experts = {e}: loom check refuses it")
    if ep > 1:
        if e % ep != 0:
            out.notes.append(f"moe: num_experts = {e} is not a multiple of ep_size = {ep}: loom "
                             "check refuses it")
        if not any(h == "comm.world" for h, _ in out.tables):
            out.tables.append(("comm.world", {"plugin": "ucx"}))
        t["comm"] = "world"
        out.notes.append(f"moe: ep_size = {ep} splits [comm.world] (ucx; nccl for device "
                         "memory) into expert-parallel groups of consecutive ranks")
    out.tables.append(("moe.experts", t))
    out.notes.append("moe is [moe.experts]: the trainer's [moe] instance = \"experts\" (or "
                     "loom.torch.MoE(session.instance(\"moe\", \"experts\"), ...)); DeepSpeed's "
                     "capacity C = max(ceil(k * capacity_factor * S / E), min_capacity) is the "
                     "plugin's")
