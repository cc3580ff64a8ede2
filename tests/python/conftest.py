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
