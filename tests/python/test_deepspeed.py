"""loom.from_deepspeed / python -m loom.deepspeed: DeepSpeed configs to Loom manifests, every
key either carried or listed with a reason; the manifests validate against the plugins."""
import json
import os
import subprocess
import sys

import pytest

import loom
from loom.deepspeed import convert

from conftest import PACKAGE_DIR

FULL = {
    "train_batch_size": 64,
    "gradient_accumulation_steps": 2,
    "steps_per_print": 10,
    "optimizer": {"type": "OneBitAdam", "params": {
        "lr": 4e-4, "betas": [0.9, 0.98], "eps": 1e-8, "weight_decay": 0.01,
        "freeze_step": 23000, "cuda_aware": False, "comm_backend_name": "mpi",
        "amsgrad": False, "bias_correction": False}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 1000}},
    "fp16": {"enabled": True, "loss_scale": 0},
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 0},
    "curriculum_learning": {
        "enabled": True, "curriculum_type": "seqlen", "min_difficulty": 80,
        "max_difficulty": 2048, "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 110000, "difficulty_step": 8}},
    "data_efficiency": {"enabled": True, "seed": 1234, "data_sampling": {
        "enabled": True, "num_epochs": 1, "num_workers": 0, "curriculum_learning": {
            "enabled": True, "data_cluster_path": "/tmp/clusters", "curriculum_metrics": {
                "vocabularyrarity": {
                    "index_to_sample_path": "/d/voc_index_to_sample_percentile_merged",
                    "index_to_metric_path": "/d/voc_index_to_metric",
                    "difficulty_type": "percentile", "clustering_type": "schedule_based",
                    "min_difficulty": 1, "max_difficulty": 100, "schedule_type": "fixed_root",
                    "schedule_config": {"total_curriculum_step": 110000, "difficulty_step": 1,
                                        "root_degree": 2}}}}},
        "data_routing": {"enabled": False}},
    "moe": {"enabled": True},
}


def validate(conv):
    """The manifest as loom check sees it: parsed, plugins loaded, parameters validated."""
    loom.Session.from_string(conv.manifest, "converted.toml", validate_only=True,
                             log_level="error").close()


def unmapped(conv):
    return {u.key: u.reason for u in conv.unmapped}


@pytest.mark.parametrize("typ,plugin", [
    ("Adam", "adam"), ("AdamW", "adam"), ("Lamb", "lamb"), ("OneBitAdam", "onebit_adam"),
    ("ZeroOneAdam", "zero_one_adam"), ("OneBitLamb", "onebit_lamb"), ("onebitadam", "onebit_adam"),
])
def test_each_optimizer_type_maps_to_its_plugin(typ, plugin):
    conv = loom.from_deepspeed({"optimizer": {"type": typ, "params": {
        "lr": 1e-3, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1}}})
    t = conv.instance("optimizer.main")
    assert t["plugin"] == plugin
    assert (t["betas"], t["eps"], t["weight_decay"]) == ([0.8, 0.99], 1e-6, 0.1)
    assert "learning rate per step" in unmapped(conv)["optimizer.params.lr"]
    if plugin.startswith(("onebit", "zero_one")):
        assert (t["comm"], t["codec"], t["bias_correction"]) == ("world", "onebit", False)
        assert conv.instance("comm.world") == {"plugin": "ucx"}
        assert conv.instance("codec.onebit") == {"plugin": "onebit"}
    validate(conv)


def test_type_specific_parameters():
    conv = convert({"optimizer": {"type": "ZeroOneAdam", "params": {
        "var_freeze_step": 1000, "var_update_scaler": 16, "local_step_scaler": 1000,
        "local_step_clipper": 16.0, "freeze_step": 20}}})
    t = conv.instance("optimizer.main")
    assert t["local_step_clipper"] == 16 and isinstance(t["local_step_clipper"], int)
    assert (t["var_freeze_step"], t["local_step_scaler"]) == (1000, 1000)
    # 0/1 Adam has no freeze_step (DeepSpeed's own test sets one that it ignores).
    assert "not a parameter of Loom's 'zero_one_adam'" in unmapped(conv)["optimizer.params.freeze_step"]
    validate(conv)
    conv = convert({"optimizer": {"type": "OneBitLamb", "params": {
        "max_coeff": 0.3, "min_coeff": 0.01, "coeff_beta": 0.9, "factor_max": 1.0,
        "factor_min": 0.5, "factor_threshold": 0.1, "freeze_step": 1000}}})
    assert conv.instance("optimizer.main")["factor_max"] == 1.0
    validate(conv)


