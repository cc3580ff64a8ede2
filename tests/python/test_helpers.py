"""The suite's own helpers: run_together kills what it started when it times out."""
import os
import sys
import time

import pytest

from conftest import run_together

SCRIPT = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
print("to stderr", file=sys.stderr, flush=True)
time.sleep(60)
"""


def test_run_together_keeps_stdout_and_stderr_apart():
    (rc, out, err), = run_together([([sys.executable, "-c",
                                      "import sys; print('out'); print('err', file=sys.stderr)"],
                                     dict(os.environ))], 60, "the printer")
    assert (rc, out, err) == (0, "out\n", "err\n")


def test_run_together_kills_the_whole_group_on_timeout():
    with pytest.raises(pytest.fail.Exception) as e:
        run_together([([sys.executable, "-c", SCRIPT], dict(os.environ))], 3, "the sleeper")
    text = str(e.value)
    assert "the sleeper did not finish in 3 s" in text
    assert "to stderr" in text  # the partial output is in the failure
    grandchild = int(text.split("stdout:\n", 1)[1].split()[0])
    for _ in range(50):  # SIGKILL reached the grandchild too (reaped by init)
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"process {grandchild} outlived the timeout")
