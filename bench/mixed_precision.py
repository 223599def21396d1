"""float16-mixed against float32, bfloat16 and float16 (issue 29): accuracy of the embedded default's images and
the transformer forward's time, on this CPU or the GPU (MLXDIFF_DEVICE / the machine's default device).

    python bench/mixed_precision.py images [--steps 20]      # the embedded default (trained), its default size
    python bench/mixed_precision.py forward [--model klein-4b|sd3.5-medium]   # one forward per dtype (GPU)

`images`: one prompt, same seed, each dtype in turn (a warm-up image first, then the timed one): the image's mean
and max difference from float32's in levels, the latents' max relative error, seconds per image. `forward`: the
real-config transformer (random weights, bench/step_kernels_gpu.build) at 1024x1024, median of 5 forwards per dtype,
and each output's max relative error against the float32 forward. Prints RESULT json lines (bench/RESULTS.md,
"float16-mixed").
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import mlxdiff  # noqa: E402  (before mlx)
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

DTYPES = ("float32", "bfloat16", "float16", "float16-mixed")
PROMPT = "a large red circle on the left and a large blue square on the right on a white background"


def images(steps):
    from mlxdiff import default_model
    ref = None
    for name in DTYPES:
        pipe = mlxdiff.load(str(default_model.FOLDER), dtype=name, keep="auto")
        pipe.generate(PROMPT, steps=steps, seed=1, progress_bar=False)          # warm-up, loads what it keeps
        t = time.perf_counter()
        r = pipe.generate(PROMPT, steps=steps, seed=0, progress_bar=False)
        seconds = time.perf_counter() - t
        img, lat = np.asarray(r.images[0], dtype=np.int16), np.asarray(r.latents, dtype=np.float64)
        if ref is None:
            ref = (img, lat)
        d = np.abs(img - ref[0])
        print("RESULT" + json.dumps({"part": "images", "dtype": name, "steps": steps, "seconds": round(seconds, 2),
                                     "mean_levels": round(float(d.mean()), 3), "max_levels": int(d.max()),
                                     "latents_max_rel": float(np.abs(lat - ref[1]).max() / np.abs(ref[1]).max()),
                                     "finite": bool(np.isfinite(lat).all()),
                                     "device": str(mx.default_device())}), flush=True)


def forward(model_name):
    import step_kernels_gpu as sk
    from mlxdiff import memory
    from mlxdiff.pacing import settle
    from mlxdiff.pipelines.base import evaluate_each_block
    from mlxdiff.policy import RunPolicy, installed
    model = sk.build(model_name)                     # bf16 weights
    master = {k: v for k, v in nn.utils.tree_flatten(model.parameters())}
    ref = None
    for name in DTYPES:
        dtype = mlxdiff.backend.compute_dtype(name)
        stream = mlxdiff.backend.stream_dtype(name)
        model.update(nn.utils.tree_unflatten([(k, v.astype(dtype)) for k, v in master.items()]))
        model.compute_dtype = dtype
        mx.eval(model.parameters())
        policy = RunPolicy(in_flight=2, compile_blocks=memory.compile_blocks_for(model, 2))
        if model_name == "sd3.5-medium":
            x, ctx, pooled = sk.rand((2, 16, 128, 128)), sk.rand((2, sk.TXT_SD3, 4096)), sk.rand((2, 2048))
            call = lambda: model(x, ctx, pooled, mx.array([500.0, 500.0]), after_block=evaluate_each_block,  # noqa
                                 stream_dtype=stream)
        else:
            img, img_ids, txt_ids = sk.flux_inputs()
            img, txt = mx.array(img), sk.rand((1, sk.TXT_FLUX, model.args.joint_attention_dim), scale=0.5)
            call = lambda: model(img, txt, mx.array([0.5]), img_ids, txt_ids, after_block=evaluate_each_block,  # noqa
                                 stream_dtype=stream)
        times = []
        for i in range(7):
            t = time.perf_counter()
            with installed(policy):
                y = call()
                mx.eval(y)
                settle()
            mx.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - t)
        y = np.array(y.astype(mx.float32), dtype=np.float64)
        if ref is None:
            ref = y
        print("RESULT" + json.dumps({"part": "forward", "model": model_name, "dtype": name,
                                     "seconds": round(statistics.median(times), 5),
                                     "max_rel_vs_float32": float(np.abs(y - ref).max() / np.abs(ref).max()),
                                     "finite": bool(np.isfinite(y).all()), "device": str(mx.default_device())}),
              flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("part", choices=("images", "forward"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--model", default="klein-4b", choices=("klein-4b", "sd3.5-medium"))
    a = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    images(a.steps) if a.part == "images" else forward(a.model)
