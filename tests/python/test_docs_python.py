"""docs/python.md's commands and examples, run as written: the virtual environment is made
with Debian's interpreter, the curriculum example gives what its comments say, and the
DeepSpeed importer's command line works from a checkout."""
import os
import re
import shutil
import subprocess

import pytest

from conftest import ROOT

DOC = os.path.join(ROOT, "docs", "python.md")


def doc():
    with open(DOC, encoding="utf-8") as f:
        return f.read()


def blocks(lang):
    return re.findall(rf"```{lang}\n(.*?)```", doc(), flags=re.S)


def shell_lines():
    """Every command of the sh blocks (continuation lines joined, comments dropped)."""
    out = []
    for b in blocks("sh"):
        for line in b.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def test_python_commands_name_an_interpreter_with_torch():
    """A bare `python` is not on Debian, and a `python3` first in PATH may be another one
    (pyenv, conda) without Debian's numpy and torch: the doc's commands name
    /usr/bin/python3 or the virtual environment's python."""
    lines = shell_lines()
    assert lines
    venvs = [ln for ln in lines if "-m venv" in ln]
    assert venvs and all(ln.startswith("/usr/bin/python3 -m venv --system-site-packages ")
                         for ln in venvs), venvs
    commands = 0
    for ln in lines:
        for segment in re.split(r"[;&|]+", ln):
            words = [w for w in segment.split() if "=" not in w and w not in ("do", "then")]
            if words and os.path.basename(words[0]) in ("python", "python3"):
                commands += 1
                assert words[0] in ("/usr/bin/python3", "venv/bin/python"), ln
    assert commands >= 4


def test_the_curriculum_example_runs_as_written():
    pytest.importorskip("numpy")
    text = doc()
    section = text[text.index("## Curriculum schedules and metrics"):]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    scope = {}
    exec(compile(code, "docs/python.md", "exec"), scope)  # noqa: S102 (the doc's own example)
    slw, voc = scope["slw"], scope["voc"]
    assert slw.curriculum_plan() == {"roles": 2, "metric": False, "schedule": True,
                                     "seq_len_mode": "truncate", "stats_count": 0}
    assert slw.curriculum_at(10000) == {"difficulty": 256.0, "seq_len": 256}
    assert scope["stats"].tolist()[:8] == [0, 3, 1, 1, 0, 1, 0, 1]
    assert (scope["scores"] > 0).all()
    assert "# {\"difficulty\": 256.0, \"seq_len\": 256}" in code
    scope["s"].close()


def test_the_deepspeed_command_runs_as_written_from_a_checkout(tmp_path):
    if not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("no /usr/bin/python3")
    line = next(ln for ln in shell_lines() if ln.startswith("PYTHONPATH=bindings/python "))
    assert line == ("PYTHONPATH=bindings/python /usr/bin/python3 -m loom.deepspeed "
                    "ds_config.json -o run.toml --check")
    # the checkout's package, and a config of the shape of DeepSpeed's GPT-2 ZeroQuant recipe
    os.symlink(os.path.join(ROOT, "bindings"), tmp_path / "bindings")
    shutil.copy(os.path.join(os.path.dirname(__file__), "deepspeed_configs",
                             "gpt2_zeroquant.json"), tmp_path / "ds_config.json")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run(["bash", "-c", line], cwd=str(tmp_path), env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "run.toml").read_text()
    assert "[quantizer.wq1]" in text and "[[quantize]]" in text
    assert "ds_config.json: optimizer.params.lr: not mapped" in r.stderr
    # The doc's sample of that stderr: its lines are the command's, the removed features
    # first (the whole block of them), in the same order.
    text = doc()
    section = text[text.index("## DeepSpeed configs"):]
    shown = re.search(r"```\n(ds_config\.json: .*?)```", section, flags=re.S).group(1)
    shown = shown.splitlines()
    got = r.stderr.splitlines()
    removed = [ln for ln in shown if ln.startswith("ds_config.json:  ") or "removed in" in ln]
    assert removed and got[:len(removed)] == removed == shown[:len(removed)]
    rest = shown[len(removed):]
    assert rest and [ln for ln in got if ln in rest] == rest


