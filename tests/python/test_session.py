"""loom.Session and loom.Instance over libloom: opening, finding, describing, state, errors,
library discovery."""
import os
import pydoc
import re
import shutil
import struct
import subprocess
import sys

import pytest

import loom
from loom import errors

from conftest import PACKAGE_DIR

PROBE = '[optimizer.main]\nplugin = "probe"\ntag = "py"\nweight_decay = 0.5\nstart_step = 2\n'


def test_version_and_abi():
    assert re.match(r"^\d+\.\d+\.\d+", loom.version())
    major, minor = loom.abi_version()
    assert major == 1 and minor >= 4
    assert os.path.isfile(loom.library_path())


def test_open_file_lists_finds_and_describes(write):
    path = write('[optimizer.a]\nplugin = "adam"\n\n[optimizer.b]\nplugin = "lamb"\n'
                 'max_coeff = 2.0\n')
    with loom.Session(path, log_level="error") as s:
        assert len(s) == 2
        assert [i.name for i in s] == ["a", "b"]
        assert s.describe() == [
            {"section": "optimizer", "name": "a", "kind": "loom.optimizer/1", "plugin": "adam"},
            {"section": "optimizer", "name": "b", "kind": "loom.optimizer/1", "plugin": "lamb"},
        ]
        b = s.instance("loom.optimizer/1", "b")
        assert (b.section, b.plugin) == ("optimizer", "lamb")
        assert "optimizer.a" in repr(s) and "optimizer.b" in repr(s)
        names = [p["name"] for p in b.schema()]
        assert "max_coeff" in names and "betas" in names
    assert s.closed
    assert "closed" in repr(s)


def test_find_errors(write):
    with loom.Session.from_string('[optimizer.main]\nplugin = "adam"\n', "run.toml") as s:
        with pytest.raises(loom.NotFoundError) as e:
            s.instance("optimizer", "absent")
        assert isinstance(e.value, LookupError)
        assert e.value.code == 2
        assert "'absent'" in str(e.value)
        with pytest.raises(loom.LoomError) as e:
            s.instance("optimzer", "main")
        assert "optimzer" in str(e.value)


def test_bad_manifest_names_file_line_col(write, plugin_dir):
    path = write('[optimizer.main]\nplugin = "probe"\ntag = "t"\nweight_decay = -1\n', "bad.toml")
    with pytest.raises(loom.InvalidArgumentError) as e:
        loom.Session(path, plugin_path=plugin_dir)
    assert isinstance(e.value, ValueError)
    assert e.value.code == 1
    assert re.fullmatch(re.escape(path) + r":4:16: parameter 'weight_decay' of optimizer.main "
                        r"= -1 is out of range \[0, 1\]", e.value.message), e.value.message


def test_every_manifest_error_on_its_own_line(write):
    path = write('[optimizer.a]\nplugin = "adam"\neps = -1\n\n[optimizer.b]\nplugin = "adam"\n'
                 'betaz = [0.9, 0.99]\n')
    with pytest.raises(loom.InvalidArgumentError) as e:
        loom.Session(path)
    lines = str(e.value).splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith(path + ":3:") and "'eps'" in lines[0]
    assert lines[1].startswith(path + ":7:") and "did you mean 'betas'" in lines[1]


def test_open_string_origin_names_messages(plugin_dir):
    with pytest.raises(loom.InvalidArgumentError) as e:
        loom.Session.from_string('[comm.w]\nplugin = "probe"\npeer = "w"\n', "inline.toml",
                                 plugin_path=[plugin_dir])
    assert str(e.value) == "inline.toml:3:8: reference cycle: comm.w -> comm.w"


