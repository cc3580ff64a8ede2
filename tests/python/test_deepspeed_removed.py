"""The DeepSpeed importer says first which features of a config DeepSpeed removed in
September 2026 (the 1-bit optimizers and their comm backends, the compression library's
ZeroQuant, XTC, pruning and layer reduction) and which Loom instance carries each: on
configs of the published 1-bit shapes (deepspeed_configs/) and on two of DeepSpeedExamples'
compression configs, copied unchanged (deepspeed_configs/deepspeedexamples/)."""
import os
import subprocess
import sys

import pytest

import loom
from loom.deepspeed import Removed, convert
from loom.deepspeed import _optimizer

from conftest import PACKAGE_DIR

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deepspeed_configs")
HEADER = ("this config uses features DeepSpeed removed in September 2026 "
          "(deepspeedai/DeepSpeed#8490); Loom carries these:")
NOT_CARRIED = ("this config uses features DeepSpeed removed in September 2026 "
               "(deepspeedai/DeepSpeed#8490); Loom does not carry these (the keys not mapped "
               "say why):")
WQ = "compression_training.weight_quantization.different_groups"
AQ = "compression_training.activation_quantization"


def config(*name):
    return os.path.join(CONFIGS, *name)


def removed(conv):
    return [(r.key, r.feature, r.loom) for r in conv.removed]


def unmapped(conv):
    return {u.key: u.reason for u in conv.unmapped}


def validate(conv):
    loom.Session.from_string(conv.manifest, "converted.toml", validate_only=True,
                             log_level="error").close()


