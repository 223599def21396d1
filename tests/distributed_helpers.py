"""`mlx.launch` from the tests, shared by tests/test_distributed.py and tests/test_tensor_parallel.py (no test module
imports another)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
LAUNCH = shutil.which("mlx.launch") or str(Path(sys.executable).parent / "mlx.launch")
CHEAP = ["--steps", "2", "--no-progress"]


def launch(*argv, timeout=300, port=32323):
    """`mlx.launch --backend ring -n 2` of python *argv; `port`: the ring's first port (mlx.launch's default here;
    each test file that launches uses its own, so that pytest-xdist's workers may run two files at once)."""
    cmd = [LAUNCH, "--backend", "ring", "-n", "2", "--starting-port", str(port), "--", sys.executable, *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.fixture(scope="module")
def launcher():
    if not Path(LAUNCH).exists():
        pytest.fail(f"mlx.launch not found next to {sys.executable} (it ships with mlx)")
    return LAUNCH