def test_open_string_refuses_a_nul_where_the_cli_would(write):
    # libloom takes a C string: without the check everything after the NUL was dropped, and
    # this manifest opened as an adam with no error.
    text = '[optimizer.main]\nplugin = "adam"\n# \u00e9\0\n[optimizer.main]\n'
    with pytest.raises(loom.InvalidArgumentError) as e:
        loom.Session.from_string(text, "inline.toml", validate_only=True)
    assert str(e.value) == ("inline.toml:3:4: TOML syntax error: a NUL character (U+0000); "
                            "control characters other than TAB (U+0009) are prohibited")
    with pytest.raises(loom.InvalidArgumentError, match=r"^<string>:2:1: .*NUL.* \(1 more NUL"):
        loom.Session.from_string('[optimizer.main]\n\0plugin = "adam"\0\n')
    # The same text from a file: the host refuses it at the same line and column.
    path = write(text)
    with pytest.raises(loom.InvalidArgumentError, match=re.escape(path) + ":3:4: TOML syntax"):
        loom.Session(path, validate_only=True)


def test_names_and_paths_with_a_nul_are_refused(write):
    path = write('[optimizer.main]\nplugin = "adam"\n')
    # A path cut at the NUL would have opened m.toml.
    with pytest.raises(loom.InvalidArgumentError, match=r"manifest path .*m\.toml\\x00x.* byte"):
        loom.Session(path + "\0x")
    with pytest.raises(loom.InvalidArgumentError, match="origin"):
        loom.Session.from_string('[optimizer.main]\nplugin = "adam"\n', "a\0b")
    with pytest.raises(loom.InvalidArgumentError, match="plugin_path"):
        loom.Session(path, plugin_path=["/tmp\0/x"])
    with pytest.raises(loom.InvalidArgumentError, match="name 'adam\\\\x00x'"):
        loom.describe_plugins("adam\0x")
    with loom.Session(path, validate_only=True) as s, loom.Session(path) as t:
        assert len(s) == 0
        with pytest.raises(loom.InvalidArgumentError, match=r"name 'main\\x00' .* at byte 4"):
            t.instance("optimizer", "main\0")
        with pytest.raises(loom.InvalidArgumentError, match="kind"):
            t.instance("optimizer\0x", "main")
        assert t.instance("optimizer", "main").plugin == "adam"


def test_validate_only_creates_nothing():
    with loom.Session.from_string('[optimizer.main]\nplugin = "adam"\n',
                                  validate_only=True) as s:
        assert len(s) == 0
        with pytest.raises(loom.NotFoundError):
            s.optimizer()


def test_closed_session_and_its_instances_refuse_calls():
    s = loom.Session.from_string('[optimizer.main]\nplugin = "adam"\n')
    opt = s.optimizer()
    s.close()
    s.close()  # twice is a no-op
    with pytest.raises(loom.FailedPreconditionError, match="closed"):
        len(s)
    with pytest.raises(loom.FailedPreconditionError, match="optimizer.main.*closed"):
        opt.export_state()


def test_state_export_import_and_refusals(plugin_dir):
    with loom.Session.from_string(PROBE, plugin_path=plugin_dir) as s:
        opt = s.optimizer()
        blob = opt.export_state()
        assert len(blob) == 24
        magic, version, _, steps = struct.unpack("<8sIIq", blob)
        assert (magic, version, steps) == (b"PROBEST1", 1, 2)
        with pytest.raises(loom.DataLossError, match="bad magic"):
            opt.import_state(b"x" * 24)
        assert opt.export_state() == blob  # unchanged by the refused import
        opt.import_state(struct.pack("<8sIIq", b"PROBEST1", 1, 0, 40))
        assert struct.unpack("<8sIIq", opt.export_state())[3] == 40
        with pytest.raises(loom.InvalidArgumentError, match="bytes"):
            opt.import_state("not bytes")


def test_kind_specific_calls_check_the_kind(plugin_dir):
    with loom.Session.from_string('[codec.c]\nplugin = "onebit"\n') as s:
        c = s.instance("codec", "c")
        with pytest.raises(loom.InvalidArgumentError, match="codec.c is a loom.codec/1"):
            c.step([], 0.1)
        with pytest.raises(loom.InvalidArgumentError):
            c.comm_info()