def cli(*args, cwd):
    env = dict(os.environ, PYTHONPATH=PACKAGE_DIR)
    return subprocess.run([sys.executable, "-m", "loom.deepspeed", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)


MPI = "mpi" if _optimizer.comm_plugin_installed("mpi") else "ucx"


@pytest.mark.parametrize("name,typ,words,plugin,backend,comm", [
    ("onebit_adam_squad_nccl.json", "OnebitAdam", "1-bit Adam", "onebit_adam", "nccl", "nccl"),
    ("zero_one_adam_bert_nccl.json", "ZeroOneAdam", "0/1 Adam", "zero_one_adam", "nccl",
     "nccl"),
    ("onebit_lamb_bert_mpi.json", "OneBitLamb", "1-bit LAMB", "onebit_lamb", "mpi", MPI),
])
def test_the_one_bit_optimizers_are_reported_first(name, typ, words, plugin, backend, comm):
    conv = convert(config(name))
    missing = " (Loom's mpi plugin is not installed here)" if backend == "mpi" and \
        comm != "mpi" else ""
    assert removed(conv) == [
        ("optimizer.type", f'{words} (type "{typ}")',
         f'[optimizer.main] plugin "{plugin}" over [comm.world] plugin "{comm}"'),
        ("optimizer.params.comm_backend_name",
         f"the 1-bit compressed allreduce over DeepSpeed's '{backend}' backend",
         f'[comm.world] plugin "{comm}"{missing} with [codec.onebit] plugin "onebit"')]
    assert conv.instance("comm.world") == {"plugin": comm}
    assert conv.instance("optimizer.main")["plugin"] == plugin
    # first in the report, and in the manifest's comments right after its title
    lines = conv.report().splitlines()
    assert lines[0] == f"{conv.source}: {HEADER}"
    assert lines[1] == f"{conv.source}:   optimizer.type: {words} (type \"{typ}\") -> " \
                       f'[optimizer.main] plugin "{plugin}" over [comm.world] plugin "{comm}"'
    assert lines[2].startswith(f"{conv.source}:   optimizer.params.comm_backend_name: ")
    assert conv.manifest.startswith(
        f"# Loom manifest converted from the DeepSpeed config {conv.source}.\n#\n# {HEADER}\n")
    if comm != "mpi" or _optimizer.comm_plugin_installed("mpi"):
        validate(conv)


def test_the_one_bit_parameters_are_carried():
    t = convert(config("onebit_lamb_bert_mpi.json")).instance("optimizer.main")
    assert t == {"plugin": "onebit_lamb", "comm": "world", "codec": "onebit",
                 "weight_decay": 0.01, "bias_correction": False, "max_coeff": 0.5,
                 "min_coeff": 0.02, "freeze_step": 500, "coeff_beta": 0.95, "factor_max": 2.0,
                 "factor_min": 0.5, "factor_threshold": 0.2}
    t = convert(config("zero_one_adam_bert_nccl.json")).instance("optimizer.main")
    assert (t["var_freeze_step"], t["local_step_scaler"]) == (2000, 32678)


def test_mpi_goes_to_the_mpi_transport_when_it_is_installed(monkeypatch):
    monkeypatch.setattr(_optimizer, "comm_plugin_installed", lambda name: name == "mpi")
    conv = convert(config("onebit_lamb_bert_mpi.json"))
    assert conv.instance("comm.world") == {"plugin": "mpi"}
    assert removed(conv)[1][2] == '[comm.world] plugin "mpi" with [codec.onebit] plugin "onebit"'
    monkeypatch.setattr(_optimizer, "comm_plugin_installed", lambda name: False)
    conv = convert(config("onebit_lamb_bert_mpi.json"))
    assert conv.instance("comm.world") == {"plugin": "ucx"}
    assert any("Loom's mpi transport is not installed here" in n for n in conv.notes)


def test_each_comm_backend_name():
    def conv(backend):
        return convert({"optimizer": {"type": "OneBitAdam",
                                      "params": {"comm_backend_name": backend}}})

    c = conv("compressed")
    assert c.instance("comm.world") == {"plugin": "ucx"}
    assert removed(c)[1][2].startswith('[comm.world] plugin "ucx" with')
    c = conv("hccl")  # Ascend NPUs: removed, and no Loom transport for their memory
    assert c.instance("comm.world") == {"plugin": "ucx"}
    assert removed(c)[1] == ("optimizer.params.comm_backend_name",
                             "the 1-bit compressed allreduce over DeepSpeed's 'hccl' backend",
                             None)
    assert "Ascend NPUs" in unmapped(c)["optimizer.params.comm_backend_name"]
    assert NOT_CARRIED in c.report()
    c = conv("gloo")  # not one of DeepSpeed's backends: nothing DeepSpeed removed
    assert [r[0] for r in removed(c)] == ["optimizer.type"]
    assert "not one of DeepSpeed's backends" in unmapped(c)["optimizer.params.comm_backend_name"]
    # without comm_backend_name the optimizer's line alone (its transport is named there)
    c = convert({"optimizer": {"type": "ZeroOneAdam", "params": {}}})
    assert removed(c) == [("optimizer.type", '0/1 Adam (type "ZeroOneAdam")',
                           '[optimizer.main] plugin "zero_one_adam" over [comm.world] plugin '
                           '"ucx"')]


def test_xtc_with_layer_reduction_from_deepspeedexamples():
    conv = convert(config("deepspeedexamples", "ds_config_layer_reduction_W1Q8_fp32.json"))
    assert removed(conv) == [  # in the config's order; the report puts the carried first
        ("compression_training.layer_reduction",
         "layer reduction (XTC's smaller student, distilled from the teacher's layers)", None),
        (f"{WQ}.wq1", "XTC binary (1-bit) weight quantization", '[quantizer.wq1] plugin "xtc"'),
        (AQ, "ZeroQuant's INT8 activation quantization: no zeroquant instance takes it (xtc's "
             "1- and 2-bit matmul multiplies float activations)", None)]
    # layer_reduction's "enabled" is its own key (not under shared_parameters)
    assert unmapped(conv)["compression_training.layer_reduction"] == \
        "pruning and layer reduction are not part of Loom"
    # the pruning sections are there but switched off: not features the config uses
    assert unmapped(conv)["compression_training.sparse_pruning"] == "not enabled: nothing to map"
    lines = conv.report().splitlines()
    assert lines[0] == f"{conv.source}: {HEADER}"
    assert lines[2] == f"{conv.source}: {NOT_CARRIED}"
    assert lines[3].startswith(f"{conv.source}:   compression_training.layer_reduction: ")
    validate(conv)


def test_binary_and_ternary_groups_from_deepspeedexamples():
    conv = convert(config("deepspeedexamples", "ds_config_W1or2A8_Qgroup64_fp16.json"))
    assert removed(conv)[:2] == [
        (f"{WQ}.wq1", "XTC binary (1-bit) weight quantization", '[quantizer.wq1] plugin "xtc"'),
        (f"{WQ}.wq2", "XTC ternary (2-bit) weight quantization", '[quantizer.wq2] plugin "xtc"')]
    assert [r[0] for r in removed(conv)] == [f"{WQ}.wq1", f"{WQ}.wq2", AQ]  # no layer_reduction
    assert unmapped(conv)["compression_training.layer_reduction"] == "not enabled: nothing to map"
    validate(conv)


def test_zeroquant_weights_and_activations():
    conv = convert(config("gpt2_zeroquant.json"))
    assert removed(conv) == [
        (f"{WQ}.wq1", "ZeroQuant 4-bit weight quantization", '[quantizer.wq1] plugin "zeroquant"'),
        (f"{WQ}.wq2", "ZeroQuant 8-bit weight quantization", '[quantizer.wq2] plugin "zeroquant"'),
        (AQ, "ZeroQuant's INT8 activation quantization",
         'activation_bits = 8 on [quantizer.wq1], [quantizer.wq2] (plugin "zeroquant")')]
    assert NOT_CARRIED not in conv.report()


def test_a_config_without_removed_features_says_nothing_of_them():
    for cfg in ({"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}},
                {"optimizer": {"type": "Lamb", "params": {}}, "fp16": {"enabled": True}}):
        conv = convert(cfg)
        assert conv.removed == [] and conv.removed_lines() == []
        assert "DeepSpeed removed" not in conv.report()
        assert "DeepSpeed removed" not in conv.manifest
    # a removed feature that is present but switched off is not used
    conv = convert({"compression_training": {"layer_reduction": {"enabled": False},
                                             "weight_quantization": {
                                                 "shared_parameters": {"enabled": False}}}})
    assert conv.removed == []


def test_removed_is_a_plain_record():
    r = Removed("optimizer.type", "1-bit Adam", '[optimizer.main] plugin "onebit_adam"')
    assert str(r) == 'optimizer.type: 1-bit Adam -> [optimizer.main] plugin "onebit_adam"'
    assert str(Removed("compression_training.row_pruning", "row pruning")) == \
        "compression_training.row_pruning: row pruning"


def test_the_command_line_says_it_first(tmp_path):
    cfg = config("zero_one_adam_bert_nccl.json")
    r = cli(cfg, cwd=str(tmp_path))  # the manifest on stdout, the report on stderr
    assert r.returncode == 0, r.stderr
    err = r.stderr.splitlines()
    assert err[0] == f"{cfg}: {HEADER}"
    assert err[1].startswith(f"{cfg}:   optimizer.type: 0/1 Adam")
    assert err[2].startswith(f"{cfg}:   optimizer.params.comm_backend_name: ")
    assert err[3].startswith(f"{cfg}: note: ")
    assert len(err) == len(convert(cfg).report().splitlines())  # each line once
    assert r.stdout == convert(cfg).manifest
    r = cli(cfg, "-o", "run.toml", "--check", cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines()[0] == f"{cfg}: {HEADER}"
    r = cli(cfg, "-q", cwd=str(tmp_path))
    assert r.returncode == 0 and r.stderr == ""
    # nothing maps (layer reduction alone): the removed features still come first
    only = tmp_path / "lr.json"
    only.write_text('{"compression_training": {"layer_reduction": {"enabled": true}}}')
    r = cli(str(only), cwd=str(tmp_path))
    assert r.returncode == 1
    assert r.stderr.splitlines()[0] == f"{only}: {NOT_CARRIED}"
    assert "nothing in this config maps" in r.stderr.splitlines()[-1]
