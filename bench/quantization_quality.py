"""The quality cost of each quantization setting: one transformer forward, quantized vs unquantized, same inputs.

    python bench/quantization_quality.py [--model weights/bench-sd3.5-medium-random] [--size 256]

Reports max |a-b| / max |b| and relative RMS of the velocity prediction, per bits and group size, at the real
SD3.5 Medium config (random bf16 weights: the figures measure rounding, not image quality).
"""

import argparse
import json
import time
from pathlib import Path

import numpy as np

import mlxdiff
import mlx.core as mx
from mlxdiff.loading import sources
from mlxdiff.loading.matmul import use_strategy
from mlxdiff.pipelines.base import evaluate_each_block
from mlxdiff.loading.quantize import materialize
from mlxdiff.models import mmdit
from mlxdiff.pacing import settle
from mlxdiff.policy import from_switches, installed

ROOT = Path(__file__).resolve().parent.parent


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "weights" / "bench-sd3.5-medium-random"))
    ap.add_argument("--size", type=int, default=256)
    a = ap.parse_args()
    folder = Path(a.model) / "transformer"
    config = json.loads((folder / "config.json").read_text())
    rng = np.random.default_rng(0)
    lat = mx.array(rng.standard_normal((1, 16, a.size // 8, a.size // 8)).astype(np.float32))
    ctx = mx.array(rng.standard_normal((1, 333, 4096)).astype(np.float32))
    pooled = mx.array(rng.standard_normal((1, 2048)).astype(np.float32))
    t = mx.array([500.0])
    policy = from_switches()    # as a run's phases (MLXDIFF_* switches applied)

    def run(quantize):
        spec = sources.ComponentSpec("transformer", mmdit, config, sources.st.safetensors_files(folder),
                                     quantize=quantize)
        model = spec.build()
        use_strategy(model, "dequantize")
        materialize(model)
        start = time.perf_counter()
        with installed(policy):
            out = model(lat, ctx, pooled, t, after_block=evaluate_each_block)
            mx.eval(out)
            settle()
        seconds = time.perf_counter() - start
        result = np.array(out), mx.get_active_memory(), seconds
        model.clear()
        mx.clear_cache()
        return result

    ref, ref_bytes, ref_s = run(None)
    print(f"SD3.5 Medium transformer, random bf16 weights, {a.size}x{a.size}, one forward, float32 compute, "
          f"mlx {mx.__version__} {mx.default_device()}\n")
    print("| setting | weights GB | max rel err | rel RMS |\n|---|---|---|---|")
    print(f"| bf16 (reference) | {ref_bytes / 1e9:.2f} | 0 | 0 |")
    for bits, group in ((8, 64), (6, 64), (5, 64), (4, 64), (4, 32), (3, 64)):
        out, nbytes, _ = run({"bits": bits, "group_size": group})
        err = np.abs(out - ref).max() / np.abs(ref).max()
        rms = np.sqrt(((out - ref) ** 2).mean() / (ref ** 2).mean())
        print(f"| {bits}-bit g{group} | {nbytes / 1e9:.2f} | {err:.2e} | {rms:.2e} |", flush=True)


if __name__ == "__main__":
    main()