def test_comm_info_of_an_optimizer_that_never_communicates():
    with loom.Session.from_string('[optimizer.main]\nplugin = "adam"\n') as s:
        info = s.optimizer().comm_info()
    assert info == {"owns_communication": 0, "bytes_sent": 0, "bytes_received": 0, "rounds": 0,
                    "uncompressed_bytes_sent": 0, "skipped_steps": 0, "comm_wait_ns": 0}


def test_describe_plugins():
    doc = loom.describe_plugins("adam")
    (adam,) = doc["plugins"]
    assert adam["name"] == "adam"
    (kind,) = adam["kinds"]
    assert kind["kind"] == "loom.optimizer/1"
    assert {"betas", "eps", "weight_decay", "adam_w_mode"} <= {p["name"] for p in kind["params"]}
    with pytest.raises(loom.NotFoundError, match="adma"):
        loom.describe_plugins("adma")


def test_one_exception_class_per_status_code():
    classes = errors.BY_CODE
    assert sorted(classes) == list(range(1, 12))
    assert len(set(classes.values())) == 11
    for code, cls in classes.items():
        e = errors.error_for(code, "msg")
        assert type(e) is cls and e.code == code and str(e) == "msg"
        assert isinstance(e, loom.LoomError)
    unknown = errors.error_for(99, "msg")
    assert type(unknown) is loom.LoomError and unknown.code == 99 and "99" in str(unknown)
    assert issubclass(loom.UnimplementedError, NotImplementedError)
    assert issubclass(loom.DeadlineExceededError, TimeoutError)


def test_bad_log_level():
    with pytest.raises(loom.InvalidArgumentError, match="log_level 'loud'"):
        loom.Session.from_string('[optimizer.main]\nplugin = "adam"\n', log_level="loud")


def test_help_is_useful():
    text = pydoc.render_doc(loom.Session, renderer=pydoc.plaintext)
    for word in ("from_string", "validate_only", "plugin_path", "FILE:LINE:COL", "Raises",
                 "instance(self, kind: str, name: str)"):
        assert word in text, word
    text = pydoc.render_doc(loom.Instance, renderer=pydoc.plaintext)
    for word in ("step(self", "grad_scale", "export_state", "DataLossError",
                 "router_backward", "dweight"):
        assert word in text, word
    text = pydoc.render_doc(loom.Bootstrap, renderer=pydoc.plaintext)
    for word in ("allgather", "barrier", "local_rank", "DEADLINE_EXCEEDED"):
        assert word in text, word


def _run_isolated(tmp_path, env_extra, code):
    """Runs `code` with a copy of the package outside the checkout, so only LOOM_LIBRARY and
    the copy's own folders are searched."""
    dest = tmp_path / "site"
    if not (dest / "loom").exists():
        shutil.copytree(os.path.join(PACKAGE_DIR, "loom"), dest / "loom",
                        ignore=shutil.ignore_patterns("__pycache__", "_install.json"))
    env = {k: v for k, v in os.environ.items() if k != "LOOM_LIBRARY"}
    env.update(env_extra)
    env["PYTHONPATH"] = str(dest)
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=60), dest


def test_library_not_found_names_every_place(tmp_path):
    r, dest = _run_isolated(tmp_path, {}, "import loom; loom.version()")
    assert r.returncode != 0
    assert "LibraryNotFoundError: libloom not found; looked in LOOM_LIBRARY (unset)" in r.stderr
    assert str(dest / "loom" / "libloom.so.0") in r.stderr
    prefix = os.path.abspath(os.path.join(str(dest), "loom", *([os.pardir] * 4)))
    assert os.path.join(prefix, "lib", "libloom.so.0") in r.stderr
    assert "set LOOM_LIBRARY" in r.stderr