def test_adam_modes():
    t = convert({"optimizer": {"type": "Adam", "params": {}}}).instance("optimizer.main")
    assert t["adam_w_mode"] is True  # DeepSpeed's Adam is AdamW unless told otherwise
    t = convert({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}).instance(
        "optimizer.main")
    assert t["adam_w_mode"] is False
    conv = convert({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}})
    assert conv.instance("optimizer.main")["adam_w_mode"] is True
    assert any("ignored by DeepSpeed for type AdamW" in n for n in conv.notes)


def test_keys_it_cannot_map_say_why():
    conv = convert({"optimizer": {"type": "Lamb", "params": {
        "amsgrad": True, "torch_adam": True, "max_grad_norm": 1.0, "momentum": 0.9,
        "eps_inside_sqrt": True, "betas": [0.9], "weight_decay": "big"}}})
    u = unmapped(conv)
    assert "no AMSGrad" in u["optimizer.params.amsgrad"]
    assert "torch.optim's arithmetic" in u["optimizer.params.torch_adam"]
    assert "gradient clipping" in u["optimizer.params.max_grad_norm"]
    assert "outside the square root" in u["optimizer.params.eps_inside_sqrt"]
    assert "not a parameter of Loom's 'lamb' (it takes betas" in u["optimizer.params.momentum"]
    assert "list of two numbers" in u["optimizer.params.betas"]
    assert "finite number" in u["optimizer.params.weight_decay"]
    assert set(conv.instance("optimizer.main")) == {"plugin"}
    validate(conv)
    conv = convert({"optimizer": {"type": "OneBitAdam", "params": {"freeze_step": 2.5}}})
    assert "must be an integer, not 2.5" in unmapped(conv)["optimizer.params.freeze_step"]


