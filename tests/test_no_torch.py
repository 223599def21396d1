"""Issue 44 item 7: no mlxdiff run imports torch, with transformers and torch installed beside it (as here). mlx-lm's
model files are read without its package's __init__ (models/mlx_lm_models.py), tokenizers by the class their folder
names (tokenizers.tokenizer_class), so the CLI's first image pays for neither (bench/RESULTS.md, "The first image
per process")."""

import subprocess
import sys

import torch  # noqa: F401  (the reference extra: torch is installed, so its absence below is mlxdiff's doing)

CHECK = """
import runpy, sys
sys.argv = ["mlxdiff.generate", "--output", sys.argv[1], "--steps", "1", "--no-progress"]
try:
    runpy.run_module("mlxdiff.generate", run_name="__main__")
except SystemExit as e:
    assert not e.code, e.code
print(sorted(m for m in ("torch", "mlx_lm", "diffusers") if m in sys.modules))
"""


def test_cli_generate_imports_no_torch(tmp_path):
    out = tmp_path / "out.png"
    run = subprocess.run([sys.executable, "-c", CHECK, str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert out.is_file()
    assert run.stdout.strip().splitlines()[-1] == "[]", run.stdout


def test_mlx_lm_model_files_are_mlx_lms_own():
    """The private package runs mlx-lm's files as installed (no copy): the same source, the real mlx_lm untouched."""
    import inspect
    import importlib.util
    from pathlib import Path
    from mlxdiff.models import mlx_lm_models
    folder = Path(list(importlib.util.find_spec("mlx_lm").submodule_search_locations)[0]) / "models"
    for name in ("llama", "qwen2", "qwen3", "base"):
        module = getattr(mlx_lm_models, name)
        assert Path(inspect.getfile(module)) == folder / f"{name}.py"
    assert "mlx_lm" not in sys.modules or sys.modules["mlx_lm"].__name__ == "mlx_lm"
