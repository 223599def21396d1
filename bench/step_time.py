"""Seconds per denoising step of a pipeline with its components kept (no load in the timed image), one process.

    python bench/step_time.py FOLDER [--size 1024] [--steps 8]     # MLXDIFF_CACHE_LIMIT=0: MLX's own cache

A warm-up image (MLX compiles its CUDA kernels on first use), then an image of --steps whose denoise phase, divided
by the steps, is the figure; prints one RESULT json line (with the MLX cache limit the run had).
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("folder")
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--steps", type=int, default=8)
    a = p.parse_args()
    import mlxdiff
    pipe = mlxdiff.load(a.folder, keep="all")
    kw = dict(width=a.size, height=a.size, progress_bar=False)
    pipe.generate("a photo of a fox in the snow", steps=2, seed=0, **kw)
    result = pipe.generate("a photo of a fox in the snow", steps=a.steps, seed=1, **kw)
    row = {"folder": a.folder, "step_s": result.timings["denoise"] / a.steps, "reused": result.reused,
           "notes": result.notes}
    print("RESULT" + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
