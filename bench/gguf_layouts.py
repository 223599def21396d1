"""GGUF layouts per type on this backend: bytes per weight in memory against the file, and the time of one layer's
forward at prompt-like sizes, for the affine repack (through the backend's default strategy, and MLX's
quantized_matmul) and the raw blocks decoded per layer. Prints one RESULT json per (type, layout).

    python bench/gguf_layouts.py [--out 18432 --in 6144 --tokens 4608] [--dtype bfloat16]
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import numpy as np  # noqa: E402

import mlxdiff  # noqa: E402,F401  (OpenBLAS preload before mlx)
import mlx.core as mx  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf_helpers import random_blocks, write_gguf  # noqa: E402
from mlxdiff.formats.gguf import RawLinear, load_gguf  # noqa: E402
from mlxdiff.loading.matmul import DequantizedLinear  # noqa: E402

TYPES = (T.Q4_0, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)


def timed(layer, x, reps=3):
    mx.eval(layer(x))
    mx.synchronize()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    t = time.perf_counter()
    for _ in range(reps):
        mx.eval(layer(x))
    mx.synchronize()
    return (time.perf_counter() - t) / reps * 1000, (mx.get_peak_memory() - base) / 2**20


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=int, default=18432)
    p.add_argument("--in", dest="inp", type=int, default=6144)
    p.add_argument("--tokens", type=int, default=4608)
    p.add_argument("--dtype", default=None)
    args = p.parse_args()
    dtype = mlxdiff.backend.compute_dtype(args.dtype)
    rng = np.random.default_rng(0)
    x = mx.random.normal((1, args.tokens, args.inp)).astype(dtype)
    with tempfile.TemporaryDirectory() as tmp:
        for t in TYPES:
            raw = random_blocks(t, args.out, args.inp, rng, scale=1e-3)
            path = write_gguf(Path(tmp) / "w.gguf", {"w.weight": (t, raw)})
            n = args.out * args.inp
            for layout in ("affine", "raw"):
                q = load_gguf(path, dtype, layout=layout)["w.weight"]
                out = {"type": t.name, "layout": layout, "device": str(mx.default_device()), "dtype": str(dtype),
                       "shape": [args.out, args.inp], "tokens": args.tokens,
                       "file_bpw": raw.nbytes * 8 / n, "memory_bpw": q.nbytes * 8 / n}
                if layout == "affine":
                    layer = DequantizedLinear(q.weight, q.scales, q.biases, None, q.group_size, q.bits,
                                              compute_dtype=dtype)
                    out["dequantize_ms"], out["dequantize_peak_mb"] = timed(layer, x)
                    qmm = lambda v: mx.quantized_matmul(v, q.weight, q.scales, q.biases, transpose=True,  # noqa
                                                        group_size=q.group_size, bits=q.bits)
                    out["qmm_ms"], out["qmm_peak_mb"] = timed(qmm, x)
                else:
                    layer = RawLinear(args.inp, args.out, t.name, compute_dtype=dtype)
                    layer.weight = q.blocks
                    out["raw_ms"], out["raw_peak_mb"] = timed(layer, x)
                print("RESULT" + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
