"""The DeepSpeed importer on configs with the shape of published ones (deepspeed_configs/,
see its README): Megatron-DeepSpeed's pre-0.8 random-LTD layout, the data-efficiency GPT
config's `vocabrarity` metric and the command that builds its index, compression_training's
modules as `loom quantize` rules, and a config of which nothing maps."""
import json
import os
import re
import shlex
import struct
import subprocess
import sys

import pytest

import loom
from loom.deepspeed import analyze_path, convert
from loom.deepspeed._compression import _regex_glob
from loom.deepspeed._data import metric_plugin

from conftest import PACKAGE_DIR, ROOT

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deepspeed_configs")
BUILD = os.environ.get("LOOM_BUILD_DIR") or os.path.join(ROOT, "build", "release")
BIN = os.path.join(BUILD, "bin")
PLUGINS = os.path.join(BUILD, "lib", "loom", "plugins")


def config(name):
    return os.path.join(CONFIGS, name)


def unmapped(conv):
    return {u.key: u.reason for u in conv.unmapped}


def validate(conv):
    loom.Session.from_string(conv.manifest, "converted.toml", validate_only=True,
                             log_level="error").close()


def cli(*args, cwd):
    env = dict(os.environ, PYTHONPATH=PACKAGE_DIR)
    return subprocess.run([sys.executable, "-m", "loom.deepspeed", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)


def loom_binary(name="loom"):
    path = os.path.join(BIN, name)
    if not os.access(path, os.X_OK):
        pytest.skip(f"{path} is not built")
    return path


# ---------------------------------------------------------------- random-LTD, pre-0.8 layout

def test_pre08_random_ltd_layout_gives_the_current_router():
    old = convert(config("random_ltd_pre08.json"))
    new = convert(config("random_ltd_current.json"))
    router = {"plugin": "random_ltd", "layers": list(range(1, 11)), "min_value": 128,
              "max_value": 1024, "schedule_type": "fixed_linear", "require_steps": 6000,
              "seq_per_step": 16}
    assert old.instance("router.ltd") == router
    assert new.instance("router.ltd") == router
    assert [h for h, _ in old.tables] == ["router.ltd"]
    u = unmapped(old)
    p = "dynamic_train.random_ltd."
    # every key of the old layout is accounted for, under its own spelling
    assert "implied by layers" in u[p + "randomltd_layer_num"]
    assert "counts the layer tokens itself" in u[
        p + "randomltd_schedule.schedule_config.saving_layer_tokens"]
    assert "layer count" in u[p + "total_layer_num"]
    assert "router's advance" in u[p + "micro_batch_size"]
    assert "lr_unit" in u[p + "layer_token_lr_schedule"]
    assert not any(k.startswith(p + "randomltd_layer_id") for k in u)
    assert any("before 0.8" in n for n in old.notes)
    validate(old)


def test_pre08_layout_from_the_command_line(tmp_path):
    r = cli(config("random_ltd_pre08.json"), "-o", str(tmp_path / "run.toml"), "--check",
            cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "run.toml").read_text()
    assert '[router.ltd]\nplugin = "random_ltd"\nlayers = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]' in text
    assert not (tmp_path / "run.analyze.toml").exists()  # no metric, no analyzer manifest


def test_both_layouts_in_one_config_keep_one_router():
    cfg = json.load(open(config("random_ltd_current.json")))
    cfg["dynamic_train"] = json.load(open(config("random_ltd_pre08.json")))["dynamic_train"]
    conv = convert(cfg)
    assert [h for h, _ in conv.tables] == ["router.ltd"]
    assert "mapped from the first one" in unmapped(conv)["dynamic_train.random_ltd"]


# ---------------------------------------------------------------- nothing mapped

def test_nothing_mapped_is_an_error_on_the_command_line(tmp_path):
    conv = convert(config("random_ltd_pre08_disabled.json"))
    assert conv.empty and conv.tables == []
    assert "nothing to map" in unmapped(conv)["dynamic_train.random_ltd"]
    out = tmp_path / "run.toml"
    r = cli(config("random_ltd_pre08_disabled.json"), "-o", str(out), cwd=str(tmp_path))
    assert r.returncode == 1
    assert "nothing in this config maps to a Loom instance" in r.stderr
    assert "no manifest written" in r.stderr
    assert "dynamic_train.random_ltd: not mapped: enabled is false" in r.stderr
    assert not out.exists() and r.stdout == ""
    # to stdout, and quiet: still an error, with the message
    r = cli(config("random_ltd_pre08_disabled.json"), "-q", cwd=str(tmp_path))
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "nothing in this config maps" in r.stderr
    # a config that maps something still exits 0
    r = cli(config("random_ltd_current.json"), "-q", cwd=str(tmp_path))
    assert r.returncode == 0 and "[router.ltd]" in r.stdout


# ---------------------------------------------------------------- vocabrarity and its index

@pytest.mark.parametrize("name", ["vocabrarity", "vocab_rarity", "vocabularyrarity", "voc",
                                  "Vocabulary-Rarity", "vocabulary_rarity"])
def test_vocabulary_rarity_names(name):
    assert metric_plugin(name) == "vocabulary_rarity"


def test_other_metric_names():
    assert metric_plugin("seqlen") == "seqlen"
    # seqlen + coefficient * rarity: not Loom's vocabulary_rarity
    assert metric_plugin("seqlenvocabrarity") is None
    assert metric_plugin("dummy") is None


def test_vocabrarity_is_vocabulary_rarity():
    conv = convert(config("gpt_vocabrarity.json"), manifest_path="out/run.toml")
    assert conv.instance("curriculum.vocabrarity") == {"plugin": "vocabulary_rarity"}
    assert conv.instance("curriculum.vocabrarity_schedule") == {
        "plugin": "fixed_root", "min_difficulty": 1.0, "max_difficulty": 100.0,
        "total_curriculum_step": 30000, "difficulty_step": 1, "root_degree": 2.0}
    assert conv.instance("sampler.data") == {
        "plugin": "curriculum_sampler", "schedule": "vocabrarity_schedule",
        "index": "vocabrarity-index", "metric": "vocabrarity", "difficulty_type": "percentile",
        "clustering_type": "schedule_based"}
    assert conv.instance("curriculum.seqlen_truncate")["mode"] == "truncate"
    assert any("'vocabrarity' is [curriculum.vocabrarity], Loom's vocabulary_rarity" in n
               for n in conv.notes)
    assert not any("no bundled Loom metric" in n for n in conv.notes)
    # the analyzer's manifest: the metric alone
    assert conv.analyze == [("curriculum.vocabrarity", {"plugin": "vocabulary_rarity"})]
    assert analyze_path("out/run.toml") == "out/run.analyze.toml"
    hint = [n for n in conv.notes if "loom data analyze" in n]
    assert len(hint) == 1
    assert ("mkdir -p vocabrarity-index && loom data analyze out/run.analyze.toml --dataset "
            "DATA.bin --seq-len L --output vocabrarity-index --metric vocabrarity") in hint[0]
    validate(conv)


def write_dataset(tmp_path):
    """A small byte-tokenized dataset from `loom data prepare`."""
    words = ["alpha", "beta", "gamma", "delta", "kappa", "lambda", "sigma", "omega", "zeta"]
    lines = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(i % 11 + 3))
             for i in range(900)]
    (tmp_path / "corpus.txt").write_text("\n".join(lines))
    r = subprocess.run([loom_binary(), "data", "prepare", "--input", str(tmp_path / "corpus.txt"),
                        "--output", str(tmp_path / "data.bin")],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0 and "loom-data" in r.stderr:
        pytest.skip(f"loom data is not built: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    return "data.bin"


def test_the_index_hint_is_a_command_that_works(tmp_path, monkeypatch):
    """The note's command, with the dataset and the sequence length filled in, builds the
    index the converted manifest's sampler then opens and draws from."""
    loom_binary("loom-data")
    data = write_dataset(tmp_path)
    r = cli(config("gpt_vocabrarity.json"), "-o", "run.toml", cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "run.analyze.toml").is_file()
    lines = [line for line in r.stderr.splitlines() if "loom data analyze" in line
             and ": note: " in line]
    assert len(lines) == 1, r.stderr
    cmd = re.search(r"build it there, before the run, with: (.*?)   \(", lines[0]).group(1)
    assert cmd == ("mkdir -p vocabrarity-index && loom data analyze run.analyze.toml "
                   "--dataset DATA.bin --seq-len L --output vocabrarity-index "
                   "--metric vocabrarity")
    assert "DATA.bin is the dataset `loom data prepare` wrote and L the trainer's seq_len" \
        in lines[0]
    # The converted manifest itself cannot be analyzed (its sampler opens the missing
    # index when created): that is why the note names the analyzer's manifest.
    (tmp_path / "first").mkdir()
    bad = subprocess.run([loom_binary(), "data", "analyze", "run.toml", "--dataset", data,
                          "--seq-len", "32", "--output", "first", "--plugin-path", PLUGINS],
                         cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "parameter 'index'" in bad.stderr

    filled = cmd.replace("DATA.bin", shlex.quote(data)).replace("--seq-len L", "--seq-len 32")
    env = dict(os.environ, PATH=BIN + os.pathsep + os.environ.get("PATH", ""),
               LOOM_PLUGIN_PATH=PLUGINS)
    done = subprocess.run(["bash", "-c", filled], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "vocabrarity-index" / "vocabrarity.summary.json")
                         .read_text())
    assert (summary["plugin"], summary["seq_len"]) == ("vocabulary_rarity", 32)

    monkeypatch.chdir(tmp_path)  # the sampler's index is relative to the working directory
    with loom.Session("run.toml", log_level="error") as s:
        sampler = s.instance("sampler", "data")
        capacity = sampler.sampler_plan(summary["samples"], 8)
        first = sampler.sampler_next(1, seed=3, capacity=capacity)
        assert len(first["indices"]) == 8 and first["difficulty"] == 1.0  # 1st percentile


def test_the_hint_without_an_output_file_names_placeholders():
    conv = convert(config("gpt_vocabrarity.json"))
    assert conv.manifest_path is None
    hint = next(n for n in conv.notes if "loom data analyze" in n)
    assert "loom data analyze RUN.analyze.toml --dataset DATA.bin --seq-len L" in hint
    assert "-o RUN.toml" in hint
    assert conv.analyze_manifest.endswith('[curriculum.vocabrarity]\nplugin = '
                                          '"vocabulary_rarity"\n')


# ---------------------------------------------------------------- compression: [[quantize]]

def write_safetensors(path, tensors):
    """A plain safetensors file of float32 tensors: {name: shape}."""
    import numpy as np

    rng = np.random.default_rng(11)
    header, blobs, at = {}, [], 0
    for name, shape in tensors.items():
        data = rng.standard_normal(shape).astype(np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [at, at + len(data)]}
        blobs.append(data)
        at += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def read_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


def test_compression_modules_become_quantize_rules():
    conv = convert(config("gpt2_zeroquant.json"))
    assert conv.instance("quantizer.wq1")["bits"] == 4
    assert conv.instance("quantizer.wq2")["bits"] == 8
    assert conv.rules == [
        {"tensors": ["*mlp.c_fc*", "*mlp.c_proj*"], "quantizer": "wq1"},
        {"tensors": ["*attn.c_attn*", "*attn.c_proj*"], "quantizer": "wq2"},
        {"tensors": ["*"], "copy": True}]
    u = unmapped(conv)
    p = "compression_training.weight_quantization.different_groups"
    assert f"{p}.wq1.modules" not in u and f"{p}.wq2.modules" not in u
    assert any("[[quantize]] rules" in n for n in conv.notes)
    assert conv.manifest.rstrip().endswith('[[quantize]]\ntensors = ["*"]\ncopy = true')
    validate(conv)


def test_loom_check_and_loom_quantize_accept_the_written_manifest(tmp_path):
    loom_bin = loom_binary()
    r = cli(config("gpt2_zeroquant.json"), "-o", "q.toml", cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    check = subprocess.run([loom_bin, "check", "q.toml", "--plugin-path", PLUGINS],
                           cwd=str(tmp_path), capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    names = {"transformer.wte.weight": (40, 16),
             "transformer.h.0.attn.c_attn.weight": (48, 16),
             "transformer.h.0.attn.c_attn.bias": (48,),
             "transformer.h.0.attn.c_proj.weight": (16, 16),
             "transformer.h.0.mlp.c_fc.weight": (64, 16),
             "transformer.h.0.mlp.c_proj.weight": (16, 64),
             "transformer.ln_f.weight": (16,)}
    write_safetensors(tmp_path / "model.safetensors", names)
    q = subprocess.run([loom_bin, "quantize", "q.toml", "model.safetensors", "model.q.safetensors",
                        "--plugin-path", PLUGINS], cwd=str(tmp_path), capture_output=True,
                       text=True, timeout=120)
    assert q.returncode == 0, q.stdout + q.stderr
    header = read_header(tmp_path / "model.q.safetensors")
    meta = header["__metadata__"]
    quantized = {k[len("loom.quant."):]: json.loads(v)["quantizer"] for k, v in meta.items()
                 if k.startswith("loom.quant.")}
    assert quantized == {"transformer.h.0.attn.c_attn.weight": "wq2",
                         "transformer.h.0.attn.c_proj.weight": "wq2",
                         "transformer.h.0.mlp.c_fc.weight": "wq1",
                         "transformer.h.0.mlp.c_proj.weight": "wq1"}
    for name in ("transformer.wte.weight", "transformer.ln_f.weight",
                 "transformer.h.0.attn.c_attn.bias"):
        assert header[name]["dtype"] == "F32", name  # copied as is
    assert "matches no tensor" not in q.stderr


def test_regular_expression_keywords():
    conv = convert(config("bert_zeroquant_regex.json"))
    assert conv.rules == [
        {"tensors": ["*attention.self*", "*attention.output.dense*"], "quantizer": "wq1"},
        {"tensors": ["*intermediate*", "*layer.*.output.dense*"], "quantizer": "wq2"},
        {"tensors": ["*"], "copy": True}]
    assert any("'layer.\\w+.output.dense' is the pattern '*layer.*.output.dense*'" in n
               for n in conv.notes)
    validate(conv)
    assert _regex_glob("^bert.pooler$") == ("bert.pooler.weight", None)
    assert _regex_glob(r"layer\.\d+\.attn") == ("*layer.*.attn*", r"\d+")
    assert _regex_glob("h.1?.mlp") == (None, None)
    assert _regex_glob("(q|k)_proj") == (None, None)
    bad = convert({"compression_training": {"weight_quantization": {
        "shared_parameters": {"enabled": True},
        "different_groups": {"g": {"params": {"target_bits": 8},
                                   "modules": ["(q|k)_proj", "mlp"]}}}}})
    assert bad.rules[0] == {"tensors": ["*mlp*"], "quantizer": "g"}
    assert "no tensor-name pattern equivalent" in unmapped(bad)[
        "compression_training.weight_quantization.different_groups.g.modules[0]"]
    validate(bad)
