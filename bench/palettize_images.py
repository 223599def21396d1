"""Palettized against affine on images: the embedded default (weights/klein-shapes, a trained model) with its
transformer at p4 / p6 (k-means tables) and at affine 4 / 6 bits, each against the same model's float image, and the
semantic pass rate on its 24 held-out prompts (tests/test_default_model.py's check).

    python bench/palettize_images.py [--steps 20]

Same prompts, seed and noise for every run; float32 compute on this CPU. Prints a markdown table: the largest and
mean difference in levels (of 255) from the float images, and the pass rate (bits per weight of each form:
bench/palettize_quality.py).
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mlxdiff  # noqa: E402
from mlxdiff import default_model  # noqa: E402
from tools.train_klein_shapes import dataset  # noqa: E402

SETTINGS = [None, "p6", 6, "p4", 4]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    prompts = dataset.held_out_prompts()
    texts = [p for p, _, _ in prompts]
    folder = str(default_model.FOLDER)
    rows, reference = [], None
    for setting in SETTINGS:
        t = time.perf_counter()
        pipe = mlxdiff.load(folder, quantize=None if setting is None else {"transformer": setting})
        result = pipe.generate(texts, steps=a.steps, guidance=4.0, seed=0, progress_bar=False)
        images = np.stack([np.asarray(im).astype(np.int16) for im in result.images])
        rate = dataset.pass_rate(result.images, prompts)[0]
        if reference is None:
            reference = images
        diff = np.abs(images - reference)
        rows.append((f"affine {setting}" if isinstance(setting, int) else setting or "bf16 (float)", int(diff.max()), float(diff.mean()), rate, time.perf_counter() - t))
        print(f"{rows[-1]}", flush=True)
    print(f"\n**The embedded default, {len(texts)} held-out prompts, {a.steps} steps, transformer quantized**\n")
    print("| transformer | largest difference from float (levels) | mean difference | semantic pass rate |")
    print("|---|---:|---:|---:|")
    for name, worst, mean, rate, _ in rows:
        print(f"| {name} | {worst} | {mean:.2f} | {rate:.1%} |")


if __name__ == "__main__":
    main()
