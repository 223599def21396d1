"""How robust the embedded default model's semantic pass rate is: the 24 held-out prompts of
tests/test_default_model.py through mlxdiff at several seeds and step counts (the test runs seed 0, 20 steps).

    python bench/klein_shapes_semantic.py [--seeds 0 1 2 3] [--steps 20 50]
"""

import argparse
from pathlib import Path
import sys
import platform

import mlxdiff  # first: it loads OpenBLAS before mlx.core
from mlxdiff import default_model
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tools/
from tools.train_klein_shapes import dataset  # noqa: E402

import mlx.core as mx  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--steps", type=int, nargs="+", default=[20, 50])
    args = p.parse_args(argv)
    prompts = dataset.held_out_prompts()
    pipe = mlxdiff.load(str(default_model.FOLDER))
    print(f"# {default_model.FOLDER.name}, {len(prompts)} held-out prompts, guidance 4; "
          f"{platform.machine()}, MLX {mx.__version__} on {mx.default_device()}")
    print("| steps | seed | pass rate | failed |\n|---|---|---|---|")
    for steps in args.steps:
        for seed in args.seeds:
            images = pipe.generate([t for t, _, _ in prompts], steps=steps, guidance=4.0, seed=seed,
                                   progress_bar=False).images
            rate, results = dataset.pass_rate(images, prompts)
            failed = [t for (t, _, _), ok in zip(prompts, results) if not ok]
            print(f"| {steps} | {seed} | {rate:.1%} ({sum(results)}/{len(results)}) | {'; '.join(failed) or '-'} |")


if __name__ == "__main__":
    main()