def test_the_migration_section_runs_as_written(tmp_path):
    """Migrating from DeepSpeed's 1-bit optimizers: the config shown is the file the command
    converts; the command runs from a checkout and prints the lines shown first; the
    manifest shown is the one written; each diff's new side is the program's code; the
    program and its manifest twin run in that order and end identical."""
    torch = pytest.importorskip("torch")
    text = doc()
    start = text.index("## Migrating from DeepSpeed's 1-bit optimizers")
    section = text[start:text.index("\n## ", start + 1)]
    fenced = re.findall(r"```(\w*)\n(.*?)```", section, flags=re.S)
    kinds = [k for k, _ in fenced]
    assert kinds == ["diff", "json", "sh", "", "toml", "diff", "python", "python"], kinds
    diffs = [b for k, b in fenced if k == "diff"]
    (config,) = [b for k, b in fenced if k == "json"]
    (command,) = [b for k, b in fenced if k == "sh"]
    (shown,) = [b for k, b in fenced if k == ""]
    (manifest,) = [b for k, b in fenced if k == "toml"]
    program, twin = [b for k, b in fenced if k == "python"]

    with open(os.path.join(ROOT, "examples", "deepspeed", "onebit_adam.json"),
              encoding="utf-8") as f:
        assert f.read() == config

    # The command, as written, from a copy with the checkout's package and examples.
    for d in ("bindings", "examples"):
        os.symlink(os.path.join(ROOT, d), tmp_path / d)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=str(tmp_path),
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = r.stderr.splitlines()
    assert got[:len(shown.splitlines())] == shown.splitlines()
    assert len(got) > len(shown.splitlines())  # then the keys not mapped
    written = (tmp_path / "onebit_adam.toml").read_text()
    body = written[written.index("[loom]"):]
    assert body.rstrip("\n") == manifest.rstrip("\n")
    assert written.startswith("# Loom manifest converted") and \
        "# DeepSpeed keys not mapped:" in written  # the comments the doc leaves out

    # Each diff: DeepSpeed's side goes, Loom's side (and the context) is the program's code.
    lines = program.splitlines()
    for d in diffs:
        old = [ln[1:] for ln in d.splitlines() if ln.startswith("-")]
        new = [ln[1:] for ln in d.splitlines() if ln[:1] in ("+", " ")]
        assert old and new
        assert any("deepspeed" in ln for ln in old)
        assert not any("deepspeed" in ln for ln in lines)
        for ln in new:
            assert ln.rstrip() in lines, ln

    # The two programs, in the reader's order, in one interpreter, in the command's folder.
    scope = {}
    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        exec(compile(program, "docs/python.md", "exec"), scope)  # noqa: S102 (the doc's own)
        first = [p.detach().clone() for p in scope["model"].parameters()]
        assert scope["opt"].comm_info()["owns_communication"] == 1
        assert scope["opt"].instance.plugin == "onebit_adam"
        scope["opt"].close()
        exec(compile(twin, "docs/python.md", "exec"), scope)  # noqa: S102
    finally:
        os.chdir(here)
    second = [p.detach() for p in scope["model"].parameters()]
    torch.manual_seed(0)
    initial = [p.detach() for p in torch.nn.Linear(16, 4).parameters()]
    assert all(not torch.equal(a, b) for a, b in zip(first, initial))  # it trained
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_the_overlap_example_runs_as_written(tmp_path):
    """Several ranks: the 1-bit family, "Overlap with the backward": the program runs as
    written on one rank and prints its bytes."""
    pytest.importorskip("torch")
    text = doc()
    start = text.index("**Overlap with the backward.**")
    code = re.search(r"```python\n(.*?)```", text[start:], flags=re.S).group(1)
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "bindings", "python"))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    r = subprocess.run(["/usr/bin/python3", "-c", code], cwd=str(tmp_path), env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "0 bytes sent", r.stdout
