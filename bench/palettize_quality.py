"""Palettized (k-means tables, formats/palettized.py) vs MLX affine weights: reconstruction error at the bits per
weight each really holds (indices or codes, tables or scales and biases, all counted), and the CPU time of a
palettized layer's decode-then-matmul beside affine's quantized_matmul.

    python bench/palettize_quality.py [--quick]

Weights: float16 (as checkpoints hold them) random ones at real-config sizes (SDXL's attention 1280x1280 and
feed-forward 10240x1280, Laplace and Gaussian), and the trained Linear weights of the embedded default
(weights/klein-shapes' transformer, every 2-D weight). Error: mean squared error over the weights' mean square (a
relative MSE; lower is better). Prints markdown tables.
"""

import argparse
import time

import numpy as np

import mlxdiff  # noqa: F401  (before mlx)
import mlx.core as mx
import mlx.nn as nn

from mlxdiff import default_model
from mlxdiff.formats import palettized as P

PALETTES = [(2, None), (3, None), (4, None), (4, 64), (6, None), (6, 64), (8, None)]
AFFINE = [(3, 64), (3, 32), (4, 128), (4, 64), (5, 32), (6, 64), (8, 64)]


def relative_mse(d, w):
    w32 = w.astype(mx.float32)
    return float(mx.sum((d.astype(mx.float32) - w32) ** 2) / mx.sum(w32 ** 2))


def measure(weights: list) -> list:
    """[(form, bits per weight, relative MSE)] summed over `weights` (float16 arrays, rows first)."""
    n = sum(w.size for w in weights)
    rows = []
    for nbits, group in PALETTES:
        err, nbytes = 0.0, 0
        for w in weights:
            if group and w.shape[0] % group:
                break
            pw = P.palettize(w, nbits, group)
            mx.eval(pw.packed, pw.lut)
            err += relative_mse(pw.dequantize(), w) * w.size
            nbytes += pw.nbytes
        else:
            rows.append((f"p{nbits}" + (f":g{group}" if group else ""), nbytes * 8 / n, err / n))
    for bits, group in AFFINE:
        err, nbytes = 0.0, 0
        for w in weights:
            if w.shape[1] % group:
                break
            q = mx.quantize(w, group_size=group, bits=bits)
            err += relative_mse(mx.dequantize(*q, group_size=group, bits=bits), w) * w.size
            nbytes += sum(a.nbytes for a in q)
        else:
            rows.append((f"affine {bits} g{group}", nbytes * 8 / n, err / n))
    return sorted(rows, key=lambda r: r[1])


def table(title, rows):
    print(f"\n**{title}**\n\n| form | bits/weight | relative MSE |\n|---|---:|---:|")
    for form, bpw, err in rows:
        print(f"| {form} | {bpw:.3f} | {err:.3e} |")


def trained_weights() -> list:
    from mlxdiff.formats.safetensors import load_safetensors
    path = default_model.folder() / "transformer" / "diffusion_pytorch_model.safetensors"
    arrays = load_safetensors(path)
    return [a.astype(mx.float16) for k, a in sorted(arrays.items())
            if a.ndim == 2 and k.endswith(".weight") and min(a.shape) >= 64 and a.shape[1] % 64 == 0]


def timing(out_dims, in_dims, tokens, repeat, dtype=mx.float32):
    """ms per call: dense matmul, affine 4-bit g64 (quantized_matmul, and mlxdiff's dequantize strategy),
    palettized p4 and p6 (decode + matmul)."""
    rng = np.random.default_rng(0)
    w = mx.array((rng.laplace(size=(out_dims, in_dims)) * 0.02).astype(np.float32)).astype(dtype)
    x = mx.array(rng.standard_normal((1, tokens, in_dims)).astype(np.float32)).astype(dtype)
    dense = nn.Linear(in_dims, out_dims, bias=False)
    dense.weight = w
    affine = nn.QuantizedLinear.from_linear(dense, group_size=64, bits=4)
    from mlxdiff.loading.matmul import to_dequantized
    layers = {"dense": dense, "affine 4 g64 (qmm)": affine,
              "affine 4 g64 (dequantize + matmul)": to_dequantized(affine, dtype)}
    for nbits in (4, 6):
        pw = P.palettize(w, nbits)
        mx.eval(pw.packed, pw.lut)
        layers[f"p{nbits} (decode + matmul)"] = P.PalettizedLinear.of(pw)
    out = []
    for name, layer in layers.items():
        mx.eval(layer(x))
        t = time.perf_counter()
        for _ in range(repeat):
            mx.eval(layer(x))
        out.append((name, (time.perf_counter() - t) / repeat * 1e3))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller random weights, fewer repeats")
    ap.add_argument("--timing-only", nargs=3, type=int, metavar=("OUT", "IN", "TOKENS"),
                    help="only the layer timing, at this shape, in the backend's compute dtype (GPU: bfloat16)")
    a = ap.parse_args()
    if a.timing_only:
        from mlxdiff.backend import compute_dtype
        dtype = compute_dtype(None)
        print(f"| layer {a.timing_only[0]}x{a.timing_only[1]}, {a.timing_only[2]} tokens, {dtype}, "
              f"{mx.default_device()} | ms per call |\n|---|---:|")
        for name, ms in timing(*a.timing_only, repeat=20, dtype=dtype):
            print(f"| {name} | {ms:.2f} |")
        return
    rng = np.random.default_rng(0)
    sizes = [(1280, 1280), (10240, 1280)] if not a.quick else [(640, 640)]
    for name, draw in (("Laplace", rng.laplace), ("Gaussian", rng.standard_normal)):
        ws = [mx.array((draw(size=s) * 0.02).astype(np.float16)) for s in sizes]
        table(f"random {name} float16 weights, " + " + ".join(f"{r}x{c}" for r, c in sizes), measure(ws))
    trained = trained_weights()
    table(f"trained: the embedded default's transformer, {len(trained)} Linear weights, "
          f"{sum(w.size for w in trained) / 1e6:.2f} M values", measure(trained))
    shape = (1280, 1280, 1024) if not a.quick else (640, 640, 256)
    print(f"\n**CPU time of one layer, {shape[0]}x{shape[1]}, {shape[2]} tokens, float32 compute "
          f"({mx.default_device()})**\n\n| layer | ms per call |\n|---|---:|")
    for name, ms in timing(*shape, repeat=3 if a.quick else 10):
        print(f"| {name} | {ms:.1f} |")


if __name__ == "__main__":
    main()
