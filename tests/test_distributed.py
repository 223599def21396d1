"""Several processes, one job (mlxdiff/distributed.py): `mlx.launch --backend ring -n 2` on localhost, this CPU.

- a data-parallel job (three seeds over two ranks): each image equal, pixel for pixel, to the single process's;
- ranks started with different arguments: refused on every rank in one line (exit 2), nothing written;
- a rank that dies: the job ends on every rank at once (mlx.launch ends the others), no hang.
(mlx.launch exits 0 whatever its ranks do and reports each rank's exit code: the tests read those lines.)
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import PIL.Image
import pytest

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = shutil.which("mlx.launch") or str(Path(sys.executable).parent / "mlx.launch")
CHEAP = ["--steps", "2", "--no-progress"]
WRAPPER = """import os, runpy, sys
rank = int(os.environ.get("MLX_RANK", "0"))
{body}
sys.argv = ["generate"] + sys.argv[1:]
runpy.run_module("mlxdiff.generate", run_name="__main__", alter_sys=True)
"""


def launch(*argv, timeout=300):
    cmd = [LAUNCH, "--backend", "ring", "-n", "2", "--", sys.executable, *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def wrapper(tmp_path, name, body) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(WRAPPER.format(body=body))
    return str(path)


@pytest.fixture(scope="module")
def launcher():
    if not Path(LAUNCH).exists():
        pytest.fail(f"mlx.launch not found next to {sys.executable} (it ships with mlx)")
    return LAUNCH


def test_data_parallel_images_equal_the_single_process(launcher, tmp_path):
    (tmp_path / "single").mkdir()
    (tmp_path / "ranks").mkdir()
    seeds = ["--seed", "1", "2", "3"]
    single = subprocess.run([sys.executable, "-m", "mlxdiff.generate", *CHEAP, *seeds, "--output",
                             str(tmp_path / "single" / "x.png")], capture_output=True, text=True, timeout=300,
                            cwd=ROOT)
    assert single.returncode == 0, single.stderr[-2000:]
    ranks = launch("-m", "mlxdiff.generate", *CHEAP, *seeds, "--output", str(tmp_path / "ranks" / "x.png"))
    assert ranks.returncode == 0, ranks.stdout[-2000:] + ranks.stderr[-2000:]
    assert "rank 0 of 2: images 1, 3 of 3" in ranks.stdout and "rank 1 of 2: images 2 of 3" in ranks.stdout
    for i in range(3):
        a, b = (np.array(PIL.Image.open(tmp_path / d / f"x-{i}.png")) for d in ("single", "ranks"))
        assert np.array_equal(a, b), i


def test_ranks_with_different_arguments_are_refused(launcher, tmp_path):
    script = wrapper(tmp_path, "mismatch", 'sys.argv += ["--seed", str(5 + rank)]')
    p = launch(script, *CHEAP, "--output", str(tmp_path / "m.png"))
    out = p.stdout + p.stderr
    errors = [line for line in out.splitlines() if line.startswith("mlxdiff: error:")]
    # mlx.launch itself exits 0; it reports each rank's exit code
    assert len(errors) == 2 and all(f"rank {r} exited with code 2" in out for r in (0, 1)), out[-2000:]
    assert all("started with different arguments" in e for e in errors)
    assert "Traceback" not in p.stdout + p.stderr
    assert not list(tmp_path.glob("m*.png"))


def test_a_rank_that_dies_ends_the_job(launcher, tmp_path):
    script = wrapper(tmp_path, "dies", 'if rank == 1:\n    os._exit(3)')
    p = launch(script, *CHEAP, "--output", str(tmp_path / "k.png"), timeout=120)   # a hang fails on the timeout
    out = p.stdout + p.stderr
    assert "rank 1 exited with code 3" in out and "rank 0 exited with code" in out, out[-2000:]
    assert "Traceback" not in out and not list(tmp_path.glob("k*.png"))
