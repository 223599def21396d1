"""`mlx.launch` from the tests, shared by tests/test_distributed.py and tests/test_tensor_parallel.py (no test module
imports another)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
CHEAP = ["--steps", "2", "--no-progress"]

# mlx.launch itself (its main()), less its busy wait: each rank's output thread asks select() for the rank's stdin
# pipe to be writable on every turn, which it always is, and the main loop polls a stdin at end of file, so the
# launcher spun about one core for as long as its ranks ran (4 cpu s of 5.7 s of sleeping ranks). The tests write
# nothing to the ranks' stdin: the launcher's stdin is a pipe nobody writes, and its select() leaves out writers.
LAUNCHER = """import os, sys
from select import select
import mlx._distributed_utils.launch as launch
never_written, _write_end = os.pipe()
os.dup2(never_written, 0)
launch.select = lambda readers, writers, errors, timeout: (select(readers, [], errors, timeout)[0], [], [])
sys.argv[0] = "mlx.launch"
sys.exit(launch.main())
"""


def launch(*argv, timeout=300, port=32323):
    """`mlx.launch --backend ring -n 2` of python *argv; `port`: the ring's first port (mlx.launch's default here;
    each test file that launches uses its own, so that pytest-xdist's workers may run two files at once)."""
    cmd = [sys.executable, "-c", LAUNCHER, "--backend", "ring", "-n", "2", "--starting-port", str(port), "--",
           sys.executable, *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.fixture(scope="module")
def launcher():
    """What launch() runs: mlx.launch's module, with the main() and module-level select LAUNCHER replaces (an mlx
    that renames them fails here, by name, rather than in every rank)."""
    import importlib
    try:
        module = importlib.import_module("mlx._distributed_utils.launch")
    except ImportError as e:
        pytest.fail(f"mlx.launch's module is not importable ({e}); it ships with mlx")
    missing = [name for name in ("main", "select") if not hasattr(module, name)]
    if missing:
        pytest.fail(f"mlx._distributed_utils.launch has no {', '.join(missing)}: tests/distributed_helpers.LAUNCHER "
                    "needs updating for this mlx")
    return module
