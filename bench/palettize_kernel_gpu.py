"""The palettized decode on CUDA (formats/quantized._DECODE_SOURCE) against the MLX-ops reference path, on the lent
GPU: exactness for every form, then the time of a layer.

    python bench/palettize_kernel_gpu.py [--repeat 20] [--part exactness|timing|both]

1. Exactness: for nbits 1, 2, 3, 4, 6, 8; one table, a table per 16 rows, with and without a per-row scale;
   tables in bfloat16, float16 and float32; a column count that leaves a part-filled last unit; a row slice that
   starts inside the weight (its tables found from the row offset): the kernel's output equals the MLX ops'
   (policy cuda_kernels off) bit for bit. Any difference ends the script with exit 1.
2. Time per call (ms, after a warm-up call, mx.eval each), bfloat16: the decode alone and decode + matmul, kernel
   and MLX ops, for p4 and p6 beside bf16 matmul, affine 4-bit g64 quantized_matmul and mlxdiff's affine
   dequantize + matmul, at SDXL's feed-forward (10240x1280, 4096 tokens) and FLUX.2-dev's widest layer
   (55296x6144, 4608 tokens; the matmul strategy mlxdiff uses on CUDA for affine, bench/RESULTS.md).
"""

import argparse
import sys
import time
from pathlib import Path
from dataclasses import replace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mlxdiff  # noqa: F401  (before mlx)
import mlx.core as mx
import mlx.nn as nn

from mlxdiff.formats import palettized as P
from mlxdiff.formats import quantized as Q
from mlxdiff.policy import RunPolicy, cuda_kernels, installed


def kernel(on: bool):
    return installed(replace(RunPolicy(), cuda_kernels=on))


def exactness() -> int:
    rng = np.random.default_rng(0)
    bad = checked = 0
    for nbits in (1, 2, 3, 4, 6, 8):
        for dtype in (mx.bfloat16, mx.float16, mx.float32):
            for groups, scaled in ((1, False), (4, False), (4, True)):
                rows, cols = 64, 1283
                idx = rng.integers(0, 1 << nbits, (rows, cols)).astype(np.uint16)
                lut = mx.array(rng.standard_normal((groups, 1 << nbits)).astype(np.float32)).astype(dtype)
                scale = mx.array(rng.uniform(0.5, 2, rows).astype(np.float32)).astype(dtype) if scaled else None
                pw = P.palettized(idx, lut, scale)
                layer = P.PalettizedLinear.of(pw)
                for view in (layer, Q.linear_rows(layer, 16, 48)):
                    got = {}
                    for on in (True, False):
                        with kernel(on):
                            assert cuda_kernels() == on
                            got[on] = view.dense_weight()
                            mx.eval(got[on])
                    same = got[True].dtype == got[False].dtype and bool(mx.array_equal(got[True], got[False]))
                    checked += 1
                    if not same:
                        bad += 1
                        print(f"DIFFERENT: p{nbits} {dtype} groups={groups} scale={scaled} rows "
                              f"{view.row_offset}..: max {float(mx.abs(got[True] - got[False]).max())}")
    print(f"exactness: {checked} cases, {bad} different (kernel vs MLX ops, bit for bit)")
    return bad


def per_call(fn, repeat):
    mx.eval(fn())
    mx.synchronize()
    t = time.perf_counter()
    for _ in range(repeat):
        mx.eval(fn())
    mx.synchronize()
    return (time.perf_counter() - t) / repeat * 1e3


def timing(out_dims, in_dims, tokens, repeat):
    from mlxdiff.loading.matmul import to_dequantized
    rng = np.random.default_rng(1)
    dtype = mx.bfloat16
    w = mx.array((rng.laplace(size=(out_dims, in_dims)) * 0.02).astype(np.float32)).astype(dtype)
    x = mx.array(rng.standard_normal((1, tokens, in_dims)).astype(np.float32)).astype(dtype)
    dense = nn.Linear(in_dims, out_dims, bias=False)
    dense.weight = w
    affine = nn.QuantizedLinear.from_linear(dense, group_size=64, bits=4)
    rows = [("bf16 matmul", per_call(lambda: dense(x), repeat)),
            ("affine 4 g64 quantized_matmul", per_call(lambda: affine(x), repeat)),
            ("affine 4 g64 dequantize + matmul", per_call(lambda: to_dequantized(affine, dtype)(x), repeat))]
    for nbits in (4, 6):
        pw = P.palettize(w, nbits)
        layer = P.PalettizedLinear.of(pw, compute_dtype=dtype)
        mx.eval(layer.parameters())
        for on in (True, False):
            with kernel(on):
                name = "kernel" if on else "MLX ops"
                rows.append((f"p{nbits} decode alone ({name})", per_call(layer.dense_weight, repeat)))
                rows.append((f"p{nbits} decode + matmul ({name})", per_call(lambda: layer(x), repeat)))
        del pw, layer
    print(f"\n| layer {out_dims}x{in_dims}, {tokens} tokens, bfloat16, {mx.default_device()} | ms per call |\n|---|---:|")
    for name, ms in rows:
        print(f"| {name} | {ms:.2f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--part", choices=("exactness", "timing", "both"), default="both")
    a = ap.parse_args()
    if mx.default_device() != mx.gpu or not (getattr(mx, "cuda", None) and mx.cuda.is_available()):
        print("this bench needs MLX's CUDA backend (the lent GPU)")
        return 2
    bad = exactness() if a.part != "timing" else 0
    if a.part != "exactness":
        for shape in ((10240, 1280, 4096), (1280, 1280, 4096), (55296, 6144, 4608)):
            timing(*shape, repeat=a.repeat)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