def test_loom_library_that_is_missing_or_foreign(tmp_path):
    r, _ = _run_isolated(tmp_path, {"LOOM_LIBRARY": str(tmp_path / "nope.so")},
                         "import loom; loom.version()")
    assert r.returncode != 0 and "LOOM_LIBRARY is set to" in r.stderr and "nope.so" in r.stderr
    foreign = next((p for p in ("/lib/x86_64-linux-gnu/libz.so.1", "/usr/lib/x86_64-linux-gnu/libz.so.1")
                    if os.path.isfile(p)), None)
    if foreign:
        r, _ = _run_isolated(tmp_path, {"LOOM_LIBRARY": foreign}, "import loom; loom.version()")
        assert r.returncode != 0 and "is not a libloom" in r.stderr, r.stderr


def test_loom_library_beside_the_package(tmp_path):
    lib = loom.library_path()
    _, dest = _run_isolated(tmp_path, {}, "pass")
    os.symlink(os.path.realpath(lib), dest / "loom" / "libloom.so.0")
    r, _ = _run_isolated(tmp_path, {}, "import loom; print(loom.library_path())")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(dest / "loom" / "libloom.so.0")


def test_thread_pool_size():
    before = loom.thread_count()
    assert before >= 1
    try:
        loom.set_thread_count(1)
        assert loom.thread_count() == 1
    finally:
        loom.set_thread_count(0)  # back to the default
    assert loom.thread_count() == before
    with pytest.raises(loom.InvalidArgumentError):
        loom.set_thread_count(-1)


def test_help_of_the_torch_classes():
    pytest.importorskip("torch")
    import loom.torch

    text = pydoc.render_doc(loom.torch.Optimizer, renderer=pydoc.plaintext)
    for word in ("plugin_params", "state_dict", "master", "grad_scale", "Raises"):
        assert word in text, word
    text = pydoc.render_doc(loom.torch.Router, renderer=pydoc.plaintext)
    for word in ("layer_index", "first_sample", "gather", "eval", "channels", "gate",
                 "weight"):
        assert word in text, word
    text = pydoc.render_doc(loom.torch.distributed_bootstrap, renderer=pydoc.plaintext)
    for word in ("group", "gloo", "LOCAL_RANK", "FailedPreconditionError"):
        assert word in text, word
    text = pydoc.render_doc(loom.torch.Optimizer, renderer=pydoc.plaintext)
    for word in ("bootstrap", "comm_plugin", "codec_plugin"):
        assert word in text, word


def test_a_checkout_looks_in_its_own_build_before_the_prefix_rule():
    """In a repository checkout the package is four folders below an unrelated folder; the
    checkout's build/release/lib comes before that folder's lib/."""
    from loom import _lib

    dirs = _lib.candidates()
    here = os.path.dirname(os.path.abspath(_lib.__file__))
    repo = os.path.abspath(os.path.join(here, os.pardir, os.pardir, os.pardir))
    if not os.path.isfile(os.path.join(repo, "host", "include", "loom", "embed.h")):
        pytest.skip("the package is not in a repository checkout")
    build = os.path.join(repo, "build", "release", "lib")
    prefix = os.path.join(os.path.abspath(os.path.join(here, *([os.pardir] * 4))), "lib")
    assert build in dirs and prefix in dirs, dirs
    assert dirs.index(build) < dirs.index(prefix), dirs


def test_abort_job_flushes_and_exits_with_the_status():
    # A world of one: nothing to end but this process, its output flushed first; exit
    # handlers do not run (an atexit hook would print).
    code = ("import atexit, loom; atexit.register(lambda: print('atexit ran'));"
            "print('before', flush=False); loom.abort_job(7)")
    env = dict(os.environ, PYTHONPATH=str(PACKAGE_DIR))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 7, r.stderr
    assert r.stdout == "before\n"
    with pytest.raises(errors.InvalidArgumentError, match="0..255"):
        loom.abort_job(300)
