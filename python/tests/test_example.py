"""The example stays runnable: prefill and decode processes over shm."""
import os
import subprocess
import sys

from conftest import HERE

EXAMPLE = os.path.join(HERE, "..", "examples", "disaggregated.py")


def test_example_runs_and_checks_every_page():
    r = subprocess.run([sys.executable, EXAMPLE, "--engine", "shm", "--tokens", "300",
                        "--cached", "70"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "pulled tokens [70, 300) of request 1" in r.stdout
    assert "every page checked" in r.stdout
