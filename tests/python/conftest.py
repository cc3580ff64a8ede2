"""Shared set-up for the Python package's tests: the checkout's package on sys.path, the
test plugins' folder, and helpers."""
import os
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
PACKAGE_DIR = os.path.join(ROOT, "bindings", "python")
if PACKAGE_DIR not in sys.path:
    sys.path.insert(0, PACKAGE_DIR)

# The test plugins (probe, ...) live in a folder only tests use.
PLUGIN_DIR = os.environ.get("LOOM_TEST_PLUGIN_DIR") or os.path.join(
    ROOT, "build", "release", "test-plugins")
# Only the bundled plugins and the test plugins are loaded.
os.environ["LOOM_PLUGIN_PATH"] = ""
os.environ.pop("LOOM_LOG_LEVEL", None)


@pytest.fixture
def plugin_dir():
    if not os.path.isfile(os.path.join(PLUGIN_DIR, "loom_probe.so")):
        pytest.skip(f"test plugins not built in {PLUGIN_DIR} (target loom_test_plugins)")
    return PLUGIN_DIR


@pytest.fixture
def write(tmp_path):
    """write(text, name="m.toml") -> the path of a file holding text."""
    def _write(text, name="m.toml"):
        p = tmp_path / name
        p.write_text(text, encoding="utf-8")
        return str(p)
    return _write


def run_together(commands, timeout, what):
    """Starts each (argv, env) of commands at once, each in a session (process group) of
    its own, and waits for all of them up to timeout seconds in total. Returns
    [(returncode, stdout, stderr)], stdout and stderr apart (c10d and gloo warn on stderr).
    On timeout every group is killed (SIGKILL, so no worker outlives the test) and the test
    fails with what each process had written."""
    import signal
    import subprocess
    import time

    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True) for argv, env in commands]
    deadline = time.monotonic() + timeout
    results = [None] * len(procs)
    try:
        for i, p in enumerate(procs):
            out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            results[i] = (p.returncode, out, err)
    except subprocess.TimeoutExpired:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        parts = []
        for i, p in enumerate(procs):
            if results[i] is None:
                out, err = p.communicate()
                results[i] = (p.returncode, out, err)
            parts.append(f"--- process {i} (exit {results[i][0]})\nstdout:\n{results[i][1]}"
                         f"\nstderr:\n{results[i][2]}")
        pytest.fail(f"{what} did not finish in {timeout} s\n" + "\n".join(parts))
    return results


def report(results):
    """The output of run_together's processes, for an assertion's message."""
    return "\n".join(f"--- process {i} (exit {rc})\nstdout:\n{out}\nstderr:\n{err}"
                     for i, (rc, out, err) in enumerate(results))