def test_an_unsupported_optimizer_type():
    conv = convert({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert conv.instance("optimizer.main") is None
    assert "type 'SGD' has no Loom plugin" in unmapped(conv)["optimizer"]


def test_a_full_config_every_key_accounted_for():
    conv = convert(FULL)
    u = unmapped(conv)
    for key in ("train_batch_size", "gradient_accumulation_steps", "steps_per_print", "scheduler",
                "fp16", "gradient_clipping", "zero_optimization",
                "optimizer.params.lr", "optimizer.params.cuda_aware", "optimizer.params.amsgrad",
                "data_efficiency.seed", "data_efficiency.data_routing",  # disabled
                "data_efficiency.data_sampling.num_epochs",
                "data_efficiency.data_sampling.num_workers",
                "data_efficiency.data_sampling.curriculum_learning.data_cluster_path"):
        assert key in u, key
    metric = "data_efficiency.data_sampling.curriculum_learning.curriculum_metrics.vocabularyrarity"
    assert "loom data analyze" in u[metric + ".index_to_sample_path"]
    assert "scheduler" in u["scheduler"] and "loom.torch.Optimizer" in u["scheduler"]
    assert "moe" not in u and conv.instance("moe.experts")["num_experts"] == 1

    opt = conv.instance("optimizer.main")
    assert opt == {"plugin": "onebit_adam", "comm": "world", "codec": "onebit",
                   "betas": [0.9, 0.98], "eps": 1e-8, "weight_decay": 0.01,
                   "bias_correction": False, "freeze_step": 23000}
    assert conv.instance("curriculum.seqlen") == {
        "plugin": "seqlen_warmup", "mode": "truncate", "schedule_type": "fixed_linear",
        "min_difficulty": 80, "max_difficulty": 2048, "total_curriculum_step": 110000,
        "difficulty_step": 8}
    assert conv.instance("curriculum.vocabularyrarity") == {"plugin": "vocabulary_rarity"}
    assert conv.instance("curriculum.vocabularyrarity_schedule") == {
        "plugin": "fixed_root", "min_difficulty": 1.0, "max_difficulty": 100.0,
        "total_curriculum_step": 110000, "difficulty_step": 1, "root_degree": 2.0}
    s = conv.instance("sampler.data")
    assert (s["schedule"], s["metric"], s["difficulty_type"]) == (
        "vocabularyrarity_schedule", "vocabularyrarity", "percentile")
    # Every reason is written into the manifest too, as comments.
    for k in u:
        assert f"#   {k}: not mapped: " in conv.manifest
    validate(conv)


def test_curriculum_schedules():
    conv = convert({"curriculum_learning": {
        "enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8.0,
        "max_difficulty": 512, "schedule_type": "fixed_discrete",
        "schedule_config": {"difficulty": [8, 512], "max_step": [10]}}})
    assert "seqlen_warmup" in unmapped(conv)["curriculum_learning.schedule_type"]
    conv = convert({"curriculum_learning": {"enabled": False}})
    assert "enabled is false" in unmapped(conv)["curriculum_learning"]
    conv = convert({"data_efficiency": {"enabled": True, "data_sampling": {
        "enabled": True, "curriculum_learning": {"enabled": True, "curriculum_metrics": {
            "seqlen_reshape": {"min_difficulty": 64, "max_difficulty": 1024,
                               "schedule_type": "fixed_root", "schedule_config": {
                                   "total_curriculum_step": 1000, "difficulty_step": 8,
                                   "root_degree": 2}},
            "other": {"schedule_type": "custom"},
            "stages": {"difficulty_type": "value", "clustering_type": "schedule_based",
                       "min_difficulty": 1, "max_difficulty": 3,
                       "schedule_type": "fixed_discrete",
                       "schedule_config": {"difficulty": [1, 2, 3], "max_step": [5, 10]}},
            "more": {"schedule_type": "fixed_linear"}}}}}})
    assert conv.instance("curriculum.seqlen_reshape")["mode"] == "reshape"
    assert conv.instance("curriculum.stages_schedule") == {
        "plugin": "fixed_discrete", "difficulty": [1.0, 2.0, 3.0], "max_step": [5, 10]}
    u = unmapped(conv)
    assert "takes no bounds" in u["data_efficiency.data_sampling.curriculum_learning."
                                  "curriculum_metrics.stages.min_difficulty"]
    assert "loom.curriculum/1" in u["data_efficiency.data_sampling.curriculum_learning."
                                    "curriculum_metrics.other.schedule_type"]
    assert "follows one metric" in u["data_efficiency.data_sampling.curriculum_learning."
                                     "curriculum_metrics.more"]
    assert any("no bundled Loom metric" in n for n in conv.notes)
    # The metric 'stages' has no bundled plugin, so no [curriculum.stages]: a manifest
    # that names it as the sampler's metric still validates (the name is the index's).
    validate(conv)


def test_random_ltd_is_a_router():
    conv = convert({"data_efficiency": {"enabled": True, "data_routing": {
        "enabled": True, "random_ltd": {
            "enabled": True, "total_layer_num": 24, "random_ltd_layer_num": 22,
            "random_ltd_layer_id": list(range(1, 23)), "model_mask_name": "attention_mask",
            "model_type": "decoder", "hidden_state_order": "seq_batch_dim",
            "random_ltd_schedule": {"min_value": 128, "max_value": 2048,
                                    "schedule_type": "fixed_linear",
                                    "schedule_config": {"require_steps": 200000,
                                                        "seq_per_step": 16}},
            "layer_token_lr_schedule": {"enabled": False}}}}})
    assert conv.instance("router.ltd") == {
        "plugin": "random_ltd", "layers": list(range(1, 23)), "min_value": 128,
        "max_value": 2048, "schedule_type": "fixed_linear", "require_steps": 200000,
        "seq_per_step": 16}
    u = unmapped(conv)
    p = "data_efficiency.data_routing.random_ltd."
    assert "layer count" in u[p + "total_layer_num"]
    assert "strides" in u[p + "hidden_state_order"]
    assert "lr_unit" in u[p + "layer_token_lr_schedule"]
    try:
        loom.describe_plugins("random_ltd")
    except loom.NotFoundError:
        pytest.skip("random_ltd is not built")
    validate(conv)


def test_a_config_that_is_not_an_object():
    with pytest.raises(ValueError, match="JSON object"):
        convert([1, 2])


def _cli(*args, cwd):
    env = dict(os.environ, PYTHONPATH=PACKAGE_DIR)
    return subprocess.run([sys.executable, "-m", "loom.deepspeed", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)


def test_command_line(tmp_path):
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps(FULL))
    r = _cli(str(cfg), "-o", str(tmp_path / "run.toml"), "--check", cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "run.toml").read_text()
    assert 'plugin = "onebit_adam"' in text and "freeze_step = 23000" in text
    lines = r.stderr.splitlines()
    assert f"{cfg}: optimizer.params.lr: not mapped: Loom takes the learning rate per step" \
        in "\n".join(lines)
    assert all(line.startswith(f"{cfg}: ") for line in lines)
    with loom.Session(str(tmp_path / "run.toml"), validate_only=True, log_level="error"):
        pass

    # The metric's index: the analyzer's manifest is written beside, and the note names it.
    analyze = (tmp_path / "run.analyze.toml").read_text()
    assert '[curriculum.vocabularyrarity]\nplugin = "vocabulary_rarity"' in analyze
    assert "[sampler" not in analyze and "[optimizer" not in analyze
    assert f"loom data analyze {tmp_path / 'run.analyze.toml'} --dataset DATA.bin" in text

    r = _cli(str(cfg), "-q", cwd=str(tmp_path))
    # on stdout, the notes name RUN.analyze.toml (no file is written beside stdout)
    assert r.returncode == 0 and r.stderr == "" and r.stdout == convert(str(cfg)).manifest
    assert "loom data analyze RUN.analyze.toml --dataset DATA.bin" in r.stdout

    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    r = _cli(str(bad), cwd=str(tmp_path))
    assert r.returncode == 1 and "bad.json: not JSON" in r.stderr
    r = _cli(str(tmp_path / "absent.json"), cwd=str(tmp_path))
    assert r.returncode == 1 and "absent.json" in r.stderr
    cfg.write_text(json.dumps({"optimizer": {"type": "Adam", "params": {"eps": 2.0}}}))
    r = _cli(str(cfg), "--check", cwd=str(tmp_path))
    assert r.returncode == 1 and "is not valid" in r.stderr and "'eps'" in r.stderr


def test_converted_adam_trains_as_torch_adam():
    torch = pytest.importorskip("torch")
    import loom.torch

    conv = loom.from_deepspeed({"optimizer": {"type": "Adam", "params": {
        "lr": 1e-2, "adam_w_mode": False, "weight_decay": 0.01, "betas": [0.9, 0.99]}}})
    g = torch.Generator().manual_seed(3)
    p0 = torch.randn(101, generator=g)
    a, b = p0.clone().requires_grad_(), p0.clone().requires_grad_()
    ref = torch.optim.Adam([a], lr=1e-2, weight_decay=0.01, betas=(0.9, 0.99))
    with loom.Session.from_string(conv.manifest) as s:
        opt = loom.torch.Optimizer([b], s.optimizer(), lr=1e-2)
        for _ in range(20):
            grad = torch.randn(101, generator=g)
            a.grad, b.grad = grad.clone(), grad.clone()
            ref.step()
            opt.step()
    assert ((a - b).norm() / a.norm()).item() < 1e-6


def test_a_manifest_with_deepspeed_keys_says_why():
    with pytest.raises(loom.InvalidArgumentError) as e:
        loom.Session.from_string('[optimizer.main]\nplugin = "adam"\nlr = 1e-3\namsgrad = false\n',
                                 "run.toml", validate_only=True)
    lines = str(e.value).splitlines()
    assert lines[0].startswith("run.toml:3:1: unknown parameter 'lr'")
    assert lines[0].endswith("'lr' is a DeepSpeed key: Loom takes the learning rate per step "
                             "from the trainer or its scheduler, not from the manifest")
    assert "'amsgrad' is a DeepSpeed key: Loom's optimizers have no AMSGrad" in lines[1]


# ---------------------------------------------------------------- moe and compression_training

DS_MOE = {"num_experts": 8, "k": 2, "capacity_factor": 1.25, "eval_capacity_factor": 2.0,
          "min_capacity": 4, "noisy_gate_policy": "RSample", "drop_tokens": False,
          "use_rts": False, "use_residual": True, "use_tutel": True, "hidden_size": 512,
          "top2_2nd_expert_sampling": False}


def test_moe_arguments_map_to_a_moe_section():
    conv = convert({"moe": DS_MOE})
    assert conv.instance("moe.experts") == {
        "plugin": "moe", "num_experts": 8, "k": 2, "capacity_factor": 1.25,
        "eval_capacity_factor": 2.0, "min_capacity": 4, "noisy_gate_policy": "RSample",
        "drop_tokens": False, "use_rts": False, "use_residual": True}
    u = unmapped(conv)
    assert set(u) == {"moe.use_tutel", "moe.hidden_size", "moe.top2_2nd_expert_sampling"}
    assert "second-highest probability" in u["moe.top2_2nd_expert_sampling"]
    validate(conv)


def test_moe_defaults_follow_deepspeed():
    conv = convert({"moe": {"num_experts": 4, "k": 2, "noisy_gate_policy": None}})
    t = conv.instance("moe.experts")
    assert t["noisy_gate_policy"] == "none"
    assert t["use_rts"] is True  # DeepSpeed's default, not Loom's
    assert any("use_rts defaults to true" in n for n in conv.notes)
    assert any("samples the second expert" in n for n in conv.notes)
    validate(conv)


def test_moe_expert_parallel_declares_a_comm():
    conv = convert({"moe": {"num_experts": 8, "ep_size": 4}})
    assert conv.instance("moe.experts")["ep_size"] == 4
    assert conv.instance("moe.experts")["comm"] == "world"
    assert conv.instance("comm.world") == {"plugin": "ucx"}


def test_moe_bad_values_are_listed():
    conv = convert({"moe": {"num_experts": 0, "k": 1.5, "capacity_factor": -1,
                            "noisy_gate_policy": "Gaussian", "drop_tokens": "yes"}})
    u = unmapped(conv)
    assert "integer >= 1" in u["moe.num_experts"] and "integer >= 1" in u["moe.k"]
    assert "> 0" in u["moe.capacity_factor"]
    assert "None, Jitter or RSample" in u["moe.noisy_gate_policy"]
    assert "true or false" in u["moe.drop_tokens"]
    assert "must be an object" in unmapped(convert({"moe": 3}))["moe"]


COMPRESSION = {
    "weight_quantization": {
        "shared_parameters": {
            "enabled": True, "quantizer_kernel": False, "schedule_offset": 0,
            "quantize_groups": 48, "quantize_verbose": False, "quantization_type": "symmetric",
            "quantize_weight_in_forward": True, "rounding": "nearest",
            "fp16_mixed_quantize": {"enabled": False, "quantize_change_ratio": 0.001}},
        "different_groups": {
            "wq1": {"params": {"start_bits": 8, "target_bits": 8, "quantization_period": 0},
                    "modules": ["attention.self", "intermediate"]},
            "wq2": {"params": {"start_bits": 12, "target_bits": 4},
                    "modules": ["output.dense"]},
            "wq3": {"params": {"start_bits": 2, "target_bits": 2}},
            "wq4": {"params": {"start_bits": 1, "target_bits": 1}}}},
    "activation_quantization": {
        "shared_parameters": {"enabled": True, "quantization_type": "symmetric",
                              "range_calibration": "dynamic", "schedule_offset": 0},
        "different_groups": {"aq1": {"params": {"bits": 8}, "modules": ["attention.self"]}}},
    "sparse_pruning": {"shared_parameters": {"enabled": True, "method": "l1"}},
}


def test_compression_training_maps_to_quantizer_sections():
    conv = convert({"compression_training": COMPRESSION})
    assert conv.instance("quantizer.wq1") == {
        "plugin": "zeroquant", "bits": 8, "symmetric": True, "group_size": 0,
        "range": "deepspeed", "activation_bits": 8}
    assert conv.instance("quantizer.wq2")["bits"] == 4
    assert conv.instance("quantizer.wq2")["activation_bits"] == 8  # W4A8
    assert conv.instance("quantizer.wq3") == {"plugin": "xtc", "mode": "ternary",
                                              "group_size": 0}
    assert conv.instance("quantizer.wq4") == {"plugin": "xtc", "mode": "binary",
                                              "group_size": 0}
    u = unmapped(conv)
    p = "compression_training.weight_quantization"
    assert "48 equal contiguous chunks" in u[f"{p}.shared_parameters.quantize_groups"]
    assert "group_size = in_features / c" in u[f"{p}.shared_parameters.quantize_groups"]
    assert "no bit schedule" in u[f"{p}.different_groups.wq1.params.quantization_period"]
    assert "target_bits from the start" in u[f"{p}.different_groups.wq2.params.start_bits"]
    assert f"{p}.different_groups.wq1.params.start_bits" not in u  # start = target
    # modules are loom quantize's rules: the groups that name modules first, then the first
    # group over every module (DeepSpeed's default scope); a second such group gets none
    assert conv.rules == [
        {"tensors": ["*attention.self*", "*intermediate*"], "quantizer": "wq1"},
        {"tensors": ["*output.dense*"], "quantizer": "wq2"},
        {"tensors": ["*"], "quantizer": "wq3"}]
    assert f"{p}.different_groups.wq1.modules" not in u
    assert "wq3's already" in u[f"{p}.different_groups.wq4.modules"]
    assert "[[quantize]]\ntensors = [\"*output.dense*\"]\nquantizer = \"wq2\"" in conv.manifest
    assert f"{p}.shared_parameters.quantize_weight_in_forward" not in u  # true is Loom's
    assert f"{p}.shared_parameters.rounding" not in u
    assert "pruning" in u["compression_training.sparse_pruning"]
    assert "when quantization starts" in u[
        "compression_training.activation_quantization.shared_parameters.schedule_offset"]
    validate(conv)


def test_compression_without_activations_is_weight_only():
    cfg = {"weight_quantization": {
        "shared_parameters": {"enabled": True, "quantization_type": "asymmetric",
                              "rounding": "stochastic"},
        "different_groups": {"g": {"params": {"target_bits": 8}}}}}
    conv = convert({"compression_training": cfg})
    t = conv.instance("quantizer.g")
    assert t["activation_bits"] == 0 and t["symmetric"] is False
    assert "nearest" in unmapped(conv)[
        "compression_training.weight_quantization.shared_parameters.rounding"]
    validate(conv)


def test_activation_bits_other_than_8_and_static_ranges_are_listed():
    cfg = {"weight_quantization": {"shared_parameters": {"enabled": True},
                                   "different_groups": {"g": {"params": {"target_bits": 8}}}},
           "activation_quantization": {
               "shared_parameters": {"enabled": True, "range_calibration": "static"},
               "different_groups": {"a": {"params": {"bits": 4}}}}}
    conv = convert({"compression_training": cfg})
    u = unmapped(conv)
    p = "compression_training.activation_quantization"
    assert "INT8 activations (8)" in u[f"{p}.different_groups.a.params.bits"]
    assert "dynamic" in u[f"{p}.shared_parameters.range_calibration"]
    assert conv.instance("quantizer.g")["activation_bits"] == 0


def test_asymmetric_w8a8_falls_back_to_weight_only_with_a_reason():
    cfg = dict(COMPRESSION)
    cfg["weight_quantization"] = {
        "shared_parameters": {"enabled": True, "quantization_type": "asymmetric"},
        "different_groups": {"g": {"params": {"target_bits": 8}},
                             "t": {"params": {"target_bits": 2}}}}
    conv = convert({"compression_training": cfg})
    assert conv.instance("quantizer.g")["activation_bits"] == 0
    u = unmapped(conv)
    p = "compression_training.weight_quantization.different_groups"
    assert "do not fit the INT8 GEMM" in u[f"{p}.g.params.target_bits"]
    assert "symmetric by definition" in u[f"{p}.t.params.target_bits"]
    validate(conv)


def test_compression_disabled_or_malformed():
    u = unmapped(convert({"compression_training": {
        "weight_quantization": {"shared_parameters": {"enabled": False}}}}))
    assert "nothing to map" in u["compression_training.weight_quantization"]
    u = unmapped(convert({"compression_training": {"weight_quantization": {
        "shared_parameters": {"enabled": True},
        "different_groups": {"g": {"params": {"target_bits": 9}}}}}}))
    assert "1..8" in u["compression_training.weight_quantization.different_groups.g.params."
                       "target_bits"]


def test_everything_together_validates_with_unique_names():
    cfg = dict(FULL, moe=DS_MOE, compression_training={
        "weight_quantization": {"shared_parameters": {"enabled": True},
                                "different_groups": {"main": {"params": {"target_bits": 8}},
                                                     "world": {"params": {"target_bits": 1}}}}})
    conv = convert(cfg)
    headers = [h for h, _ in conv.tables]
    names = [h.split(".", 1)[1] for h in headers]
    assert len(names) == len(set(names)), headers
    assert "quantizer.main_q" in headers and "quantizer.world_q" in headers
    assert "moe.experts" in headers and "optimizer.main" in headers
    validate(conv)
