"""`pip install bindings/python` into a fresh virtual environment: offline (the build backend
needs nothing from an index), and the installed copy finds libloom by itself."""
import importlib.util
import os
import subprocess
import sys

import pytest

import loom

from conftest import PACKAGE_DIR


def test_pip_install_into_a_venv(tmp_path):
    if importlib.util.find_spec("venv") is None or importlib.util.find_spec("ensurepip") is None:
        pytest.skip("no venv/ensurepip (Debian: python3-venv)")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True, capture_output=True, timeout=300)
    lib = loom.library_path()
    env = {k: v for k, v in os.environ.items() if k not in ("LOOM_LIBRARY", "PYTHONPATH")}
    env["LOOM_LIBDIR"] = os.path.dirname(lib)  # what the wheel records (a checkout's build)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    r = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--no-index", "-q",
                        PACKAGE_DIR], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr

    del env["LOOM_LIBDIR"]
    code = ("import loom, loom.deepspeed; print(loom.__file__); print(loom.library_path()); "
            "s = loom.Session.from_string('[optimizer.main]\\nplugin = \"adam\"\\n'); "
            "print(s.optimizer().plugin)")
    r = subprocess.run([str(venv / "bin" / "python"), "-c", code], env=env, cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    where, found, plugin = r.stdout.split()
    assert where.startswith(str(venv)), where
    assert os.path.realpath(found) == os.path.realpath(lib)
    assert plugin == "adam"
    r = subprocess.run([str(venv / "bin" / "loom-from-deepspeed"), "--help"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "DeepSpeed config" in r.stdout


def test_pip_install_from_an_installed_prefix(tmp_path):
    """cmake --install puts the package in PREFIX/share/loom/python; installed from there, it
    finds PREFIX/lib/libloom.so.0 (recorded at install, not the checkout's)."""
    build = os.environ.get("LOOM_BUILD_DIR", "")
    cmake = os.environ.get("LOOM_CMAKE", "") or "cmake"
    if not build or not os.path.isfile(os.path.join(build, "bindings", "python",
                                                    "cmake_install.cmake")):
        pytest.skip("LOOM_BUILD_DIR (the build tree, set by ctest) is not set")
    if importlib.util.find_spec("venv") is None or importlib.util.find_spec("ensurepip") is None:
        pytest.skip("no venv/ensurepip (Debian: python3-venv)")
    prefix = tmp_path / "prefix"
    for part in ("host", os.path.join("bindings", "python")):
        r = subprocess.run([cmake, "--install", os.path.join(build, part), "--prefix", str(prefix)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
    pkg = prefix / "share" / "loom" / "python"
    assert (pkg / "loom" / "_install.json").is_file()

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True, capture_output=True, timeout=300)
    env = {k: v for k, v in os.environ.items()
           if k not in ("LOOM_LIBRARY", "PYTHONPATH", "LOOM_LIBDIR")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    r = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--no-index", "-q",
                        str(pkg)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([str(venv / "bin" / "python"), "-c",
                        "import loom; print(loom.library_path(), loom.version())"],
                       env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    found, version = r.stdout.split()
    assert found == str(prefix / "lib" / "libloom.so.0") and version == loom.version()
    # The package also runs straight from the prefix, without installing.
    r = subprocess.run([sys.executable, "-c", "import loom; print(loom.library_path())"],
                       env=dict(env, PYTHONPATH=str(pkg)), cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == str(prefix / "lib" / "libloom.so.0"), \
        r.stderr
